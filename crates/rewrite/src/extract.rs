//! Extraction costs. A fused node is tuple-valued: however many projections read it,
//! it is one kernel, so every cost here is a DAG cost (each node counted once), never
//! a tree cost (which would count the fused node once per projection and make a site
//! with four live outputs look four times as expensive as it is).
//!
//! Units: kernel launches weighted by the passes over the activation they make; only
//! comparisons matter.

#[cfg(test)]
use crate::analysis::FxGraph;
#[cfg(test)]
use crate::lang::Fx;
use arfuse_ir::Op;
#[cfg(test)]
use egg::Id;
#[cfg(test)]
use std::collections::HashSet;

/// An all-reduce: a collective round trip plus a pass over the activation.
pub(crate) const COST_ALL_REDUCE: u64 = 8;
/// An element-wise or reduction kernel (add, mul, cast, pow, mean, rsqrt).
pub(crate) const COST_ELEMENTWISE: u64 = 2;
/// A norm, fused add + norm, or quant kernel.
pub(crate) const COST_NORM: u64 = 3;
/// The fused all-reduce + add + norm (+ quant) kernel: one collective, one pass.
pub(crate) const COST_FUSED: u64 = 9;
/// A view or a projection: no kernel.
pub(crate) const COST_VIEW: u64 = 0;

/// Cost of one e-node, not counting its children.
#[cfg(test)]
pub(crate) fn node_cost(n: &Fx) -> u64 {
    match n {
        Fx::AllReduce(_) => COST_ALL_REDUCE,
        Fx::Fused(_) => COST_FUSED,
        Fx::RmsNorm(_) | Fx::FusedAddRmsNorm(_) | Fx::Quant(_) => COST_NORM,
        Fx::Add(_) | Fx::Mul(_) | Fx::ToDtype(_) | Fx::Pow(_) | Fx::Mean(_) | Fx::Rsqrt(_) => {
            COST_ELEMENTWISE
        }
        Fx::Reshape(_) | Fx::Wait(_) | Fx::Get(_) | Fx::Leaf(_) => COST_VIEW,
    }
}

/// Cost of one IR op (the unfused side of a site), not counting its inputs.
pub(crate) fn op_cost(op: &Op) -> u64 {
    match op {
        Op::AllReduce { .. } => COST_ALL_REDUCE,
        Op::FusedAllreduceNorm(_) => COST_FUSED,
        Op::RmsNorm { .. }
        | Op::FusedAddRmsNorm { .. }
        | Op::QuantFp8Static
        | Op::QuantFp8PerToken
        | Op::QuantFp8PerTokenGroup { .. }
        | Op::QuantNvfp4 { .. } => COST_NORM,
        Op::Reshape | Op::Input { .. } | Op::Constant { .. } | Op::Opaque { .. } => COST_VIEW,
        _ => COST_ELEMENTWISE,
    }
}

/// DAG cost of the nodes a site removes: each IR node once.
pub(crate) fn region_cost<'a>(ops: impl Iterator<Item = &'a Op>) -> u64 {
    ops.map(op_cost).sum()
}

/// DAG cost of a fused site: the fused node once, whatever the number of live
/// projections, plus the views inserted at its boundary.
pub(crate) fn fused_cost(_live_projections: u64, views: u64) -> u64 {
    COST_FUSED + views * COST_VIEW
}

/// DAG cost of the term rooted at `roots` when class `c` is computed by `choose(c)`:
/// every (class, node) reached is counted once, however many parents read it.
/// Classes `choose` returns `None` for are free (the site's inputs).
#[cfg(test)]
pub(crate) fn dag_cost<'a>(
    eg: &'a FxGraph,
    roots: &[Id],
    choose: impl Fn(Id) -> Option<&'a Fx>,
) -> u64 {
    let mut seen: HashSet<Id> = HashSet::new();
    let mut stack: Vec<Id> = roots.iter().map(|r| eg.find(*r)).collect();
    let mut total = 0;
    while let Some(c) = stack.pop() {
        if !seen.insert(c) {
            continue;
        }
        if let Some(n) = choose(c) {
            total += node_cost(n);
            stack.extend(
                crate::lang::value_children(n)
                    .into_iter()
                    .map(|k| eg.find(k)),
            );
        }
    }
    total
}

/// Tree cost of the same term: a node is counted once per path that reaches it. Only
/// for contrast in tests; the pass never uses it.
#[cfg(test)]
pub(crate) fn tree_cost<'a>(
    eg: &'a FxGraph,
    roots: &[Id],
    choose: &impl Fn(Id) -> Option<&'a Fx>,
) -> u64 {
    roots
        .iter()
        .map(|r| match choose(eg.find(*r)) {
            Some(n) => node_cost(n) + tree_cost(eg, &crate::lang::value_children(n), choose),
            None => 0,
        })
        .sum()
}
