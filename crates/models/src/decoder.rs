//! The tensor-parallel decoder graph of a config (see the crate documentation for the
//! layer structure of each family).

use crate::builder::{Ctx, NormOut, Operand};
use crate::config::{BlockMixer, EmbedScale, LayerKind, ModelSpec};
use crate::error::{BuildError, Result};
use crate::options::BuildOptions;
use arfuse_ir::{DType, Dim, Graph, InputKind, Op, TensorType, Value};
use serde_json::json;

/// Rows of each rank's shard of a vocab-parallel embedding: the vocabulary padded to
/// a multiple of 64 (vLLM's `DEFAULT_VOCAB_PADDING_SIZE`), split over `tp`, rounded up.
pub fn vocab_rows_per_rank(vocab: u64, tp: u32) -> u64 {
    vocab
        .div_ceil(64)
        .saturating_mul(64)
        .div_ceil(u64::from(tp.max(1)))
}

/// The per-rank partial output of the vocab-parallel embedding, and the all-reduced,
/// (for Gemma-2) scaled hidden state that enters layer 0.
pub(crate) fn embedding(c: &mut Ctx) -> Result<Value> {
    let spec = c.spec;
    let h = spec.hidden;
    let name = spec.embed_module();
    let module = c.module(name);
    let mut ids_dims: Vec<Dim> = c.act(1).shape.0;
    ids_dims.pop();
    let ids = c.input(
        "input_ids",
        InputKind::Activation,
        TensorType::new(DType::I64, ids_dims),
    )?;
    let rows = vocab_rows_per_rank(spec.vocab, c.opts.tp);
    let table = c.param(&format!("{name}.weight"), spec.dtype, &[rows, h])?;
    let mut x = c.one(name, Op::Embedding, vec![table, ids], c.act(h), &module)?;
    if spec.embed_scale() == EmbedScale::BeforeAllReduce {
        x = scale(c, x, &format!("{name}.embed_scale"), &module)?;
    }
    let ar = c.all_reduce(x, h, &format!("{name}.all_reduce"), &module)?;
    if spec.embed_scale() == EmbedScale::AfterAllReduce {
        let m = c.module("normalizer");
        return scale(c, ar, "normalizer", &m);
    }
    Ok(ar)
}

/// `x * sqrt(hidden_size)` with the scale cast to the activation dtype (HF Gemma).
fn scale(c: &mut Ctx, x: Value, id: &str, module: &str) -> Result<Value> {
    let h = c.spec.hidden;
    let k = c.one(
        format!("{id}.value"),
        Op::Constant {
            value: (h as f64).sqrt(),
        },
        vec![],
        TensorType::new(DType::F32, vec![]),
        module,
    )?;
    let kb = c.one(
        format!("{id}.to_act"),
        Op::ToDtype {
            dtype: c.spec.dtype,
        },
        vec![k],
        TensorType::new(c.spec.dtype, vec![]),
        module,
    )?;
    c.one(id, Op::Mul, vec![x, kb], c.act(h), module)
}

/// Builds the decoder graph.
pub(crate) fn build_decoder(spec: &ModelSpec, opts: &BuildOptions) -> Result<Graph> {
    let mut c = Ctx::new(spec, opts);
    let h = spec.hidden;
    let mut pending = embedding(&mut c)?;
    let mut residual: Option<Value> = None;
    // (id, module) of the residual add that ends the previous layer.
    let mut prev_add = (String::new(), String::new());
    for (i, kind) in spec.layers.iter().enumerate() {
        let l = format!("layers.{i}");
        let lm = c.module(&l);
        match *kind {
            LayerKind::Decoder { moe } => {
                let in_id = format!("{l}.input_layernorm");
                let (n1, r1) =
                    c.norm_step(pending, residual, &in_id, h, &prev_add.0, &prev_add.1)?;
                let mut no = norm_out(&c, n1, h, &in_id);
                let a = attention(&mut c, i, &mut no)?;
                let a = c.all_reduce(
                    a,
                    h,
                    &format!("{l}.self_attn.o_proj.all_reduce"),
                    &c.module(&format!("{l}.self_attn.o_proj")),
                )?;
                let attn_add = (format!("{l}.attn_residual_add"), lm.clone());
                let (n2, r2, ff_id) = if spec.gemma() {
                    // Sandwich norms: the all-reduce feeds post_attention_layernorm
                    // directly (no residual); the add comes after it.
                    let pa = c.rms_norm(a, &format!("{l}.post_attention_layernorm"), h)?;
                    let ff_id = format!("{l}.pre_feedforward_layernorm");
                    let (n2, r2) = c.add_rms_norm(pa, r1, &ff_id, h, &attn_add.0, &attn_add.1)?;
                    (n2, r2, ff_id)
                } else {
                    let ff_id = format!("{l}.post_attention_layernorm");
                    let (n2, r2) = c.add_rms_norm(a, r1, &ff_id, h, &attn_add.0, &attn_add.1)?;
                    (n2, r2, ff_id)
                };
                let mut no2 = norm_out(&c, n2, h, &ff_id);
                let mlp = spec.mlp_module();
                let m = if moe {
                    moe_block(&mut c, &format!("{l}.{mlp}"), &mut no2)?
                } else {
                    dense_mlp(&mut c, &format!("{l}.{mlp}"), &mut no2)?
                };
                let mm = c.module(&format!("{l}.{mlp}"));
                let m = c.all_reduce(m, h, &format!("{l}.{mlp}.all_reduce"), &mm)?;
                pending = if spec.gemma() {
                    c.rms_norm(m, &format!("{l}.post_feedforward_layernorm"), h)?
                } else {
                    m
                };
                residual = Some(r2);
                prev_add = (format!("{l}.mlp_residual_add"), lm);
            }
            LayerKind::Block(mixer) => {
                let n_id = format!("{l}.norm");
                let (n, r) = c.norm_step(pending, residual, &n_id, h, &prev_add.0, &prev_add.1)?;
                let mut no = norm_out(&c, n, h, &n_id);
                let mx = format!("{l}.mixer");
                let out = match mixer {
                    BlockMixer::Attention => attention_with(&mut c, i, &mut no, &mx)?,
                    BlockMixer::Mamba => mamba(&mut c, &mx, &mut no)?,
                    BlockMixer::Moe => moe_block(&mut c, &mx, &mut no)?,
                    BlockMixer::Mlp => dense_mlp(&mut c, &mx, &mut no)?,
                };
                let mxm = c.module(&mx);
                pending = c.all_reduce(out, h, &format!("{mx}.all_reduce"), &mxm)?;
                residual = Some(r);
                prev_add = (format!("{l}.residual_add"), lm);
            }
        }
    }
    let f = spec.final_norm_module();
    let (y, _) = c.norm_step(pending, residual, f, h, &prev_add.0, &prev_add.1)?;
    let meta = metadata(spec, opts);
    c.finish(vec![y], meta)
}

pub(crate) fn metadata(spec: &ModelSpec, opts: &BuildOptions) -> serde_json::Value {
    json!({
        "builder": "arfuse-models",
        "model_type": spec.model_type,
        "hidden_size": spec.hidden,
        "layers": spec.layers.len(),
        "tp": opts.tp,
        "weights": spec.quant.format.name(),
        "norm_form": opts.norm_form,
        "three_d": opts.three_d,
    })
}

pub(crate) fn norm_out(c: &Ctx, y: Value, k: u64, id: &str) -> NormOut {
    NormOut {
        y,
        k,
        id: id.to_string(),
        module: c.module(id),
        quant: None,
    }
}

fn attention(c: &mut Ctx, layer: usize, no: &mut NormOut) -> Result<Value> {
    let id = format!("layers.{layer}.self_attn");
    attention_with(c, layer, no, &id)
}

/// Attention on the norm output: QKV GEMM, opaque attention, o_proj (per-rank partial
/// `[tokens..., H]`, before the all-reduce). `id` is the attention module (relative).
pub(crate) fn attention_with(
    c: &mut Ctx,
    layer: usize,
    no: &mut NormOut,
    id: &str,
) -> Result<Value> {
    if c.spec.mla.is_some() {
        return mla(c, no, id);
    }
    let spec = c.spec;
    let (h, hd) = (spec.hidden, spec.head_dim);
    let hq = c.shard("num_attention_heads", spec.heads)?;
    let hkv = c.shard_heads("num_key_value_heads", spec.kv_heads)?;
    let m = c.module(id);
    let shards: Vec<String> = ["q_proj", "k_proj", "v_proj"]
        .iter()
        .map(|p| format!("{m}.{p}"))
        .collect();
    let quant = spec.quant.for_modules(&shards)?;
    let op = c.operand_for(no, quant)?;
    let n_qkv = (hq + 2 * hkv) * hd;
    let mut qkv = c.gemm(op, no.k, n_qkv, &format!("{id}.qkv_proj"))?;
    if spec.attn_bias {
        qkv = c.bias(qkv, n_qkv, &format!("{id}.qkv_proj"))?;
    }
    let mut attrs = json!({
        "num_heads": spec.heads,
        "num_kv_heads": spec.kv_heads,
        "head_dim": hd,
        "heads_per_rank": hq,
        "kv_heads_per_rank": hkv,
        "qk_norm": spec.qk_norm,
    });
    if let Some(Some(w)) = spec.sliding.get(layer) {
        attrs["sliding_window"] = json!(w);
    }
    if spec.model_type == "gpt_oss" {
        attrs["sinks"] = json!(true);
    }
    let attn = c.one(
        format!("{id}.attn"),
        Op::Opaque {
            target: "attention".into(),
            attrs,
        },
        vec![qkv],
        c.act(hq * hd),
        &m,
    )?;
    let o_id = format!("{id}.o_proj");
    let mut o = c.linear(attn, hq * hd, h, &o_id, &format!("{m}.o_proj"))?;
    if spec.attn_bias {
        // vLLM's RowParallelLinear adds the bias on rank 0 only, before the all-reduce.
        o = c.bias(o, h, &o_id)?;
    }
    Ok(o)
}

/// Multi-head latent attention: q_a_proj, q_a_layernorm (an RMSNorm that is no fusion
/// site: no all-reduce before it), q_b_proj, kv_a_proj_with_mqa, the optional DSA
/// indexer projections, opaque `mla_attention` (kv_a_layernorm, kv_b_proj, RoPE and
/// the attention itself), o_proj.
fn mla(c: &mut Ctx, no: &mut NormOut, id: &str) -> Result<Value> {
    let spec = c.spec;
    let Some(mla) = spec.mla.clone() else {
        return Err(BuildError::missing("kv_lora_rank"));
    };
    let h = spec.hidden;
    let hq = c.shard("num_attention_heads", spec.heads)?;
    let m = c.module(id);
    let q_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim;
    let quant = |name: &str| spec.quant.for_modules(&[format!("{m}.{name}")]);
    let mut inputs = Vec::new();
    let mut q_a_norm: Option<NormOut> = None;
    match mla.q_lora_rank {
        Some(r) => {
            let op = c.operand_for(no, quant("q_a_proj")?)?;
            let q_a = c.gemm(op, h, r, &format!("{id}.q_a_proj"))?;
            let n_id = format!("{id}.q_a_layernorm");
            let qn = c.rms_norm(q_a, &n_id, r)?;
            let mut qno = crate::decoder::norm_out(c, qn, r, &n_id);
            let op = c.operand_for(&mut qno, quant("q_b_proj")?)?;
            inputs.push(c.gemm(op, r, hq * q_head, &format!("{id}.q_b_proj"))?);
            q_a_norm = Some(qno);
        }
        None => {
            let op = c.operand_for(no, quant("q_proj")?)?;
            inputs.push(c.gemm(op, h, hq * q_head, &format!("{id}.q_proj"))?);
        }
    }
    let op = c.operand_for(no, quant("kv_a_proj_with_mqa")?)?;
    inputs.push(c.gemm(
        op,
        h,
        mla.kv_lora_rank + mla.qk_rope_head_dim,
        &format!("{id}.kv_a_proj_with_mqa"),
    )?);
    let mut attrs = json!({
        "num_heads": spec.heads,
        "heads_per_rank": hq,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
    });
    if let Some(ix) = &mla.indexer {
        let Some(mut qno) = q_a_norm else {
            return Err(BuildError::missing("q_lora_rank"));
        };
        let op = c.operand_for(&mut qno, quant("indexer.wq_b")?)?;
        inputs.push(c.gemm(
            op,
            qno.k,
            ix.heads * ix.head_dim,
            &format!("{id}.indexer.wq_b"),
        )?);
        let op = c.operand_for(no, quant("indexer.wk")?)?;
        inputs.push(c.gemm(op, h, ix.head_dim, &format!("{id}.indexer.wk"))?);
        let op = c.operand_for(no, quant("indexers_proj")?)?;
        inputs.push(c.gemm(op, h, ix.heads, &format!("{id}.indexers_proj"))?);
        attrs["indexer"] = json!({"heads": ix.heads, "head_dim": ix.head_dim, "topk": ix.topk});
    }
    let attn = c.one(
        format!("{id}.attn"),
        Op::Opaque {
            target: "mla_attention".into(),
            attrs,
        },
        inputs,
        c.act(hq * mla.v_head_dim),
        &m,
    )?;
    c.linear(
        attn,
        hq * mla.v_head_dim,
        h,
        &format!("{id}.o_proj"),
        &format!("{m}.o_proj"),
    )
}

/// Dense MLP: gate_up_proj (or up_proj for non-gated relu2), opaque activation,
/// down_proj; per-rank partial `[tokens..., H]`. `id` is the MLP module (relative).
pub(crate) fn dense_mlp(c: &mut Ctx, id: &str, no: &mut NormOut) -> Result<Value> {
    let spec = c.spec;
    let h = spec.hidden;
    let f = c.shard("intermediate_size", spec.ffn)?;
    let m = c.module(id);
    let gated = spec.mlp_act != "relu2";
    let (shards, up_id, n_up, act_target) = if gated {
        (
            vec![format!("{m}.gate_proj"), format!("{m}.up_proj")],
            format!("{id}.gate_up_proj"),
            2 * f,
            format!("{}_and_mul", spec.mlp_act),
        )
    } else {
        (
            vec![format!("{m}.up_proj")],
            format!("{id}.up_proj"),
            f,
            spec.mlp_act.clone(),
        )
    };
    let quant = spec.quant.for_modules(&shards)?;
    let op = c.operand_for(no, quant)?;
    let up = c.gemm(op, h, n_up, &up_id)?;
    let a = c.one(
        format!("{id}.act_fn"),
        Op::Opaque {
            target: act_target,
            attrs: json!({}),
        },
        vec![up],
        c.act(f),
        &m,
    )?;
    c.linear(
        a,
        f,
        h,
        &format!("{id}.down_proj"),
        &format!("{m}.down_proj"),
    )
}

/// MoE as one opaque op (router, routed and shared experts, combine) producing the
/// per-rank partial `[tokens..., H]`. Inputs: the bf16 norm output (the router is
/// never quantised), the router weight `[E, H]`, and the quantised norm output when the
/// experts take quantised activations.
pub(crate) fn moe_block(c: &mut Ctx, id: &str, no: &mut NormOut) -> Result<Value> {
    let spec = c.spec;
    let Some(moe) = spec.moe.clone() else {
        return Err(BuildError::missing("n_routed_experts"));
    };
    let h = spec.hidden;
    let m = c.module(id);
    let ffn_rank = c.shard("moe_intermediate_size", moe.ffn)?;
    let router = c.param(
        &format!("{id}.{}.weight", spec.router_module()),
        spec.dtype,
        &[moe.experts, h],
    )?;
    let mut inputs = vec![no.y, router];
    let quant = spec.quant.for_modules(&[format!("{m}.experts")])?;
    if quant.is_some() {
        if let Operand::Quant { q, s, .. } = c.operand_for(no, quant)? {
            inputs.push(q);
            inputs.push(s);
        }
    }
    let attrs = json!({
        "experts": moe.experts,
        "top_k": moe.top_k,
        "moe_intermediate_size": moe.ffn,
        "moe_intermediate_size_per_rank": ffn_rank,
        "shared_experts": moe.shared_experts,
        "shared_intermediate_size": moe.shared_ffn,
        "activation": moe.activation,
        "weights": spec.quant.format.name(),
        "tp": c.opts.tp,
    });
    c.one(
        format!("{id}.experts"),
        Op::Opaque {
            target: "moe".into(),
            attrs,
        },
        inputs,
        c.act(h),
        &m,
    )
}

/// Mamba2 mixer (Nemotron-H): in_proj (column-parallel), opaque `mamba2` (conv1d,
/// SSM scan, gated group RMSNorm; no collective inside when `n_groups` splits over
/// tp), out_proj (row-parallel, so the block ends in an all-reduce like attention).
fn mamba(c: &mut Ctx, id: &str, no: &mut NormOut) -> Result<Value> {
    let spec = c.spec;
    let Some(mb) = spec.mamba.clone() else {
        return Err(BuildError::missing("mamba_num_heads"));
    };
    let h = spec.hidden;
    let m = c.module(id);
    let heads = c.shard("mamba_num_heads", mb.heads)?;
    let groups = c.shard_heads("n_groups", mb.groups)?;
    let inner = heads * mb.head_dim;
    // [z, x, B, C, dt] per rank.
    let n_in = 2 * inner + 2 * groups * mb.state + heads;
    let quant = spec.quant.for_modules(&[format!("{m}.in_proj")])?;
    let op = c.operand_for(no, quant)?;
    let zx = c.gemm(op, h, n_in, &format!("{id}.in_proj"))?;
    let y = c.one(
        format!("{id}.ssm"),
        Op::Opaque {
            target: "mamba2".into(),
            attrs: json!({
                "num_heads": mb.heads,
                "heads_per_rank": heads,
                "head_dim": mb.head_dim,
                "n_groups": mb.groups,
                "groups_per_rank": groups,
                "ssm_state_size": mb.state,
                "conv_kernel": mb.conv_kernel,
            }),
        },
        vec![zx],
        c.act(inner),
        &m,
    )?;
    c.linear(
        y,
        inner,
        h,
        &format!("{id}.out_proj"),
        &format!("{m}.out_proj"),
    )
}
