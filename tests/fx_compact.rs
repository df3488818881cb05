//! The compact FX form end to end: the 2-layer Llama post-grad graph as
//! the Python extension hands it over (`ir-fixtures/fx/`), imported, lowered and spliced as
//! `arfuse.torch.FusionPass` does, and its JSON form (what `_fx_graph_json` writes).

use arfuse::advanced::import::torch_export::fx::{self, FxArg, FxGraph};
use arfuse::advanced::import::ImportOptions;
use arfuse::advanced::ir::Op;
use arfuse::splice::splice;
use arfuse::Target;
use std::io::Read;

fn two_layers() -> FxGraph {
    let path = format!(
        "{}/ir-fixtures/fx/llama_2l_tp2.fx.json.gz",
        env!("CARGO_MANIFEST_DIR")
    );
    let raw = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut text = String::new();
    flate2::read::MultiGzDecoder::new(&raw[..])
        .read_to_string(&mut text)
        .unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn two_layer_graph_lowers_and_splices_every_site() {
    let imp = fx::import(&two_layers(), &ImportOptions::default()).unwrap();
    let lowered = arfuse::lower(&imp.graph, &Target::preset("h200-sxm-x2").unwrap()).unwrap();
    // The embedding's all-reduce and two per layer.
    assert_eq!(lowered.report.all_reduces_seen, 5);
    assert_eq!(lowered.report.all_reduces_fused, 5);
    let fused = lowered
        .graph
        .nodes()
        .filter(|(_, n)| matches!(n.op, Op::FusedAllreduceNorm(_)))
        .count();
    assert_eq!(fused, 5);
    let s = splice(&imp.graph, &imp.tensors, &lowered.graph).unwrap();
    assert!(s.skipped.is_empty(), "{:?}", s.skipped);
    let ars: Vec<&str> = s.sites.iter().map(|x| x.all_reduce.as_str()).collect();
    assert_eq!(
        ars,
        [
            "all_reduce",
            "all_reduce_1",
            "all_reduce_2",
            "all_reduce_3",
            "all_reduce_4"
        ]
    );
    for site in &s.sites {
        assert_eq!(site.attrs.group, "0");
        assert_eq!(site.attrs.eps, 1e-5);
    }
}

#[test]
fn json_form_round_trips_with_a_non_finite_float() {
    let mut g = two_layers();
    // A fill value of -inf (as an attention mask has), written as text.
    let n = g
        .nodes
        .iter_mut()
        .find(|n| n.target == "aten.full.default")
        .unwrap();
    let fill = n
        .args
        .iter_mut()
        .find(|(name, _)| name == "fill_value")
        .unwrap();
    fill.1 = FxArg::Float(f64::NEG_INFINITY);
    let text = serde_json::to_string(&g).unwrap();
    assert!(
        text.contains(r#"["fill_value",{"kind":"float","value":"-inf"}]"#),
        "{}",
        &text[..200]
    );
    let back: FxGraph = serde_json::from_str(&text).unwrap();
    assert_eq!(back, g);
    assert_eq!(serde_json::to_string(&back).unwrap(), text);
}
