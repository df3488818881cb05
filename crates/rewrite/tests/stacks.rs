//! Done-when properties on generated layer stacks: 2L + 1 sites, views, a dead final
//! residual, idempotence and determinism.

mod common;

use arfuse_ir::op::FusedOutput;
use arfuse_ir::Op;
use common::builder::{NormForm, Quant, Stack};
use common::{b200, h200, lowered};

fn fused_nodes(g: &arfuse_ir::Graph) -> Vec<&arfuse_ir::op::FusedAllReduceNorm> {
    g.nodes()
        .filter_map(|(_, n)| match &n.op {
            Op::FusedAllreduceNorm(f) => Some(&**f),
            _ => None,
        })
        .collect()
}

fn all_reduces(g: &arfuse_ir::Graph) -> usize {
    g.nodes()
        .filter(|(_, n)| matches!(n.op, Op::AllReduce { .. }))
        .count()
}

#[test]
fn dense_stacks_fuse_2l_plus_1_sites_in_every_norm_form() {
    for norm in [NormForm::RmsNorm, NormForm::FusedAdd, NormForm::Decomposed] {
        for view_3d in [false, true] {
            for layers in [1, 2, 8, 32] {
                let st = Stack {
                    layers,
                    norm,
                    view_3d,
                    ..Stack::default()
                };
                let g = st.build();
                let l = lowered(&g, &h200());
                let what = format!("{norm:?} 3d={view_3d} L={layers}");
                assert_eq!(l.report.all_reduces_seen, 2 * layers + 1, "{what}");
                assert_eq!(
                    l.report.all_reduces_fused,
                    2 * layers + 1,
                    "{what}\n{}",
                    l.report
                );
                assert_eq!(fused_nodes(&l.graph).len(), 2 * layers + 1, "{what}");
                assert_eq!(all_reduces(&l.graph), 0, "{what}");
                l.graph.validate().unwrap();
            }
        }
    }
}

#[test]
fn final_residual_dead_means_no_residual_output() {
    for norm in [NormForm::RmsNorm, NormForm::FusedAdd, NormForm::Decomposed] {
        let g = Stack {
            layers: 3,
            norm,
            ..Stack::default()
        }
        .build();
        let l = lowered(&g, &h200());
        let fused = fused_nodes(&l.graph);
        let last = fused.last().unwrap();
        assert_eq!(last.outputs, vec![FusedOutput::Norm], "{norm:?}");
        // Every other one writes both (the residual feeds the next layer).
        for f in &fused[..fused.len() - 1] {
            assert_eq!(f.outputs, vec![FusedOutput::Norm, FusedOutput::Residual]);
        }
        // Live final residual: written.
        let g = Stack {
            layers: 3,
            norm,
            final_residual_live: true,
            ..Stack::default()
        }
        .build();
        let l = lowered(&g, &h200());
        let last = *fused_nodes(&l.graph).last().unwrap();
        assert_eq!(
            last.outputs,
            vec![FusedOutput::Norm, FusedOutput::Residual],
            "{norm:?}"
        );
    }
}

#[test]
fn three_d_views_get_boundary_reshapes() {
    let g = Stack {
        layers: 2,
        view_3d: true,
        ..Stack::default()
    }
    .build();
    let l = lowered(&g, &h200());
    let text = l.graph.canonical_text();
    // Fused nodes work on [B*S, H]; the norm outputs are viewed back to [B, S, H].
    assert!(text.contains("fused_allreduce_norm"), "{text}");
    for (_, n) in l.graph.nodes() {
        if let Op::FusedAllreduceNorm(_) = n.op {
            assert_eq!(n.outputs[0].shape.to_string(), "[B*S,4096]");
        }
    }
    assert!(
        l.graph.find("fused.layers.0.o.ar.norm.view").is_some(),
        "{text}"
    );
}

#[test]
fn lowering_twice_changes_nothing_and_runs_are_byte_identical() {
    let cases = [
        Stack::default(),
        Stack {
            layers: 4,
            norm: NormForm::Decomposed,
            view_3d: true,
            ..Stack::default()
        },
        Stack {
            layers: 3,
            norm: NormForm::FusedAdd,
            quant: Some(Quant::Fp8PerToken),
            norm_live_with_quant: true,
            ..Stack::default()
        },
    ];
    for st in cases {
        let g = st.build();
        let a = lowered(&g, &h200());
        let b = lowered(&g, &h200());
        assert_eq!(a.graph.to_json_string(), b.graph.to_json_string());
        assert_eq!(a.report.to_json(), b.report.to_json());
        let again = lowered(&a.graph, &h200());
        assert_eq!(again.graph.to_json_string(), a.graph.to_json_string());
        assert_eq!(again.report.all_reduces_seen, 0);
        assert!(again.report.already_fused > 0);
        assert!(
            again.report.warnings.is_empty(),
            "{:?}",
            again.report.warnings
        );
    }
}

#[test]
fn quant_epilogues_fuse_on_every_site_but_the_final_norm() {
    for (q, target) in [
        (Quant::Fp8Static, h200()),
        (Quant::Fp8PerToken, h200()),
        (Quant::Fp8Group, h200()),
        (Quant::Nvfp4, b200()),
    ] {
        for norm_live in [false, true] {
            let g = Stack {
                layers: 2,
                quant: Some(q),
                norm_live_with_quant: norm_live,
                ..Stack::default()
            }
            .build();
            let l = lowered(&g, &target);
            assert_eq!(l.report.all_reduces_fused, 5, "{q:?}\n{}", l.report);
            let fused = fused_nodes(&l.graph);
            let with_quant = fused
                .iter()
                .filter(|f| f.outputs.contains(&FusedOutput::Quant))
                .count();
            assert_eq!(with_quant, 4, "{q:?}");
            let with_norm = fused
                .iter()
                .filter(|f| f.quant != arfuse_ir::FusedQuant::None)
                .filter(|f| f.outputs.contains(&FusedOutput::Norm))
                .count();
            assert_eq!(with_norm, if norm_live { 4 } else { 0 }, "{q:?}");
            assert_eq!(all_reduces(&l.graph), 0);
        }
    }
}

#[test]
fn nvfp4_epilogue_is_not_fused_on_hopper() {
    let g = Stack {
        layers: 1,
        quant: Some(Quant::Nvfp4),
        ..Stack::default()
    }
    .build();
    let l = lowered(&g, &h200());
    assert_eq!(l.report.all_reduces_fused, 3);
    assert!(fused_nodes(&l.graph)
        .iter()
        .all(|f| f.quant == arfuse_ir::FusedQuant::None));
    assert!(l
        .graph
        .nodes()
        .any(|(_, n)| matches!(n.op, Op::QuantNvfp4 { .. })));
    let notes: Vec<&String> = l.report.sites.iter().flat_map(|s| &s.notes).collect();
    assert!(notes.iter().any(|n| n.contains("SM >= 100")), "{notes:?}");
}

#[test]
fn gemma_norms_fuse_with_weight_bias_one_and_no_quant() {
    let g = Stack {
        layers: 2,
        gemma: true,
        quant: Some(Quant::Fp8PerToken),
        ..Stack::default()
    }
    .build();
    let l = lowered(&g, &h200());
    assert_eq!(l.report.all_reduces_fused, 5, "{}", l.report);
    for f in fused_nodes(&l.graph) {
        assert_eq!(f.weight_bias, 1.0);
        assert_eq!(f.quant, arfuse_ir::FusedQuant::None);
    }
}

#[test]
fn quant_epilogues_fuse_behind_3d_views() {
    // Activations [B, S, H], all-reduces on the [B*S, H] view: the quant after a 3-D
    // norm is fused too, its outputs viewed back to [B, S, ...].
    for (q, target) in [
        (Quant::Fp8Static, h200()),
        (Quant::Fp8PerToken, h200()),
        (Quant::Fp8Group, h200()),
        (Quant::Nvfp4, b200()),
    ] {
        for norm_live in [false, true] {
            let g = Stack {
                layers: 2,
                view_3d: true,
                quant: Some(q),
                norm_live_with_quant: norm_live,
                ..Stack::default()
            }
            .build();
            let l = lowered(&g, &target);
            assert_eq!(l.report.all_reduces_fused, 5, "{q:?}\n{}", l.report);
            let fused = fused_nodes(&l.graph);
            let with_quant = fused
                .iter()
                .filter(|f| f.outputs.contains(&FusedOutput::Quant))
                .count();
            assert_eq!(with_quant, 4, "{q:?}\n{}", l.report);
            let with_norm = fused
                .iter()
                .filter(|f| f.quant != arfuse_ir::FusedQuant::None)
                .filter(|f| f.outputs.contains(&FusedOutput::Norm))
                .count();
            assert_eq!(with_norm, if norm_live { 4 } else { 0 }, "{q:?}");
            assert_eq!(all_reduces(&l.graph), 0);
            // No quant op is left; the quantised outputs are read as [B, S, ...].
            assert!(!l.graph.nodes().any(|(_, n)| matches!(
                n.op,
                Op::QuantFp8Static
                    | Op::QuantFp8PerToken
                    | Op::QuantFp8PerTokenGroup { .. }
                    | Op::QuantNvfp4 { .. }
            )));
            let view = l
                .graph
                .find("fused.layers.0.o.ar.quant.view")
                .map(|id| l.graph.node(id).outputs[0].shape.to_string());
            assert!(
                view.as_deref().is_some_and(|s| s.starts_with("[B,S,")),
                "{q:?}: {view:?}\n{}",
                l.graph.canonical_text()
            );
            l.graph.validate().unwrap();
            let again = lowered(&l.graph, &target);
            assert_eq!(again.graph.to_json_string(), l.graph.to_json_string());
        }
    }
}

#[test]
fn windows_change_nothing_but_the_egraph_totals() {
    // Every stack form, lowered whole and in windows that cut every layer (down to one
    // node); the targets fuse NVFP4 (b200) or leave it unfused (h200).
    let quants = [
        None,
        Some(Quant::Fp8Static),
        Some(Quant::Fp8PerToken),
        Some(Quant::Fp8Group),
        Some(Quant::Fp8GroupF32Ue8m0),
        Some(Quant::Nvfp4),
    ];
    let mut compared = 0;
    for norm in [NormForm::RmsNorm, NormForm::FusedAdd, NormForm::Decomposed] {
        for view_3d in [false, true] {
            for quant in quants {
                for (gemma, live) in [(false, false), (false, true), (true, false)] {
                    let g = Stack {
                        layers: 4,
                        norm,
                        view_3d,
                        quant: quant.filter(|_| !gemma),
                        gemma,
                        norm_live_with_quant: live,
                        final_residual_live: live,
                        ..Stack::default()
                    }
                    .build();
                    for target in [h200(), b200()] {
                        let whole = arfuse_rewrite::lower(&g, &target).unwrap();
                        assert_eq!(whole.report.runner.windows, 1);
                        for w in [1, 5, 23] {
                            let what = format!(
                                "{norm:?} 3d={view_3d} {quant:?} gemma={gemma} live={live}, \
                                 windows of {w}"
                            );
                            let options =
                                arfuse_rewrite::LowerOptions::default().with_window_nodes(w);
                            let cut = arfuse_rewrite::lower_with(&g, &target, &options).unwrap();
                            assert!(cut.report.runner.windows > 1, "{what}");
                            assert_eq!(whole.graph.to_string(), cut.graph.to_string(), "{what}");
                            assert_eq!(whole.sites, cut.sites, "{what}");
                            let mut report = cut.report.clone();
                            report.runner = whole.report.runner.clone();
                            assert_eq!(whole.report, report, "{what}");
                            compared += 1;
                        }
                    }
                }
            }
        }
    }
    assert_eq!(compared, 3 * 2 * 6 * 3 * 2 * 3);
}

#[test]
fn the_report_says_how_the_egraph_was_cut() {
    use arfuse_ir::{DType, Dim, Graph, InputKind, Node, TensorType, Value};
    let lower = |g: &Graph, window_nodes: usize| {
        let options = arfuse_rewrite::LowerOptions::default().with_window_nodes(window_nodes);
        arfuse_rewrite::lower_with(g, &h200(), &options).unwrap()
    };
    // A stack that fits one window: the e-graph of the whole graph.
    let g = Stack {
        layers: 4,
        ..Stack::default()
    }
    .build();
    let whole = lower(&g, usize::MAX).report;
    assert!(whole.runner.whole_graph);
    assert_eq!(whole.runner.windows, 1);
    let line = format!(
        "e-graph: saturated after {} iteration(s), {} e-nodes",
        whole.runner.iterations, whole.runner.egraph_nodes
    );
    assert!(whole.to_string().contains(&line), "{whole}");
    // Cut into windows of 8 nodes: every window with an all-reduce has its e-graph.
    let cut = lower(&g, 8).report;
    assert!(!cut.runner.whole_graph);
    assert!(
        (2..=9).contains(&cut.runner.windows),
        "{}",
        cut.runner.windows
    );
    assert_eq!(cut.runner.iterations, whole.runner.iterations);
    let line = format!(
        "e-graph: saturated in each of {} window(s), after at most {} iteration(s)",
        cut.runner.windows, cut.runner.iterations
    );
    assert!(cut.to_string().contains(&line), "{cut}");

    // No all-reduce: cut into windows, no e-graph is built, and the report says so.
    let mut g = Graph::new();
    let t = TensorType::new(DType::Bf16, vec![Dim::constant(4), Dim::constant(256)]);
    let mut add = |id: String, op: Op, inputs: Vec<Value>| {
        Value::new(
            g.add_node(Node {
                id,
                op,
                inputs,
                outputs: vec![t.clone()],
                module: None,
            })
            .unwrap(),
            0,
        )
    };
    let x = add(
        "x".into(),
        Op::Input {
            kind: InputKind::Activation,
        },
        vec![],
    );
    let mut v = x;
    for k in 0..20 {
        v = add(format!("a{k}"), Op::Add, vec![v, x]);
    }
    g.set_outputs(vec![v]).unwrap();
    let none = lower(&g, 8).report;
    assert!(!none.runner.whole_graph);
    assert_eq!(
        (
            none.runner.windows,
            none.runner.iterations,
            none.runner.egraph_nodes
        ),
        (0, 0, 0)
    );
    assert!(none
        .to_string()
        .contains("e-graph: none built: no window of the graph holds an all-reduce"));
    // The same graph in one window: its whole e-graph, as for any graph that fits.
    let one = lower(&g, usize::MAX).report;
    assert!(one.runner.whole_graph);
    assert_eq!(one.runner.windows, 1);
    assert_eq!(one.runner.egraph_nodes, 21);

    // An empty graph is one (empty) window.
    let empty = lower(&Graph::new(), 8).report;
    assert!(empty.runner.whole_graph);
    assert_eq!((empty.runner.windows, empty.runner.iterations), (1, 1));
}

/// The threads that saturate windows (`LowerOptions::threads`) change no answer, and
/// no error: a runner that stops at the e-node limit in any window, or at the
/// iteration limit, gives the one-thread error whichever thread saturated that
/// window, with the e-nodes of the windows before it counted.
#[test]
fn threads_give_the_one_thread_answer_at_every_limit() {
    let g = Stack {
        layers: 12,
        norm: NormForm::Decomposed,
        ..Stack::default()
    }
    .build();
    let target = h200();
    let lower = |threads: usize, node_limit: usize, iter_limit: usize| {
        let options = arfuse_rewrite::LowerOptions::default()
            .with_window_nodes(24)
            .with_threads(threads)
            .with_node_limit(node_limit)
            .with_iter_limit(iter_limit);
        match arfuse_rewrite::lower_with(&g, &target, &options) {
            // The whole answer, compared with `==` (a mismatch prints only the limit).
            Ok(l) => format!("{}\n{}\n{:?}", l.graph, l.report, l.sites),
            Err(e) => format!("error: {e}"),
        }
    };
    let options = arfuse_rewrite::LowerOptions::default()
        .with_window_nodes(24)
        .with_threads(1);
    let free = arfuse_rewrite::lower_with(&g, &target, &options).unwrap();
    let (windows, total) = (free.report.runner.windows, free.report.runner.egraph_nodes);
    assert!(windows >= 12, "{windows} windows");
    // Limits from the first window's size to past the total: each stops in another
    // window (or none), on the calling thread or a helper.
    let mut outcomes = std::collections::BTreeSet::new();
    for k in 0..=40 {
        let limit = total * k / 38;
        let one = lower(1, limit, arfuse_rewrite::DEFAULT_ITER_LIMIT);
        for threads in [2, 3, 5] {
            let many = lower(threads, limit, arfuse_rewrite::DEFAULT_ITER_LIMIT);
            assert!(one == many, "node limit {limit}, {threads} threads");
        }
        outcomes.insert(one);
    }
    // Distinct errors (each its e-node count), and success past the total.
    assert!(outcomes.len() > 20, "{} distinct outcomes", outcomes.len());
    assert!(outcomes.iter().any(|o| !o.starts_with("error")));
    assert!(outcomes
        .iter()
        .any(|o| o.starts_with("error: ") && o.contains("e-node limit")));
    for iter_limit in [1, 2] {
        let one = lower(1, arfuse_rewrite::DEFAULT_NODE_LIMIT, iter_limit);
        assert!(one.starts_with("error: ") && one.contains("iteration limit"));
        for threads in [2, 3] {
            let many = lower(threads, arfuse_rewrite::DEFAULT_NODE_LIMIT, iter_limit);
            assert!(
                one == many,
                "iteration limit {iter_limit}, {threads} threads"
            );
        }
    }
}

/// A graph cut into windows, lowered on more than one thread, is validated while its
/// facts are gathered and has its report built while the output is emitted: its errors
/// are the one-thread errors, in the one-thread order. A node that fails validation
/// (in a graph whose layer group is also ambiguous) gives the validation error; the
/// ambiguous group alone gives the group error; a graph whose views would make the
/// facts' walk exponential if it trusted their arity gives its validation error at
/// once.
#[test]
fn paired_steps_give_the_one_thread_errors() {
    use arfuse_ir::{DType, Dim, Graph, Node, TensorType, Value};
    fn node(g: &mut Graph, id: &str, op: Op, inputs: Vec<Value>, ty: TensorType) -> Value {
        let n = g
            .add_node(Node {
                id: id.into(),
                op,
                inputs,
                outputs: vec![ty],
                module: None,
            })
            .unwrap();
        Value::new(n, 0)
    }
    let lower = |g: &Graph, threads: usize| {
        let options = arfuse_rewrite::LowerOptions::default()
            .with_window_nodes(24)
            .with_threads(threads);
        match arfuse_rewrite::lower_with(g, &h200(), &options) {
            Ok(l) => format!("{}\n{}", l.graph, l.report),
            Err(e) => format!("error: {e}"),
        }
    };
    let t = || TensorType::new(DType::Bf16, vec![Dim::constant(8)]);
    let mut g = Graph::new();
    let input = Op::Input {
        kind: arfuse_ir::InputKind::Activation,
    };
    let x = node(&mut g, "x", input, vec![], t());
    // Two groups with one all-reduce each: a tie.
    let mut last = x;
    for (i, group) in ["tp", "ep"].iter().enumerate() {
        let op = Op::AllReduce {
            group: group.to_string(),
            reduce: Default::default(),
        };
        last = node(&mut g, &format!("ar{i}"), op, vec![last], t());
    }
    for i in 0..40 {
        last = node(&mut g, &format!("add{i}"), Op::Add, vec![last, x], t());
    }
    g.set_outputs(vec![last]).unwrap();
    let ambiguous = lower(&g, 1);
    assert!(
        ambiguous.starts_with("error: ") && ambiguous.contains("group"),
        "{ambiguous}"
    );
    assert_eq!(ambiguous, lower(&g, 2));
    // And a node that fails validation: its error comes first.
    let bad = TensorType::new(DType::F32, vec![]);
    node(&mut g, "bad_add", Op::Add, vec![x], bad);
    let invalid = lower(&g, 1);
    assert!(
        invalid.starts_with("error: ") && invalid.contains("bad_add"),
        "{invalid}"
    );
    assert_ne!(invalid, ambiguous);
    assert_eq!(invalid, lower(&g, 2));

    // Reshapes of 64 inputs, each reading the one before 64 times, below an
    // all-reduce: invalid, and while it is validated the facts are gathered on the
    // other thread, which must not follow the 64^16 paths through them.
    let mut g = Graph::new();
    let input = Op::Input {
        kind: arfuse_ir::InputKind::Activation,
    };
    let x = node(&mut g, "x", input, vec![], t());
    let op = Op::AllReduce {
        group: "tp".into(),
        reduce: Default::default(),
    };
    let mut last = node(&mut g, "ar", op, vec![x], t());
    for i in 0..16 {
        last = node(
            &mut g,
            &format!("view{i}"),
            Op::Reshape,
            vec![last; 64],
            t(),
        );
    }
    for i in 0..20 {
        last = node(&mut g, &format!("add{i}"), Op::Add, vec![last, x], t());
    }
    g.set_outputs(vec![last]).unwrap();
    let invalid = lower(&g, 2);
    assert!(
        invalid.starts_with("error: ") && invalid.contains("view0"),
        "{invalid}"
    );
    assert_eq!(invalid, lower(&g, 1));
}

/// The report of a graph cut into windows is built while the output is emitted, its
/// fused nodes named after: on one thread or two, every fused entry names the fused
/// node of its all-reduce in the output graph, every other entry none, and the JSON
/// reports are the same.
#[test]
fn paired_reports_name_their_fused_nodes() {
    let g = Stack {
        layers: 6,
        quant: Some(Quant::Fp8PerToken),
        ..Stack::default()
    }
    .build();
    let lower = |threads: usize| {
        let options = arfuse_rewrite::LowerOptions::default()
            .with_window_nodes(24)
            .with_threads(threads);
        arfuse_rewrite::lower_with(&g, &h200(), &options).unwrap()
    };
    let (one, two) = (lower(1), lower(2));
    assert_eq!(
        serde_json::to_string(&one.report).unwrap(),
        serde_json::to_string(&two.report).unwrap()
    );
    assert!(g.len() > 24 && one.report.all_reduces_fused == 13);
    for entry in &two.report.sites {
        match &entry.fused_node {
            Some(id) => {
                assert!(entry.fused, "{id}");
                let n = two.graph.node(two.graph.find(id).unwrap());
                let Op::FusedAllreduceNorm(_) = &n.op else {
                    panic!("{id} is a {}", n.op.name())
                };
                let map = two.sites.iter().find(|m| &m.fused_node == id).unwrap();
                assert_eq!(map.all_reduce, entry.all_reduce);
            }
            None => assert!(!entry.fused, "{}", entry.all_reduce),
        }
    }
}
