//! The e-class analysis: the type (dtype and shape) of every value class, the output
//! types of tuple classes, scalar constants, and the leaf of attribute classes.
//!
//! The analysis also owns the side tables the rules consult: the shape interner, the
//! IR types of opaque values, the all-reduce instances (group, use count) and the
//! refusal log written by conditional appliers. The process group of an all-reduce
//! is looked up from its instance, so it never has to live in a merged class.

use crate::lang::{Attrs, FKind, Fx, Leaf, PORT_NORM, PORT_QUANT, PORT_RESIDUAL, PORT_SCALE};
use crate::uses::Uses;
use arfuse_ir::op::FusedQuant;
use arfuse_ir::{broadcast, broadcasts_to, DType, Dim, Shape, TensorType, NVFP4_BLOCK};
use egg::{Analysis, DidMerge, EGraph, Id};
use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, BTreeSet};

/// Most outputs of a tuple class (the fused node's four ports).
pub(crate) const MAX_OUTS: usize = 4;

/// The type of one value: element type and interned shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Ty {
    pub dtype: DType,
    pub shape: u32,
}

/// What the analysis knows about one e-class.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Data {
    /// Output types: `[0]` for a value class, one per port for a tuple class (`None` for
    /// a port the tuple does not have or an attribute leaf). Inline, so that a class's
    /// data costs no allocation (the e-graph has one per IR value).
    pub outs: [Option<Ty>; MAX_OUTS],
    /// True for tuple-valued classes.
    pub tuple: bool,
    /// The value of a scalar constant, as f64 bits.
    pub konst: Option<u64>,
}

impl Data {
    /// The value type of a value class.
    pub fn ty(&self) -> Option<Ty> {
        if self.tuple {
            return None;
        }
        self.outs.first().copied().flatten()
    }
}

/// One all-reduce of the input graph.
#[derive(Clone, Debug)]
pub(crate) struct Instance {
    /// Its node id in the input graph.
    pub id: String,
    /// Its process group, as its place in [`Instances::groups`].
    group: u32,
    /// Uses of its output in the input graph (node inputs and graph outputs).
    pub uses: usize,
}

/// The all-reduces of the input graph, by node index: flat tables, so that a lookup
/// reads two entries whatever the graph's size.
#[derive(Debug, Default)]
pub(crate) struct Instances {
    /// Per node index: its all-reduce's place in `list`, or [`Instances::NONE`].
    slot: Vec<u32>,
    list: Vec<Instance>,
    /// The distinct groups, in the order first met.
    groups: Vec<String>,
}

impl Instances {
    const NONE: u32 = u32::MAX;

    /// No all-reduce yet, in a graph of `nodes` nodes.
    pub fn new(nodes: usize) -> Instances {
        Instances {
            slot: vec![Self::NONE; nodes],
            list: Vec::new(),
            groups: Vec::new(),
        }
    }

    /// Adds all-reduce `node` (id `id`, over `group`, its output used `uses` times).
    pub fn insert(&mut self, node: u32, id: String, group: &str, uses: usize) {
        let Some(slot) = self.slot.get_mut(node as usize) else {
            return;
        };
        let g = match self.groups.iter().position(|x| x == group) {
            Some(g) => g,
            None => {
                self.groups.push(group.to_string());
                self.groups.len() - 1
            }
        };
        *slot = self.list.len() as u32;
        self.list.push(Instance {
            id,
            group: g as u32,
            uses,
        });
    }

    /// All-reduce `node`, if it is one.
    pub fn get(&self, node: &u32) -> Option<&Instance> {
        let slot = *self.slot.get(*node as usize)?;
        self.list.get(slot as usize)
    }

    /// The process group of all-reduce `node`, if it is one.
    pub fn group(&self, node: &u32) -> Option<&str> {
        let i = self.get(node)?;
        self.groups.get(i.group as usize).map(String::as_str)
    }
}

/// What the rules know of the input graph, built once per lowering
/// ([`crate::convert::facts`]) and lent to the analysis of every window.
#[derive(Debug, Default)]
pub(crate) struct Facts {
    /// Who reads each value.
    pub uses: Uses,
    /// IR type and constant value of every IR value, by flat value index
    /// ([`Uses::flat`]).
    pub values: Vec<(Option<Ty>, Option<u64>)>,
    /// The all-reduces, by IR node index.
    pub instances: Instances,
    /// The layer's process group the rules fuse.
    pub group: String,
}

/// The shape interner: every shape the pass meets, by a dense id.
#[derive(Clone, Debug, Default)]
pub(crate) struct Shapes {
    shapes: Vec<Shape>,
    ids: FxHashMap<Shape, u32>,
    /// (shape, new last dim or `None` to drop it) -> the shape so changed.
    with_last: FxHashMap<(u32, Option<u64>), Option<u32>>,
}

impl Shapes {
    /// The id of `shape`.
    pub fn intern(&mut self, shape: &Shape) -> u32 {
        if let Some(&id) = self.ids.get(shape) {
            return id;
        }
        let id = self.shapes.len() as u32;
        self.shapes.push(shape.clone());
        self.ids.insert(shape.clone(), id);
        id
    }

    /// The shape with id `id`.
    pub fn get(&self, id: u32) -> Option<&Shape> {
        self.shapes.get(id as usize)
    }
}

/// The analysis of one window's e-graph: the lowering's [`Facts`], the shape interner
/// (lent for the window and handed back) and the refusals the rules log.
pub(crate) struct FxAnalysis<'a> {
    /// The input graph's facts.
    pub facts: &'a Facts,
    /// Every shape met so far (ids are stable across windows).
    pub shapes: Shapes,
    /// Why a rule refused a match, by all-reduce instance (deduplicated, ordered).
    pub refusals: BTreeMap<u32, BTreeSet<String>>,
    /// Refusals at an op (instance, class of the op, why), named by the IR node of the
    /// class once the e-graph is saturated ([`FxAnalysis::refuse_at`]).
    pub refusals_at: BTreeSet<(u32, Id, String)>,
    /// The attributes the e-graph's leaves hold by number.
    pub attrs: Attrs,
}

impl<'a> FxAnalysis<'a> {
    /// The analysis of a window over `facts`, interning into `shapes`.
    pub fn new(facts: &'a Facts, shapes: Shapes) -> FxAnalysis<'a> {
        FxAnalysis {
            facts,
            shapes,
            refusals: BTreeMap::new(),
            refusals_at: BTreeSet::new(),
            attrs: Attrs::default(),
        }
    }

    /// The id of `shape` in the interner.
    pub fn intern(&mut self, shape: &Shape) -> u32 {
        self.shapes.intern(shape)
    }

    /// The shape with interned id `id`.
    pub fn shape(&self, id: u32) -> Option<&Shape> {
        self.shapes.get(id)
    }

    /// The IR tensor type of `ty`.
    pub fn tensor_type(&self, ty: Ty) -> Option<TensorType> {
        Some(TensorType {
            dtype: ty.dtype,
            shape: self.shape(ty.shape)?.clone(),
        })
    }

    /// The constant last (hidden) dim of `ty`, if any.
    pub fn hidden(&self, ty: Ty) -> Option<u64> {
        self.shape(ty.shape)?.last()?.as_const()
    }

    /// Records why a rule refused a match of `inst`.
    pub fn refuse(&mut self, inst: u32, why: String) {
        self.refusals.entry(inst).or_default().insert(why);
    }

    /// Records why a rule refused a match of `inst` at the op of class `at`; the
    /// report names that op's IR node.
    pub fn refuse_at(&mut self, inst: u32, at: Id, why: String) {
        self.refusals_at.insert((inst, at, why));
    }

    fn with_last(&mut self, ty: Ty, last: Option<u64>, dtype: DType) -> Option<Ty> {
        let shapes = &mut self.shapes;
        let shape = match shapes.with_last.get(&(ty.shape, last)) {
            Some(&known) => known,
            None => {
                let changed = shapes.get(ty.shape).and_then(|s| {
                    let mut dims = s.0.clone();
                    match last {
                        Some(l) => *dims.last_mut()? = Dim::constant(l),
                        None => {
                            dims.pop()?;
                        }
                    }
                    Some(Shape(dims))
                });
                let id = changed.map(|s| shapes.intern(&s));
                shapes.with_last.insert((ty.shape, last), id);
                id
            }
        }?;
        Some(Ty { dtype, shape })
    }

    /// Output types of a quant epilogue of kind `q` on `x`: (quantised, scales).
    pub fn quant_types(&mut self, q: FusedQuant, x: Ty) -> (Option<Ty>, Option<Ty>) {
        let Some(h) = self.hidden(x) else {
            return (None, None);
        };
        let fp8 = Some(Ty {
            dtype: DType::Fp8E4m3,
            shape: x.shape,
        });
        match q {
            FusedQuant::None => (None, None),
            FusedQuant::Fp8Static => (fp8, None),
            FusedQuant::Fp8PerToken => (fp8, self.with_last(x, Some(1), DType::F32)),
            FusedQuant::Fp8PerTokenGroup {
                group_size,
                scale_layout,
            } => {
                if group_size == 0 || h % group_size != 0 {
                    return (None, None);
                }
                let groups = h / group_size;
                let scales = if scale_layout.f32_storage() {
                    self.with_last(x, Some(groups), DType::F32)
                } else {
                    self.with_last(x, Some(groups.div_ceil(4)), DType::I32)
                };
                (fp8, scales)
            }
            FusedQuant::Nvfp4 { .. } => {
                if h % NVFP4_BLOCK != 0 {
                    return (None, None);
                }
                (
                    self.with_last(x, Some(h / 2), DType::Fp4E2m1x2),
                    self.with_last(x, Some(h / NVFP4_BLOCK), DType::Fp8E4m3),
                )
            }
        }
    }

    fn fused_types(&mut self, k: FKind, x: Ty) -> [Option<Ty>; MAX_OUTS] {
        let (q, s) = self.quant_types(k.quant, x);
        let mut outs = [None; MAX_OUTS];
        outs[PORT_NORM as usize] = Some(x);
        outs[PORT_RESIDUAL as usize] = Some(x);
        outs[PORT_QUANT as usize] = q;
        outs[PORT_SCALE as usize] = s;
        outs
    }
}

fn value(ty: Option<Ty>) -> Data {
    Data {
        outs: [ty, None, None, None],
        ..Data::default()
    }
}

impl<'a> Analysis<Fx> for FxAnalysis<'a> {
    type Data = Data;

    fn make(egraph: &mut EGraph<Fx, FxAnalysis<'a>>, enode: &Fx) -> Data {
        let ty = |id: &Id| egraph[*id].data.ty();
        let leaf = |id: &Id| leaf_of(egraph, *id);
        match enode {
            Fx::Leaf(Leaf::Value(n, k)) => {
                let facts = egraph.analysis.facts;
                let v = arfuse_ir::Value::new(arfuse_ir::NodeId::new(*n as usize), *k);
                let (t, c) = facts
                    .uses
                    .flat(v)
                    .and_then(|i| facts.values.get(i))
                    .copied()
                    .unwrap_or((None, None));
                Data {
                    outs: [t, None, None, None],
                    konst: c,
                    ..Data::default()
                }
            }
            Fx::Leaf(_) => Data::default(),
            Fx::AllReduce([_, x])
            | Fx::Wait(x)
            | Fx::Pow([_, x])
            | Fx::Rsqrt(x)
            | Fx::RmsNorm([_, x, _]) => value(ty(x)),
            Fx::Add([a, b]) | Fx::Mul([a, b]) => {
                let (Some(ta), Some(tb)) = (ty(a), ty(b)) else {
                    return value(None);
                };
                // Equal shapes broadcast to themselves; a broadcast that is one of its
                // operands (`[T, 1] + []`) needs no shape built either.
                let an = &mut egraph.analysis;
                let (Some(sa), Some(sb)) = (an.shape(ta.shape), an.shape(tb.shape)) else {
                    return value(None);
                };
                let same = if ta.shape == tb.shape || broadcasts_to(sa, sb, sa) {
                    Some(ta.shape)
                } else if broadcasts_to(sa, sb, sb) {
                    Some(tb.shape)
                } else {
                    None
                };
                if let Some(shape) = same {
                    return value(Some(Ty {
                        dtype: ta.dtype,
                        shape,
                    }));
                }
                let s = broadcast(sa, sb);
                value(s.map(|s| Ty {
                    dtype: ta.dtype,
                    shape: an.intern(&s),
                }))
            }
            Fx::ToDtype([d, x]) => match (leaf(d), ty(x)) {
                (Some(Leaf::DType(d)), Some(t)) => value(Some(Ty {
                    dtype: d,
                    shape: t.shape,
                })),
                _ => value(None),
            },
            Fx::Mean([_, x]) => match ty(x) {
                Some(t) => value(egraph.analysis.with_last(t, Some(1), t.dtype)),
                None => value(None),
            },
            Fx::Reshape([s, x]) => match (leaf(s), ty(x)) {
                (Some(Leaf::Shape(s)), Some(t)) => value(Some(Ty {
                    dtype: t.dtype,
                    shape: s,
                })),
                _ => value(None),
            },
            Fx::FusedAddRmsNorm([_, x, _, _]) => Data {
                outs: [ty(x), ty(x), None, None],
                tuple: true,
                ..Data::default()
            },
            Fx::Quant([q, x, _]) => {
                let q = leaf(q).and_then(|l| egraph.analysis.attrs.quant(l));
                let outs = match (q, ty(x)) {
                    (Some(q), Some(t)) => {
                        let (a, b) = egraph.analysis.quant_types(q, t);
                        [a, b, None, None]
                    }
                    _ => [None; MAX_OUTS],
                };
                Data {
                    outs,
                    tuple: true,
                    ..Data::default()
                }
            }
            Fx::Fused([k, _, x, _, _, _]) => {
                let k = leaf(k).and_then(|l| egraph.analysis.attrs.fused(l));
                let outs = match (k, ty(x)) {
                    (Some(k), Some(t)) => egraph.analysis.fused_types(k, t),
                    _ => [None; MAX_OUTS],
                };
                Data {
                    outs,
                    tuple: true,
                    ..Data::default()
                }
            }
            Fx::Get([p, t]) => {
                let d = &egraph[*t].data;
                let out = match leaf(p) {
                    Some(Leaf::Port(p)) if d.tuple => d.outs.get(p as usize).copied().flatten(),
                    _ => None,
                };
                value(out)
            }
        }
    }

    fn merge(&mut self, to: &mut Data, from: Data) -> DidMerge {
        // Members of one class have one type by construction; keep what is known and
        // fill what is missing, never overwrite.
        let mut changed = false;
        for (i, t) in from.outs.iter().enumerate() {
            if to.outs[i].is_none() && t.is_some() {
                to.outs[i] = *t;
                changed = true;
            }
        }
        if to.konst.is_none() && from.konst.is_some() {
            to.konst = from.konst;
            changed = true;
        }
        to.tuple |= from.tuple;
        DidMerge(changed, true)
    }
}

/// The e-graph type of the pass.
pub(crate) type FxGraph<'a> = EGraph<Fx, FxAnalysis<'a>>;

/// The attribute leaf class `id` is (an attribute never merges with another class), or
/// `None` for a value class.
pub(crate) fn leaf_of(egraph: &FxGraph, id: Id) -> Option<Leaf> {
    match egraph[id].nodes.as_slice() {
        [Fx::Leaf(Leaf::Value(..))] => None,
        [Fx::Leaf(l)] => Some(*l),
        _ => None,
    }
}

/// True when class `id` holds an all-reduce (seen through `wait`).
pub(crate) fn all_reduce_in(egraph: &FxGraph, id: Id) -> Option<u32> {
    egraph[id].nodes.iter().find_map(|n| match n {
        Fx::AllReduce([i, _]) => match leaf_of(egraph, *i) {
            Some(Leaf::Inst(i)) => Some(i),
            _ => None,
        },
        _ => None,
    })
}
