//! Build options.

use serde::{Deserialize, Serialize};

/// Default process-group name of the tensor-parallel all-reduces.
pub const DEFAULT_GROUP: &str = "tp";

/// Default largest token count per call: vLLM's usual max batched tokens (8192), the
/// value arfuse-policy's presets use.
pub const DEFAULT_MAX_TOKENS: u64 = 8192;

/// Largest batch `B` of 3-D graphs; `S` ranges up to `ceil(max_tokens / 8)`, so the
/// largest `B*S` is `max_tokens` rounded up to a multiple of 8.
pub const THREE_D_MAX_BATCH: u64 = 8;

/// How RMSNorm (and its residual add) appears in the graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormForm {
    /// Serving-engine ops: `rms_norm` without a residual, `fused_add_rms_norm` with one
    /// (vLLM's custom ops).
    #[default]
    Explicit,
    /// What torch emits for the Hugging Face modules: `add(residual, x)`, then
    /// `to_dtype(f32)`, `pow 2`, `mean [-1] keepdim`, `add eps` (a constant node),
    /// `rsqrt`, `mul`, and then `to_dtype(bf16)` and `mul(weight, x)` for Llama-style
    /// norms, or `mul(x, add(to_dtype(w, f32), 1.0))` and `to_dtype(bf16)` for Gemma.
    Decomposed,
}

/// Options of [`crate::build`]. `BuildOptions::default()` is TP 8, explicit norms, 2-D
/// activations, T up to 8192, every layer, group `"tp"`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BuildOptions {
    /// Tensor-parallel size W (ranks of the all-reduce group), >= 1. Every sharded
    /// weight has its per-rank shape.
    pub tp: u32,
    /// Norm spelling. Default: [`NormForm::Explicit`].
    #[serde(default)]
    pub norm_form: NormForm,
    /// Activations `[B, S, H]` (symbols `B`, `S`, T = B*S) with each all-reduce on a
    /// `[B*S, H]` view between two reshapes; otherwise `[T, H]`. Default: false.
    #[serde(default)]
    pub three_d: bool,
    /// Largest token count T of one call (symbol range `1..=max_tokens`). Default 8192.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u64,
    /// Keep only the first N decoder layers (the dense-first / hybrid structure of
    /// those layers is kept). `None`: every layer. Must be `1..=num_hidden_layers`.
    #[serde(default)]
    pub layers: Option<u32>,
    /// Process-group name written on every all-reduce. Default `"tp"`.
    #[serde(default = "default_group")]
    pub group: String,
}

fn default_max_tokens() -> u64 {
    DEFAULT_MAX_TOKENS
}

fn default_group() -> String {
    DEFAULT_GROUP.to_string()
}

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions {
            tp: 8,
            norm_form: NormForm::Explicit,
            three_d: false,
            max_tokens: DEFAULT_MAX_TOKENS,
            layers: None,
            group: default_group(),
        }
    }
}

impl BuildOptions {
    /// Options with tensor-parallel size `tp` and every other field at its default.
    pub fn tp(tp: u32) -> BuildOptions {
        BuildOptions {
            tp,
            ..BuildOptions::default()
        }
    }

    /// Checks the ranges of the options.
    pub(crate) fn check(&self) -> crate::Result<()> {
        use crate::BuildError::BadOption;
        if self.tp == 0 {
            return Err(BadOption {
                option: "tp",
                reason: "must be >= 1".into(),
            });
        }
        if self.max_tokens == 0 {
            return Err(BadOption {
                option: "max_tokens",
                reason: "must be >= 1".into(),
            });
        }
        if self.layers == Some(0) {
            return Err(BadOption {
                option: "layers",
                reason: "must be >= 1 when given".into(),
            });
        }
        if self.group.trim().is_empty() {
            return Err(BadOption {
                option: "group",
                reason: "must be a non-empty process-group name".into(),
            });
        }
        Ok(())
    }
}
