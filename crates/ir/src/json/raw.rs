//! The graph file as parsed, before any checking: typed serde structures that borrow
//! their strings from the input wherever the JSON has no escapes.
//!
//! Every error here is serde_json's, at the position where it arises: unknown and
//! missing fields (derived), wrong types, duplicate keys, the node and key limits.
//! Attribute values are kept as [`Attr`], a borrowed JSON value, and become
//! `serde_json::Value`s only for an op the memo has not seen.

use crate::TensorType;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;

mod node;

pub(super) use node::BoundedNodes;

/// Objects with at most this many keys are checked for duplicates by comparing every
/// pair; larger ones use a hash set (bounded time on hostile input).
const LINEAR_DUPLICATE_SCAN: usize = 16;

/// The header fields alone, parsed to report a wrong format or version first when the
/// whole document does not parse.
#[derive(Deserialize)]
pub(super) struct Header {
    pub(super) format: Option<serde_json::Value>,
    pub(super) version: Option<serde_json::Value>,
}

/// The whole document.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawGraph<'a> {
    /// Checked by `check_header` (as for [`Header`]).
    pub(super) format: Option<serde_json::Value>,
    /// Checked by `check_header` (as for [`Header`]).
    pub(super) version: Option<serde_json::Value>,
    /// Checked field by field in `symbol_range`, so that an error names the field.
    #[serde(default)]
    pub(super) symbols: UniqueMap<String, serde_json::Value>,
    #[serde(borrow)]
    pub(super) nodes: BoundedNodes<'a>,
    #[serde(default, borrow)]
    pub(super) outputs: Vec<Str<'a>>,
    #[serde(default)]
    pub(super) metadata: Option<serde_json::Value>,
}

/// One node as written. Its inputs and attributes are ranges of the node list's
/// [`Arena`] (two vectors for the whole graph rather than two per node).
pub(super) struct RawNode<'a> {
    pub(super) id: Str<'a>,
    pub(super) op: Str<'a>,
    pub(super) attrs: Range<usize>,
    pub(super) inputs: Range<usize>,
    pub(super) outputs: Vec<TensorType>,
    pub(super) module: Option<String>,
}

/// The inputs and attributes of every node, in file order.
#[derive(Default)]
pub(super) struct Arena<'a> {
    pub(super) inputs: Vec<Str<'a>>,
    pub(super) attrs: Vec<(Str<'a>, Attr<'a>)>,
}

impl<'a> Arena<'a> {
    /// The input references of `n`.
    pub(super) fn inputs(&self, n: &RawNode<'_>) -> &[Str<'a>] {
        self.inputs.get(n.inputs.clone()).unwrap_or(&[])
    }

    /// The attributes of `n`, in file order.
    pub(super) fn attrs(&self, n: &RawNode<'_>) -> &[(Str<'a>, Attr<'a>)] {
        self.attrs.get(n.attrs.clone()).unwrap_or(&[])
    }
}

/// A JSON string, borrowed from the input unless it had escapes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(super) struct Str<'a>(pub(super) Cow<'a, str>);

impl Str<'_> {
    /// The text.
    pub(super) fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Vis;
        impl<'de> Visitor<'de> for Vis {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                // serde's own wording for a String.
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_string(Vis)
    }
}

/// A key of a [`UniqueMap`].
pub(super) trait Key {
    /// The key as written, for the duplicate-key message.
    fn text(&self) -> &str;
}

impl Key for String {
    fn text(&self) -> &str {
        self
    }
}

impl Key for Str<'_> {
    fn text(&self) -> &str {
        self.as_str()
    }
}

/// A JSON object whose keys must be unique (serde_json keeps the last duplicate
/// silently), in file order, with at most `MAX_PORTS` keys.
pub(super) struct UniqueMap<K, V>(pub(super) Vec<(K, V)>);

impl<K, V> Default for UniqueMap<K, V> {
    fn default() -> Self {
        UniqueMap(Vec::new())
    }
}

impl<'de, K: Key + Deserialize<'de>, V: Deserialize<'de>> Deserialize<'de> for UniqueMap<K, V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Vis<K, V>(PhantomData<(K, V)>);
        impl<'de, K: Key + Deserialize<'de>, V: Deserialize<'de>> Visitor<'de> for Vis<K, V> {
            type Value = UniqueMap<K, V>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, m: A) -> Result<UniqueMap<K, V>, A::Error> {
                let mut out = Vec::new();
                unique_entries(m, &mut out)?;
                Ok(UniqueMap(out))
            }
        }
        d.deserialize_map(Vis(PhantomData))
    }
}

/// Appends the entries of the object `m` to `out`, refusing a key already among
/// them (those appended by this call) and more than `MAX_PORTS` of them.
pub(super) fn unique_entries<'de, A, K, V>(mut m: A, out: &mut Vec<(K, V)>) -> Result<(), A::Error>
where
    A: MapAccess<'de>,
    K: Key + Deserialize<'de>,
    V: Deserialize<'de>,
{
    let start = out.len();
    // Filled once the object is past LINEAR_DUPLICATE_SCAN keys.
    let mut seen: HashSet<String> = HashSet::new();
    while let Some(k) = m.next_key::<K>()? {
        let earlier = out.get(start..).unwrap_or(&[]);
        let duplicate = if earlier.len() < LINEAR_DUPLICATE_SCAN {
            earlier.iter().any(|(o, _)| o.text() == k.text())
        } else {
            if seen.is_empty() {
                seen.extend(earlier.iter().map(|(o, _)| o.text().to_owned()));
            }
            !seen.insert(k.text().to_owned())
        };
        if duplicate {
            return Err(de::Error::custom(format!("duplicate key {:?}", k.text())));
        }
        if earlier.len() >= crate::MAX_PORTS {
            return Err(de::Error::custom(format!(
                "more than {} keys in one object",
                crate::MAX_PORTS
            )));
        }
        out.push((k, m.next_value()?));
    }
    Ok(())
}

/// An attribute value: any JSON value, strings borrowed from the input. Objects keep
/// every pair in file order (a repeated key inside a nested object is kept; the last
/// one wins when it becomes a `serde_json::Value`, as when serde_json parses one).
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Attr<'a> {
    Null,
    Bool(bool),
    U64(u64),
    I64(i64),
    F64(f64),
    Str(Cow<'a, str>),
    Seq(Vec<Attr<'a>>),
    Map(Vec<(Cow<'a, str>, Attr<'a>)>),
}

impl<'de: 'a, 'a> Deserialize<'de> for Attr<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(AttrVisitor(PhantomData))
    }
}

struct AttrVisitor<'a>(PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for AttrVisitor<'a> {
    type Value = Attr<'a>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // serde_json::Value's wording.
        f.write_str("any valid JSON value")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Attr<'a>, E> {
        Ok(Attr::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Attr<'a>, E> {
        Ok(Attr::I64(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Attr<'a>, E> {
        Ok(Attr::U64(v))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Attr<'a>, E> {
        Ok(Attr::F64(v))
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Attr<'a>, E> {
        Ok(Attr::Str(Cow::Borrowed(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Attr<'a>, E> {
        Ok(Attr::Str(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Attr<'a>, E> {
        Ok(Attr::Str(Cow::Owned(v)))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Attr<'a>, E> {
        Ok(Attr::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Attr<'a>, E> {
        Ok(Attr::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Attr<'a>, D::Error> {
        Attr::deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Attr<'a>, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = s.next_element::<Attr<'a>>()? {
            out.push(v);
        }
        Ok(Attr::Seq(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Attr<'a>, A::Error> {
        let mut out = Vec::new();
        while let Some((k, v)) = m.next_entry::<Str<'a>, Attr<'a>>()? {
            out.push((k.0, v));
        }
        Ok(Attr::Map(out))
    }
}

impl Attr<'_> {
    /// The value serde_json would have parsed from the same text.
    pub(super) fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Attr::Null => J::Null,
            Attr::Bool(b) => J::Bool(*b),
            Attr::U64(n) => J::Number((*n).into()),
            Attr::I64(n) => J::Number((*n).into()),
            Attr::F64(x) => serde_json::Number::from_f64(*x).map_or(J::Null, J::Number),
            Attr::Str(s) => J::String(s.to_string()),
            Attr::Seq(items) => J::Array(items.iter().map(Attr::to_json).collect()),
            Attr::Map(pairs) => {
                let mut m = serde_json::Map::new();
                for (k, v) in pairs {
                    m.insert(k.to_string(), v.to_json());
                }
                J::Object(m)
            }
        }
    }

    /// Appends an encoding of the value to `out`: two values have the same encoding
    /// only if they are equal (every variant tagged, every length written).
    pub(super) fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Attr::Null => out.push(b'n'),
            Attr::Bool(b) => out.extend_from_slice(if *b { b"t" } else { b"f" }),
            Attr::U64(n) => {
                out.push(b'u');
                out.extend_from_slice(&n.to_le_bytes());
            }
            Attr::I64(n) => {
                out.push(b'i');
                out.extend_from_slice(&n.to_le_bytes());
            }
            Attr::F64(x) => {
                out.push(b'd');
                out.extend_from_slice(&x.to_bits().to_le_bytes());
            }
            Attr::Str(s) => encode_str(b's', s, out),
            Attr::Seq(items) => {
                encode_len(b'[', items.len(), out);
                for v in items {
                    v.encode(out);
                }
            }
            Attr::Map(pairs) => {
                encode_len(b'{', pairs.len(), out);
                for (k, v) in pairs {
                    encode_str(b'k', k, out);
                    v.encode(out);
                }
            }
        }
    }
}

fn encode_len(tag: u8, len: usize, out: &mut Vec<u8>) {
    out.push(tag);
    out.extend_from_slice(&(len as u64).to_le_bytes());
}

/// A tagged, length-prefixed string (see [`Attr::encode`]).
fn encode_str(tag: u8, s: &str, out: &mut Vec<u8>) {
    encode_len(tag, s.len(), out);
    out.extend_from_slice(s.as_bytes());
}

/// Appends an encoding of an op name and its attribute object to `out` (equal
/// encodings only for the same name and the same pairs in the same order).
pub(super) fn encode_op(name: &str, attrs: &[(Str<'_>, Attr<'_>)], out: &mut Vec<u8>) {
    encode_str(b'o', name, out);
    encode_len(b'{', attrs.len(), out);
    for (k, v) in attrs {
        encode_str(b'k', k.as_str(), out);
        v.encode(out);
    }
}
