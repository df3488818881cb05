//! Every fused node the pass emits on the model corpus is one the runtime can run:
//! `arfuse_runtime::node::NodeKernels` accepts it (kernel variant built for every
//! fused range, every range within the workspace's capacity rule) and routes every
//! token count of its plan; and what the runtime allocates is the plan's workspace,
//! sized for exactly what the plan dispatches. No GPU needed: this is the launch
//! description, not the launch.

use arfuse::Target;
use arfuse_runtime::device::check_fits;
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
                let arfuse::advanced::ir::Op::FusedAllreduceNorm(a) = &n.op else {
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
                let arfuse::advanced::ir::Op::FusedAllreduceNorm(a) = &n.op else {
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
                    k.dtype.element_bytes(),
                );
                let largest = plan
                    .dispatch
                    .iter()
                    .map(|r| match r.strategy {
                        arfuse::advanced::ir::Strategy::OneShot => r.max_tokens * w * h * e,
                        arfuse::advanced::ir::Strategy::TwoShot => {
                            2 * r.max_tokens.div_ceil(w) * w * h * e
                        }
                        arfuse::advanced::ir::Strategy::Unfused => 0,
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

/// Issue 13: every number derived from capacity comes from one rule, so changing one
/// input (the size cap) moves every consumer together: the planner's max_token_num and
/// ranges, the capture-size checks, the lowered node's plan and its IR check on load,
/// and the runtime's route and fit check.
#[test]
fn one_capacity_input_moves_every_consumer_together() {
    let f = common::fixtures()
        .into_iter()
        .find(|f| f.name == "llama31_8b_tp8")
        .unwrap();
    let mut seen = Vec::new();
    // 0.5 MiB (the size table) -> M = 64 at H = 4096, bf16: one-shot to 16, two-shot
    // to 64, one buffer of 1 MiB. 64 KiB -> M = 8: one-shot only, a buffer of
    // 8 * 8 * 8192 = 524,288 bytes.
    for (cap, m, buffer) in [(None, 64u64, 1_048_576u64), (Some(65_536u64), 8, 524_288)] {
        let mut target = Target::preset("h200-sxm-x8").unwrap();
        target.max_bytes_override = cap;
        let plan = arfuse::advanced::policy::plan(&target, &[4096]).unwrap();
        assert_eq!(plan.max_token_num, m);
        let last_fused = plan
            .dispatch()
            .iter()
            .filter(|r| r.strategy.is_fused())
            .map(|r| r.hi)
            .max();
        assert_eq!(last_fused, Some(m));
        // Capture size 40: fused (two-shot) under the table's cap, unfused under the
        // smaller one.
        let p40 = plan.points.iter().find(|p| p.t == 40).unwrap();
        assert_eq!(p40.strategy.is_fused(), m >= 40, "cap {cap:?}");
        // The lowered node carries that plan, and the runtime routes by it.
        let lowered = arfuse::lower(&f.graph, &target).unwrap();
        let (id, a) = lowered
            .graph
            .nodes()
            .find_map(|(_, n)| match &n.op {
                arfuse::advanced::ir::Op::FusedAllreduceNorm(a) => Some((n.id.clone(), a.clone())),
                _ => None,
            })
            .unwrap();
        let node_plan = a.plan.clone().unwrap();
        assert_eq!(node_plan.workspace, plan.workspace.clone().unwrap());
        assert_eq!(node_plan.workspace.lamport_buffer_bytes, buffer);
        let k = NodeKernels::from_graph(&lowered.graph, &id, 8).unwrap();
        assert!(matches!(k.route(m as u32).unwrap(), Route::Fused(_)));
        assert!(matches!(
            k.route(m as u32 + 1).unwrap(),
            Route::Unfused { .. }
        ));
        seen.push((lowered.graph, id, node_plan));
    }
    // The larger plan's fused range (two-shot to T=64) pasted onto the smaller
    // workspace is refused by the IR check on load and by the runtime, with the same
    // bytes: two-shot at T=64 needs 2 * 8 * 8 * 8192 = 1,048,576 bytes.
    let (small_graph, id, small_plan) = &seen[1];
    let big_plan = &seen[0].2;
    let mut forged = small_plan.clone();
    forged.dispatch = big_plan.dispatch.clone();
    forged.max_token_num = big_plan.max_token_num;
    let mut json: serde_json::Value = serde_json::from_str(&small_graph.to_json_string()).unwrap();
    for n in json["nodes"].as_array_mut().unwrap() {
        if n["id"] == serde_json::json!(id) {
            n["attrs"]["plan"] = serde_json::to_value(&forged).unwrap();
        }
    }
    let text = match arfuse::Graph::from_json_slice(json.to_string().as_bytes()) {
        Ok(_) => panic!("the forged plan was accepted"),
        Err(e) => e.to_string(),
    };
    let available = small_plan.workspace.lamport_buffer_bytes;
    assert!(
        text.contains(&format!(
            "two-shot at T=64 needs 1048576 bytes, its buffer holds {available}"
        )),
        "{text}"
    );
    let e = arfuse_runtime::device::check_fits(
        &small_plan.workspace,
        arfuse_runtime::variants::Strategy::TwoShot,
        64,
        4096,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains(&format!(
            "needs 1048576 bytes of one Lamport buffer; it has {available}"
        )),
        "{e}"
    );
}

/// Issue 21: the plan's one-shot / two-shot boundary against the bytes each strategy
/// moves (`arfuse_runtime::check::bytes_moved`). One-shot pushes every token to every
/// peer, (1 + 3W) R bytes per rank against two-shot's about 7 R (R = T*H*e), so past
/// some size it costs more in traffic than the round trips it saves. For every
/// one-shot T of every plan of arfuse's kernels on the corpus: the call's all-reduce
/// input T*H*W*e is at most 1 MiB (the Lamport rule), and one-shot's extra bytes over
/// two-shot are at most (3W - 6) MiB, the extra of a 1 MiB call; the first T past
/// each one-shot range is over 1 MiB or not fused one-shot at all.
#[test]
fn one_shot_never_runs_past_the_bytes_boundary() {
    use arfuse_runtime::check::{bytes_moved, Case};
    use arfuse_runtime::variants::Strategy;
    const MIB: u64 = 1 << 20;
    let mut checked = 0usize;
    for f in common::fixtures() {
        for t in f.targets() {
            let target = Target::preset(&t).unwrap();
            let lowered = arfuse::lower(&f.graph, &target).unwrap();
            for (_, n) in lowered.graph.nodes() {
                let arfuse::advanced::ir::Op::FusedAllreduceNorm(a) = &n.op else {
                    continue;
                };
                let plan = a.plan.as_ref().unwrap();
                if plan.kernels() != arfuse::advanced::policy::KernelLibrary::Arfuse {
                    continue;
                }
                let k = NodeKernels::from_graph(&lowered.graph, &n.id, target.world_size).unwrap();
                let w = u64::from(k.world);
                let input =
                    |tokens: u64| tokens * u64::from(k.hidden) * w * k.dtype.element_bytes();
                let case = |strategy, tokens: u64| Case {
                    strategy,
                    world: k.world,
                    dtype: k.dtype,
                    epilogue: k.epilogue,
                    tokens: tokens as u32,
                    hidden: k.hidden,
                    weight_bias: k.weight_bias as u32,
                    gamma_f32: k.gamma_f32,
                    norm_round_twice: k.norm_round_twice,
                    norm_f32_sum: k.norm_f32_sum,
                };
                for r in &plan.dispatch {
                    if r.strategy != arfuse::advanced::ir::Strategy::OneShot {
                        continue;
                    }
                    let tokens = r.max_tokens;
                    let one = bytes_moved(&case(Strategy::OneShot, tokens)).unwrap();
                    let two = bytes_moved(&case(Strategy::TwoShot, tokens)).unwrap();
                    let (name, node) = (&f.name, &n.id);
                    assert!(input(tokens) <= MIB, "{name} on {t}, {node}: T={tokens}");
                    assert!(
                        one.saturating_sub(two) <= (3 * w).saturating_sub(6) * MIB,
                        "{name} on {t}, {node}: T={tokens} one-shot {one} B, two-shot {two} B"
                    );
                    let next = tokens + 1;
                    let past = plan
                        .dispatch
                        .iter()
                        .find(|q| q.min_tokens <= next && next <= q.max_tokens);
                    if let Some(q) =
                        past.filter(|q| q.strategy == arfuse::advanced::ir::Strategy::OneShot)
                    {
                        panic!("{name} on {t}, {node}: one-shot continues at T={next} ({q:?})");
                    }
                    if past.is_some_and(|q| q.strategy == arfuse::advanced::ir::Strategy::TwoShot) {
                        // The rule, not the buffer, ended the one-shot range here, or the
                        // buffer did and the call is within it: either way one-shot at T
                        // would be over 1 MiB or not fit.
                        let fits = arfuse_runtime::device::check_fits(
                            &k.workspace,
                            Strategy::OneShot,
                            next as u32,
                            k.hidden,
                        )
                        .is_ok();
                        assert!(
                            input(next) > MIB || !fits,
                            "{name} on {t}, {node}: T={next}"
                        );
                    }
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 1_000, "{checked}");
}
