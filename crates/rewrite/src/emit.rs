//! E-graph -> IR: the input graph with every fused site's chain replaced by one fused
//! node (plus the views its boundary needs), in a deterministic topological order.
//!
//! Untouched nodes keep their ids, ops and types; graph inputs and the order of the
//! graph outputs are preserved. The fused node of all-reduce `a` is `fused.a` (made
//! unique with `.2`, `.3`, ... if taken), views are `fused.a.<output>.view` and the
//! residual view is `fused.a.residual_in`.

use crate::error::LowerError;
use crate::plan::SiteDecision;
use crate::site::{Input, Site};
use arfuse_ir::op::{FusedAllReduceNorm, FusedOutput, FusedPlan, NormRounding};
use arfuse_ir::{
    DType, Graph, Node, NodeId, NodeOutput, Op, SiteInput, SiteMap, SiteOutput, TensorType, Value,
};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet};

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
/// match, and the result must validate.
///
/// Errors: [`LowerError::Internal`] when one of these checks fails (a bug).
pub(crate) fn emit_checked(
    g: &Graph,
    instances: &[u32],
    chosen: &BTreeMap<u32, Site>,
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
            plan,
            group: group.to_string(),
            module: s.module(g),
        });
    }
    let (out, fused_ids) = emit(g, &emits)?;
    let sites = emits
        .iter()
        .zip(&fused_ids)
        .map(|(e, fid)| site_map(g, e.site, fid))
        .collect();
    let fused_id_of: BTreeMap<u32, String> =
        emits.iter().map(|e| e.site.inst).zip(fused_ids).collect();
    let fused_before = check_collectives(g, &out, instances, &fused_id_of)?;
    out.validate()
        .map_err(|p| LowerError::Internal(format!("the rewritten graph fails validation: {p}")))?;
    Ok(Emitted {
        graph: out,
        fused_id_of,
        fused_before,
        sites,
    })
}

/// The site's chain as the original graph's ids: what `arfuse-reference`'s per-site
/// check cuts out.
fn site_map(g: &Graph, s: &Site, fused_node: &str) -> SiteMap {
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
    let mut inputs = vec![input(&s.x_input())];
    inputs.extend(s.residual.iter().map(input));
    inputs.push(input(&s.weight));
    inputs.extend(s.scale.iter().map(input));
    SiteMap {
        fused_node: fused_node.to_string(),
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

/// Every original all-reduce appears exactly once in `out`: kept as is, or in one
/// fused node; and the collectives of `out` are those of `g`, counted. Returns the
/// number of fused nodes already in `g`.
fn check_collectives(
    g: &Graph,
    out: &Graph,
    instances: &[u32],
    fused: &BTreeMap<u32, String>,
) -> Result<usize, LowerError> {
    let kept_ars: BTreeSet<&str> = out
        .nodes()
        .filter(|(_, n)| matches!(n.op, Op::AllReduce { .. }))
        .map(|(_, n)| n.id.as_str())
        .collect();
    for &inst in instances {
        let id = g.node(NodeId::new(inst as usize)).id.as_str();
        let kept = kept_ars.contains(id);
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
    /// The plan the fused node carries.
    pub plan: FusedPlan,
    /// The layer group.
    pub group: String,
    /// Its module.
    pub module: Option<String>,
}

/// A node of the output, before ids are resolved.
struct Pending {
    id: String,
    op: Op,
    inputs: Vec<Ref>,
    outputs: Vec<TensorType>,
    module: Option<String>,
    key: (u32, u32),
}

/// An output of a pending node: (pending index, output).
type Ref = (usize, u32);

/// The fused node ids, by all-reduce instance, and the output graph.
fn emit(g: &Graph, sites: &[Emit<'_>]) -> Result<(Graph, Vec<String>), LowerError> {
    // Flat tables by node index: every pass below is linear in the graph.
    let mut removed = vec![false; g.len()];
    for s in sites {
        for &n in &s.site.region {
            if let Some(r) = removed.get_mut(n as usize) {
                *r = true;
            }
        }
    }
    let is_removed = |i: u32| removed.get(i as usize).copied().unwrap_or(false);
    // Ids of kept nodes are borrowed, new ids owned.
    let kept_ids: HashSet<&str> = g
        .nodes()
        .filter(|(i, _)| !is_removed(i.index() as u32))
        .map(|(_, n)| n.id.as_str())
        .collect();
    let mut new_ids: HashSet<String> = HashSet::new();
    let mut fresh = |base: String| -> String {
        let mut id = base.clone();
        let mut k = 2;
        while kept_ids.contains(id.as_str()) || new_ids.contains(&id) {
            id = format!("{base}.{k}");
            k += 1;
        }
        new_ids.insert(id.clone());
        id
    };

    // Constants only the removed chains read are dropped with them.
    let outputs: HashSet<Value> = g.outputs().iter().copied().collect();
    let mut dead_consts = vec![false; g.len()];
    for (i, n) in g.nodes() {
        let idx = i.index() as u32;
        if !matches!(n.op, Op::Constant { .. }) || is_removed(idx) {
            continue;
        }
        let mut users = g.users(i).map(|(u, _)| u.index() as u32).peekable();
        if users.peek().is_some() && users.all(is_removed) && !outputs.contains(&Value::new(i, 0)) {
            dead_consts[i.index()] = true;
        }
    }

    let mut pending: Vec<Pending> = Vec::with_capacity(g.len() + 2 * sites.len());
    let mut slot_of: Vec<Option<usize>> = vec![None; g.len()];
    for (i, n) in g.nodes() {
        let idx = i.index() as u32;
        if is_removed(idx) || dead_consts[i.index()] {
            continue;
        }
        slot_of[i.index()] = Some(pending.len());
        pending.push(Pending {
            id: n.id.clone(),
            op: n.op.clone(),
            inputs: Vec::new(),
            outputs: n.outputs.clone(),
            module: n.module.clone(),
            key: (idx, 0),
        });
    }
    // Where each replaced value now comes from.
    let mut remap: HashMap<Value, Ref> = HashMap::new();
    let mut fused_ids = Vec::with_capacity(sites.len());
    // Inputs of fused nodes are resolved after every remap is known.
    let mut fused_inputs: Vec<(usize, Vec<Input>)> = Vec::new();
    let mut residual_views: Vec<(usize, Value)> = Vec::new();
    for e in sites {
        let s = e.site;
        let ar = g.node(NodeId::new(s.inst as usize));
        let base = format!("fused.{}", ar.id);
        let fid = fresh(base.clone());
        let fslot = pending.len();
        let mut ins = vec![s.x_input()];
        if let Some(r) = &s.residual {
            ins.push(r.clone());
        }
        ins.push(s.weight.clone());
        if let Some(sc) = &s.scale {
            ins.push(sc.clone());
        }
        let outputs: Vec<FusedOutput> = s.ports.iter().map(|p| p.output).collect();
        pending.push(Pending {
            id: fid.clone(),
            op: Op::FusedAllreduceNorm(FusedAllReduceNorm {
                group: e.group.clone(),
                eps: f64::from_bits(s.kind.eps),
                weight_bias: f64::from_bits(s.kind.bias),
                norm_rounding: if s.kind.twice {
                    NormRounding::Twice
                } else {
                    NormRounding::Once
                },
                residual: s.kind.residual,
                quant: s.kind.quant.to_ir(),
                outputs,
                plan: Some(e.plan.clone()),
            }),
            inputs: Vec::new(),
            outputs: s.ports.iter().map(|p| p.ty.clone()).collect(),
            module: e.module.clone(),
            key: (s.inst, 2),
        });
        fused_inputs.push((fslot, ins));
        for (k, p) in s.ports.iter().enumerate() {
            for v in &p.direct {
                remap.insert(*v, (fslot, k as u32));
            }
            // One view node per distinct type.
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
                        let slot = pending.len();
                        pending.push(Pending {
                            id: fresh(format!("{base}.{name}.view")),
                            op: Op::Reshape,
                            inputs: vec![(fslot, k as u32)],
                            outputs: vec![t.clone()],
                            module: e.module.clone(),
                            key: (s.inst, 3 + k as u32),
                        });
                        by_type.insert(key, slot);
                        slot
                    }
                };
                remap.insert(*v, (slot, 0));
            }
        }
        if let Some(Input::View(v, _)) = &s.residual {
            residual_views.push((fslot, *v));
        }
        fused_ids.push(fid);
    }
    let resolve = |v: Value, remap: &HashMap<Value, Ref>| -> Result<Ref, LowerError> {
        if let Some(r) = remap.get(&v) {
            return Ok(*r);
        }
        slot_of
            .get(v.node.index())
            .copied()
            .flatten()
            .map(|s| (s, v.output))
            .ok_or_else(|| {
                LowerError::Internal(format!(
                    "value {} is read but its node was removed",
                    g.value_ref(v)
                ))
            })
    };
    // Inputs of kept nodes.
    for (i, n) in g.nodes() {
        let Some(slot) = slot_of[i.index()] else {
            continue;
        };
        let ins = n
            .inputs
            .iter()
            .map(|v| resolve(*v, &remap))
            .collect::<Result<Vec<_>, _>>()?;
        pending[slot].inputs = ins;
    }
    // Inputs of fused nodes (views of an input get a reshape node).
    for (fslot, ins) in fused_inputs {
        let mut refs = Vec::with_capacity(ins.len());
        for inp in ins {
            match inp {
                Input::Value(v) => refs.push(resolve(v, &remap)?),
                Input::View(v, t) => {
                    let src = resolve(v, &remap)?;
                    // A view of a view of a fused output is that output.
                    if let [(inner, k)] = pending[src.0].inputs[..] {
                        if matches!(pending[src.0].op, Op::Reshape)
                            && matches!(pending[inner].op, Op::FusedAllreduceNorm(_))
                            && pending[inner].outputs.get(k as usize) == Some(&t)
                        {
                            refs.push((inner, k));
                            continue;
                        }
                    }
                    let base = pending[fslot].id.clone();
                    let key = (pending[fslot].key.0, 1);
                    let module = pending[fslot].module.clone();
                    let slot = pending.len();
                    let what = if residual_views.iter().any(|(f, rv)| *f == fslot && *rv == v) {
                        "residual_in"
                    } else {
                        "input_view"
                    };
                    pending.push(Pending {
                        id: fresh(format!("{base}.{what}")),
                        op: Op::Reshape,
                        inputs: vec![src],
                        outputs: vec![t],
                        module,
                        key,
                    });
                    refs.push((slot, 0));
                }
            }
        }
        pending[fslot].inputs = refs;
    }
    let graph_outputs = g
        .outputs()
        .iter()
        .map(|v| resolve(*v, &remap))
        .collect::<Result<Vec<_>, _>>()?;

    // Topological order, ties broken by the key (the original position).
    let n = pending.len();
    let mut indeg = vec![0usize; n];
    let mut succ: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, p) in pending.iter().enumerate() {
        for &(src, _) in &p.inputs {
            indeg[i] += 1;
            succ[src].push(i);
        }
    }
    let mut heap: BinaryHeap<Reverse<((u32, u32), usize)>> = pending
        .iter()
        .enumerate()
        .filter(|(i, _)| indeg[*i] == 0)
        .map(|(i, p)| Reverse((p.key, i)))
        .collect();
    let mut order = Vec::with_capacity(n);
    while let Some(Reverse((_, i))) = heap.pop() {
        order.push(i);
        for &s in &succ[i] {
            indeg[s] -= 1;
            if indeg[s] == 0 {
                heap.push(Reverse((pending[s].key, s)));
            }
        }
    }
    if order.len() != n {
        return Err(LowerError::Internal(
            "the rewritten graph has a cycle".to_string(),
        ));
    }
    let mut out = Graph::new();
    for (name, r) in g.symbols() {
        out.set_symbol(name.clone(), *r);
    }
    out.set_metadata(g.metadata().cloned());
    let mut node_of: Vec<Option<NodeId>> = vec![None; n];
    for i in order {
        let inputs = pending[i]
            .inputs
            .iter()
            .map(|&(src, k)| {
                node_of[src]
                    .map(|id| Value::new(id, k))
                    .ok_or_else(|| LowerError::Internal("input emitted late".into()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Each pending node is emitted once: move its parts instead of cloning them.
        let p = &mut pending[i];
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
    let outs = graph_outputs
        .iter()
        .map(|&(src, k)| {
            node_of[src]
                .map(|id| Value::new(id, k))
                .ok_or_else(|| LowerError::Internal("graph output missing".into()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    out.set_outputs(outs)
        .map_err(|e| LowerError::Internal(e.to_string()))?;
    Ok((out, fused_ids))
}

impl Site {
    /// The fused node's x input: the all-reduce's own input.
    pub(crate) fn x_input(&self) -> Input {
        Input::Value(self.x)
    }
}
