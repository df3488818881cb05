//! Reading a Hugging Face `config.json` into a [`ModelSpec`]: the architecture facts
//! the builder needs, each read from a named field (errors name it).

use crate::error::{BuildError, Result};
use crate::quant::QuantSpec;
use arfuse_ir::DType;
use serde_json::Value as Json;

/// Read access to a config object; `null` counts as absent.
pub(crate) struct Cfg<'a>(pub &'a Json);

impl<'a> Cfg<'a> {
    pub(crate) fn get(&self, key: &str) -> Option<&'a Json> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    pub(crate) fn u64(&self, key: &str) -> Result<u64> {
        self.opt_u64(key)?.ok_or_else(|| BuildError::missing(key))
    }

    pub(crate) fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                BuildError::bad(key, format!("expected a non-negative integer, got {v}"))
            }),
        }
    }

    /// The first present key of `keys`; missing: an error naming `keys[0]`.
    pub(crate) fn u64_any(&self, keys: &[&str]) -> Result<u64> {
        for k in keys {
            if let Some(v) = self.opt_u64(k)? {
                return Ok(v);
            }
        }
        Err(BuildError::missing(keys[0]))
    }

    pub(crate) fn opt_u64_any(&self, keys: &[&str]) -> Result<Option<u64>> {
        for k in keys {
            if let Some(v) = self.opt_u64(k)? {
                return Ok(Some(v));
            }
        }
        Ok(None)
    }

    pub(crate) fn f64_any(&self, keys: &[&str]) -> Result<f64> {
        for k in keys {
            if let Some(v) = self.get(k) {
                return v
                    .as_f64()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .ok_or_else(|| {
                        BuildError::bad(*k, format!("expected a positive number, got {v}"))
                    });
            }
        }
        Err(BuildError::missing(keys[0]))
    }

    pub(crate) fn str(&self, key: &str) -> Result<&'a str> {
        let v = self.get(key).ok_or_else(|| BuildError::missing(key))?;
        v.as_str()
            .ok_or_else(|| BuildError::bad(key, format!("expected a string, got {v}")))
    }

    pub(crate) fn opt_str(&self, key: &str) -> Option<&'a str> {
        self.get(key).and_then(Json::as_str)
    }

    pub(crate) fn bool(&self, key: &str) -> Result<bool> {
        match self.get(key) {
            None => Ok(false),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| BuildError::bad(key, format!("expected true or false, got {v}"))),
        }
    }
}

/// Model families: they fix module naming, the norm style and where the embedding
/// scale sits. Everything else is read from fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Family {
    /// llama, mistral, qwen2, qwen3: plain pre-norm decoder.
    Llama,
    /// qwen3_moe, mixtral, minimax_m2, gpt_oss: plain decoder with MoE.
    MoeDecoder,
    /// deepseek_v3, kimi_k2, glm_moe_dsa: MLA attention, dense-first MoE.
    DeepseekV3,
    /// gemma2: offset sandwich norms, embedding normaliser after the all-reduce.
    Gemma2,
    /// gemma3_text: offset sandwich norms, scaled embedding before the all-reduce.
    Gemma3,
    /// nemotron_h: hybrid Mamba2 / attention / MoE blocks with one norm each.
    NemotronH,
}

/// Where Gemma's `sqrt(hidden_size)` embedding scale sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EmbedScale {
    None,
    /// Inside the embedding module (HF `Gemma3TextScaledWordEmbedding`): before the
    /// vocab-parallel all-reduce, which then feeds the first norm directly.
    BeforeAllReduce,
    /// In the model's forward after `embed_tokens` (HF Gemma2, vLLM Gemma2/3): between
    /// the all-reduce and the first norm, so that all-reduce is no fusion site.
    AfterAllReduce,
}

/// One hybrid block's mixer (`hybrid_override_pattern`: M, *, E, -).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockMixer {
    Mamba,
    Attention,
    Moe,
    Mlp,
}

/// What one layer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LayerKind {
    /// Attention then a dense MLP or a MoE, two residual blocks.
    Decoder { moe: bool },
    /// A hybrid block: one norm, one mixer, one residual add.
    Block(BlockMixer),
}

/// Multi-head latent attention (DeepSeek-V3 style).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Mla {
    pub q_lora_rank: Option<u64>,
    pub kv_lora_rank: u64,
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
    pub indexer: Option<Indexer>,
}

/// The DSA lightning indexer of GLM-5 / DeepSeek-V3.2 (replicated on every rank).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Indexer {
    pub heads: u64,
    pub head_dim: u64,
    pub topk: u64,
}

/// MoE sizes.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Moe {
    pub experts: u64,
    pub top_k: u64,
    pub ffn: u64,
    pub shared_experts: u64,
    pub shared_ffn: u64,
    pub activation: String,
}

/// Mamba2 mixer sizes (Nemotron-H).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Mamba {
    pub heads: u64,
    pub head_dim: u64,
    pub groups: u64,
    pub state: u64,
    pub conv_kernel: u64,
}

/// Everything the builder reads from a config.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ModelSpec {
    pub model_type: String,
    pub family: Family,
    pub hidden: u64,
    pub vocab: u64,
    pub eps: f64,
    pub dtype: DType,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub attn_bias: bool,
    pub qk_norm: bool,
    pub mla: Option<Mla>,
    /// Dense MLP intermediate size (0 when the model has no dense MLP).
    pub ffn: u64,
    pub mlp_act: String,
    pub moe: Option<Moe>,
    pub mamba: Option<Mamba>,
    /// Per layer, already cut to `BuildOptions::layers`.
    pub layers: Vec<LayerKind>,
    /// Per layer: the sliding window of its attention, if any.
    pub sliding: Vec<Option<u64>>,
    pub quant: QuantSpec,
}

impl ModelSpec {
    /// Root module of the decoder (`model`, or `backbone` for Nemotron-H).
    pub(crate) fn root(&self) -> &'static str {
        if self.family == Family::NemotronH {
            "backbone"
        } else {
            "model"
        }
    }

    /// The MLP / MoE module name inside a decoder layer.
    pub(crate) fn mlp_module(&self) -> &'static str {
        match self.model_type.as_str() {
            "mixtral" | "minimax_m2" => "block_sparse_moe",
            _ => "mlp",
        }
    }

    /// The MoE router module name.
    pub(crate) fn router_module(&self) -> &'static str {
        if self.model_type == "gpt_oss" {
            "router"
        } else {
            "gate"
        }
    }

    pub(crate) fn embed_module(&self) -> &'static str {
        if self.family == Family::NemotronH {
            "embeddings"
        } else {
            "embed_tokens"
        }
    }

    pub(crate) fn final_norm_module(&self) -> &'static str {
        if self.family == Family::NemotronH {
            "norm_f"
        } else {
            "norm"
        }
    }

    pub(crate) fn gemma(&self) -> bool {
        matches!(self.family, Family::Gemma2 | Family::Gemma3)
    }

    pub(crate) fn embed_scale(&self) -> EmbedScale {
        match self.family {
            Family::Gemma2 => EmbedScale::AfterAllReduce,
            Family::Gemma3 => EmbedScale::BeforeAllReduce,
            _ => EmbedScale::None,
        }
    }

    /// Reads a config. `layers` cuts the model to its first N layers.
    pub(crate) fn from_config(config: &Json, layers: Option<u32>) -> Result<ModelSpec> {
        if !config.is_object() {
            return Err(BuildError::bad(
                "<config>",
                "config.json must be a JSON object",
            ));
        }
        let cfg = Cfg(config);
        let model_type = cfg.str("model_type")?.to_string();
        let family = match model_type.as_str() {
            "llama" | "mistral" | "qwen2" | "qwen3" => Family::Llama,
            "qwen3_moe" | "mixtral" | "minimax_m2" | "gpt_oss" => Family::MoeDecoder,
            "deepseek_v3" | "kimi_k2" | "glm_moe_dsa" => Family::DeepseekV3,
            "gemma2" => Family::Gemma2,
            "gemma3_text" => Family::Gemma3,
            "nemotron_h" => Family::NemotronH,
            _ => {
                return Err(BuildError::unsupported(
                    "model_type",
                    &Json::String(model_type.clone()),
                    "supported: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, minimax_m2, \
                     gpt_oss, deepseek_v3, kimi_k2, glm_moe_dsa, gemma2, gemma3_text, nemotron_h",
                ))
            }
        };
        let hidden = cfg.u64("hidden_size")?;
        if hidden == 0 {
            return Err(BuildError::bad("hidden_size", "must be > 0"));
        }
        let vocab = cfg.u64("vocab_size")?;
        if vocab == 0 {
            return Err(BuildError::bad("vocab_size", "must be > 0"));
        }
        let n_layers = cfg.u64("num_hidden_layers")?;
        if n_layers == 0 || n_layers > u64::from(u32::MAX) {
            return Err(BuildError::bad(
                "num_hidden_layers",
                "must be in 1..=u32::MAX",
            ));
        }
        let keep = match layers {
            None => n_layers,
            Some(n) if u64::from(n) <= n_layers => u64::from(n),
            Some(n) => {
                return Err(BuildError::BadOption {
                    option: "layers",
                    reason: format!("{n} exceeds num_hidden_layers = {n_layers}"),
                })
            }
        };
        let eps = cfg.f64_any(&["rms_norm_eps", "layer_norm_epsilon", "norm_eps"])?;
        let dtype = match cfg.opt_str("torch_dtype").or_else(|| cfg.opt_str("dtype")) {
            None | Some("bfloat16") => DType::Bf16,
            Some("float16") => DType::F16,
            Some(other) => {
                return Err(BuildError::unsupported(
                    "torch_dtype",
                    &Json::String(other.into()),
                    "activations must be bfloat16 or float16",
                ))
            }
        };
        let heads = cfg.u64("num_attention_heads")?;
        if heads == 0 {
            return Err(BuildError::bad("num_attention_heads", "must be > 0"));
        }
        let kv_heads = cfg.opt_u64("num_key_value_heads")?.unwrap_or(heads);
        if kv_heads == 0 {
            return Err(BuildError::bad("num_key_value_heads", "must be > 0"));
        }
        let head_dim = match cfg.opt_u64("head_dim")? {
            Some(d) if d > 0 => d,
            Some(_) => return Err(BuildError::bad("head_dim", "must be > 0")),
            None => hidden / heads,
        };
        let mla = if cfg.get("kv_lora_rank").is_some() {
            let indexer = match cfg.opt_u64("index_n_heads")? {
                None => None,
                Some(h) => Some(Indexer {
                    heads: h,
                    head_dim: cfg.u64("index_head_dim")?,
                    topk: cfg.u64("index_topk")?,
                }),
            };
            Some(Mla {
                q_lora_rank: cfg.opt_u64("q_lora_rank")?,
                kv_lora_rank: cfg.u64("kv_lora_rank")?,
                qk_nope_head_dim: cfg.u64("qk_nope_head_dim")?,
                qk_rope_head_dim: cfg.u64("qk_rope_head_dim")?,
                v_head_dim: cfg.u64("v_head_dim")?,
                indexer,
            })
        } else {
            None
        };
        let mlp_act = cfg
            .opt_str("hidden_activation")
            .or_else(|| cfg.opt_str("mlp_hidden_act"))
            .or_else(|| cfg.opt_str("hidden_act"))
            .unwrap_or("silu")
            .to_string();
        let experts = cfg.opt_u64_any(&["n_routed_experts", "num_experts", "num_local_experts"])?;
        let moe = match experts {
            Some(e) if e > 0 => {
                let ffn = cfg.u64_any(&["moe_intermediate_size", "intermediate_size"])?;
                let shared_experts = cfg.opt_u64("n_shared_experts")?.unwrap_or(0);
                let shared_ffn = match cfg.opt_u64_any(&[
                    "moe_shared_expert_intermediate_size",
                    "shared_intermediate_size",
                ])? {
                    Some(s) => s,
                    None => ffn * shared_experts,
                };
                Some(Moe {
                    experts: e,
                    top_k: cfg.u64_any(&["num_experts_per_tok", "experts_per_token"])?,
                    ffn,
                    shared_experts,
                    shared_ffn,
                    activation: if model_type == "gpt_oss" {
                        "swigluoai".to_string()
                    } else {
                        mlp_act.clone()
                    },
                })
            }
            _ => None,
        };
        let (layer_kinds, mamba) = if family == Family::NemotronH {
            let field = "hybrid_override_pattern";
            let pattern = cfg.str(field)?;
            if pattern.chars().count() as u64 != n_layers {
                return Err(BuildError::bad(
                    field,
                    format!(
                        "has {} entries, num_hidden_layers is {n_layers}",
                        pattern.chars().count()
                    ),
                ));
            }
            let mut kinds = Vec::new();
            for c in pattern.chars() {
                kinds.push(LayerKind::Block(match c {
                    'M' => BlockMixer::Mamba,
                    '*' => BlockMixer::Attention,
                    'E' => BlockMixer::Moe,
                    '-' => BlockMixer::Mlp,
                    _ => {
                        return Err(BuildError::bad(
                            field,
                            format!(
                                "unknown block {c:?} (M = Mamba2, * = attention, E = MoE, - = MLP)"
                            ),
                        ))
                    }
                }));
            }
            let mamba = if pattern.contains('M') {
                Some(Mamba {
                    heads: cfg.u64("mamba_num_heads")?,
                    head_dim: cfg.u64("mamba_head_dim")?,
                    groups: cfg.u64("n_groups")?,
                    state: cfg.u64("ssm_state_size")?,
                    conv_kernel: cfg.u64("conv_kernel")?,
                })
            } else {
                None
            };
            if pattern.contains('E') && moe.is_none() {
                return Err(BuildError::missing("n_routed_experts"));
            }
            (kinds, mamba)
        } else {
            let mut kinds = Vec::new();
            let first_dense = cfg.opt_u64("first_k_dense_replace")?.unwrap_or(0);
            let freq = cfg.opt_u64("moe_layer_freq")?.unwrap_or(1).max(1);
            let step = cfg.opt_u64("decoder_sparse_step")?.unwrap_or(1).max(1);
            let mlp_only: Vec<u64> = match cfg.get("mlp_only_layers") {
                None => Vec::new(),
                Some(v) => v
                    .as_array()
                    .map(|a| a.iter().filter_map(Json::as_u64).collect())
                    .ok_or_else(|| {
                        BuildError::bad("mlp_only_layers", "expected a list of layer indices")
                    })?,
            };
            for i in 0..n_layers {
                let is_moe = moe.is_some()
                    && i >= first_dense
                    && i % freq == 0
                    && (i + 1) % step == 0
                    && !mlp_only.contains(&i);
                kinds.push(LayerKind::Decoder { moe: is_moe });
            }
            (kinds, None)
        };
        let needs_dense = layer_kinds[..keep as usize].iter().any(|k| {
            matches!(
                k,
                LayerKind::Decoder { moe: false } | LayerKind::Block(BlockMixer::Mlp)
            )
        });
        let ffn = if needs_dense {
            cfg.u64("intermediate_size")?
        } else {
            cfg.opt_u64("intermediate_size")?.unwrap_or(0)
        };
        let sliding = sliding_windows(&cfg, &model_type, n_layers)?;
        let quant = QuantSpec::from_config(&cfg)?;
        let attn_bias = cfg.bool("attention_bias")?;
        let qk_norm = matches!(model_type.as_str(), "qwen3" | "qwen3_moe" | "gemma3_text")
            || cfg.bool("use_qk_norm")?;
        let keep = keep as usize;
        Ok(ModelSpec {
            model_type,
            family,
            hidden,
            vocab,
            eps,
            dtype,
            heads,
            kv_heads,
            head_dim,
            attn_bias,
            qk_norm,
            mla,
            ffn,
            mlp_act,
            moe,
            mamba,
            layers: layer_kinds[..keep].to_vec(),
            sliding: sliding[..keep].to_vec(),
            quant,
        })
    }
}

/// Per-layer sliding windows: gpt-oss `layer_types`, Gemma-2 (even layers), Gemma-3
/// (`sliding_window_pattern`: every Nth layer is global), else a global
/// `sliding_window` when `use_sliding_window` is not false.
fn sliding_windows(cfg: &Cfg, model_type: &str, n: u64) -> Result<Vec<Option<u64>>> {
    let window = cfg.opt_u64("sliding_window")?;
    let n = n as usize;
    let Some(w) = window else {
        return Ok(vec![None; n]);
    };
    if let Some(types) = cfg.get("layer_types") {
        let a = types
            .as_array()
            .ok_or_else(|| BuildError::bad("layer_types", "expected a list"))?;
        if a.len() != n {
            return Err(BuildError::bad(
                "layer_types",
                format!("has {} entries, num_hidden_layers is {n}", a.len()),
            ));
        }
        return Ok(a
            .iter()
            .map(|t| (t.as_str() == Some("sliding_attention")).then_some(w))
            .collect());
    }
    Ok(match model_type {
        "gemma2" => (0..n).map(|i| (i % 2 == 0).then_some(w)).collect(),
        "gemma3_text" => {
            let p = cfg.opt_u64("sliding_window_pattern")?.unwrap_or(6).max(1) as usize;
            (0..n).map(|i| ((i + 1) % p != 0).then_some(w)).collect()
        }
        _ => {
            if cfg.get("use_sliding_window").and_then(Json::as_bool) == Some(false) {
                vec![None; n]
            } else {
                vec![Some(w); n]
            }
        }
    })
}
