//! One snapshot per pattern family and per refusal: the lowered graph (canonical text)
//! and a one-line-per-all-reduce summary of the report.

mod common;

use arfuse_ir::{DType, Graph, InputKind, Op};
use arfuse_rewrite::{lower_with, LowerOptions};
use common::builder::{c, s, ty, NormForm, Quant, Stack, B};
use common::{b200, h200, lowered, summary};

fn snap(name: &str, g: &Graph, target: &arfuse_policy::Target) {
    let l = lowered(g, target);
    insta::assert_snapshot!(
        name,
        format!("{}\n{}", summary(&l), l.graph.canonical_text())
    );
}

#[test]
fn family_first_layer_and_residual_forms() {
    snap("first_and_residual", &Stack::default().build(), &h200());
    let fa = Stack {
        norm: NormForm::FusedAdd,
        ..Stack::default()
    };
    snap("fused_add_rms_norm", &fa.build(), &h200());
}

#[test]
fn family_quant_epilogues() {
    for (name, q, t) in [
        ("quant_fp8_static", Quant::Fp8Static, h200()),
        ("quant_fp8_per_token", Quant::Fp8PerToken, h200()),
        ("quant_fp8_group", Quant::Fp8Group, h200()),
        ("quant_fp8_group_f32_ue8m0", Quant::Fp8GroupF32Ue8m0, h200()),
        ("quant_nvfp4", Quant::Nvfp4, b200()),
    ] {
        let st = Stack {
            quant: Some(q),
            ..Stack::default()
        };
        snap(name, &st.build(), &t);
        let st = Stack {
            quant: Some(q),
            norm_live_with_quant: true,
            ..Stack::default()
        };
        snap(&format!("{name}_norm_live"), &st.build(), &t);
    }
}

#[test]
fn family_gemma_and_views() {
    let st = Stack {
        gemma: true,
        ..Stack::default()
    };
    snap("gemma", &st.build(), &h200());
    let st = Stack {
        view_3d: true,
        norm: NormForm::Decomposed,
        ..Stack::default()
    };
    snap("decomposed_3d_views", &st.build(), &h200());
}

#[test]
fn decomposed_llama_norm_fuses_like_rms_norm_but_rounds_twice() {
    for layers in [1, 3] {
        let a = Stack {
            layers,
            ..Stack::default()
        }
        .build();
        let d = Stack {
            layers,
            norm: NormForm::Decomposed,
            ..Stack::default()
        }
        .build();
        let la = lowered(&a, &h200());
        let ld = lowered(&d, &h200());
        // The same fused nodes, except that the decomposition's two roundings are kept.
        let text = ld.graph.canonical_text();
        assert_eq!(
            text.matches("\"norm_rounding\":\"twice\",").count(),
            2 * layers + 1
        );
        assert_eq!(
            text.replace("\"norm_rounding\":\"twice\",", ""),
            la.graph.canonical_text()
        );
        assert!(ld.report.sites.iter().all(|s| s.fused));
        assert!(ld
            .report
            .sites
            .iter()
            .all(|s| s.notes.iter().any(|n| n.contains("rounds twice"))
                && s.pattern
                    .as_deref()
                    .is_some_and(|p| p.ends_with("(round_twice)"))));
        assert!(la.report.sites.iter().all(|s| s.notes.is_empty()));
        for (_, n) in ld.graph.nodes() {
            if let Op::FusedAllreduceNorm(f) = &n.op {
                assert_eq!(f.norm_rounding, arfuse_ir::NormRounding::Twice, "{}", n.id);
            }
        }
    }
}

/// `x`, `res`, `w` inputs of `[T, h]` / `[h]`.
fn inputs(
    b: &mut B,
    h: u64,
    wdtype: DType,
) -> (arfuse_ir::Value, arfuse_ir::Value, arfuse_ir::Value) {
    b.sym("T", 8192);
    let x = b.input("x", ty(DType::Bf16, &[s("T"), c(h)]), InputKind::Activation);
    let r = b.input(
        "res",
        ty(DType::Bf16, &[s("T"), c(h)]),
        InputKind::Activation,
    );
    let w = b.param("w", ty(wdtype, &[c(h)]));
    (x, r, w)
}

#[test]
fn refusal_dp_attention_order() {
    // add -> norm -> all-reduce (data-parallel attention): never rewritten.
    let mut b = B::new();
    let (x, r, w) = inputs(&mut b, 4096, DType::Bf16);
    let h = b.add("h", x, r, None);
    let n = b.rms_norm("n", h, w, 1e-6, 0.0, None);
    let ar = b.all_reduce("ar", n, "tp", None);
    let g = b.finish(vec![ar, h]);
    snap("refuse_dp_attention", &g, &h200());
}

#[test]
fn refusal_other_group() {
    let mut b = B::new();
    let (x, r, w) = inputs(&mut b, 4096, DType::Bf16);
    let ar = b.all_reduce("ar", x, "dp", None);
    let h = b.add("h", ar, r, None);
    let n = b.rms_norm("n", h, w, 1e-6, 0.0, None);
    let g = b.finish(vec![n, h]);
    let l = lower_with(&g, &h200(), &LowerOptions::default().with_group("tp")).unwrap();
    insta::assert_snapshot!("refuse_other_group", summary(&l));
    assert_eq!(l.graph.to_json_string(), g.to_json_string());
}

#[test]
fn refusal_two_reductions() {
    // Expert-parallel all-reduce then the tensor-parallel one: two reductions.
    let mut b = B::new();
    let (x, r, w) = inputs(&mut b, 4096, DType::Bf16);
    let ep = b.all_reduce("ep_ar", x, "ep", None);
    let tp = b.all_reduce("tp_ar", ep, "tp", None);
    let h = b.add("h", tp, r, None);
    let n = b.rms_norm("n", h, w, 1e-6, 0.0, None);
    let g = b.finish(vec![n, h]);
    let l = lower_with(&g, &h200(), &LowerOptions::default().with_group("tp")).unwrap();
    insta::assert_snapshot!("refuse_two_reductions", summary(&l));
    assert_eq!(l.graph.to_json_string(), g.to_json_string());
    // Two all-reduces summed by one add, each used only there.
    let mut b = B::new();
    let (x, r, w) = inputs(&mut b, 4096, DType::Bf16);
    let a1 = b.all_reduce("ar_a", x, "tp", None);
    let a2 = b.all_reduce("ar_b", r, "tp", None);
    let h = b.add("h", a1, a2, None);
    let n = b.rms_norm("n", h, w, 1e-6, 0.0, None);
    let g = b.finish(vec![n]);
    let l = lowered(&g, &h200());
    insta::assert_snapshot!("refuse_two_reductions_summed", summary(&l));
    assert_eq!(l.report.all_reduces_fused, 0);
}

#[test]
fn refusal_dtype_mismatch() {
    // An f32 weight on bf16 activations with weight_bias 0: not the Gemma form.
    let mut b = B::new();
    let (x, r, w) = inputs(&mut b, 4096, DType::F32);
    let ar = b.all_reduce("ar", x, "tp", None);
    let h = b.add("h", ar, r, None);
    let n = b.rms_norm("n", h, w, 1e-6, 0.0, None);
    let g = b.finish(vec![n, h]);
    snap("refuse_dtype_mismatch", &g, &h200());
}

#[test]
fn refusal_hidden_64() {
    let mut b = B::new();
    let (x, r, w) = inputs(&mut b, 64, DType::Bf16);
    let ar = b.all_reduce("ar", x, "tp", None);
    let h = b.add("h", ar, r, None);
    let n = b.rms_norm("n", h, w, 1e-6, 0.0, None);
    let g = b.finish(vec![n, h]);
    snap("refuse_hidden_64", &g, &h200());
}

#[test]
fn refusal_all_reduce_feeds_something_else_first() {
    let mut b = B::new();
    let (x, r, w) = inputs(&mut b, 4096, DType::Bf16);
    let ar = b.all_reduce("ar", x, "tp", None);
    let other = b.opaque(
        "probe",
        "probe",
        &[ar],
        ty(DType::Bf16, &[s("T"), c(4096)]),
        None,
    );
    let h = b.add("h", ar, r, None);
    let n = b.rms_norm("n", h, w, 1e-6, 0.0, None);
    let g = b.finish(vec![n, h, other]);
    snap("refuse_all_reduce_second_user", &g, &h200());
}

#[test]
fn no_fusion_target_warns() {
    let mut t = h200();
    t.requested_backend = arfuse_policy::RequestedBackend::Auto;
    t.interconnect = arfuse_policy::Interconnect::BridgedNvlink;
    let l = lowered(&Stack::default().build(), &t);
    assert_eq!(l.report.all_reduces_fused, 0);
    assert_eq!(l.report.warnings.len(), 1, "{}", l.report);
    assert!(l.report.sites.iter().all(|s| s.reason.is_some()));
    let _ = Op::Add;
}
