//! `arfuse.Target`, `arfuse.plan`, `arfuse.Plan`, `arfuse.DispatchRange`: the policy
//! (`arfuse::advanced::policy`) from Python.

use crate::errors::{field_error, target_error};
use arfuse::advanced::policy::{
    self, ActDtype, Interconnect, KernelLibrary, RequestedBackend, UnfusedAllReduce,
};
use pyo3::basic::CompareOp;
use pyo3::prelude::*;
use serde::de::DeserializeOwned;

/// A value of one of the policy's enums from its TOML spelling (`"nvswitch"`, `"bf16"`),
/// or a `TargetError` naming the field.
fn parse_enum<T: DeserializeOwned>(py: Python<'_>, field: &'static str, s: &str) -> PyResult<T> {
    serde_json::from_value(serde_json::Value::String(s.to_string()))
        .map_err(|e| field_error(py, field, s, &e.to_string()))
}

/// The machine, the all-reduce group and the engine settings a plan is made for
/// (`arfuse::advanced::policy::Target`; every count is of the tensor-parallel group).
#[pyclass(frozen, module = "arfuse", name = "Target")]
#[derive(Clone)]
pub struct PyTarget {
    pub(crate) inner: policy::Target,
}

#[pymethods]
impl PyTarget {
    /// A target from keywords; the names, units and defaults are the TOML fields': a
    /// keyword left out (None) is a field left out of the TOML table, and
    /// `arfuse::advanced::policy::Target::from_toml_table` gives it the TOML default (so
    /// `multicast_all_ranks` follows the interconnect, as in a target file).
    #[new]
    #[pyo3(signature = (*, sm, world_size, gpus_per_node, interconnect, max_batched_tokens,
        group_nodes = None, multicast_all_ranks = None, dtype = None, capture_sizes = None,
        compile_range_boundaries = None, num_speculative_tokens = None, deterministic = None,
        unfused_all_reduce = None, requested_backend = None, kernels = None, max_bytes_override = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        sm: u32,
        world_size: u32,
        gpus_per_node: u32,
        interconnect: &str,
        max_batched_tokens: u64,
        group_nodes: Option<u32>,
        multicast_all_ranks: Option<bool>,
        dtype: Option<&str>,
        capture_sizes: Option<Vec<u64>>,
        compile_range_boundaries: Option<Vec<u64>>,
        num_speculative_tokens: Option<u64>,
        deterministic: Option<bool>,
        unfused_all_reduce: Option<&str>,
        requested_backend: Option<&str>,
        kernels: Option<&str>,
        max_bytes_override: Option<u64>,
    ) -> PyResult<PyTarget> {
        let mut t = toml::Table::new();
        let int = |v: u64| toml::Value::Integer(i64::try_from(v).unwrap_or(i64::MAX));
        let ints = |v: Vec<u64>| toml::Value::Array(v.into_iter().map(int).collect());
        t.insert("sm".into(), int(u64::from(sm)));
        t.insert("world_size".into(), int(u64::from(world_size)));
        t.insert("gpus_per_node".into(), int(u64::from(gpus_per_node)));
        t.insert("max_batched_tokens".into(), int(max_batched_tokens));
        // Enum spellings are checked here, so that the error names the keyword.
        parse_enum::<Interconnect>(py, "interconnect", interconnect)?;
        t.insert("interconnect".into(), interconnect.into());
        if let Some(v) = dtype {
            parse_enum::<ActDtype>(py, "dtype", v)?;
            t.insert("dtype".into(), v.into());
        }
        if let Some(v) = unfused_all_reduce {
            parse_enum::<UnfusedAllReduce>(py, "unfused_all_reduce", v)?;
            t.insert("unfused_all_reduce".into(), v.into());
        }
        if let Some(v) = requested_backend {
            parse_enum::<RequestedBackend>(py, "requested_backend", v)?;
            t.insert("requested_backend".into(), v.into());
        }
        if let Some(v) = kernels {
            parse_enum::<KernelLibrary>(py, "kernels", v)?;
            t.insert("kernels".into(), v.into());
        }
        let optional = [
            ("group_nodes", group_nodes.map(|v| int(u64::from(v)))),
            (
                "multicast_all_ranks",
                multicast_all_ranks.map(toml::Value::Boolean),
            ),
            ("capture_sizes", capture_sizes.map(ints)),
            (
                "compile_range_boundaries",
                compile_range_boundaries.map(ints),
            ),
            ("num_speculative_tokens", num_speculative_tokens.map(int)),
            ("deterministic", deterministic.map(toml::Value::Boolean)),
            ("max_bytes_override", max_bytes_override.map(int)),
        ];
        for (field, value) in optional {
            if let Some(v) = value {
                t.insert(field.into(), v);
            }
        }
        policy::Target::from_toml_table(t)
            .map(|inner| PyTarget { inner })
            .map_err(|e| target_error(py, &e))
    }

    /// A named preset (`h200-sxm-x8`, ...; see `preset_names()`).
    #[staticmethod]
    fn preset(py: Python<'_>, name: &str) -> PyResult<PyTarget> {
        policy::Target::preset(name)
            .map(|inner| PyTarget { inner })
            .map_err(|e| target_error(py, &e))
    }

    /// A target from TOML text (the format of `cargo xtask lower --target FILE`).
    #[staticmethod]
    fn from_toml(py: Python<'_>, text: &str) -> PyResult<PyTarget> {
        policy::Target::from_toml_str(text)
            .map(|inner| PyTarget { inner })
            .map_err(|e| target_error(py, &e))
    }

    /// The names `preset` accepts.
    #[staticmethod]
    fn preset_names() -> Vec<&'static str> {
        policy::Target::preset_names().to_vec()
    }

    /// The target as TOML text (round-trips through `from_toml`).
    fn to_toml(&self, py: Python<'_>) -> PyResult<String> {
        self.inner
            .to_toml_string()
            .map_err(|e| target_error(py, &e))
    }

    /// Pickles as `Target.from_toml(self.to_toml())`: an engine that sends its
    /// compilation config (holding a pass and its target) to worker processes pickles it.
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyAny>, (String,))> {
        let from_toml = py.get_type::<PyTarget>().getattr("from_toml")?;
        Ok((from_toml, (self.to_toml(py)?,)))
    }

    #[getter]
    fn sm(&self) -> u32 {
        self.inner.sm
    }
    #[getter]
    fn world_size(&self) -> u32 {
        self.inner.world_size
    }
    #[getter]
    fn group_nodes(&self) -> u32 {
        self.inner.group_nodes
    }
    #[getter]
    fn gpus_per_node(&self) -> u32 {
        self.inner.gpus_per_node
    }
    #[getter]
    fn multicast_all_ranks(&self) -> bool {
        self.inner.multicast_all_ranks
    }
    #[getter]
    fn interconnect(&self) -> &'static str {
        self.inner.interconnect.name()
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype.name()
    }
    #[getter]
    fn max_batched_tokens(&self) -> u64 {
        self.inner.max_batched_tokens
    }
    #[getter]
    fn capture_sizes(&self) -> Vec<u64> {
        self.inner.capture_sizes.clone()
    }
    #[getter]
    fn compile_range_boundaries(&self) -> Vec<u64> {
        self.inner.compile_range_boundaries.clone()
    }
    #[getter]
    fn num_speculative_tokens(&self) -> u64 {
        self.inner.num_speculative_tokens
    }
    #[getter]
    fn deterministic(&self) -> bool {
        self.inner.deterministic
    }
    #[getter]
    fn unfused_all_reduce(&self) -> &'static str {
        self.inner.unfused_all_reduce.name()
    }
    #[getter]
    fn requested_backend(&self) -> &'static str {
        self.inner.requested_backend.name()
    }
    #[getter]
    fn kernels(&self) -> &'static str {
        self.inner.kernels.name()
    }
    #[getter]
    fn max_bytes_override(&self) -> Option<u64> {
        self.inner.max_bytes_override
    }

    fn __richcmp__(&self, other: &Bound<'_, PyAny>, op: CompareOp) -> PyResult<Py<PyAny>> {
        let py = other.py();
        let Ok(other) = other.cast::<PyTarget>() else {
            return Ok(py.NotImplemented());
        };
        let eq = self.inner == other.get().inner;
        Ok(match op {
            CompareOp::Eq => eq.into_pyobject(py)?.to_owned().into_any().unbind(),
            CompareOp::Ne => (!eq).into_pyobject(py)?.to_owned().into_any().unbind(),
            _ => py.NotImplemented(),
        })
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.inner.to_toml_string().unwrap_or_default().hash(&mut h);
        h.finish()
    }

    fn __repr__(&self) -> String {
        let t = &self.inner;
        format!(
            "Target(sm={}, world_size={}, gpus_per_node={}, interconnect={:?}, \
             max_batched_tokens={}, group_nodes={}, multicast_all_ranks={}, dtype={:?}, \
             capture_sizes={:?}, compile_range_boundaries={:?}, num_speculative_tokens={}, \
             deterministic={}, unfused_all_reduce={:?}, requested_backend={:?}, kernels={:?}, max_bytes_override={})",
            t.sm,
            t.world_size,
            t.gpus_per_node,
            t.interconnect.name(),
            t.max_batched_tokens,
            t.group_nodes,
            py_bool(t.multicast_all_ranks),
            t.dtype.name(),
            t.capture_sizes,
            t.compile_range_boundaries,
            t.num_speculative_tokens,
            py_bool(t.deterministic),
            t.unfused_all_reduce.name(),
            t.requested_backend.name(),
            t.kernels.name(),
            t.max_bytes_override
                .map(|b| b.to_string())
                .unwrap_or_else(|| "None".into()),
        )
    }
}

fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

/// One token range of a dispatch: `lo..=hi` tokens run with `strategy`.
#[pyclass(frozen, module = "arfuse", name = "DispatchRange")]
#[derive(Clone)]
pub struct PyDispatchRange {
    inner: policy::DispatchRange,
}

#[pymethods]
impl PyDispatchRange {
    /// First token count (inclusive).
    #[getter]
    fn lo(&self) -> u64 {
        self.inner.lo
    }
    /// Last token count (inclusive).
    #[getter]
    fn hi(&self) -> u64 {
        self.inner.hi
    }
    /// `one-shot`, `two-shot` or `unfused`.
    #[getter]
    fn strategy(&self) -> &'static str {
        self.inner.strategy.name()
    }
    /// Bytes of one buffer the largest call of the range needs (0 when unfused).
    #[getter]
    fn required_bytes(&self) -> u64 {
        self.inner.required_bytes_max
    }
    /// Bytes of the buffer the strategy uses (0 when unfused).
    #[getter]
    fn available_bytes(&self) -> u64 {
        self.inner.available_bytes
    }
    /// Why this strategy for these token counts.
    #[getter]
    fn reason(&self) -> &str {
        &self.inner.reason
    }
    fn __repr__(&self) -> String {
        format!(
            "DispatchRange(lo={}, hi={}, strategy={:?}, required_bytes={})",
            self.inner.lo,
            self.inner.hi,
            self.inner.strategy.name(),
            self.inner.required_bytes_max
        )
    }
    fn __str__(&self) -> String {
        self.inner.to_string()
    }
}

/// A verified plan (`arfuse::advanced::policy::Plan`): backend, workspace and the dispatch by token
/// count of every hidden size.
#[pyclass(frozen, module = "arfuse", name = "Plan")]
pub struct PyPlan {
    inner: policy::Plan,
}

#[pymethods]
impl PyPlan {
    /// `trtllm` or `mnnvl`, or None when the plan does not fuse.
    #[getter]
    fn backend(&self) -> Option<&'static str> {
        self.inner.backend().map(|b| b.name())
    }
    /// Why this backend (or why no fusion).
    #[getter]
    fn reason(&self) -> &str {
        self.inner.decision.reason()
    }
    /// The kernels planned for (`arfuse`, `flashinfer`).
    #[getter]
    fn kernels(&self) -> &'static str {
        self.inner.kernels.name()
    }
    /// Whether every path of the plan (each fused strategy and the unfused one) reduces
    /// in one order, so a token's outputs do not depend on its batch.
    #[getter]
    fn batch_invariant(&self) -> bool {
        self.inner.batch_invariant
    }
    /// Largest fused token count M (0 when not fusing).
    #[getter]
    fn max_token_num(&self) -> u64 {
        self.inner.max_token_num
    }
    /// Bytes per rank of the planned workspace (the kernels' whole allocation), or None.
    #[getter]
    fn workspace_bytes(&self) -> Option<u64> {
        self.inner
            .workspace
            .as_ref()
            .map(|w| w.total_bytes_per_rank)
    }
    /// Bytes of ONE Lamport buffer of the planned workspace, or None.
    #[getter]
    fn lamport_buffer_bytes(&self) -> Option<u64> {
        self.inner
            .workspace
            .as_ref()
            .map(|w| w.lamport_buffer_bytes)
    }
    /// For a plan of arfuse's kernels: bytes per rank FlashInfer's sizing would allocate
    /// for the same target, backend, hidden size and M (`Plan.flashinfer_workspace`).
    #[getter]
    fn flashinfer_workspace_bytes(&self) -> Option<u64> {
        self.inner
            .flashinfer_workspace
            .as_ref()
            .map(|w| w.total_bytes_per_rank)
    }
    /// The hidden sizes planned, widest first.
    #[getter]
    fn hidden_sizes(&self) -> Vec<u64> {
        self.inner.sites.iter().map(|s| s.hidden).collect()
    }
    /// The dispatch of the widest hidden size: ranges covering 1..=max planned tokens.
    #[getter]
    fn dispatch(&self) -> Vec<PyDispatchRange> {
        ranges(self.inner.dispatch())
    }
    /// The dispatch of one planned hidden size.
    fn dispatch_for(&self, py: Python<'_>, hidden: u64) -> PyResult<Vec<PyDispatchRange>> {
        self.inner
            .dispatch_for_hidden(hidden)
            .map(|r| ranges(&r))
            .map_err(|e| target_error(py, &e))
    }
    /// Every decision taken, as sentences.
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.inner.notes.clone()
    }
    /// The whole plan as JSON text (the policy's serde form).
    fn to_json(&self) -> String {
        serde_json::to_string_pretty(&self.inner).unwrap_or_default()
    }
    fn __str__(&self) -> String {
        self.inner.summary()
    }
    fn __repr__(&self) -> String {
        format!(
            "<arfuse.Plan backend={} max_token_num={} workspace_bytes={}>",
            self.backend().unwrap_or("None"),
            self.inner.max_token_num,
            self.workspace_bytes()
                .map(|b| b.to_string())
                .unwrap_or_else(|| "None".into())
        )
    }
}

fn ranges(r: &[policy::DispatchRange]) -> Vec<PyDispatchRange> {
    r.iter()
        .map(|inner| PyDispatchRange {
            inner: inner.clone(),
        })
        .collect()
}

/// Plans `target` for these hidden sizes (elements): `arfuse::advanced::policy::plan`.
#[pyfunction]
pub fn plan(py: Python<'_>, target: &PyTarget, hidden_sizes: Vec<u64>) -> PyResult<PyPlan> {
    policy::plan(&target.inner, &hidden_sizes)
        .map(|inner| PyPlan { inner })
        .map_err(|e| target_error(py, &e))
}
