//! Import, lower and splice: the work behind `arfuse.lower` and `arfuse.torch.FusionPass`.
//! The Python side only turns its inputs into bytes (docs/fx-graph-format.md) and builds
//! its result objects from what is returned here.

use crate::errors::{load_error, lower_argument_error, lower_error, splice_error};
use crate::target::PyTarget;
use arfuse::import::{load_any_with, CustomAllReduce, ImportOptions, Imported};
use arfuse::{LowerOptions, Lowered};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// What `_lower` and `_fx_lower` return besides their own part: the report as JSON and
/// as the table, and the importer's notes.
type ReportParts = (String, String, Vec<String>);

fn import(py: Python<'_>, data: &[u8], all_reduce_ops: &[String]) -> PyResult<Imported> {
    let opts = import_options(py, all_reduce_ops)?;
    load_any_with(data, &opts).map_err(|e| load_error(py, &e))
}

fn import_options(py: Python<'_>, all_reduce_ops: &[String]) -> PyResult<ImportOptions> {
    let mut opts = ImportOptions::default();
    for spec in all_reduce_ops {
        let op: CustomAllReduce =
            spec.parse()
                .map_err(|e: arfuse::import::CustomAllReduceParseError| {
                    lower_argument_error(py, "all_reduce_ops", e.to_string())
                })?;
        opts = opts.with_all_reduce_op(op);
    }
    Ok(opts)
}

fn lower(
    py: Python<'_>,
    imported: &Imported,
    target: &PyTarget,
    group: Option<String>,
    shared_hidden_sizes: Vec<u64>,
) -> PyResult<Lowered> {
    let mut options = LowerOptions::default().with_shared_hidden_sizes(shared_hidden_sizes);
    options.group = group;
    arfuse::lower_with(&imported.graph, &target.inner, &options).map_err(|e| lower_error(py, &e))
}

fn report_parts(lowered: &Lowered, imported: &Imported) -> ReportParts {
    (
        lowered.report.to_json(),
        lowered.report.to_string(),
        imported.notes.clone(),
    )
}

/// Imports `data` (any format `arfuse::import::load_any` detects) and lowers it for
/// `target`. Returns (lowered graph JSON, report JSON, report table, import notes).
#[pyfunction]
#[pyo3(signature = (data, target, group = None, all_reduce_ops = Vec::new(), shared_hidden_sizes = Vec::new()))]
pub fn _lower(
    py: Python<'_>,
    data: &Bound<'_, PyBytes>,
    target: &PyTarget,
    group: Option<String>,
    all_reduce_ops: Vec<String>,
    shared_hidden_sizes: Vec<u64>,
) -> PyResult<(String, String, String, Vec<String>)> {
    let imported = import(py, data.as_bytes(), &all_reduce_ops)?;
    let lowered = lower(py, &imported, target, group, shared_hidden_sizes)?;
    let (json, table, notes) = report_parts(&lowered, &imported);
    Ok((lowered.graph.to_json_string(), json, table, notes))
}

/// Imports a serialized FX graph (docs/fx-graph-format.md), lowers it for `target` and
/// splices the result back (`arfuse::splice`). Returns (report JSON, report table,
/// splice JSON, import notes).
#[pyfunction]
#[pyo3(signature = (data, target, group = None, all_reduce_ops = Vec::new()))]
pub fn _fx_lower(
    py: Python<'_>,
    data: &Bound<'_, PyBytes>,
    target: &PyTarget,
    group: Option<String>,
    all_reduce_ops: Vec<String>,
) -> PyResult<(String, String, String, Vec<String>)> {
    let imported = import(py, data.as_bytes(), &all_reduce_ops)?;
    fx_finish(py, imported, target, group)
}

/// Lowers an imported FX graph and splices the result back: (report JSON, report table,
/// splice JSON, import notes).
fn fx_finish(
    py: Python<'_>,
    imported: Imported,
    target: &PyTarget,
    group: Option<String>,
) -> PyResult<(String, String, String, Vec<String>)> {
    let lowered = lower(py, &imported, target, group, Vec::new())?;
    let splice = arfuse::splice::splice(&imported.graph, &imported.tensors, &lowered.graph)
        .map_err(|e| splice_error(py, &e))?;
    let (json, table, notes) = report_parts(&lowered, &imported);
    let splice = serde_json::to_string(&splice)
        .map_err(|e| lower_argument_error(py, "internal", e.to_string()))?;
    Ok((json, table, splice, notes))
}

/// The compact FX form (`arfuse.fx.walk`'s lists) as the importer's [`FxGraph`]. A value
/// of the wrong Python type is a `LoadError` naming the node and argument.
mod compact {
    use arfuse::import::torch_export::fx::{
        FxArg, FxGraph, FxNode, FxSize, FxSymbol, FxTensor, SymInt,
    };
    use pyo3::exceptions::PyValueError;
    use pyo3::prelude::*;
    use pyo3::types::{PyList, PyTuple};

    // The argument kinds of `arfuse/fx.py` (K_*).
    const K_TENSOR: u8 = 0;
    const K_TENSORS: u8 = 1;
    const K_NONE: u8 = 2;
    const K_INT: u8 = 3;
    const K_FLOAT: u8 = 4;
    const K_BOOL: u8 = 5;
    const K_STR: u8 = 6;
    const K_INTS: u8 = 7;
    const K_FLOATS: u8 = 8;
    const K_SYM: u8 = 9;
    const K_SYMS: u8 = 10;
    const K_DTYPE: u8 = 11;
    const K_BOOLS: u8 = 12;
    const K_OTHER: u8 = 13;

    fn bad(what: String) -> PyErr {
        PyValueError::new_err(format!("arfuse.fx: {what}"))
    }

    fn size(v: &Bound<'_, PyAny>) -> PyResult<FxSize> {
        match v.extract::<i64>() {
            Ok(n) => Ok(FxSize::Const(n)),
            Err(_) => Ok(FxSize::Expr(v.extract::<String>()?)),
        }
    }

    fn tensor(v: &Bound<'_, PyAny>) -> PyResult<FxTensor> {
        let (name, dtype, sizes): (String, i64, Bound<'_, PyList>) = v.extract()?;
        let sizes = sizes.iter().map(|s| size(&s)).collect::<PyResult<_>>()?;
        Ok(FxTensor { name, dtype, sizes })
    }

    fn arg(kind: u8, v: &Bound<'_, PyAny>) -> PyResult<FxArg> {
        Ok(match kind {
            K_TENSOR => FxArg::Tensor(v.extract()?),
            K_TENSORS => FxArg::tensors(v.extract()?),
            K_NONE => FxArg::None,
            K_INT => FxArg::Int(v.extract()?),
            K_FLOAT => FxArg::Float(v.extract()?),
            K_BOOL => FxArg::Bool(v.extract()?),
            K_STR => FxArg::Str(v.extract()?),
            K_INTS => FxArg::Ints(v.extract()?),
            K_FLOATS => FxArg::Floats(v.extract()?),
            K_SYM => FxArg::Sym(SymInt::Expr(v.extract()?)),
            K_SYMS => FxArg::Syms(
                v.cast::<PyList>()?
                    .iter()
                    .map(|s| size(&s).map(SymInt::from))
                    .collect::<PyResult<_>>()?,
            ),
            K_DTYPE => FxArg::Dtype(v.extract()?),
            K_BOOLS => FxArg::Bools(v.extract()?),
            K_OTHER => FxArg::other(v.extract::<String>()?),
            k => return Err(bad(format!("unknown argument kind {k}"))),
        })
    }

    fn node(
        name: String,
        target: String,
        args: &Bound<'_, PyAny>,
        outputs: &Bound<'_, PyAny>,
        module: Option<String>,
    ) -> PyResult<FxNode> {
        let mut parsed = Vec::new();
        for a in args.cast::<PyList>()?.iter() {
            let t = a.cast::<PyTuple>()?;
            let (arg_name, kind): (String, u8) =
                (t.get_item(0)?.extract()?, t.get_item(1)?.extract()?);
            let value = arg(kind, &t.get_item(2)?)
                .map_err(|e| bad(format!("node {name:?} argument {arg_name:?}: {e}")))?;
            parsed.push((arg_name, value));
        }
        let (tensors, other_outputs): (Bound<'_, PyList>, usize) = outputs.extract()?;
        let outputs = tensors
            .iter()
            .map(|t| tensor(&t))
            .collect::<PyResult<_>>()
            .map_err(|e| bad(format!("node {name:?} outputs: {e}")))?;
        Ok(FxNode {
            name,
            target,
            args: parsed,
            outputs,
            other_outputs,
            module,
        })
    }

    /// Reads an `arfuse.fx.Walked`.
    pub fn graph(w: &Bound<'_, PyAny>) -> PyResult<FxGraph> {
        let names: Bound<'_, PyList> = w.getattr("names")?.cast_into()?;
        let targets: Bound<'_, PyList> = w.getattr("targets")?.cast_into()?;
        let args: Bound<'_, PyList> = w.getattr("args")?.cast_into()?;
        let outputs: Bound<'_, PyList> = w.getattr("outputs")?.cast_into()?;
        let modules: Bound<'_, PyList> = w.getattr("modules")?.cast_into()?;
        let n = names.len();
        if [targets.len(), args.len(), outputs.len(), modules.len()] != [n; 4] {
            return Err(bad("the node lists differ in length".into()));
        }
        let mut nodes = Vec::with_capacity(n);
        for i in 0..n {
            nodes.push(node(
                names.get_item(i)?.extract()?,
                targets.get_item(i)?.extract()?,
                &args.get_item(i)?,
                &outputs.get_item(i)?,
                modules.get_item(i)?.extract()?,
            )?);
        }
        let inputs = w
            .getattr("inputs")?
            .cast::<PyList>()?
            .iter()
            .map(|t| tensor(&t))
            .collect::<PyResult<_>>()?;
        let symbols = w
            .getattr("symbols")?
            .cast::<PyList>()?
            .iter()
            .map(|s| {
                let (name, min, max): (String, Option<i64>, Option<i64>) = s.extract()?;
                Ok(FxSymbol { name, min, max })
            })
            .collect::<PyResult<_>>()?;
        Ok(FxGraph {
            inputs,
            nodes,
            outputs: w.getattr("graph_outputs")?.extract()?,
            symbols,
            torch_version: None,
        })
    }
}

/// Imports an FX graph in the compact form (`arfuse.fx.walk`), lowers it for `target`
/// and splices the result back (`arfuse::splice`). Returns (report JSON, report table,
/// splice JSON, import notes).
#[pyfunction]
#[pyo3(signature = (walked, target, group = None, all_reduce_ops = Vec::new(), opaque_ops = Vec::new()))]
pub fn _fx_lower_walked(
    py: Python<'_>,
    walked: &Bound<'_, PyAny>,
    target: &PyTarget,
    group: Option<String>,
    all_reduce_ops: Vec<String>,
    opaque_ops: Vec<(String, String)>,
) -> PyResult<(String, String, String, Vec<String>)> {
    let fx = compact::graph(walked)?;
    let mut opts = import_options(py, &all_reduce_ops)?;
    for (op, why) in opaque_ops {
        opts = opts.with_opaque_op(op, why);
    }
    let imported =
        arfuse::import::torch_export::fx::import(&fx, &opts).map_err(|e| load_error(py, &e))?;
    fx_finish(py, imported, target, group)
}

/// The compact FX form (`arfuse.fx.walk`) as JSON text (`arfuse_import::torch_export::fx::
/// FxGraph`'s serde form): what the pass imports, for a bug report or a benchmark.
#[pyfunction]
pub fn _fx_walked_json(walked: &Bound<'_, PyAny>) -> PyResult<String> {
    let fx = compact::graph(walked)?;
    serde_json::to_string(&fx)
        .map_err(|e| lower_argument_error(walked.py(), "walked", e.to_string()))
}
