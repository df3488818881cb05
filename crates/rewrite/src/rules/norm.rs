//! Normalisation: every spelling of RMSNorm becomes `rms_norm`, and
//! `fused_add_rms_norm` becomes `add` + `rms_norm`, so the fusion rules see one form.
//!
//! - `fused-add-rms-norm-split` matches `(fused_add_rms_norm ?n ?x ?r ?w)` and unions
//!   its `@0` with `rms_norm(?n, add(?x, ?r), ?w)` and its `@1` with `add(?x, ?r)`.
//! - `decomposed-rms-norm-*` match the decomposition torch emits (domain.md §2):
//!   `xf = to_dtype(f32, x)`; `ms = mean_last(pow(xf, 2))` or `mean_last(xf * xf)`;
//!   `inv = rsqrt(ms + eps)` (eps a scalar constant > 0, either operand order);
//!   `nf = xf * inv` (either order); then one of the two epilogues, each kept with its
//!   own rounding (`arfuse_ir::NormRounding`, contract clause 3):
//!   - the Llama order `w * to_dtype(T, nf)` (either order), w of the activation dtype
//!     T: `rms_norm` rounding **twice** (`round_T(round_T(h * r) * w)`; for f32
//!     activations the first rounding is exact and the norm is `once`);
//!   - the weight applied in f32, `to_dtype(T, nf * wf)` (either order), rounding
//!     **once**: `wf` is `to_dtype(f32, w)` with w of dtype T (gpt-oss' `(w *
//!     x_f32).to(T)` once the importer made torch's promotion explicit, Nemotron-H's
//!     `(w.float() * x).to(T)`; weight_bias 0), `w32 + 1.0` with an f32 `w32` (Gemma's
//!     `1 + w.float()`: weight_bias 1), or an f32 weight with f32 activations.
//!
//!   A decomposition whose epilogue is neither (a weight of another dtype after the
//!   rounding to T, or a normalised value rounded to T and widened again before an f32
//!   weight multiply) is not matched, and the all-reduce it follows is refused with the
//!   op named ([`crate::analysis::FxAnalysis::refuse_at`]).

use super::{rule, union, Rule, Vars};
use crate::analysis::{all_reduce_in, leaf_of, FxGraph};
use crate::lang::{Fx, Leaf, NormAttrs};
use arfuse_ir::DType;
use egg::Id;
use smallvec::SmallVec;

pub(crate) fn rules() -> Result<Vec<Rule>, String> {
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
        rule(
            "f32-sum-rounded",
            "(to_dtype ?t (add ?p ?q))",
            f32_sum_rounded,
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
fn normed(eg: &FxGraph, nf: Id) -> SmallVec<[Normed; 2]> {
    let mut out: SmallVec<[Normed; 2]> = SmallVec::new();
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
                            if leaf_of(eg, *ml) != Some(Leaf::MeanLast) {
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
    let mut uniq: SmallVec<[Normed; 2]> = SmallVec::new();
    for m in out {
        if !uniq.contains(&m) {
            uniq.push(m);
        }
    }
    uniq
}

/// `to_dtype(T, f32(a) + f32(b))` with a and b of the 16-bit dtype T is `add(a, b)`: the
/// IR's `add` of two T values rounds their f32 sum once (contract clause 2). This is
/// the residual output of vLLM's native `fused_add_rms_norm`, whose norm reads the f32
/// sum itself ([`NormX::F32Sum`]); the union lets the fused node's residual output
/// replace it.
///
/// `(to_dtype ?t (add ?p ?q))`.
fn f32_sum_rounded(eg: &mut FxGraph, eclass: Id, &[t, p, q, ..]: &Vars) -> bool {
    let Some(Leaf::DType(t)) = leaf_of(eg, t) else {
        return false;
    };
    if !matches!(t, DType::Bf16 | DType::F16) {
        return false;
    }
    let (Some(a), Some(b)) = (widened_from(eg, p, t), widened_from(eg, q, t)) else {
        return false;
    };
    let h = eg.add(Fx::Add([a, b]));
    eg[h].data.ty() == eg[eclass].data.ty() && union(eg, eclass, h)
}

/// `(fused_add_rms_norm ?n ?x ?r ?w)`.
fn split_fused_add(eg: &mut FxGraph, eclass: Id, &[n, x, r, w]: &Vars) -> bool {
    let h = eg.add(Fx::Add([x, r]));
    let y = eg.add(Fx::RmsNorm([n, h, w]));
    let g0 = super::get(eg, 0, eclass);
    let g1 = super::get(eg, 1, eclass);
    let a = union(eg, g0, y);
    let b = union(eg, g1, h);
    a | b
}

/// The value a decomposed norm normalises.
#[derive(Clone, Copy)]
enum NormX {
    /// A value of the activation dtype T, widened to f32 (or itself, for f32).
    Value(Id),
    /// The unrounded f32 sum `f32(a) + f32(b)` of two T values: the norm of
    /// `add(a, b)` with `NormAttrs::f32_sum`.
    F32Sum(Id, Id),
}

/// The class the norm's `rms_norm` node reads, and whether it normalises the f32 sum of
/// that class's add (adding `add(a, b)` for [`NormX::F32Sum`]).
fn norm_x(eg: &mut FxGraph, x: NormX) -> (Id, bool) {
    match x {
        NormX::Value(x) => (x, false),
        NormX::F32Sum(a, b) => (eg.add(Fx::Add([a, b])), true),
    }
}

/// The source of an f32 widening cast of a value of dtype `t` in class `c` (an f32
/// class).
fn widened_from(eg: &FxGraph, c: Id, t: DType) -> Option<Id> {
    if eg[c].data.ty()?.dtype != DType::F32 {
        return None;
    }
    eg[c].nodes.iter().find_map(|n| match n {
        Fx::ToDtype([_, src]) if eg[*src].data.ty().map(|s| s.dtype) == Some(t) => Some(*src),
        _ => None,
    })
}

/// `f32(a) + f32(b)` in class `c` (an f32 add of two widened values of 16-bit dtype
/// `t`): `(a, b)`.
fn f32_sum_of(eg: &FxGraph, c: Id, t: DType) -> Option<(Id, Id)> {
    if !matches!(t, DType::Bf16 | DType::F16) {
        return None;
    }
    eg[c].nodes.iter().find_map(|n| match n {
        Fx::Add([p, q]) => Some((widened_from(eg, *p, t)?, widened_from(eg, *q, t)?)),
        _ => None,
    })
}

/// The parts every decomposed form shares: (x, eps, output dtype), when the squared
/// term, the eps and the casts check out. x is the f32 cast of a T value, an f32 value
/// (f32 activations) or the f32 sum of two widened T values (vLLM's native
/// `fused_add_rms_norm`, which normalises the residual sum before rounding it).
fn common(eg: &FxGraph, m: Normed, t: Id) -> Option<(NormX, f64, DType)> {
    if let Some(e) = m.exp {
        match leaf_of(eg, e).and_then(|l| eg.analysis.attrs.exp(l)) {
            Some(bits) if f64::from_bits(bits) == 2.0 => {}
            _ => return None,
        }
    }
    let eps = f64::from_bits(eg[m.eps].data.konst?);
    // The IR's rule: a fused node with another eps would not validate.
    if !arfuse_ir::valid_eps(eps) {
        return None;
    }
    let t = match leaf_of(eg, t) {
        Some(Leaf::DType(t)) if t.is_float() => t,
        _ => return None,
    };
    let xf = m.xf;
    if eg[xf].data.ty()?.dtype != DType::F32 {
        return None;
    }
    // x: the source of the f32 cast, of the activation dtype; or xf itself for f32
    // activations; or the f32 sum of two widened T values.
    let x = widened_from(eg, xf, t)
        .map(NormX::Value)
        .or((t == DType::F32).then_some(NormX::Value(xf)))
        .or_else(|| f32_sum_of(eg, xf, t).map(|(a, b)| NormX::F32Sum(a, b)))?;
    Some((x, eps, t))
}

fn add_norm(eg: &mut FxGraph, eclass: Id, x: Id, w: Id, a: NormAttrs) -> bool {
    let n = eg.analysis.attrs.norm_leaf(a);
    let n = super::leaf(eg, n);
    let y = eg.add(Fx::RmsNorm([n, x, w]));
    eg[y].data.ty() == eg[eclass].data.ty() && union(eg, eclass, y)
}

/// `w * to_dtype(T, nf)` (either order): the weight has the activation dtype; the norm
/// rounds twice (once when T is f32, where the first rounding is exact).
///
/// `(mul ?a ?b)`.
fn decomposed_llama(eg: &mut FxGraph, eclass: Id, &[a, b, ..]: &Vars) -> bool {
    let mut changed = false;
    // w-cast: `w * to_dtype(T, nf)`; cast-w: `to_dtype(T, nf) * w`.
    for (w, cast) in [(a, b), (b, a)] {
        let casts: SmallVec<[(Id, Id); 2]> = eg[cast]
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
                let (x, f32_sum) = norm_x(eg, x);
                let wd = eg[w].data.ty().map(|ty| ty.dtype);
                if wd != Some(t) {
                    let why = format!(
                        "its RMSNorm multiplies the normalised value, rounded to {t}, by a \
                         {} weight: neither the two-rounding form (a {t} weight) nor the \
                         one-rounding form (the weight applied in f32 before one cast to {t}) \
                         of a fused epilogue",
                        wd.map(|d| d.name()).unwrap_or("?")
                    );
                    refuse_for(eg, x, eclass, why);
                    continue;
                }
                let a = NormAttrs {
                    eps: eps.to_bits(),
                    bias: 0.0f64.to_bits(),
                    twice: t != DType::F32,
                    f32_sum,
                };
                changed |= add_norm(eg, eclass, x, w, a);
            }
        }
    }
    changed
}

/// `to_dtype(T, nf * wf)` (either order): wf is a cast of a T weight, an f32 weight
/// (f32 activations), or `w32 + 1.0` (Gemma).
///
/// `(to_dtype ?t (mul ?a ?b))`.
fn decomposed_one_rounding(eg: &mut FxGraph, eclass: Id, &[t, a, b, ..]: &Vars) -> bool {
    let mut changed = false;
    // cast-of-nf-w: `nf * wf`; cast-of-w-nf: `wf * nf`.
    for (nf, wf) in [(a, b), (b, a)] {
        for m in normed(eg, nf) {
            let Some((x, eps, t)) = common(eg, m, t) else {
                continue;
            };
            let (x, f32_sum) = norm_x(eg, x);
            match weight_of(eg, wf, t) {
                Some((w, bias)) => {
                    let a = NormAttrs {
                        eps: eps.to_bits(),
                        bias: bias.to_bits(),
                        twice: false,
                        f32_sum,
                    };
                    changed |= add_norm(eg, eclass, x, w, a);
                }
                None => {
                    let why = format!(
                        "its RMSNorm multiplies the normalised f32 value by a weight that is \
                         none of a cast of a {t} weight, `1 + w` of an f32 weight (Gemma) or an \
                         f32 weight with f32 activations ({}): not a fused epilogue",
                        describe(eg, wf)
                    );
                    refuse_for(eg, x, eclass, why);
                }
            }
        }
        // `to_dtype(f32, to_dtype(T', nf))`: rounded to T', widened, then multiplied.
        for (t2, inner) in widened_casts(eg, nf) {
            for m in normed(eg, inner) {
                let Some((x, _, _)) = common(eg, m, t2) else {
                    continue;
                };
                let (x, _) = norm_x(eg, x);
                let tn = leaf_of(eg, t2).map(|l| l.to_string()).unwrap_or_default();
                let why = format!(
                    "its RMSNorm rounds the normalised value to {tn}, widens it to f32 and \
                     multiplies it by an f32 weight before the final cast: that rounds twice \
                     around an f32 weight, which no fused epilogue computes"
                );
                refuse_for(eg, x, eclass, why);
            }
        }
    }
    changed
}

/// `(T', inner)` for every `to_dtype(f32, to_dtype(T', inner))` spelling of class `c`.
fn widened_casts(eg: &FxGraph, c: Id) -> SmallVec<[(Id, Id); 2]> {
    let mut out = SmallVec::new();
    for n in &eg[c].nodes {
        let Fx::ToDtype([d, src]) = n else { continue };
        if leaf_of(eg, *d) != Some(Leaf::DType(DType::F32)) {
            continue;
        }
        for sn in &eg[*src].nodes {
            if let Fx::ToDtype([t2, inner]) = sn {
                out.push((*t2, *inner));
            }
        }
    }
    out
}

/// A short description of class `c` for a refusal: its op and type.
fn describe(eg: &FxGraph, c: Id) -> String {
    let op = eg[c]
        .nodes
        .iter()
        .find_map(|n| match n {
            Fx::Leaf(Leaf::Value(..)) => None,
            Fx::Leaf(_) => None,
            other => Some(other.to_string()),
        })
        .unwrap_or_else(|| "a graph value".into());
    match eg[c].data.ty() {
        Some(t) => format!("{op} of dtype {}", t.dtype),
        None => op,
    }
}

/// Logs `why` against every all-reduce whose output (directly, through views, or as an
/// operand of the residual add) is the norm input `x`; `at` is the class of the op
/// that was refused, named in the report.
fn refuse_for(eg: &mut FxGraph, x: Id, at: Id, why: String) {
    for inst in feeding_all_reduces(eg, x, 4) {
        eg.analysis.refuse_at(inst, at, why.clone());
    }
}

/// The all-reduces that feed class `x`: `x` itself, an `add` operand of it, or the
/// same through at most `depth` views.
fn feeding_all_reduces(eg: &FxGraph, x: Id, depth: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for n in &eg[x].nodes {
        match n {
            Fx::AllReduce(_) => out.extend(all_reduce_in(eg, x)),
            Fx::Add([a, b]) => {
                out.extend(all_reduce_in(eg, *a));
                out.extend(all_reduce_in(eg, *b));
            }
            Fx::Reshape([_, inner]) if depth > 0 => {
                out.extend(feeding_all_reduces(eg, *inner, depth - 1))
            }
            _ => {}
        }
    }
    out.sort_unstable();
    out.dedup();
    out
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
