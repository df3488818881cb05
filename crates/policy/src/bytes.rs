//! Checked `u64` arithmetic for byte and token counts.
//!
//! Every byte computation in the crate goes through these helpers so that an absurd
//! input (H = 2^40, a capture size of 2^63) turns into [`PolicyError::Overflow`] instead
//! of a wrapped value or a panic.

use crate::error::{PolicyError, Result};

/// One mebibyte, 1,048,576 bytes (domain.md notation).
pub const MIB: u64 = 1 << 20;

/// `a * b`, or an overflow error naming `what`.
pub(crate) fn mul(a: u64, b: u64, what: &'static str) -> Result<u64> {
    a.checked_mul(b).ok_or(PolicyError::Overflow { what })
}

/// The product of all `factors`, or an overflow error naming `what`.
pub(crate) fn product(factors: &[u64], what: &'static str) -> Result<u64> {
    factors.iter().try_fold(1u64, |acc, &f| mul(acc, f, what))
}

/// `a + b`, or an overflow error naming `what`.
pub(crate) fn add(a: u64, b: u64, what: &'static str) -> Result<u64> {
    a.checked_add(b).ok_or(PolicyError::Overflow { what })
}

/// `ceil(a / b)`; `b == 0` is reported as an overflow of `what`.
pub(crate) fn ceil_div(a: u64, b: u64, what: &'static str) -> Result<u64> {
    if b == 0 {
        return Err(PolicyError::Overflow { what });
    }
    Ok(a / b + u64::from(a % b != 0))
}

/// `floor(a / b)`; `b == 0` is reported as an overflow of `what`.
pub(crate) fn floor_div(a: u64, b: u64, what: &'static str) -> Result<u64> {
    a.checked_div(b).ok_or(PolicyError::Overflow { what })
}

/// `a` rounded up to a multiple of `m` (`m > 0`).
pub(crate) fn round_up(a: u64, m: u64, what: &'static str) -> Result<u64> {
    mul(ceil_div(a, m, what)?, m, what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helpers_compute_and_report_overflow() {
        assert_eq!(ceil_div(42, 8, "x"), Ok(6));
        assert_eq!(ceil_div(40, 8, "x"), Ok(5));
        assert_eq!(round_up(698_369, 32, "x"), Ok(698_400));
        assert_eq!(product(&[40, 6144, 8, 2], "x"), Ok(3_932_160));
        assert_eq!(
            mul(u64::MAX, 2, "bytes"),
            Err(PolicyError::Overflow { what: "bytes" })
        );
        assert!(ceil_div(1, 0, "x").is_err());
        assert!(floor_div(1, 0, "x").is_err());
        assert!(add(u64::MAX, 1, "x").is_err());
    }
}
