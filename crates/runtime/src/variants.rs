//! The kernel variants: every combination of kernel, dtype, world size and epilogue
//! that the runtime compiles, with the `-D` defines that select it in `kernels/`.
//!
//! The matrix ([`all`]) is the full product the rewrite pass can ask for:
//! - fused kernels (`arf_fused`): strategy {one-shot, two-shot} x W in
//!   [`WORLD_SIZES`] {2, 4, 8, 16} x dtype {bf16, f16, f32} x every epilogue of
//!   [`all_epilogues`] (all-reduce only; residual add or none, then RMSNorm with
//!   `weight_bias`, then no quant or one of the FP8 / NVFP4 quant forms), keeping only
//!   the epilogues whose quant accepts the dtype ([`Quant::supports`]: NVFP4 is for
//!   16-bit activations). That is 2 x 4 x (17 + 17 + 13) = 376 variants.
//! - local kernels (`arf_local`, the unfused path after the all-reduce), for every
//!   dtype: every norm epilogue of [`all_epilogues`] (residual or none, RMSNorm, any
//!   quant the dtype supports) and every quant alone: 16 + 16 + 12 norm epilogues plus
//!   7 + 7 + 5 quant-only = 63 variants.
//! - the virtual-rank all-reduce of the unfused path (`arf_virtual_allreduce`, W
//!   logical ranks in one device memory), for every W and dtype: 12 variants.
//!
//! Which outputs are live (residual_out, norm_out, quant, scales) is a run-time
//! choice (a null pointer is dead), so "any subset of live outputs" needs no variant
//! of its own. NVFP4 variants are built for sm_100a only ([`Variant::archs`]), every
//! other variant for sm_90a and sm_100a: 826 NVRTC compilations in all, which
//! `tests/kernels_compile.rs` runs (two threads) and checks for zero spills.

use std::fmt;

/// Source of `kernels/arfuse_common.cuh` (included by the other two).
pub const COMMON_HEADER: &str = include_str!("../../../kernels/arfuse_common.cuh");
/// Source of `kernels/allreduce_fused.cu` (entry point `arf_fused`).
pub const FUSED_SOURCE: &str = include_str!("../../../kernels/allreduce_fused.cu");
/// Source of `kernels/unfused.cu` (entry point `arf_local`).
pub const LOCAL_SOURCE: &str = include_str!("../../../kernels/unfused.cu");
/// Source of `kernels/virtual_allreduce.cu` (entry point `arf_virtual_allreduce`).
pub const VIRTUAL_ALLREDUCE_SOURCE: &str = include_str!("../../../kernels/virtual_allreduce.cu");

/// The kernels' enums: the ABI's one definition (`arfuse-abi`), which this module
/// builds its variants from (`ARF_DTYPE`, `ARF_QUANT`, `ARF_STRATEGY` are their
/// `kernel_code`s).
pub use arfuse_abi::{ActDtype, Nvfp4ScaleLayout, Quant, Strategy, WORLD_SIZES};

/// What the kernel does after the all-reduce. Which outputs are live is a run-time
/// choice (null pointer = dead), not part of the variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Epilogue {
    /// Add `residual_in` (else `h` is the all-reduce output).
    pub residual: bool,
    /// RMSNorm with gamma, eps and weight_bias (run-time arguments).
    pub norm: bool,
    /// Quant of the normalised value.
    pub quant: Quant,
}

impl Epilogue {
    /// All-reduce only (FlashInfer pattern 0).
    pub const AR_ONLY: Epilogue = Epilogue {
        residual: false,
        norm: false,
        quant: Quant::None,
    };
    /// Residual add + RMSNorm (pattern 1).
    pub const RES_NORM: Epilogue = Epilogue {
        residual: true,
        norm: true,
        quant: Quant::None,
    };
    /// Short pattern name used in variant names: `ar`, `res_norm`, `norm_fp8tok`,
    /// `res_norm_nvfp4_swz`, ...
    pub fn name(&self) -> String {
        let mut parts = Vec::new();
        if self.residual {
            parts.push("res");
        }
        if self.norm {
            parts.push("norm");
        }
        if self.quant != Quant::None {
            parts.push(self.quant.name());
        }
        if parts.is_empty() {
            "ar".to_string()
        } else {
            parts.join("_")
        }
    }
}

/// Which kernel source a variant is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KernelKind {
    /// `arf_fused` from `allreduce_fused.cu`, for one strategy and world size.
    Fused {
        /// Communication strategy: one of [`Strategy::FUSED`].
        strategy: Strategy,
        /// World size W, one of [`WORLD_SIZES`].
        world: u32,
    },
    /// `arf_local` from `unfused.cu` (no communication).
    Local,
    /// `arf_virtual_allreduce` from `virtual_allreduce.cu`: the all-reduce of the
    /// unfused path on W virtual ranks (no workspace; epilogue all-reduce only).
    VirtualAllReduce {
        /// World size W, one of [`WORLD_SIZES`].
        world: u32,
    },
}

/// One compiled kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Variant {
    /// Kernel and its communication parameters.
    pub kind: KernelKind,
    /// Activation dtype.
    pub dtype: ActDtype,
    /// Epilogue.
    pub epilogue: Epilogue,
}

/// A GPU architecture NVRTC targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Hopper, architecture-specific features (`sm_90a`).
    Sm90a,
    /// Blackwell datacenter, architecture-specific (`sm_100a`, NVRTC >= 12.8).
    Sm100a,
}

impl Arch {
    /// Both architectures checked in CI.
    pub const ALL: [Arch; 2] = [Arch::Sm90a, Arch::Sm100a];
    /// NVRTC architecture name.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Sm90a => "sm_90a",
            Arch::Sm100a => "sm_100a",
        }
    }
    /// Architecture for a compute capability `major * 10 + minor`: 90 and 100 only.
    /// SM 103 (B300), SM 120 and later get `None` (an `sm_100a` cubin does not load on
    /// 10.3; no build for them yet), so the runtime refuses them with a clear error.
    pub fn for_sm(sm: u32) -> Option<Arch> {
        match sm {
            90 => Some(Arch::Sm90a),
            100 => Some(Arch::Sm100a),
            _ => None,
        }
    }
}

impl Variant {
    /// Stable, unique name, e.g. `oneshot_w8_bf16_res_norm_fp8tok`, `local_f16_norm`.
    pub fn name(&self) -> String {
        match self.kind {
            KernelKind::Fused { strategy, world } => format!(
                "{}_w{}_{}_{}",
                strategy.variant_name(),
                world,
                self.dtype.name(),
                self.epilogue.name()
            ),
            KernelKind::Local => format!("local_{}_{}", self.dtype.name(), self.epilogue.name()),
            KernelKind::VirtualAllReduce { world } => {
                format!("vallreduce_w{world}_{}", self.dtype.name())
            }
        }
    }

    /// Entry point name in the compiled module.
    pub fn entry(&self) -> &'static str {
        match self.kind {
            KernelKind::Fused { .. } => "arf_fused",
            KernelKind::Local => "arf_local",
            KernelKind::VirtualAllReduce { .. } => "arf_virtual_allreduce",
        }
    }

    /// Source text of the translation unit.
    pub fn source(&self) -> &'static str {
        match self.kind {
            KernelKind::Fused { .. } => FUSED_SOURCE,
            KernelKind::Local => LOCAL_SOURCE,
            KernelKind::VirtualAllReduce { .. } => VIRTUAL_ALLREDUCE_SOURCE,
        }
    }

    /// The `-D` defines that select this variant (the ABI's own numbers,
    /// [`arfuse_abi::kernel_defines`], come with every compilation on top of these).
    pub fn defines(&self) -> Vec<(String, u32)> {
        let mut d = vec![
            ("ARF_DTYPE".to_string(), self.dtype.kernel_code()),
            (
                "ARF_RESIDUAL".to_string(),
                u32::from(self.epilogue.residual),
            ),
            ("ARF_NORM".to_string(), u32::from(self.epilogue.norm)),
            ("ARF_QUANT".to_string(), self.epilogue.quant.kernel_code()),
        ];
        if let KernelKind::Fused { strategy, world } = self.kind {
            // An unfused "fused kernel" is no variant of the matrix; its missing
            // ARF_STRATEGY makes the source refuse to compile.
            if let Some(code) = strategy.kernel_code() {
                d.push(("ARF_STRATEGY".to_string(), code));
            }
            d.push(("ARF_W".to_string(), world));
        }
        if let KernelKind::VirtualAllReduce { world } = self.kind {
            d.push(("ARF_W".to_string(), world));
        }
        d
    }

    /// Architectures this variant is built for (NVFP4 only on SM100+).
    pub fn archs(&self) -> Vec<Arch> {
        if self.epilogue.quant.needs_sm100() {
            vec![Arch::Sm100a]
        } else {
            Arch::ALL.to_vec()
        }
    }

    /// NVRTC options for `arch` (defines, `--gpu-architecture`, C++17, no fast math
    /// so subnormals survive and division is IEEE).
    pub fn nvrtc_options(&self, arch: Arch, ptxas_verbose: bool) -> Vec<String> {
        let mut o = vec![
            format!("--gpu-architecture={}", arch.name()),
            "--std=c++17".to_string(),
            "-default-device".to_string(),
            // Contract v2: no fused multiply-add (the defaults already give IEEE
            // division and square root and keep subnormals).
            "--fmad=false".to_string(),
        ];
        if ptxas_verbose {
            o.push("--ptxas-options=--verbose".to_string());
        }
        o.extend(arfuse_abi::kernel_defines().iter().map(|d| d.option()));
        for (k, v) in self.defines() {
            o.push(format!("-D{k}={v}"));
        }
        o
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// Every epilogue the rewrite pass can emit: all-reduce only, and residual on/off x
/// RMSNorm x every quant.
pub fn all_epilogues() -> Vec<Epilogue> {
    let mut v = vec![Epilogue::AR_ONLY];
    for residual in [true, false] {
        for quant in Quant::ALL {
            v.push(Epilogue {
                residual,
                norm: true,
                quant,
            });
        }
    }
    v
}

/// The variant matrix (see the module documentation), sorted and without duplicates.
pub fn all() -> Vec<Variant> {
    let mut out = Vec::new();
    for strategy in Strategy::FUSED {
        for world in WORLD_SIZES {
            for dtype in ActDtype::ALL {
                for epilogue in all_epilogues() {
                    if epilogue.quant.supports(dtype) {
                        out.push(Variant {
                            kind: KernelKind::Fused { strategy, world },
                            dtype,
                            epilogue,
                        });
                    }
                }
            }
        }
    }
    for dtype in ActDtype::ALL {
        let local = |epilogue| Variant {
            kind: KernelKind::Local,
            dtype,
            epilogue,
        };
        for e in all_epilogues() {
            if e.norm && e.quant.supports(dtype) {
                out.push(local(e));
            }
        }
        for quant in Quant::ALL {
            if quant != Quant::None && quant.supports(dtype) {
                out.push(local(Epilogue {
                    residual: false,
                    norm: false,
                    quant,
                }));
            }
        }
        for world in WORLD_SIZES {
            out.push(virtual_allreduce(world, dtype));
        }
    }
    out.sort();
    out.dedup();
    out
}

/// The virtual-rank all-reduce of the unfused path for W ranks of `dtype`.
pub fn virtual_allreduce(world: u32, dtype: ActDtype) -> Variant {
    Variant {
        kind: KernelKind::VirtualAllReduce { world },
        dtype,
        epilogue: Epilogue::AR_ONLY,
    }
}

/// Finds the variant for a request; `None` when it is not in the matrix.
pub fn find(kind: KernelKind, dtype: ActDtype, epilogue: Epilogue) -> Option<Variant> {
    let v = Variant {
        kind,
        dtype,
        epilogue,
    };
    all().into_iter().find(|x| *x == v)
}

/// Compiles one variant for one architecture with NVRTC.
///
/// # Errors
/// [`crate::Error::NvrtcMissing`] without NVRTC; [`crate::Error::Compile`] with the
/// log when NVRTC rejects the source; [`crate::Error::Unsupported`] for NVFP4 on
/// sm_90a or sm_100a with an NVRTC older than 12.8.
pub fn compile(
    variant: &Variant,
    arch: Arch,
    ptxas_verbose: bool,
) -> crate::Result<crate::nvrtc::Compiled> {
    if !variant.archs().contains(&arch) {
        return Err(crate::Error::Unsupported(format!(
            "{variant} needs SM100 or later, not {}",
            arch.name()
        )));
    }
    let n = crate::nvrtc::nvrtc()?;
    if arch == Arch::Sm100a && !n.supports_sm100a() {
        return Err(crate::Error::Unsupported(format!(
            "NVRTC {}.{} at {} cannot target sm_100a (needs >= 12.8)",
            n.version().0,
            n.version().1,
            n.path()
        )));
    }
    let mut out = n.compile(
        &variant.name(),
        variant.source(),
        &[("arfuse_common.cuh", COMMON_HEADER)],
        &variant.nvrtc_options(arch, ptxas_verbose),
    );
    if let Err(crate::Error::Compile {
        variant: v,
        arch: a,
        ..
    }) = &mut out
    {
        *v = variant.name();
        *a = arch.name().to_string();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_defines_complete() {
        let all = all();
        let mut names: Vec<String> = all.iter().map(Variant::name).collect();
        names.sort();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "duplicate variant names");
        for v in &all {
            let d = v.defines();
            assert!(d.iter().any(|(k, _)| k == "ARF_DTYPE"));
            if matches!(v.kind, KernelKind::Fused { .. }) {
                assert!(d
                    .iter()
                    .any(|(k, val)| k == "ARF_W" && WORLD_SIZES.contains(val)));
            }
            if v.epilogue.quant.needs_sm100() {
                assert_eq!(v.archs(), vec![Arch::Sm100a]);
                assert_ne!(v.dtype, ActDtype::F32);
            }
        }
    }

    #[test]
    fn matrix_is_the_full_product_of_strategy_world_dtype_and_epilogue() {
        let all = all();
        assert_eq!(all_epilogues().len(), 17);
        let mut fused = 0;
        for s in Strategy::FUSED {
            for w in WORLD_SIZES {
                let k = KernelKind::Fused {
                    strategy: s,
                    world: w,
                };
                for d in ActDtype::ALL {
                    for e in all_epilogues() {
                        let found = find(k, d, e);
                        if e.quant.supports(d) {
                            assert!(found.is_some(), "{s:?} {w} {d:?} {e:?}");
                            fused += 1;
                        } else {
                            assert!(found.is_none(), "{s:?} {w} {d:?} {e:?}");
                        }
                    }
                }
            }
        }
        assert_eq!(fused, 2 * 4 * (17 + 17 + 13));
        let n_fused = all
            .iter()
            .filter(|v| matches!(v.kind, KernelKind::Fused { .. }))
            .count();
        assert_eq!(n_fused, fused, "no fused variant outside the product");
        let n_local = all.iter().filter(|v| v.kind == KernelKind::Local).count();
        assert_eq!(n_local, (16 + 7) + (16 + 7) + (12 + 5));
        // Every norm epilogue the pass can emit has a local kernel (the unfused path).
        for d in ActDtype::ALL {
            for e in all_epilogues().into_iter().filter(|e| e.norm) {
                assert_eq!(
                    find(KernelKind::Local, d, e).is_some(),
                    e.quant.supports(d),
                    "{d:?} {e:?}"
                );
            }
        }
        let n_var = all
            .iter()
            .filter(|v| matches!(v.kind, KernelKind::VirtualAllReduce { .. }))
            .count();
        assert_eq!(n_var, 4 * 3);
        let compiles: usize = all.iter().map(|v| v.archs().len()).sum();
        assert_eq!(compiles, 826);
    }

    #[test]
    fn two_shot_w4_f16_per_token_fp8_is_built() {
        // The case the issue names: it used to be missing, so the runtime could not
        // launch such a fused node.
        let k = KernelKind::Fused {
            strategy: Strategy::TwoShot,
            world: 4,
        };
        let e = Epilogue {
            residual: true,
            norm: true,
            quant: Quant::Fp8PerToken,
        };
        let v = find(k, ActDtype::F16, e).expect("twoshot_w4_f16_res_norm_fp8tok");
        assert_eq!(v.name(), "twoshot_w4_f16_res_norm_fp8tok");
        assert_eq!(v.archs(), Arch::ALL.to_vec());
        let nvfp4 = Epilogue {
            quant: Quant::Nvfp4(Nvfp4ScaleLayout::Linear),
            ..e
        };
        assert!(find(k, ActDtype::F32, nvfp4).is_none());
        assert_eq!(
            find(k, ActDtype::Bf16, nvfp4).unwrap().archs(),
            vec![Arch::Sm100a]
        );
    }
}
