//! The activation dtype `T` of a fused call.

use std::fmt;

/// Activation dtype of the all-reduce input (the residual stream's dtype): the one
/// definition for the policy's targets and workspaces, the IR's fused nodes and the
/// runtime's kernel variants (`ARF_DTYPE`).
///
/// TOML and JSON spell it `"bf16"`, `"f16"`, `"f32"` (aliases `bfloat16`, `fp16`,
/// `float16`, `half`, `fp32`, `float32`, `float`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum ActDtype {
    /// bfloat16, 2 bytes per element.
    #[default]
    #[cfg_attr(feature = "serde", serde(alias = "bfloat16"))]
    Bf16,
    /// IEEE half, 2 bytes per element.
    #[cfg_attr(
        feature = "serde",
        serde(alias = "fp16", alias = "float16", alias = "half")
    )]
    F16,
    /// IEEE single, 4 bytes per element.
    #[cfg_attr(
        feature = "serde",
        serde(alias = "fp32", alias = "float32", alias = "float")
    )]
    F32,
}

impl ActDtype {
    /// Every activation dtype, in declaration order (the kernels' `ARF_DTYPE` order).
    pub const ALL: [ActDtype; 3] = [ActDtype::Bf16, ActDtype::F16, ActDtype::F32];

    /// Bytes per element (`e` in domain.md): 2 for bf16/f16, 4 for f32.
    pub const fn element_bytes(self) -> u64 {
        match self {
            ActDtype::Bf16 | ActDtype::F16 => 2,
            ActDtype::F32 => 4,
        }
    }

    /// The TOML / JSON spelling, also used in kernel variant names (`"bf16"`, `"f16"`,
    /// `"f32"`).
    pub const fn name(self) -> &'static str {
        match self {
            ActDtype::Bf16 => "bf16",
            ActDtype::F16 => "f16",
            ActDtype::F32 => "f32",
        }
    }

    /// The kernels' `ARF_DTYPE` value: 0 bf16, 1 f16, 2 f32 (named `ARF_DTYPE_BF16`,
    /// `ARF_DTYPE_F16`, `ARF_DTYPE_F32` by [`crate::kernel_defines`]).
    pub const fn kernel_code(self) -> u32 {
        match self {
            ActDtype::Bf16 => 0,
            ActDtype::F16 => 1,
            ActDtype::F32 => 2,
        }
    }

    /// The name of this dtype's `ARF_DTYPE_*` define.
    pub const fn define_name(self) -> &'static str {
        match self {
            ActDtype::Bf16 => "ARF_DTYPE_BF16",
            ActDtype::F16 => "ARF_DTYPE_F16",
            ActDtype::F32 => "ARF_DTYPE_F32",
        }
    }

    /// The Lamport "empty" bit pattern of one element: -0.0 (`0x8000` for 16-bit
    /// types, `0x8000_0000` for f32).
    pub const fn sentinel_bits(self) -> u32 {
        match self {
            ActDtype::Bf16 | ActDtype::F16 => 0x8000,
            ActDtype::F32 => 0x8000_0000,
        }
    }
}

impl fmt::Display for ActDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
