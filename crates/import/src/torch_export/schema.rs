//! The parts of torch.export's serialized ExportedProgram (schema 8.x) the importer
//! reads. Unknown fields are ignored (the schema grows by minor versions); unions
//! (`Argument`, `SymInt`, input specs) stay `serde_json::Value` and are taken apart
//! where they are used, with errors naming the node.

use serde::de::{Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;
use std::fmt;
use std::marker::PhantomData;

use super::{MAX_TENSOR_VALUES, MAX_TORCH_NODES};

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
