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
    let mut rules = vec![rule(
        "fused-add-rms-norm-split",
        "(fused_add_rms_norm ?n ?x ?r ?w)",
        split_fused_add,
    )?];
    let squares = [("pow", "(pow ?e ?xf)"), ("xx", "(mul ?xf ?xf)")];
    let variances = [
        ("eps-r", "(add (mean mean_last SQ) ?eps)"),
        ("eps-l", "(add ?eps (mean mean_last SQ))"),
    ];
    let normed = [
        ("x-inv", "(mul ?xf (rsqrt VAR))"),
        ("inv-x", "(mul (rsqrt VAR) ?xf)"),
    ];
    let outers: [(&str, &str, crate::rules::ApplyFn); 4] = [
        ("w-cast", "(mul ?w (to_dtype ?t NF))", decomposed_llama),
        ("cast-w", "(mul (to_dtype ?t NF) ?w)", decomposed_llama),
        (
            "cast-of-nf-w",
            "(to_dtype ?t (mul NF ?wf))",
            decomposed_one_rounding,
        ),
        (
            "cast-of-w-nf",
            "(to_dtype ?t (mul ?wf NF))",
            decomposed_one_rounding,
        ),
    ];
    for (sn, sq) in squares {
        for (vn, var) in variances {
            for (nn, nf) in normed {
                for (on, outer, apply) in outers {
                    let nf = nf.replace("VAR", &var.replace("SQ", sq));
                    let pattern = outer.replace("NF", &nf);
                    let name = format!("decomposed-rms-norm-{on}-{nn}-{vn}-{sn}");
                    rules.push(rule(&name, &pattern, apply)?);
                }
            }
        }
    }
    Ok(rules)
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
fn common(eg: &FxGraph, subst: &Subst) -> Option<(Id, f64, DType)> {
    if let Some(e) = var(subst, "?e") {
        match eg[e].data.leaf {
            Some(Leaf::Exp(bits)) if f64::from_bits(bits) == 2.0 => {}
            _ => return None,
        }
    }
    let eps = f64::from_bits(eg[var(subst, "?eps")?].data.konst?);
    if !(eps.is_finite() && eps > 0.0) {
        return None;
    }
    let t = match eg[var(subst, "?t")?].data.leaf {
        Some(Leaf::DType(t)) if t.is_float() => t,
        _ => return None,
    };
    let xf = var(subst, "?xf")?;
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

/// `w * to_dtype(T, nf)`: the weight has the activation dtype.
fn decomposed_llama(eg: &mut FxGraph, eclass: Id, subst: &Subst) -> Vec<Id> {
    let Some((x, eps, t)) = common(eg, subst) else {
        return Vec::new();
    };
    let Some(w) = var(subst, "?w") else {
        return Vec::new();
    };
    if eg[w].data.ty().map(|ty| ty.dtype) != Some(t) {
        return Vec::new();
    }
    add_norm(eg, eclass, x, w, eps, 0.0)
}

/// `to_dtype(T, nf * wf)`: wf is a cast of a T weight, an f32 weight (f32
/// activations), or `w32 + 1.0` (Gemma).
fn decomposed_one_rounding(eg: &mut FxGraph, eclass: Id, subst: &Subst) -> Vec<Id> {
    let Some((x, eps, t)) = common(eg, subst) else {
        return Vec::new();
    };
    let Some(wf) = var(subst, "?wf") else {
        return Vec::new();
    };
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
    let Some((w, bias)) = found else {
        return Vec::new();
    };
    let rank1 = eg[w]
        .data
        .ty()
        .and_then(|ty| eg.analysis.shape(ty.shape).map(|s| s.rank() == 1))
        .unwrap_or(false);
    if !rank1 {
        return Vec::new();
    }
    add_norm(eg, eclass, x, w, eps, bias)
}
