//! arfuse-reference: the CPU oracle of arfuse.
//!
//! Evaluates any IR graph ([`arfuse_ir::Graph`]) across W simulated ranks on
//! the CPU, bit for bit as the kernels must compute it, and checks that a
//! lowering preserves meaning.
//!
//! - [`numerics`]: exact conversions (bf16/f16 via `half`, fp8 e4m3, fp4
//!   e2m1, ue8m0) and the quant epilogues with their scale layouts and byte
//!   sizes (domain.md section 1).
//! - [`contract`]: "arfuse rounding contract v3", the one place that states
//!   how the fused all-reduce -> residual add -> RMSNorm (-> quant) op rounds.
//! - [`tensor`]: concrete tensors (values as f32 or i64, logical shape,
//!   physical scale layouts).
//! - [`eval`]: the evaluator over W virtual ranks, symbol binding and seeded
//!   random inputs.
//! - [`equiv`]: [`check_equivalent`] (whole graphs, small ones) and the token counts
//!   to run it on.
//! - [`sites`]: [`check_sites`], the same proof for a real model, site by site at
//!   its real hidden size.
//!
//! ```
//! use arfuse_ir::Graph;
//! use arfuse_reference::{bind_tokens, evaluate, random_inputs};
//! let g = Graph::from_json_str(r#"{
//!   "format": "arfuse-graph", "version": 1,
//!   "symbols": {"T": {"min": 1, "max": 64}},
//!   "nodes": [
//!     {"id": "x", "op": "input", "outputs": [{"dtype": "bf16", "shape": ["T", 256]}]},
//!     {"id": "ar", "op": "all_reduce", "attrs": {"group": "tp"}, "inputs": ["x"],
//!      "outputs": [{"dtype": "bf16", "shape": ["T", 256]}]}
//!   ],
//!   "outputs": ["ar"]
//! }"#).unwrap();
//! let b = bind_tokens(&g, 3).unwrap();
//! let inputs = random_inputs(&g, 4, &b, 42).unwrap();
//! let out = evaluate(&g, 4, &b, &inputs).unwrap();
//! assert_eq!(out.outputs[0].len(), 4); // one tensor per rank
//! assert_eq!(out.outputs[0][0], out.outputs[0][3]); // identical after the all-reduce
//! ```

// `x % m == 0` is kept over `is_multiple_of` (stable only since Rust 1.87;
// the workspace's rust-version is 1.80).
#![allow(clippy::manual_is_multiple_of)]

pub mod contract;
pub mod equiv;
pub mod error;
pub mod eval;
pub mod numerics;
pub mod sites;
pub mod tensor;

pub use contract::CONTRACT_NAME;
pub use equiv::{
    check_equivalent, equivalence_token_counts, EquivalenceReport, OutputComparison, TokenReport,
};
pub use error::{ReferenceError, Result};
pub use eval::{bind_tokens, evaluate, random_inputs, Bindings, Evaluation, RankInputs};
pub use sites::{
    check_sites, check_wiring, cut_site, site_token_counts, SiteCheck, SiteCut, SiteGroup,
    SiteTokens, SitesReport, SITE_ELEMENT_BUDGET,
};
pub use tensor::{Storage, Tensor, TensorData};
