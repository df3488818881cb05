//! Real ranks on the host device: W processes, each one rank of a [`Group`], run the
//! same host-compiled kernels over a workspace in POSIX shared memory that every rank
//! maps, the way W GPUs run over IPC-mapped memory.
//!
//! [`RankWorkspace::create`] is collective and all or nothing (issue 43):
//! 1. **agreement and vote**: every rank sends its request (W, H, dtype, bytes per
//!    rank) and the backends its device can run; ranks that ask for different
//!    workspaces fail alike, and the backend is the first of the fallback chain every
//!    rank can run (the weakest rank wins);
//! 2. **allocation**: each rank creates its region (`shm_open` under a fresh name),
//!    fills it (Lamport buffers the -0.0 sentinel, state zero) and sends the name;
//! 3. **mapping**: each rank maps every peer's region by name;
//!
//! and after each step every rank knows whether all succeeded. A failure on any rank
//! frees every rank's regions and returns the same [`Error::RankFailed`] (the rank and
//! its cause) on every rank. The exchange after step 2 is also the barrier after the
//! sentinel fill: no peer pushes into a region before its owner filled it. Once every
//! rank mapped every region the names are unlinked, so a process that dies later
//! leaks nothing.
//!
//! A call ([`RankWorkspace::launch`]) runs this rank's CTAs with `rank_base` = its
//! rank and its own error word; the kernels' call headers and abort words
//! (`arfuse_abi::protocol`) end a call on every rank when any rank gives up or the
//! ranks disagree on the call. After a failed call the workspace must be reset
//! collectively ([`RankWorkspace::reset`]: barrier, refill, barrier) before it is used
//! again.

use super::launch::{HostKernel, LaunchOptions};
use super::memory::HostBuffer;
use crate::device::{self, FusedCall, KernelParams};
use crate::error::{Error, Result};
use crate::group::{all_or_nothing, request_key, vote, Group};
use crate::workspace::Backend;
use arfuse_abi::protocol;
use arfuse_policy::{ArfuseLayout, Workspace};
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};

/// Numbers the shared-memory regions this process creates (with the pid, a fresh name).
static REGION_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A POSIX shared-memory region mapped into this process.
struct ShmRegion {
    name: CString,
    addr: *mut libc::c_void,
    len: usize,
    /// Whether this process created the name and has not unlinked it yet.
    owns_name: bool,
}

// SAFETY: the mapping is plain shared memory; the region is only read and written by
// kernels during launches and by its owner between them.
unsafe impl Send for ShmRegion {}

fn os_err(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

impl ShmRegion {
    /// Creates a region of `len` bytes under a fresh name.
    fn create(len: usize) -> std::result::Result<ShmRegion, String> {
        let k = REGION_COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("/arfuse-{}-{k}", std::process::id());
        let cname = CString::new(name.clone()).map_err(|e| e.to_string())?;
        // SAFETY: a NUL-terminated name; the result is checked.
        let fd = unsafe {
            libc::shm_open(
                cname.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            )
        };
        if fd < 0 {
            return Err(os_err(&format!("shm_open({name})")));
        }
        let mut region = ShmRegion {
            name: cname,
            addr: std::ptr::null_mut(),
            len,
            owns_name: true,
        };
        // SAFETY: fd is a fresh shared-memory object of this process.
        let sized = unsafe { libc::ftruncate(fd, len as libc::off_t) };
        let res = if sized != 0 {
            Err(os_err(&format!("ftruncate({name}, {len})")))
        } else {
            region.map(fd)
        };
        // SAFETY: fd is open and closed once; the mapping keeps the object alive.
        unsafe { libc::close(fd) };
        res.map(|()| region)
    }

    /// Maps the region a peer created under `name`, which must hold `len` bytes.
    fn open(name: &str, len: usize) -> std::result::Result<ShmRegion, String> {
        let cname = CString::new(name).map_err(|e| e.to_string())?;
        // SAFETY: a NUL-terminated name; the result is checked.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            return Err(os_err(&format!("shm_open({name})")));
        }
        let mut region = ShmRegion {
            name: cname,
            addr: std::ptr::null_mut(),
            len,
            owns_name: false,
        };
        // SAFETY: fstat into a zeroed struct of the right type.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        let res = if unsafe { libc::fstat(fd, &mut st) } != 0 {
            Err(os_err(&format!("fstat({name})")))
        } else if st.st_size as u64 != len as u64 {
            Err(format!(
                "{name} holds {} bytes; the workspace needs {len}",
                st.st_size
            ))
        } else {
            region.map(fd)
        };
        // SAFETY: as in create.
        unsafe { libc::close(fd) };
        res.map(|()| region)
    }

    fn map(&mut self, fd: libc::c_int) -> std::result::Result<(), String> {
        // SAFETY: a shared mapping of an object of at least `len` bytes; checked.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(os_err(&format!(
                "mmap of {} bytes of {}",
                self.len,
                self.name.to_string_lossy()
            )));
        }
        self.addr = addr;
        Ok(())
    }

    fn unlink(&mut self) {
        if self.owns_name {
            // SAFETY: the name this process created.
            unsafe { libc::shm_unlink(self.name.as_ptr()) };
            self.owns_name = false;
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `len` mapped bytes; no kernel runs while `&mut self` is held.
        unsafe { std::slice::from_raw_parts_mut(self.addr.cast::<u8>(), self.len) }
    }
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        if !self.addr.is_null() {
            // SAFETY: the mapping made in `map`, unmapped once.
            unsafe { libc::munmap(self.addr, self.len) };
        }
        self.unlink();
    }
}

/// Options of one rank's part of a workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RankOptions {
    /// Most bytes this rank may allocate for one workspace (`None`: no limit of
    /// arfuse's own; the system's shared memory still is one). A larger request fails
    /// the collective creation on every rank, naming this rank.
    pub max_bytes: Option<u64>,
    /// The backends this rank's device can run (the vote's input). The host device
    /// runs both: its regions are mapped by every rank, as unicast (trtllm) or
    /// multicast-unicast (mnnvl) mappings are.
    pub backends: [bool; 2],
}

impl Default for RankOptions {
    fn default() -> RankOptions {
        RankOptions {
            max_bytes: None,
            backends: [true, true],
        }
    }
}

impl RankOptions {
    /// These options with a per-rank allocation limit.
    pub fn with_max_bytes(self, max_bytes: Option<u64>) -> RankOptions {
        RankOptions { max_bytes, ..self }
    }

    /// These options with the backends this rank can run.
    pub fn with_backends(self, trtllm: bool, mnnvl: bool) -> RankOptions {
        RankOptions {
            backends: [trtllm, mnnvl],
            ..self
        }
    }

    fn runs(&self, b: Backend) -> bool {
        match b {
            Backend::Trtllm => self.backends[0],
            Backend::Mnnvl => self.backends[1],
        }
    }
}

/// One rank's view of a workspace shared by W processes (see the module docs).
pub struct RankWorkspace {
    /// The workspace (the plan's, per rank).
    pub workspace: Workspace,
    /// Its byte offsets (one rank).
    pub layout: ArfuseLayout,
    /// The backend the ranks voted for.
    pub backend: Backend,
    rank: u32,
    own: ShmRegion,
    /// Every rank's region (this rank's too, as `own`'s address).
    peers: Vec<ShmRegion>,
    peer_addr: [u64; arfuse_abi::MAX_RANKS as usize],
    err: HostBuffer,
    calls: u64,
}

impl RankWorkspace {
    /// Creates `request` across the `group` (collective: every rank calls it with its
    /// request, in the same order as its other collectives). `chain` is the fallback
    /// order of backends (the plan's first); the first every rank can run is used.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a request that is not arfuse's layout or whose W is not
    /// the group's, or when the ranks ask for different workspaces; [`Error::NoBackend`]
    /// when no backend of `chain` runs on every rank; [`Error::RankFailed`] when a rank
    /// cannot allocate or map (every rank returns the same error); [`Error::Group`].
    pub fn create(
        group: &dyn Group,
        request: &Workspace,
        chain: &[Backend],
        opts: &RankOptions,
    ) -> Result<RankWorkspace> {
        let layout = device::arfuse_layout(request)?;
        let world = group.world_size();
        if request.world_size != world || world > arfuse_abi::MAX_RANKS {
            return Err(Error::Invalid(format!(
                "a workspace for W = {} on a group of {world} ranks",
                request.world_size
            )));
        }
        let key = request_key(request, &layout);
        let backend = vote(group, &key, chain, &|b| opts.runs(b))?;
        let len =
            usize::try_from(layout.bytes_per_rank).map_err(|_| Error::Overflow("workspace"))?;
        // Step 2: allocation (and the sentinel fill).
        let own = Self::allocate(&layout, request, len, opts);
        let names = all_or_nothing(
            group,
            "allocation",
            own.as_ref()
                .map(|r| r.name.as_bytes().to_vec())
                .map_err(Clone::clone),
        )?;
        let own = own.map_err(Error::Invalid)?;
        // Step 3: mapping every peer's region.
        let mut peers = Vec::with_capacity(world as usize);
        let mut mapped: std::result::Result<(), String> = Ok(());
        for (q, name) in names.iter().enumerate() {
            if q as u32 == group.rank() {
                continue;
            }
            match ShmRegion::open(&String::from_utf8_lossy(name), len) {
                Ok(r) => peers.push((q, r)),
                Err(e) => {
                    mapped = Err(format!("mapping rank {q}'s region: {e}"));
                    break;
                }
            }
        }
        all_or_nothing(group, "mapping", mapped.map(|()| Vec::new()))?;
        let mut ws = RankWorkspace {
            workspace: request.clone(),
            layout,
            backend,
            rank: group.rank(),
            own,
            peers: Vec::new(),
            peer_addr: [0; arfuse_abi::MAX_RANKS as usize],
            err: HostBuffer::new(16)?,
            calls: 0,
        };
        ws.peer_addr[ws.rank as usize] = ws.own.addr as u64;
        for (q, r) in peers {
            ws.peer_addr[q] = r.addr as u64;
            ws.peers.push(r);
        }
        // Every rank mapped every region: the names can go.
        group.barrier()?;
        ws.own.unlink();
        Ok(ws)
    }

    /// This rank's region, created and filled, or why not.
    fn allocate(
        layout: &ArfuseLayout,
        request: &Workspace,
        len: usize,
        opts: &RankOptions,
    ) -> std::result::Result<ShmRegion, String> {
        if let Some(max) = opts.max_bytes {
            if layout.bytes_per_rank > max {
                return Err(format!(
                    "the workspace needs {} bytes per rank; this rank allows {max}",
                    layout.bytes_per_rank
                ));
            }
        }
        let mut r = ShmRegion::create(len)?;
        super::memory::initialise_rank(r.bytes_mut(), layout, request.dtype)
            .map_err(|e| e.to_string())?;
        Ok(r)
    }

    /// This process's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Calls run on this workspace since it was created or reset.
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// `base` with the workspace fields of this rank: every rank's region as mapped
    /// here, the offsets, this process's error word, `rank_base` = this rank.
    pub fn params(&self, base: KernelParams) -> KernelParams {
        let mut p = base;
        p.peer = self.peer_addr;
        p.off_state = self.layout.state_offset;
        p.off_lamport = self.layout.lamport_offset;
        p.lamport_stride = self.layout.lamport_buffer_bytes;
        p.err = self.err.addr();
        p.rank_base = self.rank as i32;
        p
    }

    /// Runs this rank's part of a fused call (`call.ranks` is W; its tensors are this
    /// process's, `rank_stride` 0) on `kernel` with `grid_ctas` CTAs at most, and
    /// returns when it ended. Every rank of the group must make the same call (same
    /// T, same `params.call_tag`), in the same order.
    ///
    /// # Errors
    /// As [`device::fused_shape`] (tensors checked as one rank's); [`Error::CallFailed`]
    /// when this rank's error word is set (a timeout, a peer's abort, ranks that
    /// disagree on the call): the workspace must then be [`RankWorkspace::reset`];
    /// launch errors.
    ///
    /// # Safety
    /// The tensor addresses in `call.params` must be this process's memory of the sizes
    /// [`device::tensor_uses`] gives, alive and untouched by anything else until this
    /// returns.
    pub unsafe fn launch(
        &mut self,
        kernel: &HostKernel,
        call: &FusedCall,
        grid_ctas: u32,
        opts: &LaunchOptions,
    ) -> Result<()> {
        if kernel.variant() != &call.variant {
            return Err(Error::Invalid(format!(
                "kernel {} for a call of {}",
                kernel.variant(),
                call.variant
            )));
        }
        let (_, _, block) = device::fused_shape_of_rank(&self.workspace, call)?;
        let p = self.params(call.params.for_call(call)?);
        let p = KernelParams {
            rank_base: self.rank as i32,
            ..p
        };
        let grid = device::grid_width(call.tokens, grid_ctas.max(1));
        let seq = self.calls;
        self.calls += 1;
        // SAFETY: the workspace fields are this workspace's mappings; the tensors are
        // the caller's (see # Safety).
        unsafe { kernel.launch(&p, grid, 1, block, opts)? };
        self.take_error(seq)
    }

    fn state_word(&self, word: u64) -> u32 {
        let addr = self.own.addr as u64 + self.layout.state_offset + word * 4;
        // SAFETY: a word of this rank's state block, read between launches.
        unsafe { std::ptr::read_volatile(addr as *const u32) }
    }

    fn take_error(&mut self, seq: u64) -> Result<()> {
        // SAFETY: the first word of the error buffer, between launches.
        let word = unsafe { std::ptr::read_volatile(self.err.addr() as *const u32) };
        let abort = self.state_word(protocol::STATE_WORD_ABORT);
        crate::group::call_result(self.rank, seq, word, abort)
    }

    /// Puts the workspace back in its created state on every rank (collective): a
    /// barrier (every rank's launches have ended: the host device's launches are
    /// synchronous), this rank's region refilled (sentinels, state zero, the call
    /// headers and abort word included) and its error word cleared, a barrier. The
    /// next call is then call 0 on every rank.
    ///
    /// # Errors
    /// [`Error::RankFailed`] or [`Error::Group`] on every surviving rank when a rank
    /// fails or is gone; the workspace must then not be used again.
    pub fn reset(&mut self, group: &dyn Group) -> Result<()> {
        all_or_nothing(group, "reset (drain)", Ok(Vec::new()))?;
        let refill = super::memory::initialise_rank(
            self.own.bytes_mut(),
            &self.layout,
            self.workspace.dtype,
        )
        .map_err(|e| e.to_string());
        // SAFETY: the error word, between launches.
        unsafe { std::ptr::write_volatile(self.err.addr() as *mut u32, 0) };
        self.calls = 0;
        all_or_nothing(group, "reset (refill)", refill.map(|()| Vec::new()))?;
        Ok(())
    }
}
