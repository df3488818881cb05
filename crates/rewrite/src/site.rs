//! Sites: after saturation, the fused tuple nodes of every all-reduce are candidates;
//! this module checks each against the IR (which values it replaces, which nodes it
//! removes, whether anything outside the chain still reads an intermediate) and picks
//! at most one per all-reduce.

use crate::analysis::{leaf_of, FxGraph};
use crate::convert::Classes;
use crate::lang::{FKind, Fx, Leaf, PORT_NORM, PORT_QUANT, PORT_RESIDUAL, PORT_SCALE};
use crate::uses::Uses;
use arfuse_ir::op::{FusedOutput, FusedQuant};
use arfuse_ir::{Graph, NodeId, NodeOutput, Op, SiteInput, SiteMap, SiteOutput, TensorType, Value};
use arfuse_policy::Target;
use egg::{Id, Language};
use smallvec::SmallVec;
use std::collections::{BTreeMap, BTreeSet};

/// Most IR nodes one site may replace (a decomposed norm with views and a quant has
/// about 15); a larger region means the match is not the chain it should be.
pub(crate) const MAX_REGION_NODES: usize = 64;

/// An input of a fused node: an IR value, or an IR value seen through a view.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Input {
    /// The value itself.
    Value(Value),
    /// The value reshaped to the type given (a `reshape` node is inserted).
    View(Value, TensorType),
}

/// One output port the fused node writes, and the IR values it replaces.
#[derive(Clone, Debug)]
pub(crate) struct Port {
    /// Which output.
    pub output: FusedOutput,
    /// Its type (in the all-reduce input's shape).
    pub ty: TensorType,
    /// Replaced values read in the port's own shape.
    pub direct: Vec<Value>,
    /// Replaced values read through a view, with their type.
    pub views: Vec<(Value, TensorType)>,
}

/// A checked site: one all-reduce, the fused node that replaces its chain.
#[derive(Clone, Debug)]
pub(crate) struct Site {
    /// IR node index of the all-reduce.
    pub inst: u32,
    /// The fused kind.
    pub kind: FKind,
    /// The all-reduce input.
    pub x: Value,
    /// The residual input.
    pub residual: Option<Input>,
    /// The weight.
    pub weight: Input,
    /// The static FP8 scale or NVFP4 global scale.
    pub scale: Option<Input>,
    /// IR nodes the site replaces (removed when fused).
    pub region: BTreeSet<u32>,
    /// Live outputs, in output order.
    pub ports: Vec<Port>,
    /// The IR node of the norm (for the module), when one exists in the region.
    pub norm_node: Option<u32>,
    /// x's type.
    pub x_ty: TensorType,
    /// The chain as the input graph's ids (its `fused_node` is set when the site is
    /// emitted), made when the site is chosen, while the window's nodes are at hand:
    /// what `arfuse_reference::check_sites` cuts out.
    pub map: Option<SiteMap>,
    /// The site's module ([`Site::module_in`]).
    pub module: Option<String>,
}

/// Indexes over one window's saturated e-graph and the IR.
pub(crate) struct Index<'g, 'e, 'a> {
    g: &'g Graph,
    eg: &'e FxGraph<'a>,
    uses: &'a Uses,
    /// (canonical class, IR value) of every IR value the window converted, sorted: the
    /// values of a class in graph order.
    values_in: Vec<(Id, Value)>,
    /// (class c, class holding an IR value that contains `reshape(_, c)`), sorted,
    /// without repeats.
    view_parents: Vec<(Id, Id)>,
    /// Canonical class of every converted value, by flat index.
    classes: &'e Classes,
}

impl<'g, 'e, 'a> Index<'g, 'e, 'a> {
    pub fn new(g: &'g Graph, eg: &'e FxGraph<'a>, classes: &'e Classes) -> Index<'g, 'e, 'a> {
        let uses = &eg.analysis.facts.uses;
        // A class's values sort in graph order (values order by node, then output).
        let mut values_in: Vec<(Id, Value)> = classes
            .converted()
            .iter()
            .filter_map(|&(i, v)| Some((eg.find(classes.get(i as usize)?), v)))
            .collect();
        values_in.sort_unstable();
        let mut view_parents: Vec<(Id, Id)> = Vec::new();
        let mut last = None;
        for &(c, _) in &values_in {
            if last == Some(c) {
                continue;
            }
            last = Some(c);
            for node in &eg[c].nodes {
                if let Fx::Reshape([_, child]) = node {
                    view_parents.push((eg.find(*child), c));
                }
            }
        }
        view_parents.sort_unstable();
        view_parents.dedup();
        Index {
            g,
            eg,
            uses,
            values_in,
            view_parents,
            classes,
        }
    }

    /// The IR values in class `c` (canonical), in graph order.
    fn values_of(&self, c: Id) -> impl Iterator<Item = Value> + '_ {
        let lo = self.values_in.partition_point(|(k, _)| *k < c);
        self.values_in[lo..]
            .iter()
            .take_while(move |(k, _)| *k == c)
            .map(|(_, v)| *v)
    }

    /// The first IR value in class `c` (canonical).
    fn first_value(&self, c: Id) -> Option<Value> {
        self.values_of(c).next()
    }

    /// Classes holding an IR value that contain `reshape(_, c)` (canonical).
    fn view_parents_of(&self, c: Id) -> impl Iterator<Item = Id> + '_ {
        let lo = self.view_parents.partition_point(|(k, _)| *k < c);
        self.view_parents[lo..]
            .iter()
            .take_while(move |(k, _)| *k == c)
            .map(|(_, p)| *p)
    }

    /// Consumers (node indices) of value `v`, in graph order.
    fn users_of(&self, v: Value) -> &[u32] {
        self.uses.users_of(v)
    }

    /// The canonical class of `v`, when the window converted it.
    fn class(&self, v: Value) -> Option<Id> {
        let c = self.classes.get(self.uses.flat(v)?)?;
        Some(self.eg.find(c))
    }

    fn node(&self, i: u32) -> &arfuse_ir::Node {
        self.g.node(arfuse_ir::NodeId::new(i as usize))
    }

    /// An IR input for class `c`: a value in it, else a value whose view it is.
    fn materialize(&self, c: Id) -> Option<Input> {
        let c = self.eg.find(c);
        if let Some(v) = self.first_value(c) {
            return Some(Input::Value(v));
        }
        let ty = self.eg[c].data.ty()?;
        let tt = self.eg.analysis.tensor_type(ty)?;
        self.eg[c].nodes.iter().find_map(|n| match n {
            Fx::Reshape([_, src]) => self
                .first_value(self.eg.find(*src))
                .map(|v| Input::View(v, tt.clone())),
            _ => None,
        })
    }

    /// Every fused candidate of the all-reduces `owned` (ascending), by all-reduce
    /// instance, most complete first.
    pub fn candidates(&self, owned: &[u32]) -> BTreeMap<u32, Vec<(Id, [Id; 6], FKind)>> {
        let mut out: BTreeMap<u32, Vec<(Id, [Id; 6], FKind)>> = BTreeMap::new();
        let fused = Fx::Fused([Id::from(0usize); 6]).discriminant();
        let classes = self.eg.classes_for_op(&fused).into_iter().flatten();
        for class in classes.map(|c| &self.eg[c]) {
            for node in &class.nodes {
                let Fx::Fused(ch) = node else { continue };
                let kind = leaf_of(self.eg, ch[0]).and_then(|l| self.eg.analysis.attrs.fused(l));
                let (Some(k), Some(Leaf::Inst(i))) = (kind, leaf_of(self.eg, ch[1])) else {
                    continue;
                };
                if owned.binary_search(&i).is_ok() {
                    out.entry(i).or_default().push((class.id, *ch, k));
                }
            }
        }
        for v in out.values_mut() {
            // Residual form before the first form, an epilogue before none, then a
            // fixed order of kinds and classes.
            v.sort_by_key(|(c, _, k)| (!k.residual, k.quant == FusedQuant::None, k.quant, *c));
            v.dedup();
        }
        out
    }

    /// Checks one candidate against the IR; the site, or why not. The steps: the
    /// frontier (the fused node's inputs), the values each port replaces, the region
    /// of IR nodes between them, that nothing outside the region reads an intermediate,
    /// the live ports, and the fused node's IR inputs.
    pub fn check(
        &self,
        inst: u32,
        fclass: Id,
        ch: [Id; 6],
        kind: FKind,
        claimed: &mut Claimed,
    ) -> Result<Site, String> {
        let eg = self.eg;
        let [_, _, x, r, w, s] = ch;
        let none = |c: Id| leaf_of(eg, c) == Some(Leaf::None);
        let ar = self.node(inst);
        let Some(&x_val) = ar.inputs.first() else {
            return Err("internal: all-reduce without input".into());
        };
        let frontier = self.frontier([x, r, w, s]);
        let mut ports = self.replaced_values(fclass);
        let region = self.region(inst, &ports, &frontier, claimed)?;
        self.check_readers(inst, &ports, &region)?;
        // Live outputs: read by something outside the region.
        let live = |v: &Value| {
            self.uses.is_output(*v) || self.users_of(*v).iter().any(|u| !region.contains(u))
        };
        ports.retain(|p| p.direct.iter().any(live) || p.views.iter().any(|(v, _)| live(v)));
        // Every replaced value of a written port stays mapped (a later fused node may
        // read one of them as its residual), even one only the chain itself read.
        if ports.is_empty() {
            return Err("no output of the chain is read".into());
        }
        let x_ty = self
            .g
            .value_type(x_val)
            .cloned()
            .ok_or("internal: untyped all-reduce input")?;
        let mat = |c: Id, what: &str| {
            self.materialize(c)
                .ok_or_else(|| format!("internal: no IR value for the {what}"))
        };
        let residual = if none(r) {
            None
        } else {
            Some(mat(r, "residual")?)
        };
        let weight = mat(w, "weight")?;
        let scale = if none(s) {
            None
        } else {
            Some(mat(s, "scale")?)
        };
        let norm_node = self.norm_node(&region, &ports);
        Ok(Site {
            inst,
            kind,
            x: x_val,
            residual,
            weight,
            scale,
            region: region.into_iter().collect(),
            ports,
            norm_node,
            x_ty,
            map: None,
            module: None,
        })
    }

    /// The classes of the fused node's inputs (`none` leaves skipped) and of the values
    /// their views read.
    fn frontier(&self, inputs: [Id; 4]) -> SmallVec<[Id; 8]> {
        let eg = self.eg;
        let mut frontier = SmallVec::new();
        for c in inputs {
            if leaf_of(eg, c) == Some(Leaf::None) {
                continue;
            }
            let c = eg.find(c);
            frontier.push(c);
            for n in &eg[c].nodes {
                if let Fx::Reshape([_, src]) = n {
                    frontier.push(eg.find(*src));
                }
            }
        }
        frontier
    }

    /// Per output port of the fused node `fclass`, the IR values it replaces: those in
    /// the port's class, and those that are a view of it.
    fn replaced_values(&self, fclass: Id) -> Vec<Port> {
        let eg = self.eg;
        let port_outputs = [
            (PORT_NORM, FusedOutput::Norm),
            (PORT_RESIDUAL, FusedOutput::Residual),
            (PORT_QUANT, FusedOutput::Quant),
            (PORT_SCALE, FusedOutput::Scale),
        ];
        let mut ports: Vec<Port> = Vec::new();
        for (p, output) in port_outputs {
            let Some(pl) = eg.lookup(Fx::Leaf(Leaf::Port(p))) else {
                continue;
            };
            let Some(gc) = eg.lookup(Fx::Get([pl, fclass])) else {
                continue;
            };
            let gc = eg.find(gc);
            let Some(t) = eg[gc].data.ty() else {
                continue;
            };
            let direct: Vec<Value> = self.values_of(gc).collect();
            let mut views = Vec::new();
            for vc in self.view_parents_of(gc) {
                for v in self.values_of(vc) {
                    if let Some(t) = self.g.value_type(v) {
                        views.push((v, t.clone()));
                    }
                }
            }
            if direct.is_empty() && views.is_empty() {
                continue;
            }
            let Some(ty) = eg.analysis.tensor_type(t) else {
                continue;
            };
            ports.push(Port {
                output,
                ty,
                direct,
                views,
            });
        }
        ports
    }

    /// The region: every IR node between the replaced values and the frontier; each a
    /// node the rules model, one all-reduce (`inst`), at most [`MAX_REGION_NODES`], none
    /// claimed by an earlier site. Ascending.
    fn region(
        &self,
        inst: u32,
        ports: &[Port],
        frontier: &[Id],
        claimed: &mut Claimed,
    ) -> Result<SmallVec<[u32; 16]>, String> {
        let mut region: SmallVec<[u32; 16]> = SmallVec::new();
        let mut stack: SmallVec<[u32; 16]> = ports
            .iter()
            .flat_map(|p| {
                p.direct
                    .iter()
                    .chain(p.views.iter().map(|(v, _)| v))
                    .map(|v| v.node.index() as u32)
            })
            .collect();
        while let Some(n) = stack.pop() {
            if region.contains(&n) {
                continue;
            }
            region.push(n);
            if region.len() > MAX_REGION_NODES {
                return Err(format!(
                    "the chain spans more than {MAX_REGION_NODES} nodes; not the pattern"
                ));
            }
            let node = self.node(n);
            let modeled = matches!(
                node.op,
                Op::AllReduce { .. }
                    | Op::Add
                    | Op::Mul
                    | Op::ToDtype { .. }
                    | Op::Pow { .. }
                    | Op::Mean { .. }
                    | Op::Rsqrt
                    | Op::Reshape
                    | Op::RmsNorm { .. }
                    | Op::FusedAddRmsNorm { .. }
                    | Op::QuantFp8Static
                    | Op::QuantFp8PerToken
                    | Op::QuantFp8PerTokenGroup { .. }
                    | Op::QuantNvfp4 { .. }
            ) || (matches!(node.op, Op::Opaque { .. }) && self.is_wait_node(n));
            if !modeled {
                return Err(format!(
                    "the chain reaches node `{}` ({}), which is not part of the pattern",
                    node.id,
                    node.op.name()
                ));
            }
            if let Op::AllReduce { .. } = node.op {
                if n != inst {
                    return Err(format!(
                        "the chain contains a second all-reduce (`{}`)",
                        node.id
                    ));
                }
            }
            for v in &node.inputs {
                if self.class(*v).is_some_and(|c| frontier.contains(&c)) {
                    continue;
                }
                let p = self.node(v.node.index() as u32);
                if p.inputs.is_empty() {
                    continue; // inputs and constants stay
                }
                stack.push(v.node.index() as u32);
            }
        }
        region.sort_unstable();
        if region.binary_search(&inst).is_err() {
            return Err("internal: the fused node does not replace its all-reduce".into());
        }
        if let Some(n) = claimed.first_claimed(&region) {
            return Err(format!(
                "node `{}` belongs to another fused site",
                self.node(n).id
            ));
        }
        Ok(region)
    }

    /// Nothing outside the region may read a value of it that no port replaces.
    fn check_readers(&self, inst: u32, ports: &[Port], region: &[u32]) -> Result<(), String> {
        let replaced: SmallVec<[Value; 8]> = ports
            .iter()
            .flat_map(|p| {
                p.direct
                    .iter()
                    .chain(p.views.iter().map(|(v, _)| v))
                    .copied()
            })
            .collect();
        for &n in region {
            let node = self.node(n);
            for k in 0..node.outputs.len() {
                let v = Value::new(arfuse_ir::NodeId::new(n as usize), k as u32);
                if replaced.contains(&v) {
                    continue;
                }
                let outside = self
                    .users_of(v)
                    .iter()
                    .find(|u| region.binary_search(u).is_err())
                    .map(|u| format!("node `{}`", self.node(*u).id))
                    .or_else(|| self.uses.is_output(v).then(|| "a graph output".to_string()));
                if let Some(user) = outside {
                    let what = if n == inst {
                        "the all-reduce output".to_string()
                    } else {
                        format!("intermediate `{}`", node.id)
                    };
                    return Err(format!(
                        "{what} is also read by {user} outside the chain, which the fused \
                         node cannot provide"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The IR node of the norm: one in the region, else the producer of the first value
    /// the norm port replaces.
    fn norm_node(&self, region: &[u32], ports: &[Port]) -> Option<u32> {
        region
            .iter()
            .copied()
            .find(|n| {
                matches!(
                    self.node(*n).op,
                    Op::RmsNorm { .. } | Op::FusedAddRmsNorm { .. }
                )
            })
            .or_else(|| {
                ports
                    .iter()
                    .find(|p| p.output == FusedOutput::Norm)
                    .and_then(|p| p.direct.first().or(p.views.first().map(|(v, _)| v)))
                    .map(|v| v.node.index() as u32)
            })
    }

    /// Every refusal the rules logged against the all-reduces `owned` (ascending), added
    /// to `out` by instance: those against the all-reduce (in their set order), then
    /// those at an op, each naming the op's IR node (in their set order).
    pub fn rule_refusals(&self, owned: &[u32], out: &mut BTreeMap<u32, Vec<String>>) {
        let an = &self.eg.analysis;
        let mine = |inst: &u32| owned.binary_search(inst).is_ok();
        for (inst, r) in an.refusals.iter().filter(|(i, _)| mine(i)) {
            out.entry(*inst).or_default().extend(r.iter().cloned());
        }
        let mut at_op: BTreeMap<u32, BTreeSet<String>> = BTreeMap::new();
        for (inst, at, why) in an.refusals_at.iter().filter(|(i, _, _)| mine(i)) {
            let at = self
                .node_of(*at)
                .unwrap_or_else(|| "an op with no node of its own".into());
            at_op
                .entry(*inst)
                .or_default()
                .insert(format!("the norm at {at}: {why}"));
        }
        for (inst, named) in at_op {
            out.entry(inst).or_default().extend(named);
        }
    }

    /// The IR node a class stands for, as "`id` (op)", when the class holds an IR value.
    pub fn node_of(&self, c: Id) -> Option<String> {
        let v = self.first_value(self.eg.find(c))?;
        let n = self.g.node(v.node);
        Some(format!("`{}` ({})", n.id, n.op.name()))
    }

    fn is_wait_node(&self, n: u32) -> bool {
        let v = Value::new(arfuse_ir::NodeId::new(n as usize), 0);
        self.class(v).is_some_and(|c| {
            self.eg[c]
                .nodes
                .iter()
                .any(|e| matches!(e, Fx::Wait(_) | Fx::AllReduce(_)))
        })
    }
}

impl Site {
    /// `allreduce[+residual]+rms_norm[(gemma)][(round_twice)][(f32_sum)][+<quant>]`.
    pub(crate) fn pattern_name(&self) -> String {
        // Room for the longest name, so that it is allocated once.
        let mut name = String::with_capacity(80);
        name.push_str("allreduce");
        if self.kind.residual {
            name.push_str("+residual");
        }
        name.push_str("+rms_norm");
        if f64::from_bits(self.kind.bias) == 1.0 {
            name.push_str("(gemma)");
        }
        if self.kind.twice {
            name.push_str("(round_twice)");
        }
        if self.kind.f32_sum {
            name.push_str("(f32_sum)");
        }
        if self.kind.quant != FusedQuant::None {
            name.push('+');
            name.push_str(self.kind.quant.name());
        }
        name
    }

    /// FlashInfer's pattern code (domain.md §1): 1 norm; 2/4 static FP8 without/with the
    /// norm output; 3/5 NVFP4; 8/9 per-token-group FP8; 10/11 dynamic per-token FP8.
    pub(crate) fn pattern_code(&self) -> u32 {
        let norm = self.ports.iter().any(|p| p.output == FusedOutput::Norm);
        let (without_norm, with_norm) = match self.kind.quant {
            FusedQuant::None => return 1,
            FusedQuant::Fp8Static => (2, 4),
            FusedQuant::Nvfp4 { .. } => (3, 5),
            FusedQuant::Fp8PerTokenGroup { .. } => (8, 9),
            FusedQuant::Fp8PerToken => (10, 11),
        };
        if norm {
            with_norm
        } else {
            without_norm
        }
    }

    /// The module of the site: the norm's, else the all-reduce's.
    pub(crate) fn module_in(&self, graph: &Graph) -> Option<String> {
        self.norm_node
            .and_then(|n| graph.node(NodeId::new(n as usize)).module.clone())
            .or_else(|| graph.node(NodeId::new(self.inst as usize)).module.clone())
    }

    /// The hidden size H (the constant last dim of the all-reduce input), when known.
    pub(crate) fn hidden(&self) -> Option<u64> {
        self.x_ty.shape.last().and_then(|d| d.as_const())
    }
}

/// What [`choose`] decided, per all-reduce instance.
#[derive(Default)]
pub(crate) struct Choice {
    /// The site kept for each all-reduce that has one.
    pub chosen: BTreeMap<u32, Site>,
    /// Why each refused candidate was refused, in the order tried.
    pub why_not: BTreeMap<u32, Vec<String>>,
    /// Notes about epilogues left unfused (the site itself may still fuse).
    pub notes: BTreeMap<u32, Vec<String>>,
}

/// Step 3 of the pass, choosing the sites, for the all-reduces `owned` of one window
/// (ascending): per all-reduce (in graph order), the first candidate (most complete
/// first) whose epilogue the target can fuse, that passes the IR checks
/// ([`Index::check`]) against the nodes earlier sites claimed (`claimed`, by node
/// index, over every window so far). Adds to `out`.
pub(crate) fn choose(
    index: &Index<'_, '_, '_>,
    owned: &[u32],
    target: &Target,
    claimed: &mut Claimed,
    out: &mut Choice,
) {
    let candidates = index.candidates(owned);
    let nvfp4_ok = crate::plan::nvfp4_ok(target);
    for &inst in owned {
        let Some(cands) = candidates.get(&inst) else {
            continue;
        };
        for (class, ch, kind) in cands {
            if let Some(note) = unfused_epilogue(kind.quant, nvfp4_ok, target) {
                out.notes.entry(inst).or_default().push(note);
                continue;
            }
            match index.check(inst, *class, *ch, *kind, claimed) {
                Ok(s) if kernel_epilogue_refusal(&s, target).is_some() => {
                    let why = kernel_epilogue_refusal(&s, target).unwrap_or_default();
                    out.notes.entry(inst).or_default().push(why);
                }
                Ok(mut s) => {
                    s.map = Some(site_map(index.g, &s));
                    s.module = s.module_in(index.g);
                    claimed.claim(&s.region);
                    out.chosen.insert(inst, s);
                    break;
                }
                Err(e) => out.why_not.entry(inst).or_default().push(e),
            }
        }
    }
}

/// The site's chain as the input graph's ids, its fused node not named yet.
fn site_map(g: &Graph, s: &Site) -> SiteMap {
    let input = |i: &Input| match i {
        Input::Value(v) => SiteInput {
            value: NodeOutput::of(g, *v),
            view: None,
        },
        Input::View(v, t) => SiteInput {
            value: NodeOutput::of(g, *v),
            view: Some(t.clone()),
        },
    };
    let mut inputs = vec![input(&Input::Value(s.x))];
    inputs.extend(s.residual.iter().map(input));
    inputs.push(input(&s.weight));
    inputs.extend(s.scale.iter().map(input));
    SiteMap {
        fused_node: String::new(),
        all_reduce: g.node(NodeId::new(s.inst as usize)).id.clone(),
        replaced_nodes: s
            .region
            .iter()
            .map(|&n| g.node(NodeId::new(n as usize)).id.clone())
            .collect(),
        inputs,
        outputs: s
            .ports
            .iter()
            .map(|p| SiteOutput {
                output: p.output,
                replaces: p
                    .direct
                    .iter()
                    .chain(p.views.iter().map(|(v, _)| v))
                    .map(|v| NodeOutput::of(g, *v))
                    .collect(),
            })
            .collect(),
    }
}

/// The IR nodes the chosen sites replace, by node index; when logging
/// ([`Claimed::logging`]), also every node a check asked about.
#[derive(Debug, Default)]
pub(crate) struct Claimed {
    claimed: Vec<bool>,
    /// Every node of every region tested against the claims, with repeats.
    tested: Option<Vec<u32>>,
}

impl Claimed {
    /// Nothing claimed in a graph of `nodes` nodes.
    pub fn new(nodes: usize) -> Claimed {
        Claimed {
            claimed: vec![false; nodes],
            tested: None,
        }
    }

    /// Like [`Claimed::new`], logging every node tested: a helper thread chooses a
    /// window's sites ahead, knowing only its own window's claims; the result holds
    /// when no tested node was claimed by a window before (`crate::find`).
    pub fn logging(nodes: usize) -> Claimed {
        Claimed {
            claimed: vec![false; nodes],
            tested: Some(Vec::new()),
        }
    }

    /// Whether node `n` is claimed.
    pub fn contains(&self, n: u32) -> bool {
        self.claimed.get(n as usize).copied().unwrap_or(false)
    }

    /// The first node of `region` that is claimed; logs `region` when logging.
    fn first_claimed(&mut self, region: &[u32]) -> Option<u32> {
        if let Some(log) = &mut self.tested {
            log.extend_from_slice(region);
        }
        region.iter().copied().find(|&n| self.contains(n))
    }

    /// Claims the nodes of `region`.
    pub fn claim(&mut self, region: &BTreeSet<u32>) {
        for &n in region {
            if let Some(c) = self.claimed.get_mut(n as usize) {
                *c = true;
            }
        }
    }

    /// Forgets the claims of every site of `chosen`, ready for another window; returns
    /// the nodes tested since the last release, with repeats (empty when not logging).
    pub fn release(&mut self, chosen: &BTreeMap<u32, Site>) -> Vec<u32> {
        for s in chosen.values() {
            for &n in &s.region {
                if let Some(c) = self.claimed.get_mut(n as usize) {
                    *c = false;
                }
            }
        }
        self.tested.as_mut().map(std::mem::take).unwrap_or_default()
    }
}

/// Why arfuse's kernels cannot run a checked site's quant epilogue at its hidden size
/// and dtype (the ABI's rule, [`arfuse_abi::Quant::unsupported`]: NVFP4 on f32, a
/// hidden size that is not a multiple of the group or block), or `None`. FlashInfer's
/// kernels are not judged here.
fn kernel_epilogue_refusal(s: &Site, target: &Target) -> Option<String> {
    if target.kernels != arfuse_policy::KernelLibrary::Arfuse {
        return None;
    }
    let quant = s.kind.quant.kernel_quant().ok()?;
    let dtype = s.x_ty.dtype.activation()?;
    let why = quant.unsupported(s.hidden()?, dtype)?;
    Some(format!(
        "the {} quant epilogue is not fused: {why}; the quant runs unfused after the fused \
         node",
        s.kind.quant.name()
    ))
}

/// Why a candidate's quant epilogue is not fused on this target (the quant then runs
/// unfused after a fused node without it), or `None` when it may be.
fn unfused_epilogue(quant: FusedQuant, nvfp4_ok: bool, target: &Target) -> Option<String> {
    match quant {
        FusedQuant::Nvfp4 { .. } if !nvfp4_ok => Some(format!(
            "the NVFP4 quant epilogue is not fused: it needs SM >= 100, the target is \
             SM {}; the quant runs unfused after the fused node",
            target.sm
        )),
        FusedQuant::Fp8PerTokenGroup { group_size, .. } => {
            arfuse_policy::group_quant_unsupported_reason(group_size).map(|why| {
                format!(
                    "the per-token-group FP8 quant epilogue is not fused: {why}; the \
                     quant runs unfused after the fused node"
                )
            })
        }
        _ => None,
    }
}
