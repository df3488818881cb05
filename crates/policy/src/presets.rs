//! Named targets for common machines ([`crate::Target::preset`]).
//!
//! Values are the public facts of each machine (domain.md §3 and §7); engine settings
//! are vLLM-like defaults: bf16 activations, 8192 max batched tokens and vLLM's default
//! CUDA-graph capture sizes up to 512 tokens.

use crate::target::{
    ActDtype, Interconnect, KernelLibrary, RequestedBackend, Target, UnfusedAllReduce,
};

/// One named machine: its hardware facts (domain.md §3 and §7) and a line for people.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preset {
    /// The name [`crate::Target::preset`] takes.
    pub name: &'static str,
    /// The GPU model.
    pub gpu: &'static str,
    /// Compute capability.
    pub sm: u32,
    /// W, ranks of the all-reduce group.
    pub world_size: u32,
    /// Nodes the group spans.
    pub group_nodes: u32,
    /// GPUs per node.
    pub gpus_per_node: u32,
    /// Multicast on every rank of the group.
    pub multicast_all_ranks: bool,
    /// How the group's GPUs are connected.
    pub interconnect: Interconnect,
    /// What the machine is, in a few words.
    pub description: &'static str,
}

/// A tensor-parallel group of `w` GPUs inside one 8-GPU HGX node.
const fn hgx(name: &'static str, gpu: &'static str, sm: u32, w: u32) -> Preset {
    Preset {
        name,
        gpu,
        sm,
        world_size: w,
        group_nodes: 1,
        gpus_per_node: 8,
        multicast_all_ranks: true,
        interconnect: Interconnect::Nvswitch,
        description: "HGX node, NVSwitch, multicast (NVLS) on every GPU",
    }
}

/// Every preset, in the order documented. The TP2 and TP4 presets are tensor-parallel
/// groups inside one 8-GPU HGX node (the other GPUs serve other replicas).
pub const PRESETS: &[Preset] = &[
    hgx("h100-sxm-x8", "H100 SXM", 90, 8),
    hgx("h100-sxm-x4", "H100 SXM", 90, 4),
    hgx("h100-sxm-x2", "H100 SXM", 90, 2),
    hgx("h200-sxm-x8", "H200 SXM", 90, 8),
    hgx("h200-sxm-x4", "H200 SXM", 90, 4),
    hgx("h200-sxm-x2", "H200 SXM", 90, 2),
    // H200 NVL PCIe cards with NVLink bridges: the driver reports multicast, but there
    // is no switch across all ranks (domain.md §3: no fusion).
    Preset {
        name: "h200-nvl-x8",
        gpu: "H200 NVL",
        sm: 90,
        world_size: 8,
        group_nodes: 1,
        gpus_per_node: 8,
        multicast_all_ranks: true,
        interconnect: Interconnect::BridgedNvlink,
        description: "PCIe cards with NVLink bridges between pairs, no NVSwitch",
    },
    hgx("b200-x8", "B200", 100, 8),
    hgx("b200-x4", "B200", 100, 4),
    hgx("b200-x2", "B200", 100, 2),
    // GB200 NVL72: 4 GPUs per compute tray (node); TP8 spans 2 trays over the fabric.
    Preset {
        name: "gb200-nvl72-2node-tp8",
        gpu: "GB200",
        sm: 100,
        world_size: 8,
        group_nodes: 2,
        gpus_per_node: 4,
        multicast_all_ranks: true,
        interconnect: Interconnect::NvlinkFabric,
        description: "NVL72 rack, TP8 across two 4-GPU trays over the NVLink fabric",
    },
    // HGX B300 (8 GPUs, NVSwitch), TP4 inside the node.
    hgx("b300-x4", "B300", 103, 4),
    // RTX PRO 6000 Blackwell (SM 12.0), PCIe only, no multicast.
    Preset {
        name: "rtx-pro-6000-x4",
        gpu: "RTX PRO 6000",
        sm: 120,
        world_size: 4,
        group_nodes: 1,
        gpus_per_node: 4,
        multicast_all_ranks: false,
        interconnect: Interconnect::Pcie,
        description: "workstation / server cards on PCIe, no NVLink, no multicast",
    },
    // Two HGX H100 nodes joined by InfiniBand, TP16 across both. Each GPU reports
    // multicast, but NVLink multicast cannot cross InfiniBand.
    Preset {
        name: "h100-2node-ib-tp16",
        gpu: "H100 SXM",
        sm: 90,
        world_size: 16,
        group_nodes: 2,
        gpus_per_node: 8,
        multicast_all_ranks: true,
        interconnect: Interconnect::Infiniband,
        description: "two HGX nodes joined by InfiniBand, TP16 across both",
    },
];

/// Max batched tokens per step in the presets: vLLM's common chunked-prefill budget.
const PRESET_MAX_BATCHED_TOKENS: u64 = 8192;

/// Largest CUDA-graph capture size in the presets: vLLM's default max capture size.
const PRESET_MAX_CAPTURE: u64 = 512;

/// Up to this size vLLM's default capture sizes step by 8; beyond it by 16.
const PRESET_CAPTURE_FINE_LIMIT: u64 = 256;

/// vLLM-like default capture sizes: 1, 2, 4, then 8..=256 step 8, then 272..=512 step 16.
fn vllm_capture_sizes() -> Vec<u64> {
    let mut sizes = vec![1, 2, 4];
    sizes.extend((8..=PRESET_CAPTURE_FINE_LIMIT).step_by(8));
    sizes.extend((PRESET_CAPTURE_FINE_LIMIT + 16..=PRESET_MAX_CAPTURE).step_by(16));
    sizes
}

impl Preset {
    /// This machine's target with vLLM-like engine defaults (bf16, 8192 max batched
    /// tokens, capture sizes to 512, arfuse's kernels).
    pub fn target(&self) -> Target {
        Target {
            sm: self.sm,
            world_size: self.world_size,
            group_nodes: self.group_nodes,
            gpus_per_node: self.gpus_per_node,
            multicast_all_ranks: self.multicast_all_ranks,
            interconnect: self.interconnect,
            dtype: ActDtype::Bf16,
            max_batched_tokens: PRESET_MAX_BATCHED_TOKENS,
            capture_sizes: vllm_capture_sizes(),
            compile_range_boundaries: Vec::new(),
            num_speculative_tokens: 0,
            deterministic: false,
            unfused_all_reduce: UnfusedAllReduce::Arfuse,
            requested_backend: RequestedBackend::Auto,
            kernels: KernelLibrary::Arfuse,
            max_bytes_override: None,
        }
    }
}

/// The target of the preset called `name`, if any.
pub(crate) fn preset(name: &str) -> Option<Target> {
    PRESETS.iter().find(|p| p.name == name).map(Preset::target)
}

/// Every preset name, in [`PRESETS`] order.
pub(crate) fn names() -> &'static [&'static str] {
    static NAMES: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    NAMES.get_or_init(|| PRESETS.iter().map(|p| p.name).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::PolicyError;

    #[test]
    fn every_named_preset_exists_and_validates() {
        for name in names() {
            let t = Target::preset(name).unwrap();
            t.validate().unwrap();
            let back = Target::from_toml_str(&t.to_toml_string().unwrap()).unwrap();
            assert_eq!(back, t, "{name} round-trips through TOML");
        }
        assert_eq!(Target::preset_names().len(), 14);
        // Every W of the TP2 / TP4 families exists for H100, H200 and B200.
        for gpu in ["h100-sxm", "h200-sxm", "b200"] {
            for w in [2, 4, 8] {
                let t = Target::preset(&format!("{gpu}-x{w}")).unwrap();
                assert_eq!(t.world_size, w);
                assert_eq!((t.group_nodes, t.gpus_per_node), (1, 8));
            }
        }
    }

    #[test]
    fn unknown_preset_lists_known_names() {
        let err = Target::preset("h300-x8").unwrap_err();
        let PolicyError::UnknownPreset { known, .. } = &err else {
            panic!("wrong error {err}");
        };
        assert!(
            known.contains("h200-sxm-x8") && known.contains("b300-x4"),
            "{known}"
        );
    }

    #[test]
    fn capture_sizes_are_vllm_like() {
        let sizes = vllm_capture_sizes();
        assert_eq!(&sizes[..6], &[1, 2, 4, 8, 16, 24]);
        assert!(sizes.contains(&40) && sizes.contains(&256) && sizes.contains(&272));
        assert!(!sizes.contains(&264));
        assert_eq!(sizes.last(), Some(&512));
        assert_eq!(sizes.len(), 3 + 32 + 16);
    }

    #[test]
    fn h200_sxm_x8_values() {
        let t = Target::preset("h200-sxm-x8").unwrap();
        assert_eq!((t.sm, t.world_size, t.group_nodes), (90, 8, 1));
        assert!(t.multicast_all_ranks);
        assert_eq!(t.interconnect, Interconnect::Nvswitch);
        assert_eq!(t.max_batched_tokens, 8192);
        let gb = Target::preset("gb200-nvl72-2node-tp8").unwrap();
        assert_eq!(
            (gb.sm, gb.world_size, gb.group_nodes, gb.gpus_per_node),
            (100, 8, 2, 4)
        );
    }
}
