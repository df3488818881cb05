//! How a call runs ([`Strategy`]) and where its peer buffers live ([`Backend`]).

use std::fmt;

/// How one call of T tokens is executed: the one definition for the policy's plans, the
/// IR's fused nodes (the graph format spells it `one_shot`, `two_shot`, `unfused`) and
/// the runtime's kernel variants (`ARF_STRATEGY`, [`Strategy::kernel_code`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum Strategy {
    /// Fused, one-shot Lamport all-reduce: every rank pushes its whole input to every
    /// peer and reduces locally.
    OneShot,
    /// Fused, two-shot: reduce-scatter then all-gather (FlashInfer's requires T >= W).
    TwoShot,
    /// Not fused: separate all-reduce, residual add and RMSNorm kernels.
    Unfused,
}

impl Strategy {
    /// The two fused strategies, each a kernel of its own (`ARF_STRATEGY` 1 and 2).
    pub const FUSED: [Strategy; 2] = [Strategy::OneShot, Strategy::TwoShot];

    /// `"one-shot"`, `"two-shot"` or `"unfused"`.
    pub const fn name(self) -> &'static str {
        match self {
            Strategy::OneShot => "one-shot",
            Strategy::TwoShot => "two-shot",
            Strategy::Unfused => "unfused",
        }
    }

    /// The short name in kernel variant names: `"oneshot"`, `"twoshot"`, `"unfused"`.
    pub const fn variant_name(self) -> &'static str {
        match self {
            Strategy::OneShot => "oneshot",
            Strategy::TwoShot => "twoshot",
            Strategy::Unfused => "unfused",
        }
    }

    /// True for the two fused strategies.
    pub const fn is_fused(self) -> bool {
        !matches!(self, Strategy::Unfused)
    }

    /// The fused kernel's `ARF_STRATEGY` value (1 one-shot, 2 two-shot; named
    /// `ARF_ONE_SHOT` and `ARF_TWO_SHOT` by [`crate::kernel_defines`]), `None` for
    /// [`Strategy::Unfused`], which has no fused kernel.
    pub const fn kernel_code(self) -> Option<u32> {
        match self {
            Strategy::OneShot => Some(1),
            Strategy::TwoShot => Some(2),
            Strategy::Unfused => None,
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A fused all-reduce + residual add + RMSNorm device algorithm (domain.md §3): how the
/// ranks' workspaces are mapped. arfuse's kernels run either one the same way (they
/// take every peer's address); the runtime's fallback chain is `mnnvl -> trtllm ->
/// unfused`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum Backend {
    /// CUDA IPC peer-to-peer buffers inside one node (or virtual ranks on one GPU).
    Trtllm,
    /// NVLink multicast (NVLS / multi-node NVLink) buffers.
    Mnnvl,
}

impl Backend {
    /// Lower-case name (`"trtllm"`, `"mnnvl"`).
    pub const fn name(self) -> &'static str {
        match self {
            Backend::Trtllm => "trtllm",
            Backend::Mnnvl => "mnnvl",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
