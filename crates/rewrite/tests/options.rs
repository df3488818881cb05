//! `LowerOptions::shared_hidden_sizes` is checked for every graph: an invalid size is
//! an error naming it whether or not the graph has a fusion site.

use arfuse_ir::Graph;
use arfuse_policy::Target;
use arfuse_rewrite::{lower_with, LowerError, LowerOptions};

const HDR: &str = r#"{"format": "arfuse-graph", "version": 1, "symbols": {"T": {"min": 1, "max": 64}}, "nodes": ["#;

/// A graph with no all-reduce: one input read by one rsqrt.
fn no_site() -> Graph {
    let s = format!(
        r#"{HDR}
{{"id": "x", "op": "input", "outputs": [{{"dtype": "bf16", "shape": ["T", 4096]}}]}},
{{"id": "y", "op": "rsqrt", "inputs": ["x"], "outputs": [{{"dtype": "bf16", "shape": ["T", 4096]}}]}}
], "outputs": ["y"]}}"#
    );
    Graph::from_json_str(&s).unwrap()
}

/// One fusable site: all-reduce -> fused add + RMSNorm.
fn one_site() -> Graph {
    let s = format!(
        r#"{HDR}
{{"id": "x", "op": "input", "outputs": [{{"dtype": "bf16", "shape": ["T", 4096]}}]}},
{{"id": "res", "op": "input", "outputs": [{{"dtype": "bf16", "shape": ["T", 4096]}}]}},
{{"id": "w", "op": "input", "attrs": {{"kind": "parameter"}}, "outputs": [{{"dtype": "bf16", "shape": [4096]}}]}},
{{"id": "ar", "op": "all_reduce", "attrs": {{"group": "tp"}}, "inputs": ["x"], "outputs": [{{"dtype": "bf16", "shape": ["T", 4096]}}]}},
{{"id": "n", "op": "fused_add_rms_norm", "attrs": {{"eps": 1e-6}}, "inputs": ["ar", "res", "w"], "outputs": [{{"dtype": "bf16", "shape": ["T", 4096]}}, {{"dtype": "bf16", "shape": ["T", 4096]}}]}}
], "outputs": ["n", "n:1"]}}"#
    );
    Graph::from_json_str(&s).unwrap()
}

#[test]
fn an_invalid_shared_hidden_size_is_refused_for_every_graph() {
    let target = Target::preset("h200-sxm-x8").unwrap();
    for (name, g, sites) in [("no site", no_site(), 0), ("one site", one_site(), 1)] {
        let ok = lower_with(&g, &target, &LowerOptions::default()).unwrap();
        assert_eq!(ok.report.all_reduces_fused, sites, "{name}");
        for bad in [0u64, 1 << 40] {
            let options = LowerOptions::default().with_shared_hidden_sizes(vec![bad]);
            let e = lower_with(&g, &target, &options).unwrap_err();
            assert!(matches!(e, LowerError::Policy(_)), "{name}, H = {bad}: {e}");
            assert!(e.to_string().contains(&bad.to_string()), "{name}: {e}");
        }
        let options = LowerOptions::default().with_shared_hidden_sizes(vec![8192]);
        assert!(lower_with(&g, &target, &options).is_ok(), "{name}");
    }
}
