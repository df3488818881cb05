//! Every spelling of the decomposed RMSNorm the norm rules document (2 squares x 2
//! eps orders x 2 product orders x 4 outer forms) is matched and fused, with the
//! weight_bias of its form; a wrong exponent or a non-constant eps is not.

mod common;

use arfuse_ir::{DType, Graph, InputKind, Op, Value};
use common::builder::{c, s, ty, B};
use common::{h200, lowered};

#[derive(Clone, Copy, Debug)]
struct Spelling {
    xx: bool,
    eps_left: bool,
    inv_left: bool,
    /// 0: `w * cast(nf)`, 1: `cast(nf) * w`, 2: `cast(nf * wf)`, 3: `cast(wf * nf)`.
    outer: u8,
    gemma: bool,
    exponent: f64,
}

fn graph(sp: Spelling) -> Graph {
    let h = 4096;
    let mut b = B::new();
    b.sym("T", 8192);
    let act = ty(DType::Bf16, &[s("T"), c(h)]);
    let f32t = ty(DType::F32, &[s("T"), c(h)]);
    let red = ty(DType::F32, &[s("T"), c(1)]);
    let x = b.input("x", act.clone(), InputKind::Activation);
    let r = b.input("res", act.clone(), InputKind::Activation);
    let ar = b.all_reduce("ar", x, "tp", Some("model.layers.0.mlp"));
    let hsum = b.add("h", ar, r, None);
    let m = Some("model.layers.1.input_layernorm");
    let xf = b.node(
        "xf",
        Op::ToDtype { dtype: DType::F32 },
        &[hsum],
        vec![f32t.clone()],
        m,
    );
    let sq = if sp.xx {
        b.node("sq", Op::Mul, &[xf, xf], vec![f32t.clone()], m)
    } else {
        b.node(
            "sq",
            Op::Pow {
                exponent: sp.exponent,
            },
            &[xf],
            vec![f32t.clone()],
            m,
        )
    };
    let ms = b.node(
        "ms",
        Op::Mean {
            dims: vec![-1],
            keepdim: true,
        },
        &[sq],
        vec![red.clone()],
        m,
    );
    let eps = b.node(
        "eps",
        Op::Constant { value: 1e-6 },
        &[],
        vec![ty(DType::F32, &[])],
        m,
    );
    let var_in: [Value; 2] = if sp.eps_left { [eps, ms] } else { [ms, eps] };
    let var = b.node("var", Op::Add, &var_in, vec![red.clone()], m);
    let inv = b.node("inv", Op::Rsqrt, &[var], vec![red], m);
    let nf_in: [Value; 2] = if sp.inv_left { [inv, xf] } else { [xf, inv] };
    let nf = b.node("nf", Op::Mul, &nf_in, vec![f32t.clone()], m);
    let y = if sp.outer < 2 {
        let w = b.param("w", ty(DType::Bf16, &[c(h)]));
        let cast = b.node(
            "cast",
            Op::ToDtype { dtype: DType::Bf16 },
            &[nf],
            vec![act.clone()],
            m,
        );
        let ins = if sp.outer == 0 { [w, cast] } else { [cast, w] };
        b.node("y", Op::Mul, &ins, vec![act.clone()], m)
    } else {
        let wf = if sp.gemma {
            let w = b.param("w", ty(DType::F32, &[c(h)]));
            let one = b.node(
                "one",
                Op::Constant { value: 1.0 },
                &[],
                vec![ty(DType::F32, &[])],
                m,
            );
            b.node("wf", Op::Add, &[w, one], vec![ty(DType::F32, &[c(h)])], m)
        } else {
            let w = b.param("w", ty(DType::Bf16, &[c(h)]));
            b.node(
                "wf",
                Op::ToDtype { dtype: DType::F32 },
                &[w],
                vec![ty(DType::F32, &[c(h)])],
                m,
            )
        };
        let ins = if sp.outer == 2 { [nf, wf] } else { [wf, nf] };
        let p = b.node("p", Op::Mul, &ins, vec![f32t], m);
        b.node(
            "y",
            Op::ToDtype { dtype: DType::Bf16 },
            &[p],
            vec![act.clone()],
            m,
        )
    };
    b.finish(vec![y, hsum])
}

#[test]
fn every_decomposed_spelling_fuses() {
    let mut n = 0;
    for xx in [false, true] {
        for eps_left in [false, true] {
            for inv_left in [false, true] {
                for outer in 0..4u8 {
                    for gemma in [false, true] {
                        if gemma && outer < 2 {
                            continue;
                        }
                        let sp = Spelling {
                            xx,
                            eps_left,
                            inv_left,
                            outer,
                            gemma,
                            exponent: 2.0,
                        };
                        let l = lowered(&graph(sp), &h200());
                        assert_eq!(l.report.all_reduces_fused, 1, "{sp:?}\n{}", l.report);
                        let fused: Vec<_> = l
                            .graph
                            .nodes()
                            .filter_map(|(_, n)| match &n.op {
                                Op::FusedAllreduceNorm(f) => Some(f.clone()),
                                _ => None,
                            })
                            .collect();
                        assert_eq!(fused.len(), 1, "{sp:?}");
                        assert_eq!(
                            fused[0].weight_bias,
                            if gemma { 1.0 } else { 0.0 },
                            "{sp:?}"
                        );
                        assert_eq!(fused[0].eps, 1e-6, "{sp:?}");
                        n += 1;
                    }
                }
            }
        }
    }
    assert_eq!(n, 48);
}

#[test]
fn a_cube_is_not_an_rms_norm() {
    let sp = Spelling {
        xx: false,
        eps_left: false,
        inv_left: false,
        outer: 0,
        gemma: false,
        exponent: 3.0,
    };
    let l = lowered(&graph(sp), &h200());
    assert_eq!(l.report.all_reduces_fused, 0, "{}", l.report);
}
