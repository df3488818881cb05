//! Byte sizes of the quant output tensors, with checked arithmetic (`u64`), never
//! wrapped. The workspace layout is the policy's ([`arfuse_policy::ArfuseLayout`]):
//! the runtime allocates exactly what the plan proved.

use crate::error::{Error, Result};

fn round_up(x: u64, a: u64) -> Result<u64> {
    x.checked_add(a - 1)
        .map(|y| y / a * a)
        .ok_or(Error::Overflow("round_up"))
}

fn mul(a: u64, b: u64, what: &'static str) -> Result<u64> {
    a.checked_mul(b).ok_or(Error::Overflow(what))
}

/// NVFP4 scale bytes in the swizzled 128x4 layout:
/// `round_up(T, 128) * round_up(H / 16, 4)`.
pub fn nvfp4_swizzled_scale_bytes(tokens: u64, hidden: u64) -> Result<u64> {
    mul(
        round_up(tokens, 128)?,
        round_up(hidden / 16, 4)?,
        "nvfp4 scales",
    )
}

/// Byte offset of the NVFP4 scale of (row `t`, block column `c`) in the swizzled
/// layout; same formula as `arf_nvfp4_sf_offset` in the kernels (cuBLAS / FlashInfer
/// 128x4 convention: inside a 512-byte tile row i sits at (i % 32) * 16 + (i / 32) * 4).
pub fn nvfp4_swizzled_offset(t: u64, c: u64, sf_cols: u64) -> u64 {
    let ktiles = sf_cols.div_ceil(4);
    ((t / 128) * ktiles + c / 4) * 512 + (t % 32) * 16 + ((t % 128) / 32) * 4 + c % 4
}

/// Packed ue8m0 group-scale bytes: `ceil((H / 128) / 4) * round_up(T, 4) * 4`.
pub fn fp8_group_packed_scale_bytes(tokens: u64, hidden: u64) -> Result<u64> {
    mul(
        mul(
            (hidden / 128).div_ceil(4),
            round_up(tokens, 4)?,
            "group scales",
        )?,
        4,
        "group scales",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quant_scale_sizes_match_domain_examples() {
        assert_eq!(nvfp4_swizzled_scale_bytes(1, 16384).unwrap(), 131_072);
        assert_eq!(nvfp4_swizzled_scale_bytes(1, 14336).unwrap(), 114_688);
        assert_eq!(fp8_group_packed_scale_bytes(7, 7168).unwrap(), 14 * 8 * 4);
        // Swizzle: row 33 of tile 0, column 2 -> 1 * 16 + 1 * 4 + 2.
        assert_eq!(nvfp4_swizzled_offset(33, 2, 8), 22);
        assert_eq!(nvfp4_swizzled_offset(128, 5, 8), (2 + 1) * 512 + 1);
    }
}
