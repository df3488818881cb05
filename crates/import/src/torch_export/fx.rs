//! The compact form of an FX graph: what a torch.compile pass hands the importer in
//! memory instead of JSON text (`docs/fx-graph-format.md`, "The compact form"; the
//! Python package's `arfuse.fx.walk` writes it).
//!
//! [`FxGraph`] holds the graph as owned Rust values (nodes in FX order, arguments typed,
//! tensors named by the FX node that produced them). [`import`] reads it with the same
//! builder and op mapping as a torch.export file, with one difference: a tensor whose
//! dtype arfuse has no type for, or whose sizes cannot be read, never fails the import
//! (a pass must not fail on a node it does not model): it is typed as a `u8` scalar
//! that only opaque ops may read, and counted in the notes.

use super::schema::{
    Bounded, BoundedMap, GraphModule, NamedArg, Program, RangeConstraint, RawGraph, RawNode,
    Signature, TensorMeta,
};
use super::{Builder, MAX_TENSOR_VALUES, MAX_TORCH_NODES, SUPPORTED_SCHEMA_MAJOR};
use crate::{ImportError, ImportOptions, Imported};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value as Json};

/// One size of a tensor: a constant or a symbolic expression (`s72`, `2*s72`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum FxSize {
    /// A constant size.
    Const(i64),
    /// A sympy expression over the graph's symbols, as `str(SymInt)` writes it.
    Expr(String),
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

/// One argument value of a node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "value", rename_all = "snake_case")]
pub enum FxArg {
    /// A tensor, by name.
    Tensor(String),
    /// A list of tensors (`None` for an absent optional one).
    Tensors(Vec<Option<String>>),
    /// `None`.
    None,
    /// An int.
    Int(i64),
    /// A float (in JSON, a non-finite one as the text `inf`, `-inf` or `NaN`).
    Float(#[serde(with = "float_text")] f64),
    /// A bool.
    Bool(bool),
    /// A string (also an op given as an argument, a device or a layout, as text).
    Str(String),
    /// A list of ints.
    Ints(Vec<i64>),
    /// A list of floats (non-finite ones as for [`FxArg::Float`]).
    Floats(#[serde(with = "floats_text")] Vec<f64>),
    /// A list of bools.
    Bools(Vec<bool>),
    /// A symbolic int, by its expression.
    Sym(String),
    /// A list of ints and symbolic ints.
    Syms(Vec<FxSize>),
    /// A dtype, as a `ScalarType` code.
    Dtype(i64),
    /// Anything else (a script object, a nested structure): its type name.
    Other(String),
}

/// serde for an f64 that may be infinite or NaN: a JSON number, or its text.
mod float_text {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    #[serde(untagged)]
    pub(super) enum Repr {
        Number(f64),
        Text(String),
    }

    pub(super) fn repr(f: f64) -> Repr {
        if f.is_finite() {
            Repr::Number(f)
        } else {
            Repr::Text(f.to_string())
        }
    }

    pub(super) fn value<E: serde::de::Error>(r: Repr) -> Result<f64, E> {
        match r {
            Repr::Number(f) => Ok(f),
            Repr::Text(t) => t
                .parse()
                .map_err(|_| E::custom(format!("{t:?} is not a float"))),
        }
    }

    pub fn serialize<S: Serializer>(f: &f64, s: S) -> Result<S::Ok, S::Error> {
        repr(*f).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        value(Repr::deserialize(d)?)
    }
}

/// [`float_text`] for a list.
mod floats_text {
    use super::float_text::{repr, value, Repr};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(l: &[f64], s: S) -> Result<S::Ok, S::Error> {
        l.iter().map(|f| repr(*f)).collect::<Vec<_>>().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
        Vec::<Repr>::deserialize(d)?
            .into_iter()
            .map(value)
            .collect()
    }
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
    let program = program(fx)?;
    let version = format!("{SUPPORTED_SCHEMA_MAJOR}.fx");
    let mut builder = Builder::new(&program, version, options)?;
    builder.lenient_types = true;
    builder.build(&program)
}

fn too_many(what: &str, n: usize, limit: usize) -> ImportError {
    ImportError::malformed(
        "the FX graph",
        format!("{n} {what}, above the limit of {limit}"),
    )
}

fn tensor_ref(name: &str) -> Json {
    json!({ "as_tensor": { "name": name } })
}

fn size_json(s: &FxSize) -> Json {
    match s {
        FxSize::Const(n) => json!({ "as_int": n }),
        FxSize::Expr(e) => json!({ "as_expr": { "expr_str": e } }),
    }
}

/// The schema's form of one argument.
fn arg_json(a: &FxArg) -> Json {
    match a {
        FxArg::Tensor(t) => tensor_ref(t),
        FxArg::Tensors(l) if l.iter().all(Option::is_some) => json!({
            "as_tensors": l.iter().flatten().map(|t| json!({ "name": t })).collect::<Vec<_>>()
        }),
        FxArg::Tensors(l) => json!({
            "as_optional_tensors": l
                .iter()
                .map(|t| match t {
                    Some(t) => tensor_ref(t),
                    None => json!({ "as_none": true }),
                })
                .collect::<Vec<_>>()
        }),
        FxArg::None => json!({ "as_none": true }),
        FxArg::Int(i) => json!({ "as_int": i }),
        FxArg::Float(f) if f.is_finite() => json!({ "as_float": f }),
        FxArg::Float(f) => json!({ "as_string": f.to_string() }),
        FxArg::Bool(b) => json!({ "as_bool": b }),
        FxArg::Str(s) => json!({ "as_string": s }),
        FxArg::Ints(l) => json!({ "as_ints": l }),
        FxArg::Floats(l) => json!({
            "as_floats": l.iter().map(|f| if f.is_finite() { json!(f) } else { Json::Null }).collect::<Vec<_>>()
        }),
        FxArg::Bools(l) => json!({ "as_bools": l }),
        FxArg::Sym(e) => json!({ "as_sym_int": { "as_name": e } }),
        FxArg::Syms(l) => json!({
            "as_sym_ints": l
                .iter()
                .map(|s| match s {
                    FxSize::Const(n) => json!({ "as_int": n }),
                    FxSize::Expr(e) => json!({ "as_name": e }),
                })
                .collect::<Vec<_>>()
        }),
        FxArg::Dtype(c) => json!({ "as_scalar_type": c }),
        FxArg::Other(what) => json!({ "as_other": what }),
    }
}

/// The program the builder reads: the schema's structures, built from the compact form.
fn program(fx: &FxGraph) -> Result<Program, ImportError> {
    if fx.nodes.len() > MAX_TORCH_NODES {
        return Err(too_many("nodes", fx.nodes.len(), MAX_TORCH_NODES));
    }
    let tensors = fx.inputs.len() + fx.nodes.iter().map(|n| n.outputs.len()).sum::<usize>();
    if tensors > MAX_TENSOR_VALUES {
        return Err(too_many("tensors", tensors, MAX_TENSOR_VALUES));
    }
    let meta = |t: &FxTensor| {
        (
            t.name.clone(),
            TensorMeta {
                dtype: t.dtype,
                sizes: t.sizes.iter().map(size_json).collect(),
            },
        )
    };
    let mut tensor_values: Vec<(String, TensorMeta)> = Vec::with_capacity(tensors);
    let mut sym_ints: Vec<(String, Json)> = Vec::new();
    tensor_values.extend(fx.inputs.iter().map(meta));
    let mut nodes = Vec::with_capacity(fx.nodes.len());
    for n in &fx.nodes {
        tensor_values.extend(n.outputs.iter().map(meta));
        let mut inputs = Vec::with_capacity(n.args.len());
        for (name, a) in &n.args {
            match a {
                FxArg::Sym(e) => {
                    sym_ints.push((e.clone(), json!({ "as_expr": { "expr_str": e } })))
                }
                FxArg::Syms(l) => sym_ints.extend(l.iter().filter_map(|s| match s {
                    FxSize::Expr(e) => Some((e.clone(), json!({ "as_expr": { "expr_str": e } }))),
                    FxSize::Const(_) => None,
                })),
                _ => {}
            }
            inputs.push(NamedArg {
                name: name.clone(),
                arg: arg_json(a),
            });
        }
        let mut outputs: Vec<Json> = n.outputs.iter().map(|t| tensor_ref(&t.name)).collect();
        outputs.extend((0..n.other_outputs).map(|_| json!({ "as_none": true })));
        let mut metadata = Map::new();
        if let Some(m) = &n.module {
            metadata.insert("nn_module_stack".into(), Json::String(format!("{m},{m},?")));
        }
        nodes.push(RawNode {
            target: n.target.clone(),
            inputs,
            outputs,
            metadata,
            name: Some(n.name.clone()),
        });
    }
    let input_specs = fx
        .inputs
        .iter()
        .map(|t| json!({ "user_input": { "arg": { "as_tensor": { "name": t.name } } } }))
        .collect();
    let range_constraints = fx
        .symbols
        .iter()
        .map(|s| {
            (
                s.name.clone(),
                RangeConstraint {
                    min_val: s.min.map(|v| json!(v)),
                    max_val: s.max.map(|v| json!(v)),
                },
            )
        })
        .collect();
    Ok(Program {
        graph_module: GraphModule {
            graph: RawGraph {
                inputs: fx.inputs.iter().map(|t| tensor_ref(&t.name)).collect(),
                outputs: fx.outputs.iter().map(|t| tensor_ref(t)).collect(),
                nodes: Bounded(nodes),
                tensor_values: BoundedMap(tensor_values),
                sym_int_values: BoundedMap(sym_ints),
            },
            signature: Some(Signature { input_specs }),
        },
        range_constraints: BoundedMap(range_constraints),
        torch_version: fx.torch_version.clone(),
    })
}
