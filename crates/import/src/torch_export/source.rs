//! What the builder reads: one graph in borrowed, typed form, made by either front end
//! without copying its strings. The torch.export front end converts its schema once
//! ([`super::schema::Converted`]) and lends it; the compact FX form ([`super::fx`])
//! lends its [`FxGraph`](super::fx::FxGraph) directly.

use super::arg::Arg;
use super::fx::{FxSize, FxTensor};
use arfuse_ir::InputKind;
use serde_json::Value as Json;

/// One graph as the builder reads it.
pub(super) struct Source<'p> {
    /// The symbols' ranges, in order: name, smallest and largest value when given as
    /// an integer (a negative one as 0).
    pub ranges: Vec<(&'p str, Option<u64>, Option<u64>)>,
    /// The torch version recorded with the graph.
    pub torch_version: Option<&'p str>,
    /// The input specs that name a tensor: tensor, parameter or buffer name, kind.
    pub specs: Vec<(&'p str, Option<&'p str>, InputKind)>,
    /// The graph inputs.
    pub inputs: Vec<GraphValue<'p>>,
    /// The graph outputs.
    pub outputs: Vec<GraphValue<'p>>,
    /// Every tensor's metadata, in order (a name given twice: the later one counts).
    pub tensors: Vec<(&'p str, Meta<'p>)>,
    /// torch.export's `sym_int_values` (empty for the compact form).
    pub sym_ints: Vec<(&'p str, &'p Json)>,
    /// The nodes, in order.
    pub nodes: Vec<NodeIn<'p>>,
}

/// A graph input or output.
#[derive(Clone, Copy)]
pub(super) enum GraphValue<'p> {
    /// A tensor, by name.
    Tensor(&'p str),
    /// Anything else (its JSON, for the note).
    Other(&'p Json),
}

/// A tensor's dtype code and sizes.
#[derive(Clone, Copy)]
pub(super) struct Meta<'p> {
    pub dtype: i64,
    pub sizes: Sizes<'p>,
}

/// A tensor's sizes, as its front end wrote them.
#[derive(Clone, Copy)]
pub(super) enum Sizes<'p> {
    Fx(&'p [FxSize]),
    Schema(&'p [Json]),
}

/// One size, read.
pub(super) enum Size<'a> {
    /// A constant.
    Const(u64),
    /// An expression, by its text.
    Expr(&'a str),
    /// Not a size: why.
    Bad(String),
}

impl<'p> Sizes<'p> {
    pub fn len(&self) -> usize {
        match self {
            Sizes::Fx(l) => l.len(),
            Sizes::Schema(l) => l.len(),
        }
    }

    /// Size `i` (`i < len`).
    pub fn get(&self, i: usize) -> Size<'p> {
        match *self {
            Sizes::Fx(l) => match &l[i] {
                FxSize::Const(n) => match u64::try_from(*n) {
                    Ok(n) => Size::Const(n),
                    Err(_) => Size::Bad(format!("size {n} is not a non-negative integer")),
                },
                FxSize::Expr(e) => Size::Expr(e),
            },
            // A `SymInt`: `{"as_int": n}`, or `{"as_expr": {"expr_str": ...}}` (or the
            // text itself under `as_expr`).
            Sizes::Schema(l) => {
                let s = &l[i];
                if let Some(n) = s.get("as_int") {
                    return match n.as_u64() {
                        Some(n) => Size::Const(n),
                        None => Size::Bad(format!("size {n} is not a non-negative integer")),
                    };
                }
                match s
                    .get("as_expr")
                    .and_then(|e| e.get("expr_str").or_else(|| e.as_str().map(|_| e)))
                    .and_then(Json::as_str)
                {
                    Some(text) => Size::Expr(text),
                    None => Size::Bad(format!(
                        "size {s} is neither {{\"as_int\"}} nor {{\"as_expr\"}}"
                    )),
                }
            }
        }
    }
}

/// One node as the builder reads it.
#[derive(Clone, Copy)]
pub(super) struct NodeIn<'p> {
    /// The node's name, when it has one.
    pub name: Option<&'p str>,
    /// The target, as written (perhaps with `torch.ops.`).
    pub target: &'p str,
    /// Named arguments, in the op's order.
    pub args: &'p [(String, Arg)],
    /// Its outputs.
    pub outputs: Outputs<'p>,
    /// Where its module path comes from.
    pub module: Module<'p>,
}

/// A node's outputs.
#[derive(Clone, Copy)]
pub(super) enum Outputs<'p> {
    /// The compact form: these tensors, then this many values that are not tensors.
    Fx(&'p [FxTensor], usize),
    /// The schema's outputs, read.
    Schema(&'p SchemaOutputs),
}

/// The outputs of a schema node: its tensor names, in order, how many outputs are not
/// tensors, and whether the first output is one tensor (`as_tensor`).
#[derive(Default)]
pub(super) struct SchemaOutputs {
    pub names: Vec<String>,
    pub other: usize,
    pub first_is_tensor: bool,
}

impl<'p> Outputs<'p> {
    /// Appends the tensor names to `names`; returns how many outputs are not tensors.
    pub fn names(&self, names: &mut Vec<&'p str>) -> usize {
        match *self {
            Outputs::Fx(t, other) => {
                names.extend(t.iter().map(|t| t.name.as_str()));
                other
            }
            Outputs::Schema(o) => {
                names.extend(o.names.iter().map(String::as_str));
                o.other
            }
        }
    }

    /// The first output's tensor, when the first output is one tensor.
    pub fn first_tensor(&self) -> Option<&'p str> {
        match *self {
            Outputs::Fx(t, _) => t.first().map(|t| t.name.as_str()),
            Outputs::Schema(o) => o
                .first_is_tensor
                .then(|| o.names.first().map(String::as_str))
                .flatten(),
        }
    }
}

/// Where a node's module path comes from.
#[derive(Clone, Copy)]
pub(super) enum Module<'p> {
    /// None known.
    None,
    /// torch.export's `nn_module_stack` metadata string.
    Stack(&'p str),
    /// The innermost module path itself (the compact form).
    Path(&'p str),
}
