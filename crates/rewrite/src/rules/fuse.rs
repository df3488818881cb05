//! Fusion of an all-reduce with the residual add and RMSNorm it feeds.
//!
//! One search, `fuse` over `(rms_norm ?n ?y ?w)`, enumerates the matches of three
//! patterns (and of `norm-of-view`, documented in [`super::view`]):
//!
//! - `fuse-residual-l`: `(rms_norm ?n (add (all_reduce ?i ?x) ?r) ?w)`,
//! - `fuse-residual-r`: `(rms_norm ?n (add ?r (all_reduce ?i ?x)) ?w)`: all-reduce +
//!   residual add + RMSNorm. Adds `F = (fused k ?i ?x ?r ?w none)` and unions the
//!   norm's class with `(get @0 F)` and the add's class with `(get @1 F)`, so every
//!   user of the residual sum (the norm and the next layer's add) can read the fused
//!   node.
//! - `fuse-first`: `(rms_norm ?n (all_reduce ?i ?x) ?w)`: all-reduce + RMSNorm with no
//!   residual (first layer, or a Gemma sandwich norm). Adds
//!   `F = (fused k ?i ?x none ?w none)` and unions the norm with `(get @0 F)` and the
//!   all-reduce itself with `(get @1 F)` (its other users read the fused node's
//!   residual output, the rounded all-reduce sum).
//!
//! Conditions ([`check`]), each refusal logged against the all-reduce:
//! - the all-reduce's group is the layer's group;
//! - weight_bias is 0, or 1 (the Gemma form);
//! - x, residual and weight have the activation dtype, except the Gemma form
//!   (weight_bias 1), whose weight may be f32;
//! - the weight is `[H]`, the residual has x's type (no broadcast);
//! - a row of H elements is a multiple of 16 bytes and at least
//!   [`MIN_ROW_BYTES`] (H >= 256 at 16 bits);
//! - the all-reduce's input is not itself an all-reduce output, and the residual is not
//!   an all-reduce output used only by this add (layouts needing two reductions).
//!
//! The add consuming the all-reduce output directly is the pattern itself (views and
//! waits in between were made equal to it by the view and collective rules); that no
//! other node reads the all-reduce or the chain's intermediates is checked per site
//! from the IR's use counts when converting back.

use super::{get, leaf, rule, union, Rule, Vars};
use crate::analysis::{all_reduce_in, leaf_of, FxGraph};
use crate::lang::{FKind, Fx, Leaf, NormAttrs, PORT_NORM, PORT_RESIDUAL};
use arfuse_abi::{MIN_ROW_BYTES, VECTOR_BYTES};
use arfuse_ir::op::FusedQuant;
use arfuse_ir::DType;
use egg::Id;
use smallvec::SmallVec;

pub(crate) fn rules() -> Result<Vec<Rule>, String> {
    // One search of the `rms_norm` classes for every form (and for `norm-of-view`,
    // see [`super::view`]); the applier enumerates exactly the matches the patterns in
    // the module docs would, so the e-graph is scanned once instead of four times.
    Ok(vec![rule("fuse", "(rms_norm ?n ?y ?w)", fuse_any)?])
}

/// Every match of the three fusion patterns (and `norm-of-view`) at one `rms_norm`:
/// `(rms_norm ?n ?y ?w)`.
fn fuse_any(eg: &mut FxGraph, eclass: Id, &[n, y, w, ..]: &Vars) -> bool {
    // The matches, gathered before anything is added (one rms_norm has a few).
    type Matches = SmallVec<[(Form, Id, Id, Option<Id>); 4]>;
    let mut matches: Matches = SmallVec::new();
    let mut views: SmallVec<[(Id, Id); 2]> = SmallVec::new();
    let ar_nodes = |eg: &FxGraph, c: Id, out: &mut Matches, form: Form, r: Option<Id>| {
        for node in &eg[c].nodes {
            if let Fx::AllReduce([i, x]) = node {
                out.push((form, *i, *x, r));
            }
        }
    };
    // In the order the separate rules ran: every left form, every right form, every
    // first form, every view.
    for node in &eg[y].nodes {
        if let Fx::Add([a, b]) = node {
            ar_nodes(eg, *a, &mut matches, Form::ResidualLeft, Some(*b));
        }
    }
    for node in &eg[y].nodes {
        if let Fx::Add([a, b]) = node {
            ar_nodes(eg, *b, &mut matches, Form::ResidualRight, Some(*a));
        }
    }
    for node in &eg[y].nodes {
        match node {
            Fx::AllReduce([i, x]) => matches.push((Form::First, *i, *x, None)),
            Fx::Reshape([sh, inner]) => views.push((*sh, *inner)),
            _ => {}
        }
    }
    let mut changed = false;
    for (form, i, x, r) in matches {
        changed |= fuse(eg, eclass, n, i, x, r, w, form);
    }
    for (sh, inner) in views {
        changed |= super::view::norm_of_view(eg, eclass, n, sh, inner, w);
    }
    changed
}

/// Which spelling matched: the all-reduce left or right of the add, or no add.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Form {
    ResidualLeft,
    ResidualRight,
    First,
}

#[allow(clippy::too_many_arguments)]
fn fuse(
    eg: &mut FxGraph,
    eclass: Id,
    n: Id,
    i: Id,
    x: Id,
    r: Option<Id>,
    w: Id,
    form: Form,
) -> bool {
    let Some(Leaf::Inst(inst)) = leaf_of(eg, i) else {
        return false;
    };
    // The class the fused node's residual output replaces: the add (residual forms)
    // or the all-reduce itself (first form). Both exist: the pattern matched them.
    let Some(ar) = eg.lookup(Fx::AllReduce([i, x])) else {
        return false;
    };
    let replaced = match (form, r) {
        (Form::ResidualLeft, Some(r)) => eg.lookup(Fx::Add([ar, r])),
        (Form::ResidualRight, Some(r)) => eg.lookup(Fx::Add([r, ar])),
        _ => Some(ar),
    };
    let Some(replaced) = replaced else {
        return false;
    };
    let kind = match check(eg, n, inst, x, r, w) {
        Ok(k) => k,
        Err(why) => {
            eg.analysis.refuse(inst, why);
            return false;
        }
    };
    let k = eg.analysis.attrs.fused_leaf(kind);
    let k = leaf(eg, k);
    let none = leaf(eg, Leaf::None);
    let f = eg.add(Fx::Fused([k, i, x, r.unwrap_or(none), w, none]));
    let norm = get(eg, PORT_NORM, f);
    let res = get(eg, PORT_RESIDUAL, f);
    let a = union(eg, eclass, norm);
    let b = union(eg, replaced, res);
    a | b
}

/// The site conditions; the fused kind, or why not.
fn check(eg: &FxGraph, n: Id, inst: u32, x: Id, r: Option<Id>, w: Id) -> Result<FKind, String> {
    let an = &eg.analysis;
    let group = an.facts.instances.group(&inst).unwrap_or("");
    if group != an.facts.group {
        return Err(format!(
            "the all-reduce is over group `{group}`, but the layer's tensor-parallel group is \
             `{}`; only all-reduces over the layer's group are fused (set LowerOptions::group \
             if the layer's group is another one)",
            an.facts.group
        ));
    }
    let Some(NormAttrs {
        eps,
        bias,
        twice,
        f32_sum,
    }) = leaf_of(eg, n).and_then(|l| eg.analysis.attrs.norm(l))
    else {
        return Err("internal: norm attributes missing".into());
    };
    if f32_sum && r.is_none() {
        // The norm reads the f32 sum of an add's operands; without a residual add
        // there is no such sum to fuse (the all-reduce output alone is its own norm
        // input, matched in the rounded form).
        return Err("internal: an f32-sum norm without a residual add".into());
    }
    let b = f64::from_bits(bias);
    if b != 0.0 && b != 1.0 {
        return Err(format!(
            "weight_bias is {b}; the fused kernel supports 0 and 1 (Gemma) only"
        ));
    }
    let (Some(tx), Some(tw)) = (eg[x].data.ty(), eg[w].data.ty()) else {
        return Err("internal: untyped operand".into());
    };
    let Some(h) = an.hidden(tx) else {
        return Err(format!(
            "the hidden (last) dim of the all-reduce input {} is not a constant",
            shape_text(eg, tx.shape)
        ));
    };
    if !matches!(tx.dtype, DType::Bf16 | DType::F16 | DType::F32) {
        return Err(format!(
            "activation dtype {} is not bf16, f16 or f32",
            tx.dtype
        ));
    }
    if tw.dtype != tx.dtype && !(b == 1.0 && tw.dtype == DType::F32) {
        return Err(format!(
            "the norm weight is {} but the activation is {}; a mixed-dtype norm is only \
             fused in the Gemma form (weight_bias = 1 with an f32 weight)",
            tw.dtype, tx.dtype
        ));
    }
    let w_ok = an
        .shape(tw.shape)
        .is_some_and(|s| s.rank() == 1 && s.last().and_then(|d| d.as_const()) == Some(h));
    if !w_ok {
        return Err(format!(
            "the norm weight has shape {}, expected [{h}]",
            shape_text(eg, tw.shape)
        ));
    }
    if let Some(r) = r {
        if eg[r].data.ty() != Some(tx) {
            return Err(
                "the residual's type differs from the all-reduce's (a broadcast or a cast \
                 between them)"
                    .into(),
            );
        }
        if let Some(other) = all_reduce_in(eg, r) {
            if let Some(o) = an.facts.instances.get(&other).filter(|o| o.uses == 1) {
                return Err(format!(
                    "the add sums this all-reduce and another one (`{}`) used only by it: \
                     a layout with two reductions is never fused",
                    o.id
                ));
            }
        }
    }
    if let Some(src) = all_reduce_in(eg, x) {
        let src = an
            .facts
            .instances
            .get(&src)
            .map(|i| i.id.as_str())
            .unwrap_or("?");
        return Err(format!(
            "the all-reduce reduces the output of another all-reduce (`{src}`): a layout \
             with two reductions is never fused"
        ));
    }
    let e = tx.dtype.size_bytes();
    let row = h.saturating_mul(e);
    if row % VECTOR_BYTES != 0 || row < MIN_ROW_BYTES {
        return Err(format!(
            "H = {h} at {} is a row of {row} bytes; the fused kernel needs a multiple of \
             {VECTOR_BYTES} bytes and at least {MIN_ROW_BYTES} bytes (H >= {} at this dtype)",
            tx.dtype,
            MIN_ROW_BYTES / e
        ));
    }
    Ok(FKind {
        residual: r.is_some(),
        quant: FusedQuant::None,
        eps,
        bias,
        twice,
        f32_sum,
    })
}

fn shape_text(eg: &FxGraph, s: u32) -> String {
    eg.analysis
        .shape(s)
        .map(|s| s.to_string())
        .unwrap_or_else(|| "?".into())
}
