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
//! `quant-through-view` (same search): `?y` holds `(reshape ?s N)` where `N` holds
//! `(get @0 F)` and the reshape keeps the last (hidden) dim, as a norm on `[B, S, H]`
//! activations whose all-reduce runs on the `[B*S, H]` view. Quant ops work per token
//! (leading dims are tokens; scale layouts are defined over T = their product), so the
//! quant of the view is the view of the quant: `Fq` is added on the flat form and its
//! `@2` / `@3`, reshaped to the quant's own output shapes, are unioned with the
//! quant's outputs (types checked equal).
//!
//! Conditions: not after the Gemma form (weight_bias 1: the kernels' quant epilogues
//! assume a same-dtype weight; domain.md §2); the scale input is an f32 scalar; the
//! quant's output types exist for this H (group size divides H, NVFP4 blocks of 16).
//! NVFP4 needs SM >= 100: that is the target's business, checked per site when the
//! plan is made.

use super::{get, leaf, rule, union, Rule, Vars};
use crate::analysis::{leaf_of, FxGraph};
use crate::lang::{Fx, Leaf, PORT_NORM, PORT_QUANT, PORT_RESIDUAL, PORT_SCALE};
use arfuse_ir::op::FusedQuant;
use arfuse_ir::DType;
use egg::Id;

pub(crate) fn rules() -> Result<Vec<Rule>, String> {
    Ok(vec![rule("fuse-quant", "(quant ?q ?y ?s)", fuse_quant)?])
}

/// `(quant ?q ?y ?s)`.
fn fuse_quant(eg: &mut FxGraph, eclass: Id, &[q, y, s, ..]: &Vars) -> bool {
    let mut changed = false;
    let Some(qk) = leaf_of(eg, q).and_then(|l| eg.analysis.attrs.quant(l)) else {
        return false;
    };
    // Fused nodes whose norm output is `?y`, without an epilogue yet; or whose norm
    // output `?y` is a view of (`quant-through-view`: a reshape keeping the hidden
    // dim, as around the all-reduces of 3-D activations), with that view's shape.
    let mut fused: Vec<([Id; 6], Option<Id>)> = Vec::new();
    let no_epilogue = |eg: &FxGraph, t: Id, view: Option<Id>, out: &mut Vec<_>| {
        for tn in &eg[t].nodes {
            if let Fx::Fused(ch) = tn {
                let kind = leaf_of(eg, ch[0]).and_then(|l| eg.analysis.attrs.fused(l));
                if matches!(kind, Some(k) if k.quant == FusedQuant::None) {
                    out.push((*ch, view));
                }
            }
        }
    };
    let norm_tuples = |eg: &FxGraph, c: Id| -> Vec<Id> {
        eg[c]
            .nodes
            .iter()
            .filter_map(|n| match n {
                Fx::Get([p, t]) if leaf_of(eg, *p) == Some(Leaf::Port(PORT_NORM)) => Some(*t),
                _ => None,
            })
            .collect()
    };
    for t in norm_tuples(eg, y) {
        no_epilogue(eg, t, None, &mut fused);
    }
    let views: Vec<(Id, Id)> = eg[y]
        .nodes
        .iter()
        .filter_map(|n| match n {
            Fx::Reshape([sh, inner]) => Some((*sh, *inner)),
            _ => None,
        })
        .collect();
    for (sh, inner) in views {
        let keeps = match (leaf_of(eg, sh), eg[inner].data.ty()) {
            (Some(Leaf::Shape(to)), Some(from)) => {
                match (eg.analysis.shape(from.shape), eg.analysis.shape(to)) {
                    (Some(a), Some(b)) => a.last().is_some() && a.last() == b.last(),
                    _ => false,
                }
            }
            _ => false,
        };
        if !keeps {
            continue;
        }
        for t in norm_tuples(eg, inner) {
            no_epilogue(eg, t, Some(sh), &mut fused);
        }
    }
    fused.sort();
    fused.dedup();
    for (ch, view) in fused {
        let [k, i, x, r, w, _] = ch;
        let kind = leaf_of(eg, k).and_then(|l| eg.analysis.attrs.fused(l));
        let (Some(kind), Some(Leaf::Inst(inst))) = (kind, leaf_of(eg, i)) else {
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
        let kq = eg.analysis.attrs.fused_leaf(kq);
        let kq = leaf(eg, kq);
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
        ];
        for (a, b) in pairs {
            changed |= union(eg, a, b);
        }
        let mut outs = vec![(PORT_QUANT, 0u8)];
        if qk.writes_scales() {
            outs.push((PORT_SCALE, 1));
        }
        for (port, k) in outs {
            let a = get(eg, port, fq);
            let b = get(eg, k, eclass);
            // Through a view, the quant's output is the fused port viewed to the
            // quant's own shape (its leading dims, the port's last dim).
            let a = match view {
                None => a,
                Some(_) => match eg[b].data.ty() {
                    Some(tb) => {
                        let sh = leaf(eg, Leaf::Shape(tb.shape));
                        eg.add(Fx::Reshape([sh, a]))
                    }
                    None => continue,
                },
            };
            if eg[a].data.ty() != eg[b].data.ty() {
                continue;
            }
            changed |= union(eg, a, b);
        }
    }
    changed
}
