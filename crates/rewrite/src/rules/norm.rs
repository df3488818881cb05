//! Normalisation: every spelling of RMSNorm becomes `rms_norm`, and
//! `fused_add_rms_norm` becomes `add` + `rms_norm`, so the fusion rules see one form.
//!
//! - `fused-add-rms-norm-split` matches `(fused_add_rms_norm ?n ?x ?r ?w)` and unions
//!   its `@0` with `rms_norm(?n, add(?x, ?r), ?w)` and its `@1` with `add(?x, ?r)`.
//! - `decomposed-rms-norm-*` match the decomposition torch emits (domain.md §2):
//!   `xf = to_dtype(f32, x)`; `ms = mean_last(pow(xf, 2))` or `mean_last(xf * xf)`;
//!   `inv = rsqrt(ms + eps)` (eps a scalar constant > 0, either operand order);
//!   `nf = xf * inv` (either order); then either the Llama order
//!   `w * to_dtype(T, nf)` (either order) or the Gemma / one-rounding order
//!   `to_dtype(T, nf * wf)` (either order). In the Llama order the weight must have the
//!   activation dtype T. In the other order `wf` is `to_dtype(f32, w)` with w of dtype
//!   T (weight_bias 0), or `w32 + 1.0` with an f32 `w32` (the Gemma offset weight:
//!   weight_bias 1). Anything else is not matched.
//!
//! Optional arguments at their defaults need no rule: the IR fills attribute defaults
//! at load (weight_bias 0, reduce sum) and rejects unknown attributes, so an op that
//! gains an argument fails loudly instead of silently not matching.
//!
//! The decomposition Hugging Face's Llama code writes rounds twice (to T before the
//! weight multiply); `rms_norm` follows arfuse rounding contract v1 (one rounding), a
//! documented change of at most about 1 ulp that the report notes per decomposed site.

use super::{rule, union, var};
use crate::analysis::{FxAnalysis, FxGraph};
use crate::lang::{Fx, Leaf};
use arfuse_ir::DType;
use egg::{Id, Rewrite, Subst};

pub(crate) fn rules() -> Result<Vec<Rewrite<Fx, FxAnalysis>>, String> {
    // Three searches instead of one pattern per spelling: the inner part of the
    // decomposition (`NF`, 8 spellings) is matched by [`normed`] in the applier, so the
    // e-graph is scanned once per outer form, not once per spelling (32 scans of every
    // `mul` and `to_dtype` class made this the pass's hot spot on large graphs).
    Ok(vec![
        rule(
            "fused-add-rms-norm-split",
            "(fused_add_rms_norm ?n ?x ?r ?w)",
            split_fused_add,
        )?,
        // `(mul ?w (to_dtype ?t NF))` and `(mul (to_dtype ?t NF) ?w)`: one search, both
        // operand roles tried.
        rule("decomposed-rms-norm-llama", "(mul ?a ?b)", decomposed_llama)?,
        // `(to_dtype ?t (mul NF ?wf))` and `(to_dtype ?t (mul ?wf NF))`: one search,
        // both operand roles tried.
        rule(
            "decomposed-rms-norm-cast-of-mul",
            "(to_dtype ?t (mul ?a ?b))",
            decomposed_one_rounding,
        )?,
    ])
}

/// One match of the inner decomposition `NF`: `xf * rsqrt(mean_last(SQ) + eps)` (either
/// order of the product and of the sum), `SQ` being `pow(xf, e)` or `xf * xf`.
#[derive(Clone, Copy, PartialEq)]
struct Normed {
    xf: Id,
    /// The `pow` exponent class, when the square is a `pow`.
    exp: Option<Id>,
    eps: Id,
}

/// Every way class `nf` matches `NF` (the 8 spellings of the module docs).
fn normed(eg: &FxGraph, nf: Id) -> Vec<Normed> {
    let mut out = Vec::new();
    let same = |a: Id, b: Id| eg.find(a) == eg.find(b);
    for n in &eg[nf].nodes {
        let Fx::Mul([p, q]) = n else { continue };
        // x-inv: `xf * rsqrt(VAR)`; inv-x: `rsqrt(VAR) * xf`.
        for (xf, inv) in [(*p, *q), (*q, *p)] {
            for rn in &eg[inv].nodes {
                let Fx::Rsqrt(var) = rn else { continue };
                for vn in &eg[*var].nodes {
                    let Fx::Add([a, b]) = vn else { continue };
                    // eps-r: `mean + eps`; eps-l: `eps + mean`.
                    for (m, eps) in [(*a, *b), (*b, *a)] {
                        for mn in &eg[m].nodes {
                            let Fx::Mean([ml, sq]) = mn else { continue };
                            if eg[*ml].data.leaf != Some(Leaf::MeanLast) {
                                continue;
                            }
                            for sn in &eg[*sq].nodes {
                                match sn {
                                    Fx::Pow([e, x]) if same(*x, xf) => out.push(Normed {
                                        xf,
                                        exp: Some(*e),
                                        eps,
                                    }),
                                    Fx::Mul([x1, x2]) if same(*x1, xf) && same(*x2, xf) => {
                                        out.push(Normed { xf, exp: None, eps })
                                    }
                                    _ => {}
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    // A class matched twice the same way (e.g. `xf * xf` read both ways) is one match.
    let mut uniq: Vec<Normed> = Vec::with_capacity(out.len());
    for m in out {
        if !uniq.contains(&m) {
            uniq.push(m);
        }
    }
    uniq
}

fn split_fused_add(eg: &mut FxGraph, eclass: Id, subst: &Subst) -> Vec<Id> {
    let mut changed = Vec::new();
    let (Some(n), Some(x), Some(r), Some(w)) = (
        var(subst, "?n"),
        var(subst, "?x"),
        var(subst, "?r"),
        var(subst, "?w"),
    ) else {
        return changed;
    };
    let h = eg.add(Fx::Add([x, r]));
    let y = eg.add(Fx::RmsNorm([n, h, w]));
    let g0 = super::get(eg, 0, eclass);
    let g1 = super::get(eg, 1, eclass);
    union(eg, g0, y, &mut changed);
    union(eg, g1, h, &mut changed);
    changed
}

/// The parts every decomposed form shares: (x, eps, output dtype), when the squared
/// term, the eps and the casts check out.
fn common(eg: &FxGraph, m: Normed, t: Id) -> Option<(Id, f64, DType)> {
    if let Some(e) = m.exp {
        match eg[e].data.leaf {
            Some(Leaf::Exp(bits)) if f64::from_bits(bits) == 2.0 => {}
            _ => return None,
        }
    }
    let eps = f64::from_bits(eg[m.eps].data.konst?);
    if !(eps.is_finite() && eps > 0.0) {
        return None;
    }
    let t = match eg[t].data.leaf {
        Some(Leaf::DType(t)) if t.is_float() => t,
        _ => return None,
    };
    let xf = m.xf;
    if eg[xf].data.ty()?.dtype != DType::F32 {
        return None;
    }
    // x: the source of the f32 cast, of the activation dtype; or xf itself for f32
    // activations.
    let x = eg[xf]
        .nodes
        .iter()
        .find_map(|n| match n {
            Fx::ToDtype([_, src]) if eg[*src].data.ty().map(|s| s.dtype) == Some(t) => Some(*src),
            _ => None,
        })
        .or((t == DType::F32).then_some(xf))?;
    Some((x, eps, t))
}

fn add_norm(eg: &mut FxGraph, eclass: Id, x: Id, w: Id, eps: f64, bias: f64) -> Vec<Id> {
    let mut changed = Vec::new();
    let n = super::leaf(
        eg,
        Leaf::Norm {
            eps: eps.to_bits(),
            bias: bias.to_bits(),
        },
    );
    let y = eg.add(Fx::RmsNorm([n, x, w]));
    if eg[y].data.ty() == eg[eclass].data.ty() {
        union(eg, eclass, y, &mut changed);
    }
    changed
}

/// `w * to_dtype(T, nf)` (either order): the weight has the activation dtype.
fn decomposed_llama(eg: &mut FxGraph, eclass: Id, subst: &Subst) -> Vec<Id> {
    let mut changed = Vec::new();
    let (Some(a), Some(b)) = (var(subst, "?a"), var(subst, "?b")) else {
        return changed;
    };
    // w-cast: `w * to_dtype(T, nf)`; cast-w: `to_dtype(T, nf) * w`.
    for (w, cast) in [(a, b), (b, a)] {
        let casts: Vec<(Id, Id)> = eg[cast]
            .nodes
            .iter()
            .filter_map(|n| match n {
                Fx::ToDtype([t, nf]) => Some((*t, *nf)),
                _ => None,
            })
            .collect();
        for (t, nf) in casts {
            for m in normed(eg, nf) {
                let Some((x, eps, t)) = common(eg, m, t) else {
                    continue;
                };
                if eg[w].data.ty().map(|ty| ty.dtype) != Some(t) {
                    continue;
                }
                changed.extend(add_norm(eg, eclass, x, w, eps, 0.0));
            }
        }
    }
    changed
}

/// `to_dtype(T, nf * wf)` (either order): wf is a cast of a T weight, an f32 weight
/// (f32 activations), or `w32 + 1.0` (Gemma).
fn decomposed_one_rounding(eg: &mut FxGraph, eclass: Id, subst: &Subst) -> Vec<Id> {
    let mut changed = Vec::new();
    let (Some(t), Some(a), Some(b)) = (var(subst, "?t"), var(subst, "?a"), var(subst, "?b")) else {
        return changed;
    };
    // cast-of-nf-w: `nf * wf`; cast-of-w-nf: `wf * nf`.
    for (nf, wf) in [(a, b), (b, a)] {
        for m in normed(eg, nf) {
            let Some((x, eps, t)) = common(eg, m, t) else {
                continue;
            };
            if let Some((w, bias)) = weight_of(eg, wf, t) {
                changed.extend(add_norm(eg, eclass, x, w, eps, bias));
            }
        }
    }
    changed
}

/// The weight and weight_bias a one-rounding `wf` stands for.
fn weight_of(eg: &FxGraph, wf: Id, t: DType) -> Option<(Id, f64)> {
    let dtype = |eg: &FxGraph, id: Id| eg[id].data.ty().map(|ty| ty.dtype);
    let is_one = |eg: &FxGraph, id: Id| {
        eg[id].data.konst.map(f64::from_bits) == Some(1.0)
            && eg[id].data.ty().is_some_and(|ty| ty.dtype == DType::F32)
    };
    let mut found: Option<(Id, f64)> = None;
    for n in &eg[wf].nodes {
        match n {
            Fx::Add([a, b]) if is_one(eg, *b) && dtype(eg, *a) == Some(DType::F32) => {
                found = Some((*a, 1.0));
            }
            Fx::Add([a, b]) if is_one(eg, *a) && dtype(eg, *b) == Some(DType::F32) => {
                found = Some((*b, 1.0));
            }
            Fx::ToDtype([_, w]) if found.is_none() && dtype(eg, *w) == Some(t) => {
                found = Some((*w, 0.0));
            }
            _ => {}
        }
        if matches!(found, Some((_, b)) if b == 1.0) {
            break;
        }
    }
    if found.is_none() && t == DType::F32 && dtype(eg, wf) == Some(DType::F32) {
        found = Some((wf, 0.0));
    }
    // The weight of a norm is `[H]`; a broadcast `[1, H]` or a scalar is not matched.
    let (w, bias) = found?;
    let rank1 = eg[w]
        .data
        .ty()
        .and_then(|ty| eg.analysis.shape(ty.shape).map(|s| s.rank() == 1))
        .unwrap_or(false);
    rank1.then_some((w, bias))
}
