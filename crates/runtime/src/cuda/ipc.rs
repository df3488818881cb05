//! Real ranks on CUDA GPUs (issue 43): one rank per process of a [`Group`], each with its
//! GPU, over a workspace whose every rank's region is a CUDA allocation that the other
//! processes map:
//! - trtllm: a `cuMemAlloc` allocation exported as a CUDA IPC handle, opened by the
//!   peers with `cuIpcOpenMemHandle` (one node);
//! - mnnvl: a `cuMemCreate` allocation exported as a fabric handle
//!   (`CU_MEM_HANDLE_TYPE_FABRIC`), imported by the peers and mapped into their address
//!   space (`cuMemImportFromShareableHandle`, `cuMemMap`): the NVLink fabric's memory,
//!   across the nodes of one NVLink domain (GB200 / GB300 NVL72). A rank offers mnnvl
//!   in the vote when its GPU has multicast and fabric handles. arfuse's kernels reach
//!   every peer with unicast loads and stores through these mappings (they issue no
//!   `multimem` instruction), so no multicast object is made. POSIX-fd handles (mnnvl
//!   inside one node) are not used: a file descriptor cannot travel through the
//!   group's byte all-gather, and inside one node trtllm's IPC handles serve.
//!
//! [`IpcWorkspace::create`] is collective and all or nothing, as the host device's
//! [`crate::host::RankWorkspace::create`]: the ranks agree on the request and vote for
//! the backend; each allocates its region, fills it (sentinels, state zero) and waits
//! for the fill; the handles are all-gathered (the barrier after the fill); each rank
//! maps its peers' regions. A failure on any rank unmaps and frees every rank's regions
//! and gives every rank the same error. Never inside a capture: creation refuses when
//! the stream given is capturing, on every rank alike.
//!
//! NOT YET RUN ON A GPU: this code compiles and its CPU-side parts are shared with the
//! host device's real ranks (the vote, the all-or-nothing steps, the call result),
//! which run in CI; the driver calls are unverified.

use super::{check, enqueue_rank_fill, sys, DeviceBuffer, Gpu};
use crate::device::{self, arfuse_layout, FusedCall, KernelParams};
use crate::error::{Error, Result};
use crate::group::{all_or_nothing, call_result, request_key, vote, Group};
use crate::workspace::Backend;
use arfuse_abi::protocol;
use arfuse_policy::{ArfuseLayout, Workspace};

/// A CUDA stream of the device's primary context as an integer: torch's
/// `torch.cuda.current_stream().cuda_stream`, or `0` for the legacy default stream.
pub type RawStream = u64;

fn stream_of(s: RawStream) -> sys::CUstream {
    s as usize as sys::CUstream
}

/// Bytes of a CUDA IPC memory handle.
const IPC_HANDLE_BYTES: usize = 64;
/// Bytes of a fabric handle (`CUmemFabricHandle`).
const FABRIC_HANDLE_BYTES: usize = 64;

/// One rank's region as this process maps it; unmapped (and, for this rank's own,
/// freed) on drop.
enum Region {
    /// This rank's `cuMemAlloc` allocation (trtllm).
    Alloc(DeviceBuffer),
    /// A peer's allocation opened from its IPC handle.
    Ipc(sys::CUdeviceptr),
    /// A `cuMemCreate` allocation (this rank's, or a peer's imported from its fabric
    /// handle) mapped at `ptr`.
    Fabric {
        ptr: sys::CUdeviceptr,
        size: usize,
        handle: sys::CUmemGenericAllocationHandle,
    },
}

impl Region {
    fn ptr(&self) -> u64 {
        match self {
            Region::Alloc(b) => b.ptr,
            Region::Ipc(p) => *p,
            Region::Fabric { ptr, .. } => *ptr,
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        match *self {
            Region::Alloc(_) => {}
            // SAFETY: a pointer cuIpcOpenMemHandle returned, closed once.
            Region::Ipc(p) => unsafe {
                let _ = sys::cuIpcCloseMemHandle(p);
            },
            // SAFETY: a mapping `fabric_map` made (reserved, mapped, handle held),
            // undone once, in reverse order.
            Region::Fabric { ptr, size, handle } => unsafe {
                let _ = sys::cuMemUnmap(ptr, size);
                let _ = sys::cuMemAddressFree(ptr, size);
                let _ = sys::cuMemRelease(handle);
            },
        }
    }
}

/// One rank's view of a workspace shared with the other processes of a group (see the
/// module docs).
pub struct IpcWorkspace {
    /// The workspace (the plan's, per rank).
    pub workspace: Workspace,
    /// Its byte offsets (one rank).
    pub layout: ArfuseLayout,
    /// The backend the ranks voted for.
    pub backend: Backend,
    rank: u32,
    own: Region,
    /// Peers' regions as mapped here.
    _peers: Vec<Region>,
    peer_addr: [u64; arfuse_abi::MAX_RANKS as usize],
    err: DeviceBuffer,
    calls: u64,
}

/// Whether `gpu` can run `b` for real ranks.
fn runs(gpu: &Gpu, b: Backend) -> bool {
    match b {
        Backend::Trtllm => true,
        Backend::Mnnvl => gpu.info().multicast && gpu.info().fabric_handles,
    }
}

/// The properties of a fabric-exportable allocation on device `ordinal`.
fn fabric_prop(ordinal: usize) -> Result<sys::CUmemAllocationProp> {
    // SAFETY: plain C data; the fields that matter are set below, the rest zero.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = i32::try_from(ordinal).map_err(|_| Error::Overflow("device ordinal"))?;
    Ok(prop)
}

/// Reserves an address range of `size` bytes on device `ordinal`, maps `handle` there
/// and gives the device read-write access. On failure, what was done is undone and
/// `handle` released.
fn fabric_map(
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
    ordinal: usize,
) -> Result<Region> {
    let prop = fabric_prop(ordinal)?;
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: valid out-pointer; no fixed address asked for.
    let reserved = check(
        unsafe { sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0) },
        "cuMemAddressReserve",
    );
    if let Err(e) = reserved {
        // SAFETY: a handle this function owns, released once.
        unsafe {
            let _ = sys::cuMemRelease(handle);
        }
        return Err(e);
    }
    // SAFETY: `ptr` reserves `size` bytes; `handle` is an allocation of `size` bytes.
    let mapped = check(
        unsafe { sys::cuMemMap(ptr, size, 0, handle, 0) },
        "cuMemMap",
    );
    if let Err(e) = mapped {
        // SAFETY: undoing the reservation above, then releasing the handle, once.
        unsafe {
            let _ = sys::cuMemAddressFree(ptr, size);
            let _ = sys::cuMemRelease(handle);
        }
        return Err(e);
    }
    // From here the Region's drop undoes everything.
    let region = Region::Fabric { ptr, size, handle };
    let access = sys::CUmemAccessDesc {
        location: prop.location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the mapping above, one access descriptor.
    check(
        unsafe { sys::cuMemSetAccess(ptr, size, &access, 1) },
        "cuMemSetAccess",
    )?;
    Ok(region)
}

impl IpcWorkspace {
    /// Creates `request` across the `group` (collective: every rank calls it with its
    /// GPU, in the same order as its other collectives). `chain` is the fallback order
    /// of backends; `stream` is the stream the calls will be launched on (creation is
    /// refused while it captures).
    ///
    /// # Errors
    /// As [`crate::host::RankWorkspace::create`]; [`Error::RankFailed`] naming a rank
    /// whose stream was capturing, whose allocation failed or that could not map a
    /// peer's region; driver errors.
    pub fn create(
        gpu: &Gpu,
        group: &dyn Group,
        request: &Workspace,
        chain: &[Backend],
        stream: RawStream,
    ) -> Result<IpcWorkspace> {
        let layout = arfuse_layout(request)?;
        let world = group.world_size();
        if request.world_size != world || world > arfuse_abi::MAX_RANKS {
            return Err(Error::Invalid(format!(
                "a workspace for W = {} on a group of {world} ranks",
                request.world_size
            )));
        }
        let runs_here = |b: Backend| runs(gpu, b);
        let backend = vote(group, &request_key(request, &layout), chain, &runs_here)?;
        let own = Self::allocate(gpu, backend, &layout, request, stream_of(stream));
        let handles = all_or_nothing(
            group,
            "allocation",
            own.as_ref()
                .map(|(_, h)| h.clone())
                .map_err(|e| e.to_string()),
        )?;
        let (own, _) = own?;
        let mut peers: Vec<(usize, Region)> = Vec::new();
        let mut mapped: std::result::Result<Vec<u8>, String> = Ok(Vec::new());
        for (q, h) in handles.iter().enumerate() {
            if q as u32 == group.rank() {
                continue;
            }
            match Self::map_peer(gpu, backend, h) {
                Ok(r) => peers.push((q, r)),
                Err(e) => {
                    mapped = Err(format!("mapping rank {q}'s region: {e}"));
                    break;
                }
            }
        }
        all_or_nothing(group, "mapping", mapped)?;
        let err = gpu.alloc(4)?;
        let mut peer_addr = [0; arfuse_abi::MAX_RANKS as usize];
        peer_addr[group.rank() as usize] = own.ptr();
        for (q, r) in &peers {
            peer_addr[*q] = r.ptr();
        }
        Ok(IpcWorkspace {
            workspace: request.clone(),
            layout,
            backend,
            rank: group.rank(),
            own,
            _peers: peers.into_iter().map(|(_, r)| r).collect(),
            peer_addr,
            err,
            calls: 0,
        })
    }

    /// This rank's region for `backend`, allocated, filled (and the fill waited for),
    /// with the bytes its peers map it from: an IPC handle (trtllm), or a fabric
    /// handle and the region's size (mnnvl).
    fn allocate(
        gpu: &Gpu,
        backend: Backend,
        layout: &ArfuseLayout,
        request: &Workspace,
        stream: sys::CUstream,
    ) -> Result<(Region, Vec<u8>)> {
        if gpu.stream_capturing(stream)? {
            return Err(Error::Capturing("creating a real-rank workspace".into()));
        }
        let own = match backend {
            Backend::Trtllm => Region::Alloc(gpu.alloc(layout.bytes_per_rank)?),
            Backend::Mnnvl => Self::fabric_alloc(gpu, layout.bytes_per_rank)?,
        };
        enqueue_rank_fill(gpu, own.ptr(), layout, request.dtype)?;
        gpu.sync()?;
        let bytes = match &own {
            Region::Fabric { size, handle, .. } => {
                let mut fh = [0u8; FABRIC_HANDLE_BYTES];
                // SAFETY: a cuMemCreate handle requested with the fabric handle type;
                // `fh` has the 64 bytes of a CUmemFabricHandle.
                check(
                    unsafe {
                        sys::cuMemExportToShareableHandle(
                            fh.as_mut_ptr().cast(),
                            *handle,
                            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
                            0,
                        )
                    },
                    "cuMemExportToShareableHandle (fabric)",
                )?;
                let mut out = fh.to_vec();
                out.extend_from_slice(&(*size as u64).to_le_bytes());
                out
            }
            _ => Self::ipc_handle(own.ptr())?.to_vec(),
        };
        Ok((own, bytes))
    }

    /// A `cuMemCreate` allocation of at least `bytes` (rounded up to the recommended
    /// granularity), exportable as a fabric handle, mapped here.
    fn fabric_alloc(gpu: &Gpu, bytes: u64) -> Result<Region> {
        let prop = fabric_prop(gpu.ordinal())?;
        let mut gran = 0usize;
        // SAFETY: valid out-pointer and properties.
        check(
            unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut gran,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                )
            },
            "cuMemGetAllocationGranularity",
        )?;
        let gran = gran.max(1) as u64;
        let size = bytes
            .checked_add(gran - 1)
            .map(|b| b / gran * gran)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or(Error::Overflow("fabric allocation size"))?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and properties; the size is a granularity multiple.
        check(
            unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) },
            "cuMemCreate (fabric)",
        )?;
        fabric_map(handle, size, gpu.ordinal())
    }

    /// The IPC handle of this context's `cuMemAlloc` allocation at `ptr`.
    fn ipc_handle(ptr: u64) -> Result<[u8; IPC_HANDLE_BYTES]> {
        // SAFETY: a zeroed handle is plain C data, written by the driver.
        let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: `ptr` is a cuMemAlloc allocation of this context; valid out-pointer.
        check(
            unsafe { sys::cuIpcGetMemHandle(&mut handle, ptr) },
            "cuIpcGetMemHandle",
        )?;
        let mut bytes = [0u8; IPC_HANDLE_BYTES];
        for (b, c) in bytes.iter_mut().zip(handle.reserved.iter()) {
            *b = *c as u8;
        }
        Ok(bytes)
    }

    /// Maps a peer's region from the bytes its [`IpcWorkspace::allocate`] exported.
    fn map_peer(gpu: &Gpu, backend: Backend, bytes: &[u8]) -> Result<Region> {
        match backend {
            Backend::Trtllm => Self::open_ipc(bytes),
            Backend::Mnnvl => {
                if bytes.len() != FABRIC_HANDLE_BYTES + 8 {
                    return Err(Error::Invalid(format!(
                        "a fabric handle and size of {} bytes",
                        bytes.len()
                    )));
                }
                let (fh, size) = bytes.split_at(FABRIC_HANDLE_BYTES);
                let size = u64::from_le_bytes(size.try_into().expect("8 bytes"));
                let size = usize::try_from(size).map_err(|_| Error::Overflow("fabric size"))?;
                let mut fh_buf = [0u8; FABRIC_HANDLE_BYTES];
                fh_buf.copy_from_slice(fh);
                let mut handle: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: the 64 bytes of a CUmemFabricHandle a peer exported; valid
                // out-pointer.
                check(
                    unsafe {
                        sys::cuMemImportFromShareableHandle(
                            &mut handle,
                            fh_buf.as_mut_ptr().cast(),
                            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
                        )
                    },
                    "cuMemImportFromShareableHandle (fabric)",
                )?;
                fabric_map(handle, size, gpu.ordinal())
            }
        }
    }

    /// Opens a peer's `cuMemAlloc` region from its IPC handle's bytes.
    fn open_ipc(bytes: &[u8]) -> Result<Region> {
        if bytes.len() != IPC_HANDLE_BYTES {
            return Err(Error::Invalid(format!(
                "an IPC handle of {} bytes",
                bytes.len()
            )));
        }
        // SAFETY: plain C data, filled below.
        let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (c, b) in handle.reserved.iter_mut().zip(bytes) {
            *c = *b as std::ffi::c_char;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: a handle another process exported; valid out-pointer.
        check(
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    handle,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            "cuIpcOpenMemHandle",
        )?;
        Ok(Region::Ipc(ptr))
    }

    /// This process's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Whether `stream` is capturing (launches then are recorded, and errors are read
    /// at the next call outside the capture).
    ///
    /// # Errors
    /// Driver errors.
    pub fn capturing(gpu: &Gpu, stream: RawStream) -> Result<bool> {
        gpu.stream_capturing(stream_of(stream))
    }

    /// `base` with this rank's workspace fields: every rank's region as mapped here,
    /// the offsets, this process's error word, `rank_base` = this rank.
    pub fn params(&self, base: KernelParams) -> KernelParams {
        KernelParams {
            peer: self.peer_addr,
            off_state: self.layout.state_offset,
            off_lamport: self.layout.lamport_offset,
            lamport_stride: self.layout.lamport_buffer_bytes,
            err: self.err.ptr,
            rank_base: self.rank as i32,
            ..base
        }
    }

    /// Enqueues this rank's part of a fused call on `stream` (capture-safe: no
    /// allocation, no compilation, no sync; the variant must have been loaded by
    /// [`Gpu::kernel`] before a capture). A non-cooperative launch of `(nblocks, 1, 1)`
    /// CTAs, `nblocks` at most what the GPU holds at once; PDL as the [`Gpu`] is set.
    ///
    /// # Errors
    /// As [`device::fused_shape_of_rank`]; [`Error::Capturing`] for a variant not loaded
    /// before a capture; driver errors.
    pub fn launch(&mut self, gpu: &mut Gpu, call: &FusedCall, stream: RawStream) -> Result<()> {
        let (_, _, block) = device::fused_shape_of_rank(&self.workspace, call)?;
        let f = match gpu.cached_kernel(&call.variant) {
            Some(f) => f,
            None => gpu.kernel(&call.variant)?,
        };
        let resident = gpu.resident_ctas(f, block)?;
        let gx = device::grid_width(call.tokens, resident);
        if gx == 0 {
            return Err(Error::Unsupported(format!(
                "no CTA of {block} threads fits this GPU"
            )));
        }
        let p = self.params(call.params.for_call(call)?);
        let p = KernelParams {
            rank_base: self.rank as i32,
            ..p
        };
        self.calls += 1;
        gpu.launch_on(stream_of(stream), f, gx, 1, block, &p, false, gpu.pdl())
    }

    /// Waits for `stream`, then reads and clears this rank's error word and reads its
    /// abort word: the outcome of the calls since the last check.
    ///
    /// # Errors
    /// [`Error::CallFailed`] (see [`call_result`]): the workspace must then be
    /// [`IpcWorkspace::reset`]; driver errors.
    pub fn take_error(&self, gpu: &Gpu, stream: RawStream) -> Result<()> {
        gpu.sync_stream(stream_of(stream))?;
        let mut w = [0u8; 4];
        gpu.download(&self.err, 0, &mut w)?;
        let word = u32::from_le_bytes(w);
        let mut a = [0u8; 4];
        let off = self.layout.state_offset + protocol::STATE_WORD_ABORT * 4;
        // SAFETY: the abort word lies in this rank's state block, inside its region.
        unsafe { gpu.read_device(self.own.ptr() + off, &mut a)? };
        if word != 0 {
            gpu.upload(&self.err, 0, &[0u8; 4])?;
        }
        call_result(
            self.rank,
            self.calls.saturating_sub(1),
            word,
            u32::from_le_bytes(a),
        )
    }

    /// Puts the workspace back in its created state on every rank (collective): the
    /// stream drained, a barrier, this rank's region refilled and its error word
    /// cleared (and waited for), a barrier. Refused while `stream` captures.
    ///
    /// # Errors
    /// [`Error::RankFailed`] or [`Error::Group`] on every surviving rank when a rank
    /// fails or is gone; driver errors.
    pub fn reset(&mut self, gpu: &Gpu, group: &dyn Group, stream: RawStream) -> Result<()> {
        let drained = gpu
            .sync_stream(stream_of(stream))
            .map(|()| Vec::new())
            .map_err(|e| e.to_string());
        all_or_nothing(group, "reset (drain)", drained)?;
        let refill = (|| {
            enqueue_rank_fill(gpu, self.own.ptr(), &self.layout, self.workspace.dtype)?;
            // SAFETY: the error word is the 4 bytes of `err`.
            check(
                unsafe { sys::cuMemsetD8Async(self.err.ptr, 0, 4, gpu.stream) },
                "cuMemsetD8Async (error word)",
            )?;
            gpu.sync()
        })()
        .map(|()| Vec::new())
        .map_err(|e| e.to_string());
        self.calls = 0;
        all_or_nothing(group, "reset (refill)", refill)?;
        Ok(())
    }
}
