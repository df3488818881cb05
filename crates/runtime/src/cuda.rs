//! The GPU side: device probe, virtual-rank workspaces, kernel loading, fused and
//! unfused launches, CUDA graph capture and replay. Everything returns
//! [`Error::NoDriver`] on a machine without an NVIDIA driver (checked with a plain
//! `dlopen` before cudarc is touched, since cudarc 0.16 panics when libcuda is absent).
//!
//! Virtual ranks: the W ranks' workspaces are W slices of ONE allocation; the fused
//! kernel is launched once with grid `(nblocks, W, 1)` as a cooperative launch, which
//! the driver accepts only when every CTA can be resident at once, so the spinning
//! ranks cannot starve each other. Real peers later pass IPC or multicast-unicast
//! addresses in the same `peer[]` array and launch `(nblocks, 1, 1)` per GPU.
//!
//! NOT YET RUN ON A GPU: this session had no device machine; this module compiles and
//! its CPU-side parts (shapes, parameters) are unit-tested, the rest is unverified.

use crate::error::{Error, Result};
use crate::variants::{self, Arch, Dtype, KernelKind, Variant};
use crate::workspace::{Backend, WorkspaceFactory};
use arfuse_policy::{ArfuseLayout, Workspace};
use cudarc::driver::sys;
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::Arc;

/// Default polling timeout of the kernels (globaltimer ns): 5 s. A correct protocol
/// never comes close; a broken one exits and reports instead of hanging.
pub const DEFAULT_TIMEOUT_NS: u64 = 5_000_000_000;
/// Most CTAs per rank of one fused launch (tokens are strided over them).
pub const MAX_GRID_CTAS: u32 = 256;

/// Checks that a driver library can be loaded, without touching cudarc.
///
/// # Errors
/// [`Error::NoDriver`] when neither `libcuda.so.1` nor `libcuda.so` loads.
pub fn driver_present() -> Result<()> {
    for name in ["libcuda.so.1", "libcuda.so"] {
        // SAFETY: loading the driver library runs no user code beyond its initialisers.
        if unsafe { libloading::Library::new(name) }.is_ok() {
            return Ok(());
        }
    }
    Err(Error::NoDriver(
        "libcuda.so.1 not loadable (no NVIDIA driver on this machine)".into(),
    ))
}

/// Runs `f`, turning a cudarc panic into an error. cudarc 0.16 panics when a driver
/// symbol cannot be loaded: that is [`Error::NoDriver`] only when the driver library
/// itself is missing ([`driver_present`] is called before `f`, so this is the rare case
/// of a driver too old for the bindings); with a driver present it is a real
/// [`Error::Driver`] failure, never reported as "no GPU, skipped".
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let detail = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("no message");
        Err(match driver_present() {
            Err(_) => Error::NoDriver(format!("cudarc panicked during {what}: {detail}")),
            Ok(()) => Error::Driver {
                call: what.to_string(),
                msg: format!("cudarc panicked with a driver present: {detail}"),
            },
        })
    })
}

fn check(rc: sys::CUresult, call: &str) -> Result<()> {
    if rc == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Driver {
            call: call.to_string(),
            msg: format!("{rc:?}"),
        })
    }
}

/// What [`Gpu::open`] found about the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device name.
    pub name: String,
    /// Compute capability as `major * 10 + minor` (90 = H100/H200).
    pub sm: u32,
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`.
    pub multicast: bool,
    /// Free device memory, bytes.
    pub free_bytes: u64,
    /// Total device memory, bytes.
    pub total_bytes: u64,
}

/// A device allocation, freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    bytes: u64,
}

impl DeviceBuffer {
    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // SAFETY: allocated by cuMemAlloc_v2, freed once.
            unsafe {
                let _ = sys::cuMemFree_v2(self.ptr);
            }
        }
    }
}

/// One tensor per rank: rank r at `ptr + r * rank_stride` (bytes). Mirrors `ArfTensor`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankTensor {
    /// Address of rank 0's tensor (0 = dead output / unused input).
    pub ptr: u64,
    /// Bytes between consecutive ranks' tensors.
    pub rank_stride: u64,
}

/// Kernel parameters, layout-identical to `ArfParams` in `kernels/arfuse_common.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct KernelParams {
    /// Workspace base address of each rank.
    pub peer: [u64; 16],
    /// All-reduce input (local kernel: input).
    pub x: RankTensor,
    /// Residual input.
    pub residual_in: RankTensor,
    /// Residual output (0 = dead).
    pub residual_out: RankTensor,
    /// Norm output, or the all-reduce output without norm (0 = dead).
    pub out: RankTensor,
    /// Quant output (0 = dead).
    pub quant_out: RankTensor,
    /// Scale output (0 = dead).
    pub scale_out: RankTensor,
    /// RMSNorm weight `[H]`.
    pub gamma: u64,
    /// fp32 scalar: static fp8 dequant scale or NVFP4 global scale.
    pub scale_in: u64,
    /// Workspace offsets ([`ArfuseLayout`]): the state block.
    pub off_state: u64,
    /// The first Lamport buffer.
    pub off_lamport: u64,
    /// Bytes of one Lamport buffer.
    pub lamport_stride: u64,
    /// u32 error word.
    pub err: u64,
    /// Polling timeout, ns.
    pub timeout_ns: u64,
    /// Tokens T.
    pub tokens: i32,
    /// Hidden size H.
    pub hidden: i32,
    /// Rank of `blockIdx.y == 0`.
    pub rank_base: i32,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// 0 or 1 (Gemma-style weight offset).
    pub weight_bias: f32,
    /// 1 when `gamma` is f32 (the Gemma form `1 + w.float()` with 16-bit activations),
    /// 0 when it has the activation dtype. `ArfParams::gamma_f32`.
    pub gamma_f32: i32,
    /// 1 when the RMSNorm rounds `h * r` to the activation dtype before the weight
    /// multiply (`NormRounding::Twice`, the Llama order), 0 for one rounding.
    /// `ArfParams::norm_round_twice`.
    pub norm_round_twice: i32,
    /// Padding (the size stays a multiple of 8).
    pub pad: i32,
}

const _: () = assert!(std::mem::size_of::<KernelParams>() == 312);

impl KernelParams {
    /// Fills the workspace fields from a layout and the base of rank 0's slice
    /// (virtual ranks: rank r of `world` at `base + r * bytes_per_rank`).
    ///
    /// # Errors
    /// [`Error::Invalid`] for more than 16 ranks; [`Error::Overflow`].
    pub fn with_virtual_workspace(
        mut self,
        layout: &ArfuseLayout,
        world: u32,
        base: u64,
        err: u64,
    ) -> Result<Self> {
        if world as usize > self.peer.len() {
            return Err(Error::Invalid(format!(
                "{world} ranks; the kernels take at most 16"
            )));
        }
        for r in 0..world as usize {
            self.peer[r] = (r as u64)
                .checked_mul(layout.bytes_per_rank)
                .and_then(|o| o.checked_add(base))
                .ok_or(Error::Overflow("peer address"))?;
        }
        self.off_state = layout.state_offset;
        self.off_lamport = layout.lamport_offset;
        self.lamport_stride = layout.lamport_buffer_bytes;
        self.err = err;
        Ok(self)
    }
}

/// Threads per block for a token of `hidden` elements of `dtype`: the policy's
/// [`arfuse_policy::arfuse_block_threads`] (16-byte vectors, at most four per thread,
/// whole warps, at least 128 threads), the plan-time limit the planner already
/// checked.
///
/// # Errors
/// [`Error::Unsupported`] with the policy's reason when the kernels cannot run the row.
pub fn block_size(hidden: u32, dtype: Dtype) -> Result<u32> {
    arfuse_policy::arfuse_block_threads(u64::from(hidden), dtype.policy())
        .map_err(|e| Error::Unsupported(e.to_string()))
}

/// A loaded kernel entry point (opaque driver handle, valid while its [`Gpu`] lives).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelFn(sys::CUfunction);

/// An open GPU: context, one stream, loaded kernels.
pub struct Gpu {
    _ctx: Arc<cudarc::driver::CudaContext>,
    stream: sys::CUstream,
    info: DeviceInfo,
    arch: Option<Arch>,
    kernels: HashMap<Variant, KernelFn>,
    capturing: std::cell::Cell<bool>,
}

impl Gpu {
    /// Opens device `ordinal`.
    ///
    /// # Errors
    /// [`Error::NoDriver`] without a driver; [`Error::Driver`] when the device cannot
    /// be opened.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        driver_present()?;
        guarded("device open", || {
            let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| Error::Driver {
                call: "CudaContext::new".into(),
                msg: e.to_string(),
            })?;
            let attr = |a: sys::CUdevice_attribute| {
                ctx.attribute(a).map_err(|e| Error::Driver {
                    call: format!("cuDeviceGetAttribute({a:?})"),
                    msg: e.to_string(),
                })
            };
            use sys::CUdevice_attribute as A;
            let major = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
            let minor = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            let sm_count = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            let multicast = attr(A::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED).unwrap_or(0) != 0;
            let (free, total) =
                cudarc::driver::result::mem_get_info().map_err(|e| Error::Driver {
                    call: "cuMemGetInfo".into(),
                    msg: e.to_string(),
                })?;
            let name = ctx.name().unwrap_or_else(|_| "unknown".into());
            let mut stream: sys::CUstream = std::ptr::null_mut();
            // SAFETY: valid out-pointer; context is current (CudaContext::new binds it).
            check(
                unsafe {
                    sys::cuStreamCreate(
                        &mut stream,
                        sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                    )
                },
                "cuStreamCreate",
            )?;
            let sm = (major as u32) * 10 + minor as u32;
            Ok(Gpu {
                _ctx: ctx,
                stream,
                info: DeviceInfo {
                    name,
                    sm,
                    sm_count: sm_count as u32,
                    multicast,
                    free_bytes: free as u64,
                    total_bytes: total as u64,
                },
                arch: Arch::for_sm(sm),
                kernels: HashMap::new(),
                capturing: std::cell::Cell::new(false),
            })
        })
    }

    /// The probe results.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The raw stream every launch of this handle uses.
    pub fn stream(&self) -> sys::CUstream {
        self.stream
    }

    /// Whether the stream is capturing (asks the driver, and our own flag).
    pub fn capturing(&self) -> Result<bool> {
        let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: valid stream and out-pointer.
        check(
            unsafe { sys::cuStreamIsCapturing(self.stream, &mut st) },
            "cuStreamIsCapturing",
        )?;
        Ok(self.capturing.get() || st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Allocates `bytes` of device memory, zeroed. Refused during capture.
    ///
    /// # Errors
    /// [`Error::Capturing`] during capture; [`Error::Driver`] on failure.
    pub fn alloc(&self, bytes: u64) -> Result<DeviceBuffer> {
        if self.capturing()? {
            return Err(Error::Capturing(format!("allocation of {bytes} bytes")));
        }
        let n = usize::try_from(bytes.max(1)).map_err(|_| Error::Overflow("allocation"))?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, n) }, "cuMemAlloc")?;
        let buf = DeviceBuffer { ptr, bytes };
        // SAFETY: `n` bytes were just allocated at `ptr`.
        check(
            unsafe { sys::cuMemsetD8Async(ptr, 0, n, self.stream) },
            "cuMemsetD8Async",
        )?;
        self.sync()?;
        Ok(buf)
    }

    /// Copies host bytes to the device, ordered on this GPU's work stream after
    /// everything enqueued before (a synchronous legacy-stream copy would not be
    /// ordered with the non-blocking work stream), and waits for it.
    pub fn upload(&self, dst: &DeviceBuffer, offset: u64, src: &[u8]) -> Result<()> {
        let end = offset
            .checked_add(src.len() as u64)
            .ok_or(Error::Overflow("upload"))?;
        if end > dst.bytes {
            return Err(Error::Invalid(format!(
                "upload of {} bytes at {offset} overruns {} bytes",
                src.len(),
                dst.bytes
            )));
        }
        // SAFETY: range checked above; the host slice stays valid until the copy has
        // completed, because sync() waits for it before returning.
        check(
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dst.ptr + offset,
                    src.as_ptr().cast::<c_void>(),
                    src.len(),
                    self.stream,
                )
            },
            "cuMemcpyHtoDAsync",
        )?;
        self.sync()
    }

    /// Copies device bytes to the host, after everything enqueued on the work stream,
    /// and waits for it.
    pub fn download(&self, src: &DeviceBuffer, offset: u64, dst: &mut [u8]) -> Result<()> {
        let end = offset
            .checked_add(dst.len() as u64)
            .ok_or(Error::Overflow("download"))?;
        if end > src.bytes {
            return Err(Error::Invalid("download overruns the buffer".into()));
        }
        // SAFETY: range checked above; `dst` outlives the copy (sync() below).
        check(
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    dst.as_mut_ptr().cast::<c_void>(),
                    src.ptr + offset,
                    dst.len(),
                    self.stream,
                )
            },
            "cuMemcpyDtoHAsync",
        )?;
        self.sync()
    }

    /// Waits for the stream.
    pub fn sync(&self) -> Result<()> {
        // SAFETY: valid stream.
        check(
            unsafe { sys::cuStreamSynchronize(self.stream) },
            "cuStreamSynchronize",
        )
    }

    /// Compiles (NVRTC, cubin for this device's `sm_XXa`) and loads a variant once.
    ///
    /// # Errors
    /// [`Error::Unsupported`] on a device that is not SM 90 / 100; NVRTC errors.
    pub fn kernel(&mut self, v: &Variant) -> Result<KernelFn> {
        if let Some(f) = self.kernels.get(v) {
            return Ok(*f);
        }
        if self.capturing()? {
            return Err(Error::Capturing(format!("loading kernel {v}")));
        }
        let arch = self.arch()?;
        let compiled = variants::compile(v, arch, false)?;
        self.load(v, &compiled)
    }

    fn load(&mut self, v: &Variant, compiled: &crate::nvrtc::Compiled) -> Result<KernelFn> {
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: the cubin image lives for the call; the driver copies it.
        check(
            unsafe { sys::cuModuleLoadData(&mut module, compiled.cubin.as_ptr().cast::<c_void>()) },
            "cuModuleLoadData",
        )?;
        let mut f: sys::CUfunction = std::ptr::null_mut();
        let name =
            std::ffi::CString::new(v.entry()).map_err(|_| Error::Invalid("entry name".into()))?;
        // SAFETY: module loaded above; NUL-terminated name.
        check(
            unsafe { sys::cuModuleGetFunction(&mut f, module, name.as_ptr()) },
            "cuModuleGetFunction",
        )?;
        self.kernels.insert(*v, KernelFn(f));
        Ok(KernelFn(f))
    }

    /// CTAs of `f` with `block` threads that fit on the whole device at once.
    pub fn resident_ctas(&self, f: KernelFn, block: u32) -> Result<u32> {
        let mut n: i32 = 0;
        // SAFETY: valid function and out-pointer.
        check(
            unsafe {
                sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, f.0, block as i32, 0)
            },
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        )?;
        Ok((n.max(0) as u32).saturating_mul(self.info.sm_count))
    }

    /// Launches `f` with `params` on grid `(gx, gy, 1)`; cooperative (all CTAs
    /// resident) when `cooperative`; with programmatic dependent launch when `pdl`.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &self,
        f: KernelFn,
        gx: u32,
        gy: u32,
        block: u32,
        params: &KernelParams,
        cooperative: bool,
        pdl: bool,
    ) -> Result<()> {
        // SAFETY: zeroed attribute structs are valid (plain C data).
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n = 0usize;
        if cooperative {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
            attrs[n].value.cooperative = 1;
            n += 1;
        }
        if pdl {
            attrs[n].id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        let cfg = sys::CUlaunchConfig {
            gridDimX: gx,
            gridDimY: gy,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: self.stream,
            attrs: attrs.as_mut_ptr(),
            numAttrs: n as u32,
        };
        let mut p = *params;
        let mut args = [(&mut p as *mut KernelParams).cast::<c_void>()];
        // SAFETY: one kernel parameter of the exact layout the kernel declares.
        check(
            unsafe { sys::cuLaunchKernelEx(&cfg, f.0, args.as_mut_ptr(), std::ptr::null_mut()) },
            "cuLaunchKernelEx",
        )
    }

    /// The NVRTC target of this device.
    fn arch(&self) -> Result<Arch> {
        self.arch.ok_or_else(|| {
            Error::Unsupported(format!(
                "SM {} has no kernel build (SM 90 and 100 only)",
                self.info.sm
            ))
        })
    }

    /// Compiles every variant of `variants` not loaded yet with NVRTC on up to
    /// `threads` threads (NVRTC is thread safe), then loads them, so nothing is
    /// compiled later (and never during capture).
    ///
    /// # Errors
    /// As [`Gpu::kernel`]; the first failure is returned.
    pub fn preload(&mut self, variants: &[Variant], threads: usize) -> Result<()> {
        if self.capturing()? {
            return Err(Error::Capturing("preloading kernels".into()));
        }
        let arch = self.arch()?;
        let mut todo: Vec<Variant> = variants
            .iter()
            .filter(|v| !self.kernels.contains_key(v))
            .copied()
            .collect();
        todo.sort();
        todo.dedup();
        let threads = threads.clamp(1, 64);
        let compiled: Vec<(Variant, Result<crate::nvrtc::Compiled>)> =
            std::thread::scope(|scope| {
                let handles: Vec<_> = (0..threads)
                    .map(|k| {
                        let todo = &todo;
                        scope.spawn(move || {
                            todo.iter()
                                .skip(k)
                                .step_by(threads)
                                .map(|v| (*v, variants::compile(v, arch, false)))
                                .collect::<Vec<_>>()
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .flat_map(|h| {
                        h.join().unwrap_or_else(|_| {
                            vec![(
                                todo[0],
                                Err(Error::Invalid("an NVRTC thread panicked".into())),
                            )]
                        })
                    })
                    .collect()
            });
        for (v, c) in compiled {
            self.load(&v, &c?)?;
        }
        Ok(())
    }

    /// Sets `bytes` bytes of `buf` from `offset` to `value` (enqueued on the stream).
    ///
    /// # Errors
    /// [`Error::Invalid`] when the range overruns the buffer; driver errors.
    pub fn fill(&self, buf: &DeviceBuffer, offset: u64, bytes: u64, value: u8) -> Result<()> {
        let end = offset.checked_add(bytes).ok_or(Error::Overflow("fill"))?;
        if end > buf.bytes {
            return Err(Error::Invalid(format!(
                "fill of {bytes} bytes at {offset} overruns {} bytes",
                buf.bytes
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: range checked above.
        check(
            unsafe { sys::cuMemsetD8Async(buf.ptr + offset, value, bytes as usize, self.stream) },
            "cuMemsetD8Async",
        )
    }

    /// Captures what `body` enqueues on the stream into an instantiated graph.
    /// Allocation and kernel loading are refused while `body` runs.
    pub fn capture(&mut self, body: impl FnOnce(&mut Gpu) -> Result<()>) -> Result<Graph> {
        // SAFETY: valid stream.
        check(
            unsafe {
                sys::cuStreamBeginCapture_v2(
                    self.stream,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
            },
            "cuStreamBeginCapture",
        )?;
        self.capturing.set(true);
        let r = body(self);
        self.capturing.set(false);
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: capture was begun on this stream.
        let end = check(
            unsafe { sys::cuStreamEndCapture(self.stream, &mut graph) },
            "cuStreamEndCapture",
        );
        r?;
        end?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: graph from a finished capture.
        let inst = check(
            unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
            "cuGraphInstantiate",
        );
        // SAFETY: the exec does not need the graph after instantiation.
        unsafe {
            let _ = sys::cuGraphDestroy(graph);
        }
        inst?;
        Ok(Graph {
            exec,
            stream: self.stream,
        })
    }

    /// The handle of a variant loaded earlier, without compiling (usable during
    /// capture, when [`Gpu::kernel`] refuses to load anything new).
    pub fn cached_kernel(&self, v: &Variant) -> Option<KernelFn> {
        self.kernels.get(v).copied()
    }

    /// Milliseconds the stream takes for what `body` enqueues, measured with events.
    pub fn time_ms(&mut self, body: impl FnOnce(&mut Gpu) -> Result<()>) -> Result<f32> {
        let mut a: sys::CUevent = std::ptr::null_mut();
        let mut b: sys::CUevent = std::ptr::null_mut();
        // SAFETY: out-pointers valid; events destroyed below.
        unsafe {
            check(sys::cuEventCreate(&mut a, 0), "cuEventCreate")?;
            check(sys::cuEventCreate(&mut b, 0), "cuEventCreate")?;
            check(sys::cuEventRecord(a, self.stream), "cuEventRecord")?;
        }
        let r = body(self);
        let mut ms = 0f32;
        // SAFETY: events recorded on this stream.
        let t = unsafe {
            check(sys::cuEventRecord(b, self.stream), "cuEventRecord")
                .and_then(|_| check(sys::cuEventSynchronize(b), "cuEventSynchronize"))
                .and_then(|_| check(sys::cuEventElapsedTime(&mut ms, a, b), "cuEventElapsedTime"))
        };
        // SAFETY: created above.
        unsafe {
            let _ = sys::cuEventDestroy_v2(a);
            let _ = sys::cuEventDestroy_v2(b);
        }
        r?;
        t?;
        Ok(ms)
    }

    /// Enqueues a device-to-device copy (for the bandwidth baseline).
    pub fn copy_d2d(&self, dst: &DeviceBuffer, src: &DeviceBuffer, bytes: u64) -> Result<()> {
        if bytes > dst.bytes || bytes > src.bytes {
            return Err(Error::Invalid("copy larger than a buffer".into()));
        }
        // SAFETY: sizes checked.
        check(
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst.ptr, src.ptr, bytes as usize, self.stream) },
            "cuMemcpyDtoDAsync",
        )
    }
}

/// An instantiated CUDA graph.
pub struct Graph {
    exec: sys::CUgraphExec,
    stream: sys::CUstream,
}

impl Graph {
    /// Replays the graph on the stream it was captured on.
    pub fn launch(&self) -> Result<()> {
        // SAFETY: valid exec and stream.
        check(
            unsafe { sys::cuGraphLaunch(self.exec, self.stream) },
            "cuGraphLaunch",
        )
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: destroyed once.
        unsafe {
            let _ = sys::cuGraphExecDestroy(self.exec);
        }
    }
}

/// W virtual ranks' workspaces in one allocation, plus the error word.
pub struct VirtualWorkspace {
    /// The workspace the plan proved (what is allocated per rank).
    pub workspace: Workspace,
    /// Its byte offsets (one rank).
    pub layout: ArfuseLayout,
    /// All ranks' slices.
    pub memory: DeviceBuffer,
    /// u32 error word the kernels set instead of hanging.
    pub err: DeviceBuffer,
}

impl VirtualWorkspace {
    /// Allocates `workspace` for its W virtual ranks and initialises it (Lamport
    /// buffers to the -0.0 sentinel, the state block zero).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a workspace of FlashInfer's kernels or with problems of
    /// its own; [`Error::Unsupported`] when it exceeds free memory; driver errors.
    pub fn create(gpu: &Gpu, workspace: &Workspace) -> Result<VirtualWorkspace> {
        let layout = arfuse_layout(workspace)?;
        let bytes = layout
            .bytes_per_rank
            .checked_mul(u64::from(workspace.world_size))
            .ok_or(Error::Overflow("virtual workspace"))?;
        if bytes > gpu.info.free_bytes {
            return Err(Error::Unsupported(format!(
                "workspace of {bytes} bytes exceeds free memory {}",
                gpu.info.free_bytes
            )));
        }
        let memory = gpu.alloc(bytes)?;
        let err = gpu.alloc(4)?;
        let dtype = Dtype::from_policy(workspace.dtype);
        for r in 0..u64::from(workspace.world_size) {
            let base = memory.ptr + r * layout.bytes_per_rank + layout.lamport_offset;
            let lam = arfuse_policy::LAMPORT_BUFFER_COUNT * layout.lamport_buffer_bytes;
            let rc = match dtype {
                // SAFETY: the range lies inside `memory` (layout arithmetic is checked).
                Dtype::Bf16 | Dtype::F16 => unsafe {
                    sys::cuMemsetD16Async(base, 0x8000, (lam / 2) as usize, gpu.stream)
                },
                // SAFETY: as above.
                Dtype::F32 => unsafe {
                    sys::cuMemsetD32Async(base, 0x8000_0000, (lam / 4) as usize, gpu.stream)
                },
            };
            check(rc, "cuMemsetD16/D32Async (Lamport sentinel)")?;
        }
        gpu.sync()?;
        Ok(VirtualWorkspace {
            workspace: workspace.clone(),
            layout,
            memory,
            err,
        })
    }

    /// Reads and clears the error word; `Err(KernelTimeout)` if a kernel gave up.
    pub fn take_error(&self, gpu: &Gpu) -> Result<()> {
        let mut w = [0u8; 4];
        gpu.download(&self.err, 0, &mut w)?;
        let v = u32::from_le_bytes(w);
        if v != 0 {
            gpu.upload(&self.err, 0, &[0u8; 4])?;
            return Err(Error::KernelTimeout(v));
        }
        Ok(())
    }
}

impl WorkspaceFactory for Gpu {
    type Workspace = VirtualWorkspace;
    fn is_capturing(&self) -> Result<bool> {
        self.capturing()
    }
    fn create(&mut self, backend: Backend, workspace: &Workspace) -> Result<VirtualWorkspace> {
        match backend {
            // One GPU: no multicast object between ranks exists here.
            Backend::Mnnvl => Err(Error::Unsupported(
                "mnnvl needs NVLink multicast between GPUs; virtual ranks use trtllm layout".into(),
            )),
            Backend::Trtllm => VirtualWorkspace::create(self, workspace),
            Backend::Unfused => Err(Error::Invalid("unfused needs no workspace".into())),
        }
    }
}

/// The arfuse layout of a workspace the runtime can allocate.
///
/// # Errors
/// [`Error::Invalid`] for FlashInfer's kernels (arfuse's runtime runs its own) or a
/// workspace with problems of its own.
pub fn arfuse_layout(workspace: &Workspace) -> Result<ArfuseLayout> {
    let problems = workspace.problems();
    if !problems.is_empty() {
        return Err(Error::Invalid(format!(
            "workspace: {}",
            problems.join("; ")
        )));
    }
    workspace.arfuse_layout().ok_or_else(|| {
        Error::Invalid(format!(
            "the workspace is laid out for {}'s kernels; arfuse-runtime runs plans made for \
             kernels = \"arfuse\"",
            workspace.kernels
        ))
    })
}

/// Whether a fused call of `tokens` tokens at `hidden` with `strategy` may run in
/// `workspace`: the policy's capacity rule ([`Workspace::misfit`]), the one the
/// planner proved the plan with.
///
/// # Errors
/// [`Error::Invalid`] naming the required and available bytes (or T < W for FlashInfer's
/// two-shot, which this runtime never runs).
pub fn check_fits(
    workspace: &Workspace,
    strategy: variants::Strategy,
    tokens: u32,
    hidden: u32,
) -> Result<()> {
    let misfit = workspace
        .misfit(strategy.policy(), u64::from(tokens), u64::from(hidden))
        .map_err(|e| Error::Invalid(e.to_string()))?;
    match misfit {
        None => Ok(()),
        Some(arfuse_policy::Misfit::BelowWorldSize { world_size }) => Err(Error::Invalid(format!(
            "{} at T = {tokens} needs T >= W = {world_size}",
            strategy.policy()
        ))),
        Some(arfuse_policy::Misfit::TooLarge {
            required_bytes,
            available_bytes,
        }) => Err(Error::Invalid(format!(
            "{} at T = {tokens} needs {required_bytes} bytes of one Lamport buffer; it has \
             {available_bytes}",
            strategy.policy()
        ))),
    }
}

/// One fused (or local) call: the variant, shapes and per-rank tensors.
#[derive(Debug, Clone, Copy)]
pub struct FusedCall {
    /// Kernel variant.
    pub variant: Variant,
    /// Tokens T.
    pub tokens: u32,
    /// Hidden size H of this call (elements; at most the workspace's).
    pub hidden: u32,
    /// Ranks in this launch (W for virtual ranks).
    pub ranks: u32,
    /// Tensors and scalars; workspace fields are filled by [`launch_fused`].
    pub params: KernelParams,
}

/// Launches a fused call on virtual ranks (one cooperative launch for all W ranks).
///
/// # Errors
/// [`Error::Invalid`] when the call does not fit the workspace; [`Error::Unsupported`]
/// when the grid cannot be co-resident; driver errors.
pub fn launch_fused(gpu: &mut Gpu, ws: &VirtualWorkspace, call: &FusedCall) -> Result<()> {
    let KernelKind::Fused { strategy, world } = call.variant.kind else {
        return Err(Error::Invalid("launch_fused needs a fused variant".into()));
    };
    let wsp = &ws.workspace;
    if world != wsp.world_size || call.variant.dtype.policy() != wsp.dtype {
        return Err(Error::Invalid(
            "variant world size / dtype differ from the workspace".into(),
        ));
    }
    let hidden = call.hidden;
    check_fits(wsp, strategy, call.tokens, hidden)?;
    let f = gpu.kernel(&call.variant)?;
    let block = block_size(hidden, call.variant.dtype)?;
    let resident = gpu.resident_ctas(f, block)?;
    let gx = call.tokens.min(MAX_GRID_CTAS).min(resident / world);
    if gx == 0 {
        return Err(Error::Unsupported(format!(
            "{world} ranks x 1 CTA of {block} threads cannot be co-resident"
        )));
    }
    let mut p = call
        .params
        .with_virtual_workspace(&ws.layout, world, ws.memory.ptr, ws.err.ptr)?;
    p.tokens = i32::try_from(call.tokens).map_err(|_| Error::Overflow("T"))?;
    p.hidden = hidden as i32;
    p.rank_base = 0;
    if p.timeout_ns == 0 {
        p.timeout_ns = DEFAULT_TIMEOUT_NS;
    }
    gpu.launch(f, gx, world, block, &p, true, false)
}

/// Launches the local (unfused) kernel for every virtual rank.
pub fn launch_local(gpu: &mut Gpu, call: &FusedCall, hidden: u32) -> Result<()> {
    if call.variant.kind != KernelKind::Local {
        return Err(Error::Invalid("launch_local needs a local variant".into()));
    }
    let f = gpu.kernel(&call.variant)?;
    let block = block_size(hidden, call.variant.dtype)?;
    let mut p = call.params;
    p.tokens = call.tokens as i32;
    p.hidden = hidden as i32;
    let gx = call.tokens.clamp(1, 65_535);
    gpu.launch(f, gx, call.ranks, block, &p, false, false)
}

/// Launches the virtual-rank all-reduce of the unfused path: for every rank r,
/// `params.out[r] = round_T(sum over q in rank order of params.x[q])` (contract v2
/// clause 1), `tokens` tokens of `hidden` elements. Needs no workspace.
///
/// # Errors
/// [`Error::Invalid`] for a world size outside {2, 4, 8, 16}, T = 0 or H * e not a
/// multiple of 16; launch errors.
pub fn launch_virtual_allreduce(
    gpu: &mut Gpu,
    world: u32,
    dtype: Dtype,
    hidden: u32,
    tokens: u32,
    params: &KernelParams,
) -> Result<()> {
    if !variants::WORLD_SIZES.contains(&world) || tokens == 0 {
        return Err(Error::Invalid(format!(
            "virtual all-reduce: W = {world}, T = {tokens}"
        )));
    }
    let f = gpu.kernel(&variants::virtual_allreduce(world, dtype))?;
    let block = block_size(hidden, dtype)?;
    let mut p = *params;
    p.tokens = i32::try_from(tokens).map_err(|_| Error::Overflow("T"))?;
    p.hidden = i32::try_from(hidden).map_err(|_| Error::Overflow("H"))?;
    p.rank_base = 0;
    gpu.launch(f, tokens.min(65_535), world, block, &p, false, false)
}

/// One instantiated graph per capture size T.
#[derive(Default)]
pub struct CaptureSet {
    graphs: BTreeMap<u32, Graph>,
}

impl CaptureSet {
    /// Captures `launch(T)` for every T in `sizes` (all workspaces and kernels must
    /// exist beforehand: nothing is created during capture).
    pub fn capture(
        gpu: &mut Gpu,
        sizes: &[u32],
        mut launch: impl FnMut(&mut Gpu, u32) -> Result<()>,
    ) -> Result<CaptureSet> {
        let mut graphs = BTreeMap::new();
        for &t in sizes {
            let g = gpu.capture(|g| launch(g, t))?;
            graphs.insert(t, g);
        }
        Ok(CaptureSet { graphs })
    }
    /// Replays the graph of capture size `t`.
    pub fn replay(&self, t: u32) -> Result<()> {
        self.graphs
            .get(&t)
            .ok_or_else(|| Error::Invalid(format!("no graph captured for T = {t}")))?
            .launch()
    }
    /// Capture sizes held.
    pub fn sizes(&self) -> Vec<u32> {
        self.graphs.keys().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_are_the_policys() {
        assert_eq!(block_size(6144, Dtype::Bf16).unwrap(), 768);
        assert!(matches!(
            block_size(65536, Dtype::Bf16),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            block_size(100, Dtype::Bf16),
            Err(Error::Unsupported(_))
        ));
    }

    #[test]
    fn params_layout_and_virtual_peers() {
        let ws = Workspace::arfuse(
            arfuse_policy::Backend::Trtllm,
            4,
            4096,
            arfuse_policy::ActDtype::Bf16,
            Some(16),
            16 * 4 * 4096 * 2,
        )
        .unwrap();
        let layout = arfuse_layout(&ws).unwrap();
        let p = KernelParams::default()
            .with_virtual_workspace(&layout, 4, 0x1000_0000, 0x2000)
            .unwrap();
        assert_eq!(p.peer[3], 0x1000_0000 + 3 * (256 + 3 * 16 * 4 * 4096 * 2));
        assert_eq!(p.peer[4], 0);
        assert_eq!((p.off_state, p.off_lamport), (0, 256));
        assert_eq!(p.lamport_stride, 16 * 4 * 4096 * 2);
        assert_eq!(std::mem::offset_of!(KernelParams, x), 128);
        assert_eq!(std::mem::offset_of!(KernelParams, gamma), 224);
        assert_eq!(std::mem::offset_of!(KernelParams, tokens), 280);
        assert_eq!(std::mem::offset_of!(KernelParams, eps), 292);
        // The capacity rule is the policy's: one-shot T=16 fits, 17 does not; two-shot
        // runs T < W (T=3) and fits up to 2 * ceil(T/4) * 4 * 8192 <= 524,288: T = 32.
        check_fits(&ws, variants::Strategy::OneShot, 16, 4096).unwrap();
        let e = check_fits(&ws, variants::Strategy::OneShot, 17, 4096).unwrap_err();
        assert!(e.to_string().contains("557056 bytes"), "{e}");
        check_fits(&ws, variants::Strategy::TwoShot, 3, 4096).unwrap();
        check_fits(&ws, variants::Strategy::TwoShot, 32, 4096).unwrap();
        let e = check_fits(&ws, variants::Strategy::TwoShot, 33, 4096).unwrap_err();
        assert!(e.to_string().contains("589824 bytes"), "{e}");
        // FlashInfer's layouts are not this runtime's.
        let fi = Workspace::flashinfer_mnnvl(4, 4096, arfuse_policy::ActDtype::Bf16, 16).unwrap();
        assert!(arfuse_layout(&fi)
            .unwrap_err()
            .to_string()
            .contains("flashinfer"));
    }

    #[test]
    fn without_a_driver_open_is_an_error_not_a_panic() {
        match Gpu::open(0) {
            Ok(g) => {
                // A GPU is here: what the probe read must be a real device.
                let i = g.info();
                println!("GPU present: {i:?}");
                assert!(i.sm >= 70 && i.sm_count > 0, "{i:?}");
                assert!(i.total_bytes > 0 && i.free_bytes <= i.total_bytes, "{i:?}");
                assert!(!i.name.is_empty(), "{i:?}");
            }
            Err(e) => {
                println!("skipped: no CUDA driver ({e})");
                assert!(
                    matches!(e, Error::NoDriver(_) | Error::Driver { .. }),
                    "{e}"
                );
            }
        }
    }
}
