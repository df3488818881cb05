//! arfuse-runtime: runs the fused all-reduce -> residual add -> RMSNorm (-> quant)
//! node that the arfuse planner emits.
//!
//! The only crate of the workspace that links CUDA (cudarc, driver API, dynamic
//! loading) and NVRTC (loaded at run time by [`nvrtc`]). Nothing here needs CUDA to
//! build; every GPU entry point returns [`Error`] when the driver or NVRTC is absent.
//!
//! Running a lowered graph's fused node on a [`device::Device`] (a GPU with W virtual
//! ranks, [`cuda::Gpu`], or the CPU, [`host::HostDevice`]):
//!
//! 1. [`node::NodeKernels::from_graph`] (graph, node id, world size): the kernel
//!    variant for every token count of the node's plan, the plan's workspace, the
//!    scalar arguments; everything the kernels cannot do is an error here, at load time.
//!    [`runner::Runner::for_graph`] does this for every fused node of a graph.
//! 2. Open a device ([`cuda::Gpu::open`], or [`host::HostDevice::new`]), then
//!    [`runner::Runner::new`] + [`runner::Runner::add`] (or `for_graph`) and
//!    [`runner::Runner::prepare`] outside any capture: creates the workspaces (plan's
//!    backend first, then trtllm, then unfused; failures cached; nodes carrying the
//!    same workspace share one) and loads every kernel.
//! 3. Allocate the tensors ([`device::Device::alloc`]; [`runner::NodeTensors`] says
//!    what each holds; W slices at a fixed per-rank stride), then
//!    [`runner::Runner::launch`] per call, or [`runner::Runner::capture`] once per
//!    capture size and [`runner::Runner::replay`]; [`runner::Runner::sync`] waits and
//!    reports a kernel's error word as an error naming the node.
//!
//! Module map:
//! - [`device`]: the [`device::Device`] trait (workspaces, kernel loading, launches,
//!   capture and replay, error words, memory) and the launch arguments and checks both
//!   devices share.
//! - [`node`]: IR fused node + plan -> variants per token count, the plan's workspace.
//! - [`runner`]: the fused nodes of a graph end to end on any device.
//! - [`cuda`]: the CUDA device (probe, allocations, virtual-rank workspaces, cooperative
//!   launches, CUDA graphs); the only module that uses cudarc.
//! - [`host`]: the host device: the same kernel sources compiled with the machine's
//!   C++ compiler and run on the CPU (CTAs as OS threads, CUDA threads as fibers, each
//!   rank its own launch stream), for testing the kernels without a GPU.
//! - [`group`]: real ranks: the process group ([`group::Group`]; [`group::SocketGroup`]
//!   for W processes of this machine) and the all-or-nothing step of collective creation.
//! - [`workspace`]: the backend fallback chain with cached failures (device-independent).
//! - [`variants`]: the kernel variants in `kernels/` and their NVRTC compilation.
//! - [`nvrtc`]: finding and calling NVRTC (PyPI wheel, CUDA toolkit, or system).
//! - [`check`]: the device-independent half of the GPU check (cases, inputs, expected
//!   outputs from arfuse-reference's contract, comparison).
//!
//! Rounding contract of every kernel: `arfuse_reference::contract` (the kernels'
//! side: `kernels/arfuse_common.cuh`).

pub mod check;
pub mod cuda;
pub mod device;
pub mod error;
pub mod group;
pub mod host;
pub mod node;
pub mod nvrtc;
pub mod runner;
pub mod variants;
pub mod workspace;

pub use error::{Error, Result};
