//! Every architecture of ir-fixtures/configs, exported by tools/export from Hugging Face
//! modeling code (ir-fixtures/exported/hf: two TP sizes, dynamic and static T), lowered
//! for a target of its TP size: each export holds the all-reduces the exporter
//! inserted, fuses exactly the sites its modeling code has (docs/architectures.md
//! derives them), with the RMSNorm rounding its code spells, and refuses each non-site
//! for its reason. Also the post-grad graphs torch.compile produced
//! (ir-fixtures/postgrad) and the other all-reduce spellings
//! (ir-fixtures/exported/spellings).

use arfuse::advanced::import::{CustomAllReduce, ImportOptions};
use arfuse::advanced::ir::{NormRounding, Op};
use arfuse::{Graph, Target};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// What a correct pass does with one architecture's exports.
struct Expect {
    /// Config stem (the export file names start with it).
    stem: &'static str,
    /// Fusion sites (all-reduce -> (residual add ->) RMSNorm chains).
    sites: usize,
    /// The RMSNorm rounding and weight bias every fused node must carry.
    rounding: NormRounding,
    weight_bias: f64,
    /// All-reduces that are not sites: (all-reduce module, reason fragment).
    refused: &'static [(&'static str, &'static str)],
}

const TWICE: NormRounding = NormRounding::Twice;
const ONCE: NormRounding = NormRounding::Once;
const GEMMA_EMBEDDING: &[(&str, &str)] = &[(
    "model.embed_tokens",
    "no residual add + RMSNorm follows the all-reduce: its output feeds `mul`",
)];

/// One row per config of ir-fixtures/configs. Dense and MoE decoders with L layers:
/// 2L + 1 sites; Nemotron-H (one mixer a block): L + 1; Gemma (sandwich norms, the
/// embedding all-reduce feeds the sqrt(H) scale): 2L.
const EXPECT: &[Expect] = &[
    row("llama_3_1_8b_instruct", 5, TWICE),
    row("llama_3_1_70b_instruct", 5, TWICE),
    row("meta_llama_3_1_405b", 5, TWICE),
    row("deepseek_v3", 9, TWICE),
    row("deepseek_r1", 9, TWICE),
    row("deepseek_v3_1_nvfp4", 9, TWICE),
    row("kimi_k2_instruct", 5, TWICE),
    row("glm_5", 9, TWICE),
    row("glm_5_fp8", 9, TWICE),
    row("qwen3_8b", 5, TWICE),
    row("qwen3_30b_a3b", 5, TWICE),
    row("qwen3_235b_a22b", 5, TWICE),
    row("qwen3_235b_a22b_nvfp4", 5, TWICE),
    row("mixtral_8x7b_v0_1", 5, TWICE),
    row("minimax_m2_5", 5, TWICE),
    row("minimax_m2_5_nvfp4", 5, TWICE),
    // `(self.weight * hidden_states).to(input_dtype)`: a bf16 weight times f32
    // activations (torch's promotion), one rounding.
    row("gpt_oss_120b", 5, ONCE),
    // `(self.weight.to(torch.float32) * hidden_states).to(input_dtype)`.
    row("nvidia_nemotron_3_nano_30b_a3b_bf16", 7, ONCE),
    gemma("gemma_2_9b"),
    gemma("gemma_2_27b"),
    gemma("gemma_3_1b_it"),
];

const fn row(stem: &'static str, sites: usize, rounding: NormRounding) -> Expect {
    Expect {
        stem,
        sites,
        rounding,
        weight_bias: 0.0,
        refused: &[],
    }
}

const fn gemma(stem: &'static str) -> Expect {
    Expect {
        stem,
        sites: 4,
        rounding: ONCE,
        weight_bias: 1.0,
        refused: GEMMA_EMBEDDING,
    }
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn manifest(dir: &Path) -> Vec<Value> {
    let m: Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    m["exports"].as_array().unwrap().clone()
}

fn target(world_size: u32) -> Target {
    let mut t = Target::preset("h200-sxm-x8").unwrap();
    t.world_size = world_size;
    t.validate().unwrap();
    t
}

fn import(path: &Path, opts: &ImportOptions) -> arfuse::advanced::import::Imported {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    arfuse::advanced::import::load_any_with(&bytes, opts)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Lowers and checks one graph against its row; returns a summary line.
fn check(name: &str, g: &Graph, world: u32, all_reduces: usize, e: &Expect) -> String {
    let l = arfuse::lower(g, &target(world)).unwrap_or_else(|err| panic!("{name}: {err}"));
    let r = &l.report;
    assert_eq!(r.all_reduces_seen, all_reduces, "{name}\n{r}");
    assert_eq!(r.all_reduces_fused, e.sites, "{name}\n{r}");
    assert_eq!(
        r.all_reduces_seen - r.all_reduces_fused,
        e.refused.len(),
        "{name}\n{r}"
    );
    assert!(r.unknown_collectives.is_empty(), "{name}\n{r}");
    for (module, why) in e.refused {
        let s = r
            .sites
            .iter()
            .find(|s| s.all_reduce_module.as_deref() == Some(*module))
            .unwrap_or_else(|| panic!("{name}: no all-reduce in {module}\n{r}"));
        assert!(!s.fused, "{name}: {module} fused\n{r}");
        let reason = s.reason.as_deref().unwrap_or_default();
        assert!(reason.contains(why), "{name}: {module}: {reason}");
    }
    let mut fused = 0;
    for (_, n) in l.graph.nodes() {
        if let Op::FusedAllreduceNorm(f) = &n.op {
            fused += 1;
            assert_eq!(f.norm_rounding, e.rounding, "{name}: {}", n.id);
            assert_eq!(f.weight_bias, e.weight_bias, "{name}: {}", n.id);
        }
    }
    assert_eq!(fused, e.sites, "{name}");
    format!(
        "{name}: {} all-reduces, {} fused ({}, weight_bias {})",
        r.all_reduces_seen,
        r.all_reduces_fused,
        e.rounding.name(),
        e.weight_bias
    )
}

fn expect_for(stem_of_file: &str) -> &'static Expect {
    EXPECT
        .iter()
        .filter(|e| {
            stem_of_file.starts_with(e.stem) && stem_of_file[e.stem.len()..].starts_with("_L")
        })
        .max_by_key(|e| e.stem.len())
        .unwrap_or_else(|| panic!("{stem_of_file}: no row in EXPECT"))
}

#[test]
fn every_architecture_fuses_its_expected_sites() {
    let dir = root().join("ir-fixtures/exported/hf");
    let exports = manifest(&dir);
    let mut summary = String::new();
    let mut configs = BTreeSet::new();
    for e in &exports {
        let file = e["file"].as_str().unwrap();
        let world = e["tp"].as_u64().unwrap() as u32;
        let inserted = e["all_reduces_after"].as_array().unwrap().len();
        configs.insert(e["config"].as_str().unwrap().to_string());
        let imp = import(&dir.join(file), &ImportOptions::default());
        let line = check(file, &imp.graph, world, inserted, expect_for(file));
        summary.push_str(&line);
        summary.push('\n');
    }
    // Every config of the corpus, two TP sizes, dynamic and static T.
    let all: BTreeSet<String> = std::fs::read_dir(root().join("ir-fixtures/configs"))
        .unwrap()
        .map(|d| d.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".json"))
        .collect();
    assert_eq!(configs, all);
    assert_eq!(exports.len(), 4 * all.len());
    assert_eq!(EXPECT.len(), all.len());
    insta::assert_snapshot!("hf_exports", summary);
}

#[test]
fn post_grad_graphs_from_torch_compile_fuse_like_their_exports() {
    let dir = root().join("ir-fixtures/postgrad");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_string_lossy().to_string();
        if !file.ends_with(".json.gz") {
            continue;
        }
        n += 1;
        let imp = import(&path, &ImportOptions::default());
        let e = expect_for(&file);
        // The all-reduces are the ones a serving engine runs: embedding, and two a layer.
        check(&file, &imp.graph, 2, e.sites + e.refused.len(), e);
        // Post-grad spellings really occur: casts are prims.convert_element_type.
        let raw = std::fs::read(&path).unwrap();
        let text = String::from_utf8(flate(&raw)).unwrap();
        assert!(
            text.contains("torch.ops.prims.convert_element_type.default"),
            "{file}"
        );
        assert!(!text.contains("torch.ops.aten.to.dtype\""), "{file}");
    }
    assert!(n >= 4, "{n} post-grad graphs");
}

fn flate(gz: &[u8]) -> Vec<u8> {
    use std::io::Read;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut out)
        .unwrap();
    out
}

#[test]
fn every_all_reduce_spelling_of_llama_fuses_or_is_named() {
    let dir = root().join("ir-fixtures/exported/spellings");
    let llama = expect_for("llama_3_1_8b_instruct_L2");
    for spelling in ["dist_all_reduce", "inplace_functional"] {
        let path = dir.join(format!("llama_3_1_8b_instruct_L2_tp8_{spelling}.json.gz"));
        let imp = import(&path, &ImportOptions::default());
        check(spelling, &imp.graph, 8, 5, llama);
    }
    // vLLM's own op: kept opaque and warned about unless named.
    let path = dir.join("llama_3_1_8b_instruct_L2_tp8_vllm_all_reduce.json.gz");
    let plain = import(&path, &ImportOptions::default());
    assert!(plain
        .notes
        .iter()
        .any(|n| n.starts_with("warning: vllm.all_reduce.default")));
    let l = arfuse::lower(&plain.graph, &target(8)).unwrap();
    assert_eq!(l.report.all_reduces_seen, 0);
    assert_eq!(
        l.report.unknown_collectives,
        vec!["vllm.all_reduce.default"]
    );
    let text = l.report.to_string();
    assert!(text.contains("sites may be missed"), "{text}");
    assert!(
        text.contains("only collective-looking opaque ops"),
        "{text}"
    );
    let named =
        ImportOptions::default().with_all_reduce_op(CustomAllReduce::new("vllm.all_reduce"));
    let imp = import(&path, &named);
    check("vllm_all_reduce named", &imp.graph, 8, 5, llama);
}
