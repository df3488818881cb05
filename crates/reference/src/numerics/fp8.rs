//! OCP FP8 E4M3 ("e4m3fn"): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa
//! bits; no infinities; NaN is `S.1111.111` (0x7F / 0xFF); max finite
//! `0x7E` = 1.75 * 2^8 = 448; min normal 2^-6; subnormals are
//! `m * 2^-9`, m = 1..7 (min subnormal 2^-9 = 0.001953125).
//!
//! Encoding rounds to nearest, ties to even, as CUDA's
//! `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)` and PTX
//! `cvt.rn.satfinite.e4m3x2.f32` (domain.md section 1: "saturate to +-448").
//!
//! Choices stated here (arfuse rounding contract v3, see [`crate::contract`]):
//! - the sign of zero is kept (`-0.0 -> 0x80`, and a negative value that
//!   rounds to zero gives 0x80);
//! - NaN input encodes to the canonical NaN `0x7F` whatever its sign (what
//!   the PTX conversion produces);
//! - [`Saturation::SatFinite`]: finite values beyond the range and +-infinity
//!   clamp to +-448; [`Saturation::NonSaturating`]: they become NaN (0x7F),
//!   since E4M3 has no infinity.

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Smallest positive normal E4M3 value (2^-6).
pub const E4M3_MIN_NORMAL: f32 = 0.015625;
/// Smallest positive subnormal E4M3 value (2^-9).
pub const E4M3_MIN_SUBNORMAL: f32 = 0.001953125;
/// The canonical NaN code produced by the encoder.
pub const E4M3_NAN: u8 = 0x7F;

/// What the encoder does with values beyond +-448 (and infinities).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Saturation {
    /// Clamp to +-448 (`__NV_SATFINITE`). Every quant epilogue of arfuse uses this.
    SatFinite,
    /// Overflow to NaN (`__NV_NOSAT`; E4M3 has no infinity).
    NonSaturating,
}

/// Encode an f32 to E4M3 bits: round to nearest, ties to even.
///
/// Works on the exact value: with `e = max(floor(log2 |x|), -6)` the E4M3
/// quantum is `2^(e-3)`, `n = rne(|x| / 2^(e-3))` is an integer in 0..=16,
/// and the code is `(e + 7) * 8 + n - 8` (which also covers the subnormals,
/// `e = -6`, and a mantissa that rounds up into the next binade).
pub fn e4m3_from_f32(x: f32, saturation: Saturation) -> u8 {
    if x.is_nan() {
        return E4M3_NAN;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a.is_infinite() {
        return match saturation {
            Saturation::SatFinite => sign | 0x7E,
            Saturation::NonSaturating => E4M3_NAN,
        };
    }
    if a >= 512.0 {
        // Far out of range (also keeps the arithmetic below small).
        return match saturation {
            Saturation::SatFinite => sign | 0x7E,
            Saturation::NonSaturating => E4M3_NAN,
        };
    }
    let e = floor_log2(a).max(-6);
    // a / 2^(e-3) is exact: a scaling by a power of two that stays within
    // the normal f32 range (a < 512, e - 3 >= -9).
    let n = (a * pow2(3 - e)).round_ties_even();
    // n <= 16; code <= (8 + 7) * 8 + 8 = 128 for a < 512.
    let code = (e + 7) * 8 + n as i32 - 8;
    if code > 0x7E {
        return match saturation {
            Saturation::SatFinite => sign | 0x7E,
            Saturation::NonSaturating => E4M3_NAN,
        };
    }
    sign | code as u8
}

/// Encode with saturation: `e4m3_satfinite(x)` of domain.md section 1.
pub fn e4m3_satfinite(x: f32) -> u8 {
    e4m3_from_f32(x, Saturation::SatFinite)
}

/// Decode E4M3 bits to f32 (exact). `0x7F` and `0xFF` decode to NaN.
pub fn e4m3_to_f32(bits: u8) -> f32 {
    let sign = if bits & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = i32::from((bits >> 3) & 0x0F);
    let man = f32::from(bits & 0x07);
    if exp == 0x0F && bits & 0x07 == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        man * pow2(-9)
    } else {
        (8.0 + man) * pow2(exp - 7 - 3)
    };
    sign * magnitude
}

/// Round an f32 to the nearest E4M3 value (satfinite), returned as f32.
pub fn round_e4m3(x: f32) -> f32 {
    e4m3_to_f32(e4m3_satfinite(x))
}

/// Distance in E4M3 codes between two encoded values (sign-magnitude order;
/// `0x00` and `0x80` are 0 apart; NaN vs NaN 0, NaN vs number `u64::MAX`).
pub fn e4m3_code_distance(a: u8, b: u8) -> u64 {
    let nan = |c: u8| c & 0x7F == 0x7F;
    match (nan(a), nan(b)) {
        (true, true) => 0,
        (true, false) | (false, true) => u64::MAX,
        _ => super::ordered_key(u32::from(a), 7).abs_diff(super::ordered_key(u32::from(b), 7)),
    }
}

/// `floor(log2(a))` of a positive finite f32 (subnormals give values
/// below -126, which callers clamp).
pub(crate) fn floor_log2(a: f32) -> i32 {
    let bits = a.to_bits();
    let biased = ((bits >> 23) & 0xFF) as i32;
    if biased == 0 {
        // Subnormal: value = mantissa * 2^-149.
        let m = bits & 0x7F_FFFF;
        if m == 0 {
            return i32::MIN / 2;
        }
        return 31 - m.leading_zeros() as i32 - 149;
    }
    biased - 127
}

/// Exact 2^k for k in -149..=127 as f32 (0 below, +inf above).
pub(crate) fn pow2(k: i32) -> f32 {
    if k > 127 {
        f32::INFINITY
    } else if k >= -126 {
        f32::from_bits(((k + 127) as u32) << 23)
    } else if k >= -149 {
        f32::from_bits(1u32 << (k + 149))
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_table() {
        let sat = Saturation::SatFinite;
        // (input, expected code)
        let table: &[(f32, u8)] = &[
            (0.0, 0x00),
            (-0.0, 0x80),
            (1.0, 0x38),
            (-1.0, 0xB8),
            (448.0, 0x7E),
            (-448.0, 0xFE),
            (E4M3_MIN_NORMAL, 0x08),
            (E4M3_MIN_SUBNORMAL, 0x01),
            (7.0 * E4M3_MIN_SUBNORMAL, 0x07), // largest subnormal
            // halfway between 0 and the min subnormal: ties to even -> 0 (keeps sign).
            (E4M3_MIN_SUBNORMAL / 2.0, 0x00),
            (-E4M3_MIN_SUBNORMAL / 2.0, 0x80),
            // just above half of the min subnormal rounds up.
            (E4M3_MIN_SUBNORMAL * 0.5000001, 0x01),
            // 1.5 * min subnormal: tie between 0x01 (odd) and 0x02 (even) -> 0x02.
            (1.5 * E4M3_MIN_SUBNORMAL, 0x02),
            // 7.5 * 2^-9: tie between largest subnormal 0x07 and min normal 0x08 -> 0x08.
            (7.5 * E4M3_MIN_SUBNORMAL, 0x08),
            // 1 + 1/16: tie between 1.0 (0x38, even) and 1.125 (0x39) -> 1.0.
            (1.0625, 0x38),
            // 1.1875: tie between 1.125 (0x39, odd) and 1.25 (0x3A) -> 1.25.
            (1.1875, 0x3A),
            // 1.96875 = 1.875 + 1/16: tie between 1.875 (0x3F, odd) and 2.0 (0x40) -> 2.0 (binade carry).
            (1.96875, 0x40),
            // 416 = 1.625 * 2^8 is exact.
            (416.0, 0x7D),
            // 432: tie between 416 (0x7D, odd) and 448 (0x7E) -> 448.
            (432.0, 0x7E),
            // 464: tie between 448 (0x7E, even) and 480 (not representable) -> 448.
            (464.0, 0x7E),
            // beyond: saturate.
            (465.0, 0x7E),
            (1.0e6, 0x7E),
            (-1.0e6, 0xFE),
            (f32::INFINITY, 0x7E),
            (f32::NEG_INFINITY, 0xFE),
            // f32 subnormal input: rounds to (signed) zero.
            (f32::from_bits(1), 0x00),
            (-f32::from_bits(1), 0x80),
            (f32::NAN, 0x7F),
            (-f32::NAN, 0x7F),
        ];
        for &(x, want) in table {
            assert_eq!(e4m3_from_f32(x, sat), want, "e4m3({x:e})");
        }
    }

    #[test]
    fn non_saturating_overflow_is_nan() {
        let ns = Saturation::NonSaturating;
        assert_eq!(e4m3_from_f32(464.0, ns), 0x7E); // still rounds down to 448
        assert_eq!(e4m3_from_f32(464.1, ns), E4M3_NAN);
        assert_eq!(e4m3_from_f32(-1.0e6, ns), E4M3_NAN);
        assert_eq!(e4m3_from_f32(f32::INFINITY, ns), E4M3_NAN);
        assert_eq!(e4m3_from_f32(448.0, ns), 0x7E);
    }

    #[test]
    fn decode_table() {
        let table: &[(u8, f32)] = &[
            (0x00, 0.0),
            (0x01, 0.001953125),
            (0x07, 0.013671875),
            (0x08, 0.015625),
            (0x38, 1.0),
            (0x3F, 1.875),
            (0x7E, 448.0),
            (0xFE, -448.0),
            (0xB8, -1.0),
        ];
        for &(c, want) in table {
            assert_eq!(e4m3_to_f32(c).to_bits(), want.to_bits(), "decode {c:#04x}");
        }
        assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
        assert!(e4m3_to_f32(0x7F).is_nan());
        assert!(e4m3_to_f32(0xFF).is_nan());
    }

    #[test]
    fn every_code_round_trips() {
        for c in 0u8..=255 {
            let v = e4m3_to_f32(c);
            if v.is_nan() {
                continue;
            }
            assert_eq!(e4m3_satfinite(v), c, "code {c:#04x} value {v}");
        }
    }

    #[test]
    fn encoder_picks_nearest_on_a_dense_sweep() {
        // Against a brute-force nearest-even search over all finite codes.
        let finite: Vec<(u8, f32)> = (0u8..=0x7E).map(|c| (c, e4m3_to_f32(c))).collect();
        let mut x = 0.0f32;
        while x < 470.0 {
            let mut best = (0u8, f32::INFINITY);
            for &(c, v) in &finite {
                let d = (v - x).abs();
                if d < best.1 || (d == best.1 && c % 2 == 0) {
                    best = (c, d);
                }
            }
            assert_eq!(e4m3_satfinite(x), best.0, "x = {x}");
            x += 0.000_976_562_5 * (1.0 + x / 8.0).floor();
        }
    }

    #[test]
    fn code_distance() {
        assert_eq!(e4m3_code_distance(0x38, 0x39), 1);
        assert_eq!(e4m3_code_distance(0x01, 0x81), 2);
        assert_eq!(e4m3_code_distance(0x00, 0x80), 0);
        assert_eq!(e4m3_code_distance(0x7F, 0xFF), 0);
        assert_eq!(e4m3_code_distance(0x7F, 0x00), u64::MAX);
    }
}
