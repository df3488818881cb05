//! Quant epilogues after a fused all-reduce + RMSNorm.
//!
//! `fuse-quant` matches `(quant ?q ?y ?s)` where `?y` holds `(get @0 F)` of a fused node
//! `F` without a quant epilogue: static FP8 (`?s` the f32 dequant scale), dynamic
//! per-token FP8, per-token-group FP8 (either scale layout) and NVFP4 (`?s` the f32
//! global scale). It adds `Fq`, the same fused node with the epilogue, and unions
//! `(get @0 Fq)` with the norm, `(get @1 Fq)` with F's residual, `(get @2 Fq)` with the
//! quantised output and `(get @3 Fq)` with the scales. Whether the norm output is also
//! written is decided per site from liveness.
//!
//! Conditions: not after the Gemma form (weight_bias 1: the kernels' quant epilogues
//! assume a same-dtype weight; domain.md §2); the scale input is an f32 scalar; the
//! quant's output types exist for this H (group size divides H, NVFP4 blocks of 16).
//! NVFP4 needs SM >= 100: that is the target's business, checked per site when the
//! plan is made.

use super::{get, leaf, rule, union, var};
use crate::analysis::{FxAnalysis, FxGraph};
use crate::lang::{Fx, Leaf, PORT_NORM, PORT_QUANT, PORT_RESIDUAL, PORT_SCALE};
use arfuse_ir::DType;
use egg::{Id, Rewrite, Subst};

pub(crate) fn rules() -> Result<Vec<Rewrite<Fx, FxAnalysis>>, String> {
    Ok(vec![rule("fuse-quant", "(quant ?q ?y ?s)", fuse_quant)?])
}

fn fuse_quant(eg: &mut FxGraph, eclass: Id, subst: &Subst) -> Vec<Id> {
    let mut changed = Vec::new();
    let (Some(q), Some(y), Some(s)) = (var(subst, "?q"), var(subst, "?y"), var(subst, "?s")) else {
        return changed;
    };
    let Some(Leaf::Quant(qk)) = eg[q].data.leaf else {
        return changed;
    };
    // Fused nodes whose norm output is `?y`, without an epilogue yet.
    let mut fused: Vec<[Id; 6]> = Vec::new();
    for node in &eg[y].nodes {
        let Fx::Get([p, t]) = node else { continue };
        if eg[*p].data.leaf != Some(Leaf::Port(PORT_NORM)) {
            continue;
        }
        for tn in &eg[*t].nodes {
            if let Fx::Fused(ch) = tn {
                if matches!(eg[ch[0]].data.leaf, Some(Leaf::Fused(k)) if k.quant == crate::lang::QKind::None)
                {
                    fused.push(*ch);
                }
            }
        }
    }
    fused.sort();
    fused.dedup();
    for ch in fused {
        let [k, i, x, r, w, _] = ch;
        let (Some(Leaf::Fused(kind)), Some(Leaf::Inst(inst))) = (eg[k].data.leaf, eg[i].data.leaf)
        else {
            continue;
        };
        if f64::from_bits(kind.bias) != 0.0 {
            eg.analysis.refuse(
                inst,
                format!(
                    "{} quant after a Gemma-form norm (weight offset 1, f32 weight) is not \
                     fused: the kernels' quant epilogues assume a same-dtype weight",
                    qk.name()
                ),
            );
            continue;
        }
        let scale = if qk.takes_scale_input() {
            let ok = eg[s].data.ty().is_some_and(|t| {
                t.dtype == DType::F32
                    && eg
                        .analysis
                        .shape(t.shape)
                        .is_some_and(|sh| sh.numel().and_then(|d| d.as_const()) == Some(1))
            });
            if !ok {
                eg.analysis.refuse(
                    inst,
                    format!("the {} scale input is not an f32 scalar", qk.name()),
                );
                continue;
            }
            s
        } else {
            leaf(eg, Leaf::None)
        };
        let mut kq = kind;
        kq.quant = qk;
        let kq = leaf(eg, Leaf::Fused(kq));
        let fq = eg.add(Fx::Fused([kq, i, x, r, w, scale]));
        if eg[fq]
            .data
            .outs
            .get(PORT_QUANT as usize)
            .copied()
            .flatten()
            .is_none()
        {
            continue;
        }
        let f = eg.add(Fx::Fused(ch));
        let pairs = [
            (get(eg, PORT_NORM, fq), get(eg, PORT_NORM, f)),
            (get(eg, PORT_RESIDUAL, fq), get(eg, PORT_RESIDUAL, f)),
            (get(eg, PORT_QUANT, fq), get(eg, 0, eclass)),
        ];
        for (a, b) in pairs {
            union(eg, a, b, &mut changed);
        }
        if qk.writes_scales() {
            let a = get(eg, PORT_SCALE, fq);
            let b = get(eg, 1, eclass);
            union(eg, a, b, &mut changed);
        }
    }
    changed
}
