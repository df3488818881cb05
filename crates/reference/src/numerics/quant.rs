//! The quant epilogues of domain.md section 1, applied to `y` (the RMSNorm
//! output, already rounded to the activation dtype and widened to f32), with
//! their scale layouts and byte sizes.
//!
//! All functions take `y` as a row-major `[tokens, hidden]` slice of f32 and
//! return the storage bytes / words the kernel writes. Byte sizes use checked
//! `u64` arithmetic and return [`ReferenceError::SizeOverflow`] instead of
//! wrapping.
//!
//! Reductions (`amax`) ignore NaN, as CUDA's `fmaxf` does; a NaN element
//! itself then encodes as documented in [`super::fp8`] / [`super::fp4`].

use super::fp4::{e2m1_from_f32, pack_e2m1};
use super::fp8::{e4m3_satfinite, e4m3_to_f32, E4M3_MAX};
use super::ue8m0::{pack_ue8m0x4, ue8m0_round_up, ue8m0_to_f32};
use crate::error::{ReferenceError, Result};

/// Lower bound of the dynamic per-token FP8 scale: `1 / (512 * 448)`
/// (vLLM's `min_scaling_factor`), the f32 nearest to 1/229376.
pub const DYNAMIC_FP8_MIN_SCALE: f32 = 1.0 / (512.0 * 448.0);

/// The per-token-group FP8 floor (vLLM's `eps` argument, 1e-10 as f32): the
/// group's amax is raised to it before the division by 448, and a UE8M0 scale is
/// raised to it again before its power-of-two rounding (contract clause 4).
pub const GROUP_FP8_MIN_SCALE: f32 = 1e-10;

/// `1 / 6` rounded to f32 (0x3E2AAAAB): the constant FlashInfer's fused NVFP4 kernel
/// multiplies the block amax by (`RECIPROCAL_6` in `cvt_warp_fp16_to_fp4`).
pub const NVFP4_RECIPROCAL_6: f32 = 1.0 / 6.0;

/// The NVFP4 block and its swizzled tile, and the kernels' FP8 group size: the ABI's
/// one definition.
pub use arfuse_abi::{FP8_GROUP_SIZE, NVFP4_BLOCK, NVFP4_TILE_COLS, NVFP4_TILE_ROWS};

/// [`NVFP4_BLOCK`] as a slice length.
const NVFP4_BLOCK_LEN: usize = NVFP4_BLOCK as usize;
/// Bytes of one swizzled NVFP4 scale tile (128 rows x 4 columns).
pub const NVFP4_TILE_BYTES: u64 = 512;

fn check_matrix(y: &[f32], tokens: usize, hidden: usize, what: &str) -> Result<()> {
    let n = tokens
        .checked_mul(hidden)
        .ok_or(ReferenceError::SizeOverflow("tokens * hidden"))?;
    if n != y.len() {
        return Err(ReferenceError::InvalidShape(format!(
            "{what}: input has {} elements, expected tokens {tokens} x hidden {hidden}",
            y.len()
        )));
    }
    if hidden == 0 {
        return Err(ReferenceError::InvalidShape(format!(
            "{what}: hidden size is 0"
        )));
    }
    Ok(())
}

fn amax(values: &[f32]) -> f32 {
    // f32::max ignores a NaN operand, like fmaxf.
    values.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// Static (per-tensor) FP8 (contract v3): `inv = 1 / scale` (one correctly
/// rounded f32 division), `q = e4m3_satfinite(y * inv)`, where `scale` is the
/// dequant scale (the single element of a 1-element fp32 tensor). This is the
/// order of vLLM's `static_scaled_fp8_quant` and of FlashInfer's fused kernel
/// (patterns 2/4); `y / scale` differs from it in about 1 code in 40,000 on the
/// golden vectors.
///
/// Output: e4m3 codes, same length and order as `y`.
/// Errors: `scale` not finite or not > 0.
pub fn static_fp8_quant(y: &[f32], scale: f32) -> Result<Vec<u8>> {
    if !(scale.is_finite() && scale > 0.0) {
        return Err(ReferenceError::InvalidParameter(format!(
            "static FP8 scale must be finite and > 0, got {scale}"
        )));
    }
    let inv = 1.0 / scale;
    Ok(y.iter().map(|&v| e4m3_satfinite(v * inv)).collect())
}

/// Dynamic per-token FP8 (FlashInfer patterns 10/11):
/// `scale_t = max(amax_t / 448, 1 / (512 * 448))`,
/// `q = e4m3(clamp(y / scale_t, -448, 448))`.
///
/// Input `y`: `[tokens, hidden]` row-major. Output: (codes `[tokens, hidden]`,
/// scales fp32 `[tokens, 1]`).
pub fn dynamic_per_token_fp8_quant(
    y: &[f32],
    tokens: usize,
    hidden: usize,
) -> Result<(Vec<u8>, Vec<f32>)> {
    check_matrix(y, tokens, hidden, "dynamic per-token FP8")?;
    let mut codes = Vec::with_capacity(y.len());
    let mut scales = Vec::with_capacity(tokens);
    for row in y.chunks_exact(hidden) {
        let scale = (amax(row) / E4M3_MAX).max(DYNAMIC_FP8_MIN_SCALE);
        scales.push(scale);
        codes.extend(
            row.iter()
                .map(|&v| e4m3_satfinite((v / scale).clamp(-E4M3_MAX, E4M3_MAX))),
        );
    }
    Ok((codes, scales))
}

/// The form of the per-token-group FP8 scales (the IR's enum, the one
/// definition; its scale values are given by [`group_fp8_scale`]):
/// - `F32RowMajor`: fp32 `[T, G]` row-major, `G = H / group_size`, unrounded.
/// - `F32RowMajorUe8m0`: the same storage, power-of-two values.
/// - `PackedUe8m0`: DeepGEMM's packed layout (FlashInfer patterns 8/9): UE8M0
///   codes, four consecutive groups of a token per little-endian int32 (group
///   `4j + k` in byte `k` of word column `j`); word column `j` starts at word
///   `j * round_up(T, 4)`; the tensor has [`packed_group_scale_words`] words
///   (the last column only T rows, as vLLM allocates it); padding rows of the
///   other columns and unused bytes are zero.
pub use arfuse_ir::GroupScaleLayout;

/// Scales produced by [`per_token_group_fp8_quant`].
#[derive(Debug, Clone, PartialEq)]
pub enum GroupScales {
    /// See [`GroupScaleLayout::PackedUe8m0`]: `words.len() ==
    /// packed_group_scale_words(T, packed_cols)`, word of (token t, word column j)
    /// at index `j * padded_tokens + t`.
    PackedUe8m0 {
        /// The int32 words (as u32 bit patterns).
        words: Vec<u32>,
        /// `round_up(T, 4)`: the column stride in words.
        padded_tokens: usize,
        /// `ceil(G / 4)`.
        packed_cols: usize,
    },
    /// `[T, G]` row-major fp32 (both f32 forms).
    Fp32 {
        /// The scales.
        values: Vec<f32>,
        /// Groups per token `G`.
        groups: usize,
    },
}

/// Output of [`per_token_group_fp8_quant`].
#[derive(Debug, Clone, PartialEq)]
pub struct GroupQuant {
    /// e4m3 codes, `[T, H]` row-major.
    pub data: Vec<u8>,
    /// The scales in the requested layout.
    pub scales: GroupScales,
}

/// Word index and byte within the word of the scale of (`token`, `group`)
/// in the packed UE8M0 layout for `tokens` tokens.
pub fn packed_group_scale_position(
    token: usize,
    group: usize,
    tokens: usize,
) -> Result<(usize, usize)> {
    let padded = round_up_usize(tokens, 4)?;
    let idx = (group / 4)
        .checked_mul(padded)
        .and_then(|v| v.checked_add(token))
        .ok_or(ReferenceError::SizeOverflow("packed group scale index"))?;
    Ok((idx, group % 4))
}

/// Words of the packed UE8M0 scale tensor of `tokens` tokens and `packed_cols =
/// ceil(G / 4)` word columns: `T + (C - 1) * round_up(T, 4)` (0 when T or C is 0).
///
/// This is the storage of the `[T, C]` int32 tensor with strides `(1,
/// round_up(T, 4))` that vLLM's `per_token_group_quant_fp8_packed_for_deepgemm`
/// allocates (`torch.empty_strided`) and its packed kernel writes (its
/// `num_scale_elems`); FlashInfer's fused kernel (patterns 8/9) writes the same
/// words. It is up to 3 words less than `round_up(T, 4) * C` when `T % 4 != 0`:
/// the last column has no padding rows.
pub fn packed_group_scale_words(tokens: usize, packed_cols: usize) -> Result<usize> {
    if tokens == 0 || packed_cols == 0 {
        return Ok(0);
    }
    round_up_usize(tokens, 4)?
        .checked_mul(packed_cols - 1)
        .and_then(|v| v.checked_add(tokens))
        .ok_or(ReferenceError::SizeOverflow("packed group scale words"))
}

/// Bytes of the packed UE8M0 scale tensor: `4 * packed_group_scale_words(T,
/// ceil(G / 4))` with `G = hidden / group_size`. Worked: T = 5, H = 640,
/// group 128 (G = 5, C = 2): 5 + 8 = 13 words, 52 bytes.
pub fn packed_group_scale_bytes(tokens: u64, hidden: u64, group_size: u64) -> Result<u64> {
    if group_size == 0 || hidden % group_size != 0 {
        return Err(ReferenceError::InvalidShape(format!(
            "hidden {hidden} is not a multiple of the group size {group_size}"
        )));
    }
    let overflow = ReferenceError::SizeOverflow("packed group scale bytes");
    let tokens = usize::try_from(tokens).map_err(|_| overflow.clone())?;
    let cols = usize::try_from((hidden / group_size).div_ceil(4)).map_err(|_| overflow.clone())?;
    u64::try_from(packed_group_scale_words(tokens, cols)?)
        .ok()
        .and_then(|w| w.checked_mul(4))
        .ok_or(overflow)
}

/// Bytes of the scale tensor of any per-token-group form: the packed bytes
/// ([`packed_group_scale_bytes`]), or `T * G * 4` for the two f32 forms.
pub fn group_scale_bytes(
    tokens: u64,
    hidden: u64,
    group_size: u64,
    layout: GroupScaleLayout,
) -> Result<u64> {
    if layout.f32_storage() {
        if group_size == 0 || hidden % group_size != 0 {
            return Err(ReferenceError::InvalidShape(format!(
                "hidden {hidden} is not a multiple of the group size {group_size}"
            )));
        }
        tokens
            .checked_mul(hidden / group_size)
            .and_then(|v| v.checked_mul(4))
            .ok_or(ReferenceError::SizeOverflow("group scale bytes"))
    } else {
        packed_group_scale_bytes(tokens, hidden, group_size)
    }
}

/// The scale of one per-token-group FP8 group (contract v3, clause 4) for the
/// form `layout`:
/// - f32 form: `max(amax, 1e-10) / 448` (vLLM's `per_token_group_quant_8bit`
///   kernels with `scale_ue8m0 = false`, its Triton kernel and
///   `native_per_token_group_quant_fp8`: the floor is applied to amax);
/// - UE8M0 forms: `s = max(max(amax, 1e-10) / 448, 1e-10)` rounded UP to a power
///   of two ([`ue8m0_round_up`]; vLLM's register kernels bump the f32 exponent
///   when the mantissa is not zero, FlashInfer's `compute_ue8m0_scale` the same).
///
/// Returns the scale and its UE8M0 code (0 for the f32 form).
pub fn group_fp8_scale(block: &[f32], layout: GroupScaleLayout) -> (f32, u8) {
    let raw = amax(block).max(GROUP_FP8_MIN_SCALE) / E4M3_MAX;
    if layout.power_of_two_scales() {
        let code = ue8m0_round_up(raw.max(GROUP_FP8_MIN_SCALE));
        (ue8m0_to_f32(code), code)
    } else {
        (raw, 0)
    }
}

/// Per-token-group FP8 (DeepSeek-style block quant, FlashInfer patterns
/// 8/9): for each token and each group of `group_size` consecutive
/// elements, `scale` from [`group_fp8_scale`] and
/// `q = e4m3(clamp(y / scale, -448, 448))` (for a power-of-two scale this is
/// the same value as vLLM's `y * (1 / scale)`).
///
/// Input `y`: `[tokens, hidden]` row-major, `hidden % group_size == 0`.
pub fn per_token_group_fp8_quant(
    y: &[f32],
    tokens: usize,
    hidden: usize,
    group_size: usize,
    layout: GroupScaleLayout,
) -> Result<GroupQuant> {
    check_matrix(y, tokens, hidden, "per-token-group FP8")?;
    if group_size == 0 || hidden % group_size != 0 {
        return Err(ReferenceError::InvalidShape(format!(
            "per-token-group FP8: hidden {hidden} is not a multiple of the group size {group_size}"
        )));
    }
    let groups = hidden / group_size;
    let mut data = Vec::with_capacity(y.len());
    // Scales as (value, ue8m0 code) in [T, G] row-major order first.
    let mut scale_vals = Vec::with_capacity(tokens * groups);
    let mut scale_codes = Vec::with_capacity(tokens * groups);
    for block in y.chunks_exact(group_size) {
        let (scale, code) = group_fp8_scale(block, layout);
        scale_vals.push(scale);
        scale_codes.push(code);
        data.extend(
            block
                .iter()
                .map(|&v| e4m3_satfinite((v / scale).clamp(-E4M3_MAX, E4M3_MAX))),
        );
    }
    let scales = match layout {
        GroupScaleLayout::F32RowMajor | GroupScaleLayout::F32RowMajorUe8m0 => GroupScales::Fp32 {
            values: scale_vals,
            groups,
        },
        GroupScaleLayout::PackedUe8m0 => {
            let padded_tokens = round_up_usize(tokens, 4)?;
            let packed_cols = groups.div_ceil(4);
            let mut words = vec![0u32; packed_group_scale_words(tokens, packed_cols)?];
            for t in 0..tokens {
                for j in 0..packed_cols {
                    let mut bytes = [0u8; 4];
                    for (k, b) in bytes.iter_mut().enumerate() {
                        let g = 4 * j + k;
                        if g < groups {
                            *b = scale_codes[t * groups + g];
                        }
                    }
                    words[j * padded_tokens + t] = pack_ue8m0x4(bytes);
                }
            }
            GroupScales::PackedUe8m0 {
                words,
                padded_tokens,
                packed_cols,
            }
        }
    };
    Ok(GroupQuant { data, scales })
}

/// Layout of the NVFP4 scale factors (the IR's enum):
/// - `Swizzled128x4` (the default; what block-scaled GEMMs consume): rows
///   padded to a multiple of 128, scale columns (`H / 16`) padded to a
///   multiple of 4, 512-byte tiles of 128 rows x 4 columns ordered row-tile
///   major; see [`nvfp4_scale_offset`]. Padding bytes are zero.
/// - `Linear`: row-major `[T, H / 16]`, no padding.
pub use arfuse_ir::Nvfp4ScaleLayout;

/// Bytes of the NVFP4 data tensor `[T, H / 2]` u8: `T * H / 2`.
/// Worked: T = 1, H = 16384 -> 8,192 bytes.
pub fn nvfp4_data_bytes(tokens: u64, hidden: u64) -> Result<u64> {
    check_nvfp4_hidden(hidden)?;
    tokens
        .checked_mul(hidden / 2)
        .ok_or(ReferenceError::SizeOverflow("NVFP4 data bytes"))
}

/// Bytes of the NVFP4 scale tensor (one e4m3 byte per block of 16).
/// Swizzled: `round_up(T, 128) * round_up(H / 16, 4)`; linear: `T * H / 16`.
/// Worked: T = 1, H = 16384 swizzled -> 131,072; T = 1, H = 14336 swizzled ->
/// 114,688 (linear 896, the under-allocation bug of domain.md section 1).
pub fn nvfp4_scale_bytes(tokens: u64, hidden: u64, layout: Nvfp4ScaleLayout) -> Result<u64> {
    check_nvfp4_hidden(hidden)?;
    let cols = hidden / NVFP4_BLOCK;
    match layout {
        Nvfp4ScaleLayout::Linear => tokens.checked_mul(cols),
        Nvfp4ScaleLayout::Swizzled128x4 => {
            round_up_u64(tokens, NVFP4_TILE_ROWS)?.checked_mul(round_up_u64(cols, NVFP4_TILE_COLS)?)
        }
    }
    .ok_or(ReferenceError::SizeOverflow("NVFP4 scale bytes"))
}

/// Position (in 4-byte row slots, 0..128) of row `i` (0..128) inside one
/// swizzled 128x4 tile: `(i % 32) * 4 + i / 32`. The 4 scale bytes of the
/// row sit at byte `4 * slot + column % 4` of the tile.
///
/// This is the layout of TensorRT-LLM's / FlashInfer's
/// `get_sf_out_offset_128x4` (tile `[32, 4, 4]` indexed by
/// `[i % 32, i / 32, column % 4]`), which the cuBLASLt / CUTLASS block-scaled
/// GEMMs read. NOTE: domain.md section 1 writes "row i of a tile lands at
/// position (i % 4) * 32 + i / 4"; that expression is the INVERSE
/// permutation (it gives the row stored at slot i). Both agree on rows
/// 0, 33, 66, 99 ... only; the reference follows the consumer's layout.
pub fn nvfp4_swizzle_row_slot(i: u64) -> u64 {
    (i % 32) * 4 + (i % 128) / 32
}

/// Byte offset of the scale of (`row`, scale column `col`) in the NVFP4
/// scale tensor for `tokens` x `hidden`.
///
/// Swizzled: `(row / 128) * (round_up(C, 4) / 4) * 512 + (col / 4) * 512 +
/// 4 * nvfp4_swizzle_row_slot(row % 128) + col % 4`, `C = H / 16`.
/// Linear: `row * C + col`. Errors when `row >= tokens` or `col >= C`.
pub fn nvfp4_scale_offset(
    row: u64,
    col: u64,
    tokens: u64,
    hidden: u64,
    layout: Nvfp4ScaleLayout,
) -> Result<u64> {
    check_nvfp4_hidden(hidden)?;
    let cols = hidden / NVFP4_BLOCK;
    if row >= tokens || col >= cols {
        return Err(ReferenceError::InvalidShape(format!(
            "NVFP4 scale ({row}, {col}) outside [{tokens}, {cols}]"
        )));
    }
    let overflow = ReferenceError::SizeOverflow("NVFP4 scale offset");
    match layout {
        Nvfp4ScaleLayout::Linear => row
            .checked_mul(cols)
            .and_then(|v| v.checked_add(col))
            .ok_or(overflow),
        Nvfp4ScaleLayout::Swizzled128x4 => {
            let col_tiles = round_up_u64(cols, NVFP4_TILE_COLS)? / NVFP4_TILE_COLS;
            let tile = (row / NVFP4_TILE_ROWS)
                .checked_mul(col_tiles)
                .and_then(|v| v.checked_add(col / NVFP4_TILE_COLS))
                .ok_or(overflow.clone())?;
            tile.checked_mul(NVFP4_TILE_BYTES)
                .and_then(|v| v.checked_add(4 * nvfp4_swizzle_row_slot(row % NVFP4_TILE_ROWS)))
                .and_then(|v| v.checked_add(col % NVFP4_TILE_COLS))
                .ok_or(overflow)
        }
    }
}

/// Output of [`nvfp4_quant`].
#[derive(Debug, Clone, PartialEq)]
pub struct Nvfp4Quant {
    /// Packed e2m1 data `[T, H / 2]` u8, element `2k` in the low nibble.
    pub data: Vec<u8>,
    /// e4m3 scale factors, [`nvfp4_scale_bytes`] bytes in the requested layout.
    pub scales: Vec<u8>,
}

/// The scale factor of one NVFP4 block (contract v3): `SF =
/// e4m3_satfinite(global_scale * (amax * f32(1 / 6)))`, two f32 products in that
/// order, as FlashInfer's fused kernel (`cvt_warp_fp16_to_fp4`,
/// [`NVFP4_RECIPROCAL_6`]). Returns the e4m3 code.
pub fn nvfp4_block_scale(block: &[f32], global_scale: f32) -> u8 {
    e4m3_satfinite(global_scale * (amax(block) * NVFP4_RECIPROCAL_6))
}

/// The factor every element of an NVFP4 block is multiplied by before its e2m1
/// rounding (contract v3): `global_scale / f32(SF)`, one f32 division, or 0 when
/// `SF` is zero (FlashInfer's fused kernel's `outputScale`).
pub fn nvfp4_output_scale(sf_code: u8, global_scale: f32) -> f32 {
    let sf = e4m3_to_f32(sf_code);
    if sf == 0.0 {
        0.0
    } else {
        global_scale / sf
    }
}

/// NVFP4 block quant (SM100+; FlashInfer patterns 3/5): blocks of 16
/// consecutive elements of a token; `SF` from [`nvfp4_block_scale`]; each
/// element becomes `e2m1_satfinite(y * nvfp4_output_scale(SF))` (a zero with
/// the sign of `y` when `SF == 0`). `global_scale` multiplies (it is not
/// inverted).
///
/// Input `y`: `[tokens, hidden]` row-major, `hidden % 16 == 0`.
/// Errors: bad shape; `global_scale` not finite or not > 0.
pub fn nvfp4_quant(
    y: &[f32],
    tokens: usize,
    hidden: usize,
    global_scale: f32,
    layout: Nvfp4ScaleLayout,
) -> Result<Nvfp4Quant> {
    check_matrix(y, tokens, hidden, "NVFP4")?;
    check_nvfp4_hidden(hidden as u64)?;
    if !(global_scale.is_finite() && global_scale > 0.0) {
        return Err(ReferenceError::InvalidParameter(format!(
            "NVFP4 global scale must be finite and > 0, got {global_scale}"
        )));
    }
    let scale_bytes = nvfp4_scale_bytes(tokens as u64, hidden as u64, layout)?;
    let scale_bytes = usize::try_from(scale_bytes)
        .map_err(|_| ReferenceError::SizeOverflow("NVFP4 scale bytes"))?;
    let mut scales = vec![0u8; scale_bytes];
    let mut codes = Vec::with_capacity(y.len());
    let cols = hidden / NVFP4_BLOCK_LEN;
    for (t, row) in y.chunks_exact(hidden).enumerate() {
        for (c, block) in row.chunks_exact(NVFP4_BLOCK_LEN).enumerate() {
            let sf_code = nvfp4_block_scale(block, global_scale);
            let os = nvfp4_output_scale(sf_code, global_scale);
            let off = nvfp4_scale_offset(t as u64, c as u64, tokens as u64, hidden as u64, layout)?;
            // off < scale_bytes by construction of the layout.
            scales[off as usize] = sf_code;
            codes.extend(block.iter().map(|&v| e2m1_from_f32(v * os)));
        }
        debug_assert_eq!(cols * NVFP4_BLOCK_LEN, hidden);
    }
    Ok(Nvfp4Quant {
        data: pack_e2m1(&codes)?,
        scales,
    })
}

fn check_nvfp4_hidden(hidden: u64) -> Result<()> {
    if hidden == 0 || hidden % NVFP4_BLOCK != 0 {
        return Err(ReferenceError::InvalidShape(format!(
            "NVFP4 needs a hidden size that is a positive multiple of {NVFP4_BLOCK}, got {hidden}"
        )));
    }
    Ok(())
}

fn round_up_u64(x: u64, m: u64) -> Result<u64> {
    x.div_ceil(m)
        .checked_mul(m)
        .ok_or(ReferenceError::SizeOverflow("round up"))
}

fn round_up_usize(x: usize, m: usize) -> Result<usize> {
    x.div_ceil(m)
        .checked_mul(m)
        .ok_or(ReferenceError::SizeOverflow("round up"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::numerics::fp4::{e2m1_to_f32, unpack_e2m1};
    use crate::numerics::fp8::E4M3_NAN;

    #[test]
    fn nvfp4_worked_sizes() {
        use Nvfp4ScaleLayout::*;
        assert_eq!(nvfp4_data_bytes(1, 16384).unwrap(), 8_192);
        assert_eq!(nvfp4_scale_bytes(1, 16384, Swizzled128x4).unwrap(), 131_072);
        assert_eq!(nvfp4_scale_bytes(1, 14336, Swizzled128x4).unwrap(), 114_688);
        assert_eq!(nvfp4_scale_bytes(1, 14336, Linear).unwrap(), 896);
        assert_eq!(nvfp4_scale_bytes(1, 16384, Linear).unwrap(), 1_024);
        // 129 tokens need a second row tile; H = 48 has 3 scale columns, padded to 4.
        assert_eq!(nvfp4_scale_bytes(129, 48, Swizzled128x4).unwrap(), 256 * 4);
        assert_eq!(nvfp4_scale_bytes(0, 64, Swizzled128x4).unwrap(), 0);
        assert!(nvfp4_scale_bytes(1, 40, Linear).is_err());
        assert!(nvfp4_data_bytes(1, 0).is_err());
        assert_eq!(
            nvfp4_scale_bytes(u64::MAX, 16, Swizzled128x4),
            Err(ReferenceError::SizeOverflow("round up"))
        );
        assert!(nvfp4_data_bytes(u64::MAX, 64).is_err());
    }

    #[test]
    fn swizzle_positions() {
        use Nvfp4ScaleLayout::*;
        // H = 256 -> 16 scale columns -> 4 column tiles per row tile.
        let (t, h) = (300u64, 256u64);
        let off = |r, c| nvfp4_scale_offset(r, c, t, h, Swizzled128x4).unwrap();
        assert_eq!(off(0, 0), 0);
        assert_eq!(off(0, 3), 3);
        assert_eq!(off(1, 0), 16);
        assert_eq!(off(31, 0), 496);
        assert_eq!(off(32, 0), 4);
        assert_eq!(off(33, 1), 16 + 4 + 1);
        assert_eq!(off(127, 2), 31 * 16 + 3 * 4 + 2);
        assert_eq!(off(0, 4), 512);
        assert_eq!(off(5, 13), 3 * 512 + 5 * 16 + 1);
        assert_eq!(off(128, 0), 4 * 512);
        assert_eq!(off(299, 15), 2 * 4 * 512 + 3 * 512 + (43 % 32) * 16 + 4 + 3);
        assert!(nvfp4_scale_offset(300, 0, t, h, Swizzled128x4).is_err());
        assert!(nvfp4_scale_offset(0, 16, t, h, Swizzled128x4).is_err());
        assert_eq!(nvfp4_scale_offset(2, 5, t, h, Linear).unwrap(), 2 * 16 + 5);
    }

    #[test]
    fn swizzle_is_a_bijection_and_domain_formula_is_its_inverse() {
        let mut seen = [false; 128];
        for i in 0..128u64 {
            let slot = nvfp4_swizzle_row_slot(i);
            assert!(!seen[slot as usize]);
            seen[slot as usize] = true;
            // domain.md's expression maps the slot back to the row.
            assert_eq!((slot % 4) * 32 + slot / 4, i);
        }
        // And every (row, col) of a padded matrix lands on a distinct byte.
        let (t, h) = (256u64, 128u64);
        let total = nvfp4_scale_bytes(t, h, Nvfp4ScaleLayout::Swizzled128x4).unwrap();
        let mut hit = vec![false; total as usize];
        for r in 0..t {
            for c in 0..h / 16 {
                let o = nvfp4_scale_offset(r, c, t, h, Nvfp4ScaleLayout::Swizzled128x4).unwrap();
                assert!(!hit[o as usize]);
                hit[o as usize] = true;
            }
        }
        assert!(hit.iter().all(|&b| b));
    }

    #[test]
    fn nvfp4_block_values() {
        // Block 0: amax 6, global scale 1 -> SF = 1.0 (0x38); elements exact e2m1.
        // Block 1: amax 5 -> 5/6 = 0.8333 -> e4m3 0.8125 (0x35); 5/0.8125 = 6.15 saturates to 6;
        //          1/0.8125 = 1.2308 -> 1.0; -2.5/0.8125 = -3.077 -> -3.
        let mut y = vec![0.0f32; 32];
        y[..8].copy_from_slice(&[6.0, -6.0, 0.5, 1.5, 3.0, -0.25, 0.75, 4.0]);
        y[16] = 5.0;
        y[17] = 1.0;
        y[18] = -2.5;
        let q = nvfp4_quant(&y, 1, 32, 1.0, Nvfp4ScaleLayout::Linear).unwrap();
        assert_eq!(q.scales, vec![0x38, 0x35]);
        assert_eq!(e4m3_to_f32(0x35), 0.8125);
        let codes = unpack_e2m1(&q.data);
        let vals: Vec<f32> = codes.iter().map(|&c| e2m1_to_f32(c)).collect();
        assert_eq!(&vals[..8], &[6.0, -6.0, 0.5, 1.5, 3.0, -0.0, 1.0, 4.0]);
        assert_eq!(&vals[16..19], &[6.0, 1.0, -3.0]);
        assert_eq!(q.data.len(), 16);
        assert_eq!(q.data[0], 0xF7); // 6.0 -> 0x7 low, -6.0 -> 0xF high

        // global_scale multiplies: gs = 2 with amax 3 gives SF = 1 and doubles the elements.
        let mut z = vec![0.0f32; 16];
        z[0] = 3.0;
        z[1] = 0.5;
        let q = nvfp4_quant(&z, 1, 16, 2.0, Nvfp4ScaleLayout::Linear).unwrap();
        assert_eq!(q.scales, vec![0x38]);
        assert_eq!(q.data[0], 0x2 << 4 | 0x7); // 6.0, 1.0

        // An all-zero block has SF 0 and zero data (signed zeros kept).
        let mut zz = vec![0.0f32; 16];
        zz[1] = -0.0;
        let q = nvfp4_quant(&zz, 1, 16, 1.0, Nvfp4ScaleLayout::Linear).unwrap();
        assert_eq!(q.scales, vec![0]);
        assert_eq!(q.data[0], 0x80);

        // FlashInfer's order on a tie: SF code 0x1f (0.1171875); y = -0.146484375 is
        // exactly -1.25 * SF, but y * (1 / SF) = -1.2500001 rounds to -1.5 (code 0xB),
        // where y / SF would be the tie -1.25 and round to even, -1.0.
        let mut t = vec![0.0f32; 16];
        t[0] = 0.703_125; // 6 * SF
        t[1] = -75.0 / 512.0; // -0.146484375
        let q = nvfp4_quant(&t, 1, 16, 1.0, Nvfp4ScaleLayout::Linear).unwrap();
        assert_eq!(q.scales, vec![0x1f]);
        assert_eq!(q.data[0], 0xB7);
        assert_eq!(nvfp4_output_scale(0x1f, 1.0), 1.0 / 0.117_187_5);
        assert_eq!(e2m1_from_f32(t[1] / 0.117_187_5), 0xA);
        assert_eq!(NVFP4_RECIPROCAL_6.to_bits(), 0x3E2A_AAAB);
        assert_eq!(nvfp4_output_scale(0, 3.0), 0.0);

        assert!(nvfp4_quant(&y, 1, 32, 0.0, Nvfp4ScaleLayout::Linear).is_err());
        assert!(nvfp4_quant(&y, 1, 32, f32::NAN, Nvfp4ScaleLayout::Linear).is_err());
        assert!(nvfp4_quant(&y, 3, 16, 1.0, Nvfp4ScaleLayout::Linear).is_err());
    }

    #[test]
    fn nvfp4_swizzled_output_places_scales_and_zeroes_padding() {
        // T = 2, H = 32: 2 scale columns padded to 4; 128 rows: 512 bytes.
        let mut y = vec![0.0f32; 64];
        y[0] = 6.0; // row 0 block 0: SF 1.0 = 0x38
        y[16] = 12.0; // row 0 block 1: SF 2.0 = 0x40
        y[32] = 3.0; // row 1 block 0: SF 0.5 = 0x30
        let q = nvfp4_quant(&y, 2, 32, 1.0, Nvfp4ScaleLayout::Swizzled128x4).unwrap();
        assert_eq!(q.scales.len(), 512);
        assert_eq!(q.scales[0], 0x38);
        assert_eq!(q.scales[1], 0x40);
        assert_eq!(q.scales[16], 0x30);
        assert_eq!(q.scales[17], 0x00); // row 1 block 1 is all zero
        let nonzero: Vec<usize> = (0..512).filter(|&i| q.scales[i] != 0).collect();
        assert_eq!(nonzero, vec![0, 1, 16]);
    }

    #[test]
    fn static_fp8_values() {
        let q = static_fp8_quant(&[1.0, 300.0, -300.0, -0.0, f32::NAN], 0.5).unwrap();
        assert_eq!(q, vec![0x40, 0x7E, 0xFE, 0x80, E4M3_NAN]);
        // The reciprocal is rounded before the product (vLLM, FlashInfer): with scale
        // 3.7, y = -0.05419921875 (-111 / 2048, a bf16 value) gives y * f32(1/3.7) just
        // inside the e4m3 midpoint -0.0146484375 between codes 0x87 and 0x88 (so 0x87),
        // where y / 3.7 rounds to the midpoint itself and ties to even (0x88).
        let y = -111.0f32 / 2048.0;
        assert_eq!(static_fp8_quant(&[y], 3.7).unwrap(), vec![0x87]);
        assert_eq!(e4m3_satfinite(y / 3.7), 0x88);
        assert!(static_fp8_quant(&[1.0], 0.0).is_err());
        assert!(static_fp8_quant(&[1.0], f32::INFINITY).is_err());
    }

    #[test]
    fn dynamic_per_token_values() {
        // Row 0: amax 448 -> scale 1. Row 1: zeros -> min scale. Row 2: amax 1 -> scale 1/448.
        let y = vec![448.0, -2.0, 0.0, 0.0, 1.0, 0.5];
        let (q, s) = dynamic_per_token_fp8_quant(&y, 3, 2).unwrap();
        assert_eq!(s, vec![1.0, DYNAMIC_FP8_MIN_SCALE, 1.0 / 448.0]);
        assert_eq!(DYNAMIC_FP8_MIN_SCALE, 1.0 / 229_376.0);
        assert_eq!(q, vec![0x7E, 0xC0, 0x00, 0x00, 0x7E, 0x76]);
        assert_eq!(e4m3_to_f32(0x76), 224.0);
        assert!(dynamic_per_token_fp8_quant(&y, 2, 2).is_err());
        assert!(dynamic_per_token_fp8_quant(&[], 1, 0).is_err());
    }

    #[test]
    fn per_token_group_packed_and_fp32() {
        // T = 2, H = 256, group 128 -> G = 2.
        let mut y = vec![0.0f32; 512];
        y[0] = 448.0; // t0 g0: scale 1 (code 127)
        y[128] = 1.0; // t0 g1: 1/448 -> 2^-8 (code 119); q = 256 = 0x78
        y[129] = -0.5; // -> -128 = 0xF0
        y[256] = 3.0; // t1 g0: 3/448 -> 2^-7 (code 120); q = 384 = 0x7C
                      // t1 g1 all zero: 1e-10 -> 2^-33 (code 94)
        let g = per_token_group_fp8_quant(&y, 2, 256, 128, GroupScaleLayout::PackedUe8m0).unwrap();
        assert_eq!(g.data[0], 0x7E);
        assert_eq!(g.data[128], 0x78);
        assert_eq!(g.data[129], 0xF0);
        assert_eq!(g.data[256], 0x7C);
        match &g.scales {
            GroupScales::PackedUe8m0 {
                words,
                padded_tokens,
                packed_cols,
            } => {
                // One word column: only T = 2 words (vLLM's allocation), no padding rows.
                assert_eq!((*padded_tokens, *packed_cols), (4, 1));
                assert_eq!(words, &vec![127 | 119 << 8, 120 | 94 << 8]);
            }
            other => panic!("unexpected {other:?}"),
        }
        let f =
            per_token_group_fp8_quant(&y, 2, 256, 128, GroupScaleLayout::F32RowMajorUe8m0).unwrap();
        assert_eq!(f.data, g.data);
        assert_eq!(
            f.scales,
            GroupScales::Fp32 {
                values: vec![1.0, 2f32.powi(-8), 2f32.powi(-7), 2f32.powi(-33)],
                groups: 2
            }
        );
        let e = per_token_group_fp8_quant(&y, 2, 256, 128, GroupScaleLayout::F32RowMajor).unwrap();
        // The all-zero group: max(0, 1e-10) / 448 (the floor applies to amax, as vLLM's
        // kernels), not 1e-10.
        let zero_scale = 1e-10f32 / 448.0;
        assert_eq!(zero_scale.to_bits(), 0x2A7B_5123);
        assert_eq!(
            e.scales,
            GroupScales::Fp32 {
                values: vec![1.0, 1.0 / 448.0, 3.0 / 448.0, zero_scale],
                groups: 2
            }
        );
        assert!(per_token_group_fp8_quant(&y, 4, 128, 96, GroupScaleLayout::F32RowMajor).is_err());
    }

    #[test]
    fn packed_group_positions_and_sizes() {
        // T = 5 -> 8 padded rows; G = 5 -> 2 word columns.
        assert_eq!(packed_group_scale_position(4, 4, 5).unwrap(), (8 + 4, 0));
        assert_eq!(packed_group_scale_position(0, 3, 5).unwrap(), (0, 3));
        assert_eq!(packed_group_scale_position(2, 1, 5).unwrap(), (2, 1));
        // vLLM's allocation: T + (C - 1) * round_up(T, 4) words.
        assert_eq!(packed_group_scale_bytes(5, 640, 128).unwrap(), (5 + 8) * 4);
        assert_eq!(
            packed_group_scale_bytes(1, 7168, 128).unwrap(),
            (1 + 13 * 4) * 4
        );
        assert_eq!(packed_group_scale_bytes(8, 7168, 128).unwrap(), 8 * 14 * 4);
        assert_eq!(packed_group_scale_bytes(0, 7168, 128).unwrap(), 0);
        assert_eq!(packed_group_scale_words(7, 1).unwrap(), 7);
        assert_eq!(packed_group_scale_words(7, 3).unwrap(), 7 + 2 * 8);
        assert_eq!(
            group_scale_bytes(5, 640, 128, GroupScaleLayout::F32RowMajorUe8m0).unwrap(),
            5 * 5 * 4
        );
        assert_eq!(
            group_scale_bytes(5, 640, 128, GroupScaleLayout::PackedUe8m0).unwrap(),
            52
        );
        assert!(group_scale_bytes(5, 600, 128, GroupScaleLayout::F32RowMajor).is_err());
        assert!(packed_group_scale_bytes(1, 100, 128).is_err());
        assert!(packed_group_scale_bytes(u64::MAX, 1024, 128).is_err());

        // Padding of a full quant: T = 5, H = 640.
        let y: Vec<f32> = (0..5 * 640).map(|i| (i % 7) as f32 - 3.0).collect();
        let g = per_token_group_fp8_quant(&y, 5, 640, 128, GroupScaleLayout::PackedUe8m0).unwrap();
        let GroupScales::PackedUe8m0 { words, .. } = g.scales else {
            panic!("layout")
        };
        assert_eq!(words.len(), 13);
        // amax 3 -> 3/448 -> 2^-7 = code 120 everywhere.
        let full = u32::from_le_bytes([120; 4]);
        for t in 0..5 {
            assert_eq!(words[t], full, "word col 0 row {t}");
            assert_eq!(
                words[8 + t],
                120,
                "word col 1 row {t}: group 4 only, padding bytes zero"
            );
        }
        // Padding rows exist in the first column only.
        assert_eq!(&words[5..8], &[0, 0, 0]);
    }
}
