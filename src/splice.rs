//! Splicing a lowered graph back into the graph it was imported from.
//!
//! A graph compiler that hands arfuse its own graph (a torch.compile pass serializes its
//! FX graph, `docs/fx-graph-format.md`) gets back an arfuse [`Graph`], not its own
//! nodes. [`splice`] says what to change in the compiler's graph, in the compiler's
//! names (the torch tensor names [`crate::import::Imported::tensors`] records): for
//! every fused node, which tensors it reads, which tensors each of its outputs replaces
//! for the nodes that stay, and which tensors are no longer computed at all.
//!
//! The compiler then inserts one call per [`SpliceSite`] (reading [`SpliceSite::inputs`]),
//! redirects the readers of every tensor in [`SplicePort::replaces`] to the call's
//! output (and of every tensor in [`SplicePort::views`] to a reshape of it), and erases
//! the tensors of [`Splice::removed`] that have no readers left. `arfuse.torch.FusionPass`
//! (the Python package, `crates/python`) does exactly this.
//!
//! Shapes: a fused node's `norm` and `residual` outputs have the shape of its `x` input,
//! the quant outputs the shapes of the quant op's. Where the lowered graph reads a
//! fused output through a reshape (`fused.<ar>.<output>.view`), the tensor is listed in
//! `views`: a row-major reshape of the output to that tensor's shape. A fused input that
//! the lowered graph reshapes (`fused.<ar>.residual_in`, `.input_view`) is named by the
//! tensor before the reshape: the fused op reads its inputs as row-major `[tokens, H]`
//! rows, which a reshape does not change.

use arfuse_ir::op::FusedAllReduceNorm;
use arfuse_ir::{Graph, NodeId, Op, Value};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// How to change the compiler's graph: see the module documentation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Splice {
    /// One entry per fused node the lowering added, in the lowered graph's
    /// (topological) order: a site's inputs only name sites before it.
    pub sites: Vec<SpliceSite>,
    /// Fused nodes that cannot be spliced, with the reason (a fused input or a replaced
    /// tensor with no torch name, or a site reading one that cannot). Their chains stay
    /// as they are in the compiler's graph, unfused.
    pub skipped: Vec<SkippedSite>,
    /// Torch tensor names (sorted) whose values the lowered graph no longer computes:
    /// the chains of the fused sites, and every name forwarded to them (a
    /// `wait_tensor`). Erase the ones no reader is left for; a name of a skipped site
    /// keeps its readers and stays.
    pub removed: Vec<String>,
}

/// One fused node and how it replaces its chain.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SpliceSite {
    /// The fused node's id in the lowered graph (`fused.<all-reduce id>`).
    pub fused_node: String,
    /// The torch name of the all-reduce it replaces.
    pub all_reduce: String,
    /// Its attributes (group, eps, rounding, residual, quant, outputs, plan).
    pub attrs: FusedAllReduceNorm,
    /// One per fused input, in the IR's order: `x`, `residual` (when
    /// `attrs.residual`), `weight`, then the static FP8 `scale` or NVFP4
    /// `global_scale`.
    pub inputs: Vec<SpliceInput>,
    /// One per entry of `attrs.outputs`, in that order.
    pub outputs: Vec<SplicePort>,
}

/// What a fused input reads.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpliceInput {
    /// A tensor of the compiler's graph, by its torch name.
    Tensor(String),
    /// Output `output` (an index into that site's outputs) of an earlier site, by its
    /// index in [`Splice::sites`].
    Site {
        /// Index of the site in [`Splice::sites`].
        site: usize,
        /// Index into that site's `outputs`.
        output: usize,
    },
}

/// One output of a fused node.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SplicePort {
    /// Which output (`norm`, `residual`, `quant`, `scale`).
    pub output: arfuse_ir::op::FusedOutput,
    /// Torch names (sorted) whose readers now read this output: every name bound to a
    /// value that a node kept by the lowering (or a graph output) read and now reads
    /// from here.
    pub replaces: Vec<String>,
    /// Torch names (sorted) whose readers now read this output reshaped (row-major) to
    /// that tensor's shape.
    pub views: Vec<String>,
}

/// A fused node [`splice`] could not express in torch names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SkippedSite {
    /// The fused node's id in the lowered graph.
    pub fused_node: String,
    /// Why, naming the IR node.
    pub reason: String,
}

/// Why [`splice`] gave no result: the lowered graph is not a lowering of `original`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpliceError {
    /// A node kept by the lowering (same id and op) reads something other than what it
    /// read in the original graph, and not a fused output either.
    #[error("node `{node}` input {input}: the lowered graph reads {found}, the original read {expected}; the lowered graph is not a lowering of this graph")]
    Mismatch {
        /// The node id.
        node: String,
        /// The input position.
        input: usize,
        /// What the lowered graph reads.
        found: String,
        /// What the original graph read.
        expected: String,
    },
    /// The graphs have different numbers of outputs, or a node new in the lowered
    /// graph is neither a fused node nor a reshape of a fused output or input.
    #[error("the lowered graph is not a lowering of this graph: {0}")]
    Shape(String),
}

/// What a value of the lowered graph stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Meaning {
    /// A value of the original graph (a kept node's output).
    Original(Value),
    /// Output `k` of the fused node at this lowered id.
    Port(NodeId, u32),
    /// A reshape of output `k` of a fused node.
    PortView(NodeId, u32),
    /// A reshape of an original value (a fused input's view).
    OriginalView(Value),
}

/// Computes the splice of `lowered` (from `arfuse::lower` of `original`) into the
/// compiler's graph whose torch names `tensors` maps onto `original`'s values
/// ([`crate::import::Imported::tensors`]).
///
/// Errors: [`SpliceError`] when `lowered` is not a lowering of `original` (a kept node
/// whose inputs changed to something other than a fused output, a differing number of
/// graph outputs, or a new node that is neither fused nor a reshape).
pub fn splice(
    original: &Graph,
    tensors: &BTreeMap<String, Value>,
    lowered: &Graph,
) -> Result<Splice, SpliceError> {
    let mut names_of: HashMap<Value, Vec<&str>> = HashMap::new();
    for (name, v) in tensors {
        names_of.entry(*v).or_default().push(name);
    }
    let meaning = meanings(original, lowered)?;
    let ports = replaced_by_ports(original, lowered, &meaning)?;
    let removed = removed_names(original, lowered, &names_of);

    let mut sites: Vec<SpliceSite> = Vec::new();
    let mut skipped: Vec<SkippedSite> = Vec::new();
    // Lowered fused node -> its index in `sites`.
    let mut site_of: HashMap<NodeId, usize> = HashMap::new();
    for (id, n) in lowered.nodes() {
        let Op::FusedAllreduceNorm(attrs) = &n.op else {
            continue;
        };
        if matches!(meaning.get(&Value::new(id, 0)), Some(Meaning::Original(_))) {
            continue; // a fused node already in the input
        }
        match site(
            original, lowered, id, attrs, &meaning, &names_of, &site_of, &ports,
        ) {
            Ok(s) => {
                site_of.insert(id, sites.len());
                sites.push(s);
            }
            Err(reason) => skipped.push(SkippedSite {
                fused_node: n.id.clone(),
                reason,
            }),
        }
    }
    Ok(Splice {
        sites,
        skipped,
        removed,
    })
}

/// What every output of every lowered node stands for.
fn meanings(original: &Graph, lowered: &Graph) -> Result<HashMap<Value, Meaning>, SpliceError> {
    let mut meaning: HashMap<Value, Meaning> = HashMap::new();
    for (id, n) in lowered.nodes() {
        let kept = original
            .find(&n.id)
            .filter(|&o| original.node(o).op == n.op && original.node(o).outputs == n.outputs);
        if let Some(o) = kept {
            for k in 0..n.outputs.len() as u32 {
                meaning.insert(Value::new(id, k), Meaning::Original(Value::new(o, k)));
            }
            continue;
        }
        match (&n.op, n.inputs.as_slice()) {
            (Op::FusedAllreduceNorm(_), _) => {
                for k in 0..n.outputs.len() as u32 {
                    meaning.insert(Value::new(id, k), Meaning::Port(id, k));
                }
            }
            (Op::Reshape, [src]) => {
                let m = match meaning.get(src) {
                    Some(Meaning::Port(f, k)) => Meaning::PortView(*f, *k),
                    Some(Meaning::Original(v)) => Meaning::OriginalView(*v),
                    _ => {
                        return Err(SpliceError::Shape(format!(
                            "node `{}` reshapes neither a fused output nor an original value",
                            n.id
                        )))
                    }
                };
                meaning.insert(Value::new(id, 0), m);
            }
            _ => {
                return Err(SpliceError::Shape(format!(
                    "node `{}` ({}) is not in the original graph",
                    n.id,
                    n.op.name()
                )))
            }
        }
    }
    Ok(meaning)
}

/// For each fused output (lowered node, output): the original values that kept nodes
/// and graph outputs read and now read from it, directly (`false`) or reshaped (`true`).
type PortReaders = HashMap<(NodeId, u32), BTreeSet<(bool, Value)>>;

fn replaced_by_ports(
    original: &Graph,
    lowered: &Graph,
    meaning: &HashMap<Value, Meaning>,
) -> Result<PortReaders, SpliceError> {
    let mut ports: PortReaders = HashMap::new();
    let mut record =
        |place: String, input: usize, found: Value, expected: Value| match meaning.get(&found) {
            Some(Meaning::Original(v)) if *v == expected => Ok(()),
            Some(Meaning::Port(f, k)) => {
                ports.entry((*f, *k)).or_default().insert((false, expected));
                Ok(())
            }
            Some(Meaning::PortView(f, k)) => {
                ports.entry((*f, *k)).or_default().insert((true, expected));
                Ok(())
            }
            _ => Err(SpliceError::Mismatch {
                node: place,
                input,
                found: lowered.value_ref(found),
                expected: original.value_ref(expected),
            }),
        };
    for (id, n) in lowered.nodes() {
        let Some(Meaning::Original(o)) = meaning.get(&Value::new(id, 0)).copied() else {
            continue;
        };
        let before = original.node(o.node);
        for (i, (&now, &then)) in n.inputs.iter().zip(&before.inputs).enumerate() {
            record(n.id.clone(), i, now, then)?;
        }
    }
    if lowered.outputs().len() != original.outputs().len() {
        return Err(SpliceError::Shape(format!(
            "{} graph outputs, the original has {}",
            lowered.outputs().len(),
            original.outputs().len()
        )));
    }
    for (j, (&now, &then)) in lowered.outputs().iter().zip(original.outputs()).enumerate() {
        record(format!("outputs[{j}]"), j, now, then)?;
    }
    Ok(ports)
}

/// The names bound to values of original nodes the lowered graph no longer has.
fn removed_names(
    original: &Graph,
    lowered: &Graph,
    names_of: &HashMap<Value, Vec<&str>>,
) -> Vec<String> {
    let mut removed: BTreeSet<String> = BTreeSet::new();
    for (id, n) in original.nodes() {
        let kept = lowered
            .find(&n.id)
            .is_some_and(|l| lowered.node(l).op == n.op && lowered.node(l).outputs == n.outputs);
        if kept {
            continue;
        }
        for k in 0..n.outputs.len() as u32 {
            for name in names_of.get(&Value::new(id, k)).into_iter().flatten() {
                removed.insert(name.to_string());
            }
        }
    }
    removed.into_iter().collect()
}

/// The splice of one fused node, or why it cannot be expressed in torch names.
#[allow(clippy::too_many_arguments)]
fn site(
    original: &Graph,
    lowered: &Graph,
    id: NodeId,
    attrs: &FusedAllReduceNorm,
    meaning: &HashMap<Value, Meaning>,
    names_of: &HashMap<Value, Vec<&str>>,
    site_of: &HashMap<NodeId, usize>,
    ports: &PortReaders,
) -> Result<SpliceSite, String> {
    let n = lowered.node(id);
    // The primary torch name of an original value: the one equal to its node's id, else
    // the first in name order.
    let name_of = |v: Value| -> Option<String> {
        let names = names_of.get(&v)?;
        let own = &original.node(v.node).id;
        Some(
            names
                .iter()
                .find(|s| **s == own.as_str())
                .or_else(|| names.first())?
                .to_string(),
        )
    };
    let all_reduce =
        n.id.strip_prefix("fused.")
            .and_then(|ar| original.find(ar))
            .and_then(|ar| name_of(Value::new(ar, 0)))
            .ok_or_else(|| format!("fused node `{}`: its all-reduce has no torch name", n.id))?;
    let mut inputs = Vec::with_capacity(n.inputs.len());
    for (i, v) in n.inputs.iter().enumerate() {
        let input = match meaning.get(v) {
            Some(Meaning::Original(o)) | Some(Meaning::OriginalView(o)) => {
                name_of(*o).map(SpliceInput::Tensor).ok_or_else(|| {
                    format!(
                        "fused node `{}` input {i} reads {}, which no torch tensor names",
                        n.id,
                        original.value_ref(*o)
                    )
                })?
            }
            Some(Meaning::Port(f, k)) | Some(Meaning::PortView(f, k)) => {
                let site = site_of.get(f).copied().ok_or_else(|| {
                    format!(
                        "fused node `{}` input {i} reads fused node `{}`, which is skipped",
                        n.id,
                        lowered.node(*f).id
                    )
                })?;
                SpliceInput::Site {
                    site,
                    output: *k as usize,
                }
            }
            None => return Err(format!("fused node `{}` input {i} is unknown", n.id)),
        };
        inputs.push(input);
    }
    let mut outputs = Vec::with_capacity(attrs.outputs.len());
    for (k, &output) in attrs.outputs.iter().enumerate() {
        let mut replaces: BTreeSet<String> = BTreeSet::new();
        let mut views: BTreeSet<String> = BTreeSet::new();
        for &(is_view, v) in ports.get(&(id, k as u32)).into_iter().flatten() {
            let names = names_of.get(&v).filter(|l| !l.is_empty()).ok_or_else(|| {
                format!(
                    "fused node `{}` output {} replaces {}, which no torch tensor names",
                    n.id,
                    output_name(output),
                    original.value_ref(v)
                )
            })?;
            let into = if is_view { &mut views } else { &mut replaces };
            into.extend(names.iter().map(|s| s.to_string()));
        }
        outputs.push(SplicePort {
            output,
            replaces: replaces.into_iter().collect(),
            views: views.into_iter().collect(),
        });
    }
    Ok(SpliceSite {
        fused_node: n.id.clone(),
        all_reduce,
        attrs: attrs.clone(),
        inputs,
        outputs,
    })
}

fn output_name(o: arfuse_ir::op::FusedOutput) -> &'static str {
    use arfuse_ir::op::FusedOutput;
    match o {
        FusedOutput::Norm => "norm",
        FusedOutput::Residual => "residual",
        FusedOutput::Quant => "quant",
        FusedOutput::Scale => "scale",
    }
}
