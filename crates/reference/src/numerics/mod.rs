//! Number formats of the fused op and their exact conversions.
//!
//! Every value the reference handles is held as an `f32`: each supported
//! storage format (bf16, f16, fp8 e4m3, fp4 e2m1, ue8m0) is a subset of the
//! f32 values, so "a value of format F" means "an f32 that F can represent
//! exactly", and rounding to F is a function `f32 -> f32` (plus an encoder to
//! the storage bits where the bits matter).
//!
//! Modules:
//! - [`fp8`]: OCP FP8 E4M3 ("e4m3fn": no infinities, max finite 448).
//! - [`fp4`]: OCP FP4 E2M1 (max 6.0, no NaN/Inf) and its two-per-byte packing.
//! - [`ue8m0`]: unsigned power-of-two scales (8 exponent bits, bias 127).
//! - [`quant`]: the quant epilogues of domain.md section 1 (static FP8,
//!   dynamic per-token FP8, per-token-group FP8, NVFP4) with their scale
//!   layouts and byte sizes.
//!
//! bf16 and f16 conversions use the `half` crate, whose `from_f32` rounds to
//! nearest, ties to even (the same rounding as CUDA's `__float2bfloat16_rn`).

pub mod fp4;
pub mod fp8;
pub mod quant;
pub mod ue8m0;

use half::{bf16, f16};

/// A floating-point activation format the fused op computes in (the "T" of
/// domain.md section 1), or fp32 itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FloatFormat {
    /// bfloat16: 8 exponent bits, 7 mantissa bits.
    Bf16,
    /// IEEE binary16: 5 exponent bits, 10 mantissa bits.
    F16,
    /// IEEE binary32 (rounding is the identity).
    F32,
}

impl From<arfuse_abi::ActDtype> for FloatFormat {
    /// The rounding format of an activation dtype.
    fn from(d: arfuse_abi::ActDtype) -> FloatFormat {
        match d {
            arfuse_abi::ActDtype::Bf16 => FloatFormat::Bf16,
            arfuse_abi::ActDtype::F16 => FloatFormat::F16,
            arfuse_abi::ActDtype::F32 => FloatFormat::F32,
        }
    }
}

/// `round_T` for f16 (kept out of line: the bf16 path is the hot one).
#[inline(never)]
fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

impl FloatFormat {
    /// Explicit mantissa bits of the format (7, 10, 23).
    pub fn mantissa_bits(self) -> u32 {
        match self {
            FloatFormat::Bf16 => 7,
            FloatFormat::F16 => 10,
            FloatFormat::F32 => 23,
        }
    }

    /// Bytes per element in memory (2, 2, 4): the `e` of domain.md.
    pub fn bytes(self) -> u32 {
        match self {
            FloatFormat::Bf16 | FloatFormat::F16 => 2,
            FloatFormat::F32 => 4,
        }
    }

    /// `round_T(x)`: round an f32 to this format, to nearest, ties to even,
    /// overflow to +-infinity (IEEE semantics, as `__float2bfloat16_rn` and
    /// `__float2half_rn`), NaN stays NaN. The result is returned widened back
    /// to f32, which is exact.
    // Inlined into the evaluator's element loops (it is most of their work).
    #[inline(always)]
    pub fn round(self, x: f32) -> f32 {
        match self {
            FloatFormat::Bf16 => bf16::from_f32(x).to_f32(),
            FloatFormat::F16 => round_f16(x),
            FloatFormat::F32 => x,
        }
    }

    /// Round an f64 to this format, to nearest, ties to even, in ONE rounding
    /// (no double rounding through f32), returned as f32.
    ///
    /// Used for f64 attributes (constants) and integer casts. `half`'s own
    /// `bf16::from_f64` is not used: it drops the low 32 bits of the f64
    /// before its sticky-bit test, so an f64 just above a bf16 tie is rounded
    /// as a tie (to even) instead of up.
    pub fn round_f64(self, v: f64) -> f32 {
        let c = self.round(v as f32);
        if self == FloatFormat::F32 || v.is_nan() || c.is_infinite() || f64::from(c) == v {
            return c;
        }
        // c is one of the two format neighbours of v; find the other one.
        let up = f64::from(c) < v;
        let o = self.step(c, up);
        let (dc, d_o) = ((f64::from(c) - v).abs(), (f64::from(o) - v).abs());
        if dc < d_o || o.is_nan() {
            c
        } else if d_o < dc {
            o
        } else if self.to_bits(c) & 1 == 0 {
            c
        } else {
            o
        }
    }

    /// The next value of this format after `x` (a value of the format) towards
    /// +inf (`up`) or -inf.
    fn step(self, x: f32, up: bool) -> f32 {
        let bits = self.to_bits(x);
        let sign = self.sign_bit();
        let mag = bits & ((1u32 << sign) - 1);
        let neg = bits >> sign & 1 == 1;
        // Moving away from zero increases the magnitude.
        let away = up != neg;
        let new_bits = if mag == 0 && !away {
            // From +-0 towards the other side: the smallest value of the other sign.
            (u32::from(!neg) << sign) | 1
        } else if away {
            bits + 1
        } else {
            bits - 1
        };
        match self {
            FloatFormat::Bf16 => bf16::from_bits(new_bits as u16).to_f32(),
            FloatFormat::F16 => f16::from_bits(new_bits as u16).to_f32(),
            FloatFormat::F32 => f32::from_bits(new_bits),
        }
    }

    /// Storage bits of `round(x)` in this format (16 or 32 significant bits).
    pub fn to_bits(self, x: f32) -> u32 {
        match self {
            FloatFormat::Bf16 => u32::from(bf16::from_f32(x).to_bits()),
            FloatFormat::F16 => u32::from(f16::from_f32(x).to_bits()),
            FloatFormat::F32 => x.to_bits(),
        }
    }

    /// Whether `x` is exactly representable in this format (NaN counts as
    /// representable).
    pub fn is_exact(self, x: f32) -> bool {
        x.is_nan() || self.round(x).to_bits() == x.to_bits()
    }

    /// Distance in units in the last place of this format between `a` and
    /// `b` (both first rounded to the format): the number of representable
    /// values stepped over going from one to the other. `+0.0` and `-0.0` are
    /// 0 apart; two NaNs are 0 apart; a NaN and a number are `u64::MAX` apart;
    /// infinities count as the value after the max finite.
    pub fn ulp_distance(self, a: f32, b: f32) -> u64 {
        match (a.is_nan(), b.is_nan()) {
            (true, true) => return 0,
            (true, false) | (false, true) => return u64::MAX,
            _ => {}
        }
        let ka = ordered_key(self.to_bits(a), self.sign_bit());
        let kb = ordered_key(self.to_bits(b), self.sign_bit());
        ka.abs_diff(kb)
    }

    fn sign_bit(self) -> u32 {
        match self {
            FloatFormat::Bf16 | FloatFormat::F16 => 15,
            FloatFormat::F32 => 31,
        }
    }
}

/// Map sign-magnitude bits to an integer that increases with the value
/// (`-0` and `+0` both map to 0). Used for ulp distances of every format of
/// this crate (they are all sign-magnitude).
pub(crate) fn ordered_key(bits: u32, sign_bit: u32) -> i64 {
    let magnitude = i64::from(bits & ((1u32 << sign_bit) - 1));
    if bits >> sign_bit & 1 == 1 {
        -magnitude
    } else {
        magnitude
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_table() {
        let b = FloatFormat::Bf16;
        // (input, expected after round_T)
        let table: &[(f32, f32)] = &[
            (1.0, 1.0),
            // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even -> 1.
            (1.0 + 1.0 / 256.0, 1.0),
            // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even) -> up.
            (1.0 + 3.0 / 256.0, 1.0 + 1.0 / 64.0),
            // just above halfway rounds up.
            (f32::from_bits(0x3F80_8001), 1.0 + 1.0 / 128.0),
            (-0.0, -0.0),
            // max finite bf16 = (2 - 2^-7) * 2^127
            (f32::from_bits(0x7F7F_0000), f32::from_bits(0x7F7F_0000)),
            // f32::MAX rounds past the max finite bf16 -> +inf.
            (f32::MAX, f32::INFINITY),
            // smallest bf16 subnormal 2^-133
            (f32::from_bits(0x0001_0000), f32::from_bits(0x0001_0000)),
            // half of it is a tie between 0 (even) and 2^-133 -> 0.
            (f32::from_bits(0x0000_8000), 0.0),
            (f32::NEG_INFINITY, f32::NEG_INFINITY),
        ];
        for &(x, want) in table {
            let got = b.round(x);
            assert_eq!(got.to_bits(), want.to_bits(), "bf16 round({x:e})");
        }
        assert!(b.round(f32::NAN).is_nan());
        assert_eq!(b.to_bits(-0.0), 0x8000);
        assert_eq!(b.to_bits(1.0), 0x3F80);
    }

    #[test]
    fn f16_rounding_table() {
        let h = FloatFormat::F16;
        let table: &[(f32, f32)] = &[
            (65504.0, 65504.0),
            // 65520 is the halfway point between 65504 and 65536 (= overflow): ties to even -> inf.
            (65520.0, f32::INFINITY),
            (65519.0, 65504.0),
            // 1 + 2^-11 is halfway between 1 and 1 + 2^-10 -> 1.
            (1.0 + 1.0 / 2048.0, 1.0),
            (1.0 + 3.0 / 2048.0, 1.0 + 2.0 / 1024.0),
            // smallest f16 subnormal 2^-24, and a tie below it.
            (5.960_464_5e-8, 5.960_464_5e-8),
            (2.980_232_2e-8, 0.0),
            (-0.0, -0.0),
        ];
        for &(x, want) in table {
            assert_eq!(h.round(x).to_bits(), want.to_bits(), "f16 round({x:e})");
        }
        assert!(h.round(f32::NAN).is_nan());
    }

    #[test]
    fn f64_rounding_is_a_single_rounding() {
        let b = FloatFormat::Bf16;
        let p = |k: i32| 2f64.powi(k);
        let table: &[(f64, f32)] = &[
            (1.0, 1.0),
            // exact tie 1 + 2^-8 -> even (1.0)
            (1.0 + p(-8), 1.0),
            // just above the tie by 2^-30: half's from_f64 ignores these bits.
            (1.0 + p(-8) + p(-30), 1.0 + 1.0 / 128.0),
            // just above by 2^-40: `as f32` lands on the tie (double rounding).
            (1.0 + p(-8) + p(-40), 1.0 + 1.0 / 128.0),
            (-(1.0 + p(-8) + p(-40)), -(1.0 + 1.0 / 128.0)),
            // just below the tie 1 + 3*2^-8 (whose even neighbour is above).
            (1.0 + 3.0 * p(-8) - p(-40), 1.0 + 1.0 / 128.0),
            (1e-6, 9.983778e-7),
            (0.0, 0.0),
            (1e300, f32::INFINITY),
        ];
        for &(v, want) in table {
            assert_eq!(
                b.round_f64(v).to_bits(),
                want.to_bits(),
                "bf16 round_f64({v:e})"
            );
        }
        assert_eq!(b.round_f64(-0.0).to_bits(), (-0.0f32).to_bits());
        // half's from_f64 gets the first of these wrong (documented reason for round_f64).
        assert_eq!(half::bf16::from_f64(1.0 + p(-8) + p(-30)).to_f32(), 1.0);
        let h = FloatFormat::F16;
        assert_eq!(h.round_f64(1.0 + p(-11) + p(-40)), 1.0 + 1.0 / 1024.0);
        assert_eq!(h.round_f64(1.0 + p(-11)), 1.0);
        assert_eq!(FloatFormat::F32.round_f64(1e-6), 1e-6f32);
        // Across zero: a tiny negative f64 rounds to -0 in bf16.
        assert_eq!(b.round_f64(-1e-50).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn ulp_distance_counts_representable_steps() {
        let b = FloatFormat::Bf16;
        assert_eq!(b.ulp_distance(1.0, 1.0 + 1.0 / 128.0), 1);
        assert_eq!(b.ulp_distance(1.0, 1.0 + 3.0 / 128.0), 3);
        assert_eq!(b.ulp_distance(-0.0, 0.0), 0);
        // smallest positive and smallest negative subnormal are 2 apart (through 0).
        let tiny = f32::from_bits(0x0001_0000);
        assert_eq!(b.ulp_distance(tiny, -tiny), 2);
        assert_eq!(b.ulp_distance(f32::NAN, f32::NAN), 0);
        assert_eq!(b.ulp_distance(f32::NAN, 1.0), u64::MAX);
        assert_eq!(
            FloatFormat::F32.ulp_distance(1.0, f32::from_bits(0x3F80_0002)),
            2
        );
        assert!(b.is_exact(1.0 + 1.0 / 128.0));
        assert!(!b.is_exact(1.0 + 1.0 / 256.0));
    }
}
