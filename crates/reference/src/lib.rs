//! arfuse-reference: the CPU oracle of arfuse.
//!
//! - [`numerics`]: exact conversions (bf16/f16 via `half`, fp8 e4m3, fp4
//!   e2m1, ue8m0) and the quant epilogues with their scale layouts and sizes
//!   (domain.md section 1).
//! - [`contract`]: "arfuse rounding contract v1", the one place that states
//!   how the fused all-reduce -> residual add -> RMSNorm (-> quant) op rounds.

// `x % m == 0` is kept over `is_multiple_of` (stable only since Rust 1.87;
// the workspace's rust-version is 1.80).
#![allow(clippy::manual_is_multiple_of)]

pub mod contract;
pub mod equiv;
pub mod error;
pub mod eval;
pub mod numerics;
pub mod tensor;

pub use contract::CONTRACT_NAME;
pub use equiv::{
    check_equivalent, equivalence_token_counts, EquivalenceReport, OutputComparison, TokenReport,
    Tolerance,
};
pub use error::{ReferenceError, Result};
pub use eval::{bind_tokens, evaluate, random_inputs, Bindings, Evaluation, RankInputs};
pub use tensor::{Storage, Tensor, TensorData};
