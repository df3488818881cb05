//! The host build's software `cvt` conversions (`kernels/arfuse_host.h`) against
//! arfuse-reference's numerics and `half`, exhaustively where the input space allows:
//! every bf16 / f16 bit pattern, every halfway point between neighbours of each
//! format and the f32 values on either side of it, every f32 exponent's edges, the
//! e4m3 / e2m1 ties, infinities, NaNs, subnormals, and 2^22 random f32 bit patterns.

use arfuse_reference::numerics::{fp4, fp8};
use arfuse_runtime::host::{Compiler, Conversions};
use half::{bf16, f16};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

fn conversions() -> Conversions {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("arfuse-host");
    let c = Compiler::new(dir).expect("a C++ compiler (g++ or CXX)");
    Conversions::load(&c).expect("probe builds and loads")
}

/// f32 values around every representable value of a 16-bit format whose values are
/// `to_f32(bits)`: the value, the halfway point to the next one, and the f32
/// neighbours of both.
fn around_every_value(to_f32: impl Fn(u16) -> f32) -> Vec<f32> {
    let mut v = Vec::with_capacity(65536 * 6);
    for b in 0..=u16::MAX {
        let x = to_f32(b);
        if !x.is_finite() {
            v.push(x);
            continue;
        }
        let next = to_f32(b.wrapping_add(1));
        v.push(x);
        v.push(f32::from_bits(x.to_bits().wrapping_add(1)));
        v.push(f32::from_bits(x.to_bits().wrapping_sub(1)));
        if next.is_finite() && (next > x) == (x >= 0.0) {
            // Exact in f32: both are values of a 16-bit format (8 or 11 significant
            // bits), their mean needs at most one bit more.
            let mid = (f64::from(x) + f64::from(next)) / 2.0;
            let m = mid as f32;
            assert_eq!(f64::from(m), mid);
            v.push(m);
            v.push(f32::from_bits(m.to_bits() + 1));
            v.push(f32::from_bits(m.to_bits() - 1));
        }
    }
    v
}

fn edge_values() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::from_bits(0x8000_0001),
        f32::from_bits(0x007f_ffff),
        65504.0,
        65519.996,
        65520.0,
        -65520.0,
        448.0,
        464.0,
        464.00003,
        -464.00003,
        6.0,
        7.0,
        -7.0,
    ];
    // Every f32 binade boundary and its neighbours, both signs.
    for e in 0u32..255 {
        for m in [0u32, 1, 0x3f_ffff, 0x40_0000, 0x40_0001, 0x7f_ffff] {
            let b = e << 23 | m;
            v.push(f32::from_bits(b));
            v.push(f32::from_bits(b | 0x8000_0000));
        }
    }
    v
}

fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n).map(|_| f32::from_bits(rng.gen())).collect()
}

fn inputs_for_16bit() -> Vec<f32> {
    let mut v = around_every_value(|b| bf16::from_bits(b).to_f32());
    v.extend(around_every_value(|b| f16::from_bits(b).to_f32()));
    v.extend(edge_values());
    v.extend(random_f32(1 << 22, 18));
    v
}

#[test]
fn bf16_rounding_matches_half_and_nan_is_canonical() {
    let c = conversions();
    let mut checked = 0u64;
    for x in inputs_for_16bit() {
        let got = c.f32_to_bf16(x);
        if x.is_nan() {
            assert_eq!(got, 0x7fff, "NaN {:#010x}", x.to_bits());
        } else {
            assert_eq!(
                got,
                bf16::from_f32(x).to_bits(),
                "bf16({x:e} = {:#010x})",
                x.to_bits()
            );
        }
        checked += 1;
    }
    // Ties: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 (even: 1); 1 + 3 * 2^-8 between
    // 1 + 2^-7 (odd) and 1 + 2^-6 (even).
    assert_eq!(c.f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
    assert_eq!(c.f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
    // Overflow to infinity, subnormals kept, sign of zero kept.
    assert_eq!(c.f32_to_bf16(f32::MAX), 0x7f80);
    assert_eq!(c.f32_to_bf16(f32::from_bits(0x0001_0000)), 0x0001);
    assert_eq!(c.f32_to_bf16(-0.0), 0x8000);
    assert_eq!(c.f32_to_bf16(-f32::NAN), 0x7fff);
    println!("bf16: {checked} inputs");
}

#[test]
fn f16_rounding_matches_half_and_the_reference() {
    let c = conversions();
    let fmt = arfuse_reference::numerics::FloatFormat::F16;
    for x in inputs_for_16bit() {
        let got = c.f32_to_f16(x);
        if x.is_nan() {
            assert_eq!(got, 0x7fff, "NaN {:#010x}", x.to_bits());
            continue;
        }
        let want = f16::from_f32(x).to_bits();
        assert_eq!(got, want, "f16({x:e} = {:#010x})", x.to_bits());
        assert_eq!(u32::from(got), fmt.to_bits(x));
    }
    // 65520 = 65504 + half an ulp: a tie, to even = infinity; just below stays finite.
    assert_eq!(c.f32_to_f16(65520.0), 0x7c00);
    assert_eq!(c.f32_to_f16(65519.996), 0x7bff);
    // The smallest subnormal 2^-24, half of it (tie to even: zero), just above half.
    assert_eq!(c.f32_to_f16(2f32.powi(-24)), 0x0001);
    assert_eq!(c.f32_to_f16(2f32.powi(-25)), 0x0000);
    assert_eq!(c.f32_to_f16(-2f32.powi(-25)), 0x8000);
    assert_eq!(
        c.f32_to_f16(f32::from_bits(2f32.powi(-25).to_bits() + 1)),
        0x0001
    );
    // Largest subnormal rounding up into the smallest normal.
    assert_eq!(c.f32_to_f16(2f32.powi(-14) - 2f32.powi(-26)), 0x0400);
}

#[test]
fn f16_widening_is_exact_for_every_pattern() {
    let c = conversions();
    for b in 0..=u16::MAX {
        let got = c.f16_to_f32(b);
        let want = f16::from_bits(b).to_f32();
        if want.is_nan() {
            assert_eq!(got.to_bits(), 0x7fff_ffff, "f16 NaN {b:#06x}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "f16 {b:#06x}");
        }
    }
}

/// f32 values around every e4m3 / e2m1 value: the value, the midpoints to its
/// neighbours and the f32 values next to them.
fn around_small_format(values: &[f32]) -> Vec<f32> {
    let mut sorted: Vec<f32> = values.iter().copied().filter(|v| v.is_finite()).collect();
    sorted.sort_by(f32::total_cmp);
    sorted.dedup_by(|a, b| a == b);
    let mut out = Vec::new();
    for w in sorted.windows(2) {
        let mid = (w[0] + w[1]) / 2.0; // exact: few significant bits
        for x in [w[0], w[1], mid] {
            out.push(x);
            out.push(f32::from_bits(x.to_bits().wrapping_add(1)));
            if x != 0.0 {
                out.push(f32::from_bits(x.to_bits() - 1));
            }
        }
    }
    out
}

#[test]
fn e4m3_satfinite_matches_the_reference_and_packs_lo_first() {
    let c = conversions();
    let codes: Vec<f32> = (0u8..=255).map(fp8::e4m3_to_f32).collect();
    let mut inputs = around_small_format(&codes);
    inputs.extend(inputs_for_16bit());
    for (i, &x) in inputs.iter().enumerate() {
        let want = fp8::e4m3_satfinite(x);
        let other = inputs[(i * 7919 + 1) % inputs.len()];
        let got = c.e4m3x2(x, other);
        assert_eq!(
            got & 0xff,
            u16::from(want),
            "e4m3({x:e} = {:#010x})",
            x.to_bits()
        );
        assert_eq!(
            got >> 8,
            u16::from(fp8::e4m3_satfinite(other)),
            "high byte for {other:e}"
        );
    }
    assert_eq!(c.e4m3x2(f32::NAN, -f32::NAN), 0x7f7f);
    assert_eq!(c.e4m3x2(f32::INFINITY, f32::NEG_INFINITY), 0xfe7e);
    assert_eq!(c.e4m3x2(464.0, -0.0), 0x807e);
    assert_eq!(c.e4m3x2(-fp8::E4M3_MIN_SUBNORMAL / 2.0, 1.0), 0x3880);
    // The kernels' decoder of block scales is exact on every finite code.
    for b in 0u8..=255 {
        let v = fp8::e4m3_to_f32(b);
        if v.is_finite() {
            assert_eq!(c.e4m3_to_f32(b).to_bits(), v.to_bits(), "decode {b:#04x}");
        }
    }
}

#[test]
fn e2m1_satfinite_matches_the_reference_and_packs_lo_first() {
    let c = conversions();
    let codes: Vec<f32> = (0u8..16).map(fp4::e2m1_to_f32).collect();
    let mut inputs = around_small_format(&codes);
    inputs.extend(inputs_for_16bit());
    for (i, &x) in inputs.iter().enumerate() {
        let want = fp4::e2m1_from_f32(x);
        let other = inputs[(i * 104_729 + 3) % inputs.len()];
        let got = c.e2m1x2(x, other);
        assert_eq!(got & 0xf, want, "e2m1({x:e} = {:#010x})", x.to_bits());
        assert_eq!(
            got >> 4,
            fp4::e2m1_from_f32(other),
            "high nibble for {other:e}"
        );
    }
    // Ties to even, saturation, signed zero, NaN -> +6 (the contract's choice).
    assert_eq!(c.e2m1x2(5.0, 0.25), 0x06);
    assert_eq!(c.e2m1x2(-100.0, f32::INFINITY), 0x7f);
    assert_eq!(c.e2m1x2(-0.0, f32::NAN), 0x78);
}
