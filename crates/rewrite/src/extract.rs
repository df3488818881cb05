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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::FxAnalysis;
    use crate::lang::{FKind, Leaf, QKind};

    /// A fused node read through four projections costs one fused node under the DAG
    /// cost, four under a tree cost; the unfused alternative shares its all-reduce and
    /// add the same way.
    #[test]
    fn dag_cost_counts_a_shared_tuple_once() {
        let mut eg: FxGraph = egg::EGraph::new(FxAnalysis::default());
        let leaf = |eg: &mut FxGraph, l| eg.add(Fx::Leaf(l));
        let x = leaf(&mut eg, Leaf::Value(0, 0));
        let r = leaf(&mut eg, Leaf::Value(1, 0));
        let w = leaf(&mut eg, Leaf::Value(2, 0));
        let s = leaf(&mut eg, Leaf::Value(3, 0));
        let k = leaf(
            &mut eg,
            Leaf::Fused(FKind {
                residual: true,
                quant: QKind::Fp8PerToken,
                eps: 1e-6f64.to_bits(),
                bias: 0,
                twice: false,
            }),
        );
        let i = leaf(&mut eg, Leaf::Inst(9));
        let f = eg.add(Fx::Fused([k, i, x, r, w, s]));
        let ports: Vec<Id> = (0..4u8)
            .map(|p| {
                let pl = leaf(&mut eg, Leaf::Port(p));
                eg.add(Fx::Get([pl, f]))
            })
            .collect();
        let nodes: Vec<Fx> = ports.iter().map(|c| eg[*c].nodes[0].clone()).collect();
        let fnode = eg[f].nodes[0].clone();
        let choose = |c: Id| {
            if c == eg.find(f) {
                return Some(&fnode);
            }
            ports
                .iter()
                .position(|p| eg.find(*p) == c)
                .map(|k| &nodes[k])
        };
        assert_eq!(dag_cost(&eg, &ports, choose), COST_FUSED);
        assert_eq!(tree_cost(&eg, &ports, &choose), 4 * COST_FUSED);

        // Unfused: norm and residual share the add and the all-reduce.
        let ar = eg.add(Fx::AllReduce([i, x]));
        let h = eg.add(Fx::Add([ar, r]));
        let nl = leaf(
            &mut eg,
            Leaf::Norm {
                eps: 1e-6f64.to_bits(),
                bias: 0,
                twice: false,
            },
        );
        let y = eg.add(Fx::RmsNorm([nl, h, w]));
        let un: Vec<(Id, Fx)> = [ar, h, y]
            .iter()
            .map(|c| (*c, eg[*c].nodes[0].clone()))
            .collect();
        let pick = |c: Id| un.iter().find(|(id, _)| eg.find(*id) == c).map(|(_, n)| n);
        let roots = [y, h];
        let dag = dag_cost(&eg, &roots, pick);
        assert_eq!(dag, COST_ALL_REDUCE + COST_ELEMENTWISE + COST_NORM);
        assert!(tree_cost(&eg, &roots, &pick) > dag);
        // Fusing pays under the DAG cost.
        assert!(COST_FUSED < dag);
    }
}
