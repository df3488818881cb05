//! The one error type of the crate.
//!
//! Every fallible entry point returns [`PolicyError`]. Errors are for input that is
//! wrong (a zero world size, a hidden size no kernel can run, an explicit backend the
//! machine cannot run, arithmetic that would overflow `u64`). A machine on which the
//! fusion merely does not pay off is not an error: it gets a "no fusion" decision with
//! a reason (see [`crate::BackendDecision`]).

use thiserror::Error;

/// Everything that can go wrong while loading a target, planning or sizing.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// A field of [`crate::Target`] (or an argument) holds a value that cannot be right.
    #[error("invalid `{field}` = {value}: {reason}")]
    InvalidField {
        /// The field name as written in TOML (snake_case).
        field: &'static str,
        /// The offending value, rendered.
        value: String,
        /// Why it is rejected and what would be accepted.
        reason: String,
    },

    /// The TOML text could not be parsed into a [`crate::Target`].
    #[error("target TOML: {0}")]
    Toml(String),

    /// [`crate::Target::preset`] was given a name it does not know.
    #[error("unknown preset `{name}`; known presets: {known}")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// Comma-separated list of the known preset names.
        known: String,
    },

    /// No preset, or no single preset, has the world size asked for
    /// ([`crate::preset_for_world_size`]).
    #[error("{}", no_preset_message(*world_size, candidates, known))]
    NoPresetForWorldSize {
        /// The world size asked for.
        world_size: u32,
        /// Comma-separated presets with that world size when there are several (none of
        /// the default family), else empty.
        candidates: String,
        /// Comma-separated world sizes the presets cover.
        known: String,
    },

    /// `requested_backend = "trtllm"` on a group that spans more than one node.
    /// CUDA IPC handles cannot cross nodes ("invalid resource handle"); domain.md §3.
    #[error(
        "requested_backend = \"trtllm\" but the all-reduce group spans {nodes} nodes; trtllm \
         uses CUDA IPC peer buffers inside one node and fails across nodes with \"invalid \
         resource handle\". Fix: set requested_backend = \"mnnvl\" (needs SM 10.x, an NVLink \
         fabric across the nodes and multicast on every rank) or \"auto\""
    )]
    TrtllmAcrossNodes {
        /// Nodes the all-reduce group spans.
        nodes: u32,
    },

    /// An explicitly requested backend cannot run on this target.
    #[error("requested_backend = \"{requested}\" cannot run here: {reason}")]
    BackendUnavailable {
        /// The backend that was asked for.
        requested: String,
        /// Why it cannot run, and the fix.
        reason: String,
    },

    /// A hidden size that no fused kernel can run and that no real model has.
    #[error("hidden size {hidden}: {reason}")]
    InvalidHidden {
        /// Hidden size in elements.
        hidden: u64,
        /// Why it is rejected.
        reason: String,
    },

    /// A token count that is not valid for the question asked (for example T = 0).
    #[error("token count {t}: {reason}")]
    InvalidTokens {
        /// The token count.
        t: u64,
        /// Why it is rejected.
        reason: String,
    },

    /// A byte or token computation would overflow `u64`.
    #[error("arithmetic overflow computing {what}")]
    Overflow {
        /// The quantity being computed.
        what: &'static str,
    },

    /// A workspace given from outside does not match the target or plan.
    #[error("workspace does not match: {reason}")]
    WorkspaceMismatch {
        /// What differs, and the fix.
        reason: String,
    },

    /// A plan failed its own verification. This is a bug in arfuse-policy; the message
    /// lists every violation.
    #[error("internal error: the plan failed its own verification: {details}")]
    Internal {
        /// The violations, one per line.
        details: String,
    },
}

/// The text of [`PolicyError::NoPresetForWorldSize`].
fn no_preset_message(world_size: u32, candidates: &str, known: &str) -> String {
    if candidates.is_empty() {
        format!(
            "no preset has world_size {world_size} (the presets have {known}); pass --target \
             with a TOML file for this machine"
        )
    } else {
        format!(
            "several presets have world_size {world_size} and none is the default family's: \
             {candidates}; pick one with --target"
        )
    }
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, PolicyError>;
