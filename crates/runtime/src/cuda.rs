//! The CUDA device ([`Gpu`], a [`Device`]): device probe, virtual-rank workspaces,
//! kernel loading, fused and unfused launches, CUDA graph capture and replay. The only
//! module of the workspace that uses cudarc. Everything returns
//! [`Error::NoDriver`] on a machine without an NVIDIA driver (checked with a plain
//! `dlopen` before cudarc is touched, since cudarc 0.16 panics when libcuda is absent).
//!
//! Virtual ranks: the W ranks' workspaces are W slices of ONE allocation; the fused
//! kernel is launched once with grid `(nblocks, W, 1)` as a cooperative launch, which
//! the driver accepts only when every CTA can be resident at once, so the spinning
//! ranks cannot starve each other. Real peers later pass IPC or multicast-unicast
//! addresses in the same `peer[]` array and launch `(nblocks, 1, 1)` per GPU.
//!
//! Real ranks (one GPU per process of a [`crate::group::Group`]): [`ipc::IpcWorkspace`].
//!
//! NOT YET RUN ON A GPU: this session had no device machine; this module compiles and
//! its CPU-side parts (shapes, parameters) are unit-tested, the rest is unverified.

use crate::device::{self, arfuse_layout, Allocation, Device, FusedCall, KernelParams};
use crate::error::{Error, Result};
use crate::variants::{self, ActDtype, Arch, Variant};
use crate::workspace::Backend;
use arfuse_policy::{ArfuseLayout, Workspace};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

pub mod ipc;

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
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`: `cuMemCreate` allocations
    /// can be exported as fabric handles (an NVLink fabric with its IMEX service).
    pub fabric_handles: bool,
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

impl Allocation for DeviceBuffer {
    fn ptr(&self) -> u64 {
        self.ptr
    }
    fn bytes(&self) -> u64 {
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
    compile_threads: usize,
    pdl: bool,
    cooperative: bool,
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
            let fabric_handles =
                attr(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED).unwrap_or(0) != 0;
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
                    fabric_handles,
                    free_bytes: free as u64,
                    total_bytes: total as u64,
                },
                arch: Arch::for_sm(sm),
                kernels: HashMap::new(),
                capturing: std::cell::Cell::new(false),
                compile_threads: 4,
                pdl: true,
                cooperative: true,
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

    /// The device's ordinal (as given to [`Gpu::open`]).
    pub fn ordinal(&self) -> usize {
        self._ctx.ordinal()
    }

    /// Whether the stream is capturing (asks the driver, and our own flag).
    pub fn capturing(&self) -> Result<bool> {
        Ok(self.capturing.get() || self.stream_capturing(self.stream)?)
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
        // SAFETY: range checked above.
        unsafe { self.read_device(src.ptr + offset, dst) }
    }

    /// Copies `dst.len()` bytes at device address `addr` to the host, after everything
    /// enqueued on the work stream, and waits for it.
    ///
    /// # Safety
    /// `[addr, addr + dst.len())` is device memory mapped in this context.
    pub(crate) unsafe fn read_device(&self, addr: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: the caller's range; `dst` outlives the copy (sync() below).
        check(
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    dst.as_mut_ptr().cast::<c_void>(),
                    addr,
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
        self.sync_stream(self.stream)
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
        self.launch_on(self.stream, f, gx, gy, block, params, cooperative, pdl)
    }

    /// Whether `stream` (a stream of this device's context, e.g. torch's current
    /// stream) is capturing.
    ///
    /// # Errors
    /// Driver errors.
    fn stream_capturing(&self, stream: sys::CUstream) -> Result<bool> {
        let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a stream handle of this context and a valid out-pointer.
        check(
            unsafe { sys::cuStreamIsCapturing(stream, &mut st) },
            "cuStreamIsCapturing",
        )?;
        Ok(st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Waits for everything enqueued on `stream`.
    ///
    /// # Errors
    /// Driver errors (a kernel fault included).
    fn sync_stream(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: a stream handle of this context.
        check(
            unsafe { sys::cuStreamSynchronize(stream) },
            "cuStreamSynchronize",
        )
    }

    /// [`Gpu::launch`] on `stream` (a stream of this device's context, e.g. torch's
    /// current stream) instead of this handle's own.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_on(
        &self,
        stream: sys::CUstream,
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
            hStream: stream,
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

    /// NVRTC threads [`Device::load`] compiles with (default 4).
    pub fn set_compile_threads(&mut self, threads: usize) {
        self.compile_threads = threads.clamp(1, 64);
    }

    /// Whether the launches of [`Device`] carry programmatic dependent launch (PDL,
    /// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`; default on): a kernel
    /// may then start while the previous one in the stream finishes, and waits for it
    /// (`griddepcontrol.wait`) before its first read of memory; every kernel lets the
    /// next one start only after its last store (`griddepcontrol.launch_dependents`
    /// after the final barrier). Off: every launch waits for the previous kernel to end.
    pub fn set_pdl(&mut self, on: bool) {
        self.pdl = on;
    }

    /// Whether fused launches of virtual ranks are cooperative (the default: the driver
    /// then guarantees that every CTA is resident at once). Off, the grid is still
    /// sized to what the GPU holds at once, without the guarantee: the GPU check's
    /// preflight compares the two.
    pub fn set_cooperative(&mut self, on: bool) {
        self.cooperative = on;
    }

    /// Whether PDL is on ([`Gpu::set_pdl`]).
    pub fn pdl(&self) -> bool {
        self.pdl
    }

    /// Every tensor `call` touches lies inside one allocation of this context
    /// (`cuMemGetAddressRange`): a kernel that read or wrote past a caller's buffer
    /// (a scale buffer allocated without its padding, say) would corrupt memory or
    /// lose the context.
    fn check_in_memory(&self, call: &FusedCall) -> Result<()> {
        for u in device::tensor_uses(call)? {
            let ranks = if u.tensor.rank_stride == 0 {
                1
            } else {
                call.ranks
            };
            for r in 0..u64::from(ranks) {
                let at = r
                    .checked_mul(u.tensor.rank_stride)
                    .and_then(|o| o.checked_add(u.tensor.ptr))
                    .ok_or(Error::Overflow("tensor address"))?;
                let (mut base, mut size) = (0, 0usize);
                // SAFETY: out-pointers to locals; the driver only reads `at`.
                let rc = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, at) };
                let end = base.saturating_add(size as u64);
                let fits = at.checked_add(u.bytes).is_some_and(|e| e <= end);
                if rc != sys::CUresult::CUDA_SUCCESS || !fits {
                    return Err(Error::Invalid(format!(
                        "tensor {} of rank {r}: {} bytes from {at:#x} are not inside one allocation of this device ({})",
                        u.name,
                        u.bytes,
                        if rc == sys::CUresult::CUDA_SUCCESS {
                            format!("its allocation ends at {end:#x}")
                        } else {
                            format!("{rc:?}")
                        }
                    )));
                }
            }
        }
        Ok(())
    }

    /// Captures what `body` enqueues on the stream into an instantiated graph
    /// ([`Device::capture`]). Allocation and kernel loading are refused while `body` runs.
    fn capture_stream(&mut self, body: &mut dyn FnMut(&mut Gpu) -> Result<()>) -> Result<Graph> {
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

/// Enqueues on the work stream the initial state of one rank's workspace at `rank`
/// (device address of its first byte, [`ArfuseLayout::bytes_per_rank`] bytes there): the
/// state block zero, the Lamport buffers the -0.0 sentinel of `dtype`.
///
/// # Errors
/// Driver errors.
fn enqueue_rank_fill(gpu: &Gpu, rank: u64, layout: &ArfuseLayout, dtype: ActDtype) -> Result<()> {
    let lam = arfuse_abi::LAMPORT_BUFFER_COUNT * layout.lamport_buffer_bytes;
    // SAFETY: the state block [0, lamport_offset) of the rank lies inside its
    // allocation (layout arithmetic is checked when the workspace is made).
    let rc = unsafe { sys::cuMemsetD8Async(rank, 0, layout.lamport_offset as usize, gpu.stream) };
    check(rc, "cuMemsetD8Async (workspace state)")?;
    let base = rank + layout.lamport_offset;
    let rc = match dtype {
        // SAFETY: the Lamport range of the rank lies inside its allocation, as above.
        ActDtype::Bf16 | ActDtype::F16 => unsafe {
            sys::cuMemsetD16Async(
                base,
                dtype.sentinel_bits() as u16,
                (lam / 2) as usize,
                gpu.stream,
            )
        },
        // SAFETY: as above.
        ActDtype::F32 => unsafe {
            sys::cuMemsetD32Async(base, dtype.sentinel_bits(), (lam / 4) as usize, gpu.stream)
        },
    };
    check(rc, "cuMemsetD16/D32Async (Lamport sentinel)")
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
        let ws = VirtualWorkspace {
            workspace: workspace.clone(),
            layout,
            memory: gpu.alloc(bytes)?,
            err: gpu.alloc(4)?,
        };
        ws.initialise(gpu)?;
        Ok(ws)
    }

    /// Writes the initial state on the work stream and waits for it: every rank's
    /// state block zero, its Lamport buffers the -0.0 sentinel of the activation dtype,
    /// the error word zero.
    ///
    /// # Errors
    /// Driver errors.
    pub fn initialise(&self, gpu: &Gpu) -> Result<()> {
        for r in 0..u64::from(self.workspace.world_size) {
            let rank = self.memory.ptr + r * self.layout.bytes_per_rank;
            enqueue_rank_fill(gpu, rank, &self.layout, self.workspace.dtype)?;
        }
        // SAFETY: the error word is the 4 bytes of `err`.
        let rc = unsafe { sys::cuMemsetD8Async(self.err.ptr, 0, 4, gpu.stream) };
        check(rc, "cuMemsetD8Async (error word)")?;
        gpu.sync()
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

/// The CUDA device: W virtual ranks of one GPU; a fused call is ONE cooperative
/// launch of grid `(nblocks, W, 1)`, local and virtual all-reduce calls one launch of
/// grid `(nblocks, W, 1)`, all on this handle's stream in call order (a launch reaches
/// every rank only when every rank's previous work is done, so the virtual all-reduce
/// meets the ranks as [`Device::launch_virtual_allreduce`] requires).
impl Device for Gpu {
    type Workspace = VirtualWorkspace;
    type Graph = Graph;
    type Buffer = DeviceBuffer;

    fn is_capturing(&self) -> Result<bool> {
        self.capturing()
    }

    fn create_workspace(
        &mut self,
        backend: Backend,
        workspace: &Workspace,
    ) -> Result<VirtualWorkspace> {
        match backend {
            // One GPU: no multicast object between ranks exists here.
            Backend::Mnnvl => Err(Error::Unsupported(
                "mnnvl needs NVLink multicast between GPUs; virtual ranks use trtllm layout".into(),
            )),
            Backend::Trtllm => VirtualWorkspace::create(self, workspace),
        }
    }

    fn load(&mut self, variants: &[Variant]) -> Result<()> {
        self.preload(variants, self.compile_threads)
    }

    fn launch_fused(&mut self, ws: &VirtualWorkspace, call: &FusedCall) -> Result<()> {
        let (_, world, block) = device::fused_shape(&ws.workspace, call)?;
        let f = self.kernel(&call.variant)?;
        let resident = self.resident_ctas(f, block)?;
        let gx = device::grid_width(call.tokens, resident / world);
        if gx == 0 {
            return Err(Error::Unsupported(format!(
                "{world} ranks x 1 CTA of {block} threads cannot be co-resident"
            )));
        }
        self.check_in_memory(call)?;
        let p = call
            .params
            .with_virtual_workspace(&ws.layout, world, ws.memory.ptr, ws.err.ptr)?
            .for_call(call)?;
        self.launch(f, gx, world, block, &p, self.cooperative, self.pdl)
    }

    fn launch_local(&mut self, call: &FusedCall) -> Result<()> {
        let block = device::local_shape(call)?;
        let f = self.kernel(&call.variant)?;
        self.check_in_memory(call)?;
        let p = call.params.for_call(call)?;
        let gx = call.tokens.min(device::MAX_LOCAL_CTAS);
        self.launch(f, gx, call.ranks, block, &p, false, self.pdl)
    }

    fn launch_virtual_allreduce(&mut self, call: &FusedCall) -> Result<()> {
        let block = device::virtual_allreduce_shape(call)?;
        let f = self.kernel(&call.variant)?;
        self.check_in_memory(call)?;
        let p = call.params.for_call(call)?;
        let gx = call.tokens.min(device::MAX_LOCAL_CTAS);
        self.launch(f, gx, call.ranks, block, &p, false, self.pdl)
    }

    fn capture(&mut self, body: &mut dyn FnMut(&mut Gpu) -> Result<()>) -> Result<Graph> {
        self.capture_stream(body)
    }

    fn replay(&mut self, graph: &Graph) -> Result<()> {
        graph.launch()
    }

    fn sync(&mut self) -> Result<()> {
        Gpu::sync(self)
    }

    fn take_error(&mut self, ws: &VirtualWorkspace) -> Result<()> {
        ws.take_error(self)
    }

    fn reset_workspace(&mut self, ws: &VirtualWorkspace) -> Result<()> {
        if self.capturing()? {
            return Err(Error::Capturing("resetting a workspace".into()));
        }
        self.sync()?;
        ws.initialise(self)
    }

    fn alloc(&mut self, bytes: u64) -> Result<DeviceBuffer> {
        Gpu::alloc(self, bytes)
    }

    fn upload(&mut self, dst: &DeviceBuffer, offset: u64, src: &[u8]) -> Result<()> {
        Gpu::upload(self, dst, offset, src)
    }

    fn download(&mut self, src: &DeviceBuffer, offset: u64, dst: &mut [u8]) -> Result<()> {
        Gpu::download(self, src, offset, dst)
    }

    fn fill(&mut self, buf: &DeviceBuffer, offset: u64, bytes: u64, value: u8) -> Result<()> {
        Gpu::fill(self, buf, offset, bytes, value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
