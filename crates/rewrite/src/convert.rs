//! IR -> e-graph: one e-node per IR op the rules model, an opaque leaf per other value.
//!
//! [`facts`] reads the whole graph once (every value's type, every all-reduce and its
//! uses); [`convert`] builds the e-graph of one window's nodes
//! ([`crate::window::Window`]), a value read from outside the window an opaque leaf.

use crate::analysis::{Facts, FxAnalysis, FxGraph, Instances, Shapes, Ty};
use crate::lang::{Fx, Leaf, NormAttrs};
use crate::uses::Uses;
use arfuse_ir::op::is_wait_target as is_wait;
use arfuse_ir::op::FusedQuant;
use arfuse_ir::{DType, Graph, Node, NodeId, NormInput, NormRounding, Op, Shape, Value};
use egg::{EGraph, Id};

/// The collectives of a graph, by node index, in graph order.
pub(crate) struct Collectives {
    /// The all-reduces: the instances the pass accounts for, each exactly once in its
    /// output.
    pub all_reduces: Vec<u32>,
    /// The fused nodes already in the graph.
    pub fused: Vec<u32>,
    /// The opaque nodes whose target looks like a collective
    /// ([`arfuse_ir::looks_like_collective`]), which the report warns about.
    pub opaque_collectives: Vec<u32>,
}

/// The collectives of `g`, in one walk over its nodes.
pub(crate) fn collectives(g: &Graph) -> Collectives {
    let mut c = Collectives {
        all_reduces: Vec::new(),
        fused: Vec::new(),
        opaque_collectives: Vec::new(),
    };
    for (id, n) in g.nodes() {
        let i = id.index() as u32;
        match &n.op {
            Op::AllReduce { .. } => c.all_reduces.push(i),
            Op::FusedAllreduceNorm(_) => c.fused.push(i),
            Op::Opaque { target, .. } if arfuse_ir::looks_like_collective(target) => {
                c.opaque_collectives.push(i)
            }
            _ => {}
        }
    }
    c
}

/// What one IR node becomes in the e-graph: the e-node of an op the rules model, or
/// [`Form::Opaque`] (one opaque leaf per output). The one definition of what the
/// rules model (the windows' halos follow exactly these nodes).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Form {
    Opaque,
    AllReduce,
    Wait,
    Add,
    Mul,
    ToDtype(DType),
    Pow(f64),
    Mean,
    Rsqrt,
    Reshape,
    RmsNorm {
        eps: f64,
        bias: f64,
        twice: bool,
    },
    FusedAddRmsNorm {
        eps: f64,
        bias: f64,
        twice: bool,
        f32_sum: bool,
    },
    Quant(FusedQuant),
}

fn form(g: &Graph, id: NodeId, n: &Node) -> Form {
    let ins = n.inputs.len();
    let quant = match &n.op {
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
    if let Some(q) = quant {
        let q = q;
        let want_in = if q.takes_scale_input() { 2 } else { 1 };
        let want_out = if q.writes_scales() { 2 } else { 1 };
        // Validation guarantees the arity; stay total anyway.
        return if ins == want_in && n.outputs.len() == want_out {
            Form::Quant(q)
        } else {
            Form::Opaque
        };
    }
    match &n.op {
        Op::AllReduce { .. } if ins == 1 => Form::AllReduce,
        Op::Opaque { .. } if g.is_forwarding_wait(id) => Form::Wait,
        Op::Add if ins == 2 => Form::Add,
        Op::Mul if ins == 2 => Form::Mul,
        Op::ToDtype { dtype } if ins == 1 => Form::ToDtype(*dtype),
        Op::Pow { exponent } if ins == 1 => Form::Pow(*exponent),
        Op::Mean { dims, keepdim } if ins == 1 && *keepdim && is_last_dim(g, n, dims) => Form::Mean,
        Op::Rsqrt if ins == 1 => Form::Rsqrt,
        Op::Reshape if ins == 1 => Form::Reshape,
        Op::RmsNorm {
            eps,
            weight_bias,
            norm_rounding,
        } if ins == 2 => Form::RmsNorm {
            eps: *eps,
            bias: *weight_bias,
            twice: *norm_rounding == NormRounding::Twice,
        },
        Op::FusedAddRmsNorm {
            eps,
            weight_bias,
            norm_rounding,
            norm_input,
        } if ins == 3 && n.outputs.len() == 2 => Form::FusedAddRmsNorm {
            eps: *eps,
            bias: *weight_bias,
            twice: *norm_rounding == NormRounding::Twice,
            f32_sum: *norm_input == NormInput::F32Sum,
        },
        _ => Form::Opaque,
    }
}

/// How far the rules see through node `id`, for the windows' halos: `None` when they
/// do not model it (it becomes opaque leaves), `Some(0)` for a view or a wait (the rules
/// see through any number of them), `Some(1)` for every other modeled op.
pub(crate) fn modeled_step(g: &Graph, id: NodeId) -> Option<u32> {
    match form(g, id, g.node(id)) {
        Form::Opaque => None,
        Form::Reshape | Form::Wait => Some(0),
        _ => Some(1),
    }
}

/// The facts of `g` for layer group `group`: every value's type and constant (shapes
/// interned into the returned [`Shapes`]), every all-reduce with its uses. Bounded on
/// any graph `Graph` accepts, so that it can run while `g` is validated; the steps use
/// it only once `g` passed.
pub(crate) fn facts(g: &Graph, group: &str, uses: Uses) -> (Facts, Shapes) {
    let mut shapes = Shapes::default();
    let mut values = Vec::with_capacity(uses.values());
    let mut instances = Instances::new(g.len());
    // Values in a row mostly share their shape: the last one's id, without a lookup.
    let mut last: Option<(&Shape, u32)> = None;
    for (id, n) in g.nodes() {
        let konst = match n.op {
            Op::Constant { value } => Some(value.to_bits()),
            _ => None,
        };
        for t in &n.outputs {
            let shape = match last {
                Some((s, id)) if *s == t.shape => id,
                _ => shapes.intern(&t.shape),
            };
            last = Some((&t.shape, shape));
            let ty = Ty {
                dtype: t.dtype,
                shape,
            };
            values.push((Some(ty), konst));
        }
        if let Op::AllReduce { group, .. } = &n.op {
            let used = uses_through_views(g, &uses, Value::new(id, 0));
            instances.insert(id.index() as u32, n.id.clone(), group, used);
        }
    }
    let facts = Facts {
        uses,
        values,
        instances,
        group: group.to_string(),
    };
    (facts, shapes)
}

/// The class of every IR value a window converted, by flat value index; reused from
/// window to window.
#[derive(Debug, Default)]
pub(crate) struct Classes {
    class: Vec<Option<Id>>,
    /// The values the current window converted (flat index, value), in the order they
    /// were converted.
    set: Vec<(u32, Value)>,
}

impl Classes {
    /// Room for the `values` values of a graph.
    pub fn new(values: usize) -> Classes {
        Classes {
            class: vec![None; values],
            set: Vec::new(),
        }
    }

    /// The class of flat value `i`, when the window converted it.
    pub fn get(&self, i: usize) -> Option<Id> {
        self.class.get(i).copied().flatten()
    }

    /// Every value the window converted, with its flat index.
    pub fn converted(&self) -> &[(u32, Value)] {
        &self.set
    }

    fn put(&mut self, i: usize, v: Value, c: Id) {
        if let Some(slot) = self.class.get_mut(i) {
            if slot.is_none() {
                self.set.push((i as u32, v));
            }
            *slot = Some(c);
        }
    }

    /// Forgets the current window.
    pub fn clear(&mut self) {
        for &(i, _) in &self.set {
            self.class[i as usize] = None;
        }
        self.set.clear();
    }
}

/// Step 1 of the pass, the conversion: builds the e-graph of the window `nodes`
/// (ascending) of `g`, recording every value's class in `classes` (cleared first). A
/// value read from outside the window is an opaque leaf.
pub(crate) fn convert<'a>(
    g: &Graph,
    nodes: &[u32],
    analysis: FxAnalysis<'a>,
    classes: &mut Classes,
) -> FxGraph<'a> {
    classes.clear();
    let facts: &'a Facts = analysis.facts;
    let uses = &facts.uses;
    let mut eg: FxGraph<'a> = EGraph::new(analysis);
    for &idx in nodes {
        let id = NodeId::new(idx as usize);
        let n = g.node(id);
        let first = uses.values_of(idx).start;
        let f = form(g, id, n);
        if f == Form::Opaque {
            for k in 0..n.outputs.len() {
                let c = eg.add(Fx::Leaf(Leaf::Value(idx, k as u32)));
                classes.put(first + k, Value::new(id, k as u32), c);
            }
            continue;
        }
        // A modeled op has at most three inputs (`form` checks each arity).
        let mut ins = [Id::from(0usize); 3];
        for (slot, v) in ins.iter_mut().zip(&n.inputs) {
            *slot = input_class(&mut eg, uses, classes, *v);
        }
        let (outs, count) = enodes(&mut eg, idx, n, f, ins);
        for (k, c) in outs.iter().take(count).enumerate() {
            classes.put(first + k, Value::new(id, k as u32), *c);
        }
    }
    eg
}

/// The class of input value `v`: the class its node got in this window, else (a value
/// from outside the window) its opaque leaf.
fn input_class(eg: &mut FxGraph, uses: &Uses, classes: &mut Classes, v: Value) -> Id {
    // Validation guarantees every input exists (a flat index); stay total anyway.
    let i = uses.flat(v);
    if let Some(c) = i.and_then(|i| classes.get(i)) {
        return c;
    }
    let c = eg.add(Fx::Leaf(Leaf::Value(v.node.index() as u32, v.output)));
    if let Some(i) = i {
        classes.put(i, v, c);
    }
    c
}

/// Adds the e-nodes of modeled node `idx` (of form `form`, inputs' classes `ins`); the
/// classes of its outputs (the first `count` of the array; none for
/// [`Form::Opaque`], which the caller converts).
fn enodes(eg: &mut FxGraph, idx: u32, n: &Node, form: Form, ins: [Id; 3]) -> ([Id; 2], usize) {
    let x = ins[0];
    let one = |c: Id| ([c, c], 1);
    match form {
        Form::Opaque => ([x, x], 0),
        Form::Quant(q) => {
            let kl = eg.analysis.attrs.quant_leaf(q);
            let kl = eg.add(Fx::Leaf(kl));
            let s = if q.takes_scale_input() {
                ins[1]
            } else {
                eg.add(Fx::Leaf(Leaf::None))
            };
            let t = eg.add(Fx::Quant([kl, x, s]));
            let q0 = get(eg, t, 0);
            if q.writes_scales() {
                ([q0, get(eg, t, 1)], 2)
            } else {
                ([q0, q0], 1)
            }
        }
        Form::FusedAddRmsNorm {
            eps,
            bias,
            twice,
            f32_sum,
        } => {
            let a = norm_leaf(eg, eps, bias, twice, f32_sum);
            let a = eg.add(Fx::Leaf(a));
            let t = eg.add(Fx::FusedAddRmsNorm([a, x, ins[1], ins[2]]));
            ([get(eg, t, 0), get(eg, t, 1)], 2)
        }
        Form::AllReduce => {
            let i = eg.add(Fx::Leaf(Leaf::Inst(idx)));
            one(eg.add(Fx::AllReduce([i, x])))
        }
        Form::Wait => one(eg.add(Fx::Wait(x))),
        Form::Add => one(eg.add(Fx::Add([x, ins[1]]))),
        Form::Mul => one(eg.add(Fx::Mul([x, ins[1]]))),
        Form::ToDtype(dtype) => {
            let d = eg.add(Fx::Leaf(Leaf::DType(dtype)));
            one(eg.add(Fx::ToDtype([d, x])))
        }
        Form::Pow(exponent) => {
            let e = eg.analysis.attrs.exp_leaf(exponent.to_bits());
            let e = eg.add(Fx::Leaf(e));
            one(eg.add(Fx::Pow([e, x])))
        }
        Form::Mean => {
            let m = eg.add(Fx::Leaf(Leaf::MeanLast));
            one(eg.add(Fx::Mean([m, x])))
        }
        Form::Rsqrt => one(eg.add(Fx::Rsqrt(x))),
        Form::Reshape => {
            let s = eg.analysis.intern(&n.outputs[0].shape);
            let s = eg.add(Fx::Leaf(Leaf::Shape(s)));
            one(eg.add(Fx::Reshape([s, x])))
        }
        Form::RmsNorm { eps, bias, twice } => {
            let a = norm_leaf(eg, eps, bias, twice, false);
            let a = eg.add(Fx::Leaf(a));
            one(eg.add(Fx::RmsNorm([a, x, ins[1]])))
        }
    }
}

fn norm_leaf(eg: &mut FxGraph, eps: f64, bias: f64, twice: bool, f32_sum: bool) -> Leaf {
    eg.analysis.attrs.norm_leaf(NormAttrs {
        eps: eps.to_bits(),
        bias: bias.to_bits(),
        twice,
        f32_sum,
    })
}

fn get(eg: &mut FxGraph, t: Id, k: u8) -> Id {
    let p = eg.add(Fx::Leaf(Leaf::Port(k)));
    eg.add(Fx::Get([p, t]))
}

/// True when `dims` names exactly the last dim of the node's input.
fn is_last_dim(g: &Graph, n: &Node, dims: &[i64]) -> bool {
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

/// Users of `v` that are not views: reshapes and waits of one input are followed (up
/// to [`MAX_VIEW_DEPTH`] deep), graph outputs count. Views of one input form a tree
/// below `v`, so the walk visits each at most once, in a graph that failed validation
/// too (a reshape reading one value many times is counted, not followed).
pub(crate) fn uses_through_views(g: &Graph, uses: &Uses, v: Value) -> usize {
    fn go(g: &Graph, uses: &Uses, v: Value, depth: usize) -> usize {
        let mut n = uses.output_uses(v);
        for &u in uses.users_of(v) {
            let node = g.node(NodeId::new(u as usize));
            let view = node.inputs.len() == 1
                && match &node.op {
                    Op::Reshape => true,
                    Op::Opaque { target, .. } => is_wait(target),
                    _ => false,
                };
            if view && depth < MAX_VIEW_DEPTH && node.outputs.len() == 1 {
                n += go(g, uses, Value::new(NodeId::new(u as usize), 0), depth + 1);
            } else {
                n += 1;
            }
        }
        n
    }
    go(g, uses, v, 0)
}
