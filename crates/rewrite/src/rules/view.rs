//! Views: shape-preserving reshapes between the all-reduce and the add (and the norm)
//! are seen through (domain.md §2: `[B*S, H] <-> [B, S, H]`).
//!
//! - `reshape-identity`: `(reshape ?s ?x)` with `?x` already of shape `?s` is `?x`.
//! - `reshape-of-reshape`: `(reshape ?s (reshape ?u ?x))` is `(reshape ?s ?x)`.
//! - `add-of-view-l` / `-r` (one search, `add-of-view`): `(add (reshape ?s ?a) ?b)` where `?a` holds an all-reduce,
//!   the reshape keeps the last (hidden) dim, and `?b` has shape `?s` exactly (no
//!   broadcast) and `?a`'s dtype: it is `(reshape ?s (add ?a (reshape shape(?a) ?b)))`.
//!   The other operand order likewise, keeping the order.
//! - `norm-of-view` (applied by the `fuse` search of `rms_norm` classes): `(rms_norm ?n (reshape ?s ?y) ?w)` where `?y` holds an all-reduce
//!   or an add of one, and the reshape keeps the last dim: it is
//!   `(reshape ?s (rms_norm ?n ?y ?w))` (RMSNorm works per row of H).
//!
//! Only reshapes next to an all-reduce are pushed, so the e-graph does not grow with the
//! rest of the model's views.

use super::{leaf, rule, union, Rule, Vars};
use crate::analysis::{all_reduce_in, leaf_of, FxGraph};
use crate::lang::{Fx, Leaf};
use egg::Id;

pub(crate) fn rules() -> Result<Vec<Rule>, String> {
    // `norm-of-view` is applied by the single `rms_norm` search of [`super::fuse`];
    // both operand orders of `add-of-view` share one search of the `add` classes.
    Ok(vec![
        rule("reshape-identity", "(reshape ?s ?x)", reshape_identity)?,
        rule(
            "reshape-of-reshape",
            "(reshape ?s (reshape ?u ?x))",
            reshape_of_reshape,
        )?,
        rule("add-of-view", "(add ?p ?q)", add_of_view)?,
    ])
}

/// `add-of-view-l` then `add-of-view-r` at one `add` class.
/// `(add ?p ?q)`.
fn add_of_view(eg: &mut FxGraph, eclass: Id, &[p, q, ..]: &Vars) -> bool {
    let mut changed = false;
    let reshapes = |eg: &FxGraph, c: Id| -> Vec<(Id, Id)> {
        eg[c]
            .nodes
            .iter()
            .filter_map(|n| match n {
                Fx::Reshape([s, a]) => Some((*s, *a)),
                _ => None,
            })
            .collect()
    };
    // `(add (reshape ?s ?a) ?b)`
    for (s, a) in reshapes(eg, p) {
        if let Some((s, a, rb)) = view_residual(eg, s, a, q) {
            let inner = eg.add(Fx::Add([a, rb]));
            let outer = eg.add(Fx::Reshape([s, inner]));
            changed |= union(eg, eclass, outer);
        }
    }
    // `(add ?b (reshape ?s ?a))`
    for (s, a) in reshapes(eg, q) {
        if let Some((s, a, rb)) = view_residual(eg, s, a, p) {
            let inner = eg.add(Fx::Add([rb, a]));
            let outer = eg.add(Fx::Reshape([s, inner]));
            changed |= union(eg, eclass, outer);
        }
    }
    changed
}

fn shape_leaf(eg: &FxGraph, id: Id) -> Option<u32> {
    match leaf_of(eg, id) {
        Some(Leaf::Shape(s)) => Some(s),
        _ => None,
    }
}

/// Whether reshaping a value of interned shape `from` to `to` keeps the last dim.
fn keeps_hidden(eg: &FxGraph, from: u32, to: u32) -> bool {
    match (eg.analysis.shape(from), eg.analysis.shape(to)) {
        (Some(a), Some(b)) => a.last().is_some() && a.last() == b.last(),
        _ => false,
    }
}

/// `(reshape ?s ?x)`.
fn reshape_identity(eg: &mut FxGraph, eclass: Id, &[s, x, ..]: &Vars) -> bool {
    match (shape_leaf(eg, s), eg[x].data.ty()) {
        (Some(s), Some(t)) if t.shape == s => union(eg, eclass, x),
        _ => false,
    }
}

/// `(reshape ?s (reshape ?u ?x))`.
fn reshape_of_reshape(eg: &mut FxGraph, eclass: Id, &[s, _, x, ..]: &Vars) -> bool {
    let y = eg.add(Fx::Reshape([s, x]));
    union(eg, eclass, y)
}

/// The checks of `add-of-view-*`; returns the reshape of `b` to `a`'s shape.
fn view_residual(eg: &mut FxGraph, s: Id, a: Id, b: Id) -> Option<(Id, Id, Id)> {
    all_reduce_in(eg, a)?;
    let s_id = shape_leaf(eg, s)?;
    let (ta, tb) = (eg[a].data.ty()?, eg[b].data.ty()?);
    if tb.shape != s_id || ta.dtype != tb.dtype || !keeps_hidden(eg, ta.shape, s_id) {
        return None;
    }
    let sa = leaf(eg, Leaf::Shape(ta.shape));
    let rb = eg.add(Fx::Reshape([sa, b]));
    Some((s, a, rb))
}

/// Whether class `y` holds an all-reduce or an add with an all-reduce operand.
fn near_all_reduce(eg: &FxGraph, y: Id) -> bool {
    all_reduce_in(eg, y).is_some()
        || eg[y].nodes.iter().any(|n| match n {
            Fx::Add([a, b]) => all_reduce_in(eg, *a).is_some() || all_reduce_in(eg, *b).is_some(),
            _ => false,
        })
}

/// `norm-of-view` at `(rms_norm n (reshape s y) w)` (class `eclass`).
pub(super) fn norm_of_view(eg: &mut FxGraph, eclass: Id, n: Id, s: Id, y: Id, w: Id) -> bool {
    let (Some(s_id), Some(ty)) = (shape_leaf(eg, s), eg[y].data.ty()) else {
        return false;
    };
    if !near_all_reduce(eg, y) || !keeps_hidden(eg, ty.shape, s_id) {
        return false;
    }
    let inner = eg.add(Fx::RmsNorm([n, y, w]));
    let outer = eg.add(Fx::Reshape([s, inner]));
    union(eg, eclass, outer)
}
