//! # arfuse-policy
//!
//! Pure plan-time policy for fusing all-reduce -> residual add -> RMSNorm (-> quant) in
//! tensor-parallel graphs: which backend, which strategy for each token count T, and
//! how large a workspace; proven for every T the graph can run with, with a reason a
//! person can act on for every outcome. No egg, no CUDA, no IR: a graph compiler can
//! use it alone. Facts and tables come from `docs/domain.md` §3-§5 (cited on each
//! item).
//!
//! ## The model
//!
//! 1. A [`Target`] describes the all-reduce group (SM, W, nodes, multicast,
//!    interconnect), the engine (dtype, max batched tokens, capture sizes,
//!    compile-range boundaries, speculative tokens, deterministic mode, requested
//!    backend, size cap) and the kernels planned for ([`KernelLibrary`]: arfuse's own,
//!    the default, or FlashInfer's). Load it from TOML or a named preset.
//! 2. [`resolve_backend`] picks `mnnvl`, `trtllm` or no fusion (§3). An explicit
//!    backend the machine cannot run is an error naming the fix.
//! 3. The size table gives the largest eligible per-rank input; with the widest hidden
//!    size H sharing the workspace it gives `max_token_num` M (§4). A missing table
//!    entry is a visible "no fusion" reason.
//! 4. One [`Workspace`] per (group, backend, dtype) at the widest H, or given from
//!    outside. FlashInfer's kernels: FlashInfer's sizing for M (§5). arfuse's kernels:
//!    exactly what the dispatch uses, in arfuse's one layout ([`ArfuseLayout`]: a state
//!    block and three Lamport buffers that both strategies share), which the runtime
//!    allocates from this same definition. Capacity is always one buffer, decided by
//!    one rule ([`Workspace::misfit`]).
//! 5. For each T in `1..=max planned`, the preferred strategy (arfuse's kernels: one-shot
//!    iff `T*H*W*e <= 1 MiB`; FlashInfer's: vLLM's selector, which defers to
//!    FlashInfer's AUTO rule for mnnvl; §4) is used only when the call fits; otherwise
//!    the other fused strategy (FlashInfer's two-shot only for T >= W), otherwise unfused. In
//!    deterministic mode, arfuse's kernels keep this dispatch (every path reduces in the
//!    contract's one order; an unfused T must then be served by arfuse-runtime's own
//!    path, [`UnfusedAllReduce`]), FlashInfer's are one-shot for every T or no fusion.
//! 6. The result is a [`Plan`] of token ranges, each with its bytes and reason, and
//!    [`verify`] re-checks any plan against any workspace.
//!
//! ## Entry points
//!
//! - [`Target::from_toml_str`], [`Target::preset`], [`Target::preset_names`],
//!   [`Target::validate`]
//! - [`resolve_backend`] -> [`BackendDecision`]
//! - [`plan()`], [`plan_with_workspace`] -> [`Plan`]; [`Plan::strategy_for`],
//!   [`Plan::dispatch_for_hidden`], [`Plan::strategy_for_hidden`],
//!   [`Plan::with_strategy`], [`Plan::trigger_completion_at_end`], [`Plan::summary`]
//! - [`verify`] -> `Vec<`[`Violation`]`>`
//! - [`Workspace::arfuse`], [`Workspace::arfuse_layout`], [`Workspace::flashinfer`],
//!   [`Workspace::flashinfer_mnnvl`], [`Workspace::flashinfer_trtllm`],
//!   [`Workspace::flashinfer_mnnvl_from_buffer`],
//!   [`Workspace::flashinfer_mnnvl_from_allocation`], [`required_bytes`],
//!   [`Workspace::misfit`], [`Workspace::capacity_tokens`]
//! - Rules and tables: [`vllm_one_shot_selector`], [`mnnvl_auto_one_shot`],
//!   [`flashinfer_trtllm_auto_one_shot`], [`preferred_strategy`],
//!   [`trigger_completion_at_end`], [`max_bytes_entry`], [`trtllm_one_shot_bound`],
//!   [`max_token_num`], [`trtllm_lamport_max_tokens`]
//!
//! ```
//! use arfuse_policy::{plan, KernelLibrary, Strategy, Target};
//!
//! // The seed failure's machine: 8x H200, GLM-5 style H = 6144, bf16.
//! let target = Target::preset("h200-sxm-x8")?;
//! let p = plan(&target, &[6144])?;
//! assert_eq!(p.max_token_num, 42);
//! assert_eq!(p.strategy_for(40)?, Strategy::TwoShot); // one-shot would need 3,932,160
//! // arfuse's kernels: one buffer for one-shot to T=10 and two-shot to 42.
//! let ws = p.workspace.as_ref().unwrap();
//! assert_eq!(ws.lamport_buffer_bytes, 1_179_648);
//! assert_eq!(ws.total_bytes_per_rank, 256 + 3 * 1_179_648);
//! // FlashInfer's kernels, sized by FlashInfer's formulas (domain.md §5).
//! let fi = Target { kernels: KernelLibrary::Flashinfer, ..target };
//! let p = plan(&fi, &[6144])?;
//! assert_eq!(p.workspace.as_ref().unwrap().total_bytes_per_rank, 3 * 1_179_648 + 2048);
//! # Ok::<(), arfuse_policy::PolicyError>(())
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// What arfuse's kernels can run (`arfuse-abi`): the enums and limits this crate plans
/// with, re-exported so that a user of the policy alone has them.
pub use arfuse_abi as abi;

mod backend;
mod bytes;
mod error;
mod limits;
mod plan;
mod presets;
mod strategy;
mod target;
mod verify;
mod workspace;

pub use backend::{
    backend_supports_world_size, nvfp4_quant_supported, resolve_backend, sm_family, sm_supported,
    Backend, BackendDecision, MNNVL_MAX_WORLD_SIZE, MNNVL_MIN_WORLD_SIZE, TRTLLM_WORLD_SIZES,
};
pub use bytes::MIB;
pub use error::{PolicyError, Result};
pub use limits::{
    arfuse_block_threads, check_hidden, group_quant_unsupported_reason, max_bytes_entry,
    max_token_num, row_bytes, row_unsupported_reason, trtllm_lamport_max_tokens,
    trtllm_one_shot_bound, FLASHINFER_MAX_ROW_BYTES, LAMPORT_MAX_COMM_BYTES, MAX_BYTES_TABLE,
    TRTLLM_ONE_SHOT_TABLE,
};
pub use plan::{
    plan, plan_with_workspace, DispatchRange, Plan, PointSource, SiteDispatch, TokenPoint,
};
pub use presets::{
    preset_for_world_size, presets_with_world_size, Preset, DEFAULT_PRESET_FAMILY, PRESETS,
};
pub use strategy::{
    flashinfer_trtllm_auto_one_shot, mnnvl_auto_one_shot, preferred_strategy,
    trigger_completion_at_end, vllm_one_shot_selector, Strategy, VllmSelection,
    FLASHINFER_TRTLLM_AUTO_MIB, MNNVL_AUTO_ONE_SHOT_BYTES, PDL_ADVANCE_LAUNCH_TOKENS,
};
pub use target::{
    ActDtype, Interconnect, KernelLibrary, RequestedBackend, Target, UnfusedAllReduce,
};
pub use verify::{verify, Violation};
pub use workspace::{
    required_bytes, ArfuseLayout, Misfit, Workspace, LAMPORT_ALIGN_BYTES, MNNVL_SIGNAL_PAD_BYTES,
    TRTLLM_BARRIER_FLAG_COUNT, TRTLLM_FLAG_BYTES, TWO_SHOT_STAGES,
};
