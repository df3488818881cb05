//! The parts of torch.export's serialized ExportedProgram (schema 8.x) the importer
//! reads. Unknown fields are ignored (the schema grows by minor versions); unions
//! (`Argument`, `SymInt`, input specs) are parsed as `serde_json::Value`, so that a
//! malformed member is refused by the builder with an error naming the node, not by
//! the parser. [`Converted`] then reads each node's arguments into [`Arg`]s and its
//! outputs into names, once, and lends the builder a [`Source`].

use serde::de::{Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;
use std::fmt;
use std::marker::PhantomData;

use super::arg::{self, Arg};
use super::source::{GraphValue, Meta, Module, NodeIn, Outputs, SchemaOutputs, Sizes, Source};
use super::{MAX_TENSOR_VALUES, MAX_TORCH_NODES};
use arfuse_ir::InputKind;

/// Just the version, read before anything else.
#[derive(Deserialize)]
pub struct Header {
    #[serde(default)]
    pub schema_version: Option<Value>,
}

#[derive(Deserialize)]
pub struct Program {
    pub graph_module: GraphModule,
    #[serde(default)]
    pub range_constraints: BoundedMap<RangeConstraint, MAX_TENSOR_VALUES>,
    #[serde(default)]
    pub torch_version: Option<String>,
}

#[derive(Deserialize)]
pub struct RangeConstraint {
    #[serde(default)]
    pub min_val: Option<Value>,
    #[serde(default)]
    pub max_val: Option<Value>,
}

#[derive(Deserialize)]
pub struct GraphModule {
    pub graph: RawGraph,
    #[serde(default)]
    pub signature: Option<Signature>,
}

#[derive(Deserialize, Default)]
pub struct Signature {
    #[serde(default)]
    pub input_specs: Vec<Value>,
}

#[derive(Deserialize)]
pub struct RawGraph {
    #[serde(default)]
    pub inputs: Vec<Value>,
    #[serde(default)]
    pub outputs: Vec<Value>,
    pub nodes: Bounded<RawNode, MAX_TORCH_NODES>,
    pub tensor_values: BoundedMap<TensorMeta, MAX_TENSOR_VALUES>,
    #[serde(default)]
    pub sym_int_values: BoundedMap<Value, MAX_TENSOR_VALUES>,
}

#[derive(Deserialize)]
pub struct RawNode {
    pub target: String,
    #[serde(default)]
    pub inputs: Vec<NamedArg>,
    #[serde(default)]
    pub outputs: Vec<Value>,
    #[serde(default)]
    pub metadata: serde_json::Map<String, Value>,
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Deserialize)]
pub struct NamedArg {
    pub name: String,
    pub arg: Value,
}

#[derive(Deserialize)]
pub struct TensorMeta {
    pub dtype: i64,
    pub sizes: Vec<Value>,
}

/// A list (JSON array, or JSON object read as key/value pairs) refused as soon as it
/// holds more than `N` entries, so that a hostile file cannot make the importer
/// allocate without bound before the count is checked.
pub struct Bounded<T, const N: usize>(pub Vec<T>);

impl<T, const N: usize> Default for Bounded<T, N> {
    fn default() -> Self {
        Bounded(Vec::new())
    }
}

impl<'de, T: Deserialize<'de>, const N: usize> Deserialize<'de> for Bounded<T, N> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Seq<T, const N: usize>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>, const N: usize> Visitor<'de> for Seq<T, N> {
            type Value = Bounded<T, N>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "an array of at most {N} entries")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(x) = s.next_element()? {
                    if out.len() >= N {
                        return Err(serde::de::Error::custom(format!(
                            "more than {N} entries (the limit)"
                        )));
                    }
                    out.push(x);
                }
                Ok(Bounded(out))
            }
        }
        d.deserialize_seq(Seq(PhantomData))
    }
}

/// The key/value pairs of a JSON object, in file order, bounded like [`Bounded`].
pub struct BoundedMap<V, const N: usize>(pub Vec<(String, V)>);

impl<V, const N: usize> Default for BoundedMap<V, N> {
    fn default() -> Self {
        BoundedMap(Vec::new())
    }
}

impl<'de, V: Deserialize<'de>, const N: usize> Deserialize<'de> for BoundedMap<V, N> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Map<V, const N: usize>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>, const N: usize> Visitor<'de> for Map<V, N> {
            type Value = BoundedMap<V, N>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "an object of at most {N} entries")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(k) = m.next_key::<String>()? {
                    if out.len() >= N {
                        return Err(serde::de::Error::custom(format!(
                            "more than {N} entries (the limit)"
                        )));
                    }
                    out.push((k, m.next_value()?));
                }
                Ok(BoundedMap(out))
            }
        }
        d.deserialize_map(Map(PhantomData))
    }
}

/// A parsed program with its nodes read: arguments typed, outputs as names.
pub struct Converted {
    program: Program,
    nodes: Vec<ConvertedNode>,
}

struct ConvertedNode {
    name: Option<String>,
    target: String,
    args: Vec<(String, Arg)>,
    outputs: SchemaOutputs,
    /// The `nn_module_stack` metadata, when it is a string.
    module_stack: Option<String>,
}

impl Converted {
    pub fn new(mut program: Program) -> Converted {
        let raw = std::mem::take(&mut program.graph_module.graph.nodes.0);
        let nodes = raw.into_iter().map(ConvertedNode::new).collect();
        Converted { program, nodes }
    }

    /// The builder's view.
    pub fn source(&self) -> Source<'_> {
        let p = &self.program;
        let graph = &p.graph_module.graph;
        fn graph_value(a: &Value) -> GraphValue<'_> {
            a.get("as_tensor")
                .and_then(|t| t.get("name"))
                .and_then(Value::as_str)
                .map_or(GraphValue::Other(a), GraphValue::Tensor)
        }
        Source {
            ranges: p
                .range_constraints
                .0
                .iter()
                .map(|(name, r)| {
                    (
                        name.as_str(),
                        range_value(r.min_val.as_ref()),
                        range_value(r.max_val.as_ref()),
                    )
                })
                .collect(),
            torch_version: p.torch_version.as_deref(),
            specs: p
                .graph_module
                .signature
                .as_ref()
                .map(|s| s.input_specs.iter().filter_map(input_spec).collect())
                .unwrap_or_default(),
            inputs: graph.inputs.iter().map(graph_value).collect(),
            outputs: graph.outputs.iter().map(graph_value).collect(),
            tensors: graph
                .tensor_values
                .0
                .iter()
                .map(|(k, m)| {
                    (
                        k.as_str(),
                        Meta {
                            dtype: m.dtype,
                            sizes: Sizes::Schema(&m.sizes),
                        },
                    )
                })
                .collect(),
            sym_ints: graph
                .sym_int_values
                .0
                .iter()
                .map(|(k, v)| (k.as_str(), v))
                .collect(),
            nodes: self
                .nodes
                .iter()
                .map(|n| NodeIn {
                    name: n.name.as_deref(),
                    target: &n.target,
                    args: &n.args,
                    outputs: Outputs::Schema(&n.outputs),
                    module: n
                        .module_stack
                        .as_deref()
                        .map_or(Module::None, Module::Stack),
                })
                .collect(),
        }
    }
}

impl ConvertedNode {
    fn new(n: RawNode) -> ConvertedNode {
        let mut outputs = SchemaOutputs {
            first_is_tensor: n.outputs.first().and_then(arg::schema::tensor_of).is_some(),
            ..SchemaOutputs::default()
        };
        for o in &n.outputs {
            collect_output_tensors(o, &mut outputs.names, &mut outputs.other);
        }
        let mut metadata = n.metadata;
        ConvertedNode {
            name: n.name,
            target: n.target,
            args: n
                .inputs
                .into_iter()
                .map(|a| (a.name, Arg::from_schema(a.arg)))
                .collect(),
            outputs,
            module_stack: match metadata.remove("nn_module_stack") {
                Some(Value::String(s)) => Some(s),
                _ => None,
            },
        }
    }
}

/// Integer bounds of a range-constraint value: a number, null, or a string such as
/// `"int_oo"` (unbounded).
fn range_value(v: Option<&Value>) -> Option<u64> {
    match v? {
        Value::Number(n) => n
            .as_u64()
            .or_else(|| n.as_i64().map(|i| i.max(0) as u64))
            .or_else(|| {
                n.as_f64()
                    .filter(|f| f.is_finite())
                    .map(|f| f.max(0.0) as u64)
            }),
        _ => None,
    }
}

/// `(tensor name, parameter/buffer FQN, kind)` of one input spec.
fn input_spec(spec: &Value) -> Option<(&str, Option<&str>, InputKind)> {
    let (kind, body) = spec.as_object()?.iter().next()?;
    fn arg_name(b: &Value) -> Option<&str> {
        let arg = b.get("arg")?;
        arg.get("name")
            .or_else(|| arg.get("as_tensor").and_then(|t| t.get("name")))
            .and_then(Value::as_str)
    }
    match kind.as_str() {
        "parameter" => Some((
            arg_name(body)?,
            body.get("parameter_name").and_then(Value::as_str),
            InputKind::Parameter,
        )),
        "buffer" => Some((
            arg_name(body)?,
            body.get("buffer_name").and_then(Value::as_str),
            InputKind::Buffer,
        )),
        "tensor_constant" => Some((
            arg_name(body)?,
            body.get("tensor_constant_name").and_then(Value::as_str),
            InputKind::Buffer,
        )),
        "user_input" => Some((arg_name(body)?, None, InputKind::Activation)),
        _ => None,
    }
}

/// Tensor names of a node output (`as_tensor`, `as_tensors`, `as_optional_tensors`);
/// other outputs (symbolic ints, None) are counted in `other`.
fn collect_output_tensors(o: &Value, names: &mut Vec<String>, other: &mut usize) {
    let name_of = |t: &Value| t.get("name").and_then(Value::as_str).map(str::to_string);
    if let Some(t) = o.get("as_tensor") {
        if let Some(n) = name_of(t) {
            names.push(n);
        }
    } else if let Some(l) = o.get("as_tensors").and_then(Value::as_array) {
        names.extend(l.iter().filter_map(name_of));
    } else if let Some(l) = o.get("as_optional_tensors").and_then(Value::as_array) {
        names.extend(
            l.iter()
                .filter_map(|x| x.get("as_tensor"))
                .filter_map(name_of),
        );
    } else {
        *other += 1;
    }
}
