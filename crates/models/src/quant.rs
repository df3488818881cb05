//! Which activation quantisation a config implies, and for which modules.
//!
//! - Block FP8 (`quantization_config.quant_method == "fp8"`, `weight_block_size
//!   [128, 128]`, dynamic activations; DeepSeek-V3, GLM-5-FP8): each FP8 GEMM's input
//!   is quantised per token and group of 128 (`quant_fp8_per_token_group`,
//!   `packed_ue8m0` scales). Exclusions: `quantization_config.modules_to_not_convert`.
//! - NVFP4 (modelopt: `_hf_quant_config.quantization.quant_algo == "NVFP4"` for older
//!   exports, or `quantization_config.quant_algo == "NVFP4"` for newer ones): each
//!   NVFP4 GEMM's input goes through `quant_nvfp4` (swizzled 128x4 scales, an f32 `[1]`
//!   global-scale parameter). Exclusions: `exclude_modules` (older) or `ignore` (newer).
//! - MXFP4 (`quant_method == "mxfp4"`, gpt-oss): only the MoE expert weights are FP4;
//!   activations stay bf16 (the MoE kernel does any activation cast itself), so no
//!   quant op is inserted anywhere.
//! - No `quantization_config`: bf16, no quant ops.
//!
//! Exclusion matching (documented choice): an entry excludes a module path when it is
//! equal to it, matches it or one of its parents as a `*` glob
//! (`model.layers.*.self_attn`, `model.layers.61*`), names a parent module
//! (`model.layers.3.self_attn` excludes `model.layers.3.self_attn.q_a_proj`) or equals
//! its trailing components (`gate` excludes `model.layers.3.block_sparse_moe.gate` but not `...mlp.gate_proj`). Entries
//! naming norms, biases, the embedding or lm_head change no activation quantisation.

use crate::config::Cfg;
use crate::error::{BuildError, Result};
use serde_json::Value as Json;

/// The per-token-group size of block-FP8 activation quantisation (DeepSeek-style) and
/// the NVFP4 block (elements per e4m3 scale): the ABI's one definition.
use arfuse_abi::{FP8_GROUP_SIZE, NVFP4_BLOCK};

/// The activation quantisation in front of a quantised GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActQuant {
    /// `quant_fp8_per_token_group{group_size, packed_ue8m0}`.
    Fp8Group { group: u64 },
    /// `quant_nvfp4{swizzled_128x4}` with an f32 global scale.
    Nvfp4,
}

/// The weight format of a config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WeightFormat {
    Bf16,
    Fp8Block,
    Nvfp4,
    Mxfp4,
}

impl WeightFormat {
    pub(crate) fn name(self) -> &'static str {
        match self {
            WeightFormat::Bf16 => "bf16",
            WeightFormat::Fp8Block => "fp8_block",
            WeightFormat::Nvfp4 => "nvfp4",
            WeightFormat::Mxfp4 => "mxfp4",
        }
    }
}

/// The quantisation scheme of a config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct QuantSpec {
    pub format: WeightFormat,
    /// Activation quantisation of every non-excluded GEMM (None: bf16 activations).
    pub act: Option<ActQuant>,
    /// Exclusion entries, verbatim.
    pub exclude: Vec<String>,
}

impl QuantSpec {
    pub(crate) fn from_config(cfg: &Cfg) -> Result<QuantSpec> {
        // Older modelopt exports: NVFP4 only in hf_quant_config.json.
        if let Some(hq) = cfg.get("_hf_quant_config") {
            let algo = hq
                .get("quantization")
                .and_then(|q| q.get("quant_algo"))
                .ok_or_else(|| BuildError::missing("_hf_quant_config.quantization.quant_algo"))?;
            if algo.as_str() != Some("NVFP4") {
                return Err(BuildError::unsupported(
                    "_hf_quant_config.quantization.quant_algo",
                    algo,
                    "only NVFP4 modelopt exports are modelled",
                ));
            }
            check_group(
                hq.get("quantization").and_then(|q| q.get("group_size")),
                "_hf_quant_config.quantization.group_size",
            )?;
            let exclude = strings(
                hq.get("quantization")
                    .and_then(|q| q.get("exclude_modules")),
                "_hf_quant_config.quantization.exclude_modules",
            )?;
            return Ok(QuantSpec {
                format: WeightFormat::Nvfp4,
                act: Some(ActQuant::Nvfp4),
                exclude,
            });
        }
        let Some(qc) = cfg.get("quantization_config") else {
            return Ok(QuantSpec {
                format: WeightFormat::Bf16,
                act: None,
                exclude: Vec::new(),
            });
        };
        let method = qc
            .get("quant_method")
            .ok_or_else(|| BuildError::missing("quantization_config.quant_method"))?;
        match method.as_str() {
            Some("fp8") => {
                let scheme = qc.get("activation_scheme");
                if let Some(s) = scheme {
                    if s.as_str() != Some("dynamic") {
                        return Err(BuildError::unsupported(
                            "quantization_config.activation_scheme",
                            s,
                            "block FP8 needs dynamic per-token-group activations",
                        ));
                    }
                }
                let block = qc
                    .get("weight_block_size")
                    .ok_or_else(|| BuildError::missing("quantization_config.weight_block_size"))?;
                let dims: Vec<u64> = block
                    .as_array()
                    .map(|a| a.iter().filter_map(Json::as_u64).collect())
                    .unwrap_or_default();
                if dims != [FP8_GROUP_SIZE, FP8_GROUP_SIZE] {
                    return Err(BuildError::unsupported(
                        "quantization_config.weight_block_size",
                        block,
                        "only [128, 128] blocks (per-token-group 128 activations) are modelled",
                    ));
                }
                Ok(QuantSpec {
                    format: WeightFormat::Fp8Block,
                    act: Some(ActQuant::Fp8Group {
                        group: FP8_GROUP_SIZE,
                    }),
                    exclude: strings(
                        qc.get("modules_to_not_convert"),
                        "quantization_config.modules_to_not_convert",
                    )?,
                })
            }
            Some("modelopt") => {
                let algo = qc
                    .get("quant_algo")
                    .ok_or_else(|| BuildError::missing("quantization_config.quant_algo"))?;
                if algo.as_str() != Some("NVFP4") {
                    return Err(BuildError::unsupported(
                        "quantization_config.quant_algo",
                        algo,
                        "only NVFP4 modelopt exports are modelled",
                    ));
                }
                Ok(QuantSpec {
                    format: WeightFormat::Nvfp4,
                    act: Some(ActQuant::Nvfp4),
                    exclude: strings(qc.get("ignore"), "quantization_config.ignore")?,
                })
            }
            Some("mxfp4") => Ok(QuantSpec {
                format: WeightFormat::Mxfp4,
                act: None,
                exclude: strings(
                    qc.get("modules_to_not_convert"),
                    "quantization_config.modules_to_not_convert",
                )?,
            }),
            _ => Err(BuildError::unsupported(
                "quantization_config.quant_method",
                method,
                "supported: fp8 (block 128x128), modelopt NVFP4, mxfp4, or none",
            )),
        }
    }

    /// The activation quantisation in front of a GEMM made of the (HF-named) module
    /// paths `modules` (several for fused GEMMs such as q/k/v). `None` when the config
    /// is not activation-quantised or the modules are excluded; an error when only some
    /// shards of a fused GEMM are excluded.
    pub(crate) fn for_modules(&self, modules: &[String]) -> Result<Option<ActQuant>> {
        let Some(act) = self.act else { return Ok(None) };
        let excluded: Vec<bool> = modules.iter().map(|m| self.excluded(m)).collect();
        if excluded.iter().all(|e| *e) {
            return Ok(None);
        }
        if excluded.iter().any(|e| *e) {
            return Err(BuildError::bad(
                self.exclusion_field(),
                format!("excludes only some shards of the fused GEMM {modules:?}"),
            ));
        }
        Ok(Some(act))
    }

    fn exclusion_field(&self) -> &'static str {
        match self.format {
            WeightFormat::Nvfp4 => "_hf_quant_config.quantization.exclude_modules",
            _ => "quantization_config.modules_to_not_convert",
        }
    }

    /// True when an exclusion entry names `module` (see the module documentation).
    pub(crate) fn excluded(&self, module: &str) -> bool {
        self.exclude.iter().any(|p| excludes(p, module))
    }
}

fn check_group(v: Option<&Json>, field: &str) -> Result<()> {
    match v {
        None => Ok(()),
        Some(g) if g.as_u64() == Some(NVFP4_BLOCK) => Ok(()),
        Some(g) => Err(BuildError::unsupported(
            field,
            g,
            "NVFP4 uses blocks of 16 elements",
        )),
    }
}

fn strings(v: Option<&Json>, field: &str) -> Result<Vec<String>> {
    match v {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| BuildError::bad(field, "entries must be strings"))
            })
            .collect(),
        Some(_) => Err(BuildError::bad(field, "must be a list of module names")),
    }
}

/// True when the exclusion entry `pattern` names `module`.
pub(crate) fn excludes(pattern: &str, module: &str) -> bool {
    if pattern.contains('*') {
        // The glob names the module or one of its parents.
        let parents = module.match_indices('.').map(|(i, _)| &module[..i]);
        return std::iter::once(module)
            .chain(parents)
            .any(|m| glob(pattern.as_bytes(), m.as_bytes()));
    }
    module == pattern
        || module
            .strip_prefix(pattern)
            .is_some_and(|rest| rest.starts_with('.'))
        || module
            .strip_suffix(pattern)
            .is_some_and(|head| head.ends_with('.'))
}

/// `*` matches any run of characters (including dots), everything else literally.
fn glob(p: &[u8], s: &[u8]) -> bool {
    // Iterative matcher with backtracking to the last star: O(len(p) * len(s)).
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, si));
            pi += 1;
        } else if pi < p.len() && p[pi] == s[si] {
            pi += 1;
            si += 1;
        } else if let Some((sp, ss)) = star {
            pi = sp + 1;
            si = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exclusion_entries() {
        let m = "model.layers.3.self_attn.q_a_proj";
        assert!(excludes("model.layers.3.self_attn.q_a_proj", m));
        assert!(excludes("model.layers.3.self_attn", m));
        assert!(excludes("model.layers.*.self_attn", m));
        assert!(excludes("model.layers.3.self_attn*", m));
        assert!(!excludes("model.layers.30.self_attn", m));
        assert!(!excludes("model.layers.61*", m));
        assert!(excludes("model.layers.61*", "model.layers.61.mlp.experts"));
        assert!(excludes("gate", "model.layers.3.block_sparse_moe.gate"));
        assert!(!excludes("gate", "model.layers.3.mlp.gate_proj"));
        assert!(!excludes(
            "model.layers.3.mlp.gate",
            "model.layers.3.mlp.gate_proj"
        ));
    }
}
