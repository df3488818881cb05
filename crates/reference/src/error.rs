//! Errors of the reference crate.

use thiserror::Error;

/// Every failure of the reference evaluator, the numerics helpers and the
/// equivalence check. Nothing in this crate panics on bad input: it returns
/// one of these.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum ReferenceError {
    /// A shape argument of a numerics helper is not acceptable (zero, not a
    /// multiple of the block or group size, slice length mismatch, ...).
    #[error("invalid shape: {0}")]
    InvalidShape(String),

    /// A byte or element count overflowed `u64`/`usize` (checked arithmetic).
    #[error("size overflow while computing {0}")]
    SizeOverflow(&'static str),

    /// A scalar parameter is not acceptable (for example a non-finite or
    /// non-positive quantisation scale).
    #[error("invalid parameter: {0}")]
    InvalidParameter(String),

    /// The graph contains an op the reference cannot evaluate (an opaque op).
    #[error("node {node}: op `{op}` is opaque and cannot be evaluated by the reference")]
    OpaqueOp {
        /// Id (or name) of the node.
        node: String,
        /// Name of the op.
        op: String,
    },

    /// A tensor would exceed the element budget of the reference
    /// ([`crate::eval::MAX_TENSOR_ELEMENTS`]).
    #[error("node {node}: tensor of {elements} elements exceeds the reference budget of {budget} elements")]
    TensorTooLarge {
        /// Id (or name) of the node producing the tensor.
        node: String,
        /// Requested element count (saturated at `u64::MAX`).
        elements: u64,
        /// The budget.
        budget: u64,
    },

    /// [`crate::check_equivalent`] evaluates whole graphs; this one has a tensor above
    /// the reference's budget (a real model's embedding table, or its activations at a
    /// large T). [`crate::check_sites`] checks each fused site on its own instead.
    #[error("node {node}: a tensor of {elements} elements is above the reference budget of {budget}: the graph is too big to check whole; check it site by site with check_sites (`cargo xtask lower --check`)")]
    GraphTooLarge {
        /// Id of the node producing the tensor.
        node: String,
        /// Requested element count (saturated at `u64::MAX`).
        elements: u64,
        /// The budget.
        budget: u64,
    },

    /// A node could not be evaluated (bad operand shapes, dtypes, missing
    /// attributes, unbound symbol, ...). The message names the node.
    #[error("node {node}: {message}")]
    Eval {
        /// Id (or name) of the node.
        node: String,
        /// What went wrong.
        message: String,
    },

    /// The two graphs given to `check_equivalent` cannot be compared
    /// (different inputs or output counts, ...).
    #[error("graphs are not comparable: {0}")]
    NotComparable(String),

    /// An error reported by the IR crate.
    #[error("IR error: {0}")]
    Ir(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, ReferenceError>;
