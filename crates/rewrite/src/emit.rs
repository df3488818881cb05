//! E-graph -> IR: the input graph with every fused site's chain replaced by one fused
//! node (plus the views its boundary needs), in a deterministic topological order.
//!
//! Untouched nodes keep their ids, ops and types; graph inputs and the order of the
//! graph outputs are preserved. The fused node of all-reduce `a` is `fused.a` (made
//! unique with `.2`, `.3`, ... if taken), views are `fused.a.<output>.view` and the
//! residual view is `fused.a.residual_in`.

use crate::error::LowerError;
use crate::plan::SiteDecision;
use crate::site::{Input, Port, Site};
use crate::uses::Uses;
use arfuse_ir::op::{FusedAllReduceNorm, FusedOutput, FusedPlan, NormRounding};
use arfuse_ir::{DType, Graph, Node, NodeId, Op, SiteMap, TensorType, Value};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashSet};

/// What [`emit_checked`] returns.
pub(crate) struct Emitted {
    /// The output graph (validated).
    pub graph: Graph,
    /// The fused node's id in the output, by all-reduce instance, for every site fused.
    pub fused_id_of: BTreeMap<u32, String>,
    /// Fused nodes already in the input.
    pub fused_before: usize,
    /// What each fused node added here replaced, in all-reduce (graph) order.
    pub sites: Vec<SiteMap>,
}

/// Step 5 of the pass, emit and check: every chosen site the policy fuses becomes one
/// fused node carrying its plan; then every original all-reduce must appear exactly
/// once in the result (kept, or inside one fused node), the collective count must
/// match, and the result must validate: every node it added or rewired is checked
/// ([`Graph::validate_nodes`]); every other node is as it was in the validated input,
/// reading values of the same types.
///
/// Errors: [`LowerError::Internal`] when one of these checks fails (a bug).
pub(crate) fn emit_checked(
    g: &Graph,
    uses: &Uses,
    instances: &[u32],
    chosen: &mut BTreeMap<u32, Site>,
    decisions: &BTreeMap<(DType, u64), SiteDecision>,
    group: &str,
) -> Result<Emitted, LowerError> {
    let mut emits = Vec::new();
    for s in chosen.values() {
        let h = s.hidden().unwrap_or(0);
        let Some(d) = decisions.get(&(s.x_ty.dtype, h)) else {
            continue;
        };
        let (true, Some(mut plan)) = (d.fused, d.plan.clone()) else {
            continue;
        };
        plan.pattern_code = s.pattern_code();
        emits.push(Emit {
            site: s,
            plan: Some(plan),
            group,
        });
    }
    let emitted: Vec<u32> = emits.iter().map(|e| e.site.inst).collect();
    let (out, changed, fused_ids) = emit(g, uses, emits)?;
    let mut sites = Vec::with_capacity(emitted.len());
    for (inst, fid) in emitted.iter().zip(&fused_ids) {
        let mut map = chosen
            .get_mut(inst)
            .and_then(|s| s.map.take())
            .ok_or_else(|| LowerError::Internal("a fused site has no site map".into()))?;
        map.fused_node = fid.clone();
        sites.push(map);
    }
    let fused_id_of: BTreeMap<u32, String> = emitted.into_iter().zip(fused_ids).collect();
    let fused_before = check_collectives(g, &out, instances, &fused_id_of)?;
    // The input validated; a node that is not new and reads no new node's value has
    // the checks it had there.
    out.validate_nodes(changed)
        .map_err(|p| LowerError::Internal(format!("the rewritten graph fails validation: {p}")))?;
    Ok(Emitted {
        graph: out,
        fused_id_of,
        fused_before,
        sites,
    })
}

/// Every original all-reduce appears exactly once in `out`: kept as is, or in one
/// fused node; and the collectives of `out` are those of `g`, counted. Returns the
/// number of fused nodes already in `g`.
fn check_collectives(
    g: &Graph,
    out: &Graph,
    instances: &[u32],
    fused: &BTreeMap<u32, String>,
) -> Result<usize, LowerError> {
    // The all-reduces of the output, by the input node of the same id.
    let mut kept = vec![false; g.len()];
    for (_, n) in out.nodes() {
        if matches!(n.op, Op::AllReduce { .. }) {
            if let Some(i) = g.find(&n.id) {
                kept[i.index()] = true;
            }
        }
    }
    for &inst in instances {
        let id = g.node(NodeId::new(inst as usize)).id.as_str();
        let kept = kept[inst as usize];
        let fused = fused.contains_key(&inst);
        if kept == fused {
            return Err(LowerError::Internal(format!(
                "all-reduce `{id}` appears {} times in the result",
                usize::from(kept) + usize::from(fused)
            )));
        }
    }
    let fused_before = g
        .nodes()
        .filter(|(_, n)| matches!(n.op, Op::FusedAllreduceNorm(_)))
        .count();
    let collectives_after = out.nodes().filter(|(_, n)| n.op.is_collective()).count();
    if collectives_after != instances.len() + fused_before {
        return Err(LowerError::Internal(format!(
            "{} collectives in, {collectives_after} out",
            instances.len() + fused_before
        )));
    }
    Ok(fused_before)
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
    id: String,
    op: Op,
    inputs: Vec<Ref>,
    outputs: Vec<TensorType>,
    module: Option<String>,
    /// Its place in the output order: (node index, 0) for a kept node; for the nodes
    /// of the site of all-reduce `a`: (a, 1) an input view, (a, 2) the fused node,
    /// (a, 3 + k) a view of its output k.
    key: (u32, u32),
}

/// An output of a pending node: (pending index, output). Pending indices fit a u32:
/// a graph has at most `MAX_NODES` nodes and a site adds a handful. The layout of a
/// [`Value`], so a node's inputs become its values in place.
type Ref = (u32, u32);

/// The output graph being assembled: the kept nodes and the sites' new nodes, before
/// ids are resolved. Every table is flat, by node index or flat value index.
struct Builder<'g> {
    g: &'g Graph,
    uses: &'g Uses,
    /// Nodes some site replaces, by node index.
    removed: Vec<bool>,
    /// Ids given to new nodes so far.
    new_ids: HashSet<String>,
    pending: Vec<Pending>,
    /// The pending index of every kept node, by node index.
    slot_of: Vec<Option<usize>>,
    /// Where each replaced value now comes from, by flat value index.
    remap: Vec<Option<Ref>>,
    /// Kept nodes (pending indices) that read a remapped value.
    rewired: Vec<usize>,
}

/// The inputs of one fused node, resolved once every remap is known: (pending index
/// of the fused node, its inputs, whether its residual input is a view).
type FusedInputs = (usize, Vec<Input>, Option<Value>);

/// The output graph, its nodes that are new or rewired, and the fused node ids (in
/// site order).
fn emit(
    g: &Graph,
    uses: &Uses,
    mut sites: Vec<Emit<'_>>,
) -> Result<(Graph, Vec<NodeId>, Vec<String>), LowerError> {
    let mut b = Builder::new(g, uses, &sites);
    let (fused_ids, fused_inputs) = b.add_sites(&mut sites);
    b.wire_kept()?;
    b.wire_fused(fused_inputs)?;
    let outputs = g
        .outputs()
        .iter()
        .map(|v| b.resolve(*v))
        .collect::<Result<Vec<_>, _>>()?;
    let order = b.order()?;
    let (out, changed) = b.into_graph(&order, &outputs)?;
    Ok((out, changed, fused_ids))
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
            slot_of: vec![None; g.len()],
            remap: vec![None; uses.values()],
            rewired: Vec::new(),
        };
        for (i, n) in g.nodes() {
            let idx = i.index() as u32;
            if b.removed[i.index()] || b.is_dead_constant(idx, n) {
                continue;
            }
            b.slot_of[i.index()] = Some(b.pending.len());
            b.pending.push(Pending {
                id: n.id.clone(),
                op: n.op.clone(),
                inputs: Vec::new(),
                outputs: n.outputs.clone(),
                module: n.module.clone(),
                key: (idx, 0),
            });
        }
        b
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

    /// Where value `v` of the input comes from in the output.
    fn resolve(&self, v: Value) -> Result<Ref, LowerError> {
        if let Some(r) = self.uses.flat(v).and_then(|i| self.remap[i]) {
            return Ok(r);
        }
        self.slot_of
            .get(v.node.index())
            .copied()
            .flatten()
            .map(|s| (s as u32, v.output))
            .ok_or_else(|| {
                LowerError::Internal(format!(
                    "value {} is read but its node was removed",
                    self.g.value_ref(v)
                ))
            })
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
            let fslot = self.pending.len();
            let mut ins = vec![s.x_input()];
            ins.extend(s.residual.iter().cloned());
            ins.push(s.weight.clone());
            ins.extend(s.scale.iter().cloned());
            self.pending.push(Pending {
                id: fid.clone(),
                op: Op::FusedAllreduceNorm(Box::new(fused_op(e))),
                inputs: Vec::new(),
                outputs: s.ports.iter().map(|p| p.ty.clone()).collect(),
                module: s.module.clone(),
                key: (s.inst, 2),
            });
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
                    let id = self.fresh(format!("{base}.{name}.view"));
                    let slot = self.pending.len();
                    self.pending.push(Pending {
                        id,
                        op: Op::Reshape,
                        inputs: vec![(fslot as u32, k as u32)],
                        outputs: vec![t.clone()],
                        module: e.site.module.clone(),
                        key: (e.site.inst, 3 + k as u32),
                    });
                    by_type.insert(key, slot);
                    slot
                }
            };
            self.remap(*v, (slot as u32, 0));
        }
    }

    /// The inputs of every kept node.
    fn wire_kept(&mut self) -> Result<(), LowerError> {
        for (i, n) in self.g.nodes() {
            let Some(slot) = self.slot_of[i.index()] else {
                continue;
            };
            let ins = n
                .inputs
                .iter()
                .map(|v| self.resolve(*v))
                .collect::<Result<Vec<_>, _>>()?;
            let moved = n
                .inputs
                .iter()
                .zip(&ins)
                .any(|(v, r)| self.slot_of[v.node.index()] != Some(r.0 as usize));
            if moved {
                self.rewired.push(slot);
            }
            self.pending[slot].inputs = ins;
        }
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
                        if let [(inner, k)] = self.pending[src.0 as usize].inputs[..] {
                            if matches!(self.pending[src.0 as usize].op, Op::Reshape)
                                && matches!(
                                    self.pending[inner as usize].op,
                                    Op::FusedAllreduceNorm(_)
                                )
                                && self.pending[inner as usize].outputs.get(k as usize) == Some(&t)
                            {
                                refs.push((inner, k));
                                continue;
                            }
                        }
                        let what = if residual_view == Some(v) {
                            "residual_in"
                        } else {
                            "input_view"
                        };
                        let id = self.fresh(format!("{}.{what}", self.pending[fslot].id));
                        let slot = self.pending.len();
                        self.pending.push(Pending {
                            id,
                            op: Op::Reshape,
                            inputs: vec![src],
                            outputs: vec![t],
                            module: self.pending[fslot].module.clone(),
                            key: (self.pending[fslot].key.0, 1),
                        });
                        refs.push((slot as u32, 0));
                    }
                }
            }
            self.pending[fslot].inputs = refs;
        }
        Ok(())
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
            indeg[i] = p.inputs.len() as u32;
            for &(src, _) in &p.inputs {
                succ_start[src as usize + 1] += 1;
            }
        }
        for i in 1..=n {
            succ_start[i] += succ_start[i - 1];
        }
        let mut fill = succ_start.clone();
        let mut succ = vec![0u32; succ_start[n] as usize];
        for (i, p) in self.pending.iter().enumerate() {
            for &(src, _) in &p.inputs {
                let src = src as usize;
                succ[fill[src] as usize] = i as u32;
                fill[src] += 1;
            }
        }
        // The kept nodes are in key order already; the new ones are sorted and merged.
        let kept = self.slot_of.iter().flatten().count();
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

    /// The output graph: the pending nodes in `order`, the outputs `outputs`; and its
    /// nodes that are new or read a value of a new node (the only ones whose checks can
    /// differ from the input's).
    fn into_graph(
        mut self,
        order: &[usize],
        outputs: &[Ref],
    ) -> Result<(Graph, Vec<NodeId>), LowerError> {
        let g = self.g;
        let mut out = Graph::new();
        for (name, r) in g.symbols() {
            out.set_symbol(name.clone(), *r);
        }
        out.set_metadata(g.metadata().cloned());
        let edges = self.pending.iter().map(|p| p.inputs.len()).sum();
        out.reserve(self.pending.len(), edges);
        let mut node_of: Vec<Option<NodeId>> = vec![None; self.pending.len()];
        for &i in order {
            // Each pending node is emitted once: move its parts instead of cloning them
            // (its inputs become values in the same allocation).
            let p = &mut self.pending[i];
            if p.inputs
                .iter()
                .any(|&(src, _)| node_of[src as usize].is_none())
            {
                return Err(LowerError::Internal("input emitted late".into()));
            }
            let inputs: Vec<Value> = std::mem::take(&mut p.inputs)
                .into_iter()
                .map(|(src, k)| Value::new(node_of[src as usize].unwrap_or_default(), k))
                .collect();
            let id = out
                .add_node(Node {
                    id: std::mem::take(&mut p.id),
                    op: std::mem::replace(&mut p.op, Op::Rsqrt),
                    inputs,
                    outputs: std::mem::take(&mut p.outputs),
                    module: p.module.take(),
                })
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
        let kept = self.slot_of.iter().flatten().count();
        let changed = self
            .rewired
            .iter()
            .copied()
            .chain(kept..self.pending.len())
            .filter_map(|i| node_of[i])
            .collect();
        Ok((out, changed))
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
        residual: s.kind.residual,
        quant: s.kind.quant.to_ir(),
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
