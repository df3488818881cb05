//! IR -> e-graph: one e-node per IR op the rules model, an opaque leaf per other value.

use crate::analysis::{FxAnalysis, FxGraph, Instance, Ty};
use crate::lang::{Fx, Leaf, QKind};
use arfuse_ir::op::is_wait_target as is_wait;
use arfuse_ir::op::FusedQuant;
use arfuse_ir::{Graph, Op, Value};
use egg::{EGraph, Id};
use std::collections::HashMap;

/// The e-graph of a graph and the class of every IR value.
pub(crate) struct Converted {
    /// The e-graph (not yet rebuilt by a runner).
    pub egraph: FxGraph,
    /// Class of every IR value, by node index then output index.
    pub value_class: Vec<Vec<Id>>,
}

/// The all-reduces of `g` (node indices, in graph order): the instances the pass
/// accounts for, each exactly once in its output.
pub(crate) fn all_reduces(g: &Graph) -> Vec<u32> {
    g.nodes()
        .filter(|(_, n)| matches!(n.op, Op::AllReduce { .. }))
        .map(|(id, _)| id.index() as u32)
        .collect()
}

/// Step 1 of the pass, the conversion: builds the e-graph of `g` (which passed validation), for layer group `group`.
pub(crate) fn convert(g: &Graph, group: &str) -> Converted {
    let mut an = FxAnalysis::default();
    an.group = group.to_string();
    // Graph-output uses per value, counted once (not rescanned per all-reduce).
    let mut output_uses: HashMap<Value, usize> = HashMap::new();
    for v in g.outputs() {
        *output_uses.entry(*v).or_default() += 1;
    }
    // Side tables first: every value's type and constant, every all-reduce.
    for (id, n) in g.nodes() {
        let konst = match n.op {
            Op::Constant { value } => Some(value.to_bits()),
            _ => None,
        };
        let row = n
            .outputs
            .iter()
            .map(|t| {
                let ty = Ty {
                    dtype: t.dtype,
                    shape: an.intern(&t.shape),
                };
                (Some(ty), konst)
            })
            .collect();
        an.values.push(row);
        if let Op::AllReduce { group, .. } = &n.op {
            an.instances.insert(
                id.index() as u32,
                Instance {
                    id: n.id.clone(),
                    group: group.clone(),
                    uses: uses_through_views(g, &output_uses, Value::new(id, 0)),
                },
            );
        }
    }
    let mut eg: FxGraph = EGraph::new(an);
    let mut value_class: Vec<Vec<Id>> = Vec::with_capacity(g.len());
    for (id, n) in g.nodes() {
        let idx = id.index() as u32;
        let inp = |k: usize| -> Id {
            let v = n.inputs[k];
            value_class[v.node.index()][v.output as usize]
        };
        let opaque = |eg: &mut FxGraph| -> Vec<Id> {
            (0..n.outputs.len() as u32)
                .map(|k| eg.add(Fx::Leaf(Leaf::Value(idx, k))))
                .collect()
        };
        let ins = n.inputs.len();
        let quant_op = match &n.op {
            Op::QuantFp8Static => Some(FusedQuant::Fp8Static),
            Op::QuantFp8PerToken => Some(FusedQuant::Fp8PerToken),
            Op::QuantFp8PerTokenGroup {
                group_size,
                scale_layout,
            } => Some(FusedQuant::Fp8PerTokenGroup {
                group_size: *group_size,
                scale_layout: *scale_layout,
            }),
            Op::QuantNvfp4 { scale_layout } => Some(FusedQuant::Nvfp4 {
                scale_layout: *scale_layout,
            }),
            _ => None,
        };
        if let Some(q) = quant_op {
            let classes = match quant(&mut eg, q, n, &inp) {
                Some(c) => c,
                None => opaque(&mut eg),
            };
            value_class.push(classes);
            continue;
        }
        let classes: Vec<Id> = match &n.op {
            Op::AllReduce { .. } if ins == 1 => {
                let i = eg.add(Fx::Leaf(Leaf::Inst(idx)));
                vec![eg.add(Fx::AllReduce([i, inp(0)]))]
            }
            Op::Opaque { .. } if g.is_forwarding_wait(id) => vec![eg.add(Fx::Wait(inp(0)))],
            Op::Add if ins == 2 => vec![eg.add(Fx::Add([inp(0), inp(1)]))],
            Op::Mul if ins == 2 => vec![eg.add(Fx::Mul([inp(0), inp(1)]))],
            Op::ToDtype { dtype } if ins == 1 => {
                let d = eg.add(Fx::Leaf(Leaf::DType(*dtype)));
                vec![eg.add(Fx::ToDtype([d, inp(0)]))]
            }
            Op::Pow { exponent } if ins == 1 => {
                let e = eg.add(Fx::Leaf(Leaf::Exp(exponent.to_bits())));
                vec![eg.add(Fx::Pow([e, inp(0)]))]
            }
            Op::Mean { dims, keepdim } if ins == 1 && *keepdim && is_last_dim(g, n, dims) => {
                let m = eg.add(Fx::Leaf(Leaf::MeanLast));
                vec![eg.add(Fx::Mean([m, inp(0)]))]
            }
            Op::Rsqrt if ins == 1 => vec![eg.add(Fx::Rsqrt(inp(0)))],
            Op::Reshape if ins == 1 => {
                let s = eg.analysis.intern(&n.outputs[0].shape);
                let s = eg.add(Fx::Leaf(Leaf::Shape(s)));
                vec![eg.add(Fx::Reshape([s, inp(0)]))]
            }
            Op::RmsNorm { eps, weight_bias } if ins == 2 => {
                let a = eg.add(Fx::Leaf(norm_leaf(*eps, *weight_bias)));
                vec![eg.add(Fx::RmsNorm([a, inp(0), inp(1)]))]
            }
            Op::FusedAddRmsNorm { eps, weight_bias } if ins == 3 && n.outputs.len() == 2 => {
                let a = eg.add(Fx::Leaf(norm_leaf(*eps, *weight_bias)));
                let t = eg.add(Fx::FusedAddRmsNorm([a, inp(0), inp(1), inp(2)]));
                gets(&mut eg, t, 2)
            }
            _ => opaque(&mut eg),
        };
        value_class.push(classes);
    }
    Converted {
        egraph: eg,
        value_class,
    }
}

fn norm_leaf(eps: f64, bias: f64) -> Leaf {
    Leaf::Norm {
        eps: eps.to_bits(),
        bias: bias.to_bits(),
        twice: false,
    }
}

fn gets(eg: &mut FxGraph, t: Id, n: u8) -> Vec<Id> {
    (0..n)
        .map(|k| {
            let p = eg.add(Fx::Leaf(Leaf::Port(k)));
            eg.add(Fx::Get([p, t]))
        })
        .collect()
}

fn quant(
    eg: &mut FxGraph,
    q: FusedQuant,
    n: &arfuse_ir::Node,
    inp: &dyn Fn(usize) -> Id,
) -> Option<Vec<Id>> {
    let q = QKind::from_ir(q);
    let want_in = if q.takes_scale_input() { 2 } else { 1 };
    let want_out = if q.writes_scales() { 2 } else { 1 };
    if n.inputs.len() != want_in || n.outputs.len() != want_out {
        // Validation guarantees the arity; stay total anyway.
        return None;
    }
    let k = eg.add(Fx::Leaf(Leaf::Quant(q)));
    let s = if want_in == 2 {
        inp(1)
    } else {
        eg.add(Fx::Leaf(Leaf::None))
    };
    let t = eg.add(Fx::Quant([k, inp(0), s]));
    Some(gets(eg, t, want_out as u8))
}

/// True when `dims` names exactly the last dim of the node's input.
fn is_last_dim(g: &Graph, n: &arfuse_ir::Node, dims: &[i64]) -> bool {
    let Some(rank) = n
        .inputs
        .first()
        .and_then(|v| g.value_type(*v))
        .map(|t| t.shape.rank() as i64)
    else {
        return false;
    };
    matches!(dims, [d] if *d == -1 || *d == rank - 1) && rank > 0
}

/// Most views followed when counting the real users of a value.
const MAX_VIEW_DEPTH: usize = 16;

/// Users of `v` that are not views: reshapes and waits are followed (up to
/// [`MAX_VIEW_DEPTH`] deep), graph outputs (`output_uses`, per value) count.
pub(crate) fn uses_through_views(
    g: &Graph,
    output_uses: &HashMap<Value, usize>,
    v: Value,
) -> usize {
    fn go(g: &Graph, outs: &HashMap<Value, usize>, v: Value, depth: usize) -> usize {
        let mut n = outs.get(&v).copied().unwrap_or(0);
        for (u, e) in g.users(v.node) {
            if e.output != v.output {
                continue;
            }
            let node = g.node(u);
            let view = match &node.op {
                Op::Reshape => true,
                Op::Opaque { target, .. } => is_wait(target) && node.inputs.len() == 1,
                _ => false,
            };
            if view && depth < MAX_VIEW_DEPTH && node.outputs.len() == 1 {
                n += go(g, outs, Value::new(u, 0), depth + 1);
            } else {
                n += 1;
            }
        }
        n
    }
    go(g, output_uses, v, 0)
}
