//! The device-independent half of the GPU check (`gpu_check`, `cargo xtask gpu-check`):
//! the cases, their inputs, the outputs arfuse-reference's rounding contract says the
//! kernels must write, the output byte sizes, the comparison, and the byte counts the
//! bandwidth figures divide by. Everything here runs (and is tested) on the CPU; the
//! binary only adds the launches.
//!
//! What "correct" means for a kernel (arfuse rounding contract v3,
//! `arfuse_reference::contract`):
//! - the all-reduce output, `residual_out` and `norm_out`: bit-exact against the
//!   contract in the kernels' sum order (`SumOrder::KernelTree`: the RMSNorm sum of
//!   squares in their block tree, which depends on H only);
//! - quant data and scales: bit-exact against the contract's quant applied to the
//!   kernel's `norm_out` (which equals the contract's), including the zeroed padding
//!   of the packed UE8M0 and swizzled NVFP4 scale layouts;
//! - a run with only some outputs live writes exactly the same bytes to the live
//!   outputs as the run with all of them, and never touches the dead ones
//!   ([`compare_partial`]).

use crate::error::{Error, Result};
use crate::variants::{ActDtype, Epilogue, KernelKind, Quant, Strategy, Variant};
use arfuse_reference::contract;
use arfuse_reference::numerics::quant::{self as rq, GroupScales};
use arfuse_reference::numerics::FloatFormat;
use arfuse_reference::ReferenceError;
use half::{bf16, f16};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

/// The name of the contract the kernels are checked against.
pub use arfuse_reference::contract::CONTRACT_NAME as CONTRACT;

/// Token counts the check runs (issue 9): decode sizes, the seed bug's 40 and 42,
/// and a prefill size.
pub const TOKENS: [u32; 7] = [1, 7, 16, 40, 42, 128, 1024];
/// World sizes the check runs on virtual ranks.
pub const WORLDS: [u32; 3] = [2, 4, 8];
/// RMSNorm epsilon of every case.
pub const EPS: f64 = 1e-6;
/// Static FP8 dequant scale (2^-6): normalised values above 7 in magnitude saturate,
/// so the saturation path runs.
pub const STATIC_FP8_SCALE: f32 = 0.015_625;
/// NVFP4 global scale: block scales land mid-range of e4m3; the all-zero block of
/// token 0 exercises `SF == 0`.
pub const NVFP4_GLOBAL_SCALE: f32 = 64.0;
/// Byte written into every output buffer before a run, so outputs a kernel should
/// have written (or must not have written) are told apart from old data.
pub const FILL_BYTE: u8 = 0xA5;

fn reference(e: ReferenceError) -> Error {
    Error::Invalid(format!("reference: {e}"))
}

fn usize_of(v: u64, what: &'static str) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::Overflow(what))
}

/// One correctness case: one fused kernel variant at one token count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Case {
    /// Communication strategy.
    pub strategy: Strategy,
    /// World size W (virtual ranks).
    pub world: u32,
    /// Activation dtype.
    pub dtype: ActDtype,
    /// Epilogue (residual, RMSNorm, quant).
    pub epilogue: Epilogue,
    /// Tokens T.
    pub tokens: u32,
    /// Hidden size H (elements).
    pub hidden: u32,
    /// RMSNorm weight offset: 0, or 1 for the Gemma form.
    pub weight_bias: u32,
    /// The RMSNorm weight is f32 (the Gemma form `1 + w.float()`), not the activation
    /// dtype.
    pub gamma_f32: bool,
    /// The RMSNorm rounds `h * r` to the activation dtype before the weight multiply
    /// (`NormRounding::Twice`, the Llama order).
    pub norm_round_twice: bool,
    /// The RMSNorm normalises the unrounded f32 sum of the all-reduce output and the
    /// residual (`NormInput::F32Sum`).
    pub norm_f32_sum: bool,
}

impl Case {
    /// The fused kernel variant the case launches.
    pub fn variant(&self) -> Variant {
        Variant {
            kind: KernelKind::Fused {
                strategy: self.strategy,
                world: self.world,
            },
            dtype: self.dtype,
            epilogue: self.epilogue,
        }
    }

    /// Short pattern name: `ar`, `res_norm`, `norm_fp8tok`, ...
    pub fn pattern(&self) -> String {
        self.epilogue.name()
    }

    /// Checks the case is one the kernels support.
    ///
    /// # Errors
    /// [`Error::Invalid`] for T = 0, W outside {2, 4, 8, 16}, H * e not a multiple of 16,
    /// a group quant with H not a multiple of 128, NVFP4 with H not a multiple of 16 or
    /// f32 activations, a weight_bias other than 0 or 1.
    pub fn validate(&self) -> Result<()> {
        if self.tokens == 0 {
            return Err(Error::Invalid("a case needs T >= 1".into()));
        }
        if !self.strategy.is_fused() {
            return Err(Error::Invalid("a case runs a fused strategy".into()));
        }
        // What the kernels run: the ABI's rules, as the planner and the node check.
        if let Some(why) = arfuse_abi::world_unsupported(self.world) {
            return Err(Error::Invalid(why));
        }
        if let Some(why) = arfuse_abi::row_unsupported(u64::from(self.hidden), self.dtype) {
            return Err(Error::Invalid(why));
        }
        if let Some(why) = self
            .epilogue
            .quant
            .unsupported(u64::from(self.hidden), self.dtype)
        {
            return Err(Error::Invalid(why));
        }
        // The kernels' block-size limit (H * e <= 64 KiB).
        crate::device::block_size(self.hidden, self.dtype)?;
        if self.weight_bias > 1 {
            return Err(Error::Invalid("weight_bias must be 0 or 1".into()));
        }
        if self.gamma_f32 && !self.epilogue.norm {
            return Err(Error::Invalid("an f32 weight needs an RMSNorm".into()));
        }
        if self.norm_round_twice && !self.epilogue.norm {
            return Err(Error::Invalid("a norm rounding needs an RMSNorm".into()));
        }
        if self.norm_f32_sum && !(self.epilogue.norm && self.epilogue.residual) {
            return Err(Error::Invalid(
                "normalising the f32 sum needs a residual and an RMSNorm".into(),
            ));
        }
        Ok(())
    }

    /// Elements of one rank's `[T, H]` activation.
    pub fn elements(&self) -> Result<usize> {
        usize_of(
            u64::from(self.tokens) * u64::from(self.hidden),
            "T * H elements",
        )
    }

    /// Bytes of each output of ONE rank (0 = the kernel has no such output).
    ///
    /// # Errors
    /// [`Error::Overflow`] on absurd sizes; [`Error::Invalid`] for an invalid case.
    pub fn output_bytes(&self) -> Result<OutputBytes> {
        self.validate()?;
        let (t, h) = (u64::from(self.tokens), u64::from(self.hidden));
        let act = t
            .checked_mul(h)
            .and_then(|v| v.checked_mul(self.dtype.element_bytes()))
            .ok_or(Error::Overflow("activation bytes"))?;
        let (quant, scale) = quant_bytes_of(self.epilogue.quant, self.tokens, self.hidden)?;
        Ok(OutputBytes {
            out: act,
            residual_out: if self.epilogue.norm { act } else { 0 },
            quant,
            scale,
        })
    }

    /// One line naming the case, e.g. `oneshot W=8 bf16 res_norm_fp8tok T=42`.
    pub fn label(&self) -> String {
        format!(
            "{} W={} {} {} T={}",
            self.strategy.name(),
            self.world,
            self.dtype.name(),
            self.pattern(),
            self.tokens
        )
    }
}

/// Bytes per rank of the quant data and the quant scales (padding included) that
/// `quant` writes for `tokens` tokens of `hidden` elements, in the kernels' layouts
/// (`arfuse_reference::numerics::quant`'s sizes: packed UE8M0 as vLLM allocates it,
/// swizzled NVFP4 padded to 128 x 4); `(0, 0)` without a quant.
///
/// # Errors
/// [`Error::Overflow`] on absurd sizes; reference errors for shapes the layout refuses.
pub fn quant_bytes_of(quant: Quant, tokens: u32, hidden: u32) -> Result<(u64, u64)> {
    let (t, h) = (u64::from(tokens), u64::from(hidden));
    let th = t.checked_mul(h).ok_or(Error::Overflow("T * H"))?;
    Ok(match quant {
        Quant::None => (0, 0),
        Quant::Fp8Static => (th, 0),
        Quant::Fp8PerToken => (th, 4 * t),
        Quant::Fp8Group(layout) => (
            th,
            rq::group_scale_bytes(t, h, arfuse_abi::FP8_GROUP_SIZE, layout).map_err(reference)?,
        ),
        Quant::Nvfp4(layout) => (
            rq::nvfp4_data_bytes(t, h).map_err(reference)?,
            rq::nvfp4_scale_bytes(t, h, layout).map_err(reference)?,
        ),
    })
}

/// Every case of the full check: strategy x W in [`WORLDS`] x dtype x every epilogue
/// the pass emits (`variants::all_epilogues`, NVFP4 only for 16-bit activations and
/// only when `nvfp4` is true, i.e. on SM100+) x T in [`TOKENS`], at hidden size
/// `hidden`. Cases whose H does not suit a quant (group quant needs H % 128 == 0) are
/// left out.
pub fn all_cases(hidden: u32, nvfp4: bool) -> Vec<Case> {
    cases_for_tokens(hidden, nvfp4, &TOKENS)
}

/// [`all_cases`] with another list of token counts.
pub fn cases_for_tokens(hidden: u32, nvfp4: bool, token_counts: &[u32]) -> Vec<Case> {
    let mut out = Vec::new();
    for world in WORLDS {
        for dtype in ActDtype::ALL {
            for epilogue in crate::variants::all_epilogues() {
                if epilogue.quant.needs_sm100() && !nvfp4 {
                    continue;
                }
                // Strategies alternate call by call on one workspace (a counter
                // shared between them deadlocked public code).
                for &tokens in token_counts {
                    for strategy in Strategy::FUSED {
                        let c = Case {
                            strategy,
                            world,
                            dtype,
                            epilogue,
                            tokens,
                            hidden,
                            // The Gemma form (offset weight in f32) on the
                            // residual-free norms, so both weight forms run with
                            // every quant; the two-rounding Llama order on the
                            // two-shot residual norms, so both roundings do too.
                            weight_bias: u32::from(epilogue.norm && !epilogue.residual),
                            gamma_f32: epilogue.norm && !epilogue.residual,
                            norm_round_twice: epilogue.norm
                                && epilogue.residual
                                && strategy == Strategy::TwoShot,
                            // vLLM's native form (the norm of the unrounded f32
                            // sum) on the residual norms at W = 2, 8 and 16, both
                            // strategies and roundings; the rounded residual at W = 4.
                            norm_f32_sum: epilogue.norm && epilogue.residual && world != 4,
                        };
                        if c.validate().is_ok() {
                            out.push(c);
                        }
                    }
                }
            }
        }
    }
    out
}

/// The arfuse workspace (trtllm mapping: virtual ranks on one device) whose ONE Lamport
/// buffer holds either strategy at every T up to `max_tokens` at `hidden`: the larger of
/// the policy's one-shot and two-shot needs at `max_tokens` (both grow with T). Used by
/// the GPU check and the host device's tests.
///
/// # Errors
/// [`Error::Invalid`] when the policy refuses the sizes (e.g. a buffer above the
/// Lamport limit).
pub fn workspace_for(
    world: u32,
    dtype: ActDtype,
    hidden: u32,
    max_tokens: u32,
) -> Result<arfuse_policy::Workspace> {
    use arfuse_policy::{Backend, KernelLibrary, Workspace};
    let invalid = |e: arfuse_policy::PolicyError| Error::Invalid(e.to_string());
    let need = |s| {
        arfuse_policy::required_bytes(
            KernelLibrary::Arfuse,
            Backend::Trtllm,
            s,
            u64::from(max_tokens),
            u64::from(hidden),
            world,
            dtype,
        )
        .map_err(invalid)
    };
    let need = need(arfuse_policy::Strategy::OneShot)?.max(need(arfuse_policy::Strategy::TwoShot)?);
    Workspace::arfuse(
        Backend::Trtllm,
        world,
        u64::from(hidden),
        dtype,
        Some(u64::from(max_tokens)),
        Workspace::arfuse_buffer_for(need).map_err(invalid)?,
    )
    .map_err(invalid)
}

/// The IR fused node that runs `case`'s epilogue, as the rewrite pass writes it: RMSNorm
/// with [`EPS`], the case's weight form (f32 offset weight when `gamma_f32`) and norm
/// rounding, every output the case has, and a plan over `workspace` whose dispatch
/// ranges are `dispatch` (`(first T, last T, strategy or None for unfused)`, from
/// T = 1 without gaps); returned as the runtime's launch description of node `id` for
/// world size `case.world`. The case's own strategy and T play no part.
///
/// # Errors
/// [`Error::Invalid`] for an all-reduce-only case (a fused node always has an RMSNorm);
/// as [`crate::node::NodeKernels::new`].
pub fn node_for(
    case: &Case,
    id: &str,
    workspace: &arfuse_policy::Workspace,
    dispatch: &[(u32, u32, Strategy)],
) -> Result<crate::node::NodeKernels> {
    use arfuse_ir::{DType, FusedOutput, FusedQuant};
    let e = case.epilogue;
    if !e.norm {
        return Err(Error::Invalid(format!(
            "{}: a fused node always ends in an RMSNorm",
            case.label()
        )));
    }
    let quant = FusedQuant::from(e.quant);
    let mut outputs = vec![FusedOutput::Norm, FusedOutput::Residual];
    if e.quant != Quant::None {
        outputs.push(FusedOutput::Quant);
        if e.quant != Quant::Fp8Static {
            outputs.push(FusedOutput::Scale);
        }
    }
    let attrs = arfuse_ir::FusedAllReduceNorm {
        group: "tp".into(),
        eps: EPS,
        weight_bias: f64::from(case.weight_bias),
        norm_rounding: if case.norm_round_twice {
            arfuse_ir::NormRounding::Twice
        } else {
            arfuse_ir::NormRounding::Once
        },
        norm_input: if case.norm_f32_sum {
            arfuse_ir::NormInput::F32Sum
        } else {
            arfuse_ir::NormInput::Residual
        },
        residual: e.residual,
        quant,
        outputs,
        plan: Some(arfuse_ir::FusedPlan {
            pattern_code: 0,
            max_token_num: dispatch
                .iter()
                .filter(|r| r.2.is_fused())
                .map(|r| u64::from(r.1))
                .max()
                .unwrap_or(0),
            workspace: workspace.clone(),
            dispatch: dispatch
                .iter()
                .map(|&(lo, hi, s)| arfuse_ir::DispatchRange {
                    min_tokens: u64::from(lo),
                    max_tokens: u64::from(hi),
                    strategy: s,
                    required_bytes: 0,
                })
                .collect(),
        }),
    };
    crate::node::NodeKernels::new(
        id,
        &attrs,
        DType::of_activation(case.dtype),
        u64::from(case.hidden),
        DType::of_activation(gamma_dtype(case)),
        case.world,
    )
}

/// Bytes of each output of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutputBytes {
    /// `out`: the RMSNorm output (or the all-reduce output without norm), `T*H*e`.
    pub out: u64,
    /// `residual_out`, `T*H*e` (0 for all-reduce only).
    pub residual_out: u64,
    /// Quant data: `T*H` (FP8) or `T*H/2` (NVFP4).
    pub quant: u64,
    /// Quant scales in their layout (padding included).
    pub scale: u64,
}

/// The inputs of one case: per-rank activations and residuals as raw little-endian
/// bytes of the activation dtype, the RMSNorm weight and the fp32 scalar.
#[derive(Debug, Clone, PartialEq)]
pub struct Inputs {
    /// `x[r]`: rank r's all-reduce input, `[T, H]`.
    pub x: Vec<Vec<u8>>,
    /// `residual[r]`: rank r's residual, `[T, H]` (empty without residual).
    pub residual: Vec<Vec<u8>>,
    /// RMSNorm weight `[H]` in the activation dtype, or f32 when the case says so.
    pub gamma: Vec<u8>,
    /// fp32 scalar input: static FP8 scale or NVFP4 global scale (0 otherwise).
    pub scale_in: f32,
}

/// Encodes f32 values (each exactly representable) as little-endian `dtype` bytes.
pub fn encode(dtype: ActDtype, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * (dtype.element_bytes() as usize));
    for &v in values {
        match dtype {
            ActDtype::Bf16 => out.extend(bf16::from_f32(v).to_bits().to_le_bytes()),
            ActDtype::F16 => out.extend(f16::from_f32(v).to_bits().to_le_bytes()),
            ActDtype::F32 => out.extend(v.to_bits().to_le_bytes()),
        }
    }
    out
}

/// Decodes little-endian `dtype` bytes to f32 (exact widening). Trailing bytes that
/// do not form a whole element are ignored.
pub fn decode(dtype: ActDtype, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        ActDtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        ActDtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        ActDtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_bits(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
    }
}

/// The smallest-magnitude negative subnormal of a dtype (its bit pattern is the
/// sentinel's plus one: the value a float compare under FTZ confuses with -0.0).
pub fn negative_subnormal(dtype: ActDtype) -> f32 {
    match dtype {
        ActDtype::Bf16 => bf16::from_bits(0x8001).to_f32(),
        ActDtype::F16 => f16::from_bits(0x8001).to_f32(),
        ActDtype::F32 => f32::from_bits(0x8000_0001),
    }
}

/// A random value of `dtype` drawn from its bits: 1/32 -0.0, 1/32 the smallest
/// negative subnormal, otherwise `+-(1 + m) * 2^k` with `k` in -9..=0 and `m` on the
/// dtype's mantissa grid (at most 22 bits), so every value is exact in the dtype.
fn random_value(dtype: ActDtype, rng: &mut SmallRng) -> f32 {
    let r: u32 = rng.gen();
    match r & 31 {
        0 => -0.0,
        1 => negative_subnormal(dtype),
        _ => {
            let mb = FloatFormat::from(dtype).mantissa_bits().min(22);
            let sign = (r >> 5) & 1;
            let k = ((r >> 6) & 15) % 10; // exponent 2^(k - 9)
            let m = (r >> 10) & ((1u32 << mb) - 1);
            f32::from_bits(sign << 31 | (118 + k) << 23 | m << (23 - mb))
        }
    }
}

/// Deterministic inputs for `case` from `seed` (rank r draws from its own stream, so
/// ranks are generated in parallel). Values: see `random_value` (magnitudes in
/// [2^-9, 2), about 1/32 each of -0.0 and the dtype's smallest negative subnormal);
/// in token 0 the first 16 elements are -0.0 on every rank (all-reduce result +0.0,
/// an all-zero NVFP4 block with `SF == 0`); the residual of token 0 holds +-60 (static
/// FP8 saturates); with T >= 2, element 5 of the last token of rank 0's `x` is +inf,
/// so that token's all-reduce is +inf there, its RMSNorm is NaN / signed zeros and
/// every quant meets a NaN (encoded 0x7F in e4m3, +6 in e2m1 by the contract).
///
/// # Errors
/// As [`Case::validate`]; [`Error::Overflow`] on absurd sizes.
pub fn make_inputs(case: &Case, seed: u64) -> Result<Inputs> {
    case.validate()?;
    let n = case.elements()?;
    let h = case.hidden as usize;
    let dtype = case.dtype;
    let stream = |rank: u64, which: u64| {
        SmallRng::seed_from_u64(seed ^ (rank * 2 + which + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15))
    };
    let tensor = |rank: u64, residual: bool| {
        let mut rng = stream(rank, u64::from(residual));
        let mut v: Vec<f32> = (0..n).map(|_| random_value(dtype, &mut rng)).collect();
        v[..16.min(h)].fill(-0.0);
        if residual && h > 32 {
            v[16] = 60.0;
            v[17] = -60.0;
        }
        if !residual && rank == 0 && case.tokens >= 2 && h > 5 {
            v[(case.tokens as usize - 1) * h + 5] = f32::INFINITY;
        }
        encode(dtype, &v)
    };
    let ranks = u64::from(case.world);
    let x: Vec<Vec<u8>> = (0..ranks)
        .into_par_iter()
        .map(|r| tensor(r, false))
        .collect();
    let residual: Vec<Vec<u8>> = if case.epilogue.residual {
        (0..ranks)
            .into_par_iter()
            .map(|r| tensor(r, true))
            .collect()
    } else {
        Vec::new()
    };
    let mut rng = stream(u64::from(u32::MAX), 0);
    let gamma = if case.gamma_f32 {
        // Any f32 (not only values of the activation dtype): w.float() of a trained
        // offset weight, or an f32 parameter.
        let g: Vec<f32> = (0..h).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        encode(ActDtype::F32, &g)
    } else {
        let fmt = FloatFormat::from(dtype);
        let g: Vec<f32> = (0..h)
            .map(|_| fmt.round(rng.gen_range(-1024i32..1024) as f32 / 512.0))
            .collect();
        encode(dtype, &g)
    };
    let scale_in = match case.epilogue.quant {
        Quant::Fp8Static => STATIC_FP8_SCALE,
        Quant::Nvfp4(_) => NVFP4_GLOBAL_SCALE,
        _ => 0.0,
    };
    Ok(Inputs {
        x,
        residual,
        gamma,
        scale_in,
    })
}

/// What one rank's kernel wrote (or must write): raw bytes of each output in the
/// kernel's layout; an empty vector for an output the case does not have.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RankOutputs {
    /// `out` (norm output, or the all-reduce output without norm).
    pub out: Vec<u8>,
    /// `residual_out`.
    pub residual_out: Vec<u8>,
    /// Quant data.
    pub quant: Vec<u8>,
    /// Quant scales.
    pub scale: Vec<u8>,
}

/// Quant data and scale bytes of the contract's quant applied to `y` (`[T, H]`,
/// values of the activation dtype), in the kernel's output layouts.
///
/// # Errors
/// Reference errors (bad shapes or scales) as [`Error::Invalid`].
pub fn quant_bytes(case: &Case, y: &[f32], scale_in: f32) -> Result<(Vec<u8>, Vec<u8>)> {
    quant_bytes_for(case.epilogue.quant, case.tokens, case.hidden, y, scale_in)
}

/// [`quant_bytes`] for a quant epilogue and a shape: `y` is `[tokens, hidden]`;
/// `scale_in` is the static FP8 dequant scale or the NVFP4 global scale (unused by the
/// other forms). The sizes are [`quant_bytes_of`]'s.
///
/// # Errors
/// Reference errors (bad shapes or scales) as [`Error::Invalid`].
pub fn quant_bytes_for(
    quant: Quant,
    tokens: u32,
    hidden: u32,
    y: &[f32],
    scale_in: f32,
) -> Result<(Vec<u8>, Vec<u8>)> {
    let (t, h) = (tokens as usize, hidden as usize);
    Ok(match quant {
        Quant::None => (Vec::new(), Vec::new()),
        Quant::Fp8Static => (
            rq::static_fp8_quant(y, scale_in).map_err(reference)?,
            Vec::new(),
        ),
        Quant::Fp8PerToken => {
            let (codes, scales) = rq::dynamic_per_token_fp8_quant(y, t, h).map_err(reference)?;
            (codes, scales.iter().flat_map(|s| s.to_le_bytes()).collect())
        }
        Quant::Fp8Group(layout) => {
            let g =
                rq::per_token_group_fp8_quant(y, t, h, arfuse_abi::FP8_GROUP_SIZE as usize, layout)
                    .map_err(reference)?;
            let scales = match g.scales {
                GroupScales::PackedUe8m0 { words, .. } => {
                    words.iter().flat_map(|w| w.to_le_bytes()).collect()
                }
                GroupScales::Fp32 { values, .. } => {
                    values.iter().flat_map(|s| s.to_le_bytes()).collect()
                }
            };
            (g.data, scales)
        }
        Quant::Nvfp4(layout) => {
            let q = rq::nvfp4_quant(y, t, h, scale_in, layout).map_err(reference)?;
            (q.data, q.scales)
        }
    })
}

/// The dtype the RMSNorm weight is stored in.
pub fn gamma_dtype(case: &Case) -> ActDtype {
    if case.gamma_f32 {
        ActDtype::F32
    } else {
        case.dtype
    }
}

/// The outputs the contract prescribes for every rank of `case` on `inputs`
/// (`arfuse_reference::contract`: all-reduce, residual add, RMSNorm with [`EPS`] in the
/// kernels' sum order, quant).
///
/// # Errors
/// Input sizes that do not match the case ([`Error::Invalid`]); reference errors.
pub fn expected(case: &Case, inputs: &Inputs) -> Result<Vec<RankOutputs>> {
    expected_with_eps(case, inputs, EPS)
}

/// [`expected`] with the RMSNorm epsilon `eps` (a node's own, e.g. 1e-5) instead of
/// [`EPS`].
///
/// # Errors
/// As [`expected`].
pub fn expected_with_eps(case: &Case, inputs: &Inputs, eps: f64) -> Result<Vec<RankOutputs>> {
    case.validate()?;
    let n = case.elements()?;
    let fmt = FloatFormat::from(case.dtype);
    let act_bytes = n * (case.dtype.element_bytes() as usize);
    if inputs.x.len() != case.world as usize || inputs.x.iter().any(|v| v.len() != act_bytes) {
        return Err(Error::Invalid(format!(
            "inputs: need {} ranks of {act_bytes} bytes",
            case.world
        )));
    }
    let xs: Vec<Vec<f32>> = inputs.x.par_iter().map(|b| decode(case.dtype, b)).collect();
    let refs: Vec<&[f32]> = xs.iter().map(Vec::as_slice).collect();
    let a = contract::all_reduce(&refs, fmt).map_err(reference)?;
    let gamma = decode(gamma_dtype(case), &inputs.gamma);
    let rank = |r: usize| -> Result<RankOutputs> {
        if !case.epilogue.norm {
            return Ok(RankOutputs {
                out: encode(case.dtype, &a),
                ..RankOutputs::default()
            });
        }
        let res = if case.epilogue.residual {
            let res = inputs
                .residual
                .get(r)
                .filter(|b| b.len() == act_bytes)
                .ok_or_else(|| Error::Invalid(format!("inputs: residual of rank {r}")))?;
            Some(decode(case.dtype, res))
        } else {
            None
        };
        let input = if case.norm_f32_sum {
            contract::NormInput::F32Sum
        } else {
            contract::NormInput::Residual
        };
        let (h, norm_in) =
            contract::residual_and_norm_input(&a, res.as_deref(), input, fmt).map_err(reference)?;
        let rounding = if case.norm_round_twice {
            contract::NormRounding::Twice
        } else {
            contract::NormRounding::Once
        };
        let y = contract::rms_norm_ordered(
            &norm_in,
            &gamma,
            eps,
            f64::from(case.weight_bias),
            rounding,
            contract::SumOrder::KernelTree,
            fmt,
        )
        .map_err(reference)?;
        let (quant, scale) = quant_bytes(case, &y, inputs.scale_in)?;
        Ok(RankOutputs {
            out: encode(case.dtype, &y),
            residual_out: encode(case.dtype, &h),
            quant,
            scale,
        })
    };
    (0..case.world as usize).into_par_iter().map(rank).collect()
}

/// The result of comparing a kernel's outputs with the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Verdict {
    /// Elements of bit-exact outputs (all-reduce, `residual_out`) that differ.
    pub exact_mismatches: u64,
    /// `norm_out` elements that differ from the contract (any distance).
    pub norm_mismatches: u64,
    /// Largest `norm_out` distance seen, ulp of the activation dtype.
    pub max_norm_ulp: u64,
    /// Quant data or scale bytes (padding included) that differ from the contract's
    /// quant of the kernel's own `norm_out`.
    pub quant_mismatches: u64,
    /// Tokens whose quant output differs from the contract's quant of the
    /// contract's `norm_out` (allowed: follows from a 1-ulp norm difference).
    pub quant_tokens_moved: u64,
    /// Outputs whose size is wrong (a harness defect).
    pub size_mismatches: u64,
}

impl Verdict {
    /// Whether every clause of the contract holds.
    pub fn passed(&self) -> bool {
        self.exact_mismatches == 0
            && self.norm_mismatches == 0
            && self.quant_mismatches == 0
            && self.size_mismatches == 0
    }

    /// `ok`, or the counts that failed.
    pub fn summary(&self) -> String {
        if self.passed() {
            return "ok".to_string();
        }
        let mut parts = Vec::new();
        for (n, what) in [
            (self.exact_mismatches, "exact"),
            (self.norm_mismatches, "norm"),
            (self.quant_mismatches, "quant"),
            (self.size_mismatches, "size"),
        ] {
            if n > 0 {
                parts.push(format!("{n} {what}"));
            }
        }
        parts.join(", ")
    }

    fn add(&mut self, o: Verdict) {
        self.exact_mismatches += o.exact_mismatches;
        self.norm_mismatches += o.norm_mismatches;
        self.max_norm_ulp = self.max_norm_ulp.max(o.max_norm_ulp);
        self.quant_mismatches += o.quant_mismatches;
        self.quant_tokens_moved += o.quant_tokens_moved;
        self.size_mismatches += o.size_mismatches;
    }
}

fn byte_mismatches(a: &[u8], b: &[u8]) -> u64 {
    let differing = a.iter().zip(b).filter(|(x, y)| x != y).count();
    (differing + a.len().abs_diff(b.len())) as u64
}

fn elem_mismatches(dtype: ActDtype, a: &[u8], b: &[u8]) -> u64 {
    let e = dtype.element_bytes() as usize;
    let differing = a.chunks(e).zip(b.chunks(e)).filter(|(x, y)| x != y).count();
    (differing + a.len().abs_diff(b.len()) / e) as u64
}

/// Compares what the kernel wrote with all outputs live (`got`, one entry per rank)
/// with `expected` (from [`expected`] on the same inputs).
///
/// # Errors
/// Reference errors while re-quantising the kernel's norm output.
pub fn compare(
    case: &Case,
    inputs: &Inputs,
    expected: &[RankOutputs],
    got: &[RankOutputs],
) -> Result<Verdict> {
    let mut v = Verdict::default();
    if expected.len() != got.len() {
        v.size_mismatches += expected.len().abs_diff(got.len()) as u64;
    }
    let fmt = FloatFormat::from(case.dtype);
    let rank = |(want, have): (&RankOutputs, &RankOutputs)| -> Result<Verdict> {
        let mut r = Verdict::default();
        for (w, h) in [
            (&want.out, &have.out),
            (&want.residual_out, &have.residual_out),
            (&want.quant, &have.quant),
            (&want.scale, &have.scale),
        ] {
            r.size_mismatches += u64::from(w.len() != h.len());
        }
        if r.size_mismatches > 0 {
            return Ok(r);
        }
        r.exact_mismatches += elem_mismatches(case.dtype, &want.residual_out, &have.residual_out);
        if !case.epilogue.norm {
            r.exact_mismatches += elem_mismatches(case.dtype, &want.out, &have.out);
            return Ok(r);
        }
        let (wy, hy) = (decode(case.dtype, &want.out), decode(case.dtype, &have.out));
        for (a, b) in wy.iter().zip(&hy) {
            let d = fmt.ulp_distance(*a, *b);
            r.max_norm_ulp = r.max_norm_ulp.max(d);
            r.norm_mismatches += u64::from(d > 0);
        }
        if case.epilogue.quant != Quant::None {
            let (q, s) = quant_bytes(case, &hy, inputs.scale_in)?;
            r.quant_mismatches +=
                byte_mismatches(&q, &have.quant) + byte_mismatches(&s, &have.scale);
            let per_token = have.quant.len() / case.tokens.max(1) as usize;
            if per_token > 0 {
                r.quant_tokens_moved += want
                    .quant
                    .chunks(per_token)
                    .zip(have.quant.chunks(per_token))
                    .filter(|(a, b)| a != b)
                    .count() as u64;
            }
        }
        Ok(r)
    };
    let per_rank: Vec<Verdict> = expected
        .par_iter()
        .zip(got.par_iter())
        .map(rank)
        .collect::<Result<_>>()?;
    for r in per_rank {
        v.add(r);
    }
    Ok(v)
}

/// Which outputs a partial run leaves dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    /// `out` written.
    pub out: bool,
    /// `residual_out` written.
    pub residual_out: bool,
    /// Quant data written.
    pub quant: bool,
    /// Quant scales written.
    pub scale: bool,
}

impl Liveness {
    /// Every output the case has.
    pub fn all(case: &Case) -> Result<Liveness> {
        let b = case.output_bytes()?;
        Ok(Liveness {
            out: b.out > 0,
            residual_out: b.residual_out > 0,
            quant: b.quant > 0,
            scale: b.scale > 0,
        })
    }

    /// The subset a partial run writes: with a quant, the quant outputs and
    /// `residual_out` (the norm output dead, as when only the next GEMM reads it);
    /// without, the norm output only (`residual_out` dead, as in the last layer).
    /// All-reduce only has a single output: `None`.
    pub fn partial(case: &Case) -> Result<Option<Liveness>> {
        let all = Liveness::all(case)?;
        if !case.epilogue.norm {
            return Ok(None);
        }
        Ok(Some(if all.quant {
            Liveness {
                out: false,
                residual_out: all.residual_out,
                quant: true,
                scale: all.scale,
            }
        } else {
            Liveness {
                out: true,
                residual_out: false,
                quant: false,
                scale: false,
            }
        }))
    }
}

/// Checks a partial run (`partial`, written with `live`) against the all-live run
/// (`full`): live outputs byte-identical, dead outputs still all [`FILL_BYTE`].
/// Returns the number of differing bytes.
pub fn compare_partial(live: Liveness, full: &[RankOutputs], partial: &[RankOutputs]) -> u64 {
    let mut bad = full.len().abs_diff(partial.len()) as u64;
    for (f, p) in full.iter().zip(partial) {
        for (is_live, fb, pb) in [
            (live.out, &f.out, &p.out),
            (live.residual_out, &f.residual_out, &p.residual_out),
            (live.quant, &f.quant, &p.quant),
            (live.scale, &f.scale, &p.scale),
        ] {
            bad += if is_live {
                byte_mismatches(fb, pb)
            } else {
                pb.iter().filter(|&&b| b != FILL_BYTE).count() as u64
            };
        }
    }
    bad
}

/// Device-memory bytes that all W virtual ranks together read and write in one fused
/// call (the numerator of the achieved-bandwidth figure), with `R = T*H*e`:
/// - one-shot, per rank: read x (R), push it to every peer (W*R), re-fill the
///   previous call's buffer with the sentinel (W*R, same T assumed), poll and read the
///   W slots (W*R);
/// - two-shot, per rank: read x (R), push to the owners (R), poll the owned slots
///   (R), push the reduced tokens to every peer (R), poll the gathered tokens (R),
///   re-fill the previous call's buffer with the sentinel (`(W * ceil(T/W) + T) * H
///   * e`, same T assumed);
/// - epilogue, per rank: read the residual (R), write `residual_out` (R, norm
///   patterns), write `out` (R), read gamma (H*e), write quant data and scales
///   ([`Case::output_bytes`]).
///
/// # Errors
/// [`Error::Overflow`] on absurd sizes; invalid cases.
pub fn bytes_moved(case: &Case) -> Result<u64> {
    let o = case.output_bytes()?;
    let w = u64::from(case.world);
    let r = o.out;
    let row = u64::from(case.hidden) * case.dtype.element_bytes();
    let t = u64::from(case.tokens);
    let comm = match case.strategy {
        Strategy::OneShot => r.checked_mul(1 + 3 * w),
        Strategy::TwoShot => r
            .checked_mul(5)
            .and_then(|c| c.checked_add((w * t.div_ceil(w) + t).checked_mul(row)?)),
        Strategy::Unfused => return Err(Error::Invalid("a case runs a fused strategy".into())),
    }
    .ok_or(Error::Overflow("bytes moved"))?;
    let residual_in = if case.epilogue.residual { r } else { 0 };
    let gamma = if case.epilogue.norm {
        u64::from(case.hidden) * gamma_dtype(case).element_bytes()
    } else {
        0
    };
    let per_rank = [
        comm,
        residual_in,
        o.residual_out,
        o.out,
        gamma,
        o.quant,
        o.scale,
    ]
    .iter()
    .try_fold(0u64, |acc, &b| acc.checked_add(b))
    .ok_or(Error::Overflow("bytes moved"))?;
    per_rank
        .checked_mul(w)
        .ok_or(Error::Overflow("bytes moved"))
}

/// The fewest device-memory bytes that all W virtual ranks together must read and
/// write in one call, whatever the algorithm (the denominator of the efficiency
/// against the minimum), with `R = T*H*e`: per rank, its input x read once (R), its
/// residual read (R), its outputs written ([`Case::output_bytes`]: `residual_out`,
/// `out`, quant data and scales) and the weight read (H elements). On one GPU the
/// exchange of the all-reduce needs no further bytes (one kernel could read every
/// rank's x and reduce in registers); [`bytes_moved`] minus this is what the
/// algorithm's buffers and sentinels cost.
///
/// # Errors
/// [`Error::Overflow`] on absurd sizes; invalid cases.
pub fn minimum_bytes(case: &Case) -> Result<u64> {
    let o = case.output_bytes()?;
    let residual_in = if case.epilogue.residual { o.out } else { 0 };
    let gamma = if case.epilogue.norm {
        u64::from(case.hidden) * gamma_dtype(case).element_bytes()
    } else {
        0
    };
    [
        o.out,
        residual_in,
        o.residual_out,
        o.out,
        gamma,
        o.quant,
        o.scale,
    ]
    .iter()
    .try_fold(0u64, |acc, &b| acc.checked_add(b))
    .and_then(|per_rank| per_rank.checked_mul(u64::from(case.world)))
    .ok_or(Error::Overflow("minimum bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arfuse_ir::{GroupScaleLayout, Nvfp4ScaleLayout};

    fn case(epilogue: Epilogue, dtype: ActDtype, tokens: u32) -> Case {
        Case {
            strategy: Strategy::OneShot,
            world: 4,
            dtype,
            epilogue,
            tokens,
            hidden: 256,
            weight_bias: 0,
            gamma_f32: false,
            norm_round_twice: false,
            norm_f32_sum: false,
        }
    }

    /// Moves one little-endian float element one ulp away from zero.
    fn bump_ulp(elem: &mut [u8]) {
        for b in elem.iter_mut() {
            let (v, carry) = b.overflowing_add(1);
            *b = v;
            if !carry {
                break;
            }
        }
    }

    fn all_quants() -> Vec<Epilogue> {
        crate::variants::all_epilogues()
    }

    #[test]
    fn the_full_matrix_has_every_pattern_dtype_world_and_token_count() {
        let with = all_cases(4096, true);
        let without = all_cases(4096, false);
        // 17 epilogues for 16-bit types (all-reduce only, residual on/off x 8 quant
        // forms), 13 for f32 (no NVFP4); x 2 strategies x 3 W x 7 T (arfuse's Lamport
        // two-shot runs T < W as well).
        assert_eq!(with.len(), (17 + 17 + 13) * 2 * 3 * 7);
        assert_eq!(without.len(), (13 + 13 + 13) * 2 * 3 * 7);
        assert!(without.iter().all(|c| !c.epilogue.quant.needs_sm100()));
        assert!(with
            .iter()
            .any(|c| c.epilogue.norm && !c.epilogue.residual && c.weight_bias == 1));
        // Both RMSNorm roundings run with every quant form on the residual norms.
        for q in [
            Quant::None,
            Quant::Fp8PerToken,
            Quant::Nvfp4(Nvfp4ScaleLayout::Swizzled128x4),
        ] {
            for twice in [false, true] {
                assert!(with.iter().any(|c| c.epilogue.residual
                    && c.epilogue.norm
                    && c.epilogue.quant == q
                    && c.norm_round_twice == twice));
            }
        }
        // H = 2880 (gpt-oss) is not a multiple of 128: no group quant cases.
        assert!(all_cases(2880, true)
            .iter()
            .all(|c| !c.epilogue.quant.is_group()));
        // Shapes no kernel takes give no cases; tiny ones give no panic.
        assert!(all_cases(65536, true).is_empty());
        assert!(all_cases(8, true)
            .iter()
            .all(|c| !c.epilogue.quant.needs_sm100()));
        for c in cases_for_tokens(4, true, &[1, 2, 3]) {
            let inputs = make_inputs(&c, 1).unwrap();
            expected(&c, &inputs).unwrap();
        }
    }

    #[test]
    fn output_sizes_follow_the_layouts() {
        let e = |quant| Epilogue {
            residual: true,
            norm: true,
            quant,
        };
        let c = |q, t| case(e(q), ActDtype::Bf16, t).output_bytes().unwrap();
        let b = c(Quant::None, 7);
        assert_eq!(
            (b.out, b.residual_out, b.quant, b.scale),
            (3584, 3584, 0, 0)
        );
        assert_eq!(c(Quant::Fp8PerToken, 7).scale, 28);
        // Packed UE8M0, H = 256: 2 groups -> 1 word column of T = 7 words (vLLM's
        // allocation, T + (C - 1) * round_up(T, 4)); the f32 forms 7 x 2 floats.
        let g = |l| Quant::Fp8Group(l);
        assert_eq!(c(g(GroupScaleLayout::PackedUe8m0), 7).scale, 28);
        assert_eq!(c(g(GroupScaleLayout::F32RowMajor), 7).scale, 7 * 2 * 4);
        assert_eq!(c(g(GroupScaleLayout::F32RowMajorUe8m0), 7).scale, 7 * 2 * 4);
        let mut wide = case(e(g(GroupScaleLayout::PackedUe8m0)), ActDtype::Bf16, 7);
        wide.hidden = 640;
        assert_eq!(wide.output_bytes().unwrap().scale, (7 + 8) * 4);
        // NVFP4 swizzled: round_up(7, 128) x round_up(16, 4) bytes.
        assert_eq!(
            c(Quant::Nvfp4(Nvfp4ScaleLayout::Swizzled128x4), 7).scale,
            128 * 16
        );
        assert_eq!(c(Quant::Nvfp4(Nvfp4ScaleLayout::Linear), 7).scale, 7 * 16);
        assert_eq!(c(Quant::Nvfp4(Nvfp4ScaleLayout::Linear), 7).quant, 7 * 128);
        let ar = case(Epilogue::AR_ONLY, ActDtype::F32, 3)
            .output_bytes()
            .unwrap();
        assert_eq!((ar.out, ar.residual_out), (3 * 256 * 4, 0));
        assert!(
            case(e(Quant::Nvfp4(Nvfp4ScaleLayout::Linear)), ActDtype::F32, 1)
                .output_bytes()
                .is_err()
        );
        let mut bad = case(
            e(Quant::Fp8Group(GroupScaleLayout::F32RowMajor)),
            ActDtype::Bf16,
            1,
        );
        bad.hidden = 192;
        assert!(bad.validate().is_err());
    }

    #[test]
    fn inputs_hold_the_edge_values_and_are_deterministic() {
        let c = case(Epilogue::RES_NORM, ActDtype::Bf16, 16);
        let a = make_inputs(&c, 7).unwrap();
        assert_eq!(a, make_inputs(&c, 7).unwrap());
        assert_ne!(a, make_inputs(&c, 8).unwrap());
        assert_eq!(a.x.len(), 4);
        let x0 = decode(ActDtype::Bf16, &a.x[0]);
        assert!(x0[..16].iter().all(|v| v.to_bits() == (-0.0f32).to_bits()));
        let all: Vec<f32> = a.x.iter().flat_map(|b| decode(ActDtype::Bf16, b)).collect();
        let sub = negative_subnormal(ActDtype::Bf16);
        assert!(all.iter().filter(|v| v.to_bits() == sub.to_bits()).count() > 10);
        assert!(all.iter().all(|v| FloatFormat::Bf16.is_exact(*v)));
        // One +inf, in rank 0's last token; its norm output is NaN there, and the
        // per-token FP8 of that token encodes the NaN as 0x7F.
        assert_eq!(all.iter().filter(|v| v.is_infinite()).count(), 1);
        assert_eq!(x0[15 * 256 + 5], f32::INFINITY);
        let q = Case {
            epilogue: Epilogue {
                residual: true,
                norm: true,
                quant: Quant::Fp8PerToken,
            },
            ..c
        };
        let e = expected(&q, &make_inputs(&q, 7).unwrap()).unwrap();
        let y = decode(ActDtype::Bf16, &e[3].out);
        assert!(y[15 * 256 + 5].is_nan());
        assert_eq!(e[3].quant[15 * 256 + 5], 0x7F);
        assert!(y[..15 * 256].iter().all(|v| v.is_finite()));
    }

    #[test]
    fn expected_outputs_are_the_contract() {
        // All -0.0 columns reduce to +0.0; the negative subnormal survives; residual
        // and norm follow the contract functions.
        let c = case(Epilogue::RES_NORM, ActDtype::Bf16, 2);
        let inp = make_inputs(&c, 1).unwrap();
        let e = expected(&c, &inp).unwrap();
        assert_eq!(e.len(), 4);
        let h0 = decode(ActDtype::Bf16, &e[0].residual_out);
        let r0 = decode(ActDtype::Bf16, &inp.residual[0]);
        // Token 0, element 0: a = +0.0 (all ranks -0.0), residual -0.0 -> +0.0.
        assert_eq!(h0[0].to_bits(), 0.0f32.to_bits());
        let xs: Vec<Vec<f32>> = inp.x.iter().map(|b| decode(ActDtype::Bf16, b)).collect();
        for i in [20usize, 300, 511] {
            let mut acc = 0.0f32;
            for x in &xs {
                acc += x[i];
            }
            let a = FloatFormat::Bf16.round(acc);
            assert_eq!(h0[i], FloatFormat::Bf16.round(a + r0[i]), "element {i}");
        }
        // AR only: every rank gets the same bytes.
        let ar = case(Epilogue::AR_ONLY, ActDtype::F16, 3);
        let e = expected(&ar, &make_inputs(&ar, 2).unwrap()).unwrap();
        assert!(e.windows(2).all(|w| w[0] == w[1]));
        assert!(e[0].residual_out.is_empty());
    }

    #[test]
    fn expected_norm_follows_the_case_rounding() {
        // The two-rounding case is the Llama decomposition element for element, and
        // differs from the one-rounding case somewhere.
        let once = case(Epilogue::RES_NORM, ActDtype::Bf16, 8);
        let twice = Case {
            norm_round_twice: true,
            norm_f32_sum: false,
            ..once
        };
        let inp = make_inputs(&once, 7).unwrap();
        let (eo, et) = (
            expected(&once, &inp).unwrap(),
            expected(&twice, &inp).unwrap(),
        );
        let h = decode(ActDtype::Bf16, &et[0].residual_out);
        let g = decode(ActDtype::Bf16, &inp.gamma);
        let y = decode(ActDtype::Bf16, &et[0].out);
        let bf = FloatFormat::Bf16;
        let hidden = once.hidden as usize;
        let r = contract::rms_inv(
            &h[..hidden],
            contract::eps_f32(EPS),
            contract::SumOrder::KernelTree,
            2,
        );
        for i in 0..hidden {
            assert_eq!(
                y[i].to_bits(),
                bf.round(bf.round(h[i] * r) * g[i]).to_bits()
            );
        }
        assert_eq!(eo[0].residual_out, et[0].residual_out);
        assert_ne!(eo[0].out, et[0].out);
        assert!(Case {
            epilogue: Epilogue::AR_ONLY,
            ..twice
        }
        .validate()
        .is_err());
    }

    #[test]
    fn compare_accepts_the_contract_and_catches_each_kind_of_defect() {
        for epilogue in all_quants() {
            for dtype in ActDtype::ALL {
                let c = case(epilogue, dtype, 5);
                if c.validate().is_err() {
                    continue;
                }
                let inp = make_inputs(&c, 3).unwrap();
                let want = expected(&c, &inp).unwrap();
                let v = compare(&c, &inp, &want, &want).unwrap();
                assert!(v.passed(), "{}: {v:?}", c.label());
                assert_eq!(v.max_norm_ulp, 0);
                // A flipped low bit in the residual / all-reduce output is caught.
                let mut bad = want.clone();
                if epilogue.norm {
                    bad[1].residual_out[40] ^= 1;
                } else {
                    bad[1].out[40] ^= 1;
                }
                let v = compare(&c, &inp, &want, &bad).unwrap();
                assert_eq!(v.exact_mismatches, 1, "{}", c.label());
                if !epilogue.norm {
                    continue;
                }
                // A norm output 1 ulp away (bump the magnitude of element 20 of
                // token 0) is a defect (the kernels' sum order is the contract's):
                // caught as a norm mismatch.
                let mut near = want.clone();
                let e = dtype.element_bytes() as usize;
                bump_ulp(&mut near[2].out[20 * e..21 * e]);
                let v = compare(&c, &inp, &want, &near).unwrap();
                assert_eq!(v.norm_mismatches, 1, "{}", c.label());
                assert_eq!(v.max_norm_ulp, 1);
                assert!(!v.passed());
                if epilogue.quant != Quant::None {
                    // A flipped quant byte is caught.
                    let mut qbad = want.clone();
                    qbad[0].quant[3] ^= 0x10;
                    let v = compare(&c, &inp, &want, &qbad).unwrap();
                    assert_eq!(v.quant_mismatches, 1, "{}", c.label());
                    assert_eq!(v.quant_tokens_moved, 1);
                }
                // A norm far off (sign flipped on a non-zero element) is caught.
                let mut far = want.clone();
                let y = decode(dtype, &far[0].out);
                let i = y.iter().position(|v| *v != 0.0).unwrap();
                far[0].out[i * e + e - 1] ^= 0x80;
                let v = compare(&c, &inp, &want, &far).unwrap();
                assert!(v.norm_mismatches >= 1 && !v.passed(), "{}", c.label());
            }
        }
    }

    #[test]
    fn compare_flags_wrong_sizes() {
        let c = case(Epilogue::RES_NORM, ActDtype::Bf16, 2);
        let inp = make_inputs(&c, 1).unwrap();
        let want = expected(&c, &inp).unwrap();
        let mut short = want.clone();
        short[0].out.pop();
        assert_eq!(compare(&c, &inp, &want, &short).unwrap().size_mismatches, 1);
        assert_eq!(
            compare(&c, &inp, &want, &want[..3])
                .unwrap()
                .size_mismatches,
            1
        );
    }

    #[test]
    fn partial_runs_must_match_and_leave_dead_outputs_alone() {
        let e = Epilogue {
            residual: true,
            norm: true,
            quant: Quant::Fp8PerToken,
        };
        let c = case(e, ActDtype::Bf16, 3);
        let live = Liveness::partial(&c).unwrap().unwrap();
        assert!(!live.out && live.residual_out && live.quant && live.scale);
        let full = expected(&c, &make_inputs(&c, 1).unwrap()).unwrap();
        let mut part = full.clone();
        for p in &mut part {
            p.out.fill(FILL_BYTE);
        }
        assert_eq!(compare_partial(live, &full, &part), 0);
        part[1].out[5] = 0;
        assert_eq!(compare_partial(live, &full, &part), 1);
        part[1].out[5] = FILL_BYTE;
        part[2].scale[0] ^= 1;
        assert_eq!(compare_partial(live, &full, &part), 1);
        let plain = case(Epilogue::RES_NORM, ActDtype::Bf16, 3);
        let l = Liveness::partial(&plain).unwrap().unwrap();
        assert!(l.out && !l.residual_out);
        assert!(
            Liveness::partial(&case(Epilogue::AR_ONLY, ActDtype::Bf16, 3))
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn bytes_moved_counts_each_rank() {
        // One-shot, W=4, T=1, H=256, bf16, res+norm: R = 512;
        // per rank (1 + 12) R + R residual + R res_out + R out + 512 gamma = 17 R.
        let c = case(Epilogue::RES_NORM, ActDtype::Bf16, 1);
        assert_eq!(bytes_moved(&c).unwrap(), 4 * 17 * 512);
        // Two-shot, T=4, R = 2048: 5 R + the re-fill of (4 * 1 + 4) rows of 512 bytes
        // (2 R) + residual, res_out, out (3 R) + gamma.
        let mut two = case(Epilogue::RES_NORM, ActDtype::Bf16, 4);
        two.strategy = Strategy::TwoShot;
        assert_eq!(bytes_moved(&two).unwrap(), 4 * (10 * 2048 + 512));
        // T=1 < W: R = 512; 5 R + (4 * 1 + 1) rows (5 R) + 3 R + gamma.
        two.tokens = 1;
        assert_eq!(bytes_moved(&two).unwrap(), 4 * (13 * 512 + 512));
        let ar = case(Epilogue::AR_ONLY, ActDtype::Bf16, 1);
        assert_eq!(bytes_moved(&ar).unwrap(), 4 * 14 * 512);
    }

    #[test]
    fn minimum_bytes_are_the_epilogues_alone() {
        // W=4, T=1, H=256, bf16 (R = 512): x, residual, res_out, out and the weight.
        let c = case(Epilogue::RES_NORM, ActDtype::Bf16, 1);
        assert_eq!(minimum_bytes(&c).unwrap(), 4 * 5 * 512);
        // The one-shot moves 17 R per rank for the same call (gamma is R here).
        assert_eq!(
            bytes_moved(&c).unwrap() - minimum_bytes(&c).unwrap(),
            4 * 12 * 512
        );
        // All-reduce only: x read, out written.
        let ar = case(Epilogue::AR_ONLY, ActDtype::Bf16, 1);
        assert_eq!(minimum_bytes(&ar).unwrap(), 4 * 2 * 512);
    }

    #[test]
    fn the_sum_of_squares_is_the_kernels_block_tree() {
        // H = 4096 bf16: 512 vectors of 8 on 512 threads (one vector each), 16 warps.
        // Recomputed here from that description: per-vector sums, per-warp butterflies,
        // then the butterfly over the 16 warp totals and 16 zeros.
        let mut rng = SmallRng::seed_from_u64(5);
        let x: Vec<f32> = (0..4096).map(|_| rng.gen_range(-4.0f32..4.0)).collect();
        let butterfly = |mut v: Vec<f32>| {
            for o in [16usize, 8, 4, 2, 1] {
                let p = v.clone();
                for l in 0..32 {
                    v[l] = p[l] + p[l ^ o];
                }
            }
            v[0]
        };
        let lanes: Vec<f32> = x
            .chunks(8)
            .map(|c| c.iter().fold(0.0f32, |a, v| a + v * v))
            .collect();
        let mut totals: Vec<f32> = lanes.chunks(32).map(|w| butterfly(w.to_vec())).collect();
        totals.resize(32, 0.0);
        let tree = butterfly(totals);
        assert_eq!(contract::sum_of_squares(&x, 2).to_bits(), tree.to_bits());
        // ... which is not the sequential sum for these inputs: the order matters.
        let seq = x.iter().fold(0.0f32, |a, v| a + v * v);
        assert_ne!(tree.to_bits(), seq.to_bits());
        // A row no arfuse kernel runs (not a multiple of 16 bytes) is summed in order.
        assert_eq!(contract::sum_of_squares(&x[..4095], 2).to_bits(), {
            x[..4095].iter().fold(0.0f32, |a, v| a + v * v).to_bits()
        });
    }
}
