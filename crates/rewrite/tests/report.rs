//! The report as printed: header, workspace, dispatch, patterns, one line per site,
//! refusals grouped by reason, deduplicated notes; and a workspace shared with a wider
//! graph (`LowerOptions::shared_hidden_sizes`).

mod common;

use arfuse_ir::DType;
use arfuse_rewrite::{lower_with, LowerOptions, Lowered};
use common::builder::{c, s, ty, NormForm, Quant, Stack, B};
use common::{h200, lowered};

#[test]
fn report_of_a_quantised_stack() {
    let g = Stack {
        layers: 2,
        quant: Some(Quant::Fp8PerToken),
        ..Stack::default()
    }
    .build();
    let l = lowered(&g, &h200());
    insta::assert_snapshot!("report_quantised_stack", l.report.to_string());
}

#[test]
fn report_of_a_decomposed_stack_notes_the_two_roundings_once() {
    let g = Stack {
        layers: 2,
        norm: NormForm::Decomposed,
        view_3d: true,
        ..Stack::default()
    }
    .build();
    let l = lowered(&g, &h200());
    let text = l.report.to_string();
    assert_eq!(text.matches("rounds twice").count(), 1, "{text}");
    assert!(
        text.contains("note (5 sites): the RMSNorm rounds twice as written"),
        "{text}"
    );
    insta::assert_snapshot!("report_decomposed_stack", text);
}

#[test]
fn report_groups_refusals_by_reason() {
    // Three all-reduces over another group (same reason) and one fused site.
    let mut b = B::new();
    b.sym("T", 8192);
    let act = ty(DType::Bf16, &[s("T"), c(4096)]);
    let x = b.input("x", act.clone(), arfuse_ir::InputKind::Activation);
    let r = b.input("res", act.clone(), arfuse_ir::InputKind::Activation);
    let w = b.param("w", ty(DType::Bf16, &[c(4096)]));
    let mut outs = Vec::new();
    for k in 0..3 {
        let ar = b.all_reduce(&format!("dp{k}"), x, "dp", Some(&format!("model.dp.{k}")));
        let h = b.add(&format!("h{k}"), ar, r, None);
        outs.push(b.rms_norm(
            &format!("n{k}"),
            h,
            w,
            1e-6,
            0.0,
            Some(&format!("model.dp.{k}.norm")),
        ));
        outs.push(h);
    }
    let ar = b.all_reduce("tp0", x, "tp", Some("model.layers.0.mlp"));
    let h = b.add("ht", ar, r, None);
    outs.push(b.rms_norm(
        "nt",
        h,
        w,
        1e-6,
        0.0,
        Some("model.layers.1.input_layernorm"),
    ));
    outs.push(h);
    let g = b.finish(outs);
    let l = lower_with(&g, &h200(), &LowerOptions::default().with_group("tp")).unwrap();
    let text = l.report.to_string();
    assert!(
        text.contains("3 sites: the all-reduce is over group `dp`"),
        "{text}"
    );
    assert!(
        text.contains("layers.0.mlp -> layers.1.input_layernorm"),
        "{text}"
    );
    insta::assert_snapshot!("report_refusals_grouped", text);
}

/// The H200 target with its GPUs on bridged NVLink: the policy fuses nothing there.
fn h200_bridged() -> arfuse_policy::Target {
    let mut t = h200();
    t.interconnect = arfuse_policy::Interconnect::BridgedNvlink;
    t
}

#[test]
fn report_of_a_target_without_fusion() {
    let l = lowered(&Stack::default().build(), &h200_bridged());
    insta::assert_snapshot!("report_no_fusion", l.report.to_string());
}

/// The dense stack of two layers at H = 4,096 that the shared-workspace tests lower.
fn two_layers_at_4096() -> arfuse_ir::Graph {
    Stack {
        layers: 2,
        hidden: 4096,
        ..Stack::default()
    }
    .build()
}

/// `g` lowered for `t` with the workspace shared with graphs of hidden sizes `sizes`.
fn shared_with(g: &arfuse_ir::Graph, t: &arfuse_policy::Target, sizes: &[u64]) -> Lowered {
    lower_with(
        g,
        t,
        &LowerOptions::default().with_shared_hidden_sizes(sizes),
    )
    .unwrap()
}

/// The report's notes about shared hidden sizes the kernels cannot run.
fn shared_size_notes(l: &Lowered) -> Vec<&String> {
    l.report
        .notes
        .iter()
        .filter(|n| n.starts_with("shared hidden size"))
        .collect()
}

/// A speculative-decoding draft wider than the target shares the target's workspace:
/// the workspace is sized for the draft's H, so max_token_num is smaller than the
/// target alone would get, and every fused site's plan says so.
#[test]
fn a_wider_shared_graph_sizes_the_workspace() {
    let g = two_layers_at_4096();
    let alone = lowered(&g, &h200());
    let shared = shared_with(&g, &h200(), &[8192]);
    let (wa, ws) = (&alone.report.workspaces[0], &shared.report.workspaces[0]);
    assert_eq!(wa.hidden, Some(4096));
    assert_eq!(ws.hidden, Some(8192));
    assert_eq!(ws.own_hidden_sizes, vec![4096]);
    assert_eq!(ws.shared_hidden_sizes, vec![8192]);
    // SM90 W=8: 0.5 MiB / (H * 2): 64 tokens at 4096, 32 at 8192 (domain.md §4).
    assert_eq!(wa.max_token_num, 64);
    assert_eq!(ws.max_token_num, 32);
    assert_eq!(shared.report.all_reduces_fused, 5);
    for (_, n) in shared.graph.nodes() {
        if let arfuse_ir::Op::FusedAllreduceNorm(f) = &n.op {
            let plan = f.plan.as_ref().unwrap();
            assert_eq!(plan.max_token_num, 32);
            assert_eq!(
                plan.workspace.lamport_buffer_bytes,
                ws.lamport_buffer_bytes.unwrap()
            );
            let last_fused = plan
                .dispatch
                .iter()
                .filter(|r| r.strategy != arfuse_ir::Strategy::Unfused)
                .map(|r| r.max_tokens)
                .max();
            assert_eq!(last_fused, Some(32));
        }
    }
    let text = shared.report.to_string();
    assert!(
        text.contains("sized for H = 8,192 (this graph: H = 4,096; shared with H = 8,192)"),
        "{text}"
    );
    assert!(text.contains("max_token_num 32"), "{text}");
    // A narrower shared graph changes nothing.
    let narrow = shared_with(&g, &h200(), &[2048]);
    assert_eq!(narrow.graph.to_json_string(), alone.graph.to_json_string());
    assert_eq!(narrow.report.workspaces[0].max_token_num, 64);
    // An invalid shared size is an error, not a silent resize.
    assert!(lower_with(
        &g,
        &h200(),
        &LowerOptions::default().with_shared_hidden_sizes(vec![0]),
    )
    .is_err());
}

/// A shared hidden size the fused kernels cannot run (4,100 at bf16: a row of 8,200
/// bytes, not a multiple of 16) never uses the workspace: the workspace stays sized for
/// this graph's 4,096, the output is the unshared one, and a note says why (none when
/// the target plans no workspace); a wider size they can run (4,104) sizes it, with no
/// such note.
#[test]
fn a_shared_size_the_kernels_cannot_run_does_not_size_the_workspace_and_is_said() {
    let g = two_layers_at_4096();
    let alone = lowered(&g, &h200());
    let odd = shared_with(&g, &h200(), &[4100]);
    let ws = &odd.report.workspaces[0];
    assert_eq!(ws.hidden, Some(4096));
    assert_eq!(ws.shared_hidden_sizes, vec![4100]);
    assert_eq!(ws.max_token_num, 64);
    assert_eq!(odd.graph.to_json_string(), alone.graph.to_json_string());
    let said = shared_size_notes(&odd);
    assert_eq!(
        said,
        vec![
            "shared hidden size H = 4100 is not fused: H = 4100 at bf16 is a row of 8200 \
             bytes, not a multiple of the kernels' 16-byte vectors; the all-reduces of a \
             graph of that size stay unfused and do not use the bf16 workspace, which is \
             sized for H = 4096"
        ]
    );
    let text = odd.report.to_string();
    assert!(
        text.contains("sized for H = 4,096 (this graph: H = 4,096; shared with H = 4,100)"),
        "{text}"
    );
    assert!(
        text.contains("note: shared hidden size H = 4,100 is not fused"),
        "{text}"
    );
    // A target that fuses nothing plans no workspace: no such note (the report gives
    // the plan's own reason).
    let none = shared_with(&g, &h200_bridged(), &[4100]);
    assert_eq!(none.report.workspaces[0].hidden, None);
    assert!(
        shared_size_notes(&none).is_empty(),
        "{:?}",
        none.report.notes
    );
    let wide = shared_with(&g, &h200(), &[4104]);
    assert_eq!(wide.report.workspaces[0].hidden, Some(4104));
    assert_eq!(wide.report.workspaces[0].max_token_num, 63);
    assert!(
        shared_size_notes(&wide).is_empty(),
        "{:?}",
        wide.report.notes
    );
}

/// A graph without an all-reduce has no layer group: the header says so instead of
/// naming an empty one.
#[test]
fn a_graph_without_an_all_reduce_has_no_group() {
    let mut b = B::new();
    b.sym("T", 64);
    let x = b.input(
        "x",
        ty(DType::Bf16, &[s("T"), c(256)]),
        arfuse_ir::InputKind::Activation,
    );
    let w = b.param("w", ty(DType::Bf16, &[c(256)]));
    let y = b.rms_norm("n", x, w, 1e-6, 0.0, None);
    let g = b.finish(vec![y]);
    let l = lowered(&g, &h200());
    let text = l.report.to_string();
    let header = text.lines().next().unwrap();
    assert!(
        header.starts_with("arfuse lower: no group (no all-reduce in the graph); target SM 90"),
        "{header}"
    );
    assert!(header.ends_with("all-reduces fused 0 / 0"), "{header}");
    assert_eq!(l.report.group, "");
}

/// A graph with bf16 and f32 sites is planned once per dtype; a planner note both
/// plans give word for word is in the report once.
#[test]
fn a_note_two_dtypes_plans_share_is_reported_once() {
    let mut b = B::new();
    b.sym("T", 8192);
    let mut outs = Vec::new();
    for (name, dtype) in [("a", DType::Bf16), ("b", DType::F32)] {
        let x = b.input(
            &format!("{name}.x"),
            ty(dtype, &[s("T"), c(4096)]),
            arfuse_ir::InputKind::Activation,
        );
        let w = b.param(&format!("{name}.w"), ty(dtype, &[c(4096)]));
        let ar = b.all_reduce(&format!("{name}.ar"), x, "tp", None);
        outs.push(b.rms_norm(&format!("{name}.norm"), ar, w, 1e-6, 0.0, None));
    }
    let g = b.finish(outs);
    let l = lowered(&g, &h200());
    let dtypes: Vec<&str> = l
        .report
        .workspaces
        .iter()
        .map(|w| w.dtype.as_str())
        .collect();
    assert_eq!(dtypes.len(), 2, "{dtypes:?}");
    assert_eq!(l.report.all_reduces_fused, 2);
    let notes = &l.report.notes;
    let mut unique = notes.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), notes.len(), "{notes:#?}");
    // The PDL note is the same for both plans: once.
    assert_eq!(
        notes.iter().filter(|n| n.contains("PDL")).count(),
        1,
        "{notes:#?}"
    );
}
