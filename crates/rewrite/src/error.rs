//! The one error type of the pass.

use thiserror::Error;

/// Why [`crate::lower`] returned no graph. The pass never returns a partial result.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LowerError {
    /// The input graph failed [`arfuse_ir::Graph::validate`]; every problem is listed
    /// with its node id.
    #[error("the input graph is invalid: {0}")]
    InvalidGraph(arfuse_ir::Problems),
    /// No layer group was given and the graph's all-reduces use several groups equally
    /// often.
    #[error(
        "the graph's all-reduces use the groups {candidates:?} equally often ({count} each); \
         name the layer's tensor-parallel group (LowerOptions::group, or `--group NAME` of \
         `cargo xtask lower`)"
    )]
    AmbiguousGroup {
        /// The tied groups, sorted.
        candidates: Vec<String>,
        /// All-reduces per tied group.
        count: usize,
    },
    /// The target is wrong (from `arfuse-policy`; the message names the fix).
    #[error("policy: {0}")]
    Policy(#[from] arfuse_policy::PolicyError),
    /// The e-graph runner stopped before saturation: the result would depend on the
    /// limits, so there is none.
    #[error(
        "the e-graph did not saturate: {reason} after {iterations} iteration(s), {nodes} \
         e-nodes; raise the limits in LowerOptions (iter_limit, node_limit)"
    )]
    NotSaturated {
        /// The runner's stop reason.
        reason: String,
        /// Iterations run.
        iterations: usize,
        /// E-nodes at the stop.
        nodes: usize,
    },
    /// The graph says which tensor-parallel size it was built for (metadata `tp` or
    /// `world_size`) and the target's all-reduce group size differs: every byte count of
    /// the plan would be wrong.
    #[error(
        "the graph was built for tensor-parallel size {graph} (its metadata), the target's \
         all-reduce group has world_size {target}: choose a target with world_size = {graph}"
    )]
    WorldSizeMismatch {
        /// The graph's tensor-parallel size.
        graph: u64,
        /// The target's world size.
        target: u32,
    },
    /// The graph already holds a fused node whose plan is not the one this target gets
    /// (another machine, size or backend): running it would trust a stale plan.
    #[error(
        "fused node `{node}` carries a plan that differs from this target's ({detail}); \
         lower the unfused graph for this target instead"
    )]
    StalePlan {
        /// The fused node's id.
        node: String,
        /// What differs.
        detail: String,
    },
    /// A bug in this crate: the result failed its own checks. Please report it with
    /// the graph.
    #[error("internal error in arfuse-rewrite: {0}")]
    Internal(String),
}
