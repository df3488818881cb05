//! The fused op's kernels on real ranks (issue 43): `arfuse.torch` runs
//! `torch.ops.arfuse.fused_allreduce_rms_norm` on CPU tensors through the host device
//! (`arfuse_runtime::host`): arfuse's own kernel sources, compiled for the CPU, across
//! the processes of the engine's `torch.distributed` group, over a workspace in shared
//! memory that the ranks create together ([`RankWorkspace::create`]: backend vote,
//! allocation, mapping, all or nothing).
//!
//! CUDA tensors run through the CUDA device (`_CudaRanks`, over
//! `arfuse_runtime::cuda::ipc::IpcWorkspace`: CUDA IPC or fabric handles between the
//! ranks' processes) on
//! torch's current stream: the workspace and the kernels are made on the first call
//! outside a capture; a captured call only launches. NOT YET RUN ON A GPU.
//!
//! The group is a Python object (`arfuse.torch._TorchGroup`) with `rank`, `world_size`
//! and `all_gather(bytes) -> list[bytes]`, over the engine's process group.

use arfuse_runtime::cuda::ipc::IpcWorkspace;
use arfuse_runtime::cuda::Gpu;
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
pub const CALL_TOKENS: u32 = 64;
/// Calls of at most this many tokens run one-shot, larger ones two-shot (both reduce
/// in rank order from +0.0, so the choice changes no bit; it only exercises both).
pub const ONE_SHOT_TOKENS: u32 = 16;
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

pub fn dtype_of(name: &str) -> PyResult<ActDtype> {
    match name {
        "bfloat16" => Ok(ActDtype::Bf16),
        "float16" => Ok(ActDtype::F16),
        "float32" => Ok(ActDtype::F32),
        _ => Err(PyValueError::new_err(format!(
            "dtype {name} is not bfloat16, float16 or float32"
        ))),
    }
}

/// A quant output tensor as `arfuse.torch` passes it: (address, bytes); (0, 0) when
/// the epilogue has no such output.
pub type OutBuf = (usize, usize);

/// The op's name of a quant epilogue (the `quant` argument of
/// `torch.ops.arfuse.fused_allreduce_rms_norm`): the IR's quant kind (`none`,
/// `fp8_static`, `fp8_per_token`), and for the forms with a scale layout
/// `kind:layout` (`fp8_per_token_group:packed_ue8m0`, `nvfp4:swizzled_128x4`, ...).
pub fn op_quant_name(q: Quant) -> String {
    match q {
        Quant::None => "none".into(),
        Quant::Fp8Static => "fp8_static".into(),
        Quant::Fp8PerToken => "fp8_per_token".into(),
        Quant::Fp8Group(l) => format!("fp8_per_token_group:{}", l.name()),
        Quant::Nvfp4(l) => format!("nvfp4:{}", l.name()),
    }
}

/// The op's quant epilogue names, in the kernels' order (`_arfuse.OP_QUANTS`).
pub fn op_quant_names() -> Vec<String> {
    Quant::ALL.into_iter().map(op_quant_name).collect()
}

/// The op names of the quant epilogues that read a scale input
/// (`_arfuse.SCALE_INPUT_QUANTS`).
pub fn scale_input_quant_names() -> Vec<String> {
    Quant::ALL
        .into_iter()
        .filter(|q| q.takes_scale_input())
        .map(op_quant_name)
        .collect()
}

/// The quant epilogue of an op name ([`op_quant_name`]).
pub fn quant_of(name: &str) -> PyResult<Quant> {
    Quant::ALL
        .into_iter()
        .find(|&q| op_quant_name(q) == name)
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "quant epilogue {name:?} is not one of {}",
                op_quant_names().join(", ")
            ))
        })
}

/// Checks the quant tensors of a call of `quant` on `tokens` rows of `hidden` elements
/// of `dtype`: the kernels run the quant on such rows, the data and scale outputs hold
/// exactly the bytes the kernels' layouts take
/// (`arfuse_runtime::check::quant_bytes_of`), and a static FP8 or NVFP4 call has its
/// scale input.
///
/// # Errors
/// `ValueError` naming the tensor.
pub fn check_quant_tensors(
    quant: Quant,
    dtype: ActDtype,
    tokens: u32,
    hidden: u32,
    quant_out: OutBuf,
    scale_out: OutBuf,
    scale_in: usize,
) -> PyResult<()> {
    if let Some(why) = quant.unsupported(u64::from(hidden), dtype) {
        return Err(PyValueError::new_err(why));
    }
    let (qb, sb) =
        arfuse_runtime::check::quant_bytes_of(quant, tokens, hidden).map_err(runtime_err)?;
    for (what, (ptr, bytes), want) in [("quant_out", quant_out, qb), ("scale_out", scale_out, sb)] {
        let ok = if want == 0 {
            ptr == 0
        } else {
            ptr != 0 && bytes as u64 == want
        };
        if !ok {
            return Err(PyValueError::new_err(format!(
                "{what} holds {bytes} bytes; {quant} of {tokens} x {hidden} takes {want}"
            )));
        }
    }
    if quant.takes_scale_input() != (scale_in != 0) {
        return Err(PyValueError::new_err(format!(
            "{quant} {} a scale input",
            if quant.takes_scale_input() {
                "needs"
            } else {
                "takes no"
            }
        )));
    }
    Ok(())
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

/// What a failed call leaves: the error, after the collective reset (or with the
/// reset's own failure, which leaves the workspace unusable).
fn failed_call(
    e: arfuse_runtime::Error,
    reset: arfuse_runtime::Result<()>,
    broken: &mut Option<String>,
) -> PyErr {
    match reset {
        Ok(()) => PyRuntimeError::new_err(format!(
            "arfuse: {e} (the workspace was reset on every rank)"
        )),
        Err(r) => {
            *broken = Some(r.to_string());
            PyRuntimeError::new_err(format!("arfuse: {e}; resetting the workspace failed: {r}"))
        }
    }
}

fn check_usable(broken: &Option<String>) -> PyResult<()> {
    match broken {
        Some(why) => Err(PyRuntimeError::new_err(format!(
            "arfuse: this workspace is unusable after a failed reset: {why}"
        ))),
        None => Ok(()),
    }
}

fn timeout_of(timeout_ms: Option<u64>) -> u64 {
    timeout_ms.map_or(DEFAULT_TIMEOUT_NS, |ms| ms.saturating_mul(1_000_000))
}

fn py_group(group: Bound<'_, PyAny>) -> PyResult<PyGroup> {
    let rank: u32 = group.getattr("rank")?.extract()?;
    let world: u32 = group.getattr("world_size")?.extract()?;
    Ok(PyGroup {
        obj: group.unbind(),
        rank,
        world,
    })
}

/// One rank's workspace of the fused op on the host device for (group, dtype, H), made
/// on the first call.
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
        let group = py_group(group)?;
        let compiler = compiler()?;
        let request = arfuse_runtime::check::workspace_for(group.world, dtype, hidden, CALL_TOKENS)
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
            timeout_ns: timeout_of(timeout_ms),
            broken: None,
        })
    }

    /// Bytes of this rank's workspace.
    #[getter]
    fn bytes_per_rank(&self) -> u64 {
        self.ws.layout.bytes_per_rank
    }

    /// The fused op on this rank for `numel` elements at `x` (rows of H; the tensors'
    /// addresses as in `arfuse.torch`): writes `norm_out`, `residual_out` and, for a
    /// quant epilogue ([`op_quant_name`]), `quant_out` and `scale_out`, given as
    /// (address, bytes) and checked against the kernels' layouts
    /// ([`check_quant_tensors`]); `scale_in` is the address of the f32 static FP8 or
    /// NVFP4 global scale (0: none). Every rank makes the same call
    /// (same T, same `call_tag`). A failed call (a timeout, a peer's abort, ranks that
    /// disagree) resets the workspace on every rank and raises `RuntimeError`.
    #[pyo3(signature = (x, residual, weight, weight_dtype, numel, eps, weight_bias,
        norm_round_twice, norm_f32_sum, quant, norm_out, residual_out, quant_out, scale_out,
        scale_in, call_tag))]
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
        quant_out: OutBuf,
        scale_out: OutBuf,
        scale_in: usize,
        call_tag: u32,
    ) -> PyResult<()> {
        check_usable(&self.broken)?;
        let op = OpArgs {
            x,
            residual,
            weight,
            weight_dtype,
            numel,
            eps,
            weight_bias,
            norm_round_twice,
            norm_f32_sum,
            quant,
            norm_out,
            residual_out,
            quant_out,
            scale_out,
            scale_in,
            call_tag,
        };
        for call in op.calls(self.dtype, self.hidden, self.group.world, self.timeout_ns)? {
            let kernel = self
                .compiler
                .kernel(&call.variant, Build::Plain)
                .map_err(runtime_err)?;
            // SAFETY: the tensor addresses are those of live, contiguous CPU tensors
            // that `arfuse.torch` checked (dtype, element count) and keeps alive for
            // the call.
            let res = unsafe {
                self.ws
                    .launch(&kernel, &call, HOST_CTAS, &LaunchOptions::default())
            };
            if let Err(e) = res {
                let reset = self.ws.reset(&self.group);
                return Err(failed_call(e, reset, &mut self.broken));
            }
        }
        Ok(())
    }
}

/// One rank's workspace of the fused op on a CUDA GPU for (group, dtype, H), made on
/// the first call outside a capture. NOT YET RUN ON A GPU.
#[pyclass(name = "_CudaRanks", unsendable)]
pub struct CudaRanks {
    gpu: Gpu,
    ws: IpcWorkspace,
    group: PyGroup,
    dtype: ActDtype,
    hidden: u32,
    timeout_ns: u64,
    broken: Option<String>,
}

#[pymethods]
impl CudaRanks {
    /// Creates the workspace across the group on GPU `device` (collective; refused
    /// while `stream`, torch's current stream as an integer, captures).
    #[new]
    #[pyo3(signature = (group, dtype, hidden, device, stream, timeout_ms=None))]
    fn new(
        group: Bound<'_, PyAny>,
        dtype: &str,
        hidden: u32,
        device: usize,
        stream: u64,
        timeout_ms: Option<u64>,
    ) -> PyResult<CudaRanks> {
        let dtype = dtype_of(dtype)?;
        let group = py_group(group)?;
        let gpu = Gpu::open(device).map_err(runtime_err)?;
        let request = arfuse_runtime::check::workspace_for(group.world, dtype, hidden, CALL_TOKENS)
            .map_err(runtime_err)?;
        // mnnvl (fabric handles, across the nodes of an NVLink domain) where every
        // rank's GPU has it, else trtllm (CUDA IPC, one node): voted by the ranks.
        let chain = [Backend::Mnnvl, Backend::Trtllm];
        let ws =
            IpcWorkspace::create(&gpu, &group, &request, &chain, stream).map_err(runtime_err)?;
        Ok(CudaRanks {
            gpu,
            ws,
            group,
            dtype,
            hidden,
            timeout_ns: timeout_of(timeout_ms),
            broken: None,
        })
    }

    /// As `_HostRanks.run`, for CUDA tensors, enqueued on `stream` (torch's current
    /// stream). Outside a capture the kernels are compiled and loaded as needed and the
    /// call is waited for and checked (a failure resets the workspace on every rank
    /// and raises); inside a capture the call is only launched (every kernel it needs
    /// must have run once before), and a failure of a replay is reported by the next
    /// call outside the capture.
    #[pyo3(signature = (x, residual, weight, weight_dtype, numel, eps, weight_bias,
        norm_round_twice, norm_f32_sum, quant, norm_out, residual_out, quant_out, scale_out,
        scale_in, call_tag, stream))]
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
        quant_out: OutBuf,
        scale_out: OutBuf,
        scale_in: usize,
        call_tag: u32,
        stream: u64,
    ) -> PyResult<()> {
        check_usable(&self.broken)?;
        let op = OpArgs {
            x,
            residual,
            weight,
            weight_dtype,
            numel,
            eps,
            weight_bias,
            norm_round_twice,
            norm_f32_sum,
            quant,
            norm_out,
            residual_out,
            quant_out,
            scale_out,
            scale_in,
            call_tag,
        };
        let capturing = IpcWorkspace::capturing(&self.gpu, stream).map_err(runtime_err)?;
        let calls = op.calls(self.dtype, self.hidden, self.group.world, self.timeout_ns)?;
        self.load_kernels(&calls, capturing)?;
        let mut res = Ok(());
        if !capturing {
            // Errors of earlier (captured) calls first, then this call's.
            res = self.ws.take_error(&self.gpu, stream);
        }
        for call in &calls {
            if res.is_err() {
                break;
            }
            res = self.ws.launch(&mut self.gpu, call, stream);
        }
        if res.is_ok() && !capturing {
            res = self.ws.take_error(&self.gpu, stream);
        }
        match res {
            Ok(()) => Ok(()),
            Err(e) if capturing => Err(runtime_err(e)),
            Err(e) => {
                let reset = self.ws.reset(&self.gpu, &self.group, stream);
                Err(failed_call(e, reset, &mut self.broken))
            }
        }
    }
}

impl CudaRanks {
    /// Outside a capture: compiles and loads the kernels of both strategies for the
    /// calls' epilogue (so that a later capture at any T finds them). Inside: checks
    /// that every call's kernel was loaded before.
    fn load_kernels(&mut self, calls: &[FusedCall], capturing: bool) -> PyResult<()> {
        for call in calls {
            if capturing {
                if self.gpu.cached_kernel(&call.variant).is_none() {
                    return Err(PyRuntimeError::new_err(format!(
                        "arfuse: kernel {} was not loaded before the CUDA graph capture: \
                         run the op once outside the capture first",
                        call.variant
                    )));
                }
                continue;
            }
            for strategy in [Strategy::OneShot, Strategy::TwoShot] {
                let kind = KernelKind::Fused {
                    strategy,
                    world: self.group.world,
                };
                if let Some(v) = variants::find(kind, self.dtype, call.variant.epilogue) {
                    self.gpu.kernel(&v).map_err(runtime_err)?;
                }
            }
        }
        Ok(())
    }
}

/// The fused op's arguments as `arfuse.torch` passes them (tensor addresses as
/// integers; 0 for an absent tensor).
struct OpArgs<'a> {
    x: usize,
    residual: usize,
    weight: usize,
    weight_dtype: &'a str,
    numel: usize,
    eps: f64,
    weight_bias: f64,
    norm_round_twice: bool,
    norm_f32_sum: bool,
    quant: &'a str,
    norm_out: usize,
    residual_out: usize,
    quant_out: OutBuf,
    scale_out: OutBuf,
    scale_in: usize,
    call_tag: u32,
}

impl OpArgs<'_> {
    /// The fused calls of this op on a workspace for (`dtype`, `hidden`, `world`): the
    /// rows in consecutive calls of at most [`CALL_TOKENS`] tokens, one-shot up to
    /// [`ONE_SHOT_TOKENS`], two-shot above.
    fn calls(
        &self,
        dtype: ActDtype,
        hidden: u32,
        world: u32,
        timeout_ns: u64,
    ) -> PyResult<Vec<FusedCall>> {
        let quant = quant_of(self.quant)?;
        let gamma_f32 = match dtype_of(self.weight_dtype)? {
            w if w == dtype => false,
            ActDtype::F32 => true,
            w => {
                return Err(PyValueError::new_err(format!(
                    "weight dtype {w} with {dtype} activations"
                )))
            }
        };
        let h = hidden as usize;
        let numel = self.numel;
        if numel == 0 || numel % h != 0 || self.x == 0 || self.weight == 0 || self.norm_out == 0 {
            return Err(PyValueError::new_err(format!(
                "{numel} elements do not form rows of hidden size {h}, or a null pointer"
            )));
        }
        let tokens =
            u32::try_from(numel / h).map_err(|_| PyValueError::new_err("more than 2^32 tokens"))?;
        check_quant_tensors(
            quant,
            dtype,
            tokens,
            hidden,
            self.quant_out,
            self.scale_out,
            self.scale_in,
        )?;
        let scale_rows = i32::try_from(tokens)
            .map_err(|_| PyValueError::new_err("more than 2^31 tokens of scales"))?;
        // Quant data bytes of one row (FP8: H; NVFP4: H / 2).
        let quant_row = arfuse_runtime::check::quant_bytes_of(quant, 1, hidden)
            .map_err(runtime_err)?
            .0 as usize;
        let e = dtype.element_bytes() as usize;
        let base = KernelParams {
            gamma: self.weight as u64,
            eps: self.eps as f32,
            weight_bias: self.weight_bias as f32,
            gamma_f32: i32::from(gamma_f32),
            norm_round_twice: i32::from(self.norm_round_twice),
            norm_f32_sum: i32::from(self.norm_f32_sum),
            timeout_ns,
            call_tag: self.call_tag,
            scale_in: self.scale_in as u64,
            scale_out: RankTensor {
                ptr: self.scale_out.0 as u64,
                rank_stride: 0,
            },
            scale_rows,
            ..KernelParams::default()
        };
        let epilogue = Epilogue {
            residual: self.residual != 0,
            norm: true,
            quant,
        };
        let mut calls = Vec::new();
        let mut start = 0u32;
        while start < tokens {
            let t = (tokens - start).min(CALL_TOKENS);
            // Row `start` of a tensor of `row_bytes` per token.
            let at = |ptr: usize, row_bytes: usize| RankTensor {
                ptr: if ptr == 0 {
                    0
                } else {
                    (ptr + start as usize * row_bytes) as u64
                },
                rank_stride: 0,
            };
            let params = KernelParams {
                x: at(self.x, h * e),
                residual_in: at(self.residual, h * e),
                residual_out: at(self.residual_out, h * e),
                out: at(self.norm_out, h * e),
                quant_out: at(self.quant_out.0, quant_row),
                // The scales of the whole T, of which this call writes rows
                // `start..start + t` (packed and swizzled layouts depend on the whole T).
                scale_row0: start as i32,
                ..base
            };
            let strategy = if t <= ONE_SHOT_TOKENS || t < world {
                Strategy::OneShot
            } else {
                Strategy::TwoShot
            };
            let variant = variants::find(KernelKind::Fused { strategy, world }, dtype, epilogue)
                .ok_or_else(|| {
                    PyValueError::new_err(format!(
                        "no fused kernel for W = {world}, {dtype}, {}",
                        epilogue.name()
                    ))
                })?;
            calls.push(FusedCall {
                variant,
                tokens: t,
                hidden,
                ranks: world,
                params,
            });
            start += t;
        }
        Ok(calls)
    }
}
