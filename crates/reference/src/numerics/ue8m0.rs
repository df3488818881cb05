//! UE8M0: an unsigned 8-bit exponent, value `2^(code - 127)`; code 255 is
//! NaN. Used for power-of-two quantisation scales (DeepGEMM's per-token-group
//! FP8 scales, domain.md section 1), four codes packed per int32.
//!
//! Rounding is UP to the next power of two (DeepGEMM's `ceil_to_ue8m0`:
//! `2^ceil(log2(x))`), so that `x / scale <= 448` still holds after the
//! scale is rounded.
//!
//! Choices stated here (arfuse rounding contract v3):
//! - NaN -> 255;
//! - `x <= 2^-127` (including 0, negatives and -0.0) -> code 0 (2^-127, the
//!   smallest scale); callers clamp scales away from zero first;
//! - `x > 2^127` (including +inf) saturates to code 254 (2^127).

use super::fp8::{floor_log2, pow2};

/// The NaN code.
pub const UE8M0_NAN: u8 = 255;

/// Smallest power of two `>= x`, as a UE8M0 code (see the module doc for
/// the edge cases).
pub fn ue8m0_round_up(x: f32) -> u8 {
    if x.is_nan() {
        return UE8M0_NAN;
    }
    if x <= pow2(-127) {
        return 0;
    }
    if x > pow2(127) {
        return 254;
    }
    let e = floor_log2(x);
    let exact = pow2(e) == x;
    let k = if exact { e } else { e + 1 };
    // k in -126..=127 here.
    (k + 127) as u8
}

/// Value of a UE8M0 code: `2^(code - 127)` (exact in f32; code 0 is the f32
/// subnormal 2^-127), NaN for 255.
pub fn ue8m0_to_f32(code: u8) -> f32 {
    if code == UE8M0_NAN {
        return f32::NAN;
    }
    pow2(i32::from(code) - 127)
}

/// Round `x` up to a power of two and return the power as f32.
pub fn round_up_pow2(x: f32) -> f32 {
    ue8m0_to_f32(ue8m0_round_up(x))
}

/// Pack four UE8M0 codes into one little-endian int32 word: code `k` of the
/// group of four goes to bits `8k..8k+8` (DeepGEMM's packing).
pub fn pack_ue8m0x4(codes: [u8; 4]) -> u32 {
    u32::from_le_bytes(codes)
}

/// Inverse of [`pack_ue8m0x4`].
pub fn unpack_ue8m0x4(word: u32) -> [u8; 4] {
    word.to_le_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_up_table() {
        let table: &[(f32, u8)] = &[
            (1.0, 127),
            (1.0000001, 128), // just above a power of two -> next one
            (0.75, 127),      // -> 1.0
            (0.5, 126),
            (2.0, 128),
            (3.0, 129),         // -> 4
            (448.0, 136),       // -> 512
            (1.0 / 448.0, 119), // 0.00223 -> 2^-8 = 0.0039
            (1e-10, 94),        // 2^-33.2 -> 2^-33
            (f32::MAX, 254),
            (f32::INFINITY, 254),
            (0.0, 0),
            (-0.0, 0),
            (-1.0, 0),
            (f32::from_bits(0x0040_0000), 0), // exactly 2^-127
            (f32::from_bits(0x0040_0001), 1), // just above -> 2^-126
            (f32::from_bits(1), 0),           // 2^-149
        ];
        for &(x, want) in table {
            assert_eq!(ue8m0_round_up(x), want, "ue8m0_round_up({x:e})");
        }
        assert_eq!(ue8m0_round_up(f32::NAN), 255);
    }

    #[test]
    fn decode_table() {
        assert_eq!(ue8m0_to_f32(127), 1.0);
        assert_eq!(ue8m0_to_f32(128), 2.0);
        assert_eq!(ue8m0_to_f32(94), 2f32.powi(-33));
        assert_eq!(ue8m0_to_f32(0).to_bits(), 0x0040_0000);
        assert_eq!(ue8m0_to_f32(254), 2f32.powi(127));
        assert!(ue8m0_to_f32(255).is_nan());
        for c in 0u8..255 {
            assert_eq!(ue8m0_round_up(ue8m0_to_f32(c)), c);
        }
    }

    #[test]
    fn packing_is_little_endian() {
        assert_eq!(pack_ue8m0x4([0x7F, 0x80, 0x01, 0x00]), 0x0001_807F);
        assert_eq!(unpack_ue8m0x4(0x0001_807F), [0x7F, 0x80, 0x01, 0x00]);
    }
}
