//! The arfuse tensor-graph IR: dtypes, symbolic shapes, ops, the graph, its JSON
//! format (version 1), validation, a canonical text form and DOT export.
//!
//! A [`Graph`] holds [`Node`]s in topological order; each node has a stable string id,
//! an [`Op`], inputs naming a producer's output ([`Value`]) and typed outputs
//! ([`TensorType`]). Graph compilers build one with [`Graph::add_node`] or load one
//! with [`Graph::from_json_str`]; [`Graph::validate`] type-checks it and reports every
//! problem with its node id.
//!
//! This crate knows nothing of e-graphs or CUDA; of arfuse it knows the kernel ABI
//! (`arfuse-abi`) and the policy's workspace a plan carries (ARCHITECTURE.md).
//!
//! ```
//! use arfuse_ir::Graph;
//! let text = r#"{
//!   "format": "arfuse-graph", "version": 1,
//!   "symbols": {"T": {"min": 1, "max": 8192}},
//!   "nodes": [
//!     {"id": "x", "op": "input", "outputs": [{"dtype": "bf16", "shape": ["T", 4096]}]},
//!     {"id": "ar", "op": "all_reduce", "attrs": {"group": "tp"}, "inputs": ["x"],
//!      "outputs": [{"dtype": "bf16", "shape": ["T", 4096]}]}
//!   ],
//!   "outputs": ["ar"]
//! }"#;
//! let g = Graph::from_json_str(text).unwrap();
//! assert_eq!(g.len(), 2);
//! assert!(g.canonical_text().contains("all_reduce(%0)"));
//! ```

mod dtype;
mod error;
mod graph;
mod id_index;
mod json;
pub mod op;
mod shape;
mod site_map;
mod text;
mod validate;

pub use dtype::DType;
pub use error::{LoadError, Problem, ProblemKind, Problems, MAX_IDENTICAL_LISTED, MAX_PROBLEMS};
pub use graph::{
    check_node_id, BuildError, Graph, Node, NodeId, Use, Value, MAX_ID_LEN, MAX_NODES, MAX_PORTS,
    MAX_RANK, MAX_SYMBOL_VALUE,
};
pub use json::{FORMAT_TAG, FORMAT_VERSION, MAX_INPUT_BYTES};
pub use op::{
    looks_like_collective, Backend, DispatchRange, FusedAllReduceNorm, FusedOutput, FusedPlan,
    FusedQuant, GroupScaleLayout, InputKind, NormInput, NormRounding, Nvfp4ScaleLayout, Op,
    ReduceOp, Strategy,
};
pub use shape::{is_symbol_name, Dim, DimParseError, Shape, SymbolRange, Symbols, TensorType};
pub use site_map::{NodeOutput, SiteInput, SiteMap, SiteOutput};
pub use text::{canonical_text, to_dot};
pub use validate::{broadcast, broadcasts_to, valid_eps, NVFP4_BLOCK};
