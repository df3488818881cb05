//! Import, lower and splice: the work behind `arfuse.lower` and `arfuse.torch.FusionPass`.
//! The Python side only turns its inputs into bytes (docs/fx-graph-format.md) and builds
//! its result objects from what is returned here.

use crate::errors::{load_error, lower_argument_error, lower_error, splice_error};
use crate::target::PyTarget;
use arfuse::advanced::import::{load_any_with, CustomAllReduce, ImportOptions, Imported};
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
                .map_err(|e: arfuse::advanced::import::CustomAllReduceParseError| {
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

/// Imports `data` (any format `arfuse::advanced::import::load_any` detects) and lowers it for
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

/// Walks an FX graph (`crate::walk`), imports it, lowers it for `target` and splices the
/// result back (`arfuse::splice`). `opaque_ops`: `(op, reason)` pairs kept opaque. Returns
/// (report JSON, report table, splice JSON, import notes).
#[pyfunction]
#[pyo3(signature = (graph, target, group = None, all_reduce_ops = Vec::new(), opaque_ops = Vec::new()))]
pub fn _fx_lower_graph(
    py: Python<'_>,
    graph: &Bound<'_, PyAny>,
    target: &PyTarget,
    group: Option<String>,
    all_reduce_ops: Vec<String>,
    opaque_ops: Vec<(String, String)>,
) -> PyResult<(String, String, String, Vec<String>)> {
    let fx = crate::walk::walk(graph)?;
    let mut opts = import_options(py, &all_reduce_ops)?;
    for (op, why) in opaque_ops {
        opts = opts.with_opaque_op(op, why);
    }
    let imported = arfuse::advanced::import::torch_export::fx::import(&fx, &opts)
        .map_err(|e| load_error(py, &e))?;
    fx_finish(py, imported, target, group)
}

/// An FX graph in the compact form as JSON text (`arfuse_import::torch_export::fx::FxGraph`'s
/// serde form): what the pass imports, for a bug report or a benchmark
/// (`examples/fx_pass_cost.rs`).
#[pyfunction]
pub fn _fx_graph_json(graph: &Bound<'_, PyAny>) -> PyResult<String> {
    let fx = crate::walk::walk(graph)?;
    serde_json::to_string(&fx).map_err(|e| lower_argument_error(graph.py(), "graph", e.to_string()))
}
