//! The expected number of all-reduce + (residual add) + RMSNorm fusion sites of a
//! built graph, by architecture.
//!
//! A site is an all-reduce whose output reaches an RMSNorm either directly or through
//! one residual add (seeing through reshapes), with nothing else in between.
//!
//! Count rules (L = layers built):
//! - Dense and MoE decoders (Llama, Qwen3, Qwen3-MoE, Mixtral, gpt-oss, MiniMax-M2),
//!   and MLA decoders (DeepSeek-V3, GLM-5, Kimi-K2), dense-first or not: **2L + 1**:
//!   the embedding all-reduce feeds layer 0's input norm (no residual); per layer the
//!   o_proj all-reduce feeds post_attention_layernorm through the residual add, and the
//!   MLP/MoE all-reduce feeds the next input norm (the last one the final norm, whose
//!   residual output is dead). MLA's q_a_layernorm (and kv_a_layernorm, inside the
//!   opaque attention), Qwen3's q/k norms and the DSA indexer's k_norm are RMS/Layer
//!   norms with no all-reduce before them: not sites.
//! - Gemma-3: **2L + 1**: the embedding scale sits inside the embedding module (HF
//!   `Gemma3TextScaledWordEmbedding`), before the all-reduce, so the embedding
//!   all-reduce feeds the input norm; per layer the o_proj all-reduce feeds
//!   post_attention_layernorm directly and the down_proj all-reduce feeds
//!   post_feedforward_layernorm directly (sandwich norms, no residual at either site,
//!   the all-reduce output is dead afterwards). The residual adds feed
//!   pre_feedforward_layernorm, the next input_layernorm and the final norm, with no
//!   all-reduce in front: not sites.
//! - Gemma-2: **2L**: as Gemma-3, but HF Gemma2 multiplies by `sqrt(hidden_size)` after
//!   `embed_tokens`, i.e. after the vocab-parallel all-reduce: that all-reduce feeds a
//!   `mul` before the norm and must not be fused.
//! - Hybrid (Nemotron-H): **L + 1**: every block (Mamba2, attention, MoE or MLP) has
//!   one norm and one mixer ending in a row-parallel projection and an all-reduce
//!   (Mamba2's out_proj included), which feeds the next block's norm through the
//!   residual add (the last one norm_f); plus the embedding all-reduce.
//! - EAGLE-3 draft: **3** (2L + 1, L = 1): embedding all-reduce -> input_layernorm,
//!   o_proj all-reduce -> post-attention norm, MLP all-reduce -> final norm (with a live
//!   residual: it is the next step's hidden state).

use crate::config::{BlockMixer, EmbedScale, Family, LayerKind, ModelSpec};
use crate::error::Result;
use crate::options::BuildOptions;
use serde::{Deserialize, Serialize};

/// Expected fusion sites of a built graph.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SiteCount {
    /// Layers built (L).
    pub layers: u32,
    /// All-reduces in the graph.
    pub all_reduces: u32,
    /// Fusion sites (all-reduce -> [residual add ->] RMSNorm).
    pub sites: u32,
    /// Sites with no residual add (the embedding site, Gemma's sandwich-norm sites).
    pub without_residual: u32,
    /// Sites whose norm output is quantised for the next GEMMs (block-FP8 / NVFP4).
    pub with_quant: u32,
    /// The rule, as a formula with its L.
    pub rule: String,
}

/// Is the activation into the GEMMs reading the norm before layer `i`'s mixer/attention
/// quantised? (Mirrors the builder's module names.)
fn attn_in_quant(spec: &ModelSpec, i: usize, tp_block_prefix: &str) -> Result<bool> {
    let m = format!("{}.layers.{i}.{tp_block_prefix}", spec.root());
    let q = &spec.quant;
    if spec.mla.is_some() {
        let mut names = vec!["kv_a_proj_with_mqa", "indexer.wk", "indexers_proj"];
        names.push(match spec.mla.as_ref().and_then(|x| x.q_lora_rank) {
            Some(_) => "q_a_proj",
            None => "q_proj",
        });
        let has_indexer = spec.mla.as_ref().is_some_and(|x| x.indexer.is_some());
        for n in names {
            if !has_indexer && n.contains("index") {
                continue;
            }
            if q.for_modules(&[format!("{m}.{n}")])?.is_some() {
                return Ok(true);
            }
        }
        return Ok(false);
    }
    let shards: Vec<String> = ["q_proj", "k_proj", "v_proj"]
        .iter()
        .map(|p| format!("{m}.{p}"))
        .collect();
    Ok(q.for_modules(&shards)?.is_some())
}

fn mlp_in_quant(spec: &ModelSpec, module: &str, moe: bool) -> Result<bool> {
    let q = &spec.quant;
    if moe {
        return Ok(q.for_modules(&[format!("{module}.experts")])?.is_some());
    }
    let shards = if spec.mlp_act == "relu2" {
        vec![format!("{module}.up_proj")]
    } else {
        vec![format!("{module}.gate_proj"), format!("{module}.up_proj")]
    };
    Ok(q.for_modules(&shards)?.is_some())
}

/// Whether the norm in front of layer `i` (its input norm) feeds a quant.
fn input_norm_quant(spec: &ModelSpec, i: usize) -> Result<bool> {
    let Some(kind) = spec.layers.get(i) else {
        return Ok(false); // the final norm feeds lm_head, never quantised here
    };
    let root = spec.root();
    match *kind {
        LayerKind::Decoder { .. } => attn_in_quant(spec, i, "self_attn"),
        LayerKind::Block(BlockMixer::Attention) => attn_in_quant(spec, i, "mixer"),
        LayerKind::Block(BlockMixer::Mamba) => Ok(spec
            .quant
            .for_modules(&[format!("{root}.layers.{i}.mixer.in_proj")])?
            .is_some()),
        LayerKind::Block(BlockMixer::Moe) => {
            mlp_in_quant(spec, &format!("{root}.layers.{i}.mixer"), true)
        }
        LayerKind::Block(BlockMixer::Mlp) => {
            mlp_in_quant(spec, &format!("{root}.layers.{i}.mixer"), false)
        }
    }
}

pub(crate) fn count(spec: &ModelSpec) -> Result<SiteCount> {
    let l = spec.layers.len() as u32;
    let mut all_reduces = 1;
    let mut sites = 0;
    let mut without_residual = 0;
    let mut with_quant = 0;
    if spec.embed_scale() != EmbedScale::AfterAllReduce {
        sites += 1;
        without_residual += 1;
        with_quant += u32::from(input_norm_quant(spec, 0)?);
    }
    let mlp = spec.mlp_module();
    for (i, kind) in spec.layers.iter().enumerate() {
        match *kind {
            LayerKind::Decoder { moe } => {
                all_reduces += 2;
                sites += 2;
                if spec.gemma() {
                    without_residual += 2;
                } else {
                    let module = format!("{}.layers.{i}.{mlp}", spec.root());
                    with_quant += u32::from(mlp_in_quant(spec, &module, moe)?);
                    with_quant += u32::from(input_norm_quant(spec, i + 1)?);
                }
            }
            LayerKind::Block(_) => {
                all_reduces += 1;
                sites += 1;
                with_quant += u32::from(input_norm_quant(spec, i + 1)?);
            }
        }
    }
    let rule = match spec.family {
        Family::NemotronH => format!("L + 1 (hybrid: one norm and one all-reduce per block), L = {l}"),
        Family::Gemma2 => format!(
            "2L (Gemma-2 sandwich norms; the embedding all-reduce feeds the sqrt(H) normaliser, not a norm), L = {l}"
        ),
        Family::Gemma3 => format!(
            "2L + 1 (Gemma-3 sandwich norms: o_proj and down_proj all-reduces feed post-norms directly, plus the embedding), L = {l}"
        ),
        _ => format!("2L + 1 (embedding + o_proj and MLP/MoE all-reduce per layer), L = {l}"),
    };
    Ok(SiteCount {
        layers: l,
        all_reduces,
        sites,
        without_residual,
        with_quant,
        rule,
    })
}

/// The expected sites of `build(config, opts)` (see the module docs for the rules).
/// Fails exactly when `build` fails (the graph is built to check the TP split; the
/// count itself comes from the rule, not from the graph).
pub fn expected_sites(config: &serde_json::Value, opts: &BuildOptions) -> Result<SiteCount> {
    opts.check()?;
    let spec = ModelSpec::from_config(config, opts.layers)?;
    crate::decoder::build_decoder(&spec, opts)?;
    count(&spec)
}

/// The expected sites of `build_eagle3_draft(config, opts)`: 3 (2L + 1 with L = 1).
pub fn expected_draft_sites(config: &serde_json::Value, opts: &BuildOptions) -> Result<SiteCount> {
    opts.check()?;
    // Fails exactly when the draft build fails.
    crate::draft::build_eagle3_draft(config, opts)?;
    Ok(SiteCount {
        layers: 1,
        all_reduces: 3,
        sites: 3,
        without_residual: 1,
        with_quant: 0,
        rule:
            "2L + 1 (EAGLE-3 draft: embedding -> input_layernorm, o_proj, MLP -> final norm), L = 1"
                .to_string(),
    })
}
