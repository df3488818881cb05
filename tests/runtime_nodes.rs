//! Every fused node the pass emits on the model corpus is one the runtime can run:
//! `arfuse_runtime::node::NodeKernels` accepts it (kernel variant built for every
//! fused range, every range within the workspace's capacity rule) and routes every
//! token count of its plan; and what the runtime allocates is the plan's workspace,
//! sized for exactly what the plan dispatches. No GPU needed: this is the launch
//! description, not the launch.

use arfuse::Target;
use arfuse_runtime::cuda::check_fits;
use arfuse_runtime::node::{NodeKernels, Route};
use arfuse_runtime::variants::{self, KernelKind};
use std::collections::BTreeMap;

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
                                let KernelKind::Fused { strategy, .. } = v.kind else {
                                    panic!("{name} on {t}: fused route to {v}");
                                };
                                check_fits(&k.workspace, strategy, tokens as u32, k.hidden)
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

/// Issue 13: the plan's bytes per rank are what the runtime allocates, for every fused
/// node of every lowered corpus pair, and that allocation is exactly what the plan
/// dispatches: arfuse's layout (256-byte state + 3 Lamport buffers) with ONE buffer
/// the largest call any node sharing the workspace makes, rounded up to 128 bytes,
/// recomputed here from the ranges' own T (not from the planner's figures).
#[test]
fn plan_bytes_are_the_runtime_allocation_and_only_what_is_dispatched() {
    let mut pairs = 0usize;
    for f in common::fixtures() {
        for t in f.targets() {
            let target = Target::preset(&t).unwrap();
            let lowered = arfuse::lower(&f.graph, &target).unwrap();
            // Workspace -> (largest call its nodes dispatch, nodes).
            let mut shared: BTreeMap<String, (u64, usize)> = BTreeMap::new();
            for (_, n) in lowered.graph.nodes() {
                let arfuse::ir::Op::FusedAllreduceNorm(a) = &n.op else {
                    continue;
                };
                let k = NodeKernels::from_graph(&lowered.graph, &n.id, target.world_size)
                    .unwrap_or_else(|e| panic!("{} on {t}: {e}", f.name));
                let plan = a.plan.as_ref().unwrap();
                let ws = &plan.workspace;
                let allocated = k.layout().unwrap().bytes_per_rank;
                assert_eq!(
                    allocated, ws.total_bytes_per_rank,
                    "{} on {t}: {}",
                    f.name, n.id
                );
                assert_eq!(allocated, 256 + 3 * ws.lamport_buffer_bytes);
                let (w, h, e) = (
                    u64::from(ws.world_size),
                    u64::from(k.hidden),
                    k.dtype.bytes() as u64,
                );
                let largest = plan
                    .dispatch
                    .iter()
                    .map(|r| match r.strategy {
                        arfuse::ir::Strategy::OneShot => r.max_tokens * w * h * e,
                        arfuse::ir::Strategy::TwoShot => 2 * r.max_tokens.div_ceil(w) * w * h * e,
                        arfuse::ir::Strategy::Unfused => 0,
                    })
                    .max()
                    .unwrap_or(0);
                let entry = shared.entry(format!("{ws:?}")).or_default();
                entry.0 = entry.0.max(largest);
                entry.1 += 1;
            }
            for (ws, (largest, nodes)) in &shared {
                let b = ws
                    .split("lamport_buffer_bytes: ")
                    .nth(1)
                    .and_then(|r| r.split(',').next())
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap();
                assert_eq!(
                    b,
                    largest.div_ceil(128) * 128,
                    "{} on {t}: {nodes} nodes share {ws}",
                    f.name
                );
            }
            // The report states the same allocation.
            for w in &lowered.report.workspaces {
                if let Some(bytes) = w.bytes_per_rank {
                    assert!(
                        shared
                            .keys()
                            .any(|k| k.contains(&format!("total_bytes_per_rank: {bytes} "))),
                        "{} on {t}: report says {bytes}",
                        f.name
                    );
                }
            }
            pairs += 1;
        }
    }
    assert!(pairs >= 20, "{pairs}");
}
