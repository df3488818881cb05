//! arfuse-models: builds the tensor-parallel decoder graph a serving engine runs from
//! a Hugging Face `config.json`, at real sizes, per rank.
//!
//! ```
//! let cfg: serde_json::Value = serde_json::from_str(include_str!(
//!     "../../../ir-fixtures/configs/meta-llama__Llama-3.1-8B-Instruct.json"
//! )).unwrap();
//! let opts = arfuse_models::BuildOptions { layers: Some(2), ..arfuse_models::BuildOptions::tp(8) };
//! let g = arfuse_models::build(&cfg, &opts).unwrap();
//! let sites = arfuse_models::expected_sites(&cfg, &opts).unwrap();
//! assert_eq!(sites.sites, 5); // 2L + 1
//! assert!(g.validate().is_ok());
//! ```
//!
//! # The graph
//!
//! Per rank, tokens `T` (or `B, S` with [`BuildOptions::three_d`]), activation dtype
//! from `torch_dtype` (bf16 in every corpus config):
//! - `input_ids` -> vocab-parallel `embedding` (table `[ceil(pad64(vocab)/tp), H]`) ->
//!   `all_reduce` (group [`BuildOptions::group`]).
//! - Per decoder layer: input norm -> attention -> o_proj -> `all_reduce` -> residual
//!   add + post-attention norm -> dense MLP or MoE -> `all_reduce` -> (next layer's
//!   residual add + input norm). The first input norm has no residual (the embedding
//!   all-reduce output becomes the residual). After the last layer: residual add +
//!   final norm; the graph output is the final norm output.
//! - Attention: `qkv_proj` GEMM `[(heads + 2 kv_heads)/tp * head_dim, H]` (kv heads
//!   replicated when fewer than tp), opaque `attention` (RoPE, q/k norms, softmax)
//!   -> `[T, heads/tp * head_dim]`, `o_proj` `[H, heads/tp * head_dim]`.
//! - MLA (`kv_lora_rank` present): `q_a_proj` -> `q_a_layernorm` (an RMSNorm that is
//!   no fusion site) -> `q_b_proj`, `kv_a_proj_with_mqa`, the DSA indexer projections
//!   when `index_n_heads` is present, opaque `mla_attention`
//!   -> `[T, heads/tp * v_head_dim]`, `o_proj`.
//! - Dense MLP: `gate_up_proj` `[2 ffn/tp, H]`, opaque `<act>_and_mul`, `down_proj`
//!   `[H, ffn/tp]`. MoE (dense-first per `first_k_dense_replace`, `moe_layer_freq`,
//!   `decoder_sparse_step`, `mlp_only_layers`): one opaque `moe` op (router, routed and
//!   shared experts) producing the per-rank partial `[T, H]` for the all-reduce.
//! - Gemma-2/3: offset norms (`weight_bias` 1, bf16 weight parameter read through
//!   `to_dtype f32`: HF's `1 + w.float()`), post_attention_layernorm on the all-reduce
//!   output before the residual add, pre/post_feedforward_layernorm, the `sqrt(H)`
//!   embedding scale (Gemma-3 before the all-reduce, Gemma-2 after it).
//! - Nemotron-H (`hybrid_override_pattern`): one norm + one mixer per block; Mamba2
//!   blocks are `in_proj` -> opaque `mamba2` -> `out_proj` -> `all_reduce` (out_proj is
//!   row-parallel under TP like o_proj).
//! - Quantisation ([`quant`](crate::quant) rules): block-FP8 and NVFP4 configs get
//!   `quant_fp8_per_token_group{128, packed_ue8m0}` / `quant_nvfp4{swizzled_128x4}`
//!   in front of every quantised GEMM (the norm's quant is shared by the GEMMs reading
//!   that norm; a norm also read by a bf16 consumer, e.g. a MoE router or an excluded
//!   module, keeps its bf16 output live); quantised GEMMs are opaque `fp8_block_gemm` /
//!   `nvfp4_gemm` ops with their weight and scale parameters. MXFP4 (gpt-oss) and bf16
//!   configs get no quant op.
//! - Not built: lm_head (column-parallel, no all-reduce), MTP layers.
//!
//! Node ids are module paths without the root (`layers.3.self_attn.o_proj`); each
//! node's `module` is the full HF module path (`model.layers.3.self_attn.o_proj`).
//! Site count rules: [`sites`](crate::sites).

mod builder;
mod config;
mod decoder;
mod draft;
mod error;
mod fixture;
mod options;
pub mod quant;
pub mod sites;

pub use decoder::vocab_rows_per_rank;
pub use draft::{build_eagle3_draft, EAGLE3_AUX_LAYERS};
pub use error::{BuildError, Result};
pub use fixture::{corpus, FixtureOptions, FixtureSpec, GraphKind};
pub use options::{BuildOptions, NormForm, DEFAULT_GROUP, DEFAULT_MAX_TOKENS, THREE_D_MAX_BATCH};
pub use sites::{expected_draft_sites, expected_sites, SiteCount};

use arfuse_ir::Graph;

/// Builds the tensor-parallel decoder graph of `config` (a parsed config.json). The
/// graph validates ([`Graph::validate`]); errors name the config field or option.
pub fn build(config: &serde_json::Value, opts: &BuildOptions) -> Result<Graph> {
    opts.check()?;
    let spec = config::ModelSpec::from_config(config, opts.layers)?;
    decoder::build_decoder(&spec, opts)
}
