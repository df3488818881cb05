//! The compact form of an FX graph: what a torch.compile pass hands the importer in
//! memory instead of JSON text (`docs/fx-graph-format.md`, "The compact form"; the
//! Python extension walks an FX graph into it, `crates/python/src/walk.rs`).
//!
//! [`FxGraph`] holds the graph as owned Rust values (nodes in FX order, arguments typed,
//! tensors named by the FX node that produced them). [`import`] reads it with the same
//! builder and op mapping as a torch.export file, with one difference: a tensor whose
//! dtype arfuse has no type for, or whose sizes cannot be read, never fails the import
//! (a pass must not fail on a node it does not model): it is typed as a `u8` scalar
//! that only opaque ops may read, and counted in the notes.

use super::source::{GraphValue, Meta, Module, NodeIn, Outputs, Sizes, Source};
use super::{Builder, MAX_TENSOR_VALUES, MAX_TORCH_NODES, SUPPORTED_SCHEMA_MAJOR};
use crate::{ImportError, ImportOptions, Imported};
use arfuse_ir::InputKind;
use serde::{Deserialize, Serialize};

pub use super::arg::{Arg, SymInt};

/// One argument value of a node: the importer's [`Arg`] (the compact form uses every
/// variant but `OptionalTensor`, `OptionalTensors` with every tensor present, and
/// [`SymInt::Name`]; [`Arg::tensors`] and [`Arg::other`] make its lists of tensors and
/// its unmodelled objects).
pub use super::arg::Arg as FxArg;

/// One size of a tensor: a constant or a symbolic expression (`s72`, `2*s72`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum FxSize {
    /// A constant size.
    Const(i64),
    /// A sympy expression over the graph's symbols, as `str(SymInt)` writes it.
    Expr(String),
}

impl From<FxSize> for SymInt {
    fn from(s: FxSize) -> SymInt {
        match s {
            FxSize::Const(n) => SymInt::Const(n),
            FxSize::Expr(e) => SymInt::Expr(e),
        }
    }
}

/// A tensor value: its name (the FX node, or the `getitem` node reading it from a tuple),
/// torch.export's `ScalarType` code of its dtype (0 when it has none) and its sizes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FxTensor {
    /// The tensor's name.
    pub name: String,
    /// `ScalarType` code (`13` bf16, `7` f32, ...; `docs/torch-export.md`).
    pub dtype: i64,
    /// Sizes, outermost first.
    pub sizes: Vec<FxSize>,
}

/// One FX node (not a placeholder, not the output, not a `getitem` of a tuple).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FxNode {
    /// The FX node's name.
    pub name: String,
    /// The target: an op overload without `torch.ops.` (`aten.add.Tensor`), a higher-order
    /// op as `higher_order.<name>`, a Python function as `module.qualname`.
    pub target: String,
    /// Named arguments, in the op's order (positional ones named by its schema).
    pub args: Vec<(String, FxArg)>,
    /// The tensors of the node's value, in order.
    pub outputs: Vec<FxTensor>,
    /// How many entries of the node's value are not tensors (a `None`, a symbolic int).
    pub other_outputs: usize,
    /// The innermost module path of the node (`model.layers.0.mlp`), when known.
    pub module: Option<String>,
}

/// A symbol's range (`None`: unbounded on that side).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FxSymbol {
    /// The symbol (`s72`).
    pub name: String,
    /// Smallest value.
    pub min: Option<i64>,
    /// Largest value.
    pub max: Option<i64>,
}

/// An FX graph in the compact form.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FxGraph {
    /// The tensor placeholders, in order.
    pub inputs: Vec<FxTensor>,
    /// Every other node, in FX order.
    pub nodes: Vec<FxNode>,
    /// The names of the tensors the graph returns.
    pub outputs: Vec<String>,
    /// The ranges of the graph's symbols.
    pub symbols: Vec<FxSymbol>,
    /// The torch version that traced the graph, recorded in the metadata.
    pub torch_version: Option<String>,
}

/// Imports an FX graph in the compact form (see the module documentation).
///
/// Errors: more than [`MAX_TORCH_NODES`] nodes or [`MAX_TENSOR_VALUES`] tensors,
/// [`ImportError::Malformed`] for a tensor produced twice, [`ImportError::MissingTensor`]
/// for an argument naming a tensor nothing produced, and [`ImportError::Invalid`] if the
/// result does not validate.
pub fn import(fx: &FxGraph, options: &ImportOptions) -> Result<Imported, ImportError> {
    let source = source(fx)?;
    let version = format!("{SUPPORTED_SCHEMA_MAJOR}.fx");
    let mut builder = Builder::new(&source, version, options)?;
    builder.lenient_types = true;
    builder.build()
}

fn too_many(what: &str, n: usize, limit: usize) -> ImportError {
    ImportError::malformed(
        "the FX graph",
        format!("{n} {what}, above the limit of {limit}"),
    )
}

/// The builder's view of the compact form: every string borrowed.
fn source(fx: &FxGraph) -> Result<Source<'_>, ImportError> {
    if fx.nodes.len() > MAX_TORCH_NODES {
        return Err(too_many("nodes", fx.nodes.len(), MAX_TORCH_NODES));
    }
    let tensors = fx.inputs.len() + fx.nodes.iter().map(|n| n.outputs.len()).sum::<usize>();
    if tensors > MAX_TENSOR_VALUES {
        return Err(too_many("tensors", tensors, MAX_TENSOR_VALUES));
    }
    fn meta(t: &FxTensor) -> (&str, Meta<'_>) {
        let meta = Meta {
            dtype: t.dtype,
            sizes: Sizes::Fx(&t.sizes),
        };
        (&t.name, meta)
    }
    let mut tensor_values = Vec::with_capacity(tensors);
    tensor_values.extend(fx.inputs.iter().map(meta));
    for n in &fx.nodes {
        tensor_values.extend(n.outputs.iter().map(meta));
    }
    // A negative bound reads as 0, as in torch.export's range constraints.
    let bound = |v: Option<i64>| v.map(|v| v.max(0) as u64);
    Ok(Source {
        ranges: fx
            .symbols
            .iter()
            .map(|s| (s.name.as_str(), bound(s.min), bound(s.max)))
            .collect(),
        torch_version: fx.torch_version.as_deref(),
        specs: fx
            .inputs
            .iter()
            .map(|t| (t.name.as_str(), None, InputKind::Activation))
            .collect(),
        inputs: fx
            .inputs
            .iter()
            .map(|t| GraphValue::Tensor(&t.name))
            .collect(),
        outputs: fx.outputs.iter().map(|t| GraphValue::Tensor(t)).collect(),
        tensors: tensor_values,
        sym_ints: Vec::new(),
        nodes: fx
            .nodes
            .iter()
            .map(|n| NodeIn {
                name: Some(&n.name),
                target: &n.target,
                args: &n.args,
                outputs: Outputs::Fx(&n.outputs, n.other_outputs),
                module: n.module.as_deref().map_or(Module::None, Module::Path),
            })
            .collect(),
    })
}
