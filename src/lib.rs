//! # arfuse
//!
//! Fuses the all-reduce -> residual add -> RMSNorm (-> quant) chain that ends nearly
//! every tensor-parallel decoder block into one node, with a backend (trtllm-style IPC
//! or mnnvl multicast) and a one-shot / two-shot plan proven at plan time for every
//! token count the graph can run with.
//!
//! The top of this crate is what a user of the pass needs: [`lower`] / [`lower_with`]
//! with [`LowerOptions`], a [`Graph`] and a [`Target`], the [`Lowered`] result with
//! its [`Report`], [`LowerError`], and [`splice`](mod@splice) (what a graph compiler
//! changes in its own graph to apply a lowering; the torch.compile pass of the Python
//! package uses it). The layers are behind [`advanced`], one dependency for users who
//! need them:
//!
//! - [`advanced::abi`]: what the kernels can run (enums, limits, `-D` defines).
//! - [`advanced::ir`]: the tensor-graph IR, its JSON format, validation, canonical text,
//!   DOT.
//! - [`advanced::import`]: front ends (torch.export's ExportedProgram JSON and `.pt2`).
//! - [`advanced::policy`]: backend, strategy and workspace planning (usable alone).
//! - [`advanced::rewrite`]: the e-graph fusion pass.
//! - [`advanced::reference`]: CPU reference semantics and the equivalence check.
//!
//! The GPU runtime (`arfuse-runtime`, cudarc) is a separate crate so that using the
//! compiler pass never links CUDA. Error enums and option structs are
//! `#[non_exhaustive]`; options start from `Default` (with `with_*` setters).
//!
//! ```no_run
//! // A graph file (arfuse JSON, torch.export JSON or .pt2), e.g. the checkout's
//! // ir-fixtures/models/llama31_8b_tp8.json.
//! let path = std::env::args().nth(1).ok_or("usage: lower GRAPH")?;
//! let bytes = std::fs::read(&path).map_err(|e| format!("{path}: {e}"))?;
//! let graph = arfuse::advanced::import::load_any(&bytes)?.graph;
//! let target = arfuse::Target::preset("h200-sxm-x8")?;
//! let lowered = arfuse::lower(&graph, &target)?;
//! println!("{}", lowered.report);
//! std::fs::write("lowered.json", lowered.graph.to_json_string())?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

/// The layers of the pass, for users who need more than [`lower`]: each is its own
/// crate, re-exported here (inlined, so that `cargo doc -p arfuse` documents them).
pub mod advanced {
    #[doc(inline)]
    pub use arfuse_abi as abi;
    #[doc(inline)]
    pub use arfuse_import as import;
    #[doc(inline)]
    pub use arfuse_ir as ir;
    #[doc(inline)]
    pub use arfuse_policy as policy;
    #[doc(inline)]
    pub use arfuse_reference as reference;
    #[doc(inline)]
    pub use arfuse_rewrite as rewrite;
}

pub mod splice;

pub use arfuse_ir::Graph;
pub use arfuse_policy::Target;
pub use arfuse_rewrite::{lower, lower_with, LowerError, LowerOptions, Lowered, Report};
