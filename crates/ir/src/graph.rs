//! The graph: nodes with typed outputs, edges naming output indices.

use crate::id_index::IdIndex;
use crate::{Op, ProblemKind, Symbols, TensorType};
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use std::fmt;

/// Most nodes a graph may hold. The largest real decoder graphs (405B, 126 layers,
/// decomposed norms) have tens of thousands of nodes; the limit bounds memory on
/// hostile input.
pub const MAX_NODES: usize = 500_000;
/// Most inputs or outputs of one node (bounds memory on hostile input; real ops have
/// at most a few dozen).
pub const MAX_PORTS: usize = 1_024;
/// Most dimensions of one shape.
pub const MAX_RANK: usize = 8;
/// Longest node id, in bytes.
pub const MAX_ID_LEN: usize = 256;
/// Largest value a symbol's range may reach (`symbols.T.max`): 2^31 - 1, which is
/// also what the torch.export importer gives a dimension with no finite maximum. No
/// engine runs a token count or sequence length near it, and products of a few
/// symbols with a hidden size stay inside u64 byte counts.
pub const MAX_SYMBOL_VALUE: u64 = i32::MAX as u64;

/// Index of a node in a [`Graph`]. Indices are dense, in topological order.
pub type NodeId = NodeIndex<u32>;

/// One output of one node: the value an edge carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Value {
    /// Producer.
    pub node: NodeId,
    /// Output index of the producer.
    pub output: u32,
}

impl Value {
    /// Output `output` of `node`.
    pub fn new(node: NodeId, output: u32) -> Value {
        Value { node, output }
    }
}

/// Edge weight of the petgraph view: which producer output feeds which consumer input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Use {
    /// Output index of the producer.
    pub output: u32,
    /// Input position at the consumer.
    pub input: u32,
}

/// A node: a stable string id, an op, inputs and typed outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// Stable id, unique in the graph (no `:` and no whitespace).
    pub id: String,
    /// The operation.
    pub op: Op,
    /// Inputs, in the op's order.
    pub inputs: Vec<Value>,
    /// Output types, in order.
    pub outputs: Vec<TensorType>,
    /// Module path this node came from (e.g. `model.layers.1.mlp`), when known.
    pub module: Option<String>,
}

/// Error from building a graph by hand.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("node {id:?}: {message}")]
pub struct BuildError {
    /// The node being added.
    pub id: String,
    /// What is wrong.
    pub kind: ProblemKind,
    /// Details.
    pub message: String,
}

/// The metadata keys that record a graph's tensor-parallel size, in the order
/// [`Graph::recorded_world_size`] reads them.
pub(crate) const WORLD_SIZE_KEYS: [&str; 2] = ["world_size", "tp"];

/// A tensor graph. Nodes are stored in topological order: a node can only be added
/// after every node it reads, so a `Graph` is acyclic with valid references by
/// construction. Types are checked by [`Graph::validate`].
#[derive(Clone, Debug, Default)]
pub struct Graph {
    symbols: Symbols,
    g: DiGraph<Node, Use, u32>,
    /// Every node by its id.
    ids: IdIndex,
    outputs: Vec<Value>,
    metadata: Option<serde_json::Value>,
}

/// Why `id` is not a valid node id, if it is not.
pub fn check_node_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("node id is empty".into());
    }
    if id.len() > MAX_ID_LEN {
        return Err(format!("node id is longer than {MAX_ID_LEN} bytes"));
    }
    // ASCII ids (nearly all) byte by byte: the ASCII whitespace and control characters
    // are exactly the bytes up to 0x20 and 0x7f.
    let bad = if id.is_ascii() {
        id.bytes().any(|b| b == b':' || b <= b' ' || b == 0x7f)
    } else {
        id.chars()
            .any(|c| c == ':' || c.is_whitespace() || c.is_control())
    };
    if bad {
        return Err(format!(
            "node id {id:?} contains ':' , whitespace or a control character"
        ));
    }
    Ok(())
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Graph {
        Graph::default()
    }

    /// Declares (or replaces) a symbol and its range.
    pub fn set_symbol(&mut self, name: impl Into<String>, range: crate::SymbolRange) {
        self.symbols.insert(name.into(), range);
    }

    /// The declared symbols.
    pub fn symbols(&self) -> &Symbols {
        &self.symbols
    }

    /// Free-form metadata carried through load and save (model name, source, ...).
    pub fn metadata(&self) -> Option<&serde_json::Value> {
        self.metadata.as_ref()
    }

    /// True when `id` is the wait of a functional collective that forwards its input:
    /// an `opaque` op whose target is a wait ([`crate::op::is_wait_target`]) with one
    /// input and one output of the input's type. The pass sees through it; the
    /// per-site check evaluates it as the identity.
    pub fn is_forwarding_wait(&self, id: NodeId) -> bool {
        let n = self.node(id);
        match &n.op {
            Op::Opaque { target, .. } => {
                crate::op::is_wait_target(target)
                    && n.inputs.len() == 1
                    && n.outputs.len() == 1
                    && self.value_type(n.inputs[0]) == Some(&n.outputs[0])
            }
            _ => false,
        }
    }

    /// The tensor-parallel size the graph was built or exported for, when its metadata
    /// records one (key `world_size`, else `tp`; `arfuse-models` writes `tp`). In a valid
    /// graph it is an integer from 1 to `u32::MAX`, and the two keys agree
    /// ([`Graph::validate`]). Lowering and the runtime refuse another world size.
    pub fn recorded_world_size(&self) -> Option<u64> {
        let m = self.metadata.as_ref()?;
        WORLD_SIZE_KEYS
            .iter()
            .find_map(|k| m.get(*k).and_then(|v| v.as_u64()))
    }

    /// Sets the free-form metadata.
    pub fn set_metadata(&mut self, metadata: Option<serde_json::Value>) {
        self.metadata = metadata;
    }

    /// Adds a node after every node it reads.
    ///
    /// Errors: an invalid or duplicate id, an input naming a node or output index
    /// that does not exist, more than [`MAX_PORTS`] inputs or outputs, more than
    /// [`MAX_NODES`] nodes.
    pub fn add_node(&mut self, node: Node) -> Result<NodeId, BuildError> {
        let fail = |kind, message: String| BuildError {
            id: node.id.clone(),
            kind,
            message,
        };
        check_node_id(&node.id).map_err(|m| fail(ProblemKind::BadId, m))?;
        let hash = self.ids.hash(&node.id);
        let g = &self.g;
        let id_of = |n: NodeId| g.node_weight(n).map(|w| w.id.as_str());
        if self.ids.find(hash, &node.id, id_of).is_some() {
            return Err(fail(ProblemKind::DuplicateId, "duplicate node id".into()));
        }
        let n = self.add_node_unindexed(node)?;
        let g = &self.g;
        self.ids
            .insert_new(hash, n, |n: NodeId| g.node_weight(n).map(|w| w.id.as_str()));
        Ok(n)
    }

    /// [`Graph::add_node`] for a node whose id the caller has checked (valid, not in
    /// the graph) and indexes itself ([`Graph::set_id_index`]): every other check,
    /// with the same errors, and the node is not found by [`Graph::find`] until then.
    pub(crate) fn add_node_unindexed(&mut self, mut node: Node) -> Result<NodeId, BuildError> {
        let fail = |kind, message: String| BuildError {
            id: node.id.clone(),
            kind,
            message,
        };
        if self.g.node_count() >= MAX_NODES {
            return Err(fail(
                ProblemKind::Limit,
                format!("graph exceeds the limit of {MAX_NODES} nodes"),
            ));
        }
        if node.inputs.len() > MAX_PORTS || node.outputs.len() > MAX_PORTS {
            return Err(fail(
                ProblemKind::Limit,
                format!(
                    "{} inputs and {} outputs exceed the limit of {MAX_PORTS} per node",
                    node.inputs.len(),
                    node.outputs.len()
                ),
            ));
        }
        for (i, v) in node.inputs.iter().enumerate() {
            match self.g.node_weight(v.node) {
                None => {
                    return Err(fail(
                        ProblemKind::MissingInput,
                        format!("input {i} refers to a node that does not exist"),
                    ))
                }
                Some(p) if v.output as usize >= p.outputs.len() => {
                    return Err(fail(
                        ProblemKind::MissingInput,
                        format!(
                            "input {i} refers to output {} of {:?}, which has {} output(s)",
                            v.output,
                            p.id,
                            p.outputs.len()
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        let inputs = std::mem::take(&mut node.inputs);
        let n = self.g.add_node(node);
        // At most MAX_PORTS inputs (checked above): each position fits a u32.
        for (i, v) in (0u32..).zip(&inputs) {
            let w = Use {
                output: v.output,
                input: i,
            };
            self.g.add_edge(v.node, n, w);
        }
        self.g[n].inputs = inputs;
        Ok(n)
    }

    /// Replaces the id index with `ids`, which must name every node by its id (the
    /// loader's, built once while checking the file).
    pub(crate) fn set_id_index(&mut self, ids: IdIndex) {
        self.ids = ids;
    }

    /// Makes room for `nodes` more nodes and `edges` more edges (node inputs), so that
    /// adding them allocates nothing more for the graph's own tables (a loader, or a
    /// pass that rebuilds a graph, knows both).
    pub fn reserve(&mut self, nodes: usize, edges: usize) {
        self.g.reserve_nodes(nodes);
        self.g.reserve_edges(edges);
        let g = &self.g;
        self.ids
            .reserve(nodes, |n: NodeId| g.node_weight(n).map(|w| w.id.as_str()));
    }

    /// Sets the graph outputs. Errors when a value does not exist.
    pub fn set_outputs(&mut self, outputs: Vec<Value>) -> Result<(), BuildError> {
        for v in &outputs {
            let ok = self
                .g
                .node_weight(v.node)
                .is_some_and(|n| (v.output as usize) < n.outputs.len());
            if !ok {
                return Err(BuildError {
                    id: "<graph outputs>".into(),
                    kind: ProblemKind::MissingInput,
                    message: format!(
                        "graph output refers to a missing value (node index {}, output {})",
                        v.node.index(),
                        v.output
                    ),
                });
            }
        }
        self.outputs = outputs;
        Ok(())
    }

    /// Graph outputs, in order.
    pub fn outputs(&self) -> &[Value] {
        &self.outputs
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.g.node_count()
    }

    /// True when the graph has no nodes.
    pub fn is_empty(&self) -> bool {
        self.g.node_count() == 0
    }

    /// The node at `id`. Panics only if `id` came from another graph.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.g[id]
    }

    /// The node at `id`, or `None`.
    pub fn get(&self, id: NodeId) -> Option<&Node> {
        self.g.node_weight(id)
    }

    /// Looks a node up by its string id.
    pub fn find(&self, id: &str) -> Option<NodeId> {
        let g = &self.g;
        let id_of = |n: NodeId| g.node_weight(n).map(|w| w.id.as_str());
        self.ids.find(self.ids.hash(id), id, id_of)
    }

    /// All nodes in topological order.
    pub fn nodes(&self) -> impl Iterator<Item = (NodeId, &Node)> + '_ {
        self.g.node_indices().map(move |i| (i, &self.g[i]))
    }

    /// The type of a value, or `None` when it does not exist.
    pub fn value_type(&self, v: Value) -> Option<&TensorType> {
        self.g.node_weight(v.node)?.outputs.get(v.output as usize)
    }

    /// Every use of any output of `node`: (consumer, edge), in no particular order.
    pub fn users(&self, node: NodeId) -> impl Iterator<Item = (NodeId, Use)> + '_ {
        self.g
            .edges_directed(node, Direction::Outgoing)
            .map(|e| (e.target(), *e.weight()))
    }

    /// Number of consumers (node inputs and graph outputs) of one value.
    pub fn use_count(&self, v: Value) -> usize {
        self.users(v.node)
            .filter(|(_, u)| u.output == v.output)
            .count()
            + self.outputs.iter().filter(|o| **o == v).count()
    }

    /// The petgraph view (edges carry [`Use`]), for algorithms.
    pub fn petgraph(&self) -> &DiGraph<Node, Use, u32> {
        &self.g
    }

    /// Renders `v` as `id` or `id:N` (the JSON spelling).
    pub fn value_ref(&self, v: Value) -> String {
        let id = self
            .g
            .node_weight(v.node)
            .map(|n| n.id.as_str())
            .unwrap_or("<missing>");
        if v.output == 0 {
            id.to_string()
        } else {
            format!("{id}:{}", v.output)
        }
    }
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&crate::text::canonical_text(self))
    }
}
