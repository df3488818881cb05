//! The node list, each node's inputs and attributes appended to one [`Arena`].
//!
//! A node is read by hand (a `DeserializeSeed` carries the arena), with what
//! `#[derive(Deserialize)]` and `#[serde(deny_unknown_fields)]` would do for
//!
//! ```text
//! struct RawNode { id: String, op: String, #[serde(default)] attrs: UniqueMap<..>,
//!     #[serde(default)] inputs: Vec<String>, #[serde(default)] outputs: Vec<TensorType>,
//!     #[serde(default)] module: Option<String> }
//! ```
//!
//! an object (or, as serde allows, an array of the fields in order) with the same
//! messages at the same positions: unknown, duplicate and missing fields, a wrong type.

use super::{unique_entries, Arena, RawNode, Str};
use crate::graph::MAX_NODES;
use crate::TensorType;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use std::fmt;
use std::marker::PhantomData;

/// The fields of a node, in order (serde's list in an unknown-field message).
const FIELDS: &[&str] = &["id", "op", "attrs", "inputs", "outputs", "module"];
/// What a node is, in serde's messages (the name of the derived struct this replaces).
const EXPECTING: &str = "struct RawNode";
/// What an array-form node is, in serde's too-short message.
const EXPECTING_SEQ: &str = "struct RawNode with 6 elements";

/// The node list, refused as soon as it exceeds [`MAX_NODES`] (bounded time and memory),
/// with the inputs and attributes of every node.
pub(in crate::json) struct BoundedNodes<'a> {
    pub(in crate::json) nodes: Vec<RawNode<'a>>,
    pub(in crate::json) arena: Arena<'a>,
}

impl<'de: 'a, 'a> de::Deserialize<'de> for BoundedNodes<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Vis<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for Vis<'a> {
            type Value = BoundedNodes<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of nodes")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<BoundedNodes<'a>, A::Error> {
                let mut nodes = Vec::new();
                let mut arena = Arena::default();
                while let Some(n) = s.next_element_seed(NodeSeed { arena: &mut arena })? {
                    if nodes.len() >= MAX_NODES {
                        return Err(de::Error::custom(format!(
                            "the graph has more than {MAX_NODES} nodes (the limit)"
                        )));
                    }
                    nodes.push(n);
                }
                Ok(BoundedNodes { nodes, arena })
            }
        }
        d.deserialize_seq(Vis(PhantomData))
    }
}

/// Reads one node, appending its inputs and attributes to `arena`.
struct NodeSeed<'s, 'a> {
    arena: &'s mut Arena<'a>,
}

impl<'de: 'a, 'a> DeserializeSeed<'de> for NodeSeed<'_, 'a> {
    type Value = RawNode<'a>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<RawNode<'a>, D::Error> {
        d.deserialize_struct("RawNode", FIELDS, self)
    }
}

/// A node's fields as read so far.
#[derive(Default)]
struct Fields<'a> {
    id: Option<Str<'a>>,
    op: Option<Str<'a>>,
    attrs: Option<std::ops::Range<usize>>,
    inputs: Option<std::ops::Range<usize>>,
    outputs: Option<Vec<TensorType>>,
    module: Option<Option<String>>,
}

impl<'a> Fields<'a> {
    /// The node, or serde's "missing field" for the first required field absent.
    fn finish<E: de::Error>(self, arena: &Arena<'a>) -> Result<RawNode<'a>, E> {
        let empty_attrs = arena.attrs.len()..arena.attrs.len();
        let empty_inputs = arena.inputs.len()..arena.inputs.len();
        Ok(RawNode {
            id: self.id.ok_or_else(|| E::missing_field("id"))?,
            op: self.op.ok_or_else(|| E::missing_field("op"))?,
            attrs: self.attrs.unwrap_or(empty_attrs),
            inputs: self.inputs.unwrap_or(empty_inputs),
            outputs: self.outputs.unwrap_or_default(),
            module: self.module.unwrap_or_default(),
        })
    }
}

impl<'de: 'a, 'a> Visitor<'de> for NodeSeed<'_, 'a> {
    type Value = RawNode<'a>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(EXPECTING)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<RawNode<'a>, A::Error> {
        let arena = self.arena;
        let mut f = Fields::default();
        while let Some(key) = m.next_key::<Str<'de>>()? {
            let key = key.as_str();
            let taken = match key {
                "id" => f.id.is_some(),
                "op" => f.op.is_some(),
                "attrs" => f.attrs.is_some(),
                "inputs" => f.inputs.is_some(),
                "outputs" => f.outputs.is_some(),
                "module" => f.module.is_some(),
                _ => return Err(de::Error::unknown_field(key, FIELDS)),
            };
            if taken {
                let name = FIELDS.iter().find(|n| **n == key).copied().unwrap_or("");
                return Err(de::Error::duplicate_field(name));
            }
            match key {
                "id" => f.id = Some(m.next_value()?),
                "op" => f.op = Some(m.next_value()?),
                "attrs" => f.attrs = Some(m.next_value_seed(AttrsSeed(&mut *arena))?),
                "inputs" => f.inputs = Some(m.next_value_seed(InputsSeed(&mut *arena))?),
                "outputs" => f.outputs = Some(m.next_value()?),
                _ => f.module = Some(m.next_value()?),
            }
        }
        f.finish(arena)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<RawNode<'a>, A::Error> {
        let arena = self.arena;
        let short = |i| de::Error::invalid_length(i, &EXPECTING_SEQ);
        let id = s.next_element::<Str<'a>>()?.ok_or_else(|| short(0))?;
        let op = s.next_element::<Str<'a>>()?.ok_or_else(|| short(1))?;
        // Each defaulted field is asked for even after the list ended, as derived code does.
        let f = Fields {
            id: Some(id),
            op: Some(op),
            attrs: s.next_element_seed(AttrsSeed(&mut *arena))?,
            inputs: s.next_element_seed(InputsSeed(&mut *arena))?,
            outputs: s.next_element()?,
            module: s.next_element()?,
        };
        f.finish(arena)
    }
}

/// Reads a node's attribute object (unique keys, at most `MAX_PORTS`) into the arena.
struct AttrsSeed<'s, 'a>(&'s mut Arena<'a>);

impl<'de: 'a, 'a> DeserializeSeed<'de> for AttrsSeed<'_, 'a> {
    type Value = std::ops::Range<usize>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de: 'a, 'a> Visitor<'de> for AttrsSeed<'_, 'a> {
    type Value = std::ops::Range<usize>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object")
    }
    fn visit_map<A: MapAccess<'de>>(self, m: A) -> Result<Self::Value, A::Error> {
        let start = self.0.attrs.len();
        unique_entries(m, &mut self.0.attrs)?;
        Ok(start..self.0.attrs.len())
    }
}

/// Reads a node's input references into the arena.
struct InputsSeed<'s, 'a>(&'s mut Arena<'a>);

impl<'de: 'a, 'a> DeserializeSeed<'de> for InputsSeed<'_, 'a> {
    type Value = std::ops::Range<usize>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de: 'a, 'a> Visitor<'de> for InputsSeed<'_, 'a> {
    type Value = std::ops::Range<usize>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // serde's wording for a Vec.
        f.write_str("a sequence")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Self::Value, A::Error> {
        let start = self.0.inputs.len();
        while let Some(r) = s.next_element::<Str<'a>>()? {
            self.0.inputs.push(r);
        }
        Ok(start..self.0.inputs.len())
    }
}
