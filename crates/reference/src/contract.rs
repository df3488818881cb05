//! # arfuse rounding contract v3
//!
//! The one place that states how the fused all-reduce -> residual add ->
//! RMSNorm (-> quant) op computes, bit for bit. The CPU evaluator
//! ([`crate::eval`]) calls these functions for the fused node AND for the
//! unfused ops (`all_reduce`, `add`, `rms_norm`, `fused_add_rms_norm`, the
//! quant ops), so the two forms agree by construction; the GPU kernels are
//! checked against the same functions. Every kernel states that it follows
//! this contract, or which clause it deviates from.
//!
//! Notation as in domain.md: `T` is the activation dtype (bf16, f16 or f32),
//! `round_T` rounds an f32 to T to nearest, ties to even
//! ([`FloatFormat::round`]), `f32(v)` widens exactly. All arithmetic is IEEE
//! binary32 with round-to-nearest-even, no fused multiply-add, no
//! flush-to-zero.
//!
//! 1. **All-reduce.** `s = x_0 + x_1 + ... + x_{W-1}`: each `x_r` widened
//!    exactly to f32, accumulated in f32 left to right in rank order starting
//!    from +0.0 (`acc = +0.0; acc = acc + f32(x_0); acc = acc + f32(x_1);
//!    ...`); then `a = round_T(s)`. Starting from +0.0 only differs from
//!    starting at `x_0` when every input is -0.0: the sum is then +0.0, as the
//!    one-shot Lamport kernel must produce (it rewrites -0.0 to +0.0 before
//!    sending, because -0.0 is its empty sentinel; domain.md section 6).
//!    This rounding before the residual add matches the
//!    unfused path (domain.md section 1: a kernel that skips it drifts 1-4
//!    ulp). [`all_reduce`].
//! 2. **Residual.** `h = round_T(f32(a) + f32(residual))`, written as
//!    `residual_out`. Without a residual: `h = a`, and `residual_out` (when
//!    asked for) is `a`. [`residual_add`]. What clause 3 normalises is the node's
//!    [`NormInput`]: `residual` (the default), `h` itself, as vLLM's CUDA
//!    `fused_add_rms_norm` and FlashInfer's fused kernel do; `f32_sum`, the unrounded
//!    `s2 = f32(a) + f32(residual)` (one f32 addition), as vLLM's native
//!    `fused_add_rms_norm` does (`vllm/ir/ops/layernorm.py` in vLLM 0.32: `x =
//!    x.to(f32) + x_residual.to(f32)`, `x_residual = x.to(orig_dtype)`, the variance
//!    and the normalisation on the f32 `x`): clause 3 then reads `s2` where it reads
//!    `h` below, and `residual_out` is still `h`. [`residual_and_norm_input`].
//! 3. **RMSNorm.** `ss = sum_i f32(h_i)^2` over the H elements of the token
//!    (each square rounded to f32, then added), in a [`SumOrder`]: the IR's
//!    `rms_norm` (and a decomposed `mean`) sums sequentially (i = 0, 1, ..., H-1);
//!    arfuse's kernels sum in their block tree ([`SumOrder::KernelTree`],
//!    [`sum_of_squares`]), ONE order that depends on H and T's element size
//!    only, never on the token count, the grid or the strategy, so every kernel
//!    path (fused one-shot, two-shot, the unfused local kernel) gives the same
//!    bits for a row in any batch; `r = 1 / sqrt(ss / H + eps)` in f32
//!    (`ss / H` one division, `+ eps` with `eps` the f32 nearest to the f64
//!    attribute, a correctly rounded `sqrt`, one division); then, by the
//!    node's [`NormRounding`] (domain.md section 1: the sources differ, and a
//!    rewrite must keep the one its graph spells):
//!    - `once` (the weight applied in f32, one rounding, as FlashInfer's fused
//!      kernel, Gemma's `(x * (1 + w.float())).type_as(x)` and gpt-oss'
//!      `(w * x_f32).to(T)`): `y_i = round_T((f32(h_i) * r) * (f32(gamma_i) +
//!      weight_bias))`;
//!    - `twice` (Hugging Face's Llama order `w * x_normed.to(T)`): `n_i =
//!      round_T(f32(h_i) * r)`, `y_i = round_T(f32(n_i) * (f32(gamma_i) +
//!      weight_bias))`.
//!
//!    `gamma` is T, or f32 (Gemma's `1 + w.float()`, `weight_bias = 1`).
//!    [`rms_norm_with`]; [`rms_norm`] is the `once` form.
//!    arfuse's kernels (correctly rounded `sqrt` and division, no FMA) are
//!    bit-exact against this clause in the kernel order, `norm_out` included.
//!    Against the IR's sequential order a fused node's `norm_out` differs by the
//!    reorder of one f32 sum (a few f32 ulp of `r`), which moves some 16-bit
//!    outputs by an ulp (two with the `twice` rounding and a weight above 1 in
//!    magnitude); `residual_out` and the all-reduce output never differ.
//! 4. **Quant epilogues** act on `y` (already rounded to T, widened to f32)
//!    ([`Epilogue`], [`apply_epilogue`], [`crate::numerics::quant`]). Each form
//!    follows the operation order of the engine kernel a user compares the fused
//!    output with, every operation one IEEE f32 rounding (the golden vectors of
//!    `tools/golden/golden.py` check it bit for bit, `tests/golden.rs`):
//!    - static FP8: `inv = 1 / scale`, `q = e4m3_satfinite(y * inv)`. Source:
//!      vLLM `static_scaled_fp8_quant` (csrc/quantization/w8a8/fp8/common.cu,
//!      `scaled_fp8_quant_kernel_strided`: `inv_scale = 1.0f / (*scale)`, then
//!      `scaled_fp8_conversion<true>`: `val * inv_scale`, clamp, cvt); FlashInfer's
//!      fused kernel (include/flashinfer/comm/trtllm_allreduce_fusion.cuh, the
//!      `kFP8` branch: `m_scale_factor = 1.f / *(params.scale_factor)`, `val *
//!      m_scale_factor`, satfinite cast) has the same order.
//!    - dynamic per-token FP8: `s = max(amax / 448, 1 / (448 * 512))`,
//!      `q = e4m3(clamp(y / s, -448, 448))`, scales f32 `[T, 1]`. Source: vLLM
//!      `dynamic_per_token_scaled_fp8_quant_kernel_strided` (common.cu) and
//!      `ref_dynamic_per_token_quant` (tests/kernels/quant_utils.py); FlashInfer
//!      `dynamic_token_fp8_scale` (patterns 10/11). Unchanged from v1.
//!    - per-token-group FP8 ([`GroupScaleLayout`], [`group_fp8_scale`]): f32
//!      form `s = max(amax, 1e-10) / 448`; the two UE8M0 forms (packed, and f32
//!      with power-of-two values) `s = max(max(amax, 1e-10) / 448, 1e-10)` rounded
//!      UP to a power of two; `q = e4m3(clamp(y / s, -448, 448))`. Sources: vLLM
//!      csrc/quantization/w8a8/fp8/per_token_group_quant.cu
//!      (`ComputeGroupScale` / `per_token_group_quant_8bit_register_kernel`: the
//!      absmax starts at `eps` = 1e-10, then `/ max_8bit`; with `SCALE_UE8M0` the
//!      exponent is bumped when the mantissa is not zero, after `fmaxf(y_s,
//!      1e-10f)`; `per_token_group_quant_8bit_packed_register_kernel` the same, its
//!      quantisation `y * (1 / y_s)` equals `y / y_s` for a power of two);
//!      `native_per_token_group_quant_fp8` (tests/kernels/quant_utils.py: `amax
//!      .clamp(min=eps) / fp8_max`); FlashInfer `compute_ue8m0_scale` (patterns
//!      8/9: `fmaxf(absmax / 448, 1e-10f)`, then the same rounding; the same value
//!      as vLLM's). vLLM's shared-memory kernel (used for f32 inputs or other
//!      group sizes) and its Triton kernel round with `exp2(ceil(log2(s)))`,
//!      which can round down a value a few ulp above a power of two once
//!      `log2` rounds to an integer; the contract is the exact rounding. The
//!      packed storage has `T + (ceil(G / 4) - 1) * round_up(T, 4)` int32 words,
//!      vLLM's allocation (`per_token_group_quant_fp8_packed_for_deepgemm`:
//!      `torch.empty_strided((T, C), (1, round_up(T, 4)))`) and what FlashInfer's
//!      pattern 8/9 kernel writes ([`packed_group_scale_words`]).
//!    - NVFP4: `SF = e4m3_satfinite(global_scale * (amax * f32(1 / 6)))`,
//!      `os = global_scale / f32(SF)` (0 when `SF == 0`), element
//!      `e2m1_satfinite(y * os)`; swizzled scales follow the 128x4 layout the
//!      block-scaled GEMMs read ([`crate::numerics::quant::nvfp4_swizzle_row_slot`]).
//!      Source: FlashInfer's fused kernel (trtllm_allreduce_fusion.cuh,
//!      `utils::cvt_warp_fp16_to_fp4`: `SFScaleVal * (vecMax * RECIPROCAL_6)`,
//!      `outputScale = SFScaleVal / quantized_sf`, `fp2Val *= outputScale`), the
//!      kernel the fused op replaces. The engines' unfused quant disagrees with it:
//!      vLLM `scaled_fp4_quant` (csrc/quantization/fp4/nvfp4_utils.cuh), FlashInfer's
//!      standalone `fp4_quantize` (nv_internal quantization_utils.cuh) and its
//!      test reference `ref_fp4_quant` compute `os = 1 / (f32(SF) * (1 / gs))`,
//!      which is the same value when `gs` is a power of two and otherwise differs
//!      on 21 of 458,240 golden bytes; the contract follows the fused kernel.
//!    - `amax` ignores NaN (as `fmaxf`); e4m3 rounds to nearest even and
//!      encodes NaN as 0x7F; e2m1 rounds to nearest even, saturates to +-6
//!      and encodes NaN as +6 (0x7); signs of zeros are kept. The engines
//!      disagree on NaN, so the contract states its own choice: vLLM's
//!      static/per-token clamp `fmaxf(-448, fminf(x, 448))` turns NaN into +448,
//!      vLLM's group kernels and FlashInfer's per-token and group paths
//!      (`fminf(fmaxf(x, -448), 448)`) into -448, FlashInfer's static path keeps
//!      NaN. The golden vectors hold finite inputs only.
//!
//!    Arithmetic of the engine builds, not modelled: FlashInfer compiles its
//!    comm kernels with `-use_fast_math` (flashinfer/jit/core.py), so its
//!    `1.f / scale` and `gs / SF` are approximate (up to 1-2 ulp) and subnormals
//!    flush to zero; a FlashInfer binary matches the contract wherever its
//!    approximation returns the correctly rounded value (exactly, for a
//!    power-of-two `scale` or `gs`). vLLM's `scaled_fp4_quant` uses
//!    `rcp.approx.ftz` explicitly. arfuse's kernels compile with IEEE division
//!    and no FMA contraction, as this clause.
//!
//! Engine paths the contract does not follow (nothing implicit is offered for
//! them; a user comparing against them sees these differences):
//! - vLLM's CPU `_C.fused_add_rms_norm` (csrc/cpu/layernorm.cpp in vLLM 0.32) takes
//!   the variance of the unrounded f32 sum but normalises the rounded one; neither
//!   [`NormInput`] is that (the importer keeps that op opaque).
//! - DeepGEMM's test utilities (`per_token_cast_to_fp8`) floor a group's amax at
//!   1e-4 instead of 1e-10, so groups with amax below 1e-4 get other scales and
//!   codes than vLLM's kernels and this contract.
//!
//! ## Changelog
//!
//! v3 (clauses 2-3): the [`NormInput`] `f32_sum` form (vLLM's native
//! `fused_add_rms_norm`), in the IR, the rewrite, the kernels and the host device.
//! Every v2 result is unchanged (`residual` is the default).
//!
//! v2 (clause 4 only; clauses 1-3 unchanged):
//! - static FP8: `y * (1 / scale)` instead of `y / scale` (vLLM
//!   `static_scaled_fp8_quant`, FlashInfer's fused kernel). 24 of 1,003,520
//!   golden codes differed under v1.
//! - per-token-group FP8, f32 scales: the floor moves to amax, `max(amax, 1e-10)
//!   / 448` instead of `max(amax / 448, 1e-10)` (vLLM's kernels); all-zero groups
//!   get 2.2321428e-13 instead of 1e-10, and groups with amax below 4.48e-8 other
//!   codes. 8,570 of 271,488 golden codes and 282 of 2,121 scales differed.
//! - per-token-group FP8: new form `f32_row_major_ue8m0` (f32 storage,
//!   power-of-two values: vLLM's `use_ue8m0=True` with row-major scales), in the
//!   IR, the rewrite, the runtime and the kernels.
//! - per-token-group FP8, packed UE8M0: the tensor is `T + (ceil(G / 4) - 1) *
//!   round_up(T, 4)` words (vLLM's allocation) instead of `round_up(T, 4) *
//!   ceil(G / 4)`: the last word column has no padding rows, and no kernel writes
//!   them. 19 golden scale words were extra under v1.
//! - NVFP4: `SF = e4m3(gs * (amax * f32(1/6)))` instead of `e4m3((gs * amax) /
//!   6)`, and the element `y * (gs / SF)` instead of `(y * gs) / SF` (FlashInfer's
//!   fused kernel); they differ on exact ties, common with a power-of-two `gs`.
//!   1,003 of 572,800 golden data bytes differed under v1.
//!
//! f64 attributes (`eps`, constants) enter as the nearest f32 (`eps`) or in
//! one rounding to T ([`FloatFormat::round_f64`]).
//!
//! The IR's `rms_norm` and `fused_add_rms_norm` ops have the `once`
//! semantics, and the fused node the rounding its `norm_rounding` names, so an
//! explicit chain (all_reduce, add, rms_norm, quant) and the fused node are
//! bit-exact on the CPU. A *decomposed* norm is exact too when it is fused
//! with the rounding it spells: the Llama decomposition (cast to f32, pow 2,
//! mean keepdim, add eps, rsqrt, mul, cast back to T, mul by the T weight)
//! is `twice`, the Gemma one (`(h * r) * (1 + f32(w))` in f32, one cast back)
//! and gpt-oss' (`(f32(w) * (h * r))`, one cast back) are `once`; the two
//! forms differ by up to about 1 ulp of T (domain.md section 1), which
//! `check_equivalent` would report as a mismatch.

use crate::error::{ReferenceError, Result};
use crate::numerics::quant::{
    dynamic_per_token_fp8_quant, nvfp4_quant, per_token_group_fp8_quant, static_fp8_quant,
    GroupScaleLayout, GroupScales, Nvfp4ScaleLayout,
};
#[cfg(doc)]
use crate::numerics::quant::{group_fp8_scale, packed_group_scale_words};
use crate::numerics::FloatFormat;

/// The name of this contract, as kernels and reports cite it.
pub const CONTRACT_NAME: &str = "arfuse rounding contract v3";

/// The order of clause 3's sum of squares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SumOrder {
    /// Element by element, i = 0, 1, ..., H-1: the IR's `rms_norm` and the
    /// evaluator's reductions.
    Sequential,
    /// arfuse's kernels' block tree for the row ([`sum_of_squares`]).
    KernelTree,
}

/// Where RMSNorm rounds to T (clause 3): the IR's definition, re-exported so
/// that the kernels' host side names it from the contract.
pub use arfuse_ir::NormRounding;

/// What RMSNorm normalises when a residual is added (clauses 2-3): the IR's
/// definition, re-exported so that the kernels' host side names it from the contract.
pub use arfuse_ir::NormInput;

/// Clause 1: the all-reduce of one tensor over `W = ranks.len()` ranks.
///
/// `ranks[r]` holds rank r's values (each exactly representable in `t`,
/// same length for every rank). Returns `a = round_T(((+0.0 + f32(x_0)) +
/// f32(x_1)) + ... + f32(x_{W-1}))` element-wise (so all -0.0 inputs give
/// +0.0, as the Lamport kernels do).
pub fn all_reduce(ranks: &[&[f32]], t: FloatFormat) -> Result<Vec<f32>> {
    let first = ranks
        .first()
        .ok_or_else(|| ReferenceError::InvalidParameter("all-reduce over zero ranks".into()))?;
    if let Some((r, bad)) = ranks
        .iter()
        .enumerate()
        .find(|(_, x)| x.len() != first.len())
    {
        return Err(ReferenceError::InvalidShape(format!(
            "all-reduce: rank {r} has {} elements, rank 0 has {}",
            bad.len(),
            first.len()
        )));
    }
    let mut acc: Vec<f32> = vec![0.0; first.len()];
    for x in ranks {
        for (a, &v) in acc.iter_mut().zip(x.iter()) {
            *a += v;
        }
    }
    for a in &mut acc {
        *a = t.round(*a);
    }
    Ok(acc)
}

/// Clause 2 with [`NormInput::F32Sum`]: the unrounded `f32(a) + f32(residual)`
/// element-wise (one f32 addition; the norm reads it, `residual_out` is its rounding,
/// which is [`residual_add`]).
pub fn residual_sum_f32(a: &[f32], residual: &[f32]) -> Result<Vec<f32>> {
    if a.len() != residual.len() {
        return Err(ReferenceError::InvalidShape(format!(
            "residual add: {} vs {} elements",
            a.len(),
            residual.len()
        )));
    }
    Ok(a.iter().zip(residual).map(|(&x, &r)| x + r).collect())
}

/// Clauses 2 and 3's input: `(residual_out, norm input)` for the all-reduce output
/// `a` and this rank's residual (if any) under `input`: the rounded sum twice
/// ([`NormInput::Residual`]), or the rounded sum and the unrounded f32 sum
/// ([`NormInput::F32Sum`]). Without a residual both are `a`.
pub fn residual_and_norm_input(
    a: &[f32],
    residual: Option<&[f32]>,
    input: NormInput,
    t: FloatFormat,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let Some(r) = residual else {
        return Ok((a.to_vec(), a.to_vec()));
    };
    let h = residual_add(a, r, t)?;
    match input {
        NormInput::Residual => Ok((h.clone(), h)),
        NormInput::F32Sum => Ok((h, residual_sum_f32(a, r)?)),
    }
}

/// Clause 2: `h = round_T(f32(a) + f32(residual))` element-wise.
pub fn residual_add(a: &[f32], residual: &[f32], t: FloatFormat) -> Result<Vec<f32>> {
    if a.len() != residual.len() {
        return Err(ReferenceError::InvalidShape(format!(
            "residual add: {} vs {} elements",
            a.len(),
            residual.len()
        )));
    }
    Ok(a.iter()
        .zip(residual)
        .map(|(&x, &r)| t.round(x + r))
        .collect())
}

/// The f32 `eps` of the contract: the f32 nearest to the f64 attribute.
pub fn eps_f32(eps: f64) -> f32 {
    eps as f32
}

/// Lanes of a warp in arfuse's kernels.
const WARP_LANES: usize = 32;

/// A warp's butterfly sum (`v += __shfl_xor_sync(~0, v, o)` for o = 16, 8, 4, 2, 1):
/// lane l becomes `v_l + v_(l ^ o)` at each step; every lane ends with the same value.
fn warp_butterfly(mut v: [f32; WARP_LANES]) -> f32 {
    for o in [16, 8, 4, 2, 1] {
        let prev = v;
        for (l, x) in v.iter_mut().enumerate() {
            *x = prev[l] + prev[l ^ o];
        }
    }
    v[0]
}

/// Clause 3's sum of squares of one row `h` of T values (`elem_bytes` 2 or 4).
///
/// Where arfuse's kernels run the row (`arfuse_policy::arfuse_block_threads`), the
/// order is their block tree, a function of H and the element size only: B threads
/// (the policy's block size), each summing, sequentially, the squares of its 16-byte
/// vectors `t, t + B, t + 2B, ...` element by element; each warp's 32 partial sums
/// combined by the butterfly of `warp_butterfly`; the per-warp totals (zero for lanes
/// past the last warp) combined by the same butterfly. Any other row: sequentially.
pub fn sum_of_squares(h: &[f32], elem_bytes: u64) -> f32 {
    let act = match elem_bytes {
        2 => Some(arfuse_abi::ActDtype::Bf16),
        4 => Some(arfuse_abi::ActDtype::F32),
        _ => None,
    };
    let block = act.and_then(|d| arfuse_policy::arfuse_block_threads(h.len() as u64, d).ok());
    let Some(block) = block.map(|b| b as usize) else {
        return h.iter().fold(0.0f32, |ss, &v| ss + v * v);
    };
    let per_vec = (arfuse_abi::VECTOR_BYTES / elem_bytes) as usize;
    let nvec = h.len() / per_vec;
    let per_thread = nvec.div_ceil(block);
    let lane_sum = |t: usize| {
        let mut ss = 0.0f32;
        for v in 0..per_thread {
            let idx = t + v * block;
            if idx < nvec {
                for &x in &h[idx * per_vec..(idx + 1) * per_vec] {
                    ss += x * x;
                }
            }
        }
        ss
    };
    let mut warp_totals = [0.0f32; WARP_LANES];
    for (w, total) in warp_totals.iter_mut().enumerate().take(block / WARP_LANES) {
        let mut lanes = [0.0f32; WARP_LANES];
        for (l, x) in lanes.iter_mut().enumerate() {
            *x = lane_sum(w * WARP_LANES + l);
        }
        *total = warp_butterfly(lanes);
    }
    warp_butterfly(warp_totals)
}

/// Clause 3 for one token of T values (`elem_bytes` bytes each):
/// `r = 1 / sqrt(ss / H + eps)` with `ss` summed in `order`.
pub fn rms_inv(h: &[f32], eps: f32, order: SumOrder, elem_bytes: u64) -> f32 {
    let ss = match order {
        SumOrder::Sequential => h.iter().fold(0.0f32, |ss, &v| ss + v * v),
        SumOrder::KernelTree => sum_of_squares(h, elem_bytes),
    };
    1.0 / (ss / h.len() as f32 + eps).sqrt()
}

/// Clause 3, `once`: RMSNorm of `h` (`[tokens, hidden]` row-major, `hidden =
/// gamma.len()`), `y_i = round_T((h_i * r) * (gamma_i + weight_bias))`.
///
/// Errors: see [`rms_norm_with`].
pub fn rms_norm(
    h: &[f32],
    gamma: &[f32],
    eps: f64,
    weight_bias: f64,
    t: FloatFormat,
) -> Result<Vec<f32>> {
    rms_norm_with(h, gamma, eps, weight_bias, NormRounding::Once, t)
}

/// Clause 3 with the IR's sequential sum ([`rms_norm_ordered`] with
/// [`SumOrder::Sequential`]).
///
/// Errors: see [`rms_norm_ordered`].
pub fn rms_norm_with(
    h: &[f32],
    gamma: &[f32],
    eps: f64,
    weight_bias: f64,
    rounding: NormRounding,
    t: FloatFormat,
) -> Result<Vec<f32>> {
    rms_norm_ordered(
        h,
        gamma,
        eps,
        weight_bias,
        rounding,
        SumOrder::Sequential,
        t,
    )
}

/// Clause 3: RMSNorm of `h` (`[tokens, hidden]` row-major, `hidden =
/// gamma.len()`) with the rounding `rounding` names: `once`,
/// `y_i = round_T((h_i * r) * (gamma_i + weight_bias))`; `twice`,
/// `y_i = round_T(round_T(h_i * r) * (gamma_i + weight_bias))`.
///
/// `gamma` holds the weight values (T or f32); `order` is the sum of squares' order
/// (the IR's sequential one, or arfuse's kernels' tree). Errors on a shape mismatch,
/// an empty hidden dim, or `eps` not finite and > 0.
pub fn rms_norm_ordered(
    h: &[f32],
    gamma: &[f32],
    eps: f64,
    weight_bias: f64,
    rounding: NormRounding,
    order: SumOrder,
    t: FloatFormat,
) -> Result<Vec<f32>> {
    let hidden = gamma.len();
    if hidden == 0 || h.len() % hidden != 0 {
        return Err(ReferenceError::InvalidShape(format!(
            "rms_norm: {} input elements do not form rows of the weight's {hidden}",
            h.len()
        )));
    }
    if !(eps.is_finite() && eps > 0.0) {
        return Err(ReferenceError::InvalidParameter(format!(
            "rms_norm eps must be finite and > 0, got {eps}"
        )));
    }
    if !weight_bias.is_finite() {
        return Err(ReferenceError::InvalidParameter(format!(
            "weight_bias must be finite, got {weight_bias}"
        )));
    }
    let eps = eps_f32(eps);
    let wb = weight_bias as f32;
    let normed = |x: f32, r: f32| match rounding {
        NormRounding::Once => x * r,
        NormRounding::Twice => t.round(x * r),
    };
    let mut out = Vec::with_capacity(h.len());
    for row in h.chunks_exact(hidden) {
        let r = rms_inv(row, eps, order, u64::from(t.bytes()));
        out.extend(
            row.iter()
                .zip(gamma)
                .map(|(&x, &g)| t.round(normed(x, r) * (g + wb))),
        );
    }
    Ok(out)
}

/// Clause 4: the quant epilogue of the fused node (or of a standalone quant op).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Epilogue {
    /// No quantisation.
    None,
    /// Static per-tensor FP8 with this dequant scale.
    Fp8Static {
        /// The fp32 dequant scale (the 1-element scale tensor).
        scale: f32,
    },
    /// Dynamic per-token FP8.
    Fp8PerToken,
    /// Per-token-group FP8. The form fixes both the scale values and their
    /// storage ([`GroupScaleLayout`]: f32 `max(amax, 1e-10) / 448`, or
    /// power-of-two scales packed or as f32).
    Fp8PerTokenGroup {
        /// Elements per group.
        group_size: usize,
        /// Scale form.
        layout: GroupScaleLayout,
    },
    /// NVFP4 with this global scale (multiplied, not inverted).
    Nvfp4 {
        /// The fp32 global scale.
        global_scale: f32,
        /// Scale layout.
        layout: Nvfp4ScaleLayout,
    },
}

/// The quant output of an epilogue, logical (un-swizzled) values.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantOut {
    /// e4m3 values (decoded to f32), `[tokens, hidden]`.
    Fp8 {
        /// Decoded e4m3 values.
        values: Vec<f32>,
    },
    /// e4m3 values plus f32 scales `[tokens, 1]`.
    Fp8PerToken {
        /// Decoded e4m3 values.
        values: Vec<f32>,
        /// Per-token scales.
        scales: Vec<f32>,
    },
    /// e4m3 values plus group scales in their layout.
    Fp8PerTokenGroup {
        /// Decoded e4m3 values.
        values: Vec<f32>,
        /// Scales (packed words or f32).
        scales: GroupScales,
    },
    /// NVFP4 packed data `[tokens, hidden / 2]` bytes and the e4m3 block
    /// scales as stored (swizzled or linear) bytes.
    Nvfp4 {
        /// Packed e2m1 bytes, low nibble first.
        data: Vec<u8>,
        /// Scale bytes in the requested layout.
        scales: Vec<u8>,
    },
}

/// Clause 4: apply an epilogue to `y` (`[tokens, hidden]`, values already
/// rounded to T).
pub fn apply_epilogue(
    y: &[f32],
    tokens: usize,
    hidden: usize,
    epilogue: Epilogue,
) -> Result<Option<QuantOut>> {
    use crate::numerics::fp8::e4m3_to_f32;
    let decode = |codes: Vec<u8>| codes.into_iter().map(e4m3_to_f32).collect::<Vec<f32>>();
    Ok(match epilogue {
        Epilogue::None => None,
        Epilogue::Fp8Static { scale } => Some(QuantOut::Fp8 {
            values: decode(static_fp8_quant(y, scale)?),
        }),
        Epilogue::Fp8PerToken => {
            let (codes, scales) = dynamic_per_token_fp8_quant(y, tokens, hidden)?;
            Some(QuantOut::Fp8PerToken {
                values: decode(codes),
                scales,
            })
        }
        Epilogue::Fp8PerTokenGroup { group_size, layout } => {
            let g = per_token_group_fp8_quant(y, tokens, hidden, group_size, layout)?;
            Some(QuantOut::Fp8PerTokenGroup {
                values: decode(g.data),
                scales: g.scales,
            })
        }
        Epilogue::Nvfp4 {
            global_scale,
            layout,
        } => {
            let q = nvfp4_quant(y, tokens, hidden, global_scale, layout)?;
            Some(QuantOut::Nvfp4 {
                data: q.data,
                scales: q.scales,
            })
        }
    })
}

/// Everything the fused op computes for one rank (all of it; the node writes
/// only the live outputs).
#[derive(Debug, Clone, PartialEq)]
pub struct FusedResult {
    /// `h` (clauses 1-2): the new residual, `[tokens, hidden]`.
    pub residual_out: Vec<f32>,
    /// `y` (clause 3), `[tokens, hidden]`.
    pub norm_out: Vec<f32>,
    /// Clause 4, when an epilogue is set.
    pub quant: Option<QuantOut>,
}

/// Parameters of [`fused_allreduce_norm`] other than the tensors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedParams {
    /// Activation dtype T.
    pub t: FloatFormat,
    /// RMSNorm epsilon (f64 attribute; used as the nearest f32).
    pub eps: f64,
    /// 0, or 1 for Gemma-style offset weights.
    pub weight_bias: f64,
    /// Where the RMSNorm rounds to T (clause 3).
    pub norm_rounding: NormRounding,
    /// What the RMSNorm normalises with a residual (clauses 2-3).
    pub norm_input: NormInput,
    /// Quant epilogue.
    pub epilogue: Epilogue,
}

/// The whole fused op for one rank: clauses 1-4 in order.
///
/// `ranks[r]`: rank r's all-reduce input `[tokens, hidden]`; `residual`:
/// this rank's residual `[tokens, hidden]` or `None`; `gamma`: `[hidden]`.
pub fn fused_allreduce_norm(
    ranks: &[&[f32]],
    residual: Option<&[f32]>,
    gamma: &[f32],
    params: FusedParams,
) -> Result<FusedResult> {
    let a = all_reduce(ranks, params.t)?;
    let (h, norm_in) = residual_and_norm_input(&a, residual, params.norm_input, params.t)?;
    let y = rms_norm_with(
        &norm_in,
        gamma,
        params.eps,
        params.weight_bias,
        params.norm_rounding,
        params.t,
    )?;
    let hidden = gamma.len();
    let tokens = y.len() / hidden;
    let quant = apply_epilogue(&y, tokens, hidden, params.epilogue)?;
    Ok(FusedResult {
        residual_out: h,
        norm_out: y,
        quant,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BF: FloatFormat = FloatFormat::Bf16;

    #[test]
    fn all_reduce_rounds_once_after_fp32_rank_order_sum() {
        // 1 + 2^-8 + 2^-8: in f32 exactly 1 + 2^-7 (a bf16 value); summing in
        // bf16 pairwise would give 1 (each 2^-8 addition is a tie to even).
        let e = 1.0 / 256.0;
        let (x0, x1, x2) = ([1.0f32], [e], [e]);
        let a = all_reduce(&[&x0, &x1, &x2], BF).unwrap();
        assert_eq!(a, vec![1.0 + 1.0 / 128.0]);
        // Rank order matters in f32: 2^24 + 1 + 1 = 2^24 (each +1 is a tie), 1 + 1 + 2^24 = 2^24 + 2.
        let big = 16_777_216.0f32;
        let f = FloatFormat::F32;
        assert_eq!(all_reduce(&[&[big], &[1.0], &[1.0]], f).unwrap(), vec![big]);
        assert_eq!(
            all_reduce(&[&[1.0], &[1.0], &[big]], f).unwrap(),
            vec![big + 2.0]
        );
        assert!(all_reduce(&[], BF).is_err());
        assert!(all_reduce(&[&[1.0], &[1.0, 2.0]], BF).is_err());
    }

    #[test]
    fn all_reduce_of_negative_zeros_is_positive_zero() {
        // The Lamport kernels send -0.0 as +0.0 (it is their empty sentinel), so the
        // contract starts the sum at +0.0: all -0.0 in gives +0.0 out.
        let z = [-0.0f32];
        let a = all_reduce(&[&z, &z, &z, &z], BF).unwrap();
        assert_eq!(a[0].to_bits(), 0.0f32.to_bits());
        // One negative subnormal stays negative: +0.0 + x is x for any x != -0.0.
        let tiny = -f32::from_bits(1);
        let a = all_reduce(&[&[tiny], &z], FloatFormat::F32).unwrap();
        assert_eq!(a[0].to_bits(), tiny.to_bits());
    }

    #[test]
    fn residual_is_added_to_the_rounded_all_reduce() {
        // Ranks 1.0, 2^-8 and 2^-16 (bf16 values): the f32 sum 1 + 2^-8 + 2^-16 rounds
        // (bf16) up to 1 + 2^-7. Adding the residual -2^-7 then gives exactly 1.0.
        // Skipping the intermediate rounding would give
        // round(1 + 2^-8 + 2^-16 - 2^-7) = 1 - 2^-8.
        let (e8, e16) = (1.0f32 / 256.0, 1.0f32 / 65536.0);
        let a = all_reduce(&[&[1.0], &[e8], &[e16]], BF).unwrap();
        assert_eq!(a, vec![1.0 + 1.0 / 128.0]);
        let h = residual_add(&a, &[-1.0 / 128.0], BF).unwrap();
        assert_eq!(h, vec![1.0]);
        let unrounded = BF.round(1.0 + e8 + e16 - 1.0 / 128.0);
        assert_eq!(unrounded, 1.0 - 1.0 / 256.0);
        assert!(residual_add(&[1.0], &[1.0, 2.0], BF).is_err());
    }

    #[test]
    fn rms_norm_values() {
        // h = [3, 4]: ss = 25, mean 12.5, eps tiny -> r = 1/sqrt(12.5) = 0.28284273.
        let h = [3.0f32, 4.0];
        let y = rms_norm(&h, &[1.0, 1.0], 1e-6, 0.0, FloatFormat::F32).unwrap();
        let r = 1.0f32 / (12.5f32 + 1e-6f32).sqrt();
        assert_eq!(y, vec![3.0 * r, 4.0 * r]);
        assert!((y[0] - 0.848_528_1).abs() < 1e-6);
        // Gemma form: weight 0 with weight_bias 1 is the same as weight 1.
        let g = rms_norm(&h, &[0.0, 0.0], 1e-6, 1.0, FloatFormat::F32).unwrap();
        assert_eq!(g, y);
        // bf16: one rounding of the f32 product.
        let b = rms_norm(&h, &[1.0, 2.0], 1e-6, 0.0, BF).unwrap();
        assert_eq!(b, vec![BF.round(3.0 * r), BF.round((4.0 * r) * 2.0)]);
        assert_eq!(b, vec![0.847_656_25, 2.265_625]);
        // Two tokens are normalised independently.
        let two = rms_norm(
            &[3.0, 4.0, 6.0, 8.0],
            &[1.0, 1.0],
            1e-6,
            0.0,
            FloatFormat::F32,
        )
        .unwrap();
        assert_eq!(&two[..2], &y[..]);
        assert!(rms_norm(&h, &[1.0; 3], 1e-6, 0.0, BF).is_err());
        assert!(rms_norm(&h, &[1.0; 2], 0.0, 0.0, BF).is_err());
        assert!(rms_norm(&h, &[], 1e-6, 0.0, BF).is_err());
    }

    #[test]
    fn twice_rounds_the_normalised_value_first_and_differs_from_once() {
        // `twice` is the Llama decomposition, element for element; `once` differs from
        // it by at most 1 ulp, and does differ for some inputs.
        let mut differs = 0;
        for k in 0..2000u32 {
            let h: Vec<f32> = (0..8)
                .map(|i| BF.round(((k * 8 + i) as f32 * 0.37).sin() * 3.0))
                .collect();
            let gamma: Vec<f32> = (0..8)
                .map(|i| BF.round(0.5 + ((k + i) as f32 * 0.11).cos()))
                .collect();
            let once = rms_norm(&h, &gamma, 1e-5, 0.0, BF).unwrap();
            let twice = rms_norm_with(&h, &gamma, 1e-5, 0.0, NormRounding::Twice, BF).unwrap();
            let r = rms_inv(&h, eps_f32(1e-5), SumOrder::Sequential, 2);
            for i in 0..8 {
                let llama = BF.round(BF.round(h[i] * r) * gamma[i]);
                assert_eq!(twice[i].to_bits(), llama.to_bits(), "k {k} i {i}");
                let d = BF.ulp_distance(once[i], twice[i]);
                assert!(d <= 1, "k {k} i {i}: {d} ulp");
                differs += usize::from(d > 0);
            }
        }
        assert!(differs > 0);
        // f32 activations: the first rounding is exact, the forms agree.
        let h = [3.0f32, 4.0];
        let f = FloatFormat::F32;
        assert_eq!(
            rms_norm_with(&h, &[0.7, 1.3], 1e-6, 0.0, NormRounding::Twice, f).unwrap(),
            rms_norm(&h, &[0.7, 1.3], 1e-6, 0.0, f).unwrap()
        );
    }

    #[test]
    fn fused_without_residual_returns_the_all_reduce_as_residual() {
        let x0 = [1.0f32, 2.0, 3.0, 4.0];
        let x1 = [0.5f32, 0.5, 0.5, 0.5];
        let p = FusedParams {
            t: BF,
            eps: 1e-6,
            weight_bias: 0.0,
            norm_rounding: NormRounding::Once,
            norm_input: NormInput::Residual,
            epilogue: Epilogue::Fp8Static { scale: 0.5 },
        };
        let out = fused_allreduce_norm(&[&x0, &x1], None, &[1.0, 1.0], p).unwrap();
        assert_eq!(out.residual_out, vec![1.5, 2.5, 3.5, 4.5]);
        let y = rms_norm(&out.residual_out, &[1.0, 1.0], 1e-6, 0.0, BF).unwrap();
        assert_eq!(out.norm_out, y);
        let Some(QuantOut::Fp8 { values }) = out.quant else {
            panic!("static fp8 output expected")
        };
        let want: Vec<f32> = y
            .iter()
            .map(|&v| crate::numerics::fp8::round_e4m3(v * (1.0 / 0.5)))
            .collect();
        assert_eq!(values, want);

        let with_res =
            fused_allreduce_norm(&[&x0, &x1], Some(&[1.0, 1.0, 1.0, 1.0]), &[1.0, 1.0], p).unwrap();
        assert_eq!(with_res.residual_out, vec![2.5, 3.5, 4.5, 5.5]);
    }

    #[test]
    fn f32_sum_input_is_the_unrounded_sum_and_residual_out_its_rounding() {
        // a = 1 (bf16), residual = 2^-9: the f32 sum 1 + 2^-9 is not a bf16 value; the
        // residual output rounds it (a tie, to even: 1.0), the f32_sum norm reads it.
        let a = [1.0f32, 3.0];
        let r = [1.0f32 / 512.0, 0.25];
        let (h, n) = residual_and_norm_input(&a, Some(&r), NormInput::F32Sum, BF).unwrap();
        assert_eq!(h, vec![1.0, 3.25]);
        assert_eq!(n, vec![1.0 + 1.0 / 512.0, 3.25]);
        let (h2, n2) = residual_and_norm_input(&a, Some(&r), NormInput::Residual, BF).unwrap();
        assert_eq!((h2.clone(), n2), (h.clone(), h));
        // Without a residual both are the all-reduce output.
        let (h3, n3) = residual_and_norm_input(&a, None, NormInput::F32Sum, BF).unwrap();
        assert_eq!((h3, n3), (a.to_vec(), a.to_vec()));
        // The fused op normalises what its input says.
        let p = FusedParams {
            t: BF,
            eps: 1e-6,
            weight_bias: 0.0,
            norm_rounding: NormRounding::Twice,
            norm_input: NormInput::F32Sum,
            epilogue: Epilogue::None,
        };
        let zero = [0.0f32, 0.0];
        let out = fused_allreduce_norm(&[&a, &zero], Some(&r), &[1.0, 1.0], p).unwrap();
        let want = rms_norm_with(
            &n2_of(&a, &r),
            &[1.0, 1.0],
            1e-6,
            0.0,
            NormRounding::Twice,
            BF,
        )
        .unwrap();
        assert_eq!(out.norm_out, want);
        assert_eq!(out.residual_out, h2);
        assert!(residual_sum_f32(&a, &r[..1]).is_err());
    }

    fn n2_of(a: &[f32], r: &[f32]) -> Vec<f32> {
        a.iter().zip(r).map(|(x, y)| x + y).collect()
    }

    /// The kernels' tree order and the IR's sequential one are really different
    /// orders (some outputs move), and for these inputs (weights in [-2, 2]) they
    /// move a 16-bit output by at most 1 ulp with one rounding, 2 with two.
    #[test]
    fn kernel_tree_order_is_within_the_tolerance_of_the_sequential_one() {
        let mut moved = 0usize;
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
        };
        for (h, fmt) in [
            (2048usize, FloatFormat::Bf16),
            (4096, FloatFormat::F16),
            (7168, FloatFormat::Bf16),
            (16384, FloatFormat::Bf16),
        ] {
            let x: Vec<f32> = (0..h).map(|_| fmt.round(next())).collect();
            let g: Vec<f32> = (0..h).map(|_| fmt.round(next() / 2.0)).collect();
            for rounding in [NormRounding::Once, NormRounding::Twice] {
                let seq = rms_norm_ordered(&x, &g, 1e-6, 0.0, rounding, SumOrder::Sequential, fmt)
                    .unwrap();
                let tree = rms_norm_ordered(&x, &g, 1e-6, 0.0, rounding, SumOrder::KernelTree, fmt)
                    .unwrap();
                let bound = match rounding {
                    NormRounding::Once => 1,
                    NormRounding::Twice => 2,
                };
                for (a, b) in seq.iter().zip(&tree) {
                    let d = fmt.ulp_distance(*a, *b);
                    assert!(d <= bound, "H={h} {rounding:?}: {d} ulp");
                    moved += usize::from(d > 0);
                }
            }
        }
        assert!(moved > 0);
    }
}
