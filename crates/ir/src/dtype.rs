//! Element types.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The element type of a tensor.
///
/// Spellings in the JSON format and the canonical text are the snake_case names
/// given on each variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DType {
    /// `bf16`: bfloat16, 2 bytes.
    #[serde(rename = "bf16")]
    Bf16,
    /// `f16`: IEEE half, 2 bytes.
    #[serde(rename = "f16")]
    F16,
    /// `f32`: IEEE single, 4 bytes.
    #[serde(rename = "f32")]
    F32,
    /// `fp8_e4m3`: OCP FP8 E4M3 (finite max 448), 1 byte.
    #[serde(rename = "fp8_e4m3")]
    Fp8E4m3,
    /// `fp4_e2m1x2`: two FP4 E2M1 values packed in one byte; one element of this type
    /// is one byte (two values), so an NVFP4 row of H values has H/2 elements.
    #[serde(rename = "fp4_e2m1x2")]
    Fp4E2m1x2,
    /// `u8`: unsigned byte.
    #[serde(rename = "u8")]
    U8,
    /// `i32`: 32-bit signed integer (also the container of packed ue8m0 scales).
    #[serde(rename = "i32")]
    I32,
    /// `i64`: 64-bit signed integer (token ids as PyTorch exports them).
    #[serde(rename = "i64")]
    I64,
    /// `ue8m0`: an unsigned 8-bit exponent, value 2^(e-127); 1 byte.
    #[serde(rename = "ue8m0")]
    Ue8m0,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 9] = [
        DType::Bf16,
        DType::F16,
        DType::F32,
        DType::Fp8E4m3,
        DType::Fp4E2m1x2,
        DType::U8,
        DType::I32,
        DType::I64,
        DType::Ue8m0,
    ];

    /// Bytes per element (per packed pair for [`DType::Fp4E2m1x2`]).
    pub const fn size_bytes(self) -> u64 {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
            DType::Fp8E4m3 | DType::Fp4E2m1x2 | DType::U8 | DType::Ue8m0 => 1,
        }
    }

    /// True for the activation/compute floating types bf16, f16 and f32.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::Bf16 | DType::F16 | DType::F32)
    }

    /// True for the integer types usable as indices (i32, i64).
    pub const fn is_index(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }

    /// The activation dtype a fused kernel runs on (bf16, f16, f32), in the policy's
    /// terms; `None` for every other type.
    pub const fn activation(self) -> Option<arfuse_abi::ActDtype> {
        match self {
            DType::Bf16 => Some(arfuse_abi::ActDtype::Bf16),
            DType::F16 => Some(arfuse_abi::ActDtype::F16),
            DType::F32 => Some(arfuse_abi::ActDtype::F32),
            _ => None,
        }
    }

    /// The IR dtype of an activation dtype (the inverse of [`DType::activation`]).
    pub const fn of_activation(d: arfuse_abi::ActDtype) -> DType {
        match d {
            arfuse_abi::ActDtype::Bf16 => DType::Bf16,
            arfuse_abi::ActDtype::F16 => DType::F16,
            arfuse_abi::ActDtype::F32 => DType::F32,
        }
    }

    /// The name used in JSON and text.
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::Fp8E4m3 => "fp8_e4m3",
            DType::Fp4E2m1x2 => "fp4_e2m1x2",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Ue8m0 => "ue8m0",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
