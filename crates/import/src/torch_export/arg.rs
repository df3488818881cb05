//! One argument of a node, typed: what both front ends hand the builder and the op
//! mapping. The torch.export front end converts each schema `Argument` (a JSON union
//! such as `{"as_tensor": {"name": "x"}}`) once ([`Arg::from_schema`]); the compact FX
//! form ([`super::fx`]) builds the same values directly ([`super::fx::FxArg`] is this
//! type).
//!
//! A schema argument becomes a typed variant only when it is exactly the union member
//! torch writes (one key, its value of the expected shape, a tensor reference exactly
//! `{"name": ...}`); anything else (a kind the importer does not model, such as
//! `as_device` or `as_custom_obj`, or a malformed member) is kept as [`Arg::Other`] with
//! its JSON and read exactly as before the arguments were typed. Each accessor below
//! answers, for a typed variant, what the same question asked of the variant's schema
//! JSON ([`Arg::schema_json`]) answers.

use serde::de::{Deserialize, Deserializer};
use serde::ser::{Serialize, SerializeStruct, Serializer};
use serde_json::{json, Value as Json};
use std::borrow::Cow;
use std::collections::HashMap;

/// A symbolic int argument (or one entry of a list of them).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
pub enum SymInt {
    /// A constant.
    Const(i64),
    /// A sympy expression over the graph's symbols, as `str(SymInt)` writes it (`s72`,
    /// `2*s72`): the compact FX form's spelling.
    Expr(String),
    /// A name of torch.export's `sym_int_values`, which holds its expression (in JSON
    /// `{"name": ...}`): the torch.export JSON's spelling.
    Name {
        /// The `sym_int_values` key.
        name: String,
    },
}

/// One argument value of a node.
///
/// In JSON (the serde form, used by [`super::fx::FxGraph`] dumps) an argument is
/// `{"kind": K, "value": V}` with `K` the variant's name in snake case (`tensor`,
/// `tensors`, `none`, `int`, `float`, `bool`, `str`, `ints`, `floats`, `bools`, `sym`,
/// `syms`, `dtype`, `other`) and a non-finite float written as its text (`inf`, `-inf`,
/// `NaN`). `tensors` holds `null` for an absent optional tensor; the variants only the
/// torch.export front end makes are `optional_tensor`, `optional_tensors` (a list of
/// optional tensors that are all present) and `json` (an [`Arg::Other`] that is not a
/// type name).
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    /// A tensor, by name.
    Tensor(String),
    /// A list of tensors.
    Tensors(Vec<String>),
    /// An optional tensor (torch.export's `as_optional_tensor`).
    OptionalTensor(Option<String>),
    /// A list of optional tensors (`None` for an absent one).
    OptionalTensors(Vec<Option<String>>),
    /// `None`.
    None,
    /// An int.
    Int(i64),
    /// A float. A non-finite one (only the compact FX form has them) reads as the
    /// string `inf`, `-inf` or `NaN`, as the schema writes it.
    Float(f64),
    /// A bool.
    Bool(bool),
    /// A string (also an op given as an argument, a device or a layout, as text).
    Str(String),
    /// A list of ints.
    Ints(Vec<i64>),
    /// A list of floats.
    Floats(Vec<f64>),
    /// A list of bools.
    Bools(Vec<bool>),
    /// A symbolic int.
    Sym(SymInt),
    /// A list of ints and symbolic ints.
    Syms(Vec<SymInt>),
    /// A dtype, as a `ScalarType` code.
    Dtype(i64),
    /// Anything else, as schema JSON: for the compact FX form an object the importer
    /// does not model, `{"as_other": TYPE_NAME}` ([`Arg::other`]).
    Other(Json),
}

/// torch.export's `sym_int_values`: name to `SymInt` JSON.
pub(super) type SymInts<'p> = HashMap<&'p str, &'p Json>;

impl Arg {
    /// A list of tensors, some perhaps absent: [`Arg::Tensors`] when every one is
    /// present, else [`Arg::OptionalTensors`].
    pub fn tensors(list: Vec<Option<String>>) -> Arg {
        if list.iter().all(Option::is_some) {
            Arg::Tensors(list.into_iter().flatten().collect())
        } else {
            Arg::OptionalTensors(list)
        }
    }

    /// An object the importer does not model, by its type name.
    pub fn other(type_name: impl Into<String>) -> Arg {
        Arg::Other(json!({ "as_other": type_name.into() }))
    }

    /// A schema `Argument` (see the module documentation).
    pub(super) fn from_schema(a: Json) -> Arg {
        match typed(&a) {
            Some(t) => t,
            None => Arg::Other(a),
        }
    }

    /// The argument in torch.export's schema form: the JSON it was read from, or for
    /// an argument of the compact FX form the JSON that stands for it.
    pub fn schema_json(&self) -> Cow<'_, Json> {
        let tensor_ref = |t: &str| json!({ "as_tensor": { "name": t } });
        let none = || json!({ "as_none": true });
        let sym = |s: &SymInt| match s {
            SymInt::Const(n) => json!({ "as_int": n }),
            SymInt::Expr(e) => json!({ "as_name": e }),
            SymInt::Name { name } => json!({ "as_name": name }),
        };
        Cow::Owned(match self {
            Arg::Tensor(t) => tensor_ref(t),
            Arg::Tensors(l) => json!({
                "as_tensors": l.iter().map(|t| json!({ "name": t })).collect::<Vec<_>>()
            }),
            Arg::OptionalTensor(t) => json!({
                "as_optional_tensor": t.as_deref().map_or_else(none, tensor_ref)
            }),
            Arg::OptionalTensors(l) => json!({
                "as_optional_tensors": l
                    .iter()
                    .map(|t| t.as_deref().map_or_else(none, tensor_ref))
                    .collect::<Vec<_>>()
            }),
            Arg::None => none(),
            Arg::Int(i) => json!({ "as_int": i }),
            Arg::Float(f) if f.is_finite() => json!({ "as_float": f }),
            Arg::Float(f) => json!({ "as_string": f.to_string() }),
            Arg::Bool(b) => json!({ "as_bool": b }),
            Arg::Str(s) => json!({ "as_string": s }),
            Arg::Ints(l) => json!({ "as_ints": l }),
            Arg::Floats(l) => json!({
                "as_floats": l.iter().map(|f| Json::from(*f)).collect::<Vec<_>>()
            }),
            Arg::Bools(l) => json!({ "as_bools": l }),
            Arg::Sym(s) => json!({ "as_sym_int": sym(s) }),
            Arg::Syms(l) => json!({ "as_sym_ints": l.iter().map(sym).collect::<Vec<_>>() }),
            Arg::Dtype(c) => json!({ "as_scalar_type": c }),
            Arg::Other(j) => return Cow::Borrowed(j),
        })
    }

    /// Calls `f` with every tensor name the argument holds, in order.
    pub(super) fn each_tensor<'a>(&'a self, f: &mut dyn FnMut(&'a str)) {
        match self {
            Arg::Tensor(t) | Arg::OptionalTensor(Some(t)) => f(t),
            Arg::Tensors(l) => l.iter().for_each(|t| f(t)),
            Arg::OptionalTensors(l) => l.iter().flatten().for_each(|t| f(t)),
            Arg::Other(j) => schema::each_tensor(j, f),
            _ => {}
        }
    }

    /// How many tensors the argument holds (its share of the node's tensor inputs).
    pub(super) fn tensor_count(&self) -> usize {
        match self {
            Arg::Tensor(_) | Arg::OptionalTensor(Some(_)) => 1,
            Arg::Tensors(l) => l.len(),
            Arg::OptionalTensors(l) => l.iter().flatten().count(),
            Arg::Other(j) => schema::tensors_in(j),
            _ => 0,
        }
    }

    /// Whether the argument is one tensor (a tensor, or a present optional tensor).
    pub(super) fn is_single_tensor(&self) -> bool {
        match self {
            Arg::Tensor(_) | Arg::OptionalTensor(Some(_)) => true,
            Arg::Other(j) => {
                j.get("as_tensor").is_some()
                    || j.get("as_optional_tensor")
                        .and_then(|o| o.get("as_tensor"))
                        .is_some()
            }
            _ => false,
        }
    }

    /// The tensor's name when the argument is a tensor (not an optional one).
    pub(super) fn tensor(&self) -> Option<&str> {
        match self {
            Arg::Tensor(t) => Some(t),
            Arg::Other(j) => schema::tensor_of(j),
            _ => None,
        }
    }

    /// Whether the argument is `None`.
    pub(super) fn is_none(&self) -> bool {
        match self {
            Arg::None => true,
            Arg::Other(j) => j.get("as_none").is_some(),
            _ => false,
        }
    }

    /// The value of an int argument.
    pub(super) fn int(&self) -> Option<i64> {
        match self {
            Arg::Int(i) => Some(*i),
            Arg::Other(j) => j.get("as_int").and_then(Json::as_i64),
            _ => None,
        }
    }

    /// An int argument as its text, whatever number it holds.
    pub(super) fn int_text(&self) -> Option<String> {
        match self {
            Arg::Int(i) => Some(i.to_string()),
            Arg::Other(j) => j.get("as_int").map(Json::to_string),
            _ => None,
        }
    }

    /// A Python number argument (an int or a finite float).
    pub(super) fn number(&self) -> Option<f64> {
        match self {
            Arg::Int(i) => Some(*i as f64),
            Arg::Float(f) if f.is_finite() => Some(*f),
            Arg::Other(j) => match j.get("as_int").and_then(Json::as_i64) {
                Some(i) => Some(i as f64),
                None => j.get("as_float").and_then(Json::as_f64),
            },
            _ => None,
        }
    }

    /// A number argument as the `f64` its JSON number is (an int argument too, whatever
    /// its size).
    pub(super) fn number_f64(&self) -> Option<f64> {
        match self {
            Arg::Other(j) => j
                .get("as_int")
                .and_then(Json::as_f64)
                .or_else(|| j.get("as_float").and_then(Json::as_f64)),
            a => a.number(),
        }
    }

    /// The value of a string argument (a non-finite float reads as its text).
    pub(super) fn string(&self) -> Option<Cow<'_, str>> {
        match self {
            Arg::Str(s) => Some(Cow::Borrowed(s)),
            Arg::Float(f) if !f.is_finite() => Some(Cow::Owned(f.to_string())),
            Arg::Other(j) => j.get("as_string").and_then(Json::as_str).map(Cow::Borrowed),
            _ => None,
        }
    }

    /// The value of a bool argument.
    pub(super) fn bool(&self) -> Option<bool> {
        match self {
            Arg::Bool(b) => Some(*b),
            Arg::Other(j) => j.get("as_bool").and_then(Json::as_bool),
            _ => None,
        }
    }

    /// The entries of a list-of-ints argument (`None` for one that is not an int).
    pub(super) fn ints(&self) -> Option<Vec<Option<i64>>> {
        match self {
            Arg::Ints(l) => Some(l.iter().copied().map(Some).collect()),
            Arg::Other(j) => Some(
                j.get("as_ints")?
                    .as_array()?
                    .iter()
                    .map(Json::as_i64)
                    .collect(),
            ),
            _ => None,
        }
    }

    /// The length of a list of ints or of symbolic ints.
    pub(super) fn int_list_len(&self) -> Option<usize> {
        match self {
            Arg::Ints(l) => Some(l.len()),
            Arg::Syms(l) => Some(l.len()),
            Arg::Other(j) => j
                .get("as_ints")
                .or_else(|| j.get("as_sym_ints"))
                .and_then(Json::as_array)
                .map(Vec::len),
            _ => None,
        }
    }

    /// The length of a list of tensors (not of optional tensors).
    pub(super) fn tensor_list_len(&self) -> Option<usize> {
        match self {
            Arg::Tensors(l) => Some(l.len()),
            Arg::Other(j) => j.get("as_tensors").and_then(Json::as_array).map(Vec::len),
            _ => None,
        }
    }

    /// The name of a script object argument (`as_custom_obj`).
    pub(super) fn custom_obj_name(&self) -> Option<&str> {
        match self {
            Arg::Other(j) => j
                .get("as_custom_obj")
                .and_then(|o| o.get("name"))
                .and_then(Json::as_str),
            _ => None,
        }
    }
}

/// The typed form of a schema argument, when it is exactly one union member of the
/// shape torch writes.
fn typed(a: &Json) -> Option<Arg> {
    let o = a.as_object()?;
    if o.len() != 1 {
        return None;
    }
    let (kind, v) = o.iter().next()?;
    let owned = |s: &str| s.to_string();
    Some(match kind.as_str() {
        "as_tensor" => Arg::Tensor(tensor_name(v)?.to_string()),
        "as_tensors" => Arg::Tensors(
            v.as_array()?
                .iter()
                .map(|t| tensor_name(t).map(owned))
                .collect::<Option<_>>()?,
        ),
        "as_optional_tensor" => Arg::OptionalTensor(optional_tensor(v)?.map(owned)),
        "as_optional_tensors" => Arg::OptionalTensors(
            v.as_array()?
                .iter()
                .map(|t| optional_tensor(t).map(|t| t.map(owned)))
                .collect::<Option<_>>()?,
        ),
        "as_none" if *v == Json::Bool(true) => Arg::None,
        "as_int" => Arg::Int(v.as_i64()?),
        "as_float" if v.is_f64() => Arg::Float(v.as_f64()?),
        "as_bool" => Arg::Bool(v.as_bool()?),
        "as_string" => Arg::Str(v.as_str()?.to_string()),
        "as_ints" => Arg::Ints(
            v.as_array()?
                .iter()
                .map(Json::as_i64)
                .collect::<Option<_>>()?,
        ),
        "as_floats" => Arg::Floats(
            v.as_array()?
                .iter()
                .map(|f| f.is_f64().then(|| f.as_f64()).flatten())
                .collect::<Option<_>>()?,
        ),
        "as_bools" => Arg::Bools(
            v.as_array()?
                .iter()
                .map(Json::as_bool)
                .collect::<Option<_>>()?,
        ),
        "as_scalar_type" => Arg::Dtype(v.as_i64()?),
        "as_sym_int" => Arg::Sym(sym_int(v)?),
        "as_sym_ints" => Arg::Syms(v.as_array()?.iter().map(sym_int).collect::<Option<_>>()?),
        _ => return None,
    })
}

/// The name of a tensor reference that is exactly `{"name": NAME}`.
fn tensor_name(t: &Json) -> Option<&str> {
    let o = t.as_object()?;
    if o.len() != 1 {
        return None;
    }
    o.get("name")?.as_str()
}

/// An optional tensor that is exactly `{"as_tensor": {"name": NAME}}` (`Some(Some)`) or
/// `{"as_none": true}` (`Some(None)`).
fn optional_tensor(t: &Json) -> Option<Option<&str>> {
    let o = t.as_object()?;
    if o.len() != 1 {
        return None;
    }
    match o.iter().next()? {
        (k, v) if k == "as_tensor" => Some(Some(tensor_name(v)?)),
        (k, v) if k == "as_none" && *v == Json::Bool(true) => Some(None),
        _ => None,
    }
}

/// A `SymIntArgument` that is exactly `{"as_int": N}` or `{"as_name": NAME}`.
fn sym_int(s: &Json) -> Option<SymInt> {
    let o = s.as_object()?;
    if o.len() != 1 {
        return None;
    }
    match o.iter().next()? {
        (k, v) if k == "as_int" => Some(SymInt::Const(v.as_i64()?)),
        (k, v) if k == "as_name" => Some(SymInt::Name {
            name: v.as_str()?.to_string(),
        }),
        _ => None,
    }
}

/// The questions of [`Arg`]'s accessors asked of schema JSON (for [`Arg::Other`]).
pub(super) mod schema {
    use serde_json::Value as Json;

    /// The tensor name of an `as_tensor` argument or output.
    pub(in crate::torch_export) fn tensor_of(a: &Json) -> Option<&str> {
        a.get("as_tensor")
            .and_then(|t| t.get("name"))
            .and_then(Json::as_str)
    }

    /// Calls `f` with every tensor name an argument holds, in order.
    pub(in crate::torch_export) fn each_tensor<'a>(a: &'a Json, f: &mut dyn FnMut(&'a str)) {
        let name_of = |t: &'a Json| t.get("name").and_then(Json::as_str);
        if let Some(t) = a.get("as_tensor") {
            if let Some(n) = name_of(t) {
                f(n);
            }
        } else if let Some(l) = a.get("as_tensors").and_then(Json::as_array) {
            for t in l {
                if let Some(n) = name_of(t) {
                    f(n);
                }
            }
        } else if let Some(t) = a.get("as_optional_tensor").and_then(|t| t.get("as_tensor")) {
            if let Some(n) = name_of(t) {
                f(n);
            }
        } else if let Some(l) = a.get("as_optional_tensors").and_then(Json::as_array) {
            for x in l {
                if let Some(n) = x.get("as_tensor").and_then(name_of) {
                    f(n);
                }
            }
        }
    }

    /// How many tensors an argument holds.
    pub(in crate::torch_export) fn tensors_in(a: &Json) -> usize {
        if a.get("as_tensor").is_some() {
            1
        } else if let Some(l) = a.get("as_tensors").and_then(Json::as_array) {
            l.len()
        } else if a
            .get("as_optional_tensor")
            .and_then(|o| o.get("as_tensor"))
            .is_some()
        {
            1
        } else if let Some(l) = a.get("as_optional_tensors").and_then(Json::as_array) {
            l.iter().filter(|x| x.get("as_tensor").is_some()).count()
        } else {
            0
        }
    }
}

// ---------------------------------------------------------------------------------
// The serde form.
// ---------------------------------------------------------------------------------

/// serde for an f64 that may be infinite or NaN: a JSON number, or its text.
mod float_text {
    use serde::{Deserialize, Deserializer, Serialize};

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

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        value(Repr::deserialize(d)?)
    }
}

/// [`float_text`] for a list.
mod floats_text {
    use super::float_text::{repr, value, Repr};
    use serde::{Deserialize, Deserializer};

    pub(super) fn serialize(l: &[f64]) -> Vec<Repr> {
        l.iter().map(|f| repr(*f)).collect()
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
        Vec::<Repr>::deserialize(d)?
            .into_iter()
            .map(value)
            .collect()
    }
}

/// What an [`Arg`] is read from.
#[derive(serde::Deserialize)]
#[serde(tag = "kind", content = "value", rename_all = "snake_case")]
enum Repr {
    Tensor(String),
    Tensors(Vec<Option<String>>),
    OptionalTensor(Option<String>),
    OptionalTensors(Vec<String>),
    None,
    Int(i64),
    Float(#[serde(deserialize_with = "float_text::deserialize")] f64),
    Bool(bool),
    Str(String),
    Ints(Vec<i64>),
    Floats(#[serde(deserialize_with = "floats_text::deserialize")] Vec<f64>),
    Bools(Vec<bool>),
    Sym(SymInt),
    Syms(Vec<SymInt>),
    Dtype(i64),
    Other(String),
    Json(Json),
}

impl<'de> Deserialize<'de> for Arg {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Arg, D::Error> {
        Ok(match Repr::deserialize(d)? {
            Repr::Tensor(t) => Arg::Tensor(t),
            Repr::Tensors(l) => Arg::tensors(l),
            Repr::OptionalTensor(t) => Arg::OptionalTensor(t),
            Repr::OptionalTensors(l) => Arg::OptionalTensors(l.into_iter().map(Some).collect()),
            Repr::None => Arg::None,
            Repr::Int(i) => Arg::Int(i),
            Repr::Float(f) => Arg::Float(f),
            Repr::Bool(b) => Arg::Bool(b),
            Repr::Str(s) => Arg::Str(s),
            Repr::Ints(l) => Arg::Ints(l),
            Repr::Floats(l) => Arg::Floats(l),
            Repr::Bools(l) => Arg::Bools(l),
            Repr::Sym(s) => Arg::Sym(s),
            Repr::Syms(l) => Arg::Syms(l),
            Repr::Dtype(c) => Arg::Dtype(c),
            Repr::Other(name) => Arg::other(name),
            Repr::Json(j) => Arg::Other(j),
        })
    }
}

/// An [`Arg::Other`] that [`Arg::other`] made: its type name.
fn other_type_name(j: &Json) -> Option<&str> {
    let o = j.as_object()?;
    if o.len() != 1 {
        return None;
    }
    o.get("as_other")?.as_str()
}

impl Serialize for Arg {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        fn tagged<S: Serializer, T: Serialize + ?Sized>(
            s: S,
            kind: &'static str,
            value: &T,
        ) -> Result<S::Ok, S::Error> {
            let mut st = s.serialize_struct("Arg", 2)?;
            st.serialize_field("kind", kind)?;
            st.serialize_field("value", value)?;
            st.end()
        }
        match self {
            Arg::Tensor(t) => tagged(s, "tensor", t),
            Arg::Tensors(l) => tagged(s, "tensors", l),
            Arg::OptionalTensor(t) => tagged(s, "optional_tensor", t),
            Arg::OptionalTensors(l) if l.iter().all(Option::is_some) => {
                tagged(s, "optional_tensors", l)
            }
            Arg::OptionalTensors(l) => tagged(s, "tensors", l),
            Arg::None => {
                let mut st = s.serialize_struct("Arg", 1)?;
                st.serialize_field("kind", "none")?;
                st.end()
            }
            Arg::Int(i) => tagged(s, "int", i),
            Arg::Float(f) => tagged(s, "float", &float_text::repr(*f)),
            Arg::Bool(b) => tagged(s, "bool", b),
            Arg::Str(t) => tagged(s, "str", t),
            Arg::Ints(l) => tagged(s, "ints", l),
            Arg::Floats(l) => tagged(s, "floats", &floats_text::serialize(l)),
            Arg::Bools(l) => tagged(s, "bools", l),
            Arg::Sym(x) => tagged(s, "sym", x),
            Arg::Syms(l) => tagged(s, "syms", l),
            Arg::Dtype(c) => tagged(s, "dtype", c),
            Arg::Other(j) => match other_type_name(j) {
                Some(name) => tagged(s, "other", name),
                None => tagged(s, "json", j),
            },
        }
    }
}
