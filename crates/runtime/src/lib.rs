//! arfuse-runtime: runs the fused all-reduce -> residual add -> RMSNorm (-> quant)
//! node that the arfuse planner emits.
//!
//! The only crate of the workspace that links CUDA (cudarc, driver API, dynamic
//! loading) and NVRTC (loaded at run time by [`nvrtc`]). Nothing here needs CUDA to
//! build; every GPU entry point returns [`Error`] when the driver or NVRTC is absent.
//!
//! Module map:
//! - [`variants`]: the kernel variants in `kernels/` and their NVRTC compilation.
//! - [`nvrtc`]: finding and calling NVRTC (PyPI wheel, CUDA toolkit, or system).
//! - [`protocol`]: host model of the one-shot / two-shot synchronisation protocols
//!   (Rust threads as ranks, same layouts, sentinels and counters as the kernels).
//! - [`layout`]: workspace and output byte sizes, with checked arithmetic.
//!
//! Rounding contract of every kernel: see `kernels/arfuse_common.cuh` and
//! [`protocol::allreduce_reference`].

pub mod check;
pub mod cuda;
pub mod error;
pub mod layout;
pub mod node;
pub mod nvrtc;
pub mod protocol;
pub mod runner;
pub mod variants;
pub mod workspace;

pub use error::{Error, Result};
