//! E-graph -> IR: the input graph with every fused site's chain replaced by one fused
//! node (plus the views its boundary needs), in a deterministic topological order.
//!
//! Untouched nodes keep their ids, ops and types; graph inputs and the order of the
//! graph outputs are preserved. The fused node of all-reduce `a` is `fused.a` (made
//! unique with `.2`, `.3`, ... if taken), views are `fused.a.<output>.view` and the
//! residual view is `fused.a.residual_in`.

use crate::convert::Collectives;
use crate::error::LowerError;
use crate::par;
use crate::plan::SiteDecision;
use crate::site::{Input, Port, Site};
use crate::uses::Uses;
use arfuse_ir::op::{FusedAllReduceNorm, FusedOutput, FusedPlan, NormInput, NormRounding};
use arfuse_ir::{DType, Graph, Node, NodeId, Op, SiteMap, TensorType, Value};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashSet};

/// What [`emit_sites`] returns.
pub(crate) struct Emitted {
    /// The output graph (validated by [`check`]).
    pub graph: Graph,
    /// The fused node's id in the output, by all-reduce instance, for every site fused.
    pub fused_id_of: BTreeMap<u32, String>,
    /// What each fused node added here replaced, in all-reduce (graph) order.
    pub sites: Vec<SiteMap>,
    /// The nodes of `graph` that [`check`] validates: those added or rewired.
    changed: Vec<NodeId>,
}

/// The chosen sites step 5 emits, as all-reduce instances in graph order: those whose
/// size the policy fuses with a plan ([`SiteDecision`]), what the report calls fused;
/// and their site maps (in the same order), taken out of `chosen`: the chain each
/// fused node replaces, its fused node not named yet ([`emit_sites`] names it). One
/// walk over `chosen`.
///
/// Errors: [`LowerError::Internal`] when a selected site has no map (a bug).
pub(crate) fn select(
    chosen: &mut BTreeMap<u32, Site>,
    decisions: &BTreeMap<(DType, u64), SiteDecision>,
) -> Result<(Vec<u32>, Vec<SiteMap>), LowerError> {
    let mut selected = Vec::new();
    let mut maps = Vec::new();
    for s in chosen.values_mut() {
        if fused_plan(s, decisions).is_none() {
            continue;
        }
        let map = s
            .map
            .take()
            .ok_or_else(|| LowerError::Internal("a fused site has no site map".into()))?;
        selected.push(s.inst);
        maps.push(map);
    }
    Ok((selected, maps))
}

/// The plan site `s` is emitted with: its size's decision's, when that decision fuses.
fn fused_plan<'d>(
    s: &Site,
    decisions: &'d BTreeMap<(DType, u64), SiteDecision>,
) -> Option<&'d FusedPlan> {
    let d = decisions.get(&(s.x_ty.dtype, s.hidden().unwrap_or(0)))?;
    d.plan.as_ref().filter(|_| d.fused)
}

/// Step 5 of the pass, emit: every site of `chosen` that `decisions` fuse (those
/// [`select`] took, in the same order) becomes one fused node carrying its plan;
/// `sites` are their maps ([`select`]'s), which get the fused nodes' ids. The result is
/// checked by [`check`]. When `parallel`, the input's kept nodes are copied on a
/// helper thread while the sites are added and wired ([`par::both`]).
///
/// Errors: [`LowerError::Internal`] when `sites` are not one map per site to emit or a
/// site cannot be wired (a bug).
pub(crate) fn emit_sites(
    g: &Graph,
    uses: &Uses,
    chosen: &BTreeMap<u32, Site>,
    mut sites: Vec<SiteMap>,
    decisions: &BTreeMap<(DType, u64), SiteDecision>,
    group: &str,
    parallel: bool,
) -> Result<Emitted, LowerError> {
    let mut emits = Vec::with_capacity(sites.len());
    for s in chosen.values() {
        let Some(plan) = fused_plan(s, decisions) else {
            continue;
        };
        let mut plan = plan.clone();
        plan.pattern_code = s.pattern_code();
        emits.push(Emit {
            site: s,
            plan: Some(plan),
            group,
        });
    }
    if emits.len() != sites.len() {
        return Err(LowerError::Internal(
            "the sites to emit are not one per site map".into(),
        ));
    }
    let insts: Vec<u32> = emits.iter().map(|e| e.site.inst).collect();
    let (out, changed, fused_ids) = emit(g, uses, emits, parallel)?;
    for (map, fid) in sites.iter_mut().zip(&fused_ids) {
        map.fused_node = fid.clone();
    }
    Ok(Emitted {
        graph: out,
        fused_id_of: insts.into_iter().zip(fused_ids).collect(),
        sites,
        changed,
    })
}

/// The checks of step 5, on the graph [`emit_sites`] made from `g`: every original
/// all-reduce appears exactly once in the result (kept, or inside one fused node), the
/// collective count matches, and the result validates: every node it added or rewired
/// is checked ([`Graph::validate_nodes`]); every other node is as it was in the
/// validated input, reading values of the same types.
///
/// When `parallel`, the collectives and the first half of those nodes are checked on a
/// helper thread while the calling thread checks the second half ([`par::both`]); a
/// failure is then found again on the calling thread alone, so the error is the one
/// thread's.
///
/// Errors: [`LowerError::Internal`] when one of these checks fails (a bug).
pub(crate) fn check(
    g: &Graph,
    collectives: &Collectives,
    e: &Emitted,
    parallel: bool,
) -> Result<(), LowerError> {
    let in_order = || {
        check_collectives(g, &e.graph, collectives, &e.fused_id_of)?;
        validate(&e.graph, &e.changed)
    };
    if !parallel {
        return in_order();
    }
    let (first, second) = e.changed.split_at(e.changed.len() / 2);
    let (a, b) = par::both(
        true,
        || {
            check_collectives(g, &e.graph, collectives, &e.fused_id_of)
                .and_then(|()| validate(&e.graph, first))
        },
        || validate(&e.graph, second),
    );
    match (a, b) {
        (Ok(()), Ok(())) => Ok(()),
        _ => in_order(),
    }
}

/// Validates nodes `nodes` of `out`, the emitted graph: the input validated, and a node
/// that is not new and reads no new node's value has the checks it had there.
fn validate(out: &Graph, nodes: &[NodeId]) -> Result<(), LowerError> {
    out.validate_nodes(nodes.iter().copied())
        .map_err(|p| LowerError::Internal(format!("the rewritten graph fails validation: {p}")))
}

/// Every original all-reduce appears exactly once in `out`: kept as is, or in one
/// fused node (`fused`); and the collectives of `out` are those of `g`
/// (`collectives`), counted.
fn check_collectives(
    g: &Graph,
    out: &Graph,
    collectives: &Collectives,
    fused: &BTreeMap<u32, String>,
) -> Result<(), LowerError> {
    let instances = &collectives.all_reduces;
    // The all-reduces of the output, by the input node of the same id; and its
    // collectives, counted in the same walk.
    let mut kept = vec![false; g.len()];
    let mut collectives_after = 0usize;
    for (_, n) in out.nodes() {
        if !n.op.is_collective() {
            continue;
        }
        collectives_after += 1;
        if matches!(n.op, Op::AllReduce { .. }) {
            if let Some(i) = g.find(&n.id) {
                kept[i.index()] = true;
            }
        }
    }
    let mut is_fused = vec![false; g.len()];
    for &inst in fused.keys() {
        if let Some(f) = is_fused.get_mut(inst as usize) {
            *f = true;
        }
    }
    for &inst in instances {
        let id = g.node(NodeId::new(inst as usize)).id.as_str();
        let kept = kept[inst as usize];
        let fused = is_fused[inst as usize];
        if kept == fused {
            return Err(LowerError::Internal(format!(
                "all-reduce `{id}` appears {} times in the result",
                usize::from(kept) + usize::from(fused)
            )));
        }
    }
    let fused_before = collectives.fused.len();
    if collectives_after != instances.len() + fused_before {
        return Err(LowerError::Internal(format!(
            "{} collectives in, {collectives_after} out",
            instances.len() + fused_before
        )));
    }
    Ok(())
}

/// A fused site ready to emit.
struct Emit<'a> {
    /// The site.
    pub site: &'a Site,
    /// The plan the fused node carries (moved into it).
    pub plan: Option<FusedPlan>,
    /// The layer group.
    pub group: &'a str,
}

/// A node of the output, before ids are resolved.
struct Pending {
    /// A kept node of the input (its node index; copied when the output is written, or
    /// before, on a helper thread: [`copy_nodes`]), or
    /// a new node (its index in [`Builder::new_nodes`]).
    what: What,
    /// Its inputs: `Builder::ins[start..start + len]`.
    ins: (u32, u32),
    /// Its place in the output order: (node index, 0) for a kept node; for the nodes
    /// of the site of all-reduce `a`: (a, 1) an input view, (a, 2) the fused node,
    /// (a, 3 + k) a view of its output k.
    key: (u32, u32),
}

/// What a pending node is.
#[derive(Clone, Copy)]
enum What {
    Kept(u32),
    New(u32),
}

/// A node a site adds.
struct NewNode {
    id: String,
    op: Op,
    outputs: Vec<TensorType>,
    module: Option<String>,
}

/// An output of a pending node: (pending index, output). Pending indices fit a u32:
/// a graph has at most `MAX_NODES` nodes and a site adds a handful. The layout of a
/// [`Value`], so a node's inputs become its values in place.
type Ref = (u32, u32);

/// No pending slot (a node some site removed).
const NO_SLOT: u32 = u32::MAX;

/// The output graph being assembled: the kept nodes and the sites' new nodes, before
/// ids are resolved. Every table is flat, by node index or flat value index; a kept
/// node is read from the input when the output is written, so it is copied once.
struct Builder<'g> {
    g: &'g Graph,
    uses: &'g Uses,
    /// Nodes some site replaces, by node index.
    removed: Vec<bool>,
    /// Ids given to new nodes so far.
    new_ids: HashSet<String>,
    /// The output's nodes: the kept ones first, in graph order, then the new ones.
    pending: Vec<Pending>,
    /// The nodes the sites add.
    new_nodes: Vec<NewNode>,
    /// Every pending node's inputs, one after the other ([`Pending::ins`]).
    ins: Vec<Ref>,
    /// The pending index of every kept node, by node index ([`NO_SLOT`]: removed).
    slot_of: Vec<u32>,
    /// The number of kept nodes.
    kept: usize,
    /// Where each replaced value now comes from, by flat value index.
    remap: Vec<Option<Ref>>,
    /// Kept nodes (pending indices) that read a remapped value.
    rewired: Vec<usize>,
}

/// The inputs of one fused node, resolved once every remap is known: (pending index
/// of the fused node, its inputs, whether its residual input is a view).
type FusedInputs = (usize, Vec<Input>, Option<Value>);

/// The output graph, its nodes that are new or rewired, and the fused node ids (in
/// site order). When `parallel`, a helper thread copies the kept nodes of `g` while
/// the calling thread adds and wires the sites and orders the output; else each kept
/// node is copied as it is written.
fn emit(
    g: &Graph,
    uses: &Uses,
    mut sites: Vec<Emit<'_>>,
    parallel: bool,
) -> Result<(Graph, Vec<NodeId>, Vec<String>), LowerError> {
    let mut b = Builder::new(g, uses, &sites);
    let kept = if parallel { b.kept_nodes() } else { Vec::new() };
    let (copies, assembled) = par::both(
        parallel,
        || parallel.then(|| copy_nodes(g, &kept)),
        || {
            let (fused_ids, fused_inputs) = b.add_sites(&mut sites);
            b.wire_kept()?;
            b.wire_fused(fused_inputs)?;
            let outputs = g
                .outputs()
                .iter()
                .map(|v| b.resolve(*v))
                .collect::<Result<Vec<_>, _>>()?;
            let order = b.order()?;
            Ok::<_, LowerError>((fused_ids, outputs, order))
        },
    );
    let (fused_ids, outputs, order) = assembled?;
    let (out, changed) = b.into_graph(&order, &outputs, copies)?;
    Ok((out, changed, fused_ids))
}

/// Copies of the nodes `nodes` of `g`, in that order, each with no inputs (the output
/// graph wires its own).
fn copy_nodes(g: &Graph, nodes: &[u32]) -> Vec<Node> {
    nodes
        .iter()
        .map(|&n| copy_node(g.node(NodeId::new(n as usize)), Vec::new()))
        .collect()
}

/// A copy of `n` reading `inputs` instead of its own.
fn copy_node(n: &Node, inputs: Vec<Value>) -> Node {
    Node {
        id: n.id.clone(),
        op: n.op.clone(),
        inputs,
        outputs: n.outputs.clone(),
        module: n.module.clone(),
    }
}

impl<'g> Builder<'g> {
    /// The kept nodes of `g`: all but the sites' regions and the constants only those
    /// regions read (dropped with them).
    fn new(g: &'g Graph, uses: &'g Uses, sites: &[Emit<'_>]) -> Builder<'g> {
        let mut removed = vec![false; g.len()];
        for s in sites {
            for &n in &s.site.region {
                if let Some(r) = removed.get_mut(n as usize) {
                    *r = true;
                }
            }
        }
        let new_sites = sites.len();
        let mut b = Builder {
            g,
            uses,
            removed,
            new_ids: HashSet::with_capacity(3 * new_sites),
            pending: Vec::with_capacity(g.len() + 3 * new_sites),
            new_nodes: Vec::with_capacity(3 * new_sites),
            ins: Vec::new(),
            slot_of: vec![NO_SLOT; g.len()],
            kept: 0,
            remap: vec![None; uses.values()],
            rewired: Vec::new(),
        };
        for (i, n) in g.nodes() {
            let idx = i.index() as u32;
            if b.removed[i.index()] || b.is_dead_constant(idx, n) {
                continue;
            }
            b.slot_of[i.index()] = b.pending.len() as u32;
            b.pending.push(Pending {
                what: What::Kept(idx),
                ins: (0, 0),
                key: (idx, 0),
            });
        }
        b.kept = b.pending.len();
        b
    }

    /// The input node of every kept pending slot, in slot order.
    fn kept_nodes(&self) -> Vec<u32> {
        self.pending[..self.kept]
            .iter()
            .filter_map(|p| match p.what {
                What::Kept(n) => Some(n),
                What::New(_) => None,
            })
            .collect()
    }

    /// A constant that is read, only by removed nodes, and is no graph output.
    fn is_dead_constant(&self, idx: u32, n: &arfuse_ir::Node) -> bool {
        if !matches!(n.op, Op::Constant { .. }) {
            return false;
        }
        let users = self.uses.users_of_node(idx);
        !users.is_empty()
            && users.iter().all(|&u| self.removed[u as usize])
            && !self
                .uses
                .is_output(Value::new(NodeId::new(idx as usize), 0))
    }

    /// `base`, or `base.2`, `base.3`, ... : the first id no kept node and no new node
    /// has.
    fn fresh(&mut self, base: String) -> String {
        let taken = |b: &Builder<'_>, id: &str| {
            b.g.find(id).is_some_and(|n| !b.removed[n.index()]) || b.new_ids.contains(id)
        };
        let mut id = base.clone();
        let mut k = 2;
        while taken(self, &id) {
            id = format!("{base}.{k}");
            k += 1;
        }
        self.new_ids.insert(id.clone());
        id
    }

    fn remap(&mut self, v: Value, to: Ref) {
        if let Some(slot) = self.uses.flat(v).and_then(|i| self.remap.get_mut(i)) {
            *slot = Some(to);
        }
    }

    /// The pending slot of input node `n`, if it is kept.
    fn slot(&self, n: NodeId) -> Option<u32> {
        self.slot_of
            .get(n.index())
            .copied()
            .filter(|&s| s != NO_SLOT)
    }

    /// Where value `v` of the input comes from in the output.
    fn resolve(&self, v: Value) -> Result<Ref, LowerError> {
        if let Some(r) = self.uses.flat(v).and_then(|i| self.remap[i]) {
            return Ok(r);
        }
        self.slot(v.node).map(|s| (s, v.output)).ok_or_else(|| {
            LowerError::Internal(format!(
                "value {} is read but its node was removed",
                self.g.value_ref(v)
            ))
        })
    }

    /// Adds a new node with inputs `inputs`; returns its pending index.
    fn push_new(&mut self, node: NewNode, inputs: &[Ref], key: (u32, u32)) -> usize {
        let slot = self.pending.len();
        self.pending.push(Pending {
            what: What::New(self.new_nodes.len() as u32),
            ins: (0, 0),
            key,
        });
        self.new_nodes.push(node);
        self.set_inputs(slot, inputs.iter().copied());
        slot
    }

    /// Sets the inputs of pending node `slot`.
    fn set_inputs(&mut self, slot: usize, inputs: impl IntoIterator<Item = Ref>) {
        let start = self.ins.len();
        self.ins.extend(inputs);
        self.pending[slot].ins = (start as u32, (self.ins.len() - start) as u32);
    }

    /// The inputs of pending node `slot`.
    fn inputs(&self, slot: usize) -> &[Ref] {
        let (start, len) = self.pending[slot].ins;
        &self.ins[start as usize..(start + len) as usize]
    }

    /// The op of pending node `slot`.
    fn op(&self, slot: usize) -> &Op {
        match self.pending[slot].what {
            What::Kept(n) => &self.g.node(NodeId::new(n as usize)).op,
            What::New(k) => &self.new_nodes[k as usize].op,
        }
    }

    /// The output types of pending node `slot`.
    fn outputs(&self, slot: usize) -> &[TensorType] {
        match self.pending[slot].what {
            What::Kept(n) => &self.g.node(NodeId::new(n as usize)).outputs,
            What::New(k) => &self.new_nodes[k as usize].outputs,
        }
    }

    /// The new node of pending node `slot` (a fused node).
    fn new_node(&self, slot: usize) -> Option<&NewNode> {
        match self.pending[slot].what {
            What::Kept(_) => None,
            What::New(k) => self.new_nodes.get(k as usize),
        }
    }

    /// Adds every site's fused node and the views of its outputs, and remaps the values
    /// they replace. Returns the fused ids (in site order) and each fused node's inputs.
    fn add_sites(&mut self, sites: &mut [Emit<'_>]) -> (Vec<String>, Vec<FusedInputs>) {
        let mut fused_ids = Vec::with_capacity(sites.len());
        let mut fused_inputs = Vec::with_capacity(sites.len());
        for e in sites {
            let s = e.site;
            let ar = self.g.node(NodeId::new(s.inst as usize));
            let base = format!("fused.{}", ar.id);
            let fid = self.fresh(base.clone());
            let mut ins = vec![s.x_input()];
            ins.extend(s.residual.iter().cloned());
            ins.push(s.weight.clone());
            ins.extend(s.scale.iter().cloned());
            let fused = NewNode {
                id: fid.clone(),
                op: Op::FusedAllreduceNorm(Box::new(fused_op(e))),
                outputs: s.ports.iter().map(|p| p.ty.clone()).collect(),
                module: s.module.clone(),
            };
            let fslot = self.push_new(fused, &[], (s.inst, 2));
            for (k, p) in s.ports.iter().enumerate() {
                for v in &p.direct {
                    self.remap(*v, (fslot as u32, k as u32));
                }
                self.add_port_views(e, &base, fslot, k, p);
            }
            let residual_view = match &s.residual {
                Some(Input::View(v, _)) => Some(*v),
                _ => None,
            };
            fused_inputs.push((fslot, ins, residual_view));
            fused_ids.push(fid);
        }
        (fused_ids, fused_inputs)
    }

    /// One view node per distinct type the replaced values of port `k` are read in.
    fn add_port_views(&mut self, e: &Emit<'_>, base: &str, fslot: usize, k: usize, p: &Port) {
        let mut by_type: BTreeMap<String, usize> = BTreeMap::new();
        for (v, t) in &p.views {
            let key = t.to_string();
            let slot = match by_type.get(&key) {
                Some(&slot) => slot,
                None => {
                    let name = match p.output {
                        FusedOutput::Norm => "norm",
                        FusedOutput::Residual => "residual",
                        FusedOutput::Quant => "quant",
                        FusedOutput::Scale => "scale",
                    };
                    let view = NewNode {
                        id: self.fresh(format!("{base}.{name}.view")),
                        op: Op::Reshape,
                        outputs: vec![t.clone()],
                        module: e.site.module.clone(),
                    };
                    let slot = self.push_new(
                        view,
                        &[(fslot as u32, k as u32)],
                        (e.site.inst, 3 + k as u32),
                    );
                    by_type.insert(key, slot);
                    slot
                }
            };
            self.remap(*v, (slot as u32, 0));
        }
    }

    /// The inputs of every kept node.
    fn wire_kept(&mut self) -> Result<(), LowerError> {
        let mut ins = std::mem::take(&mut self.ins);
        // Most nodes read one or two values.
        ins.reserve(2 * self.kept);
        for slot in 0..self.kept {
            let What::Kept(n) = self.pending[slot].what else {
                continue;
            };
            let start = ins.len();
            let mut moved = false;
            for v in &self.g.node(NodeId::new(n as usize)).inputs {
                let r = self.resolve(*v)?;
                moved |= self.slot(v.node) != Some(r.0);
                ins.push(r);
            }
            if moved {
                self.rewired.push(slot);
            }
            self.pending[slot].ins = (start as u32, (ins.len() - start) as u32);
        }
        self.ins = ins;
        Ok(())
    }

    /// The inputs of every fused node; an input seen through a view gets a reshape
    /// node, except a view of a view of a fused output, which is that output.
    fn wire_fused(&mut self, fused_inputs: Vec<FusedInputs>) -> Result<(), LowerError> {
        for (fslot, ins, residual_view) in fused_inputs {
            let mut refs = Vec::with_capacity(ins.len());
            for inp in ins {
                match inp {
                    Input::Value(v) => refs.push(self.resolve(v)?),
                    Input::View(v, t) => {
                        let src = self.resolve(v)?;
                        if let Some(of_fused) = self.view_of_fused(src.0 as usize, &t) {
                            refs.push(of_fused);
                            continue;
                        }
                        let what = if residual_view == Some(v) {
                            "residual_in"
                        } else {
                            "input_view"
                        };
                        let (fid, module) = match self.new_node(fslot) {
                            Some(f) => (f.id.clone(), f.module.clone()),
                            None => {
                                return Err(LowerError::Internal(
                                    "a fused node is not a new node".into(),
                                ))
                            }
                        };
                        let view = NewNode {
                            id: self.fresh(format!("{fid}.{what}")),
                            op: Op::Reshape,
                            outputs: vec![t],
                            module,
                        };
                        let key = (self.pending[fslot].key.0, 1);
                        let slot = self.push_new(view, &[src], key);
                        refs.push((slot as u32, 0));
                    }
                }
            }
            self.set_inputs(fslot, refs);
        }
        Ok(())
    }

    /// When pending node `src` is a view of output `k` of a fused node, typed `t`
    /// (the type that output has): that output.
    fn view_of_fused(&self, src: usize, t: &TensorType) -> Option<Ref> {
        let [(inner, k)] = *self.inputs(src) else {
            return None;
        };
        let fused_output = matches!(self.op(src), Op::Reshape)
            && matches!(self.op(inner as usize), Op::FusedAllreduceNorm(_))
            && self.outputs(inner as usize).get(k as usize) == Some(t);
        fused_output.then_some((inner, k))
    }

    /// The output order: repeatedly the ready node (every input placed) with the least
    /// (key, pending index). Walks the nodes in that order and defers a node not yet
    /// ready; a deferred node that becomes ready goes first (its key is below every
    /// node not reached yet). Linear but for the deferred nodes (a fused node whose
    /// residual or weight comes after its all-reduce), which wait in a heap.
    fn order(&self) -> Result<Vec<usize>, LowerError> {
        let n = self.pending.len();
        let mut indeg = vec![0u32; n];
        let mut succ_start = vec![0u32; n + 1];
        for (i, p) in self.pending.iter().enumerate() {
            indeg[i] = p.ins.1;
            for &(src, _) in self.inputs(i) {
                succ_start[src as usize + 1] += 1;
            }
        }
        for i in 1..=n {
            succ_start[i] += succ_start[i - 1];
        }
        let mut fill = succ_start.clone();
        let mut succ = vec![0u32; succ_start[n] as usize];
        for i in 0..n {
            for &(src, _) in self.inputs(i) {
                let src = src as usize;
                succ[fill[src] as usize] = i as u32;
                fill[src] += 1;
            }
        }
        // The kept nodes are in key order already; the new ones are sorted and merged.
        let kept = self.kept;
        let mut new: Vec<usize> = (kept..n).collect();
        new.sort_by_key(|&i| (self.pending[i].key, i));
        let mut by_key = Vec::with_capacity(n);
        let (mut a, mut b) = (0usize, 0usize);
        while a < kept || b < new.len() {
            let take_kept = b == new.len()
                || (a < kept && (self.pending[a].key, a) < (self.pending[new[b]].key, new[b]));
            if take_kept {
                by_key.push(a);
                a += 1;
            } else {
                by_key.push(new[b]);
                b += 1;
            }
        }
        let mut deferred = vec![false; n];
        let mut ready: BinaryHeap<Reverse<((u32, u32), usize)>> = BinaryHeap::new();
        let mut order = Vec::with_capacity(n);
        let mut next = 0usize;
        while order.len() < n {
            let i = if let Some(Reverse((_, i))) = ready.pop() {
                i
            } else if next < n {
                let i = by_key[next];
                next += 1;
                if indeg[i] > 0 {
                    deferred[i] = true;
                    continue;
                }
                i
            } else {
                return Err(LowerError::Internal(
                    "the rewritten graph has a cycle".to_string(),
                ));
            };
            order.push(i);
            for &s in &succ[succ_start[i] as usize..succ_start[i + 1] as usize] {
                let s = s as usize;
                indeg[s] -= 1;
                if indeg[s] == 0 && deferred[s] {
                    ready.push(Reverse((self.pending[s].key, s)));
                }
            }
        }
        Ok(order)
    }

    /// The output graph: the pending nodes in `order` (a kept node copied from the
    /// input, or moved from `copies`, its copy by kept slot, [`copy_nodes`]; a new
    /// node moved), the outputs `outputs`; and its nodes that are new or read a value
    /// of a new node (the only ones whose checks can differ from the input's).
    fn into_graph(
        mut self,
        order: &[usize],
        outputs: &[Ref],
        mut copies: Option<Vec<Node>>,
    ) -> Result<(Graph, Vec<NodeId>), LowerError> {
        if copies.as_ref().is_some_and(|c| c.len() != self.kept) {
            return Err(LowerError::Internal(
                "the kept nodes' copies do not match them".into(),
            ));
        }
        let g = self.g;
        let mut out = Graph::new();
        for (name, r) in g.symbols() {
            out.set_symbol(name.clone(), *r);
        }
        out.set_metadata(g.metadata().cloned());
        out.reserve(self.pending.len(), self.ins.len());
        let mut node_of: Vec<Option<NodeId>> = vec![None; self.pending.len()];
        for &i in order {
            let inputs = self
                .inputs(i)
                .iter()
                .map(|&(src, k)| node_of[src as usize].map(|n| Value::new(n, k)))
                .collect::<Option<Vec<Value>>>()
                .ok_or_else(|| LowerError::Internal("input emitted late".into()))?;
            let node = match (self.pending[i].what, copies.as_mut()) {
                // Each kept node is emitted once: move its copy.
                (What::Kept(_), Some(copies)) => Node {
                    inputs,
                    ..std::mem::replace(&mut copies[i], empty_node())
                },
                (What::Kept(n), None) => copy_node(g.node(NodeId::new(n as usize)), inputs),
                (What::New(k), _) => {
                    // Each new node is emitted once: move its parts.
                    let p = &mut self.new_nodes[k as usize];
                    Node {
                        id: std::mem::take(&mut p.id),
                        op: std::mem::replace(&mut p.op, Op::Rsqrt),
                        inputs,
                        outputs: std::mem::take(&mut p.outputs),
                        module: p.module.take(),
                    }
                }
            };
            let id = out
                .add_node(node)
                .map_err(|e| LowerError::Internal(e.to_string()))?;
            node_of[i] = Some(id);
        }
        let outs = outputs
            .iter()
            .map(|&(src, k)| {
                node_of[src as usize]
                    .map(|id| Value::new(id, k))
                    .ok_or_else(|| LowerError::Internal("graph output missing".into()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        out.set_outputs(outs)
            .map_err(|e| LowerError::Internal(e.to_string()))?;
        let changed = self
            .rewired
            .iter()
            .copied()
            .chain(self.kept..self.pending.len())
            .filter_map(|i| node_of[i])
            .collect();
        Ok((out, changed))
    }
}

/// A node that allocates nothing, left where a node was moved out.
fn empty_node() -> Node {
    Node {
        id: String::new(),
        op: Op::Rsqrt,
        inputs: Vec::new(),
        outputs: Vec::new(),
        module: None,
    }
}

/// The fused op of a site to emit.
fn fused_op(e: &mut Emit<'_>) -> FusedAllReduceNorm {
    let s = e.site;
    FusedAllReduceNorm {
        group: e.group.to_string(),
        eps: f64::from_bits(s.kind.eps),
        weight_bias: f64::from_bits(s.kind.bias),
        norm_rounding: if s.kind.twice {
            NormRounding::Twice
        } else {
            NormRounding::Once
        },
        norm_input: if s.kind.f32_sum {
            NormInput::F32Sum
        } else {
            NormInput::Residual
        },
        residual: s.kind.residual,
        quant: s.kind.quant,
        outputs: s.ports.iter().map(|p| p.output).collect(),
        plan: e.plan.take(),
    }
}

impl Site {
    /// The fused node's x input: the all-reduce's own input.
    pub(crate) fn x_input(&self) -> Input {
        Input::Value(self.x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arfuse_ir::{Dim, InputKind};

    /// A graph of inputs `x` (bf16) and `y` (f32), then `n` adds: the odd ones (`bad1`,
    /// `bad3`, ...) add `x` to `y` and fail validation, the even ones add `x` to
    /// itself; and, with `collective`, an all-reduce of `x`. Returns the adds too.
    fn graph(n: usize, collective: bool) -> (Graph, Vec<NodeId>) {
        let mut g = Graph::new();
        let mut add = |id: &str, op: Op, inputs: Vec<Value>, dtype: DType| {
            let node = Node {
                id: id.into(),
                op,
                inputs,
                outputs: vec![TensorType::new(dtype, vec![Dim::constant(8)])],
                module: None,
            };
            g.add_node(node).unwrap()
        };
        let input = || Op::Input {
            kind: InputKind::Activation,
        };
        let x = Value::new(add("x", input(), vec![], DType::Bf16), 0);
        let y = Value::new(add("y", input(), vec![], DType::F32), 0);
        let adds = (0..n)
            .map(|i| match i % 2 {
                1 => add(&format!("bad{i}"), Op::Add, vec![x, y], DType::Bf16),
                _ => add(&format!("ok{i}"), Op::Add, vec![x, x], DType::Bf16),
            })
            .collect();
        if collective {
            let op = Op::AllReduce {
                group: "tp".into(),
                reduce: Default::default(),
            };
            add("ar", op, vec![x], DType::Bf16);
        }
        (g, adds)
    }

    fn checked(g: &Graph, changed: Vec<NodeId>, parallel: bool) -> String {
        let collectives = Collectives {
            all_reduces: Vec::new(),
            fused: Vec::new(),
            opaque_collectives: Vec::new(),
        };
        let e = Emitted {
            graph: g.clone(),
            fused_id_of: BTreeMap::new(),
            sites: Vec::new(),
            changed,
        };
        match check(g, &collectives, &e, parallel) {
            Ok(()) => "ok".into(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn checks_in_halves_give_the_one_thread_result() {
        // Problems in both halves, in the first only, in the second only, in none.
        let (g, nodes) = graph(6, false);
        let cases = [
            nodes.clone(),
            vec![nodes[1], nodes[0], nodes[2], nodes[4]],
            vec![nodes[0], nodes[2], nodes[3], nodes[4]],
            vec![nodes[0], nodes[2], nodes[4]],
        ];
        for changed in cases {
            let one = checked(&g, changed.clone(), false);
            assert_eq!(checked(&g, changed.clone(), true), one);
            let bad: Vec<&str> = changed
                .iter()
                .map(|&n| g.node(n).id.as_str())
                .filter(|id| id.starts_with("bad"))
                .collect();
            assert_eq!(one == "ok", bad.is_empty(), "{one}");
            for id in bad {
                assert!(one.contains(id), "{one} names {id}");
            }
        }
        // A collective the input did not have: the collectives' error, before any
        // node's.
        let (g, nodes) = graph(4, true);
        let one = checked(&g, nodes.clone(), false);
        assert_eq!(checked(&g, nodes, true), one);
        assert!(one.contains("0 collectives in, 1 out"), "{one}");
    }
}
