//! An EAGLE-3 style speculative-decoding draft graph built from its target's config.
//!
//! The draft is one Llama decoder layer of the target's shape (same hidden size, heads,
//! intermediate size and TP split), as vLLM's `llama_eagle3` runs it:
//! - `input_ids` -> vocab-parallel embedding -> all-reduce -> `input_layernorm`;
//! - `hidden_states` (the target's auxiliary hidden states, `[T, 3H]`, replicated) ->
//!   `fc` (replicated `[H, 3H]`, no collective) -> `hidden_norm`; the `fc` output is
//!   the residual;
//! - both normed halves concatenated (opaque `aten.cat`, `[T, 2H]`) -> QKV (`K = 2H`)
//!   -> attention -> o_proj -> all-reduce -> post-attention norm (with the residual)
//!   -> MLP -> all-reduce -> final norm (with the residual);
//! - outputs: the final norm output (to the draft lm_head) and the pre-norm hidden
//!   state (the next draft step's hidden state, so the final residual is live).
//!
//! Three fusion sites (2L + 1 with L = 1). The draft's all-reduces have the target's
//! hidden size and TP group, so a serving engine runs both graphs on one workspace;
//! the draft is never wider than the target. Draft weights are bf16 whatever the
//! target's quantisation (EAGLE heads ship in bf16).

use crate::builder::Ctx;
use crate::config::{Family, ModelSpec};
use crate::decoder::{attention_with, dense_mlp, embedding, metadata, norm_out};
use crate::error::{BuildError, Result};
use crate::options::BuildOptions;
use crate::quant::{QuantSpec, WeightFormat};
use arfuse_ir::{Graph, InputKind, Op};
use serde_json::json;

/// Width multiple of the target hidden states fed to an EAGLE-3 draft (three target
/// layers' outputs, concatenated).
pub const EAGLE3_AUX_LAYERS: u64 = 3;

pub(crate) fn draft_spec(config: &serde_json::Value) -> Result<ModelSpec> {
    let mut spec = ModelSpec::from_config(config, Some(1))?;
    if spec.family != Family::Llama || spec.mla.is_some() {
        return Err(BuildError::unsupported(
            "model_type",
            &json!(spec.model_type),
            "EAGLE-3 drafts are built for dense Llama-style targets",
        ));
    }
    spec.quant = QuantSpec {
        format: WeightFormat::Bf16,
        act: None,
        exclude: Vec::new(),
    };
    Ok(spec)
}

/// Builds the draft of the target described by `config` (see the module docs).
/// `opts.layers` is ignored: the draft has one layer.
pub fn build_eagle3_draft(config: &serde_json::Value, opts: &BuildOptions) -> Result<Graph> {
    opts.check()?;
    let spec = draft_spec(config)?;
    let mut c = Ctx::new(&spec, opts);
    let h = spec.hidden;
    let emb = embedding(&mut c)?;
    let embeds = c.rms_norm(emb, "layers.0.input_layernorm", h)?;
    let aux = c.input(
        "hidden_states",
        InputKind::Activation,
        c.act(EAGLE3_AUX_LAYERS * h),
    )?;
    let hidden = c.gemm(
        crate::builder::Operand::Plain(aux),
        EAGLE3_AUX_LAYERS * h,
        h,
        "fc",
    )?;
    let hn = c.rms_norm(hidden, "layers.0.hidden_norm", h)?;
    let m = c.module("layers.0.self_attn");
    let cat = c.one(
        "layers.0.self_attn.cat",
        Op::Opaque {
            target: "aten.cat".into(),
            attrs: json!({"dim": -1}),
        },
        vec![embeds, hn],
        c.act(2 * h),
        &m,
    )?;
    let mut no = norm_out(&c, cat, 2 * h, "layers.0.self_attn.cat");
    let a = attention_with(&mut c, 0, &mut no, "layers.0.self_attn")?;
    let om = c.module("layers.0.self_attn.o_proj");
    let a = c.all_reduce(a, h, "layers.0.self_attn.o_proj.all_reduce", &om)?;
    let lm = c.module("layers.0");
    let (n2, r2) = c.add_rms_norm(
        a,
        hidden,
        "layers.0.post_attention_layernorm",
        h,
        "layers.0.attn_residual_add",
        &lm,
    )?;
    let mut no2 = norm_out(&c, n2, h, "layers.0.post_attention_layernorm");
    let mlp = dense_mlp(&mut c, "layers.0.mlp", &mut no2)?;
    let mm = c.module("layers.0.mlp");
    let mlp = c.all_reduce(mlp, h, "layers.0.mlp.all_reduce", &mm)?;
    let (y, hs) = c.add_rms_norm(mlp, r2, "norm", h, "layers.0.mlp_residual_add", &lm)?;
    let mut meta = metadata(&spec, opts);
    meta["draft"] = json!("eagle3");
    c.finish(vec![y, hs], meta)
}
