//! The machine and engine a plan is made for: [`Target`].
//!
//! A target is plain data, loadable from TOML ([`Target::from_toml_str`]) or from a
//! named preset ([`Target::preset`]). Field names in TOML are the snake_case field
//! names below; enum values are lower-case / kebab-case (`"nvswitch"`,
//! `"bridged-nvlink"`, `"bf16"`, `"auto"`).
//!
//! ```toml
//! sm = 90
//! world_size = 8
//! gpus_per_node = 8
//! multicast_all_ranks = true
//! interconnect = "nvswitch"
//! max_batched_tokens = 8192
//! capture_sizes = [1, 2, 4, 8]
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::bytes;
use crate::error::{PolicyError, Result};
use crate::presets;

/// Activation dtype of the all-reduce input: the ABI's one definition.
pub use arfuse_abi::ActDtype;

/// How the GPUs of the all-reduce group are connected (domain.md §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Interconnect {
    /// NVLink through NVSwitch: every rank of the (single-node) group reaches every
    /// other at full bandwidth (HGX/DGX H100, H200, B200, B300).
    Nvswitch,
    /// NVLink bridges between pairs (H100-NVL / H200-NVL PCIe cards); no switch across
    /// all ranks.
    BridgedNvlink,
    /// PCIe only, no NVLink (RTX PRO 6000 workstations / servers).
    Pcie,
    /// A multi-node NVLink fabric (GB200 / GB300 NVL72): NVLink reaches across the
    /// nodes of the group.
    NvlinkFabric,
    /// Nodes joined by InfiniBand (or Ethernet); NVLink only inside each node.
    Infiniband,
}

impl Interconnect {
    /// What a target file without `multicast_all_ranks` assumes: true for
    /// [`Interconnect::Nvswitch`] and [`Interconnect::NvlinkFabric`] (NVSwitch
    /// machines from H100 on have NVLink multicast, NVLS; set the field to false when
    /// the driver or fabric manager does not report it: the runtime falls back to
    /// trtllm when the multicast workspace cannot be created), false for the rest
    /// (PCIe has no NVLink; bridged NVLink and InfiniBand have no multicast across every
    /// rank).
    pub fn multicast_default(self) -> bool {
        matches!(self, Interconnect::Nvswitch | Interconnect::NvlinkFabric)
    }
}

impl Interconnect {
    /// The TOML spelling.
    pub const fn name(self) -> &'static str {
        match self {
            Interconnect::Nvswitch => "nvswitch",
            Interconnect::BridgedNvlink => "bridged-nvlink",
            Interconnect::Pcie => "pcie",
            Interconnect::NvlinkFabric => "nvlink-fabric",
            Interconnect::Infiniband => "infiniband",
        }
    }

    /// True when every rank of a single-node group reaches every other over NVLink
    /// through a switch (what both fused backends need inside a node).
    pub const fn is_switched_nvlink(self) -> bool {
        matches!(self, Interconnect::Nvswitch | Interconnect::NvlinkFabric)
    }
}

impl fmt::Display for Interconnect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The backend the user asked for (domain.md §3). `auto` lets the policy choose;
/// an explicit backend is never silently replaced by another one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RequestedBackend {
    /// Choose by the rules of domain.md §3 (fallback allowed).
    #[default]
    Auto,
    /// CUDA IPC peer-to-peer buffers inside one node.
    Trtllm,
    /// NVLink multicast buffers (single node or one NVLink fabric).
    Mnnvl,
    /// Never fuse.
    Off,
}

impl RequestedBackend {
    /// The TOML spelling.
    pub const fn name(self) -> &'static str {
        match self {
            RequestedBackend::Auto => "auto",
            RequestedBackend::Trtllm => "trtllm",
            RequestedBackend::Mnnvl => "mnnvl",
            RequestedBackend::Off => "off",
        }
    }
}

impl fmt::Display for RequestedBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The fused kernels a plan is made for: their workspace layout, capacity and strategy
/// rule differ, so the plan names them and sizes exactly what they allocate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum KernelLibrary {
    /// This project's kernels (`kernels/` in the arfuse repository, run by
    /// `arfuse-runtime`): one-shot and two-shot both run in three rotating Lamport
    /// buffers, so the workspace is a small state block plus three buffers sized for the
    /// largest call the plan dispatches ([`crate::ArfuseLayout`]). The default.
    #[default]
    Arfuse,
    /// FlashInfer's `allreduce_fusion` kernels, as a graph compiler that calls them
    /// allocates them: FlashInfer's own workspace formulas and the public strategy rules
    /// (domain.md §4-§5), exactly as stated there.
    Flashinfer,
}

impl KernelLibrary {
    /// The TOML spelling (`"arfuse"`, `"flashinfer"`).
    pub const fn name(self) -> &'static str {
        match self {
            KernelLibrary::Arfuse => "arfuse",
            KernelLibrary::Flashinfer => "flashinfer",
        }
    }
}

impl fmt::Display for KernelLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which all-reduce serves the token counts a plan does not fuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum UnfusedAllReduce {
    /// arfuse-runtime's own unfused path (its all-reduce kernel, then the local
    /// kernel), in the rounding contract's order: rank order from +0.0, the RMSNorm
    /// sum in the kernels' block tree, so an unfused T gives the same bits as a fused
    /// one. The default.
    #[default]
    Arfuse,
    /// The engine's own all-reduce (NCCL or a custom all-reduce) and norm kernels:
    /// another reduction order.
    Engine,
}

impl UnfusedAllReduce {
    /// The TOML spelling (`"arfuse"`, `"engine"`).
    pub const fn name(self) -> &'static str {
        match self {
            UnfusedAllReduce::Arfuse => "arfuse",
            UnfusedAllReduce::Engine => "engine",
        }
    }
}

impl fmt::Display for UnfusedAllReduce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn default_one() -> u32 {
    1
}

/// The machine, the all-reduce group and the engine settings a plan is made for.
///
/// All counts are per all-reduce GROUP (the tensor-parallel group), never the whole
/// world: a TP group inside one node with pipeline parallelism across nodes has
/// `group_nodes = 1` (counting the world was a public bug; domain.md §3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Target {
    /// Compute capability as an integer (90 = H100/H200, 100 = B200/GB200,
    /// 103 = B300/GB300, 120 = RTX PRO 6000). Must be > 0.
    pub sm: u32,
    /// W: ranks in the all-reduce group. Must be >= 1 (1 means nothing to reduce).
    pub world_size: u32,
    /// Nodes the all-reduce group spans (default 1). 1 <= group_nodes <= world_size.
    #[serde(default = "default_one")]
    pub group_nodes: u32,
    /// GPUs per node. world_size <= group_nodes * gpus_per_node.
    pub gpus_per_node: u32,
    /// `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED` on EVERY rank of the group (the AND
    /// over the group; ranks that disagree deadlock the mnnvl rendezvous). Default, in
    /// TOML: [`Interconnect::multicast_default`] (true on NVSwitch and an NVLink
    /// fabric, where the GPUs have NVLink multicast, false otherwise).
    #[serde(default)]
    pub multicast_all_ranks: bool,
    /// How the group's GPUs are connected.
    pub interconnect: Interconnect,
    /// Activation dtype of the all-reduce input (default bf16).
    #[serde(default)]
    pub dtype: ActDtype,
    /// The engine's max batched tokens per forward step (tokens). Must be >= 1.
    pub max_batched_tokens: u64,
    /// CUDA graph capture sizes (tokens). Each is planned and checked; one above
    /// `max_batched_tokens` is planned and reported. Default empty.
    #[serde(default)]
    pub capture_sizes: Vec<u64>,
    /// Compile-range boundaries (tokens) of a piecewise-compiled graph. Each is planned
    /// and checked. Default empty.
    #[serde(default)]
    pub compile_range_boundaries: Vec<u64>,
    /// Speculative-decoding tokens per step (s). When > 0, every capture size c is also
    /// planned at c * (1 + s) tokens (a decode graph of c requests verifying s draft
    /// tokens each). Default 0.
    #[serde(default)]
    pub num_speculative_tokens: u64,
    /// Deterministic / batch-invariant mode: every T the graph can run with reduces in
    /// one order (domain.md §3). arfuse's kernels reduce in the contract's order on
    /// every strategy, so the plan may mix them; FlashInfer's do not, so it is one-shot
    /// for every T or no fusion. Default false.
    #[serde(default)]
    pub deterministic: bool,
    /// Which all-reduce serves the T the plan leaves unfused (default `arfuse`:
    /// arfuse-runtime's own unfused path, in the contract's order; `engine`: the
    /// engine's NCCL or custom all-reduce, in another order).
    #[serde(default)]
    pub unfused_all_reduce: UnfusedAllReduce,
    /// The backend asked for (default `auto`).
    #[serde(default)]
    pub requested_backend: RequestedBackend,
    /// The fused kernels the plan is for (default `arfuse`, this project's kernels;
    /// `flashinfer` plans FlashInfer's `allreduce_fusion` with its own formulas).
    #[serde(default)]
    pub kernels: KernelLibrary,
    /// Replaces the size table's max all-reduce input bytes per rank (bytes), as an
    /// engine's size-cap setting does; also supplies a value where the table has no
    /// entry. Must be > 0 when given (use `requested_backend = "off"` to disable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes_override: Option<u64>,
}

impl Target {
    /// Parses a target from TOML text and validates it.
    ///
    /// Errors: [`PolicyError::Toml`] for syntax, unknown fields or wrong types;
    /// [`PolicyError::InvalidField`] from [`Target::validate`].
    pub fn from_toml_str(text: &str) -> Result<Target> {
        let target: Target = toml::from_str(text).map_err(|e| PolicyError::Toml(e.to_string()))?;
        // The text parsed as a Target, so it parses as a table.
        let table: toml::Table =
            toml::from_str(text).map_err(|e| PolicyError::Toml(e.to_string()))?;
        target.with_defaults_of(&table)
    }

    /// A target from the fields of a TOML table: the same fields, defaults and checks as
    /// [`Target::from_toml_str`], for a caller that holds the fields rather than text
    /// (the Python package's `Target(...)` keywords). The one place where the defaults
    /// of omitted fields are decided.
    ///
    /// Errors: [`PolicyError::Toml`] for a missing required field, an unknown field or
    /// a value of the wrong type; then as [`Target::validate`].
    pub fn from_toml_table(table: toml::Table) -> Result<Target> {
        let target: Target = table
            .clone()
            .try_into()
            .map_err(|e: toml::de::Error| PolicyError::Toml(e.to_string()))?;
        target.with_defaults_of(&table)
    }

    /// The defaults serde cannot give (a field whose default depends on another:
    /// `multicast_all_ranks` from the interconnect, [`Interconnect::multicast_default`])
    /// for the fields `given` omits, then [`Target::validate`].
    fn with_defaults_of(mut self, given: &toml::Table) -> Result<Target> {
        if !given.contains_key("multicast_all_ranks") {
            self.multicast_all_ranks = self.interconnect.multicast_default();
        }
        self.validate()?;
        Ok(self)
    }

    /// Renders the target as TOML (round-trips through [`Target::from_toml_str`]).
    ///
    /// Errors: [`PolicyError::Toml`] if serialisation fails.
    pub fn to_toml_string(&self) -> Result<String> {
        toml::to_string(self).map_err(|e| PolicyError::Toml(e.to_string()))
    }

    /// A named preset for a common machine (see [`Target::preset_names`]).
    ///
    /// Errors: [`PolicyError::UnknownPreset`], listing the known names.
    pub fn preset(name: &str) -> Result<Target> {
        presets::preset(name).ok_or_else(|| PolicyError::UnknownPreset {
            name: name.to_string(),
            known: presets::names().join(", "),
        })
    }

    /// The names [`Target::preset`] accepts.
    pub fn preset_names() -> &'static [&'static str] {
        presets::names()
    }

    /// True when the all-reduce group spans more than one node.
    pub fn is_multi_node(&self) -> bool {
        self.group_nodes > 1
    }

    /// Checks every field for values that cannot be right.
    ///
    /// Errors: [`PolicyError::InvalidField`] naming the field: `sm` = 0,
    /// `world_size` = 0, `group_nodes` = 0 or > `world_size`, `gpus_per_node` = 0,
    /// `world_size` > `group_nodes * gpus_per_node`, `max_batched_tokens` = 0,
    /// a zero in `capture_sizes` or `compile_range_boundaries`,
    /// `max_bytes_override` = 0, or a speculative multiple that overflows `u64`.
    pub fn validate(&self) -> Result<()> {
        fn bad(field: &'static str, value: impl ToString, reason: &str) -> PolicyError {
            PolicyError::InvalidField {
                field,
                value: value.to_string(),
                reason: reason.to_string(),
            }
        }
        if self.sm == 0 {
            return Err(bad(
                "sm",
                self.sm,
                "compute capability must be > 0 (e.g. 90, 100)",
            ));
        }
        if self.world_size == 0 {
            return Err(bad(
                "world_size",
                self.world_size,
                "the all-reduce group needs at least one rank",
            ));
        }
        if self.group_nodes == 0 {
            return Err(bad(
                "group_nodes",
                self.group_nodes,
                "the group spans at least one node",
            ));
        }
        if self.group_nodes > self.world_size {
            return Err(bad(
                "group_nodes",
                self.group_nodes,
                "a group cannot span more nodes than it has ranks (count the nodes of the \
                 all-reduce group, not of the whole world)",
            ));
        }
        if self.gpus_per_node == 0 {
            return Err(bad(
                "gpus_per_node",
                self.gpus_per_node,
                "a node has at least one GPU",
            ));
        }
        let capacity = u64::from(self.group_nodes) * u64::from(self.gpus_per_node);
        if u64::from(self.world_size) > capacity {
            return Err(bad(
                "world_size",
                self.world_size,
                &format!(
                    "more ranks than GPUs in the group's nodes ({} node(s) x {} GPUs)",
                    self.group_nodes, self.gpus_per_node
                ),
            ));
        }
        if self.max_batched_tokens == 0 {
            return Err(bad("max_batched_tokens", 0, "must be >= 1 token"));
        }
        if self.capture_sizes.contains(&0) {
            return Err(bad(
                "capture_sizes",
                0,
                "capture sizes are token counts >= 1",
            ));
        }
        if self.compile_range_boundaries.contains(&0) {
            return Err(bad(
                "compile_range_boundaries",
                0,
                "boundaries are token counts >= 1",
            ));
        }
        if self.max_bytes_override == Some(0) {
            return Err(bad(
                "max_bytes_override",
                0,
                "a zero size cap fuses nothing; use requested_backend = \"off\" instead",
            ));
        }
        if self.num_speculative_tokens > 0 {
            let per_request = bytes::add(self.num_speculative_tokens, 1, "speculative step tokens")
                .map_err(|_| {
                    bad(
                        "num_speculative_tokens",
                        self.num_speculative_tokens,
                        "overflows u64",
                    )
                })?;
            for &c in &self.capture_sizes {
                bytes::mul(c, per_request, "speculative multiple").map_err(|_| {
                    bad(
                        "num_speculative_tokens",
                        self.num_speculative_tokens,
                        &format!("capture size {c} x (1 + s) overflows u64"),
                    )
                })?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
        sm = 90
        world_size = 8
        gpus_per_node = 8
        interconnect = "nvswitch"
        max_batched_tokens = 8192
    "#;

    #[test]
    fn minimal_toml_gets_defaults() {
        let t = Target::from_toml_str(MINIMAL).unwrap();
        assert_eq!(t.group_nodes, 1);
        assert_eq!(t.dtype, ActDtype::Bf16);
        assert_eq!(t.requested_backend, RequestedBackend::Auto);
        assert!(!t.deterministic);
        // Not given: NVSwitch has multicast.
        assert!(t.multicast_all_ranks);
        assert!(t.capture_sizes.is_empty());
        assert_eq!(t.max_bytes_override, None);
        assert_eq!(t.kernels, KernelLibrary::Arfuse);
    }

    #[test]
    fn multicast_defaults_from_the_interconnect_unless_given() {
        let with = |interconnect: &str, extra: &str| {
            let text = MINIMAL.replace("\"nvswitch\"", interconnect) + extra;
            Target::from_toml_str(&text).unwrap().multicast_all_ranks
        };
        assert!(with("\"nvswitch\"", ""));
        assert!(with("\"nvlink-fabric\"", ""));
        assert!(!with("\"pcie\"", ""));
        assert!(!with("\"bridged-nvlink\"", ""));
        assert!(!with("\"infiniband\"", ""));
        assert!(!with("\"nvswitch\"", "multicast_all_ranks = false\n"));
        assert!(with("\"pcie\"", "multicast_all_ranks = true\n"));
    }

    #[test]
    fn enum_spellings_parse() {
        let text = format!(
            "{MINIMAL}\ndtype = \"fp16\"\nrequested_backend = \"mnnvl\"\nkernels = \"flashinfer\"\n"
        )
        .replace("\"nvswitch\"", "\"bridged-nvlink\"");
        let t = Target::from_toml_str(&text).unwrap();
        assert_eq!(t.dtype, ActDtype::F16);
        assert_eq!(t.interconnect, Interconnect::BridgedNvlink);
        assert_eq!(t.requested_backend, RequestedBackend::Mnnvl);
        assert_eq!(t.kernels, KernelLibrary::Flashinfer);
    }

    #[test]
    fn unknown_field_is_rejected() {
        let err = Target::from_toml_str(&format!("{MINIMAL}\nworld = 8\n")).unwrap_err();
        assert!(
            matches!(err, PolicyError::Toml(ref m) if m.contains("world")),
            "{err}"
        );
    }

    #[test]
    fn zero_world_size_names_the_field() {
        let err = Target::from_toml_str(&MINIMAL.replace("world_size = 8", "world_size = 0"))
            .unwrap_err();
        assert!(
            matches!(
                err,
                PolicyError::InvalidField {
                    field: "world_size",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("world_size"));
    }

    #[test]
    fn validate_rejects_inconsistent_counts() {
        let mut t = Target::from_toml_str(MINIMAL).unwrap();
        t.group_nodes = 2;
        t.gpus_per_node = 2;
        assert!(matches!(
            t.validate(),
            Err(PolicyError::InvalidField {
                field: "world_size",
                ..
            })
        ));
        t.gpus_per_node = 8;
        t.group_nodes = 9;
        assert!(matches!(
            t.validate(),
            Err(PolicyError::InvalidField {
                field: "group_nodes",
                ..
            })
        ));
        t.group_nodes = 1;
        t.capture_sizes = vec![1, 0];
        assert!(matches!(
            t.validate(),
            Err(PolicyError::InvalidField {
                field: "capture_sizes",
                ..
            })
        ));
        t.capture_sizes = vec![u64::MAX];
        t.num_speculative_tokens = 3;
        assert!(matches!(
            t.validate(),
            Err(PolicyError::InvalidField {
                field: "num_speculative_tokens",
                ..
            })
        ));
        t.num_speculative_tokens = 0;
        t.max_batched_tokens = 0;
        assert!(matches!(
            t.validate(),
            Err(PolicyError::InvalidField {
                field: "max_batched_tokens",
                ..
            })
        ));
    }

    #[test]
    fn toml_round_trip() {
        let t =
            Target::from_toml_str(&format!("{MINIMAL}\nmax_bytes_override = 1048576\n")).unwrap();
        let back = Target::from_toml_str(&t.to_toml_string().unwrap()).unwrap();
        assert_eq!(back, t);
    }

    #[test]
    fn element_bytes() {
        assert_eq!(ActDtype::Bf16.element_bytes(), 2);
        assert_eq!(ActDtype::F16.element_bytes(), 2);
        assert_eq!(ActDtype::F32.element_bytes(), 4);
    }
}
