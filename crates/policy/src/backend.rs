//! Backend resolution (domain.md §3): which fused all-reduce backend, if any, a
//! [`Target`] can run, and why.
//!
//! Every outcome carries a reason a person can act on. An explicit request the machine
//! cannot run is an error naming the fix; `auto` never errors, it falls back or
//! decides "no fusion".

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{PolicyError, Result};
use crate::target::{Interconnect, RequestedBackend, Target};

/// A fused all-reduce device algorithm (domain.md §3): the ABI's one definition.
pub use arfuse_abi::Backend;

/// Whether `backend` supports a group of `w` ranks as FlashInfer publishes it
/// (domain.md §3): trtllm W in [`TRTLLM_WORLD_SIZES`], mnnvl W in
/// [`MNNVL_MIN_WORLD_SIZE`]..=[`MNNVL_MAX_WORLD_SIZE`]. arfuse's own kernels run fewer
/// (`arfuse_abi::WORLD_SIZES`), which the planner checks on its own.
pub fn backend_supports_world_size(backend: Backend, w: u32) -> bool {
    match backend {
        Backend::Trtllm => TRTLLM_WORLD_SIZES.contains(&w),
        Backend::Mnnvl => (MNNVL_MIN_WORLD_SIZE..=MNNVL_MAX_WORLD_SIZE).contains(&w),
    }
}

/// Group sizes FlashInfer's trtllm backend supports (domain.md §3).
pub const TRTLLM_WORLD_SIZES: [u32; 4] = [2, 4, 8, 16];
/// Smallest group the mnnvl backend supports (domain.md §3).
pub const MNNVL_MIN_WORLD_SIZE: u32 = 2;
/// Largest group the mnnvl backend supports (domain.md §3).
pub const MNNVL_MAX_WORLD_SIZE: u32 = 64;

/// The Hopper family: SM 9.x (only 90 exists). Families, not exact values (§3).
const SM_FAMILY_HOPPER: u32 = 9;
/// The datacenter Blackwell family: SM 10.x (100, 103, 107). An exact `== 100` check
/// once silently disabled SM 103 (domain.md §3).
const SM_FAMILY_BLACKWELL: u32 = 10;
/// Consumer / workstation Blackwell: SM 12.x (120, 121); no fused backend (§3).
const SM_FAMILY_CONSUMER_BLACKWELL: u32 = 12;
/// NVFP4 quantisation exists from SM 100 on (domain.md §1, §3).
const NVFP4_MIN_SM: u32 = 100;

/// The major architecture family of an SM integer (90 -> 9, 103 -> 10, 120 -> 12).
pub const fn sm_family(sm: u32) -> u32 {
    sm / 10
}

/// Whether a fused backend exists for this architecture: families 9.x and 10.x only.
pub const fn sm_supported(sm: u32) -> bool {
    let fam = sm_family(sm);
    fam == SM_FAMILY_HOPPER || fam == SM_FAMILY_BLACKWELL
}

/// Whether an NVFP4 quant epilogue may be fused on this SM (SM >= 100; domain.md §3).
pub const fn nvfp4_quant_supported(sm: u32) -> bool {
    sm >= NVFP4_MIN_SM
}

/// The outcome of a policy decision: fuse with a backend, or do not fuse; with the
/// reason either way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "decision")]
pub enum BackendDecision {
    /// Fuse with this backend.
    Fuse {
        /// The backend chosen.
        backend: Backend,
        /// Why this backend.
        reason: String,
    },
    /// Keep all-reduce, residual add and RMSNorm as separate kernels.
    NoFusion {
        /// Why, and what (if anything) a person could change.
        reason: String,
    },
}

impl BackendDecision {
    /// The backend, when fusing.
    pub fn backend(&self) -> Option<Backend> {
        match self {
            BackendDecision::Fuse { backend, .. } => Some(*backend),
            BackendDecision::NoFusion { .. } => None,
        }
    }

    /// The reason, in either case.
    pub fn reason(&self) -> &str {
        match self {
            BackendDecision::Fuse { reason, .. } | BackendDecision::NoFusion { reason } => reason,
        }
    }
}

impl fmt::Display for BackendDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendDecision::Fuse { backend, reason } => write!(f, "fuse with {backend}: {reason}"),
            BackendDecision::NoFusion { reason } => write!(f, "no fusion: {reason}"),
        }
    }
}

fn no_fusion(reason: String) -> Result<BackendDecision> {
    Ok(BackendDecision::NoFusion { reason })
}

fn unavailable(requested: RequestedBackend, reason: String) -> PolicyError {
    PolicyError::BackendUnavailable {
        requested: requested.name().to_string(),
        reason,
    }
}

/// Resolves the backend for `target` by the rules of domain.md §3.
///
/// Returns [`BackendDecision::Fuse`] or [`BackendDecision::NoFusion`], each with a
/// reason. Errors: [`PolicyError::InvalidField`] from [`Target::validate`];
/// [`PolicyError::TrtllmAcrossNodes`] for explicit trtllm on a multi-node group;
/// [`PolicyError::BackendUnavailable`] for any other explicit backend the target
/// cannot run (the message names the fix).
pub fn resolve_backend(target: &Target) -> Result<BackendDecision> {
    target.validate()?;
    let req = target.requested_backend;
    let w = target.world_size;
    let sm = target.sm;

    if req == RequestedBackend::Off {
        return no_fusion("fusion disabled by requested_backend = \"off\"".to_string());
    }
    if req == RequestedBackend::Trtllm && target.is_multi_node() {
        return Err(PolicyError::TrtllmAcrossNodes {
            nodes: target.group_nodes,
        });
    }
    if w == 1 {
        return no_fusion(
            "world_size = 1: there is no all-reduce to fuse (a single rank sums nothing)"
                .to_string(),
        );
    }
    if !sm_supported(sm) {
        let why = if sm_family(sm) == SM_FAMILY_CONSUMER_BLACKWELL {
            format!(
                "SM {sm} (12.x, consumer/workstation Blackwell) has no fused all-reduce \
                 backend; only SM 9.0 and 10.x do. Decided at plan time \
                 instead of failing at CUDA-graph capture; the unfused kernels are used"
            )
        } else {
            format!(
                "SM {sm} is outside the supported architecture families 9.0 and 10.x \
                 (100, 103, 107); the unfused kernels are used"
            )
        };
        return match req {
            RequestedBackend::Auto => no_fusion(why),
            _ => Err(unavailable(
                req,
                format!("{why}. Fix: requested_backend = \"auto\" or \"off\""),
            )),
        };
    }

    // Bridged NVLink: multicast may be reported, but the mnnvl workspace crashes at
    // graph capture and the trtllm fallback was measured 10x-34x slower than no fusion.
    if target.interconnect == Interconnect::BridgedNvlink {
        let why = "the group is joined by bridged NVLink (H100-NVL / H200-NVL pairs), not \
                   an NVSwitch across all ranks: an mnnvl workspace can be created there but \
                   crashes at CUDA-graph capture, and the trtllm fallback measured 10x-34x \
                   slower than no fusion. The unfused path is the fast one \
                   on this machine"
            .to_string();
        return match req {
            RequestedBackend::Auto => no_fusion(why),
            _ => Err(unavailable(
                req,
                format!("{why}. Fix: requested_backend = \"auto\" or \"off\""),
            )),
        };
    }

    if target.is_multi_node() {
        return resolve_multi_node(target);
    }
    resolve_single_node(target)
}

fn resolve_multi_node(target: &Target) -> Result<BackendDecision> {
    let req = target.requested_backend;
    let (sm, w, nodes) = (target.sm, target.world_size, target.group_nodes);
    let blocker = if sm_family(sm) != SM_FAMILY_BLACKWELL {
        Some(format!(
            "the group spans {nodes} nodes; across nodes only mnnvl can fuse and it needs \
             SM 10.x with an NVLink fabric (GB200/GB300 NVL72); SM {sm} over {} cannot \
            ",
            target.interconnect
        ))
    } else if target.interconnect != Interconnect::NvlinkFabric {
        Some(format!(
            "the group spans {nodes} nodes joined by {}; NVLink multicast does not cross \
             it, so mnnvl cannot run and trtllm cannot span nodes",
            target.interconnect
        ))
    } else if !target.multicast_all_ranks {
        Some(format!(
            "the group spans {nodes} nodes and multicast is not supported on every rank \
             (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED must hold on all ranks, else the \
             mnnvl rendezvous deadlocks); trtllm cannot span nodes"
        ))
    } else if !backend_supports_world_size(Backend::Mnnvl, w) {
        Some(format!("mnnvl supports 2..=64 ranks, the group has {w}"))
    } else {
        None
    };
    match (blocker, req) {
        (None, _) => Ok(BackendDecision::Fuse {
            backend: Backend::Mnnvl,
            reason: format!(
                "the group spans {nodes} nodes of one NVLink fabric on SM {sm} with \
                 multicast on every rank: mnnvl is the only backend that crosses nodes \
                "
            ),
        }),
        (Some(why), RequestedBackend::Auto) => no_fusion(why),
        (Some(why), _) => Err(unavailable(
            req,
            format!("{why}. Fix: requested_backend = \"auto\" or \"off\""),
        )),
    }
}

fn resolve_single_node(target: &Target) -> Result<BackendDecision> {
    let req = target.requested_backend;
    let w = target.world_size;
    if !target.interconnect.is_switched_nvlink() {
        let why = format!(
            "the group's GPUs are connected by {}, without NVLink through a switch: trtllm \
             needs NVLink peer-to-peer and mnnvl needs NVLink multicast",
            target.interconnect
        );
        return match req {
            RequestedBackend::Auto => no_fusion(why),
            _ => Err(unavailable(
                req,
                format!("{why}. Fix: requested_backend = \"auto\" or \"off\""),
            )),
        };
    }
    let mnnvl_blocker = if !target.multicast_all_ranks {
        Some(
            "multicast (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED) is not supported on every \
             rank of the group"
                .to_string(),
        )
    } else if !backend_supports_world_size(Backend::Mnnvl, w) {
        Some(format!("mnnvl supports 2..=64 ranks, the group has {w}"))
    } else {
        None
    };
    let trtllm_blocker = if backend_supports_world_size(Backend::Trtllm, w) {
        None
    } else {
        Some(format!(
            "trtllm supports W in {{2, 4, 8, 16}}, the group has W = {w}"
        ))
    };
    match req {
        RequestedBackend::Mnnvl => match mnnvl_blocker {
            None => Ok(BackendDecision::Fuse {
                backend: Backend::Mnnvl,
                reason: "requested explicitly; multicast on every rank of a single NVSwitch \
                         node"
                    .to_string(),
            }),
            Some(why) => Err(unavailable(
                req,
                format!(
                    "{why}. Fix: requested_backend = \"auto\" (falls back to \
                     trtllm where it can) or \"trtllm\""
                ),
            )),
        },
        RequestedBackend::Trtllm => match trtllm_blocker {
            None => Ok(BackendDecision::Fuse {
                backend: Backend::Trtllm,
                reason: "requested explicitly; single node with NVLink peer-to-peer".to_string(),
            }),
            Some(why) => Err(unavailable(
                req,
                format!("{why}. Fix: requested_backend = \"auto\" or \"mnnvl\""),
            )),
        },
        RequestedBackend::Auto | RequestedBackend::Off => match (mnnvl_blocker, trtllm_blocker) {
            (None, _) => Ok(BackendDecision::Fuse {
                backend: Backend::Mnnvl,
                reason: "auto: single node, NVSwitch, multicast supported on every rank -> \
                         mnnvl is preferred"
                    .to_string(),
            }),
            (Some(m), None) => Ok(BackendDecision::Fuse {
                backend: Backend::Trtllm,
                reason: format!(
                    "auto: single node with NVSwitch, but {m}; falling back to trtllm \
                     (allowed only in auto mode)"
                ),
            }),
            (Some(m), Some(t)) => no_fusion(format!("{m}, and {t}")),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn preset(name: &str) -> Target {
        Target::preset(name).unwrap()
    }

    #[test]
    fn single_node_nvswitch_with_multicast_prefers_mnnvl() {
        for name in ["h100-sxm-x8", "h200-sxm-x8", "b200-x8", "b300-x4"] {
            let d = resolve_backend(&preset(name)).unwrap();
            assert_eq!(d.backend(), Some(Backend::Mnnvl), "{name}: {d}");
        }
    }

    #[test]
    fn auto_falls_back_to_trtllm_without_multicast() {
        let mut t = preset("b200-x8");
        t.multicast_all_ranks = false;
        let d = resolve_backend(&t).unwrap();
        assert_eq!(d.backend(), Some(Backend::Trtllm));
        assert!(d.reason().contains("falling back"), "{d}");
        // The fallback is for auto only: explicit mnnvl is an error naming the fix.
        t.requested_backend = RequestedBackend::Mnnvl;
        let err = resolve_backend(&t).unwrap_err();
        assert!(matches!(err, PolicyError::BackendUnavailable { .. }));
        assert!(err.to_string().contains("Fix"), "{err}");
    }

    #[test]
    fn bridged_h200_nvl_gets_no_fusion_with_reason() {
        let d = resolve_backend(&preset("h200-nvl-x8")).unwrap();
        assert_eq!(d.backend(), None);
        assert!(d.reason().contains("bridged NVLink"), "{d}");
        assert!(d.reason().contains("10x-34x"), "{d}");
    }

    #[test]
    fn explicit_trtllm_on_two_nodes_is_an_error_naming_mnnvl() {
        let mut t = preset("gb200-nvl72-2node-tp8");
        t.requested_backend = RequestedBackend::Trtllm;
        let err = resolve_backend(&t).unwrap_err();
        assert_eq!(err, PolicyError::TrtllmAcrossNodes { nodes: 2 });
        assert!(
            err.to_string().contains("requested_backend = \"mnnvl\""),
            "{err}"
        );
    }

    #[test]
    fn gb200_two_nodes_resolves_mnnvl() {
        let d = resolve_backend(&preset("gb200-nvl72-2node-tp8")).unwrap();
        assert_eq!(d.backend(), Some(Backend::Mnnvl), "{d}");
    }

    #[test]
    fn multi_node_hopper_over_infiniband_is_no_fusion() {
        let d = resolve_backend(&preset("h100-2node-ib-tp16")).unwrap();
        assert_eq!(d.backend(), None);
        assert!(d.reason().contains("SM 90"), "{d}");
    }

    #[test]
    fn rtx_pro_6000_sm120_is_no_fusion_with_reason() {
        let d = resolve_backend(&preset("rtx-pro-6000-x4")).unwrap();
        assert_eq!(d.backend(), None);
        assert!(
            d.reason().contains("SM 120") && d.reason().contains("12.x"),
            "{d}"
        );
    }

    #[test]
    fn families_not_exact_values() {
        assert!(sm_supported(90) && sm_supported(100) && sm_supported(103) && sm_supported(107));
        assert!(!sm_supported(80) && !sm_supported(120) && !sm_supported(121));
        assert!(nvfp4_quant_supported(100) && !nvfp4_quant_supported(90));
    }

    #[test]
    fn off_and_single_rank_are_no_fusion() {
        let mut t = preset("b200-x8");
        t.requested_backend = RequestedBackend::Off;
        assert!(resolve_backend(&t).unwrap().reason().contains("\"off\""));
        let mut t = preset("b200-x8");
        t.world_size = 1;
        assert_eq!(resolve_backend(&t).unwrap().backend(), None);
    }

    #[test]
    fn world_size_outside_trtllm_set_without_multicast() {
        let mut t = preset("b200-x8");
        t.multicast_all_ranks = false;
        t.world_size = 6;
        let d = resolve_backend(&t).unwrap();
        assert_eq!(d.backend(), None);
        assert!(d.reason().contains("W = 6"), "{d}");
    }

    #[test]
    fn node_count_is_the_groups() {
        // TP8 inside one node of a 2-node PP deployment: group_nodes = 1, fused.
        let mut t = preset("h100-2node-ib-tp16");
        t.world_size = 8;
        t.group_nodes = 1;
        t.interconnect = Interconnect::Nvswitch;
        assert_eq!(resolve_backend(&t).unwrap().backend(), Some(Backend::Mnnvl));
    }
}
