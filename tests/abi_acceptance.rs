//! The planner cannot emit a plan the runtime refuses (issue 44): for generated targets
//! (W, dtype, SM, interconnect, size-table override) and sites (H, quant epilogue), every
//! fused node of the lowered graph is accepted by the runtime
//! (`NodeKernels::from_graph`, which the `Runner` calls when a node is added: W, dtype,
//! row, epilogue, a built variant for every fused range, the plan's workspace), and a
//! target the kernels cannot run (a W outside `arfuse::advanced::abi::WORLD_SIZES`, a row outside
//! `arfuse::advanced::abi::row_unsupported`, an epilogue outside `Quant::unsupported`) is planned
//! unfused with the ABI's reason in the report.

use arfuse::advanced::ir::{FusedQuant, Graph, GroupScaleLayout, Nvfp4ScaleLayout, Op};
use arfuse::advanced::policy::{ActDtype, Interconnect, KernelLibrary, Target};
use arfuse_runtime::node::NodeKernels;
use proptest::prelude::*;

/// The quant op of a site, as the IR spells it, with its outputs' JSON types.
fn quant_node(q: FusedQuant, h: u64) -> (String, Vec<String>, bool) {
    let t = |dtype: &str, last: u64| format!(r#"{{"dtype": "{dtype}", "shape": ["T", {last}]}}"#);
    match q {
        FusedQuant::None => (String::new(), vec![], false),
        FusedQuant::Fp8Static => (
            r#""op": "quant_fp8_static""#.into(),
            vec![t("fp8_e4m3", h)],
            true,
        ),
        FusedQuant::Fp8PerToken => (
            r#""op": "quant_fp8_per_token""#.into(),
            vec![t("fp8_e4m3", h), t("f32", 1)],
            false,
        ),
        FusedQuant::Fp8PerTokenGroup {
            group_size,
            scale_layout,
        } => {
            let groups = h / group_size;
            let scales = if scale_layout.f32_storage() {
                t("f32", groups)
            } else {
                t("i32", groups.div_ceil(4))
            };
            (
                format!(
                    r#""op": "quant_fp8_per_token_group", "attrs": {{"group_size": {group_size}, "scale_layout": "{}"}}"#,
                    scale_layout.name()
                ),
                vec![t("fp8_e4m3", h), scales],
                false,
            )
        }
        FusedQuant::Nvfp4 { scale_layout } => (
            format!(
                r#""op": "quant_nvfp4", "attrs": {{"scale_layout": "{}"}}"#,
                match scale_layout {
                    Nvfp4ScaleLayout::Linear => "linear",
                    Nvfp4ScaleLayout::Swizzled128x4 => "swizzled_128x4",
                }
            ),
            vec![t("fp4_e2m1x2", h / 2), t("fp8_e4m3", h / 16)],
            true,
        ),
    }
}

/// One decoder site: all-reduce -> residual add -> RMSNorm (-> quant), T in 1..=2048,
/// recorded for `world` ranks.
fn site_graph(h: u64, dtype: ActDtype, q: FusedQuant, world: u32) -> Graph {
    let d = dtype.name();
    let act = format!(r#"[{{"dtype": "{d}", "shape": ["T", {h}]}}]"#);
    let mut nodes = vec![
        format!(r#"{{"id": "x", "op": "input", "outputs": {act}}}"#),
        format!(r#"{{"id": "res", "op": "input", "outputs": {act}}}"#),
        format!(
            r#"{{"id": "w", "op": "input", "attrs": {{"kind": "parameter"}}, "outputs": [{{"dtype": "{d}", "shape": [{h}]}}]}}"#
        ),
        format!(
            r#"{{"id": "ar", "op": "all_reduce", "attrs": {{"group": "tp"}}, "inputs": ["x"], "outputs": {act}}}"#
        ),
        format!(r#"{{"id": "h", "op": "add", "inputs": ["ar", "res"], "outputs": {act}}}"#),
        format!(
            r#"{{"id": "n", "op": "rms_norm", "attrs": {{"eps": 1e-6}}, "inputs": ["h", "w"], "outputs": {act}}}"#
        ),
    ];
    let mut outputs = vec![r#""h""#.to_string()];
    let (op, outs, scale_in) = quant_node(q, h);
    if op.is_empty() {
        outputs.push(r#""n""#.into());
    } else {
        let mut inputs = vec![r#""n""#.to_string()];
        if scale_in {
            nodes.push(
                r#"{"id": "s", "op": "input", "attrs": {"kind": "parameter"}, "outputs": [{"dtype": "f32", "shape": [1]}]}"#
                    .into(),
            );
            inputs.push(r#""s""#.into());
        }
        nodes.push(format!(
            r#"{{"id": "q", {op}, "inputs": [{}], "outputs": [{}]}}"#,
            inputs.join(", "),
            outs.join(", ")
        ));
        outputs.extend((0..outs.len()).map(|k| {
            if k == 0 {
                r#""q""#.to_string()
            } else {
                format!(r#""q:{k}""#)
            }
        }));
    }
    let text = format!(
        r#"{{"format": "arfuse-graph", "version": 1, "symbols": {{"T": {{"min": 1, "max": 2048}}}},
            "nodes": [{}], "outputs": [{}], "metadata": {{"world_size": {world}}}}}"#,
        nodes.join(",\n"),
        outputs.join(", ")
    );
    Graph::from_json_str(&text).unwrap_or_else(|e| panic!("site graph: {e}\n{text}"))
}

/// A target of arfuse's kernels for `world` ranks in one NVSwitch node (or an NVLink
/// fabric of nodes of 4 GPUs when `fabric`).
fn target(world: u32, sm: u32, dtype: ActDtype, fabric: bool, cap: Option<u64>) -> Target {
    let mut t = Target::preset("h200-sxm-x8").expect("preset");
    t.sm = sm;
    t.world_size = world;
    t.dtype = dtype;
    t.kernels = KernelLibrary::Arfuse;
    t.max_batched_tokens = 2048;
    t.capture_sizes = vec![1, 2, 4, 8, 16];
    t.max_bytes_override = cap;
    if fabric {
        t.interconnect = Interconnect::NvlinkFabric;
        t.gpus_per_node = 4;
        t.group_nodes = world.div_ceil(4);
    } else {
        t.interconnect = Interconnect::Nvswitch;
        t.gpus_per_node = world.max(8);
        t.group_nodes = 1;
    }
    t.multicast_all_ranks = true;
    t
}

fn quant_strategy() -> impl Strategy<Value = FusedQuant> {
    prop_oneof![
        Just(FusedQuant::None),
        Just(FusedQuant::Fp8Static),
        Just(FusedQuant::Fp8PerToken),
        (prop::sample::select(vec![64u64, 128]), 0..3usize).prop_map(|(g, l)| {
            FusedQuant::Fp8PerTokenGroup {
                group_size: g,
                scale_layout: GroupScaleLayout::ALL[l],
            }
        }),
        prop::bool::ANY.prop_map(|s| FusedQuant::Nvfp4 {
            scale_layout: if s {
                Nvfp4ScaleLayout::Swizzled128x4
            } else {
                Nvfp4ScaleLayout::Linear
            }
        }),
    ]
}

/// What the runtime says about every fused node of a lowering: the node ids, or the
/// first refusal.
fn runtime_accepts(lowered: &Graph, world: u32) -> Result<Vec<String>, String> {
    let mut ids = Vec::new();
    for (_, node) in lowered.nodes() {
        if let Op::FusedAllreduceNorm(_) = &node.op {
            NodeKernels::from_graph(lowered, &node.id, world)
                .map_err(|e| format!("{}: {e}", node.id))?;
            ids.push(node.id.clone());
        }
    }
    Ok(ids)
}

/// The report's text with its thousands separators dropped (`131,072` -> `131072`), as
/// the ABI's sentences spell numbers.
fn plain_numbers(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    c.iter()
        .enumerate()
        .filter(|&(i, &ch)| {
            !(ch == ','
                && i > 0
                && c[i - 1].is_ascii_digit()
                && c.get(i + 1).is_some_and(|n| n.is_ascii_digit()))
        })
        .map(|(_, &ch)| ch)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, .. ProptestConfig::default() })]

    #[test]
    fn every_fused_node_the_planner_emits_is_one_the_runtime_runs(
        world in prop::sample::select(vec![2u32, 3, 4, 6, 8, 12, 16, 24, 32, 64]),
        sm in prop::sample::select(vec![90u32, 100, 103]),
        dtype in prop::sample::select(ActDtype::ALL.to_vec()),
        h in prop::sample::select(vec![192u64, 256, 320, 1000, 2048, 2880, 4096, 7168, 16384, 32768, 40960]),
        quant in quant_strategy(),
        fabric in prop::bool::ANY,
        cap in prop::option::of(prop::sample::select(vec![1u64 << 20, 64 << 20])),
    ) {
        // The IR only holds quant ops whose groups divide H.
        let divides = match quant {
            FusedQuant::Fp8PerTokenGroup { group_size, .. } => h % group_size == 0,
            FusedQuant::Nvfp4 { .. } => h % 16 == 0,
            _ => true,
        };
        prop_assume!(divides);
        let g = site_graph(h, dtype, quant, world);
        let t = target(world, sm, dtype, fabric, cap);
        let lowered = arfuse::lower(&g, &t).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let fused = runtime_accepts(&lowered.graph, world).map_err(TestCaseError::fail)?;
        let report = plain_numbers(&lowered.report.to_string());
        // The ABI's reasons are in the report where nothing refused the site before the
        // plan: a backend the machine has not, or the rewrite's own rule for rows too
        // small or misaligned.
        let backend = arfuse::advanced::policy::resolve_backend(&t)
            .map_err(|e| TestCaseError::fail(e.to_string()))?
            .backend();
        // (A row wider than any library's, `check_hidden`, is the planner's error.)
        let planned = backend.is_some()
            && arfuse::advanced::abi::row_shape_unsupported(h, dtype).is_none()
            && arfuse::advanced::policy::check_hidden(h, dtype).is_ok();
        if let Some(why) = arfuse::advanced::abi::world_unsupported(world) {
            prop_assert!(fused.is_empty(), "W = {world} fused: {fused:?}");
            if planned && arfuse::advanced::abi::row_unsupported(h, dtype).is_none() {
                prop_assert!(report.contains(&why), "W = {world}: report lacks {why:?}:\n{report}");
            }
        }
        if let Some(why) = arfuse::advanced::abi::row_unsupported(h, dtype) {
            prop_assert!(fused.is_empty(), "H = {h} {dtype} fused: {fused:?}");
            if planned && arfuse::advanced::abi::world_unsupported(world).is_none() {
                prop_assert!(report.contains(&why), "H = {h} {dtype}: report lacks {why:?}:\n{report}");
            }
        }
        // An epilogue the kernels cannot run is never fused into the node.
        for (_, node) in lowered.graph.nodes() {
            if let Op::FusedAllreduceNorm(a) = &node.op {
                let q = a.quant.kernel_quant().map_err(TestCaseError::fail)?;
                prop_assert_eq!(q.unsupported(h, dtype), None);
            }
        }
    }
}

#[test]
fn the_issue_cases_are_unfused_with_the_abis_reason() {
    // W = 6 on NVSwitch and W = 32 on an NVL72 fabric, with a size-table override: the
    // planner used to fuse both ("fused 2 / 2") and the runtime refused them.
    for (world, fabric) in [(6, false), (32, true)] {
        let g = site_graph(4096, ActDtype::Bf16, FusedQuant::None, world);
        let t = target(world, 100, ActDtype::Bf16, fabric, Some(64 << 20));
        let lowered = arfuse::lower(&g, &t).expect("lowers");
        assert_eq!(
            runtime_accepts(&lowered.graph, world),
            Ok(vec![]),
            "W = {world}"
        );
        let report = lowered.report.to_string();
        assert!(
            report.contains(&format!(
                "world size {world}: arfuse's fused kernels are built for W in {{2, 4, 8, 16}}"
            )),
            "W = {world}:\n{report}"
        );
    }
    // W = 16 on a fabric with the override is fused, and the runtime takes it.
    let g = site_graph(4096, ActDtype::Bf16, FusedQuant::Fp8PerToken, 16);
    let lowered =
        arfuse::lower(&g, &target(16, 100, ActDtype::Bf16, true, Some(64 << 20))).expect("lowers");
    assert_eq!(runtime_accepts(&lowered.graph, 16).map(|v| v.len()), Ok(1));
}
