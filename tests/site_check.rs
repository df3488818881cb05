//! The per-site equivalence check (`arfuse::advanced::reference::check_sites`) on real graphs: every
//! corpus model and the three torch.export graphs check site by site at their real
//! hidden sizes; a lowered graph changed after the fact (an eps, a kept node's input, a
//! fused node's weight, a missing site map) is caught, naming the site or node; the
//! whole-graph check says a real model is too big for it.

mod common;

use arfuse::advanced::reference::{check_sites, ReferenceError, SiteTokens, SitesReport};
use arfuse::{Graph, Lowered, Target};
use serde_json::Value as Json;

fn preset(name: &str, world_size: u32) -> Target {
    let mut t = Target::preset(name).unwrap();
    t.world_size = world_size;
    t.validate().unwrap();
    t
}

fn export(name: &str) -> Graph {
    let p = common::root().join("ir-fixtures/exported").join(name);
    arfuse::advanced::import::load_any(&std::fs::read(&p).unwrap())
        .unwrap()
        .graph
}

fn check(g: &Graph, l: &Lowered, w: u32, tokens: SiteTokens<'_>) -> SitesReport {
    check_sites(g, &l.graph, &l.sites, w, tokens, 7).unwrap()
}

/// A corpus model (only its own files read) and its lowering for 8x H200.
fn on_h200(name: &str) -> (Graph, Lowered) {
    let path = common::root().join(format!("ir-fixtures/models/{name}.options.json"));
    let graph = common::load(&path).graph;
    let lowered = arfuse::lower(&graph, &Target::preset("h200-sxm-x8").unwrap()).unwrap();
    (graph, lowered)
}

/// The lowered graph's JSON with `edit` applied, loaded back.
fn edited(g: &Graph, edit: impl FnOnce(&mut Json)) -> Graph {
    let mut j: Json = serde_json::from_str(&g.to_json_string()).unwrap();
    edit(&mut j);
    Graph::from_json_str(&j.to_string()).unwrap()
}

fn node_mut<'a>(j: &'a mut Json, id: &str) -> &'a mut Json {
    j["nodes"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|n| n["id"] == id)
        .unwrap_or_else(|| panic!("no node {id}"))
}

#[test]
fn every_corpus_model_checks_site_by_site_at_t_1() {
    let mut checked = 0;
    for f in common::fixtures() {
        let target = Target::preset(&f.targets()[0]).unwrap();
        let l = arfuse::lower(&f.graph, &target).unwrap();
        let r = check(&f.graph, &l, target.world_size, SiteTokens::Given(&[1]));
        assert!(r.is_equivalent(), "{}\n{r}", f.name);
        assert_eq!(r.sites.len(), l.report.all_reduces_fused, "{}", f.name);
        for s in &r.sites {
            assert_eq!(s.tokens(), vec![1], "{} {}", f.name, s.fused_node);
            assert!(s.report.is_bit_exact());
            // Every output of the fused node was compared (norm at least).
            assert!(!s.report.per_tokens[0].outputs.is_empty());
        }
        checked += r.sites.len();
    }
    // The corpus' fused sites on each model's first target.
    assert!(checked > 1_000, "{checked}");
}

#[test]
fn per_kind_checks_every_strategy_switch_of_the_plan() {
    // Llama-3.1-8B on H200: one-shot 1..=16, two-shot 17..=64, unfused above.
    let (graph, l) = on_h200("llama31_8b_decomposed_3d_tp8");
    let r = check(&graph, &l, 8, SiteTokens::PlanPerKind);
    assert!(r.is_equivalent(), "{r}");
    assert_eq!(r.sites.len(), 65);
    let full: Vec<_> = r.sites.iter().filter(|s| s.tokens().len() > 2).collect();
    // The embedding site, the attention and MLP sites of layer 0, the final norm.
    assert_eq!(full.len(), 4, "{r}");
    for s in &full {
        assert_eq!(
            s.tokens(),
            vec![1, 7, 8, 16, 17, 64, 65],
            "{}",
            s.fused_node
        );
    }
    for s in r.sites.iter().filter(|s| s.tokens().len() == 2) {
        assert_eq!(s.tokens(), vec![1, 8]);
    }
    assert_eq!(r.sites[0].hidden, Some(4096));
    let text = r.to_string();
    assert!(text.contains("EQUIVALENT"), "{text}");
    assert!(
        text.contains("H = 4096, T = 1, 8: 61 of 61 sites bit-exact"),
        "{text}"
    );
}

#[test]
fn the_three_exports_check_site_by_site_from_t_1() {
    for (file, w) in [
        ("llama31_8b_L2_tp8.exported_program.json", 8),
        ("qwen3_30b_a3b_L2_tp4.exported_program.json", 4),
        ("gemma3_1b_L2_tp2.exported_program.json", 2),
    ] {
        let g = export(file);
        // The exporter's token symbol starts at 2; the plan dispatches from T = 1.
        assert!(g.symbols().values().all(|r| r.min >= 2), "{file}");
        let target = preset("h200-sxm-x8", w);
        let l = arfuse::lower(&g, &target).unwrap();
        let r = check(&g, &l, w, SiteTokens::PlanPerKind);
        assert!(r.is_equivalent(), "{file}\n{r}");
        assert_eq!(r.sites.len(), 5, "{file}");
        assert!(r.sites.iter().all(|s| s.tokens()[0] == 1), "{file}");
    }
}

#[test]
fn a_changed_eps_is_caught_at_its_site_only() {
    let (graph, l) = on_h200("llama31_8b_tp8");
    let victim = l.sites[3].fused_node.clone();
    let bad = edited(&l.graph, |j| {
        node_mut(j, &victim)["attrs"]["eps"] = serde_json::json!(0.5);
    });
    let r = check_sites(&graph, &bad, &l.sites, 8, SiteTokens::Given(&[1, 3]), 1).unwrap();
    assert!(!r.is_equivalent());
    let failed: Vec<&str> = r.failures().iter().map(|s| s.fused_node.as_str()).collect();
    assert_eq!(failed, vec![victim.as_str()]);
    // The norm differs, the residual (before the norm) does not.
    let per_t = &r.failures()[0].report.per_tokens;
    assert_eq!(per_t.len(), 2);
    for t in per_t {
        assert!(!t.outputs[0].passed && t.outputs[0].bit_mismatches > 0);
        assert!(t.outputs[1].passed);
    }
    assert!(r.to_string().contains("NOT EQUIVALENT"));
}

#[test]
fn rewired_nodes_and_missing_maps_are_refused_naming_the_node() {
    let (graph, l) = on_h200("llama31_8b_tp8");
    let err = |g: &Graph, sites: &[arfuse::advanced::ir::SiteMap]| match check_sites(
        &graph,
        g,
        sites,
        8,
        SiteTokens::Given(&[1]),
        1,
    ) {
        Err(ReferenceError::NotComparable(m)) => m,
        other => panic!("expected NotComparable, got {other:?}"),
    };

    // A kept node (a projection) reading the previous site's norm output instead of
    // its own site's.
    let (s0, s1) = (&l.sites[1], &l.sites[2]);
    let reader = l
        .graph
        .nodes()
        .find(|(_, n)| {
            n.inputs
                .first()
                .is_some_and(|v| l.graph.node(v.node).id == s1.fused_node)
                && !matches!(n.op, arfuse::advanced::ir::Op::FusedAllreduceNorm(_))
        })
        .map(|(_, n)| n.id.clone())
        .unwrap();
    let g = edited(&l.graph, |j| {
        node_mut(j, &reader)["inputs"][0] = Json::String(s0.fused_node.clone());
    });
    let m = err(&g, &l.sites);
    assert!(m.contains(&format!("node {reader:?} input 0")), "{m}");

    // A fused node reading another site's weight.
    let w1 = s1.inputs.last().unwrap().value.node.clone();
    let g = edited(&l.graph, |j| {
        let inputs = node_mut(j, &s0.fused_node)["inputs"]
            .as_array_mut()
            .unwrap();
        *inputs.last_mut().unwrap() = Json::String(w1);
    });
    let m = err(&g, &l.sites);
    assert!(
        m.contains(&format!("fused node {:?} input 2", s0.fused_node)),
        "{m}"
    );

    // A fused node without its map.
    let m = err(&l.graph, &l.sites[1..]);
    assert!(
        m.contains(&l.sites[0].fused_node) && m.contains("no site map"),
        "{m}"
    );
}

#[test]
fn the_whole_graph_check_says_a_real_model_is_too_big() {
    let (graph, l) = on_h200("llama31_8b_tp8");
    let e =
        arfuse::advanced::reference::check_equivalent(&graph, &l.graph, 8, &[1], 0).unwrap_err();
    assert!(matches!(e, ReferenceError::GraphTooLarge { .. }), "{e:?}");
    assert!(e.to_string().contains("check_sites"), "{e}");
}

#[test]
fn no_token_count_beyond_the_plan_and_no_other_world_size() {
    let path = common::root().join("ir-fixtures/models/llama31_8b_tp8.options.json");
    let graph = common::load(&path).graph;
    // A machine that never batches more than 3 tokens, no capture sizes (they would
    // extend the plan): no T past the plan's last, though T = W = 8 is otherwise
    // checked on every site.
    let mut target = Target::preset("h200-sxm-x8").unwrap();
    target.max_batched_tokens = 3;
    target.capture_sizes.clear();
    target.validate().unwrap();
    let l = arfuse::lower(&graph, &target).unwrap();
    let end = l
        .graph
        .nodes()
        .find_map(|(_, n)| match &n.op {
            arfuse::advanced::ir::Op::FusedAllreduceNorm(a) => a.plan.as_ref(),
            _ => None,
        })
        .and_then(|p| p.dispatch.last())
        .unwrap()
        .max_tokens;
    assert!(end < 8, "{end}");
    let r = check(&graph, &l, 8, SiteTokens::PlanPerKind);
    assert!(r.is_equivalent(), "{r}");
    for s in &r.sites {
        let t = s.tokens();
        assert!(t.iter().all(|&t| t <= end), "{}: {t:?}", s.fused_node);
        assert_eq!(t[0], 1);
    }
    // The plans are for W = 8: a check on 4 ranks is refused, naming the site.
    match check_sites(&graph, &l.graph, &l.sites, 4, SiteTokens::Given(&[1]), 0) {
        Err(ReferenceError::InvalidParameter(m)) => {
            assert!(
                m.contains("checked for world size 4, but its plan is for 8"),
                "{m}"
            )
        }
        other => panic!("{other:?}"),
    }
}
