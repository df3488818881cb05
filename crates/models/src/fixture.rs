//! The committed model corpus under `ir-fixtures/models/`: one graph per entry of
//! [`corpus`], each with a sibling `<name>.options.json` ([`FixtureOptions`]) naming
//! its config, build options, the arfuse-policy target presets it is lowered for (each
//! with W equal to the fixture's TP size) and its expected site count.

use crate::error::Result;
use crate::options::{BuildOptions, NormForm};
use crate::sites::SiteCount;
use arfuse_ir::Graph;
use serde::{Deserialize, Serialize};

/// Which graph a fixture holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GraphKind {
    /// [`crate::build`]: the model's decoder.
    #[default]
    Decoder,
    /// [`crate::build_eagle3_draft`]: an EAGLE-3 draft of the config's model.
    Eagle3Draft,
}

/// The sibling `<name>.options.json` of a fixture.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixtureOptions {
    /// The config.json, relative to `ir-fixtures/` (`configs/<file>.json`).
    pub config: String,
    /// Which graph is built from it.
    #[serde(default)]
    pub graph: GraphKind,
    /// Build options.
    pub build: BuildOptions,
    /// arfuse-policy target presets this graph is lowered for (W = `build.tp`).
    pub targets: Vec<String>,
    /// Expected fusion sites ([`crate::expected_sites`]).
    pub expected_sites: u32,
    /// All-reduces in the graph.
    pub all_reduces: u32,
    /// Sites whose norm output feeds a quant op.
    pub sites_with_quant: u32,
    /// The count rule with its L.
    pub site_rule: String,
    /// Fixtures whose graphs run on the same all-reduce workspace (a speculative draft
    /// and its target): a workspace must be sized for all of them.
    #[serde(default)]
    pub shares_workspace_with: Vec<String>,
    /// Free-form notes (what the fixture is for, known caveats).
    #[serde(default)]
    pub notes: String,
}

/// One corpus entry: the fixture's file stem and its options.
#[derive(Clone, Debug)]
pub struct FixtureSpec {
    /// File stem under `ir-fixtures/models/`.
    pub name: &'static str,
    /// Config file name under `ir-fixtures/configs/`.
    pub config_file: &'static str,
    /// Graph kind.
    pub graph: GraphKind,
    /// Build options.
    pub build: BuildOptions,
    /// Target presets.
    pub targets: &'static [&'static str],
    /// Workspace-sharing fixtures.
    pub shares_workspace_with: &'static [&'static str],
    /// Notes.
    pub notes: &'static str,
}

const X8: &[&str] = &["h200-sxm-x8", "h100-sxm-x8", "b200-x8"];

fn opts(tp: u32) -> BuildOptions {
    BuildOptions::tp(tp)
}

/// The corpus, in a fixed order.
pub fn corpus() -> Vec<FixtureSpec> {
    let spec = |name, config_file, build, targets, notes| FixtureSpec {
        name,
        config_file,
        graph: GraphKind::Decoder,
        build,
        targets,
        shares_workspace_with: &[],
        notes,
    };
    let decomposed_3d = BuildOptions {
        norm_form: NormForm::Decomposed,
        three_d: true,
        ..opts(8)
    };
    let gemma_decomposed = BuildOptions {
        norm_form: NormForm::Decomposed,
        ..opts(4)
    };
    vec![
        spec(
            "llama31_8b_tp8",
            "meta-llama__Llama-3.1-8B-Instruct.json",
            opts(8),
            &["h200-sxm-x8", "h200-nvl-x8", "h100-sxm-x8", "b200-x8", "gb200-nvl72-2node-tp8"],
            "dense bf16 baseline; h200-nvl-x8 expects no fusion (bridged NVLink)",
        ),
        spec(
            "llama31_8b_decomposed_3d_tp8",
            "meta-llama__Llama-3.1-8B-Instruct.json",
            decomposed_3d,
            &["h200-sxm-x8", "b200-x8"],
            "RMSNorm decomposed as torch emits it, activations [B, S, H], all-reduces on [B*S, H] views",
        ),
        FixtureSpec {
            name: "llama31_8b_eagle3_draft_tp8",
            config_file: "meta-llama__Llama-3.1-8B-Instruct.json",
            graph: GraphKind::Eagle3Draft,
            build: opts(8),
            targets: &["h200-sxm-x8", "b200-x8"],
            shares_workspace_with: &["llama31_8b_tp8"],
            notes: "EAGLE-3 draft (1 layer, the target's hidden size 4096, TP8) built from the target config; \
                    runs on the target's all-reduce workspace",
        },
        spec(
            "llama31_405b_tp8",
            "meta-llama__Meta-Llama-3.1-405B.json",
            opts(8),
            &["h200-sxm-x8", "b200-x8", "gb200-nvl72-2node-tp8"],
            "126 layers, H = 16384 (base config; Instruct has the same architecture)",
        ),
        spec(
            "deepseek_v3_tp8",
            "deepseek-ai__DeepSeek-V3.json",
            opts(8),
            X8,
            "MLA, 3 dense layers then MoE, block-FP8: per-token-group quant after every input and post-attention norm; \
             MoE norms keep a live bf16 output (router); MTP layer not built",
        ),
        spec(
            "glm5_fp8_tp8",
            "zai-org__GLM-5-FP8.json",
            opts(8),
            &["h200-sxm-x8", "h200-nvl-x8", "b200-x8"],
            "seed-bug model (H = 6144, W = 8 on H200); MLA + DSA indexer, 3 dense layers then MoE, block-FP8; \
             indexers_proj is in modules_to_not_convert so every input norm keeps a live bf16 output besides its quant",
        ),
        spec(
            "qwen3_30b_a3b_tp4",
            "Qwen__Qwen3-30B-A3B.json",
            opts(4),
            &["b300-x4", "rtx-pro-6000-x4"],
            "MoE bf16; per-head q/k norms inside the attention op; rtx-pro-6000-x4 expects no fusion (PCIe)",
        ),
        spec(
            "qwen3_235b_a22b_nvfp4_tp4",
            "nvidia__Qwen3-235B-A22B-NVFP4.json",
            opts(4),
            &["b300-x4", "rtx-pro-6000-x4"],
            "NVFP4 (modelopt _hf_quant_config): quant_nvfp4 after every input and post-attention norm; \
             router gates excluded (bf16 norm output stays live for MoE layers)",
        ),
        spec(
            "deepseek_v31_nvfp4_tp8",
            "nvidia__DeepSeek-V3.1-NVFP4.json",
            opts(8),
            &["b200-x8", "gb200-nvl72-2node-tp8"],
            "NVFP4 with the MLA projections excluded: no quant after input norms (bf16 q_a/kv_a), \
             quant_nvfp4 after post-attention norms (dense MLP and MoE)",
        ),
        spec(
            "minimax_m25_nvfp4_tp4",
            "nvidia__MiniMax-M2.5-NVFP4.json",
            opts(4),
            &["b300-x4"],
            "NVFP4 declared in quantization_config (quant_algo NVFP4, ignore list with self_attn* globs): \
             no quant before attention, quant_nvfp4 before every MoE",
        ),
        spec(
            "gemma2_9b_tp4",
            "google__gemma-2-9b.json",
            opts(4),
            &["b300-x4", "rtx-pro-6000-x4"],
            "offset (1 + w) sandwich norms with f32 weights; the sqrt(H) normaliser after the embedding all-reduce \
             makes that all-reduce no site (2L)",
        ),
        spec(
            "gemma3_1b_tp4",
            "google__gemma-3-1b-it.json",
            opts(4),
            &["b300-x4", "rtx-pro-6000-x4"],
            "offset sandwich norms; scaled embedding before the all-reduce (2L + 1); TP4 so that a preset's W matches \
             (the exported torch graph is TP2)",
        ),
        spec(
            "gemma3_1b_decomposed_tp4",
            "google__gemma-3-1b-it.json",
            gemma_decomposed,
            &["b300-x4"],
            "Gemma norms decomposed as torch emits them: x.float() * rsqrt(...) * (1 + w.float()), then to bf16",
        ),
        spec(
            "nemotron3_nano_tp4",
            "nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.json",
            opts(4),
            &["b300-x4", "rtx-pro-6000-x4"],
            "hybrid Mamba2 / attention / MoE blocks per hybrid_override_pattern, one norm each (L + 1)",
        ),
        spec(
            "gpt_oss_120b_tp4",
            "openai__gpt-oss-120b.json",
            opts(4),
            &["b300-x4", "rtx-pro-6000-x4"],
            "MoE with MXFP4 expert weights: no activation quant op (bf16 activations into the MoE); \
             attention biases (o_proj bias before the all-reduce, rank 0 in vLLM)",
        ),
        spec(
            "mixtral_8x7b_tp8",
            "mistralai__Mixtral-8x7B-v0.1.json",
            opts(8),
            &["h100-sxm-x8", "h200-nvl-x8"],
            "MoE bf16, 8 experts top-2",
        ),
    ]
}

impl FixtureSpec {
    /// Builds the graph from `config` and its options file.
    pub fn build(&self, config: &serde_json::Value) -> Result<(Graph, FixtureOptions)> {
        let (graph, sites): (Graph, SiteCount) = match self.graph {
            GraphKind::Decoder => (
                crate::build(config, &self.build)?,
                crate::expected_sites(config, &self.build)?,
            ),
            GraphKind::Eagle3Draft => (
                crate::build_eagle3_draft(config, &self.build)?,
                crate::expected_draft_sites(config, &self.build)?,
            ),
        };
        let options = FixtureOptions {
            config: format!("configs/{}", self.config_file),
            graph: self.graph,
            build: self.build.clone(),
            targets: self.targets.iter().map(|s| s.to_string()).collect(),
            expected_sites: sites.sites,
            all_reduces: sites.all_reduces,
            sites_with_quant: sites.with_quant,
            site_rule: sites.rule,
            shares_workspace_with: self
                .shares_workspace_with
                .iter()
                .map(|s| s.to_string())
                .collect(),
            notes: self.notes.split_whitespace().collect::<Vec<_>>().join(" "),
        };
        Ok((graph, options))
    }
}

impl FixtureOptions {
    /// The options file text: pretty JSON and a final newline.
    pub fn to_json_string(&self) -> String {
        let mut s = serde_json::to_string_pretty(self).unwrap_or_default();
        s.push('\n');
        s
    }
}
