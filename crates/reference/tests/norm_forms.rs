//! check_equivalent on the RMSNorm rounding forms: the decomposed two-rounding
//! (Llama) norm is bit-exact against a fused node that rounds twice and caught
//! against one that rounds once; the single-rounding Gemma decomposition is
//! bit-exact against the `once` node; fixtures of the IR crate; lowerings that
//! are wrong (the check must fail).

mod common;

use arfuse_ir::{
    DType, Dim, FusedAllReduceNorm, FusedOutput, FusedQuant, Graph, InputKind, NormRounding,
    Nvfp4ScaleLayout, Op, TensorType, Value,
};
use arfuse_reference::numerics::quant::nvfp4_scale_bytes;
use arfuse_reference::{
    bind_tokens, check_equivalent, evaluate, random_inputs, ReferenceError, Storage,
};
use common::{tdims, tt, Builder};

fn fixture(name: &str) -> Graph {
    let path = format!(
        "{}/../../ir-fixtures/small/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    Graph::from_json_str(&text).unwrap()
}

/// The lowered form of ir-fixtures/small/decomposed_norm_3d.json: reshape the
/// 3-D activation and residual to [B*S, H], one fused node rounding as
/// `rounding` says, reshape back.
fn lowered_decomposed_3d(rounding: NormRounding) -> Graph {
    let mut b = Builder { g: Graph::new() };
    for s in ["B", "S"] {
        let r = fixture("decomposed_norm_3d.json").symbols()[s];
        b.g.set_symbol(s, r);
    }
    let h = 2048;
    let d3 = tt(
        DType::Bf16,
        vec![Dim::symbol("B"), Dim::symbol("S"), Dim::constant(h)],
    );
    let d2 = tt(
        DType::Bf16,
        vec![Dim::parse("B*S").unwrap(), Dim::constant(h)],
    );
    let x = b.input("x", InputKind::Activation, d3.clone());
    let res = b.input("res", InputKind::Activation, d3.clone());
    let w = b.input(
        "w",
        InputKind::Parameter,
        tt(DType::Bf16, vec![Dim::constant(h)]),
    );
    let xf = b.node("flat", Op::Reshape, vec![x], vec![d2.clone()]);
    let rf = b.node("res_flat", Op::Reshape, vec![res], vec![d2.clone()]);
    let f = b.node(
        "fused",
        Op::FusedAllreduceNorm(Box::new(FusedAllReduceNorm {
            group: "tp".into(),
            eps: 1e-6,
            weight_bias: 0.0,
            norm_rounding: rounding,
            norm_input: arfuse_ir::NormInput::Residual,
            residual: true,
            quant: FusedQuant::None,
            outputs: vec![FusedOutput::Norm, FusedOutput::Residual],
            plan: None,
        })),
        vec![xf, rf, w],
        vec![d2.clone(), d2.clone()],
    );
    let y = b.node("y", Op::Reshape, vec![f], vec![d3.clone()]);
    let hh = b.node("h", Op::Reshape, vec![Value::new(f.node, 1)], vec![d3]);
    b.set_outputs(vec![y, hh]);
    b.finish()
}

#[test]
fn decomposed_llama_norm_is_exact_with_two_roundings_and_caught_with_one() {
    let original = fixture("decomposed_norm_3d.json");
    let tokens = [1, 2, 5, 16];
    let twice = lowered_decomposed_3d(NormRounding::Twice);
    let report = check_equivalent(&original, &twice, 2, &tokens, 11).unwrap();
    assert!(report.is_bit_exact(), "{report}");
    // One rounding instead of the decomposition's two: the norm output moves by 1 ulp
    // somewhere (never more), the residual not at all.
    let once = lowered_decomposed_3d(NormRounding::Once);
    let report = check_equivalent(&original, &once, 2, &tokens, 11).unwrap();
    assert!(!report.is_equivalent(), "{report}");
    let mut norm_mismatches = 0;
    for t in &report.per_tokens {
        let (y, h) = (&t.outputs[0], &t.outputs[1]);
        assert!(y.max_ulp <= 1, "{report}");
        norm_mismatches += y.bit_mismatches;
        assert_eq!(h.bit_mismatches, 0);
        assert!(h.passed);
        assert_eq!(y.shape, vec![1, t.tokens as usize, 2048]);
    }
    assert!(norm_mismatches > 0, "{report}");
    assert!(report
        .failures()
        .iter()
        .all(|(_, o)| o.index == 0 && o.max_ulp == 1));
}

/// Gemma's decomposition: `(h * r) * (1 + f32(w))` in f32, one cast back.
fn gemma_decomposed(decomposed: bool) -> Graph {
    let h = 512;
    let mut b = Builder::new(64);
    let act = tt(DType::Bf16, tdims(h));
    let x = b.input("x", InputKind::Activation, act.clone());
    let res = b.input("res", InputKind::Activation, act.clone());
    let w = b.input(
        "w",
        InputKind::Parameter,
        tt(DType::F32, vec![Dim::constant(h)]),
    );
    let a = b.all_reduce("ar", x);
    let hh = b.add("h", a, res);
    let y = if decomposed {
        let hf = b.cast("hf", hh, DType::F32);
        let sq = b.node(
            "sq",
            Op::Pow { exponent: 2.0 },
            vec![hf],
            vec![tt(DType::F32, tdims(h))],
        );
        let ms = b.node(
            "ms",
            Op::Mean {
                dims: vec![-1],
                keepdim: true,
            },
            vec![sq],
            vec![tt(DType::F32, tdims(1))],
        );
        let eps = b.node(
            "eps",
            Op::Constant { value: 1e-6 },
            vec![],
            vec![tt(DType::F32, vec![])],
        );
        let mse = b.add("mse", ms, eps);
        let r = b.node("r", Op::Rsqrt, vec![mse], vec![tt(DType::F32, tdims(1))]);
        let n = b.mul("n", hf, r);
        let one = b.node(
            "one",
            Op::Constant { value: 1.0 },
            vec![],
            vec![tt(DType::F32, vec![])],
        );
        let w1 = b.add("w1", w, one);
        let nw = b.mul("nw", n, w1);
        b.cast("y", nw, DType::Bf16)
    } else {
        b.rms_norm("y", hh, w, 1e-6, 1.0)
    };
    b.set_outputs(vec![y, hh]);
    b.finish()
}

#[test]
fn gemma_decomposition_rounds_once_and_is_bit_exact() {
    let report = check_equivalent(
        &gemma_decomposed(true),
        &gemma_decomposed(false),
        4,
        &[1, 3, 4, 33],
        5,
    )
    .unwrap();
    // The contract's single rounding is exactly Gemma's.
    assert!(report.is_bit_exact(), "{report}");
}

#[test]
fn nvfp4_fixture_matches_its_unfused_chain_and_has_the_worked_scale_size() {
    let lowered = fixture("nvfp4_final_norm.json");
    let h = 7168u64;
    let mut b = Builder::new(8192);
    let act = tt(DType::Bf16, tdims(h));
    let x = b.input("x", InputKind::Activation, act.clone());
    let res = b.input("res", InputKind::Activation, act.clone());
    let w = b.input(
        "w",
        InputKind::Parameter,
        tt(DType::Bf16, vec![Dim::constant(h)]),
    );
    let gs = b.input(
        "gs",
        InputKind::Parameter,
        tt(DType::F32, vec![Dim::constant(1)]),
    );
    let a = b.all_reduce("ar", x);
    let hh = b.add("add", a, res);
    let y = b.rms_norm("norm", hh, w, 1e-6, 0.0);
    let q = b.node(
        "q",
        Op::QuantNvfp4 {
            scale_layout: Nvfp4ScaleLayout::Swizzled128x4,
        },
        vec![y, gs],
        vec![
            tt(DType::Fp4E2m1x2, tdims(h / 2)),
            tt(DType::Fp8E4m3, tdims(h / 16)),
        ],
    );
    b.set_outputs(vec![q, Value::new(q.node, 1)]);
    let original = b.finish();
    let report = check_equivalent(&original, &lowered, 8, &[1, 7, 8, 9, 10], 3).unwrap();
    assert!(report.is_bit_exact(), "{report}");

    // Physical scale image of the fused node at T = 1: round_up(1, 128) * round_up(448, 4) bytes.
    let bind = bind_tokens(&lowered, 1).unwrap();
    let inputs = random_inputs(&lowered, 2, &bind, 9).unwrap();
    let e = evaluate(&lowered, 2, &bind, &inputs).unwrap();
    let scales = &e.outputs[1][0];
    assert_eq!(scales.shape, vec![1, 448]);
    assert_eq!(
        scales.storage,
        Storage::Nvfp4Scales(Nvfp4ScaleLayout::Swizzled128x4)
    );
    let image = scales.physical_bytes().unwrap();
    assert_eq!(
        image.len() as u64,
        nvfp4_scale_bytes(1, h, Nvfp4ScaleLayout::Swizzled128x4).unwrap()
    );
    assert_eq!(image.len(), 128 * 448);
    // Only row 0 is real: its 448 scales sit in 112 tiles at byte 0..4 of each; the rest is zero padding.
    let nonzero = image.iter().enumerate().filter(|(_, &v)| v != 0).count();
    assert!(nonzero > 0 && nonzero <= 448);
    assert!(image
        .iter()
        .enumerate()
        .all(|(i, &v)| v == 0 || i % 512 < 4));
    // Data: [1, 3584] bytes = 7168 e2m1 values.
    assert_eq!(e.outputs[0][0].shape, vec![1, 3584]);
}

#[test]
fn first_layer_fixture_stops_at_the_opaque_attention() {
    // The fixture's embedding table is 16032 x 4096; evaluate on T = 1, W = 1.
    let g = fixture("first_layer_and_block.json");
    let bind = bind_tokens(&g, 1).unwrap();
    let inputs = random_inputs(&g, 1, &bind, 1).unwrap();
    match evaluate(&g, 1, &bind, &inputs) {
        Err(ReferenceError::OpaqueOp { node, op }) => {
            assert_eq!(node, "attn");
            assert_eq!(op, "attention");
        }
        other => panic!("expected an opaque-op error, got {other:?}"),
    }
}

fn stack_with(eps_lowered: f64, wb_lowered: f64, dtype: DType) -> (Graph, Graph) {
    let h = 256;
    let build = |fused: bool| {
        let mut b = Builder::new(64);
        let act = tt(dtype, tdims(h));
        let x = b.input("x", InputKind::Activation, act.clone());
        let res = b.input("res", InputKind::Activation, act.clone());
        let w = b.input(
            "w",
            InputKind::Parameter,
            TensorType::new(dtype, vec![Dim::constant(h)]),
        );
        let outs = if fused {
            let f = b.node(
                "fused",
                Op::FusedAllreduceNorm(Box::new(FusedAllReduceNorm {
                    group: "tp".into(),
                    eps: eps_lowered,
                    weight_bias: wb_lowered,
                    norm_rounding: NormRounding::Once,
                    norm_input: arfuse_ir::NormInput::Residual,
                    residual: true,
                    quant: FusedQuant::None,
                    outputs: vec![FusedOutput::Norm, FusedOutput::Residual],
                    plan: None,
                })),
                vec![x, res, w],
                vec![act.clone(), act.clone()],
            );
            vec![f, Value::new(f.node, 1)]
        } else {
            let a = b.all_reduce("ar", x);
            let hh = b.add("add", a, res);
            vec![b.rms_norm("norm", hh, w, 1e-6, 0.0), hh]
        };
        b.set_outputs(outs);
        b.finish()
    };
    (build(false), build(true))
}

#[test]
fn wrong_lowerings_are_caught() {
    // Wrong weight_bias: every norm element moves.
    let (o, l) = stack_with(1e-6, 1.0, DType::Bf16);
    let r = check_equivalent(&o, &l, 2, &[1, 4], 1).unwrap();
    assert!(!r.is_equivalent());
    let fails = r.failures();
    assert_eq!(fails.len(), 2, "{r}");
    assert!(fails
        .iter()
        .all(|(_, c)| c.index == 0 && c.bit_mismatches > 0));
    // The residual output is still right.
    assert!(r.per_tokens.iter().all(|t| t.outputs[1].passed));

    // Wrong eps, in f32 where no rounding can hide it.
    let (o, l) = stack_with(1e-2, 0.0, DType::F32);
    let r = check_equivalent(&o, &l, 4, &[3], 1).unwrap();
    assert!(!r.is_equivalent(), "{r}");

    // Same graphs: equivalent (sanity of the helper).
    let (o, l) = stack_with(1e-6, 0.0, DType::Bf16);
    assert!(check_equivalent(&o, &l, 4, &[1, 3, 4], 1)
        .unwrap()
        .is_bit_exact());
}

#[test]
fn incomparable_graphs_are_errors() {
    let (o, _) = stack_with(1e-6, 0.0, DType::Bf16);
    let (o16, _) = stack_with(1e-6, 0.0, DType::F16);
    assert!(matches!(
        check_equivalent(&o, &o16, 2, &[1], 0),
        Err(ReferenceError::NotComparable(_))
    ));
    assert!(matches!(
        check_equivalent(&o, &o, 2, &[], 0),
        Err(ReferenceError::InvalidParameter(_))
    ));
    assert!(matches!(
        check_equivalent(&o, &o, 0, &[1], 0),
        Err(ReferenceError::InvalidParameter(_))
    ));
    // T above the declared symbol range.
    assert!(matches!(
        check_equivalent(&o, &o, 2, &[65], 0),
        Err(ReferenceError::InvalidParameter(_))
    ));
}
