//! The Python exception classes, and the conversion of every Rust error into one of them
//! with the node, tensor or field it names kept as attributes.

use arfuse::advanced::import::ImportError;
use arfuse::advanced::ir::{LoadError as IrLoadError, Problems};
use arfuse::advanced::policy::PolicyError;
use arfuse::splice::SpliceError;
use arfuse::LowerError as RustLowerError;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use pyo3::PyTypeInfo;

pyo3::create_exception!(
    arfuse,
    ArfuseError,
    PyException,
    "Base class of every error arfuse raises. `kind` names the error class \
     (`missing_tensor`, `invalid_field`, ...)."
);
pyo3::create_exception!(
    arfuse,
    LoadError,
    ArfuseError,
    "A graph could not be read (arfuse JSON, torch.export JSON, .pt2 or FX). \
     Attributes: kind, node, tensor, location, problems."
);
pyo3::create_exception!(
    arfuse,
    TargetError,
    ArfuseError,
    "A target is wrong (a field, a preset name, TOML, a hidden size the kernels cannot \
     run). Attributes: kind, field, value, reason."
);
pyo3::create_exception!(
    arfuse,
    LowerError,
    ArfuseError,
    "The lowering gave no graph (invalid graph, ambiguous group, world-size mismatch, \
     stale plan, runner limits). Attributes: kind, node, problems."
);

/// An exception of class `E` with message `msg` and the given attributes set on it.
fn raise<E: PyTypeInfo>(
    py: Python<'_>,
    msg: String,
    attrs: Vec<(&'static str, Py<PyAny>)>,
) -> PyErr {
    let err = PyErr::new::<E, _>(msg);
    let value = err.value(py);
    for (k, v) in attrs {
        if let Err(e) = value.setattr(k, v) {
            return e;
        }
    }
    err
}

fn opt(py: Python<'_>, s: Option<&str>) -> Py<PyAny> {
    match s {
        Some(s) => s
            .into_pyobject(py)
            .map(|o| o.into_any().unbind())
            .unwrap_or_else(|_| py.None()),
        None => py.None(),
    }
}

/// `[(location, message), ...]` of validation problems.
fn problem_list(py: Python<'_>, p: Option<&Problems>) -> Py<PyAny> {
    let items: Vec<(String, String)> = p
        .map(|p| {
            p.list
                .iter()
                .map(|x| (x.location.clone(), x.message.clone()))
                .collect()
        })
        .unwrap_or_default();
    let tuples: Vec<Bound<'_, PyTuple>> = items
        .into_iter()
        .filter_map(|(a, b)| PyTuple::new(py, [a, b]).ok())
        .collect();
    tuples
        .into_pyobject(py)
        .map(|o| o.into_any().unbind())
        .unwrap_or_else(|_| py.None())
}

/// A `LoadError` from the importer.
pub fn load_error(py: Python<'_>, e: &ImportError) -> PyErr {
    let (kind, node, tensor, location, problems): (
        &str,
        Option<&str>,
        Option<&str>,
        Option<String>,
        Option<&Problems>,
    ) = match e {
        ImportError::TooLarge { what, .. } => ("too_large", None, None, Some(what.clone()), None),
        ImportError::UnknownFormat { .. } => ("unknown_format", None, None, None, None),
        ImportError::Arfuse(inner) => match inner {
            IrLoadError::Json { line, column, .. } => (
                "json",
                None,
                None,
                Some(format!("line {line}, column {column}")),
                None,
            ),
            IrLoadError::Invalid(p) => (
                "invalid_graph",
                p.list.first().map(|x| x.location.as_str()),
                None,
                None,
                Some(p),
            ),
            _ => ("arfuse_json", None, None, None, None),
        },
        ImportError::Utf8 { offset } => {
            ("utf8", None, None, Some(format!("offset {offset}")), None)
        }
        ImportError::Json { line, column, .. } => (
            "json",
            None,
            None,
            Some(format!("line {line}, column {column}")),
            None,
        ),
        ImportError::SchemaVersion { .. } => ("schema_version", None, None, None, None),
        ImportError::Malformed { location, .. } => {
            ("malformed", None, None, Some(location.clone()), None)
        }
        ImportError::MissingTensor { node, tensor } => (
            "missing_tensor",
            Some(node.as_str()),
            Some(tensor.as_str()),
            None,
            None,
        ),
        ImportError::MissingMetadata { node, tensor } => (
            "missing_metadata",
            Some(node.as_str()),
            Some(tensor.as_str()),
            None,
            None,
        ),
        ImportError::UnsupportedDtype { tensor, .. } => {
            ("unsupported_dtype", None, Some(tensor.as_str()), None, None)
        }
        ImportError::Dimension { tensor, dim, .. } => (
            "dimension",
            None,
            Some(tensor.as_str()),
            Some(format!("dimension {dim}")),
            None,
        ),
        ImportError::Gzip { .. } => ("gzip", None, None, None, None),
        ImportError::Archive { .. } => ("archive", None, None, None, None),
        ImportError::Limit { what, .. } => ("limit", None, None, Some(what.clone()), None),
        ImportError::Build(b) => ("build", Some(b.id.as_str()), None, None, None),
        ImportError::Invalid(p) => (
            "invalid_graph",
            p.list.first().map(|x| x.location.as_str()),
            None,
            None,
            Some(p),
        ),
        // ImportError is non-exhaustive: a kind added later reads as "other" until it
        // has a name here.
        _ => ("other", None, None, None, None),
    };
    raise::<LoadError>(
        py,
        e.to_string(),
        vec![
            ("kind", opt(py, Some(kind))),
            ("node", opt(py, node)),
            ("tensor", opt(py, tensor)),
            ("location", opt(py, location.as_deref())),
            ("problems", problem_list(py, problems)),
        ],
    )
}

/// A `TargetError` from the policy.
pub fn target_error(py: Python<'_>, e: &PolicyError) -> PyErr {
    let (kind, field, value, reason): (&str, Option<&str>, Option<String>, Option<String>) = match e
    {
        PolicyError::InvalidField {
            field,
            value,
            reason,
        } => (
            "invalid_field",
            Some(field),
            Some(value.clone()),
            Some(reason.clone()),
        ),
        PolicyError::Toml(m) => ("toml", None, None, Some(m.clone())),
        PolicyError::UnknownPreset { name, known } => (
            "unknown_preset",
            None,
            Some(name.clone()),
            Some(format!("known presets: {known}")),
        ),
        PolicyError::TrtllmAcrossNodes { nodes } => (
            "trtllm_across_nodes",
            Some("requested_backend"),
            Some("trtllm".into()),
            Some(format!("the all-reduce group spans {nodes} nodes")),
        ),
        PolicyError::BackendUnavailable { requested, reason } => (
            "backend_unavailable",
            Some("requested_backend"),
            Some(requested.clone()),
            Some(reason.clone()),
        ),
        PolicyError::InvalidHidden { hidden, reason } => (
            "invalid_hidden",
            Some("hidden_sizes"),
            Some(hidden.to_string()),
            Some(reason.clone()),
        ),
        PolicyError::InvalidTokens { t, reason } => (
            "invalid_tokens",
            None,
            Some(t.to_string()),
            Some(reason.clone()),
        ),
        PolicyError::Overflow { what } => ("overflow", None, None, Some(what.to_string())),
        PolicyError::WorkspaceMismatch { reason } => {
            ("workspace_mismatch", None, None, Some(reason.clone()))
        }
        PolicyError::Internal { details } => ("internal", None, None, Some(details.clone())),
        PolicyError::NoPresetForWorldSize {
            world_size,
            candidates,
            known,
        } => (
            "no_preset_for_world_size",
            Some("world_size"),
            Some(world_size.to_string()),
            Some(if candidates.is_empty() {
                format!("the presets have world sizes {known}")
            } else {
                format!("presets with this world size: {candidates}")
            }),
        ),
        // Non-exhaustive: a kind added later reads as "other" until it has a name here.
        _ => ("other", None, None, Some(e.to_string())),
    };
    raise::<TargetError>(
        py,
        e.to_string(),
        vec![
            ("kind", opt(py, Some(kind))),
            ("field", opt(py, field)),
            ("value", opt(py, value.as_deref())),
            ("reason", opt(py, reason.as_deref())),
        ],
    )
}

/// A `TargetError` naming one argument of a Python call (a keyword of `Target(...)`).
pub fn field_error(py: Python<'_>, field: &'static str, value: &str, reason: &str) -> PyErr {
    target_error(
        py,
        &PolicyError::InvalidField {
            field,
            value: value.to_string(),
            reason: reason.to_string(),
        },
    )
}

/// A `LowerError` (or, for a wrong target, a `TargetError`) from the rewrite.
pub fn lower_error(py: Python<'_>, e: &RustLowerError) -> PyErr {
    let (kind, node, problems): (&str, Option<&str>, Option<&Problems>) = match e {
        RustLowerError::Policy(p) => return target_error(py, p),
        RustLowerError::InvalidGraph(p) => (
            "invalid_graph",
            p.list.first().map(|x| x.location.as_str()),
            Some(p),
        ),
        RustLowerError::AmbiguousGroup { .. } => ("ambiguous_group", None, None),
        RustLowerError::NotSaturated { .. } => ("not_saturated", None, None),
        RustLowerError::WorldSizeMismatch { .. } => ("world_size_mismatch", None, None),
        RustLowerError::StalePlan { node, .. } => ("stale_plan", Some(node.as_str()), None),
        RustLowerError::Internal(_) => ("internal", None, None),
        // Non-exhaustive: a kind added later reads as "other" until it has a name here.
        _ => ("other", None, None),
    };
    raise::<LowerError>(
        py,
        e.to_string(),
        vec![
            ("kind", opt(py, Some(kind))),
            ("node", opt(py, node)),
            ("problems", problem_list(py, problems)),
        ],
    )
}

/// A `LowerError` for a lowered graph that does not splice back into its FX graph.
pub fn splice_error(py: Python<'_>, e: &SpliceError) -> PyErr {
    let node = match e {
        SpliceError::Mismatch { node, .. } => Some(node.as_str()),
        SpliceError::Shape(_) => None,
        _ => None,
    };
    raise::<LowerError>(
        py,
        e.to_string(),
        vec![
            ("kind", opt(py, Some("splice"))),
            ("node", opt(py, node)),
            ("problems", problem_list(py, None)),
        ],
    )
}

/// A `LowerError` with `kind` and no node (bad arguments of the lowering).
pub fn lower_argument_error(py: Python<'_>, kind: &str, msg: String) -> PyErr {
    raise::<LowerError>(
        py,
        msg,
        vec![
            ("kind", opt(py, Some(kind))),
            ("node", opt(py, None)),
            ("problems", problem_list(py, None)),
        ],
    )
}
