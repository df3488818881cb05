//! The fused op's kernels on real ranks (issue 43): `arfuse.torch` runs
//! `torch.ops.arfuse.fused_allreduce_rms_norm` on CPU tensors through the host device
//! (`arfuse_runtime::host`): arfuse's own kernel sources, compiled for the CPU, across
//! the processes of the engine's `torch.distributed` group, over a workspace in shared
//! memory that the ranks create together ([`RankWorkspace::create`]: backend vote,
//! allocation, mapping, all or nothing).
//!
//! The group is a Python object (`arfuse.torch._TorchGroup`) with `rank`, `world_size`
//! and `all_gather(bytes) -> list[bytes]`, over the engine's process group.

use arfuse_runtime::device::{FusedCall, KernelParams, RankTensor, DEFAULT_TIMEOUT_NS};
use arfuse_runtime::group::Group;
use arfuse_runtime::host::{Build, Compiler, LaunchOptions, RankOptions, RankWorkspace};
use arfuse_runtime::variants::{self, ActDtype, Epilogue, KernelKind, Quant, Strategy};
use arfuse_runtime::workspace::Backend;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// Tokens per fused call at most: the workspace holds this many, and a larger T runs
/// as consecutive fused calls of at most this many tokens (each token's result depends
/// on its own row only, so the split changes no bit).
pub const HOST_CALL_TOKENS: u32 = 64;
/// Calls of at most this many tokens run one-shot, larger ones two-shot (both reduce
/// in rank order from +0.0, so the choice changes no bit; it only exercises both).
pub const HOST_ONE_SHOT_TOKENS: u32 = 16;
/// CTAs per rank of a host launch (each is an OS thread).
const HOST_CTAS: u32 = 4;

/// A [`Group`] over a Python object (the engine's process group, wrapped by
/// `arfuse.torch._TorchGroup`).
struct PyGroup {
    obj: Py<PyAny>,
    rank: u32,
    world: u32,
}

impl Group for PyGroup {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world_size(&self) -> u32 {
        self.world
    }

    fn all_gather(&self, mine: &[u8]) -> arfuse_runtime::Result<Vec<Vec<u8>>> {
        Python::attach(|py| -> PyResult<Vec<Vec<u8>>> {
            let out = self
                .obj
                .call_method1(py, "all_gather", (PyBytes::new(py, mine),))?;
            out.extract::<Vec<Vec<u8>>>(py)
        })
        .map_err(|e| arfuse_runtime::Error::Group(format!("torch.distributed all-gather: {e}")))
    }
}

fn dtype_of(name: &str) -> PyResult<ActDtype> {
    match name {
        "bfloat16" => Ok(ActDtype::Bf16),
        "float16" => Ok(ActDtype::F16),
        "float32" => Ok(ActDtype::F32),
        _ => Err(PyValueError::new_err(format!(
            "dtype {name} is not bfloat16, float16 or float32"
        ))),
    }
}

fn quant_of(name: &str) -> PyResult<Quant> {
    match name {
        "none" => Ok(Quant::None),
        "fp8_per_token" => Ok(Quant::Fp8PerToken),
        other => Err(PyValueError::new_err(format!(
            "quant epilogue {other:?}: the op runs none and fp8_per_token"
        ))),
    }
}

/// The host compiler shared by every workspace of this process, caching its objects
/// under `ARFUSE_HOST_CACHE`, else `$XDG_CACHE_HOME/arfuse/host-kernels`, else
/// `~/.cache/arfuse/host-kernels`.
fn compiler() -> PyResult<Arc<Compiler>> {
    static COMPILER: OnceLock<Result<Arc<Compiler>, String>> = OnceLock::new();
    COMPILER
        .get_or_init(|| {
            let dir = std::env::var_os("ARFUSE_HOST_CACHE")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("XDG_CACHE_HOME")
                        .map(|c| PathBuf::from(c).join("arfuse/host-kernels"))
                })
                .or_else(|| {
                    std::env::var_os("HOME")
                        .map(|h| PathBuf::from(h).join(".cache/arfuse/host-kernels"))
                })
                .unwrap_or_else(|| std::env::temp_dir().join("arfuse-host-kernels"));
            Compiler::new(dir).map(Arc::new).map_err(|e| e.to_string())
        })
        .clone()
        .map_err(PyRuntimeError::new_err)
}

fn runtime_err(e: arfuse_runtime::Error) -> PyErr {
    PyRuntimeError::new_err(format!("arfuse: {e}"))
}

/// One rank's workspace of the fused op for (group, dtype, H), made on the first call.
#[pyclass(name = "_HostRanks", unsendable)]
pub struct HostRanks {
    ws: RankWorkspace,
    group: PyGroup,
    compiler: Arc<Compiler>,
    dtype: ActDtype,
    hidden: u32,
    timeout_ns: u64,
    /// Why the workspace cannot be used any more (a reset that failed).
    broken: Option<String>,
}

#[pymethods]
impl HostRanks {
    /// Creates the workspace across the group (collective: every rank calls it).
    /// `max_bytes` limits this rank's allocation; `timeout_ms` is the kernels' polling
    /// timeout (None: `DEFAULT_TIMEOUT_NS`).
    #[new]
    #[pyo3(signature = (group, dtype, hidden, max_bytes=None, timeout_ms=None))]
    fn new(
        group: Bound<'_, PyAny>,
        dtype: &str,
        hidden: u32,
        max_bytes: Option<u64>,
        timeout_ms: Option<u64>,
    ) -> PyResult<HostRanks> {
        let dtype = dtype_of(dtype)?;
        let rank: u32 = group.getattr("rank")?.extract()?;
        let world: u32 = group.getattr("world_size")?.extract()?;
        let group = PyGroup {
            obj: group.unbind(),
            rank,
            world,
        };
        let compiler = compiler()?;
        let request = arfuse_runtime::check::workspace_for(world, dtype, hidden, HOST_CALL_TOKENS)
            .map_err(runtime_err)?;
        let opts = RankOptions::default().with_max_bytes(max_bytes);
        let ws = RankWorkspace::create(&group, &request, &[Backend::Trtllm], &opts)
            .map_err(runtime_err)?;
        Ok(HostRanks {
            ws,
            group,
            compiler,
            dtype,
            hidden,
            timeout_ns: timeout_ms.map_or(DEFAULT_TIMEOUT_NS, |ms| ms.saturating_mul(1_000_000)),
            broken: None,
        })
    }

    /// Bytes of this rank's workspace.
    #[getter]
    fn bytes_per_rank(&self) -> u64 {
        self.ws.layout.bytes_per_rank
    }

    /// The fused op on this rank for `numel` elements at `x` (rows of H; the tensors'
    /// addresses as in `arfuse.torch`): writes `norm_out`, `residual_out` and, for
    /// `fp8_per_token`, `quant_out` and `scale_out`. Every rank makes the same call
    /// (same T, same `call_tag`). A failed call (a timeout, a peer's abort, ranks that
    /// disagree) resets the workspace on every rank and raises `RuntimeError`.
    #[pyo3(signature = (x, residual, weight, weight_dtype, numel, eps, weight_bias,
        norm_round_twice, norm_f32_sum, quant, norm_out, residual_out, quant_out, scale_out,
        call_tag))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        x: usize,
        residual: usize,
        weight: usize,
        weight_dtype: &str,
        numel: usize,
        eps: f64,
        weight_bias: f64,
        norm_round_twice: bool,
        norm_f32_sum: bool,
        quant: &str,
        norm_out: usize,
        residual_out: usize,
        quant_out: usize,
        scale_out: usize,
        call_tag: u32,
    ) -> PyResult<()> {
        if let Some(why) = &self.broken {
            return Err(PyRuntimeError::new_err(format!(
                "arfuse: this workspace is unusable after a failed reset: {why}"
            )));
        }
        let quant = quant_of(quant)?;
        let gamma_f32 = match dtype_of(weight_dtype)? {
            w if w == self.dtype => false,
            ActDtype::F32 => true,
            w => {
                return Err(PyValueError::new_err(format!(
                    "weight dtype {w} with {} activations",
                    self.dtype
                )))
            }
        };
        let hidden = self.hidden as usize;
        if numel == 0 || numel % hidden != 0 || x == 0 || weight == 0 || norm_out == 0 {
            return Err(PyValueError::new_err(format!(
                "{numel} elements do not form rows of hidden size {hidden}, or a null pointer"
            )));
        }
        let tokens = u32::try_from(numel / hidden)
            .map_err(|_| PyValueError::new_err("more than 2^32 tokens"))?;
        let e = self.dtype.element_bytes() as usize;
        let base = KernelParams {
            gamma: weight as u64,
            eps: eps as f32,
            weight_bias: weight_bias as f32,
            gamma_f32: i32::from(gamma_f32),
            norm_round_twice: i32::from(norm_round_twice),
            norm_f32_sum: i32::from(norm_f32_sum),
            timeout_ns: self.timeout_ns,
            call_tag,
            ..KernelParams::default()
        };
        let mut start = 0u32;
        while start < tokens {
            let t = (tokens - start).min(HOST_CALL_TOKENS);
            let row = start as usize * hidden;
            let at = |ptr: usize, bytes_per_elem: usize| -> RankTensor {
                RankTensor {
                    ptr: if ptr == 0 {
                        0
                    } else {
                        (ptr + row * bytes_per_elem) as u64
                    },
                    rank_stride: 0,
                }
            };
            let fp8 = quant == Quant::Fp8PerToken;
            let params = KernelParams {
                x: at(x, e),
                residual_in: at(residual, e),
                residual_out: at(residual_out, e),
                out: at(norm_out, e),
                quant_out: if fp8 {
                    at(quant_out, 1)
                } else {
                    RankTensor::default()
                },
                scale_out: if fp8 {
                    RankTensor {
                        ptr: (scale_out + start as usize * 4) as u64,
                        rank_stride: 0,
                    }
                } else {
                    RankTensor::default()
                },
                ..base
            };
            self.call(t, residual != 0, quant, params)?;
            start += t;
        }
        Ok(())
    }
}

impl HostRanks {
    /// One fused call of `tokens` tokens; on failure the collective reset.
    fn call(
        &mut self,
        tokens: u32,
        residual: bool,
        quant: Quant,
        params: KernelParams,
    ) -> PyResult<()> {
        let world = self.group.world;
        let strategy = if tokens <= HOST_ONE_SHOT_TOKENS || tokens < world {
            Strategy::OneShot
        } else {
            Strategy::TwoShot
        };
        let epilogue = Epilogue {
            residual,
            norm: true,
            quant,
        };
        let variant = variants::find(KernelKind::Fused { strategy, world }, self.dtype, epilogue)
            .ok_or_else(|| {
            PyValueError::new_err(format!(
                "no fused kernel for W = {world}, {}, {}",
                self.dtype,
                epilogue.name()
            ))
        })?;
        let kernel = self
            .compiler
            .kernel(&variant, Build::Plain)
            .map_err(runtime_err)?;
        let call = FusedCall {
            variant,
            tokens,
            hidden: self.hidden,
            ranks: world,
            params,
        };
        // SAFETY: the tensor addresses are those of live, contiguous CPU tensors that
        // `arfuse.torch` checked (dtype, element count) and keeps alive for the call.
        let res = unsafe {
            self.ws
                .launch(&kernel, &call, HOST_CTAS, &LaunchOptions::default())
        };
        let Err(e) = res else { return Ok(()) };
        match self.ws.reset(&self.group) {
            Ok(()) => Err(PyRuntimeError::new_err(format!(
                "arfuse: {e} (the workspace was reset on every rank)"
            ))),
            Err(r) => {
                self.broken = Some(r.to_string());
                Err(PyRuntimeError::new_err(format!(
                    "arfuse: {e}; resetting the workspace failed: {r}"
                )))
            }
        }
    }
}
