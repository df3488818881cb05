//! Every fused node the pass emits on the model corpus is one the runtime can run:
//! `arfuse_runtime::node::NodeKernels` accepts it (kernel variant built for every
//! fused range, workspace within the Lamport limit) and routes every token count of
//! its plan. No GPU needed: this is the launch description, not the launch.

use arfuse::Target;
use arfuse_runtime::node::{NodeKernels, Route};
use arfuse_runtime::variants::{self, KernelKind};

mod common;

#[test]
fn every_fused_node_of_the_corpus_has_a_kernel_for_every_planned_token_count() {
    let built = variants::all();
    let (mut nodes, mut graphs, mut gemma_f32_weights) = (0usize, 0usize, 0usize);
    let mut failures = Vec::new();
    for f in common::fixtures() {
        let (name, graph) = (&f.name, &f.graph);
        for t in f.targets() {
            let target = Target::preset(&t).unwrap();
            let lowered = arfuse::lower(graph, &target).unwrap();
            graphs += 1;
            for (_, n) in lowered.graph.nodes() {
                let arfuse::ir::Op::FusedAllreduceNorm(a) = &n.op else {
                    continue;
                };
                nodes += 1;
                let k = match NodeKernels::from_graph(&lowered.graph, &n.id, target.world_size) {
                    Ok(k) => k,
                    Err(e) => {
                        failures.push(format!("{name} on {t}: {e}"));
                        continue;
                    }
                };
                // Gemma's offset weight `1 + w.float()` is read as f32.
                if name.starts_with("gemma") {
                    assert!(k.gamma_f32 && k.weight_bias == 1.0, "{name}: {}", n.id);
                    gemma_f32_weights += 1;
                } else {
                    assert!(!k.gamma_f32 && k.weight_bias == 0.0, "{name}: {}", n.id);
                }
                let plan = a.plan.as_ref().unwrap();
                let last = plan.dispatch.last().unwrap().max_tokens as u32;
                // Every range boundary and its neighbours.
                for r in &plan.dispatch {
                    for tokens in [r.min_tokens, r.max_tokens] {
                        let v = match k.route(tokens as u32).unwrap() {
                            Route::Fused(v) => {
                                assert!(matches!(v.kind, KernelKind::Fused { .. }));
                                k.layout()
                                    .unwrap()
                                    .check_call(
                                        match v.kind {
                                            KernelKind::Fused { strategy, .. } => strategy,
                                            _ => unreachable!(),
                                        },
                                        tokens as u32,
                                    )
                                    .unwrap_or_else(|e| panic!("{name} on {t}, T={tokens}: {e}"));
                                v
                            }
                            Route::Unfused { local } => local,
                        };
                        if !built.contains(&v) {
                            failures
                                .push(format!("{name} on {t}: T={tokens} needs {v}, not built"));
                        }
                    }
                }
                assert!(k.route(last + 1).is_err());
                // A world size other than the one the graph was built for is refused.
                if graph.recorded_world_size().is_some() {
                    let other = if target.world_size == 8 { 4 } else { 8 };
                    let e = NodeKernels::from_graph(&lowered.graph, &n.id, other).unwrap_err();
                    assert!(e.to_string().contains("built for world size"), "{e}");
                }
            }
        }
    }
    failures.sort();
    failures.dedup();
    assert!(
        failures.is_empty(),
        "{} problems:\n{}",
        failures.len(),
        failures.join("\n")
    );
    println!(
        "{graphs} lowered graphs, {nodes} fused nodes ({gemma_f32_weights} with f32 Gemma weights)"
    );
    assert!(
        graphs >= 20 && nodes > 1000,
        "{graphs} graphs, {nodes} fused nodes"
    );
    assert!(gemma_f32_weights > 100, "{gemma_f32_weights}");
}
