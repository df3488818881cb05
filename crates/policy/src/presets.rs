//! Named targets for common machines ([`crate::Target::preset`]).
//!
//! Values are the public facts of each machine (domain.md §3 and §7); engine settings
//! are vLLM-like defaults: bf16 activations, 8192 max batched tokens and vLLM's default
//! CUDA-graph capture sizes up to 512 tokens.

use crate::target::{ActDtype, Interconnect, KernelLibrary, RequestedBackend, Target};

/// Every preset name, in the order documented.
pub(crate) const PRESET_NAMES: &[&str] = &[
    "h100-sxm-x8",
    "h200-sxm-x8",
    "h200-nvl-x8",
    "b200-x8",
    "gb200-nvl72-2node-tp8",
    "b300-x4",
    "rtx-pro-6000-x4",
    "h100-2node-ib-tp16",
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

/// One preset's hardware facts.
struct Machine {
    sm: u32,
    world_size: u32,
    group_nodes: u32,
    gpus_per_node: u32,
    multicast_all_ranks: bool,
    interconnect: Interconnect,
}

fn build(m: Machine) -> Target {
    Target {
        sm: m.sm,
        world_size: m.world_size,
        group_nodes: m.group_nodes,
        gpus_per_node: m.gpus_per_node,
        multicast_all_ranks: m.multicast_all_ranks,
        interconnect: m.interconnect,
        dtype: ActDtype::Bf16,
        max_batched_tokens: PRESET_MAX_BATCHED_TOKENS,
        capture_sizes: vllm_capture_sizes(),
        compile_range_boundaries: Vec::new(),
        num_speculative_tokens: 0,
        deterministic: false,
        requested_backend: RequestedBackend::Auto,
        kernels: KernelLibrary::Arfuse,
        max_bytes_override: None,
    }
}

/// The preset called `name`, if any.
pub(crate) fn preset(name: &str) -> Option<Target> {
    let machine = match name {
        // HGX H100 SXM: NVSwitch, multicast (NVLS) on every GPU.
        "h100-sxm-x8" | "h200-sxm-x8" => Machine {
            sm: 90,
            world_size: 8,
            group_nodes: 1,
            gpus_per_node: 8,
            multicast_all_ranks: true,
            interconnect: Interconnect::Nvswitch,
        },
        // H200 NVL PCIe cards with NVLink bridges: the driver reports multicast, but
        // there is no switch across all ranks (domain.md §3: no fusion).
        "h200-nvl-x8" => Machine {
            sm: 90,
            world_size: 8,
            group_nodes: 1,
            gpus_per_node: 8,
            multicast_all_ranks: true,
            interconnect: Interconnect::BridgedNvlink,
        },
        "b200-x8" => Machine {
            sm: 100,
            world_size: 8,
            group_nodes: 1,
            gpus_per_node: 8,
            multicast_all_ranks: true,
            interconnect: Interconnect::Nvswitch,
        },
        // GB200 NVL72: 4 GPUs per compute tray (node); TP8 spans 2 trays over the
        // NVLink fabric.
        "gb200-nvl72-2node-tp8" => Machine {
            sm: 100,
            world_size: 8,
            group_nodes: 2,
            gpus_per_node: 4,
            multicast_all_ranks: true,
            interconnect: Interconnect::NvlinkFabric,
        },
        // HGX B300 (8 GPUs, NVSwitch), TP4 inside the node.
        "b300-x4" => Machine {
            sm: 103,
            world_size: 4,
            group_nodes: 1,
            gpus_per_node: 8,
            multicast_all_ranks: true,
            interconnect: Interconnect::Nvswitch,
        },
        // RTX PRO 6000 Blackwell (SM 12.0), PCIe only, no multicast.
        "rtx-pro-6000-x4" => Machine {
            sm: 120,
            world_size: 4,
            group_nodes: 1,
            gpus_per_node: 4,
            multicast_all_ranks: false,
            interconnect: Interconnect::Pcie,
        },
        // Two HGX H100 nodes joined by InfiniBand, TP16 across both. Each GPU reports
        // multicast, but NVLink multicast cannot cross InfiniBand.
        "h100-2node-ib-tp16" => Machine {
            sm: 90,
            world_size: 16,
            group_nodes: 2,
            gpus_per_node: 8,
            multicast_all_ranks: true,
            interconnect: Interconnect::Infiniband,
        },
        _ => return None,
    };
    Some(build(machine))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::PolicyError;

    #[test]
    fn every_named_preset_exists_and_validates() {
        for name in PRESET_NAMES {
            let t = Target::preset(name).unwrap();
            t.validate().unwrap();
            let back = Target::from_toml_str(&t.to_toml_string().unwrap()).unwrap();
            assert_eq!(back, t, "{name} round-trips through TOML");
        }
        assert_eq!(Target::preset_names().len(), 8);
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
