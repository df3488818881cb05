//! Real ranks on CUDA GPUs (issue 43): one rank per process of a [`Group`], each with its
//! GPU, over a workspace whose every rank's region is a CUDA allocation that the other
//! processes map through CUDA IPC handles (the trtllm backend).
//!
//! [`IpcWorkspace::create`] is collective and all or nothing, as the host device's
//! [`crate::host::RankWorkspace::create`]: the ranks agree on the request and vote for
//! the backend; each allocates its region, fills it (sentinels, state zero) and waits
//! for the fill; the IPC handles are all-gathered (the barrier after the fill); each rank
//! opens its peers' handles. A failure on any rank closes and frees every rank's
//! mappings and regions and gives every rank the same error. Never inside a capture:
//! creation refuses when the stream given is capturing, on every rank alike.
//!
//! The mnnvl backend (`cuMemCreate` with POSIX-fd or fabric handles, bound to a
//! multicast object) is not written yet: a GPU rank does not offer it in the vote, so a
//! chain that starts with mnnvl falls back to trtllm on every rank alike.
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

/// One rank's view of a workspace shared with the other processes of a group over CUDA
/// IPC (see the module docs).
pub struct IpcWorkspace {
    /// The workspace (the plan's, per rank).
    pub workspace: Workspace,
    /// Its byte offsets (one rank).
    pub layout: ArfuseLayout,
    /// The backend the ranks voted for.
    pub backend: Backend,
    rank: u32,
    own: DeviceBuffer,
    /// Peers' regions opened from their IPC handles (closed on drop).
    opened: Vec<sys::CUdeviceptr>,
    peer_addr: [u64; arfuse_abi::MAX_RANKS as usize],
    err: DeviceBuffer,
    calls: u64,
}

impl Drop for IpcWorkspace {
    fn drop(&mut self) {
        for &p in &self.opened {
            // SAFETY: a pointer cuIpcOpenMemHandle returned, closed once.
            unsafe {
                let _ = sys::cuIpcCloseMemHandle(p);
            }
        }
    }
}

/// Peers' regions opened so far, closed when dropped (a failed creation).
struct Opened(Vec<(usize, sys::CUdeviceptr)>);

impl Drop for Opened {
    fn drop(&mut self) {
        for &(_, p) in &self.0 {
            // SAFETY: as in IpcWorkspace's drop.
            unsafe {
                let _ = sys::cuIpcCloseMemHandle(p);
            }
        }
    }
}

/// Whether this GPU can run `b` for real ranks.
fn runs(b: Backend) -> bool {
    match b {
        Backend::Trtllm => true,
        // cuMemCreate + multicast for real ranks is not written (module docs).
        Backend::Mnnvl => false,
    }
}

impl IpcWorkspace {
    /// Creates `request` across the `group` (collective: every rank calls it with its
    /// GPU, in the same order as its other collectives). `chain` is the fallback order
    /// of backends; `stream` is the stream the calls will be launched on (creation is
    /// refused while it captures).
    ///
    /// # Errors
    /// As [`crate::host::RankWorkspace::create`]; [`Error::RankFailed`] naming a rank
    /// whose stream was capturing, whose allocation failed or that could not open a
    /// peer's handle; driver errors.
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
        let backend = vote(group, &request_key(request, &layout), chain, &runs)?;
        let own = Self::allocate(gpu, &layout, request, stream_of(stream));
        let handles = all_or_nothing(
            group,
            "allocation",
            own.as_ref()
                .map(|(_, h)| h.to_vec())
                .map_err(|e| e.to_string()),
        )?;
        let (own, _) = own?;
        let mut opened = Opened(Vec::new());
        let mut mapped: std::result::Result<Vec<u8>, String> = Ok(Vec::new());
        for (q, h) in handles.iter().enumerate() {
            if q as u32 == group.rank() {
                continue;
            }
            match Self::open(h) {
                Ok(p) => opened.0.push((q, p)),
                Err(e) => {
                    mapped = Err(format!("opening rank {q}'s IPC handle: {e}"));
                    break;
                }
            }
        }
        all_or_nothing(group, "mapping", mapped)?;
        let err = gpu.alloc(4)?;
        let mut ws = IpcWorkspace {
            workspace: request.clone(),
            layout,
            backend,
            rank: group.rank(),
            own,
            opened: Vec::new(),
            peer_addr: [0; arfuse_abi::MAX_RANKS as usize],
            err,
            calls: 0,
        };
        ws.peer_addr[ws.rank as usize] = ws.own.ptr;
        for (q, p) in std::mem::take(&mut opened.0) {
            ws.peer_addr[q] = p;
            ws.opened.push(p);
        }
        Ok(ws)
    }

    /// This rank's region, allocated, filled (and the fill waited for) and exported.
    fn allocate(
        gpu: &Gpu,
        layout: &ArfuseLayout,
        request: &Workspace,
        stream: sys::CUstream,
    ) -> Result<(DeviceBuffer, [u8; IPC_HANDLE_BYTES])> {
        if gpu.stream_capturing(stream)? {
            return Err(Error::Capturing("creating a real-rank workspace".into()));
        }
        let own = gpu.alloc(layout.bytes_per_rank)?;
        enqueue_rank_fill(gpu, own.ptr, layout, request.dtype)?;
        gpu.sync()?;
        // SAFETY: a zeroed handle is plain C data, written by the driver.
        let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: `own` is a cuMemAlloc allocation of this context; valid out-pointer.
        check(
            unsafe { sys::cuIpcGetMemHandle(&mut handle, own.ptr) },
            "cuIpcGetMemHandle",
        )?;
        let mut bytes = [0u8; IPC_HANDLE_BYTES];
        for (b, c) in bytes.iter_mut().zip(handle.reserved.iter()) {
            *b = *c as u8;
        }
        Ok((own, bytes))
    }

    /// Opens a peer's region from its handle's bytes.
    fn open(bytes: &[u8]) -> Result<sys::CUdeviceptr> {
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
        Ok(ptr)
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
        gpu.download(&self.own, off, &mut a)?;
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
            enqueue_rank_fill(gpu, self.own.ptr, &self.layout, self.workspace.dtype)?;
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
