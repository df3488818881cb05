//! Graphs torch.export wrote from real modeling code (ir-fixtures/exported/): they
//! import, round-trip through arfuse JSON, and lower with exactly the site counts
//! their README gives, each site named by its module path.

use arfuse::{Graph, Target};
use std::path::PathBuf;

fn import(name: &str) -> Graph {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("ir-fixtures/exported")
        .join(name);
    let bytes = std::fs::read(&p).unwrap();
    arfuse::advanced::import::load_any(&bytes)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .graph
}

/// A preset with the export's tensor-parallel size.
fn target(preset: &str, world_size: u32) -> Target {
    let mut t = Target::preset(preset).unwrap();
    t.world_size = world_size;
    t.validate().unwrap();
    t
}

fn check(file: &str, t: Target, expected_sites: usize, expected_names: &[&str]) {
    let g = import(file);
    // Round trip through arfuse's own format first: the pass sees the same graph.
    let g = Graph::from_json_str(&g.to_json_string()).unwrap();
    let lowered = arfuse::lower(&g, &t).unwrap();
    let r = &lowered.report;
    assert_eq!(r.all_reduces_seen, expected_sites, "{file}\n{r}");
    assert_eq!(r.all_reduces_fused, expected_sites, "{file}\n{r}");
    // Every site on its own line (the default table groups layers).
    let text = r.display_every_site().to_string();
    for name in expected_names {
        assert!(
            text.contains(name),
            "{file}: the report does not name {name:?}\n{text}"
        );
    }
    let fused = lowered
        .graph
        .nodes()
        .filter(|(_, n)| matches!(n.op, arfuse::advanced::ir::Op::FusedAllreduceNorm(_)))
        .count();
    assert_eq!(fused, expected_sites);
    let stem = file.trim_end_matches(".exported_program.json");
    insta::assert_snapshot!(format!("{stem}_report"), text);
}

#[test]
fn llama31_8b_tp8_fuses_its_five_sites() {
    check(
        "llama31_8b_L2_tp8.exported_program.json",
        target("h200-sxm-x8", 8),
        5,
        &["layers.1.mlp", "layers.1.post_attention_layernorm", "norm"],
    );
}

#[test]
fn qwen3_30b_a3b_tp4_fuses_its_five_sites_and_not_the_qk_norms() {
    let file = "qwen3_30b_a3b_L2_tp4.exported_program.json";
    check(
        file,
        target("b300-x4", 4),
        5,
        &["layers.0.mlp", "layers.1.input_layernorm"],
    );
    // The q/k RMSNorms of attention (per head, no all-reduce before them) stay as they
    // were: every node of their modules is kept with its id and op, and no fused node
    // comes from them.
    let g = import(file);
    let lowered = arfuse::lower(&g, &target("b300-x4", 4)).unwrap();
    let qk = |m: &Option<String>| {
        m.as_deref()
            .is_some_and(|m| m.ends_with("self_attn.q_norm") || m.ends_with("self_attn.k_norm"))
    };
    let mut kept = 0;
    for (_, n) in g.nodes().filter(|(_, n)| qk(&n.module)) {
        let id = lowered
            .graph
            .find(&n.id)
            .unwrap_or_else(|| panic!("q/k norm node {} was removed", n.id));
        assert_eq!(lowered.graph.node(id).op, n.op, "{}", n.id);
        kept += 1;
    }
    // Two layers, a q and a k norm each, at least a norm node per module.
    let modules: std::collections::BTreeSet<&str> = g
        .nodes()
        .filter_map(|(_, n)| n.module.as_deref())
        .filter(|m| qk(&Some(m.to_string())))
        .collect();
    assert_eq!(modules.len(), 4, "{modules:?}");
    assert!(kept >= 4, "{kept} q/k norm nodes");
    for (_, n) in lowered.graph.nodes() {
        if matches!(n.op, arfuse::advanced::ir::Op::FusedAllreduceNorm(_)) {
            assert!(!qk(&n.module), "{} fused a q/k norm", n.id);
        }
    }
}

#[test]
fn gemma3_1b_tp2_fuses_its_five_sandwich_sites() {
    let g = import("gemma3_1b_L2_tp2.exported_program.json");
    check(
        "gemma3_1b_L2_tp2.exported_program.json",
        target("h100-sxm-x8", 2),
        5,
        &["post_attention_layernorm", "post_feedforward_layernorm"],
    );
    // Every fused Gemma node uses the offset weight.
    let lowered = arfuse::lower(&g, &target("h100-sxm-x8", 2)).unwrap();
    for (_, n) in lowered.graph.nodes() {
        if let arfuse::advanced::ir::Op::FusedAllreduceNorm(a) = &n.op {
            assert_eq!(a.weight_bias, 1.0, "{}", n.id);
            assert!(matches!(a.quant, arfuse::advanced::ir::FusedQuant::None));
        }
    }
}
