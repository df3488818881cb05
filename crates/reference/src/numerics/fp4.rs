//! OCP FP4 E2M1: 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit.
//! The 8 magnitudes are 0, 0.5 (the only subnormal), 1, 1.5, 2, 3, 4, 6
//! (codes 0..=7); codes 8..=15 are their negatives. No infinity, no NaN.
//!
//! Encoding rounds to nearest, ties to even, and saturates to +-6.0, as PTX
//! `cvt.rn.satfinite.e2m1x2.f32` (domain.md section 1: "e2m1 (satfinite,
//! round to nearest)").
//!
//! Choices stated here (arfuse rounding contract v3):
//! - the sign of zero is kept (`-0.0 -> 0x8`);
//! - +-infinity saturates to +-6.0;
//! - NaN, which E2M1 cannot represent, encodes to `0x7` (+6.0). This is the
//!   reference's choice; a kernel must make NaN impossible upstream or state
//!   what its conversion does.
//!
//! Packing ([`pack_e2m1`]): two codes per byte, the FIRST element (even index)
//! in the LOW nibble (bits 0..=3), the second in the high nibble. This is the
//! byte order NVFP4 GEMMs consume (data `[T, H/2]` u8 of domain.md).

use super::fp8::{floor_log2, pow2};
use crate::error::{ReferenceError, Result};

/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// Encode an f32 to a 4-bit E2M1 code (returned in the low nibble):
/// round to nearest, ties to even, saturate to +-6.
///
/// With `e = max(floor(log2 |x|), 0)` the quantum is `2^(e-1)`,
/// `n = rne(|x| / 2^(e-1))` and the code is `(e + 1) * 2 + n - 2`, clamped
/// to 7.
pub fn e2m1_from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7;
    }
    let sign: u8 = if x.is_sign_negative() { 0x8 } else { 0 };
    let a = x.abs();
    if a >= 8.0 {
        // Includes infinity; 8 is beyond the saturation point (7).
        return sign | 0x7;
    }
    let e = floor_log2(a).max(0);
    let n = (a * pow2(1 - e)).round_ties_even();
    let code = (e + 1) * 2 + n as i32 - 2;
    sign | code.min(7) as u8
}

/// Decode a 4-bit E2M1 code (low nibble of `code`; the high nibble is
/// ignored) to f32.
pub fn e2m1_to_f32(code: u8) -> f32 {
    const MAGNITUDES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let m = MAGNITUDES[usize::from(code & 0x7)];
    if code & 0x8 != 0 {
        -m
    } else {
        m
    }
}

/// Round an f32 to the nearest E2M1 value (satfinite), returned as f32.
pub fn round_e2m1(x: f32) -> f32 {
    e2m1_to_f32(e2m1_from_f32(x))
}

/// Pack E2M1 codes two per byte: element `2k` in the low nibble of byte `k`,
/// element `2k + 1` in its high nibble. Errors on an odd count.
pub fn pack_e2m1(codes: &[u8]) -> Result<Vec<u8>> {
    if codes.len() % 2 != 0 {
        return Err(ReferenceError::InvalidShape(format!(
            "e2m1 packing needs an even element count, got {}",
            codes.len()
        )));
    }
    Ok(codes
        .chunks_exact(2)
        .map(|p| (p[0] & 0xF) | ((p[1] & 0xF) << 4))
        .collect())
}

/// Unpack bytes produced by [`pack_e2m1`] into codes (2 per byte, low nibble first).
pub fn unpack_e2m1(bytes: &[u8]) -> Vec<u8> {
    bytes.iter().flat_map(|&b| [b & 0xF, b >> 4]).collect()
}

/// Distance in E2M1 codes between two codes (sign-magnitude order;
/// `0x0` and `0x8` are 0 apart).
pub fn e2m1_code_distance(a: u8, b: u8) -> u64 {
    super::ordered_key(u32::from(a & 0xF), 3).abs_diff(super::ordered_key(u32::from(b & 0xF), 3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_table() {
        let table: &[(f32, u8)] = &[
            (0.0, 0x0),
            (-0.0, 0x8),
            (0.5, 0x1),
            (1.0, 0x2),
            (1.5, 0x3),
            (2.0, 0x4),
            (3.0, 0x5),
            (4.0, 0x6),
            (6.0, 0x7),
            (-6.0, 0xF),
            (-0.5, 0x9),
            // Ties, to even code:
            (0.25, 0x0),  // 0 (even) vs 0.5
            (-0.25, 0x8), // keeps the sign
            (0.75, 0x2),  // 0.5 (odd) vs 1.0 (even)
            (1.25, 0x2),  // 1.0 (even) vs 1.5
            (1.75, 0x4),  // 1.5 (odd) vs 2.0 (even)
            (2.5, 0x4),   // 2.0 (even) vs 3.0
            (3.5, 0x6),   // 3.0 (odd) vs 4.0 (even)
            (5.0, 0x6),   // 4.0 (even) vs 6.0
            (-5.0, 0xE),
            // Just off the ties:
            (0.2500001, 0x1),
            (5.0000005, 0x7),
            (2.4999998, 0x4),
            // Saturation:
            (6.5, 0x7),
            (7.0, 0x7),
            (100.0, 0x7),
            (-100.0, 0xF),
            (f32::INFINITY, 0x7),
            (f32::NEG_INFINITY, 0xF),
            // Tiny (f32 subnormal) rounds to signed zero.
            (f32::from_bits(1), 0x0),
            (-f32::from_bits(1), 0x8),
            // NaN: the reference's choice, +6.
            (f32::NAN, 0x7),
        ];
        for &(x, want) in table {
            assert_eq!(e2m1_from_f32(x), want, "e2m1({x:e})");
        }
    }

    #[test]
    fn every_code_round_trips() {
        for c in 0u8..16 {
            assert_eq!(e2m1_from_f32(e2m1_to_f32(c)), c, "code {c:#x}");
        }
        assert_eq!(e2m1_to_f32(0x8).to_bits(), (-0.0f32).to_bits());
        assert_eq!(e2m1_to_f32(0xF), -6.0);
    }

    #[test]
    fn packing_low_nibble_first() {
        // elements [1.0, -6.0, 0.5, 3.0] -> codes [2, F, 1, 5] -> bytes [0xF2, 0x51]
        let codes: Vec<u8> = [1.0f32, -6.0, 0.5, 3.0]
            .iter()
            .map(|&x| e2m1_from_f32(x))
            .collect();
        let packed = pack_e2m1(&codes).unwrap();
        assert_eq!(packed, vec![0xF2, 0x51]);
        assert_eq!(unpack_e2m1(&packed), codes);
        assert!(pack_e2m1(&[1, 2, 3]).is_err());
    }

    #[test]
    fn code_distance() {
        assert_eq!(e2m1_code_distance(0x6, 0x7), 1);
        assert_eq!(e2m1_code_distance(0x1, 0x9), 2);
        assert_eq!(e2m1_code_distance(0x0, 0x8), 0);
        assert_eq!(e2m1_code_distance(0x7, 0xF), 14);
    }
}
