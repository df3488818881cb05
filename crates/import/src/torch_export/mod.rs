//! The torch.export front end: serialized `ExportedProgram` JSON (schema major version
//! [`SUPPORTED_SCHEMA_MAJOR`]), bare or in a `.pt2` archive, to an arfuse [`Graph`].
//!
//! What becomes what (the full table is in `docs/torch-export.md`):
//!
//! - Graph inputs become `input` nodes: parameters `parameter`, buffers and lifted
//!   tensor constants `buffer`, user inputs `activation`. Their id is the torch tensor
//!   name; a parameter's or buffer's `module` is its owning module.
//! - Each node becomes the IR op it maps to (the table is in `docs/torch-export.md`), or
//!   `opaque` with its target (without the `torch.ops.` prefix), every argument in
//!   `attrs` (a tensor argument as `{"input": k}`, its position among the node's
//!   inputs) and outputs typed from `tensor_values`. A mapped node that the IR's type
//!   rules would reject is kept opaque instead, with a note.
//! - `_c10d_functional.all_reduce` becomes `all_reduce` (group = the group name); the
//!   `wait_tensor` after it, `contiguous`, `clone`, same-dtype casts and same-shape
//!   views are identities: their users read the input directly (counted in notes).
//! - Runtime checks (`_assert_tensor_metadata`, `_assert_scalar`, `sym_constrain_range`,
//!   ...) are dropped (counted in notes), so they are never users that block a fusion.
//! - Nodes that only compute symbolic integers (`sym_size`, `operator.mul` on sizes)
//!   have no IR counterpart; sizes come from the tensor metadata.
//! - Node ids are the torch node names with `:` and whitespace replaced by `_`.
//! - `module` is the innermost `nn_module_stack` entry, without the wrapper the exporter
//!   put around the model: when every parameter and buffer name starts with the same
//!   first segment (and has at least two more), that segment is removed, so
//!   `m.model.layers.1.mlp` becomes `model.layers.1.mlp` when every parameter starts
//!   with `m.`, and a model exported directly keeps its paths as they are. A first
//!   segment followed by a list index (`layers.0.`) is never removed. The removed
//!   prefix is kept in the graph metadata (`module_prefix_removed`).
//! - Symbolic sizes: each torch symbol (`s70`) becomes an IR symbol with the range of
//!   `range_constraints`; a size expression that is a monomial (`4*s70`) becomes that
//!   dimension; any other expression becomes a fresh symbol `x<k>` whose range comes
//!   from interval arithmetic over the symbols' ranges (noted), or an error when no
//!   range can be derived.
//! - Dtypes follow the schema's `ScalarType` codes: 1 u8, 4 i32, 5 i64, 6 f16, 7 f32,
//!   13 bf16, 29 fp8_e4m3, 33 ue8m0; 12 (bool) is typed `u8` and flows only through
//!   opaque ops; any other code is an error naming the tensor.

mod archive;
mod arg;
pub mod fx;
mod ops;
mod schema;
mod source;
pub mod symbolic;

pub use archive::MAX_ARCHIVE_MEMBERS;
pub use ops::ARFUSE_QUANT_FP8_PER_TOKEN;

use crate::{check_size, Format, ImportError, ImportOptions, Imported};
use arfuse_ir::{
    looks_like_collective, DType, Dim, Graph, InputKind, Node, NodeId, Op, SymbolRange, TensorType,
    Value, MAX_ID_LEN, MAX_PORTS,
};
use arg::{Arg, SymInt, SymInts};
use schema::{Converted, Header, Program};
use serde_json::{json, Value as Json};
use source::{GraphValue, Meta, Module, NodeIn, Size, Source};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};

/// The schema major version this importer reads (torch 2.5 and later write 8.x).
pub const SUPPORTED_SCHEMA_MAJOR: u64 = 8;
/// Most nodes of one exported graph. An IR node count stays below
/// [`arfuse_ir::MAX_NODES`]: a torch node becomes at most three IR nodes.
pub const MAX_TORCH_NODES: usize = 150_000;
/// Most entries of `tensor_values`, `sym_int_values` and `range_constraints`.
pub const MAX_TENSOR_VALUES: usize = 400_000;
/// Most individual notes kept (counted findings are always one line each).
pub const MAX_NOTES: usize = 200;
/// The upper bound given to a symbol whose range has no finite maximum (or one above
/// this), so that byte counts stay finite; noted when used. The IR's limit
/// ([`arfuse_ir::MAX_SYMBOL_VALUE`]).
pub const UNBOUNDED_SYMBOL_MAX: u64 = arfuse_ir::MAX_SYMBOL_VALUE;

/// Targets that are runtime checks: dropped, never users.
pub const CHECK_TARGETS: &[&str] = &[
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten._assert_async.default",
    "aten._assert_async.msg",
    "aten._functional_assert_async.msg",
    "aten._functional_assert_scalar.default",
    "aten.sym_constrain_range.default",
    "aten.sym_constrain_range_for_size.default",
    "aten._functional_sym_constrain_range.default",
    "aten._functional_sym_constrain_range_for_size.default",
];

/// Imports a torch.export ExportedProgram with [`ImportOptions::default`].
///
/// Errors: see [`import_with`].
pub fn import(bytes: &[u8]) -> Result<Imported, ImportError> {
    import_with(bytes, &ImportOptions::default())
}

/// Imports a torch.export ExportedProgram (or a post-grad FX graph in the same schema,
/// `docs/fx-graph-format.md`): the bare JSON, or a `.pt2` zip archive holding it (which
/// archive member is read: `docs/torch-export.md`).
///
/// Errors: size limits, [`ImportError::Archive`], [`ImportError::Json`] (a truncated
/// file), [`ImportError::SchemaVersion`] for a major version other than
/// [`SUPPORTED_SCHEMA_MAJOR`], [`ImportError::Malformed`], [`ImportError::MissingTensor`]
/// for a node naming a tensor nothing produced, [`ImportError::UnsupportedDtype`],
/// [`ImportError::Dimension`], and [`ImportError::Invalid`] if the result does not
/// validate.
pub fn import_with(bytes: &[u8], options: &ImportOptions) -> Result<Imported, ImportError> {
    check_size("the file", bytes.len())?;
    let from_archive;
    let json_bytes: &[u8] = if crate::detect(bytes) == Format::TorchExportPt2 {
        from_archive = archive::read_program(bytes)?;
        &from_archive
    } else {
        bytes
    };
    let text = std::str::from_utf8(json_bytes).map_err(|e| ImportError::Utf8 {
        offset: e.valid_up_to(),
    })?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let header: Header = serde_json::from_str(text).map_err(ImportError::json)?;
    let version = check_version(header.schema_version.as_ref())?;
    let program: Program = serde_json::from_str(text).map_err(ImportError::json)?;
    let converted = Converted::new(program);
    let source = converted.source();
    Builder::new(&source, version, options)?.build()
}

fn check_version(v: Option<&Json>) -> Result<String, ImportError> {
    let err = |found: String| ImportError::SchemaVersion {
        found,
        supported: SUPPORTED_SCHEMA_MAJOR,
    };
    let Some(v) = v else {
        return Err(err("<missing>".into()));
    };
    let major = v.get("major").and_then(Json::as_u64);
    let minor = v.get("minor").and_then(Json::as_u64);
    match (major, minor) {
        (Some(SUPPORTED_SCHEMA_MAJOR), minor) => Ok(format!(
            "{SUPPORTED_SCHEMA_MAJOR}.{}",
            minor.map(|m| m.to_string()).unwrap_or_else(|| "?".into())
        )),
        (Some(m), minor) => Err(err(format!(
            "{m}.{}",
            minor.map(|m| m.to_string()).unwrap_or_else(|| "?".into())
        ))),
        (None, _) => Err(err(v.to_string())),
    }
}

/// A torch tensor already in the graph.
#[derive(Clone, Copy)]
struct Bound {
    value: Value,
    is_bool: bool,
}

/// A planned node input: an existing value or output 0 of an earlier planned node.
#[derive(Clone, Copy, Debug)]
enum PIn {
    Ext(Value),
    Local(usize),
}

/// A planned IR node (one torch node lowers to one to three of them).
#[derive(Debug)]
struct PNode {
    /// Appended to the torch name for helper nodes; `None` for the node that produces
    /// the torch node's outputs (always the last).
    suffix: Option<&'static str>,
    op: Op,
    inputs: Vec<PIn>,
    outputs: Vec<TensorType>,
}

/// How one torch node lowers.
enum Lowering {
    /// Its single output is this existing value (an identity).
    Forward(Value),
    /// These nodes; the last one's outputs are the torch node's tensor outputs.
    Nodes(Vec<PNode>),
}

/// Counted and individual findings, rendered into [`Imported::notes`].
#[derive(Default)]
struct Notes {
    /// Counts by kind (`order`) and line.
    counts: BTreeMap<u8, BTreeMap<String, usize>>,
    lines: Vec<String>,
    omitted: usize,
}

impl Notes {
    fn count(&mut self, order: u8, line: &str) {
        let lines = self.counts.entry(order).or_default();
        match lines.get_mut(line) {
            Some(n) => *n += 1,
            None => {
                lines.insert(line.to_string(), 1);
            }
        }
    }

    fn line(&mut self, l: String) {
        if self.lines.len() < MAX_NOTES {
            self.lines.push(l);
        } else {
            self.omitted += 1;
        }
    }

    fn render(self) -> Vec<String> {
        let mut out: Vec<String> = self
            .counts
            .into_iter()
            .flat_map(|(order, lines)| lines.into_iter().map(move |(what, n)| (order, what, n)))
            .map(|(order, what, n)| match order {
                0 => format!("dropped {n} {what} check(s)"),
                1 => format!("forwarded {n} {what} (identity: users read its input)"),
                2 => format!("skipped {n} {what} node(s) computing symbolic sizes only"),
                3 => format!("typed {n} bool tensor(s) as u8 (only opaque ops use them)"),
                5 => format!("warning: {what} ({n} node(s))"),
                6 => format!("typed {n} {what}"),
                _ => format!("kept {n} {what}"),
            })
            .collect();
        out.extend(self.lines);
        if self.omitted > 0 {
            out.push(format!("... and {} more note(s)", self.omitted));
        }
        out
    }
}

struct Builder<'p> {
    src: &'p Source<'p>,
    g: Graph,
    meta: HashMap<&'p str, Meta<'p>>,
    sym_ints: SymInts<'p>,
    /// The value each tensor name reads as now (rebound by in-place ops).
    tensors: HashMap<&'p str, Bound>,
    /// The value each tensor name was bound to when produced, in order.
    produced: Vec<(&'p str, Value)>,
    dropped: HashSet<&'p str>,
    fresh: HashMap<String, String>,
    /// The dimension each size expression text became (only successes: reading the
    /// same text again gives the same dimension and adds no symbol or note).
    dims: HashMap<&'p str, Dim>,
    prefix: Vec<String>,
    notes: Notes,
    opts: &'p ImportOptions,
    folds: Folds<'p>,
    scratch: Scratch,
    /// A tensor whose dtype or sizes cannot be read is typed as an opaque-only `u8`
    /// scalar (noted) instead of failing the import: the FX front end ([`fx`]).
    lenient_types: bool,
}

/// `sum` + division pairs that become one `mean` ([`ops::sum_divisor`]): the sums (node
/// indices) and, for each division, the sum output it forwards.
#[derive(Default)]
struct Folds<'p> {
    sums: HashSet<usize>,
    divisions: HashMap<usize, &'p str>,
}

/// The graph [`Builder::check`] type-checks planned nodes in: every lowering checked
/// so far (validation of a node reads only its inputs' types and the symbols), and one
/// input node per value of the real graph they read. Started over when it grows large.
#[derive(Default)]
struct Scratch {
    g: Graph,
    /// The input node standing for each value of the real graph.
    inputs: HashMap<Value, Value>,
}

impl Scratch {
    /// Nodes the scratch graph may hold before it is started over.
    const MAX_NODES: usize = 1 << 16;
}

/// `prefix` and the decimal digits of `n` (`n12`), without the formatting machinery.
fn numbered(prefix: char, mut n: usize) -> String {
    let mut digits = [0u8; 20];
    let mut k = digits.len();
    loop {
        k -= 1;
        digits[k] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut s = String::with_capacity(1 + digits.len() - k);
    s.push(prefix);
    s.extend(digits[k..].iter().map(|&d| d as char));
    s
}

/// A failed validation as a note's reason: its first problem.
fn first_problem(p: arfuse_ir::Problems) -> String {
    p.list
        .first()
        .map(|x| format!("{}: {}", x.kind, x.message))
        .unwrap_or_default()
}

/// Location text for a node: `nodes[12] (linear_3)`.
fn node_loc(i: usize, n: &NodeIn<'_>) -> String {
    match n.name {
        Some(name) => format!("node {name:?} (graph.nodes[{i}], {})", n.target),
        None => format!("graph.nodes[{i}] ({})", n.target),
    }
}

/// The target without the `torch.ops.` prefix (`aten.add.Tensor`).
pub fn short_target(target: &str) -> &str {
    target.strip_prefix("torch.ops.").unwrap_or(target)
}

/// A valid IR id from a torch name: `:`, whitespace and control characters become
/// `_`, the length is capped, and an empty name becomes `node`.
pub fn sanitize_id(name: &str) -> String {
    let cap = MAX_ID_LEN - 16;
    // Nearly every name: ASCII, short, nothing to replace.
    if !name.is_empty()
        && name.len() <= cap
        && name.bytes().all(|b| b > b' ' && b < 0x7f && b != b':')
    {
        return name.to_string();
    }
    let mut s: String = name
        .chars()
        .map(|c| {
            if c == ':' || c.is_whitespace() || c.is_control() {
                '_'
            } else {
                c
            }
        })
        .collect();
    if s.len() > cap {
        let mut cut = cap;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
    if s.is_empty() {
        s.push_str("node");
    }
    s
}

/// The innermost module path of an `nn_module_stack` string
/// (`key,path,type;key,path,type;...`), or `None` when it has none.
pub fn innermost_module(stack: &str) -> Option<&str> {
    let last = stack.rsplit(';').next()?;
    let first = last.find(',')?;
    let rest = &last[first + 1..];
    let path = match rest.rfind(',') {
        Some(p) => &rest[..p],
        None => rest,
    };
    let path = path.trim();
    (!path.is_empty()).then_some(path)
}

/// The dtype of a schema `ScalarType` code: `Ok((dtype, is_bool))`, or the code's
/// name when arfuse has no such dtype.
pub fn scalar_type(code: i64) -> Result<(DType, bool), String> {
    Ok(match code {
        1 => (DType::U8, false),
        4 => (DType::I32, false),
        5 => (DType::I64, false),
        6 => (DType::F16, false),
        7 => (DType::F32, false),
        12 => (DType::U8, true),
        13 => (DType::Bf16, false),
        29 => (DType::Fp8E4m3, false),
        33 => (DType::Ue8m0, false),
        _ => {
            let name = match code {
                0 => "UNKNOWN",
                2 => "CHAR (int8)",
                3 => "SHORT (int16)",
                8 => "DOUBLE (float64)",
                9 => "COMPLEXHALF",
                10 => "COMPLEXFLOAT",
                11 => "COMPLEXDOUBLE",
                28 => "UINT16",
                30 => "FLOAT8E5M2",
                31 => "FLOAT8E4M3FNUZ",
                32 => "FLOAT8E5M2FNUZ",
                34 => "UINT32",
                35 => "UINT64",
                _ => "an unknown code",
            };
            return Err(format!("{name} ({code})"));
        }
    })
}

/// The name a `ScalarType` code is written with in attrs (`bf16`, `bool`, `f64`).
pub fn scalar_type_name(code: i64) -> String {
    match code {
        12 => "bool".into(),
        2 => "i8".into(),
        3 => "i16".into(),
        8 => "f64".into(),
        _ => match scalar_type(code) {
            Ok((d, _)) => d.name().into(),
            Err(_) => format!("scalar_type_{code}"),
        },
    }
}

impl<'p> Builder<'p> {
    fn new(
        src: &'p Source<'p>,
        version: String,
        opts: &'p ImportOptions,
    ) -> Result<Builder<'p>, ImportError> {
        let mut g = Graph::new();
        let mut notes = Notes::default();
        for &(name, min, max) in &src.ranges {
            if !arfuse_ir::is_symbol_name(name) {
                notes.line(format!(
                    "range constraint {name:?} is not a valid symbol name; ignored"
                ));
                continue;
            }
            let min = min.unwrap_or(0);
            let max = match max {
                Some(m) if m <= UNBOUNDED_SYMBOL_MAX => m,
                _ => {
                    notes.line(format!(
                        "symbol {name} has no finite maximum at most {UNBOUNDED_SYMBOL_MAX}; imported with max {UNBOUNDED_SYMBOL_MAX}"
                    ));
                    UNBOUNDED_SYMBOL_MAX
                }
            };
            if min > max {
                return Err(ImportError::malformed(
                    format!("range_constraints.{name}"),
                    format!("empty range {min}..={max}"),
                ));
            }
            g.set_symbol(name, SymbolRange { min, max });
        }
        let mut meta = HashMap::with_capacity(src.tensors.len());
        for &(k, v) in &src.tensors {
            meta.insert(k, v);
        }
        let sym_ints = src.sym_ints.iter().copied().collect();
        // The wrapper prefix: the first segment, when every parameter and buffer name
        // has more than one segment and starts with it, and what follows it is not a
        // list index (`layers.0...` keeps its `layers`).
        let names: Vec<Vec<&str>> = src
            .specs
            .iter()
            .filter_map(|(_, fqn, _)| fqn.map(|f| f.split('.').collect()))
            .collect();
        let mut prefix: Vec<String> = Vec::new();
        if let Some(first) = names.first() {
            let shared = names.iter().all(|n| {
                n.len() > 2 && n[0] == first[0] && !n[1].bytes().all(|b| b.is_ascii_digit())
            });
            if shared {
                prefix.push(first[0].to_string());
            }
        }
        let mut md = json!({
            "source": "torch.export",
            "schema_version": version,
        });
        if let Some(tv) = src.torch_version {
            md["torch_version"] = Json::String(tv.to_string());
        }
        md["module_prefix_removed"] = Json::String(prefix.join("."));
        g.set_metadata(Some(md));
        Ok(Builder {
            src,
            g,
            meta,
            sym_ints,
            tensors: HashMap::with_capacity(src.tensors.len()),
            produced: Vec::with_capacity(src.tensors.len()),
            dropped: HashSet::new(),
            fresh: HashMap::new(),
            dims: HashMap::new(),
            prefix,
            notes,
            opts,
            folds: Folds::default(),
            scratch: Scratch::default(),
            lenient_types: false,
        })
    }

    /// Finds every `aten.sum.dim_IntList` whose only reader (checks aside) is an
    /// `aten.div.Tensor` by the number of summed elements ([`ops::sum_divisor`]).
    fn find_folds(&self) -> Folds<'p> {
        let nodes = &self.src.nodes;
        let is_sum = |n: &NodeIn<'_>| short_target(n.target) == "aten.sum.dim_IntList";
        // Only the readers of sum outputs matter.
        let mut readers: HashMap<&str, Vec<usize>> = nodes
            .iter()
            .filter(|n| is_sum(n))
            .filter_map(|n| n.outputs.first_tensor())
            .filter(|t| self.meta.contains_key(t))
            .map(|t| (t, Vec::new()))
            .collect();
        let mut folds = Folds::default();
        if readers.is_empty() {
            return folds;
        }
        for (i, n) in nodes.iter().enumerate() {
            if CHECK_TARGETS.contains(&short_target(n.target)) {
                continue;
            }
            for (_, a) in n.args {
                a.each_tensor(&mut |t| {
                    if let Some(r) = readers.get_mut(t) {
                        r.push(i);
                    }
                });
            }
        }
        for (i, n) in nodes.iter().enumerate() {
            if !is_sum(n) {
                continue;
            }
            let (Some(x), Some(out)) = (
                arg(n.args, "self").and_then(Arg::tensor),
                n.outputs.first_tensor(),
            ) else {
                continue;
            };
            let [d] = readers.get(out).map(Vec::as_slice).unwrap_or_default() else {
                continue;
            };
            let div = &nodes[*d];
            let divisor = arg(div.args, "other").and_then(Arg::number_f64);
            if short_target(div.target) != "aten.div.Tensor"
                || arg(div.args, "self").and_then(Arg::tensor) != Some(out)
                || !is_absent(arg(div.args, "rounding_mode"))
            {
                continue;
            }
            let types = self.plain_type(x).zip(self.plain_type(out));
            let Some(count) = types.and_then(|(tx, to)| ops::sum_divisor(n.args, &tx, &to)) else {
                continue;
            };
            if divisor == Some(count as f64) {
                folds.sums.insert(i);
                folds.divisions.insert(*d, out);
            }
        }
        folds
    }

    /// The type of a tensor from its metadata alone (no symbols created, no notes),
    /// when its sizes are constants or plain symbols.
    fn plain_type(&self, tensor: &str) -> Option<TensorType> {
        let m = self.meta.get(tensor)?;
        let (dtype, is_bool) = scalar_type(m.dtype).ok()?;
        if is_bool {
            return None;
        }
        let dims = (0..m.sizes.len())
            .map(|i| match m.sizes.get(i) {
                Size::Const(n) => Dim::constant(n),
                _ => Dim::symbol("_"),
            })
            .collect();
        Some(TensorType::new(dtype, dims))
    }

    /// A module path with the wrapper prefix removed (`None` when nothing is left).
    fn strip_module(&self, path: &str) -> Option<String> {
        let rest = match self.prefix.as_slice() {
            [] => path,
            // `path` split at dots, less the prefix's segment when it is the first.
            [p] => match path.strip_prefix(p.as_str()) {
                Some("") => return None,
                Some(r) => r.strip_prefix('.').unwrap_or(path),
                None => path,
            },
            _ => {
                let segs: Vec<&str> = path.split('.').collect();
                let k = self.prefix.len();
                let rest: &[&str] =
                    if segs.len() >= k && segs[..k].iter().zip(&self.prefix).all(|(a, b)| a == b) {
                        &segs[k..]
                    } else {
                        &segs[..]
                    };
                return (!rest.is_empty()).then(|| rest.join("."));
            }
        };
        Some(rest.to_string())
    }

    fn unique_id(&self, base: &str) -> String {
        let base = sanitize_id(base);
        if self.g.find(&base).is_none() {
            return base;
        }
        (1..)
            .map(|k| format!("{base}_{k}"))
            .find(|id| self.g.find(id).is_none())
            .unwrap_or(base)
    }

    /// The IR type of a tensor from its metadata, and whether only opaque ops may read
    /// it (a bool, or, with `lenient_types`, a tensor arfuse cannot type: then a `u8`
    /// scalar, noted). `user` names the node for an error.
    fn tensor_type(
        &mut self,
        tensor: &'p str,
        user: &dyn Fn() -> String,
    ) -> Result<(TensorType, bool), ImportError> {
        match self.strict_tensor_type(tensor, user) {
            Err(e @ (ImportError::UnsupportedDtype { .. } | ImportError::Dimension { .. }))
                if self.lenient_types =>
            {
                let why = match e {
                    ImportError::UnsupportedDtype { dtype, .. } => format!("dtype {dtype}"),
                    _ => "sizes arfuse cannot read".to_string(),
                };
                self.notes.count(
                    6,
                    &format!("tensor(s) with {why} (typed as opaque u8 scalars, read only by opaque ops)"),
                );
                Ok((TensorType::new(DType::U8, vec![]), true))
            }
            other => other,
        }
    }

    fn strict_tensor_type(
        &mut self,
        tensor: &'p str,
        user: &dyn Fn() -> String,
    ) -> Result<(TensorType, bool), ImportError> {
        let m = *self
            .meta
            .get(tensor)
            .ok_or_else(|| ImportError::MissingMetadata {
                node: user(),
                tensor: tensor.to_string(),
            })?;
        let (dtype, is_bool) =
            scalar_type(m.dtype).map_err(|dtype| ImportError::UnsupportedDtype {
                tensor: tensor.to_string(),
                dtype,
            })?;
        let rank = m.sizes.len();
        if rank > arfuse_ir::MAX_RANK {
            return Err(ImportError::Dimension {
                tensor: tensor.to_string(),
                dim: rank - 1,
                message: format!(
                    "rank {} is above arfuse's limit of {}",
                    rank,
                    arfuse_ir::MAX_RANK
                ),
            });
        }
        let mut dims = Vec::with_capacity(rank);
        for i in 0..rank {
            let d = self
                .sym_dim(m.sizes.get(i))
                .map_err(|message| ImportError::Dimension {
                    tensor: tensor.to_string(),
                    dim: i,
                    message,
                })?;
            dims.push(d);
        }
        if is_bool {
            self.notes.count(3, "");
        }
        Ok((TensorType::new(dtype, dims), is_bool))
    }

    /// A size as a dimension.
    fn sym_dim(&mut self, s: Size<'p>) -> Result<Dim, String> {
        let text = match s {
            Size::Const(n) => return Ok(Dim::constant(n)),
            Size::Bad(why) => return Err(why),
            Size::Expr(text) => text,
        };
        if let Some(d) = self.dims.get(text) {
            return Ok(d.clone());
        }
        let d = self.expr_dim(text)?;
        self.dims.insert(text, d.clone());
        Ok(d)
    }

    /// A size expression as a dimension: a monomial as itself (its symbols declared,
    /// noted, when they have no range), anything else as a fresh symbol.
    fn expr_dim(&mut self, text: &str) -> Result<Dim, String> {
        let expr = symbolic::parse(text)
            .map_err(|e| format!("cannot parse size expression {text:?}: {e}"))?;
        if let Some(d) = symbolic::as_monomial(&expr) {
            for sym in d.symbols() {
                if !self.g.symbols().contains_key(sym) {
                    self.g.set_symbol(
                        sym.clone(),
                        SymbolRange {
                            min: 0,
                            max: UNBOUNDED_SYMBOL_MAX,
                        },
                    );
                    self.notes.line(format!(
                        "symbol {sym} has no range constraint; imported with range 0..={UNBOUNDED_SYMBOL_MAX}"
                    ));
                }
            }
            return Ok(d);
        }
        let key = symbolic::render(&expr);
        if let Some(name) = self.fresh.get(&key) {
            return Ok(Dim::symbol(name.clone()));
        }
        let (lo, hi) = symbolic::bounds(&expr, self.g.symbols()).ok_or_else(|| {
            format!(
                "size expression {key} is not a product of symbols and constants, and no range can be derived for it"
            )
        })?;
        let min = lo.clamp(0, UNBOUNDED_SYMBOL_MAX as i128) as u64;
        let max = hi.clamp(0, UNBOUNDED_SYMBOL_MAX as i128) as u64;
        let name = (0..)
            .map(|k| format!("x{k}"))
            .find(|n| !self.g.symbols().contains_key(n))
            .unwrap_or_else(|| "x".into());
        self.g.set_symbol(
            name.clone(),
            SymbolRange {
                min,
                max: max.max(min),
            },
        );
        self.notes.line(format!(
            "size expression {key} is not a monomial; imported as fresh symbol {name} in {min}..={}",
            max.max(min)
        ));
        self.fresh.insert(key, name.clone());
        Ok(Dim::symbol(name))
    }

    fn build(mut self) -> Result<Imported, ImportError> {
        let src = self.src;
        // Room for every input and one IR node per torch node (most are one), and for
        // an edge per tensor argument; as much again in the scratch graph of `check`.
        let nodes = src.inputs.len() + src.nodes.len();
        let edges: usize = src
            .nodes
            .iter()
            .flat_map(|n| n.args)
            .map(|(_, a)| a.tensor_count())
            .sum();
        self.g.reserve(nodes, edges);
        self.scratch.g.reserve(
            (2 * src.nodes.len()).min(Scratch::MAX_NODES),
            edges.min(Scratch::MAX_NODES),
        );
        let mut kinds: HashMap<&str, (InputKind, Option<&str>)> = HashMap::new();
        for &(name, fqn, kind) in &src.specs {
            kinds.insert(name, (kind, fqn));
        }
        for (i, a) in src.inputs.iter().enumerate() {
            let Some(name) = self.graph_tensor_name(a, "input", i) else {
                continue;
            };
            let (ty, is_bool) = self.tensor_type(name, &|| format!("graph input {name:?}"))?;
            let (kind, fqn) = kinds
                .get(name)
                .copied()
                .unwrap_or((InputKind::Activation, None));
            let module = fqn.and_then(|f| {
                let (owner, _) = f.rsplit_once('.')?;
                self.strip_module(owner)
            });
            if self.tensors.contains_key(name) {
                return Err(ImportError::malformed(
                    format!("graph.inputs[{i}]"),
                    format!("tensor {name:?} is listed twice"),
                ));
            }
            let id = self.unique_id(name);
            let n = self.g.add_node(Node {
                id,
                op: Op::Input { kind },
                inputs: vec![],
                outputs: vec![ty],
                module,
            })?;
            self.tensors.insert(
                name,
                Bound {
                    value: Value::new(n, 0),
                    is_bool,
                },
            );
            self.produced.push((name, Value::new(n, 0)));
        }
        self.folds = self.find_folds();
        let mut out_names = Vec::new();
        for (i, node) in src.nodes.iter().enumerate() {
            self.node(i, node, &mut out_names)?;
        }
        let mut outputs = Vec::new();
        for (i, a) in src.outputs.iter().enumerate() {
            let Some(name) = self.graph_tensor_name(a, "output", i) else {
                continue;
            };
            let b = self
                .tensors
                .get(name)
                .ok_or_else(|| ImportError::MissingTensor {
                    node: format!("graph output {i}"),
                    tensor: name.to_string(),
                })?;
            outputs.push(b.value);
        }
        self.g.set_outputs(outputs)?;
        self.g.validate().map_err(ImportError::Invalid)?;
        let mut imported = Imported::from_graph(self.g, self.notes.render());
        // A name bound twice (by one node listing it twice) keeps its later value.
        let mut produced = self.produced;
        produced.sort_by(|a, b| a.0.cmp(b.0));
        let mut tensors: Vec<(String, Value)> = Vec::with_capacity(produced.len());
        for (k, v) in produced {
            match tensors.last_mut() {
                Some(last) if last.0 == k => last.1 = v,
                _ => tensors.push((k.to_string(), v)),
            }
        }
        imported.tensors = tensors.into_iter().collect();
        Ok(imported)
    }

    /// The tensor name of a graph input or output, or `None` (with a note) when it is
    /// not a tensor.
    fn graph_tensor_name(&mut self, a: &GraphValue<'p>, what: &str, i: usize) -> Option<&'p str> {
        match *a {
            GraphValue::Tensor(name) => Some(name),
            GraphValue::Other(j) => {
                self.notes.line(format!(
                    "graph {what} {i} is not a tensor ({}); not imported",
                    truncate(&j.to_string(), 80)
                ));
                None
            }
        }
    }

    /// Imports one torch node: resolves its tensors, plans its lowering, adds the IR
    /// nodes and binds its outputs (and, for an in-place op, the tensor it mutates).
    /// `out_names` is scratch space.
    fn node(
        &mut self,
        i: usize,
        n: &NodeIn<'p>,
        out_names: &mut Vec<&'p str>,
    ) -> Result<(), ImportError> {
        let target = short_target(n.target);
        let loc = || node_loc(i, n);
        // Output tensor names, in order.
        out_names.clear();
        let other_outputs = n.outputs.names(out_names);
        if CHECK_TARGETS.contains(&target) {
            self.notes.count(0, target);
            self.dropped.extend(out_names.iter().copied());
            return Ok(());
        }
        if out_names.is_empty() && other_outputs > 0 && !looks_like_collective(target) {
            self.notes.count(2, target);
            return Ok(());
        }
        let ins = self.node_inputs(n, &loc)?;
        let mut outs = Vec::with_capacity(out_names.len());
        for &t in out_names.iter() {
            if self.tensors.contains_key(t) || self.dropped.contains(t) {
                return Err(ImportError::malformed(
                    loc(),
                    format!("tensor {t:?} is produced twice"),
                ));
            }
            outs.push(self.tensor_type(t, &loc)?);
        }
        let lowering = self.plan_node(i, target, n, &ins, &outs);
        let made = self.apply(i, n, target, lowering, out_names, &outs)?;
        self.rebind_mutated(target, n, &made);
        Ok(())
    }

    /// The tensor arguments of `n`, resolved, in argument order.
    fn node_inputs(
        &self,
        n: &NodeIn<'p>,
        loc: &dyn Fn() -> String,
    ) -> Result<Vec<Bound>, ImportError> {
        let mut ins: Vec<Bound> = Vec::new();
        let mut missing = None;
        for (_, a) in n.args {
            a.each_tensor(&mut |t| {
                if missing.is_some() {
                    return;
                }
                match self.tensors.get(t) {
                    Some(b) => ins.push(*b),
                    None => missing = Some(t),
                }
            });
        }
        match missing {
            None => Ok(ins),
            Some(t) if self.dropped.contains(t) => Err(ImportError::MissingTensor {
                node: loc(),
                tensor: format!("{t} (the output of a dropped check)"),
            }),
            Some(t) => Err(ImportError::MissingTensor {
                node: loc(),
                tensor: t.to_string(),
            }),
        }
    }

    /// How node `i` lowers: the mapped plan when it type-checks, else `opaque` (with the
    /// reason noted, and a warning when the target looks like a collective).
    fn plan_node(
        &mut self,
        i: usize,
        target: &str,
        n: &NodeIn<'p>,
        ins: &[Bound],
        outs: &[(TensorType, bool)],
    ) -> Lowering {
        if let Some(&sum_out) = self.folds.divisions.get(&i) {
            // Only when the sum did become a mean (it stays opaque if it failed to map).
            let mean = self
                .tensors
                .get(sum_out)
                .filter(|b| matches!(self.g.node(b.value.node).op, Op::Mean { .. }));
            if let Some(b) = mean {
                let value = b.value;
                self.notes.count(
                    1,
                    &format!("{target} (a division of a sum by its element count, now a mean)"),
                );
                return Lowering::Forward(value);
            }
        }
        let view = ops::NodeView {
            target,
            args: n.args,
            ins,
            outs,
            g: &self.g,
            opts: self.opts,
        };
        let planned = if self.folds.sums.contains(&i) {
            ops::mean_of_sum(&view)
        } else {
            ops::lower(&view)
        };
        // An `auto_functionalized` node is named by the op it wraps in notes.
        let wrapped = ops::wrapped_op_name(&view);
        let label: &str = wrapped.as_deref().unwrap_or(target);
        let lowering = match planned {
            Ok(l) => match self.check(&l) {
                Ok(()) => Some(l),
                Err(why) => {
                    self.notes.count(
                        4,
                        &format!("{label} opaque: the mapped op does not type-check ({why})"),
                    );
                    None
                }
            },
            Err(why) => {
                if let Some(why) = why {
                    self.notes.count(4, &format!("{label} opaque: {why}"));
                }
                None
            }
        };
        lowering.unwrap_or_else(|| {
            if looks_like_collective(target) || wrapped.is_some() && looks_like_collective(label) {
                self.notes.count(
                    5,
                    &format!(
                        "{label}: looks like a collective but is not an all-reduce arfuse \
                         understands; kept opaque, so the sites it stands for may be missed \
                         (a framework's all-reduce can be named with --all-reduce-op NAME)"
                    ),
                );
            }
            Lowering::Nodes(vec![self.opaque(target, n.args, ins, outs)])
        })
    }

    /// The module path of a node, prefix removed.
    fn module_of(&self, m: Module<'_>) -> Option<String> {
        match m {
            Module::None => None,
            Module::Stack(s) => innermost_module(s).and_then(|m| self.strip_module(m)),
            // The innermost entry of the stack `{m},{m},?`: `m` trimmed, unless `m`
            // holds the stack's separators.
            Module::Path(m) if m.contains([',', ';']) => {
                let stack = format!("{m},{m},?");
                innermost_module(&stack).and_then(|m| self.strip_module(m))
            }
            Module::Path(m) => {
                let m = m.trim();
                (!m.is_empty()).then(|| self.strip_module(m)).flatten()
            }
        }
    }

    /// Adds the planned nodes of torch node `i` and binds its output tensors; returns
    /// the values its outputs now are.
    fn apply(
        &mut self,
        i: usize,
        n: &NodeIn<'p>,
        target: &str,
        lowering: Lowering,
        out_names: &[&'p str],
        outs: &[(TensorType, bool)],
    ) -> Result<Vec<Value>, ImportError> {
        match lowering {
            Lowering::Forward(v) => {
                let folded = self.folds.divisions.contains_key(&i)
                    && matches!(self.g.node(v.node).op, Op::Mean { .. });
                if !folded {
                    self.notes.count(1, target);
                }
                let is_bool = outs.first().map(|o| o.1).unwrap_or(false);
                if let Some(&t) = out_names.first() {
                    self.tensors.insert(t, Bound { value: v, is_bool });
                    self.produced.push((t, v));
                }
                Ok(vec![v])
            }
            Lowering::Nodes(nodes) => {
                let module = self.module_of(n.module);
                let name: Cow<'_, str> = match n.name.or_else(|| out_names.first().copied()) {
                    Some(s) => Cow::Borrowed(s),
                    None => Cow::Owned(format!("{target}_{i}")),
                };
                let mut made: Vec<NodeId> = Vec::with_capacity(nodes.len());
                for pn in nodes {
                    let id = match pn.suffix {
                        Some(s) => self.unique_id(&format!("{}_{s}", sanitize_id(&name))),
                        None => self.unique_id(&name),
                    };
                    let inputs = pn
                        .inputs
                        .iter()
                        .map(|p| match *p {
                            PIn::Ext(v) => v,
                            PIn::Local(j) => Value::new(made[j], 0),
                        })
                        .collect();
                    let nid = self.g.add_node(Node {
                        id,
                        op: pn.op,
                        inputs,
                        outputs: pn.outputs,
                        module: module.clone(),
                    })?;
                    made.push(nid);
                }
                let Some(&last) = made.last() else {
                    return Ok(Vec::new());
                };
                let mut values = Vec::with_capacity(out_names.len());
                for (j, &t) in out_names.iter().enumerate() {
                    let value = Value::new(last, j as u32);
                    self.tensors.insert(
                        t,
                        Bound {
                            value,
                            is_bool: outs[j].1,
                        },
                    );
                    self.produced.push((t, value));
                    values.push(value);
                }
                Ok(values)
            }
        }
    }

    /// After an in-place op, later readers of the tensors of its first argument read
    /// its outputs (torch's graphs run in order, so a mutation is seen by every node
    /// after it). Output `k` stands for the `k`-th mutated tensor when the types agree.
    fn rebind_mutated(&mut self, target: &str, n: &NodeIn<'p>, made: &[Value]) {
        if !ops::mutates_first_argument(target) {
            return;
        }
        let Some((_, first)) = n.args.first() else {
            return;
        };
        let mut mutated: Vec<&'p str> = Vec::new();
        first.each_tensor(&mut |t| mutated.push(t));
        for (k, &name) in mutated.iter().enumerate() {
            let (Some(old), Some(&new)) = (self.tensors.get(name).copied(), made.get(k)) else {
                continue;
            };
            if self.g.value_type(old.value) == self.g.value_type(new) {
                self.tensors.insert(
                    name,
                    Bound {
                        value: new,
                        is_bool: old.is_bool,
                    },
                );
            }
        }
    }

    /// Type-checks a lowering with the IR's own validator: its nodes, and an input
    /// node standing for each value they read, are added to the scratch graph
    /// ([`Scratch`]) and validated alone (the answer is the first problem, as a
    /// validation of a graph holding just those nodes would give it).
    fn check(&mut self, l: &Lowering) -> Result<(), String> {
        let nodes = match l {
            Lowering::Forward(_) => return Ok(()),
            Lowering::Nodes(n) => n,
        };
        if nodes
            .iter()
            .any(|pn| pn.inputs.len() > MAX_PORTS || pn.outputs.len() > MAX_PORTS)
        {
            // The graph's own error names the node: keep the scratch graph's ids.
            return self.check_alone(nodes);
        }
        let s = &mut self.scratch;
        if s.g.len() + 4 * nodes.len() > Scratch::MAX_NODES {
            *s = Scratch::default();
        }
        if s.g.symbols().len() != self.g.symbols().len() {
            // Symbols are only ever added.
            for (name, r) in self.g.symbols() {
                if !s.g.symbols().contains_key(name) {
                    s.g.set_symbol(name.clone(), *r);
                }
            }
        }
        // The nodes to validate, in the order of the graph `check_alone` builds.
        let mut order: Vec<NodeId> = Vec::with_capacity(2 * nodes.len() + 2);
        let mut made: Vec<NodeId> = Vec::with_capacity(nodes.len());
        for pn in nodes {
            let mut inputs = Vec::with_capacity(pn.inputs.len());
            for p in &pn.inputs {
                match *p {
                    PIn::Ext(v) => {
                        let x = match s.inputs.get(&v) {
                            Some(x) => *x,
                            None => {
                                let ty = self.g.value_type(v).cloned().ok_or("missing value")?;
                                let id =
                                    s.g.add_node(Node {
                                        id: numbered('i', s.g.len()),
                                        op: Op::Input {
                                            kind: InputKind::Activation,
                                        },
                                        inputs: vec![],
                                        outputs: vec![ty],
                                        module: None,
                                    })
                                    .map_err(|e| e.to_string())?;
                                s.inputs.insert(v, Value::new(id, 0));
                                Value::new(id, 0)
                            }
                        };
                        if !order.contains(&x.node) {
                            order.push(x.node);
                        }
                        inputs.push(x);
                    }
                    PIn::Local(j) => {
                        inputs.push(Value::new(*made.get(j).ok_or("bad local input")?, 0))
                    }
                }
            }
            let id =
                s.g.add_node(Node {
                    id: numbered('n', s.g.len()),
                    op: pn.op.clone(),
                    inputs,
                    outputs: pn.outputs.clone(),
                    module: None,
                })
                .map_err(|e| e.to_string())?;
            made.push(id);
            order.push(id);
        }
        s.g.validate_nodes(order).map_err(first_problem)
    }

    /// [`Builder::check`] on a graph of its own, holding just the lowering's inputs and
    /// nodes.
    fn check_alone(&self, nodes: &[PNode]) -> Result<(), String> {
        let mut g = Graph::new();
        for (name, r) in self.g.symbols() {
            g.set_symbol(name.clone(), *r);
        }
        let mut ext: HashMap<Value, Value> = HashMap::new();
        let mut made: Vec<NodeId> = Vec::new();
        for (k, pn) in nodes.iter().enumerate() {
            let mut inputs = Vec::new();
            for p in &pn.inputs {
                match *p {
                    PIn::Ext(v) => {
                        if let Some(x) = ext.get(&v) {
                            inputs.push(*x);
                            continue;
                        }
                        let ty = self.g.value_type(v).cloned().ok_or("missing value")?;
                        let id = g
                            .add_node(Node {
                                id: format!("in{}", ext.len()),
                                op: Op::Input {
                                    kind: InputKind::Activation,
                                },
                                inputs: vec![],
                                outputs: vec![ty],
                                module: None,
                            })
                            .map_err(|e| e.to_string())?;
                        ext.insert(v, Value::new(id, 0));
                        inputs.push(Value::new(id, 0));
                    }
                    PIn::Local(j) => {
                        inputs.push(Value::new(*made.get(j).ok_or("bad local input")?, 0))
                    }
                }
            }
            let id = g
                .add_node(Node {
                    id: format!("n{k}"),
                    op: pn.op.clone(),
                    inputs,
                    outputs: pn.outputs.clone(),
                    module: None,
                })
                .map_err(|e| e.to_string())?;
            made.push(id);
        }
        g.validate().map_err(first_problem)
    }

    /// The opaque node of a torch node: every argument in attrs, tensors as
    /// `{"input": k}`.
    fn opaque(
        &self,
        target: &str,
        args: &[(String, Arg)],
        ins: &[Bound],
        outs: &[(TensorType, bool)],
    ) -> PNode {
        let mut attrs = serde_json::Map::new();
        let mut k = 0usize;
        for (name, a) in args {
            attrs.insert(name.clone(), self.render_arg(a, &mut k));
        }
        PNode {
            suffix: None,
            op: Op::Opaque {
                target: target.to_string(),
                attrs: Json::Object(attrs),
            },
            inputs: ins.iter().map(|b| PIn::Ext(b.value)).collect(),
            outputs: outs.iter().map(|o| o.0.clone()).collect(),
        }
    }

    /// An argument as attribute JSON; tensors become `{"input": k}` in order.
    fn render_arg(&self, a: &Arg, k: &mut usize) -> Json {
        let mut tensor = || {
            let j = json!({ "input": *k });
            *k += 1;
            j
        };
        match a {
            Arg::Tensor(_) | Arg::OptionalTensor(Some(_)) => tensor(),
            Arg::Tensors(l) => Json::Array(l.iter().map(|_| tensor()).collect()),
            Arg::OptionalTensor(None) | Arg::None => Json::Null,
            Arg::OptionalTensors(l) => Json::Array(
                l.iter()
                    .map(|t| if t.is_some() { tensor() } else { Json::Null })
                    .collect(),
            ),
            Arg::Int(i) => Json::from(*i),
            Arg::Float(f) if f.is_finite() => Json::from(*f),
            Arg::Float(f) => Json::String(f.to_string()),
            Arg::Bool(b) => Json::Bool(*b),
            Arg::Str(s) => Json::String(s.clone()),
            Arg::Ints(l) => Json::from(l.as_slice()),
            Arg::Floats(l) => Json::Array(l.iter().map(|f| Json::from(*f)).collect()),
            Arg::Bools(l) => Json::from(l.as_slice()),
            Arg::Sym(s) => self.render_sym(s),
            Arg::Syms(l) => Json::Array(l.iter().map(|s| self.render_sym(s)).collect()),
            Arg::Dtype(c) => Json::String(scalar_type_name(*c)),
            Arg::Other(j) => self.render_json_arg(j, k),
        }
    }

    /// A symbolic int as a number or its size expression (`"s70"`, `"4*s70"`).
    fn render_sym(&self, s: &SymInt) -> Json {
        match s {
            SymInt::Const(n) => Json::from(*n),
            SymInt::Expr(text) => render_expr(text),
            SymInt::Name { name } => self.render_sym_name(name),
        }
    }

    /// A `sym_int_values` name as the size expression (or number) it holds, else as
    /// itself.
    fn render_sym_name(&self, name: &str) -> Json {
        let expr = self
            .sym_ints
            .get(name)
            .and_then(|s| s.get("as_expr"))
            .and_then(|e| e.get("expr_str"))
            .and_then(Json::as_str);
        match expr {
            Some(text) => render_expr(text),
            None => match self.sym_ints.get(name).and_then(|s| s.get("as_int")) {
                Some(i) => i.clone(),
                None => Json::String(name.to_string()),
            },
        }
    }

    /// A schema argument ([`Arg::Other`]) as attribute JSON.
    fn render_json_arg(&self, a: &Json, k: &mut usize) -> Json {
        let Some((kind, v)) = a.as_object().and_then(|o| o.iter().next()) else {
            return a.clone();
        };
        let tensor = |k: &mut usize| {
            let j = json!({ "input": *k });
            *k += 1;
            j
        };
        match kind.as_str() {
            "as_tensor" => tensor(k),
            "as_tensors" => Json::Array(
                v.as_array()
                    .map(|l| l.iter().map(|_| tensor(k)).collect())
                    .unwrap_or_default(),
            ),
            "as_optional_tensor" => {
                if v.get("as_tensor").is_some() {
                    tensor(k)
                } else {
                    Json::Null
                }
            }
            "as_optional_tensors" => Json::Array(
                v.as_array()
                    .map(|l| {
                        l.iter()
                            .map(|x| {
                                if x.get("as_tensor").is_some() {
                                    tensor(k)
                                } else {
                                    Json::Null
                                }
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
            ),
            "as_none" => Json::Null,
            "as_int" | "as_float" | "as_bool" | "as_string" | "as_ints" | "as_floats"
            | "as_bools" | "as_strings" => v.clone(),
            "as_scalar_type" => match v.as_i64() {
                Some(c) => Json::String(scalar_type_name(c)),
                None => v.clone(),
            },
            "as_layout" => match v.as_i64() {
                Some(7) => Json::String("strided".into()),
                _ => json!({ "layout": v }),
            },
            "as_memory_format" => match v.as_i64() {
                Some(1) => Json::String("contiguous_format".into()),
                Some(2) => Json::String("channels_last".into()),
                Some(3) => Json::String("channels_last_3d".into()),
                Some(4) => Json::String("preserve_format".into()),
                _ => json!({ "memory_format": v }),
            },
            "as_device" => {
                let ty = v.get("type").and_then(Json::as_str).unwrap_or("?");
                match v.get("index").and_then(Json::as_i64) {
                    Some(i) => Json::String(format!("{ty}:{i}")),
                    None => Json::String(ty.to_string()),
                }
            }
            "as_sym_int" => self.render_json_sym_int(v),
            "as_sym_ints" => Json::Array(
                v.as_array()
                    .map(|l| l.iter().map(|x| self.render_json_sym_int(x)).collect())
                    .unwrap_or_default(),
            ),
            _ => a.clone(),
        }
    }

    /// A schema `SymIntArgument` (`{"as_name": n}` or `{"as_int": i}`) as a number or
    /// the size expression it names.
    fn render_json_sym_int(&self, v: &Json) -> Json {
        if let Some(i) = v.get("as_int") {
            return i.clone();
        }
        match v.get("as_name").and_then(Json::as_str) {
            Some(name) => self.render_sym_name(name),
            None => v.clone(),
        }
    }
}

/// A size expression's text in the canonical form (as it is when it does not parse).
fn render_expr(text: &str) -> Json {
    match symbolic::parse(text) {
        Ok(e) => Json::String(symbolic::render(&e)),
        Err(_) => Json::String(text.to_string()),
    }
}

/// An optional argument that is absent or `None`.
fn is_absent(a: Option<&Arg>) -> bool {
    a.map_or(true, Arg::is_none)
}

/// A node's argument by name.
fn arg<'n>(args: &'n [(String, Arg)], name: &str) -> Option<&'n Arg> {
    args.iter().find(|(n, _)| n == name).map(|(_, a)| a)
}

fn truncate(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_string();
    }
    let mut cut = n;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}...", &s[..cut])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_stack_innermost_entry() {
        let s = "L__self__,,__main__.Wrap;L__self__m.model,m.model,x.LlamaModel;\
                 L__self__m.model.layers.0.mlp,m.model.layers.0.mlp,x.LlamaMLP";
        assert_eq!(innermost_module(s), Some("m.model.layers.0.mlp"));
        assert_eq!(innermost_module("L__self__,,__main__.Wrap"), None);
        assert_eq!(
            innermost_module("_empty_nn_module_stack_from_metadata_hook"),
            None
        );
        assert_eq!(innermost_module(""), None);
    }

    #[test]
    fn ids_and_dtypes() {
        assert_eq!(sanitize_id("a b:c\t"), "a_b_c_");
        assert_eq!(sanitize_id(""), "node");
        let long = "\u{e9}".repeat(400);
        assert!(sanitize_id(&long).len() <= MAX_ID_LEN);
        assert_eq!(scalar_type(13), Ok((DType::Bf16, false)));
        assert_eq!(scalar_type(5), Ok((DType::I64, false)));
        assert_eq!(scalar_type(4), Ok((DType::I32, false)));
        assert_eq!(scalar_type(12), Ok((DType::U8, true)));
        assert!(scalar_type(8).unwrap_err().contains("DOUBLE"));
        assert!(scalar_type(-3).is_err());
        assert_eq!(scalar_type_name(12), "bool");
    }

    #[test]
    fn numbered_ids() {
        assert_eq!(numbered('n', 0), "n0");
        assert_eq!(numbered('i', 1234), "i1234");
        assert_eq!(numbered('n', usize::MAX), format!("n{}", usize::MAX));
    }

    #[test]
    fn schema_versions() {
        assert_eq!(
            check_version(Some(&json!({"major": 8, "minor": 20}))).unwrap(),
            "8.20"
        );
        assert!(check_version(Some(&json!({"major": 7, "minor": 1}))).is_err());
        assert!(check_version(Some(&json!(8))).is_err());
        assert!(check_version(None).is_err());
    }
}
