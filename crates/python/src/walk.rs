//! The FX front end of `arfuse.torch.FusionPass`: one walk over a torch.fx graph, in
//! Rust, that builds the importer's compact form ([`FxGraph`], `docs/fx-graph-format.md`,
//! "The compact form") directly from the graph's Python objects: no serializer, no JSON,
//! no Python list per node.
//!
//! It reads each node's `op`, `name`, `target`, `args`, `kwargs` and the dtype and sizes
//! of its FakeTensor values (`meta["val"]`), and the innermost `nn_module_stack` path;
//! nothing else, and no private torch API. A node arfuse does not model is never an
//! error here (the importer keeps it opaque):
//!
//! - a `placeholder` holding a tensor is a graph input; one holding anything else (a
//!   symbolic int, a script object) is nothing, and its readers see a non-tensor
//!   argument;
//! - a `call_function` is one node: its target (`aten.add.Tensor`,
//!   `higher_order.auto_functionalized`, `_operator.getitem`, `module.function`), its
//!   arguments named by the op's schema (an `auto_functionalized` node's op is the string
//!   argument `_op`), one output per tensor of its value; the outputs of a tuple-valued
//!   node are named after the `getitem` nodes reading them, which are not listed;
//! - `get_attr`, `call_module`, `call_method` are nodes with target `<op>:<target>`;
//! - `output` gives the graph's outputs (the tensors among them).
//!
//! Argument values: a tensor by the name of the node that made it, a symbolic int by its
//! expression (`s72`, `2*s72`), a dtype by torch.export's `ScalarType` code, a device,
//! layout, memory format or op as text, and anything else by its type name.

use arfuse::advanced::import::torch_export::fx::{
    FxArg, FxGraph, FxNode, FxSize, FxSymbol, FxTensor, SymInt,
};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use std::collections::HashMap;

/// torch.export's `ScalarType` codes (torch/_export/serde/schema.py) by torch dtype name;
/// any other dtype is code 0, which the importer types as opaque.
const DTYPE_CODES: &[(&str, i64)] = &[
    ("torch.uint8", 1),
    ("torch.int8", 2),
    ("torch.int16", 3),
    ("torch.int32", 4),
    ("torch.int64", 5),
    ("torch.float16", 6),
    ("torch.float32", 7),
    ("torch.float64", 8),
    ("torch.complex32", 9),
    ("torch.complex64", 10),
    ("torch.complex128", 11),
    ("torch.bool", 12),
    ("torch.bfloat16", 13),
    ("torch.uint16", 28),
    ("torch.float8_e4m3fn", 29),
    ("torch.float8_e5m2", 30),
    ("torch.float8_e4m3fnuz", 31),
    ("torch.float8_e5m2fnuz", 32),
    ("torch.float8_e8m0fnu", 33),
    ("torch.uint32", 34),
    ("torch.uint64", 35),
];

/// What a producing FX node's value is as tensors.
enum Produced {
    /// One tensor, by name.
    One(String),
    /// A tuple: the name of each entry that is a tensor.
    Many(Vec<Option<String>>),
}

/// Python objects one walk compares against, and its caches (keyed by object address:
/// every object is alive for the walk, held by the graph).
struct Walker<'py> {
    py: Python<'py>,
    node_type: Bound<'py, PyAny>,
    tensor_type: Bound<'py, PyAny>,
    sym_types: Bound<'py, PyTuple>,
    dtype_type: Bound<'py, PyAny>,
    overload_type: Bound<'py, PyAny>,
    hop_type: Bound<'py, PyAny>,
    text_types: Bound<'py, PyTuple>,
    memory_format_type: Bound<'py, PyAny>,
    strided: Bound<'py, PyAny>,
    getitem: Bound<'py, PyAny>,
    /// Sympy expression -> its text (printing one takes about 20 us; a graph repeats
    /// the same few).
    expr_text: Bound<'py, PyDict>,
    dtype_codes: HashMap<usize, i64>,
    target_names: HashMap<usize, String>,
    arg_names: HashMap<usize, Vec<String>>,
    modules: HashMap<String, String>,
    produced: HashMap<usize, Produced>,
}

fn addr(o: &Bound<'_, PyAny>) -> usize {
    o.as_ptr() as usize
}

/// A dynamo module path as a module FQN: `L['self'].model.layers[0].mlp` and
/// `L['self']._modules['model']._modules['layers']._modules['0']` -> `model.layers.0.mlp`,
/// `model.layers.0`.
pub fn module_fqn(dynamo_path: &str) -> String {
    let p = dynamo_path.strip_prefix("L['self']").unwrap_or(dynamo_path);
    let mut flat = String::with_capacity(p.len());
    let mut rest = p;
    while let Some(open) = rest.find('[') {
        flat.push_str(&rest[..open]);
        let Some(close) = rest[open..].find(']') else {
            break;
        };
        let inner = &rest[open + 1..open + close];
        flat.push('.');
        flat.push_str(inner.trim_matches('\''));
        rest = &rest[open + close + 1..];
    }
    flat.push_str(rest);
    let segs: Vec<&str> = flat.split('.').filter(|s| !s.is_empty()).collect();
    let last = segs.len().saturating_sub(1);
    segs.iter()
        .enumerate()
        .filter(|(i, s)| *i == last || !matches!(**s, "_modules" | "_parameters" | "_buffers"))
        .map(|(_, s)| *s)
        .collect::<Vec<_>>()
        .join(".")
}

impl<'py> Walker<'py> {
    fn new(py: Python<'py>) -> PyResult<Walker<'py>> {
        let torch = py.import("torch")?;
        let ops = py.import("torch._ops")?;
        Ok(Walker {
            py,
            node_type: py.import("torch.fx")?.getattr("Node")?,
            tensor_type: torch.getattr("Tensor")?,
            sym_types: PyTuple::new(
                py,
                [
                    torch.getattr("SymInt")?,
                    torch.getattr("SymFloat")?,
                    torch.getattr("SymBool")?,
                ],
            )?,
            dtype_type: torch.getattr("dtype")?,
            overload_type: ops.getattr("OpOverload")?,
            hop_type: ops.getattr("HigherOrderOperator")?,
            text_types: PyTuple::new(py, [torch.getattr("device")?, torch.getattr("layout")?])?,
            memory_format_type: torch.getattr("memory_format")?,
            strided: torch.getattr("strided")?,
            getitem: py.import("operator")?.getattr("getitem")?,
            expr_text: PyDict::new(py),
            dtype_codes: HashMap::new(),
            target_names: HashMap::new(),
            arg_names: HashMap::new(),
            modules: HashMap::new(),
            produced: HashMap::new(),
        })
    }

    fn dtype_code(&mut self, dtype: &Bound<'py, PyAny>) -> PyResult<i64> {
        if let Some(&c) = self.dtype_codes.get(&addr(dtype)) {
            return Ok(c);
        }
        let name = dtype.str()?.to_string();
        let code = DTYPE_CODES
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |(_, c)| *c);
        self.dtype_codes.insert(addr(dtype), code);
        Ok(code)
    }

    /// A symbolic int's expression as text (`s72`, `2*s72`), through `node.expr` (the
    /// expression after the shape environment's replacements).
    fn sym_text(&self, d: &Bound<'py, PyAny>) -> PyResult<String> {
        let expr = d
            .getattr(intern!(self.py, "node"))
            .and_then(|n| n.getattr(intern!(self.py, "expr")));
        let Ok(expr) = expr else {
            return Ok(d.str()?.to_string());
        };
        if let Ok(Some(t)) = self.expr_text.get_item(&expr) {
            return t.extract();
        }
        let text = d.str()?;
        if self.expr_text.set_item(&expr, &text).is_err() {
            // An unhashable expression: printed each time.
        }
        Ok(text.to_string())
    }

    fn tensor(&mut self, name: String, t: &Bound<'py, PyAny>) -> PyResult<FxTensor> {
        let dtype = self.dtype_code(&t.getattr(intern!(self.py, "dtype"))?)?;
        let mut sizes = Vec::new();
        for d in t.getattr(intern!(self.py, "shape"))?.try_iter()? {
            let d = d?;
            sizes.push(match d.cast::<PyInt>() {
                Ok(i) => FxSize::Const(i.extract()?),
                Err(_) => FxSize::Expr(self.sym_text(&d)?),
            });
        }
        Ok(FxTensor { name, dtype, sizes })
    }

    fn target_name(&mut self, target: &Bound<'py, PyAny>) -> PyResult<String> {
        if let Some(n) = self.target_names.get(&addr(target)) {
            return Ok(n.clone());
        }
        let name = if target.is_instance(&self.overload_type)? {
            target.str()?.to_string()
        } else if target.is_instance(&self.hop_type)? {
            format!("higher_order.{}", target.call_method0("name")?.str()?)
        } else if let Ok(s) = target.cast::<PyString>() {
            s.to_string()
        } else {
            let module = target
                .getattr("__module__")
                .ok()
                .filter(|m| !m.is_none())
                .map(|m| m.str().map(|s| s.to_string()))
                .transpose()?
                .unwrap_or_else(|| "?".into());
            let qual = target
                .getattr("__qualname__")
                .or_else(|_| target.getattr("__name__"))
                .and_then(|q| q.str().map(|s| s.to_string()))
                .or_else(|_| target.repr().map(|r| r.to_string()))?;
            format!("{module}.{qual}")
        };
        self.target_names.insert(addr(target), name.clone());
        Ok(name)
    }

    /// The names of `target`'s first `n` arguments: its schema's, then `arg<i>`.
    fn arg_names(&mut self, target: &Bound<'py, PyAny>, n: usize) -> PyResult<&[String]> {
        let key = addr(target);
        let known = self.arg_names.get(&key).map_or(0, Vec::len);
        if known < n || !self.arg_names.contains_key(&key) {
            let mut names: Vec<String> = Vec::new();
            if let Ok(schema) = target.getattr("_schema") {
                for a in schema.getattr("arguments")?.try_iter()? {
                    names.push(a?.getattr("name")?.str()?.to_string());
                }
            }
            while names.len() < n {
                names.push(format!("arg{}", names.len()));
            }
            self.arg_names.insert(key, names);
        }
        Ok(&self.arg_names[&key][..n])
    }

    fn type_name(v: &Bound<'py, PyAny>) -> PyResult<String> {
        Ok(v.get_type().name()?.to_string())
    }

    /// One argument value.
    fn value(&self, v: &Bound<'py, PyAny>) -> PyResult<FxArg> {
        if v.is_instance(&self.node_type)? {
            if let Some(Produced::One(t)) = self.produced.get(&addr(v)) {
                return Ok(FxArg::Tensor(t.clone()));
            }
            let val = node_val(self.py, v)?;
            return match val {
                Some(val) if val.is_instance(&self.sym_types)? => {
                    Ok(FxArg::Sym(SymInt::Expr(self.sym_text(&val)?)))
                }
                Some(val) if val.is_instance_of::<PyInt>() || val.is_instance_of::<PyFloat>() => {
                    self.value(&val)
                }
                Some(val) => Ok(FxArg::other(Self::type_name(&val)?)),
                None => Ok(FxArg::other("NoneType")),
            };
        }
        if v.is_none() {
            return Ok(FxArg::None);
        }
        if let Ok(b) = v.cast::<PyBool>() {
            return Ok(FxArg::Bool(b.is_true()));
        }
        if let Ok(i) = v.cast::<PyInt>() {
            return Ok(match i.extract::<i64>() {
                Ok(i) => FxArg::Int(i),
                Err(_) => FxArg::other("int"),
            });
        }
        if let Ok(f) = v.cast::<PyFloat>() {
            return Ok(FxArg::Float(f.value()));
        }
        if let Ok(s) = v.cast::<PyString>() {
            return Ok(FxArg::Str(s.to_string()));
        }
        if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
            return self.sequence(v);
        }
        if v.is_instance(&self.dtype_type)? {
            let code = self.dtype_codes.get(&addr(v)).copied();
            let code = match code {
                Some(c) => c,
                None => {
                    let name = v.str()?.to_string();
                    DTYPE_CODES
                        .iter()
                        .find(|(n, _)| *n == name)
                        .map_or(0, |(_, c)| *c)
                }
            };
            return Ok(FxArg::Dtype(code));
        }
        if v.is_instance(&self.sym_types)? {
            return Ok(FxArg::Sym(SymInt::Expr(self.sym_text(v)?)));
        }
        if v.is_instance(&self.overload_type)? || v.is_instance(&self.text_types)? {
            if v.is(&self.strided) {
                return Ok(FxArg::Str("strided".into()));
            }
            return Ok(FxArg::Str(v.str()?.to_string()));
        }
        if v.is_instance(&self.memory_format_type)? {
            let s = v.str()?.to_string();
            return Ok(FxArg::Str(s.trim_start_matches("torch.").to_string()));
        }
        Ok(FxArg::other(Self::type_name(v)?))
    }

    /// A list or tuple argument: tensors (some perhaps `None`), ints, ints and symbolic
    /// ints, floats, bools, or else an opaque `list`.
    fn sequence(&self, v: &Bound<'py, PyAny>) -> PyResult<FxArg> {
        let items: Vec<Bound<'py, PyAny>> = v.try_iter()?.collect::<PyResult<_>>()?;
        if items.is_empty() {
            return Ok(FxArg::Ints(Vec::new()));
        }
        #[derive(PartialEq)]
        enum K {
            Tensor,
            None,
            Sym,
            Int,
            Float,
            Bool,
            Other,
        }
        let mut kinds = Vec::with_capacity(items.len());
        for x in &items {
            kinds.push(if x.is_instance(&self.node_type)? {
                match self.produced.get(&addr(x)) {
                    Some(Produced::One(_)) => K::Tensor,
                    _ => K::Sym,
                }
            } else if x.is_none() {
                K::None
            } else if x.is_instance_of::<PyBool>() {
                K::Bool
            } else if x.is_instance_of::<PyInt>() {
                K::Int
            } else if x.is_instance_of::<PyFloat>() {
                K::Float
            } else if x.is_instance(&self.sym_types)? {
                K::Sym
            } else {
                K::Other
            });
        }
        let all = |f: &dyn Fn(&K) -> bool| kinds.iter().all(f);
        if all(&|k| matches!(k, K::Tensor | K::None)) {
            let names = items
                .iter()
                .map(|x| match self.produced.get(&addr(x)) {
                    Some(Produced::One(t)) => Some(t.clone()),
                    _ => None,
                })
                .collect();
            return Ok(FxArg::tensors(names));
        }
        if all(&|k| *k == K::Int) {
            return Ok(match items.iter().map(|x| x.extract::<i64>()).collect() {
                Ok(l) => FxArg::Ints(l),
                Err(_) => FxArg::other("list"),
            });
        }
        if all(&|k| matches!(k, K::Int | K::Sym)) {
            let mut l = Vec::with_capacity(items.len());
            for (x, k) in items.iter().zip(&kinds) {
                l.push(if *k == K::Int {
                    match x.extract::<i64>() {
                        Ok(i) => SymInt::Const(i),
                        Err(_) => return Ok(FxArg::other("list")),
                    }
                } else {
                    let val = if x.is_instance(&self.node_type)? {
                        node_val(self.py, x)?
                    } else {
                        Some(x.clone())
                    };
                    match val {
                        Some(s) => SymInt::Expr(self.sym_text(&s)?),
                        None => return Ok(FxArg::other("list")),
                    }
                });
            }
            return Ok(FxArg::Syms(l));
        }
        if all(&|k| matches!(k, K::Int | K::Float)) {
            return Ok(FxArg::Floats(
                items
                    .iter()
                    .map(|x| x.extract::<f64>())
                    .collect::<PyResult<_>>()?,
            ));
        }
        if all(&|k| *k == K::Bool) {
            return Ok(FxArg::Bools(
                items
                    .iter()
                    .map(|x| x.extract::<bool>())
                    .collect::<PyResult<_>>()?,
            ));
        }
        Ok(FxArg::other("list"))
    }

    fn module(&mut self, node: &Bound<'py, PyAny>) -> PyResult<Option<String>> {
        let meta = node.getattr(intern!(self.py, "meta"))?;
        let Ok(meta) = meta.cast::<PyDict>() else {
            return Ok(None);
        };
        let Some(stack) = meta.get_item(intern!(self.py, "nn_module_stack"))? else {
            return Ok(None);
        };
        let Ok(stack) = stack.cast::<PyDict>() else {
            return Ok(None);
        };
        let Some((_, last)) = stack.iter().last() else {
            return Ok(None);
        };
        let Ok(path) = last
            .get_item(0)
            .and_then(|p| p.str().map(|s| s.to_string()))
        else {
            return Ok(None);
        };
        let fqn = self
            .modules
            .entry(path)
            .or_insert_with_key(|p| module_fqn(p))
            .clone();
        Ok((!fqn.is_empty()).then_some(fqn))
    }

    /// The graph's symbols and their ranges, from the shape environment of the first
    /// FakeTensor that has one.
    fn symbols(&self, nodes: &[Bound<'py, PyAny>]) -> PyResult<Vec<FxSymbol>> {
        for n in nodes {
            let Some(val) = node_val(self.py, n)? else {
                continue;
            };
            let env = val
                .getattr(intern!(self.py, "fake_mode"))
                .and_then(|m| m.getattr(intern!(self.py, "shape_env")));
            let Ok(env) = env else { continue };
            if env.is_none() {
                continue;
            }
            let ranges = env.getattr("var_to_range")?;
            let bound = |v: PyResult<Bound<'py, PyAny>>| -> Option<i64> {
                let i = v
                    .ok()?
                    .call_method0("__int__")
                    .ok()?
                    .extract::<i64>()
                    .ok()?;
                (i.unsigned_abs() < 1 << 62).then_some(i)
            };
            let mut out = Vec::new();
            for item in ranges.call_method0("items")?.try_iter()? {
                let item = item?;
                let (sym, r) = (item.get_item(0)?, item.get_item(1)?);
                out.push(FxSymbol {
                    name: sym.str()?.to_string(),
                    min: bound(r.getattr("lower")),
                    max: bound(r.getattr("upper")),
                });
            }
            return Ok(out);
        }
        Ok(Vec::new())
    }
}

/// `node.meta.get("val")`.
fn node_val<'py>(py: Python<'py>, node: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    let meta = node.getattr(intern!(py, "meta"))?;
    match meta.cast::<PyDict>() {
        Ok(m) => Ok(m.get_item(intern!(py, "val"))?.filter(|v| !v.is_none())),
        Err(_) => Ok(None),
    }
}

/// Walks `graph` (a `torch.fx.Graph`) into the compact form. Fails only on a graph that
/// is not one (a node without `op`, a `getitem` index that is no int, ...).
pub fn walk(graph: &Bound<'_, PyAny>) -> PyResult<FxGraph> {
    let py = graph.py();
    let mut w = Walker::new(py)?;
    let nodes: Vec<Bound<'_, PyAny>> = graph
        .getattr("nodes")?
        .try_iter()?
        .collect::<PyResult<_>>()?;
    // Tuple-valued nodes: their tensor outputs are named by the getitems reading them.
    let mut getitem_name: HashMap<(usize, i64), String> = HashMap::new();
    for n in &nodes {
        if n.getattr(intern!(py, "target"))?.is(&w.getitem) {
            let args = n.getattr(intern!(py, "args"))?;
            let (src, k) = (args.get_item(0)?, args.get_item(1)?);
            if let (true, Ok(k)) = (src.is_instance(&w.node_type)?, k.cast::<PyInt>()) {
                let name: String = n.getattr(intern!(py, "name"))?.extract()?;
                getitem_name
                    .entry((addr(&src), k.extract()?))
                    .or_insert(name);
            }
        }
    }
    let mut fx = FxGraph::default();
    for n in &nodes {
        let op: String = n.getattr(intern!(py, "op"))?.extract()?;
        let name: String = n.getattr(intern!(py, "name"))?.extract()?;
        let val = node_val(py, n)?;
        let is_tensor = |v: &Option<Bound<'_, PyAny>>, w: &Walker<'_>| -> PyResult<bool> {
            Ok(match v {
                Some(v) => v.is_instance(&w.tensor_type)?,
                None => false,
            })
        };
        match op.as_str() {
            "placeholder" => {
                if is_tensor(&val, &w)? {
                    let t = w.tensor(name.clone(), val.as_ref().expect("checked"))?;
                    w.produced.insert(addr(n), Produced::One(name));
                    fx.inputs.push(t);
                }
                continue;
            }
            "output" => {
                let args = n.getattr(intern!(py, "args"))?;
                if let Ok(res) = args.get_item(0) {
                    let items: Vec<Bound<'_, PyAny>> =
                        if res.is_instance_of::<PyList>() || res.is_instance_of::<PyTuple>() {
                            res.try_iter()?.collect::<PyResult<_>>()?
                        } else {
                            vec![res]
                        };
                    for r in items {
                        if let Some(Produced::One(t)) = w.produced.get(&addr(&r)) {
                            fx.outputs.push(t.clone());
                        }
                    }
                }
                continue;
            }
            _ => {}
        }
        let target = n.getattr(intern!(py, "target"))?;
        let args = n.getattr(intern!(py, "args"))?;
        let kwargs = n.getattr(intern!(py, "kwargs"))?;
        if op == "call_function" && target.is(&w.getitem) {
            let (src, k) = (args.get_item(0)?, args.get_item(1)?);
            if let (Some(Produced::Many(names)), Ok(k)) =
                (w.produced.get(&addr(&src)), k.extract::<i64>())
            {
                let named = usize::try_from(k)
                    .ok()
                    .and_then(|k| names.get(k))
                    .cloned()
                    .flatten();
                if let Some(t) = named {
                    // The output this getitem names (another getitem of the same output
                    // reads the same tensor).
                    w.produced.insert(addr(n), Produced::One(t));
                    continue;
                }
            }
        }
        // Outputs.
        let mut tensors = Vec::new();
        let mut others = 0;
        match &val {
            Some(v) if v.is_instance(&w.tensor_type)? => {
                tensors.push(w.tensor(name.clone(), v)?);
                w.produced.insert(addr(n), Produced::One(name.clone()));
            }
            Some(v) if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() => {
                let mut names = Vec::new();
                for (k, x) in v.try_iter()?.enumerate() {
                    let x = x?;
                    if x.is_instance(&w.tensor_type)? {
                        let t = getitem_name
                            .get(&(addr(n), k as i64))
                            .cloned()
                            .unwrap_or_else(|| format!("{name}__{k}"));
                        tensors.push(w.tensor(t.clone(), &x)?);
                        names.push(Some(t));
                    } else {
                        others += 1;
                        names.push(None);
                    }
                }
                w.produced.insert(addr(n), Produced::Many(names));
            }
            _ => others = 1,
        }
        // Target and arguments.
        let mut encoded: Vec<(String, FxArg)> = Vec::new();
        let positional: Vec<Bound<'_, PyAny>> = args.try_iter()?.collect::<PyResult<_>>()?;
        let target_name;
        if op == "call_function" {
            target_name = w.target_name(&target)?;
            if target_name.starts_with("higher_order.auto_functionalized") {
                let inner = match positional.first() {
                    Some(a) => w.target_name(a)?,
                    None => "?".to_string(),
                };
                encoded.push(("_op".into(), FxArg::Str(inner)));
            } else {
                let names = w.arg_names(&target, positional.len())?.to_vec();
                for (name, a) in names.into_iter().zip(&positional) {
                    encoded.push((name, w.value(a)?));
                }
            }
        } else {
            target_name = format!("{op}:{}", target.str()?);
            for (i, a) in positional.iter().enumerate() {
                encoded.push((format!("arg{i}"), w.value(a)?));
            }
        }
        if let Ok(kw) = kwargs.cast::<PyDict>() {
            for (k, v) in kw.iter() {
                encoded.push((k.str()?.to_string(), w.value(&v)?));
            }
        }
        let module = w.module(n)?;
        fx.nodes.push(FxNode {
            name,
            target: target_name,
            args: encoded,
            outputs: tensors,
            other_outputs: others,
            module,
        });
    }
    fx.symbols = w.symbols(&nodes)?;
    Ok(fx)
}
