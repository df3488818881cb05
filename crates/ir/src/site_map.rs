//! What a fused node of a lowered graph replaced in the graph it was lowered from.
//!
//! The pass (`arfuse-rewrite`) returns one [`SiteMap`] per fused node it adds; the
//! per-site equivalence check (`arfuse-reference`'s `check_sites`) uses it to cut each
//! chain out of the original graph and the fused node out of the lowered graph and to
//! compare the two in isolation. Values of the original graph are named by node id and
//! output index ([`NodeOutput`]), never by [`crate::NodeId`], so a map stays meaningful
//! next to a graph reloaded from JSON.

use crate::op::FusedOutput;
use crate::{Graph, TensorType, Value};

/// One output of a node, by the node's id: `node` alone in the JSON format when
/// `output` is 0, `node:output` otherwise.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeOutput {
    /// The node's id.
    pub node: String,
    /// The output index.
    pub output: u32,
}

impl NodeOutput {
    /// The node output `v` of `graph`, by id.
    pub fn of(graph: &Graph, v: Value) -> NodeOutput {
        NodeOutput {
            node: graph.node(v.node).id.clone(),
            output: v.output,
        }
    }

    /// The value this names in `graph`, when its node exists and has that output.
    pub fn resolve(&self, graph: &Graph) -> Option<Value> {
        let id = graph.find(&self.node)?;
        (self.output < graph.node(id).outputs.len() as u32).then(|| Value::new(id, self.output))
    }
}

impl std::fmt::Display for NodeOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.output == 0 {
            write!(f, "{}", self.node)
        } else {
            write!(f, "{}:{}", self.node, self.output)
        }
    }
}

/// What one input of a fused node reads, in the original graph.
#[derive(Clone, Debug, PartialEq)]
pub struct SiteInput {
    /// The original value.
    pub value: NodeOutput,
    /// The type the fused node reads it as, when the lowered graph reshapes it first
    /// (row-major, same elements); `None` when it is read as it is.
    pub view: Option<TensorType>,
}

/// One output of a fused node and the original values it replaces.
#[derive(Clone, Debug, PartialEq)]
pub struct SiteOutput {
    /// Which output.
    pub output: FusedOutput,
    /// The original values whose readers now read this output, in the output's own
    /// type or (where the type differs) through a row-major reshape to theirs.
    pub replaces: Vec<NodeOutput>,
}

/// One fused site: the fused node of the lowered graph and the chain of the original
/// graph it replaces.
#[derive(Clone, Debug, PartialEq)]
pub struct SiteMap {
    /// The fused node's id in the lowered graph.
    pub fused_node: String,
    /// The all-reduce's node id in the original graph.
    pub all_reduce: String,
    /// Ids of the original nodes the site removed (its chain), in graph order.
    pub replaced_nodes: Vec<String>,
    /// One per fused input, in the IR's input order (`x`, `residual` when present,
    /// `weight`, then `scale` / `global_scale`).
    pub inputs: Vec<SiteInput>,
    /// One per fused output, in the fused node's output order.
    pub outputs: Vec<SiteOutput>,
}
