//! The host device: the real kernel sources of `kernels/`, compiled for the CPU with
//! the machine's C++ compiler and run over host memory, so that the kernels' logic is
//! tested without a GPU (issue 18). Needs no CUDA driver and no NVRTC.
//!
//! - [`compile`]: one variant (the `-D` defines NVRTC gets, plus `-DARF_HOST=1`) into
//!   a cached shared object; [`Build::Plain`] and [`Build::Sanitized`] (ASan + UBSan).
//! - [`launch`]: one OS thread per CTA, the CUDA threads of a CTA as cooperative
//!   fibers (`kernels/arfuse_host.h`), all CTAs of a launch at once; W ranks as W
//!   independent launch streams with random delays and CTA orders ([`run_ranks`]).
//! - [`memory`]: aligned host buffers and the W ranks' workspaces.
//! - [`device`]: [`HostDevice`], the host implementation of [`crate::device::Device`]
//!   (what [`crate::runner::Runner`] runs on without a GPU): every rank its own launch
//!   stream, launches queued until a sync, capture and replay, memory it checks every
//!   launch against.
//! - [`ranks`]: real ranks: W processes of a [`crate::group::Group`] over a workspace in
//!   POSIX shared memory ([`RankWorkspace`], created collectively, all or nothing).
//! - [`cases`]: the GPU check's cases ([`crate::check`]) on the host: buffers, fused
//!   calls with every rank launched separately, the unfused path.
//! - [`Conversions`]: the software `cvt` conversions of the host build, callable from
//!   Rust (their exhaustive tests).
//!
//! What the host run shows and what it cannot: every index, rounding, epilogue and
//! protocol step of the CUDA code runs as written, under schedules the executor
//! varies (CTA start order and delays, fiber order per pass, rank skew), with the
//! sanitizers finding out-of-bounds and undefined behaviour; x86-64 is TSO and the
//! PTX memory model is weaker, so missing fences are not found here.

pub mod cases;
pub mod compile;
pub mod device;
pub mod launch;
pub mod memory;
pub mod ranks;

pub use compile::{Build, Compiler};
pub use device::{HostDevice, HostDeviceWorkspace, HostGraph, HostMem, HostOptions};
pub use launch::{run_rank_set, run_ranks, HostKernel, LaunchOptions, RankLaunch, RankTrace};
pub use memory::{HostBuffer, HostWorkspace, Slots};
pub use ranks::{RankOptions, RankWorkspace};

use crate::error::{Error, Result};

type F32ToU32 = unsafe extern "C" fn(f32) -> u32;
type U32ToF32 = unsafe extern "C" fn(u32) -> f32;
type PairToU32 = unsafe extern "C" fn(f32, f32) -> u32;

/// The host build's software `cvt` conversions (`kernels/arfuse_host.h`, called through
/// the kernels' helpers in `kernels/arfuse_host_probe.cpp`).
pub struct Conversions {
    f32_to_bf16: F32ToU32,
    f32_to_f16: F32ToU32,
    f16_to_f32: U32ToF32,
    e4m3x2: PairToU32,
    e2m1x2: PairToU32,
    e4m3_to_f32: U32ToF32,
    _lib: libloading::Library,
}

impl Conversions {
    /// Compiles (cached) and loads the probe.
    ///
    /// # Errors
    /// As [`Compiler::kernel`].
    pub fn load(compiler: &Compiler) -> Result<Conversions> {
        let path = compiler.probe_object()?;
        let bad = |msg: String| Error::HostKernel {
            variant: "probe".into(),
            msg,
        };
        // SAFETY: an object this crate compiled from kernels/arfuse_host_probe.cpp.
        let lib = unsafe { libloading::Library::new(&path) }
            .map_err(|e| bad(format!("loading {}: {e}", path.display())))?;
        // SAFETY: the probe's functions have these C signatures.
        unsafe {
            let f = |name: &[u8]| -> Result<*const ()> {
                let s: libloading::Symbol<*const ()> =
                    lib.get(name).map_err(|e| bad(format!("{e}")))?;
                Ok(*s)
            };
            let a = f(b"arf_probe_f32_to_bf16\0")?;
            let b = f(b"arf_probe_f32_to_f16\0")?;
            let c = f(b"arf_probe_f16_to_f32\0")?;
            let d = f(b"arf_probe_e4m3x2\0")?;
            let e = f(b"arf_probe_e2m1x2\0")?;
            let g = f(b"arf_probe_e4m3_to_f32\0")?;
            Ok(Conversions {
                f32_to_bf16: std::mem::transmute::<*const (), F32ToU32>(a),
                f32_to_f16: std::mem::transmute::<*const (), F32ToU32>(b),
                f16_to_f32: std::mem::transmute::<*const (), U32ToF32>(c),
                e4m3x2: std::mem::transmute::<*const (), PairToU32>(d),
                e2m1x2: std::mem::transmute::<*const (), PairToU32>(e),
                e4m3_to_f32: std::mem::transmute::<*const (), U32ToF32>(g),
                _lib: lib,
            })
        }
    }

    /// `cvt.rn.bf16.f32` (bits).
    pub fn f32_to_bf16(&self, x: f32) -> u16 {
        // SAFETY: a pure function of its argument.
        unsafe { (self.f32_to_bf16)(x) as u16 }
    }
    /// `cvt.rn.f16.f32` (bits), through the kernels' `arf_f32_to_bits`.
    pub fn f32_to_f16(&self, x: f32) -> u16 {
        // SAFETY: a pure function of its argument.
        unsafe { (self.f32_to_f16)(x) as u16 }
    }
    /// `cvt.f32.f16`, through the kernels' `arf_bits_to_f32`.
    pub fn f16_to_f32(&self, h: u16) -> f32 {
        // SAFETY: a pure function of its argument.
        unsafe { (self.f16_to_f32)(u32::from(h)) }
    }
    /// `cvt.rn.satfinite.e4m3x2.f32` through `arf_e4m3x2(lo, hi)`: `lo`'s code in bits
    /// 0..8, `hi`'s in bits 8..16.
    pub fn e4m3x2(&self, lo: f32, hi: f32) -> u16 {
        // SAFETY: a pure function of its arguments.
        unsafe { (self.e4m3x2)(lo, hi) as u16 }
    }
    /// `cvt.rn.satfinite.e2m1x2.f32` through `arf_e2m1x2(lo, hi)`: `lo`'s code in bits
    /// 0..4, `hi`'s in bits 4..8.
    pub fn e2m1x2(&self, lo: f32, hi: f32) -> u8 {
        // SAFETY: a pure function of its arguments.
        unsafe { (self.e2m1x2)(lo, hi) as u8 }
    }
    /// The kernels' `arf_e4m3_to_f32` (exact value of an e4m3 code).
    pub fn e4m3_to_f32(&self, b: u8) -> f32 {
        // SAFETY: a pure function of its argument.
        unsafe { (self.e4m3_to_f32)(u32::from(b)) }
    }
}
