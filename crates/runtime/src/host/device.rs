//! [`HostDevice`]: the host-compiled kernels behind [`Device`], so that the
//! [`crate::runner::Runner`] (and anything generic over a device) runs on the CPU.
//!
//! Streams. Every rank is its own launch stream, as W GPUs are: a fused or local call
//! enqueues one launch per rank (grid `(nblocks, 1, 1)`, `rank_base` = the rank), and
//! the queued launches run at the next [`Device::sync`] (or upload, download, fill,
//! [`Device::take_error`], or when [`MAX_PENDING`] launches are queued): rank r's
//! thread runs its launches in order after seeded random delays, with its CTAs in a
//! random order ([`LaunchOptions`]), never waiting for another rank outside the
//! kernels, so ranks drift apart across consecutive calls. The virtual all-reduce of
//! the unfused path is a collective: it runs (one launch of grid `(nblocks, W, 1)`)
//! when every rank has finished what was queued before it.
//!
//! Memory. Kernels dereference the addresses in their parameters, so every tensor of
//! a call must lie inside memory this device allocated ([`Device::alloc`]); a launch
//! whose tensor does not is refused with [`Error::Invalid`] when it is enqueued. A
//! queued or captured launch keeps the allocations it uses alive (a dropped
//! [`HostMem`] is freed when no launch or graph refers to it any more), and memory is
//! read and written only through this device, after its queued launches ran, so no
//! kernel ever sees freed memory or races with the caller. Each allocation is followed
//! by a guard gap ([`super::memory::GUARD_GAP`] bytes); a launch that wrote into it
//! fails the sync.
//!
//! Capture records the launches (kernel, parameters with the workspace filled in,
//! grid) instead of queueing them; replay queues them again in order.

use super::compile::{Build, Compiler};
use super::launch::{run_rank_set, HostKernel, LaunchOptions, RankLaunch};
use super::memory::{HostWorkspace, Slots};
use crate::device::{self, Allocation, Device, FusedCall, KernelParams};
use crate::error::{Error, Result};
use crate::variants::Variant;
use crate::workspace::Backend;
use arfuse_policy::Workspace;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Queued launches after which a launch runs the queue before it returns (like a full
/// CUDA launch queue, which blocks the launching thread).
pub const MAX_PENDING: usize = 256;

/// How a [`HostDevice`] runs its launches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostOptions {
    /// Seed, delays, chaos and fiber stack of the launches; every run of the queue
    /// derives its own seed from it.
    pub launch: LaunchOptions,
    /// Most CTAs per rank of a fused launch (every CTA is an OS thread; the CPU has
    /// few cores): the grid is `min(T, 256, max_ctas)`. Local and virtual all-reduce
    /// launches use the same bound.
    pub max_ctas: u32,
    /// The kernels' polling timeout of every launch, replacing the caller's (ns); None
    /// keeps the caller's.
    pub timeout_ns: Option<u64>,
    /// A rank that never launches anything (a peer that never arrives): the ranks that
    /// wait for it end through their polling timeout with the kernel's error word, and a
    /// virtual all-reduce (a collective) fails the sync naming it.
    pub absent_rank: Option<u32>,
    /// Which host build of the kernels runs ([`Build::Sanitized`] needs the ASan
    /// runtime preloaded into the process).
    pub build: Build,
    /// Compiler processes at once when loading kernels.
    pub compile_threads: usize,
}

impl Default for HostOptions {
    /// Skewed launches (seed 1, delays up to 300 us), 4 CTAs per rank, the caller's
    /// timeouts, every rank present, the plain build, 2 compiler processes.
    fn default() -> HostOptions {
        HostOptions {
            launch: LaunchOptions::skewed(1, Duration::from_micros(300)),
            max_ctas: super::cases::DEFAULT_HOST_CTAS,
            timeout_ns: None,
            absent_rank: None,
            build: Build::Plain,
            compile_threads: 2,
        }
    }
}

/// One allocation: a zeroed slot followed by a guard gap.
struct Region {
    slots: Slots,
}

// SAFETY: a Region is plain heap memory. It is read and written by the kernels of
// queued launches (only inside `HostDevice::run_queue`, which holds the device
// exclusively and joins every kernel thread before it returns) and by the device's
// memory methods (which take the device exclusively and run the queue first), never
// at the same time.
unsafe impl Send for Region {}
// SAFETY: as above; shared references are only used to keep the memory alive and to
// read it after every kernel thread has been joined.
unsafe impl Sync for Region {}

impl Region {
    fn start(&self) -> u64 {
        self.slots.addr(0)
    }
    fn len(&self) -> u64 {
        self.slots.size() as u64
    }
}

/// Memory of a [`HostDevice`] ([`Device::Buffer`]): `bytes` zeroed bytes at
/// [`Allocation::ptr`], readable and writable through the device that made it.
pub struct HostMem {
    region: Arc<Region>,
}

impl Allocation for HostMem {
    fn ptr(&self) -> u64 {
        self.region.start()
    }
    fn bytes(&self) -> u64 {
        self.region.len()
    }
}

impl std::fmt::Debug for HostMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostMem({:#x}, {} bytes)", self.ptr(), self.bytes())
    }
}

/// A workspace of a [`HostDevice`] ([`Device::Workspace`]): the plan's workspace for
/// its W ranks, one host allocation per rank, and the error word.
/// Clones are handles of the same workspace.
#[derive(Clone)]
pub struct HostDeviceWorkspace {
    inner: Arc<SharedWorkspace>,
}

struct SharedWorkspace(HostWorkspace);

// SAFETY: as for `Region`: the kernels touch the workspace only inside
// `HostDevice::run_queue`; everything else reads it through the device after that.
unsafe impl Send for SharedWorkspace {}
// SAFETY: as above.
unsafe impl Sync for SharedWorkspace {}

impl HostDeviceWorkspace {
    /// The workspace the plan proved.
    pub fn workspace(&self) -> &Workspace {
        &self.inner.0.workspace
    }
}

/// A captured sequence of launches ([`Device::Graph`]).
#[derive(Clone)]
pub struct HostGraph {
    jobs: Vec<Job>,
}

impl HostGraph {
    /// Launches recorded (one per call: a fused call is one launch of every rank).
    pub fn len(&self) -> usize {
        self.jobs.len()
    }
    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }
}

/// How the ranks take part in a queued launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Each rank launches grid `(grid_x, 1)` on its own stream.
    PerRank,
    /// Once every rank reached it, one launch of grid `(grid_x, world)`.
    Collective,
}

/// One queued (or recorded) launch, with everything it touches kept alive.
#[derive(Clone)]
struct Job {
    mode: Mode,
    kernel: Arc<HostKernel>,
    params: KernelParams,
    grid_x: u32,
    block: u32,
    world: u32,
    workspace: Option<Arc<SharedWorkspace>>,
    regions: Vec<Arc<Region>>,
}

/// The host device. See the module documentation.
pub struct HostDevice {
    compiler: Arc<Compiler>,
    opts: HostOptions,
    kernels: HashMap<Variant, Arc<HostKernel>>,
    /// Every allocation by start address (dropped ones are pruned).
    regions: BTreeMap<u64, Weak<Region>>,
    queue: Vec<Job>,
    recording: Option<Vec<Job>>,
    /// Runs of the queue so far (each derives its own launch seed).
    runs: u64,
    /// How far the ranks drifted apart in the last run of the queue.
    last_lead: usize,
}

impl HostDevice {
    /// A host device compiling with `compiler` (its cache is shared by every device
    /// using it) and running with `opts`.
    pub fn new(compiler: Arc<Compiler>, opts: HostOptions) -> HostDevice {
        HostDevice {
            compiler,
            opts,
            kernels: HashMap::new(),
            regions: BTreeMap::new(),
            queue: Vec::new(),
            recording: None,
            runs: 0,
            last_lead: 0,
        }
    }

    /// The options.
    pub fn options(&self) -> &HostOptions {
        &self.opts
    }

    /// Runs the queued launches with the current options, then replaces them.
    ///
    /// # Errors
    /// As [`Device::sync`].
    pub fn set_options(&mut self, opts: HostOptions) -> Result<()> {
        self.run_queue()?;
        self.opts = opts;
        Ok(())
    }

    /// A copy of rank `rank`'s workspace bytes (its state block and Lamport buffers),
    /// after the queued launches ran.
    ///
    /// # Errors
    /// As [`Device::sync`]; [`Error::Invalid`] for a rank outside the world.
    pub fn workspace_bytes(&mut self, ws: &HostDeviceWorkspace, rank: u32) -> Result<Vec<u8>> {
        self.run_queue()?;
        Ok(ws.inner.0.rank_bytes(rank)?.to_vec())
    }

    /// How far the ranks drifted apart when the queue last ran: the largest number of
    /// calls by which one rank was ahead of another ([`super::RankTrace::max_lead`]); 0
    /// when every rank started each call only after all had finished the one before.
    pub fn last_run_lead(&self) -> usize {
        self.last_lead
    }

    fn refuse_while_capturing(&self, what: impl FnOnce() -> String) -> Result<()> {
        if self.recording.is_some() {
            return Err(Error::Capturing(what()));
        }
        Ok(())
    }

    /// The loaded kernel of `v`, compiled and loaded now when it was not (refused
    /// during capture).
    fn kernel(&mut self, v: &Variant) -> Result<Arc<HostKernel>> {
        if let Some(k) = self.kernels.get(v) {
            return Ok(k.clone());
        }
        self.refuse_while_capturing(|| format!("loading kernel {v}"))?;
        let k = self.compiler.kernel(v, self.opts.build)?;
        self.kernels.insert(*v, k.clone());
        Ok(k)
    }

    /// The allocation holding `[ptr, ptr + len)`.
    fn region_of(&self, ptr: u64, len: u64, what: &str) -> Result<Arc<Region>> {
        let end = ptr
            .checked_add(len)
            .ok_or(Error::Overflow("tensor extent"))?;
        self.regions
            .range(..=ptr)
            .next_back()
            .and_then(|(_, w)| w.upgrade())
            .filter(|r| end <= r.start() + r.len())
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "{what} [{ptr:#x}, {end:#x}) is not inside memory this host device allocated"
                ))
            })
    }

    /// The allocations every tensor of the call lies in, for its ranks at the call's
    /// sizes ([`device::tensor_uses`]: an upper bound of what the kernel touches).
    fn regions_of(&self, call: &FusedCall, p: &KernelParams) -> Result<Vec<Arc<Region>>> {
        let mut out: Vec<Arc<Region>> = Vec::new();
        let mut add = |r: Arc<Region>| {
            if !out.iter().any(|o| Arc::ptr_eq(o, &r)) {
                out.push(r);
            }
        };
        let call = FusedCall {
            params: *p,
            ..*call
        };
        for u in device::tensor_uses(&call)? {
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
                let what = if ranks == 1 {
                    format!("tensor {}", u.name)
                } else {
                    format!("tensor {} of rank {r}", u.name)
                };
                add(self.region_of(at, u.bytes, &what)?);
            }
        }
        Ok(out)
    }

    /// Queues (or records) one launch; runs the queue when it is full.
    fn enqueue(&mut self, job: Job) -> Result<()> {
        if let Some(rec) = &mut self.recording {
            rec.push(job);
            return Ok(());
        }
        self.queue.push(job);
        if self.queue.len() >= MAX_PENDING {
            self.run_queue()?;
        }
        Ok(())
    }

    /// The job of a call: its kernel, the parameters with shape and timeout, the
    /// allocations its tensors lie in.
    fn job(
        &mut self,
        mode: Mode,
        call: &FusedCall,
        params: KernelParams,
        block: u32,
    ) -> Result<Job> {
        let kernel = self.kernel(&call.variant)?;
        let mut p = params.for_call(call)?;
        if let Some(t) = self.opts.timeout_ns {
            p.timeout_ns = t;
        }
        let regions = self.regions_of(call, &p)?;
        let grid_x = device::grid_width(call.tokens, self.opts.max_ctas.max(1));
        Ok(Job {
            mode,
            kernel,
            params: p,
            grid_x,
            block,
            world: call.ranks,
            workspace: None,
            regions,
        })
    }

    /// Runs every queued launch (see the module documentation), then checks the guard
    /// gaps of the memory they used and the bounds of their workspaces.
    fn run_queue(&mut self) -> Result<()> {
        if self.queue.is_empty() {
            return Ok(());
        }
        let jobs = std::mem::take(&mut self.queue);
        self.last_lead = 0;
        let mut first_error = None;
        let mut i = 0;
        while i < jobs.len() && first_error.is_none() {
            let mut j = i + 1;
            if jobs[i].mode == Mode::PerRank {
                while j < jobs.len()
                    && jobs[j].mode == Mode::PerRank
                    && jobs[j].world == jobs[i].world
                {
                    j += 1;
                }
            }
            self.runs += 1;
            let opts = self.opts.launch.derive(self.runs);
            let r = match jobs[i].mode {
                Mode::PerRank => self.run_streams(&jobs[i..j], &opts),
                Mode::Collective => self.run_collective(&jobs[i], &opts),
            };
            first_error = r.err();
            i = j;
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        check_bounds(&jobs)
    }

    /// A run of per-rank launches of one world size: every present rank its own stream.
    fn run_streams(&mut self, jobs: &[Job], opts: &LaunchOptions) -> Result<()> {
        let world = jobs[0].world;
        let ranks: Vec<u32> = (0..world)
            .filter(|r| Some(*r) != self.opts.absent_rank)
            .collect();
        let launches: Vec<RankLaunch<'_>> = jobs
            .iter()
            .map(|j| RankLaunch {
                kernel: &j.kernel,
                params: j.params,
                grid_x: j.grid_x,
                block: j.block,
            })
            .collect();
        // SAFETY: every address in every job's parameters was checked, when the job was
        // made, to lie inside an allocation of this device of the size the kernel
        // touches (`regions_of`) or inside the job's workspace (filled by
        // `HostWorkspace::params`); the job holds those alive, and nothing else reads or
        // writes them while this runs (`&self` of the device, and the memory is reached
        // only through the device).
        let trace = unsafe { run_rank_set(&ranks, &launches, opts) }?;
        self.last_lead = self.last_lead.max(trace.max_lead());
        Ok(())
    }

    /// One collective launch of grid `(grid_x, world)`, after every rank's earlier work.
    fn run_collective(&self, job: &Job, opts: &LaunchOptions) -> Result<()> {
        if let Some(r) = self.opts.absent_rank.filter(|r| *r < job.world) {
            return Err(Error::HostKernel {
                variant: job.kernel.variant().name(),
                msg: format!(
                    "rank {r} is absent (HostOptions::absent_rank): the collective cannot complete"
                ),
            });
        }
        // SAFETY: as in `run_streams`.
        unsafe {
            job.kernel
                .launch(&job.params, job.grid_x, job.world, job.block, opts)
        }
    }
}

/// Guard gaps of every allocation and the bounds of every workspace `jobs` used.
fn check_bounds(jobs: &[Job]) -> Result<()> {
    for j in jobs {
        for r in &j.regions {
            if r.slots.overrun().is_some() {
                return Err(Error::HostKernel {
                    variant: j.kernel.variant().name(),
                    msg: format!(
                        "a kernel wrote past the end of the {}-byte allocation at {:#x}",
                        r.len(),
                        r.start()
                    ),
                });
            }
        }
        if let Some(ws) = &j.workspace {
            ws.0.check_bounds()?;
        }
    }
    Ok(())
}

fn overrun(what: &str, offset: u64, len: usize, bytes: u64) -> Error {
    Error::Invalid(format!(
        "{what} of {len} bytes at {offset} overruns the {bytes}-byte allocation"
    ))
}

/// `[offset, offset + len)` of `mem` as a usize range, checked.
fn range(mem: &HostMem, what: &str, offset: u64, len: usize) -> Result<std::ops::Range<usize>> {
    let end = offset
        .checked_add(len as u64)
        .filter(|e| *e <= mem.bytes())
        .ok_or_else(|| overrun(what, offset, len, mem.bytes()))?;
    let a = usize::try_from(offset).map_err(|_| Error::Overflow("offset"))?;
    let b = usize::try_from(end).map_err(|_| Error::Overflow("offset"))?;
    Ok(a..b)
}

impl Device for HostDevice {
    type Workspace = HostDeviceWorkspace;
    type Graph = HostGraph;
    type Buffer = HostMem;

    fn is_capturing(&self) -> Result<bool> {
        Ok(self.recording.is_some())
    }

    fn create_workspace(
        &mut self,
        backend: Backend,
        request: &Workspace,
    ) -> Result<HostDeviceWorkspace> {
        self.refuse_while_capturing(|| format!("creating workspace ({request})"))?;
        match backend {
            // As on one GPU: W ranks of one machine have no multicast object.
            Backend::Mnnvl => Err(Error::Unsupported(
                "mnnvl needs NVLink multicast between GPUs; the host device's ranks use the trtllm mapping".into(),
            )),
            Backend::Trtllm => Ok(HostDeviceWorkspace {
                inner: Arc::new(SharedWorkspace(HostWorkspace::create(request)?)),
            }),
        }
    }

    fn load(&mut self, variants: &[Variant]) -> Result<()> {
        self.refuse_while_capturing(|| "loading kernels".into())?;
        let mut todo: Vec<Variant> = variants
            .iter()
            .filter(|v| !self.kernels.contains_key(v))
            .copied()
            .collect();
        todo.sort();
        todo.dedup();
        let ks = self
            .compiler
            .kernels(&todo, self.opts.build, self.opts.compile_threads)?;
        self.kernels.extend(todo.into_iter().zip(ks));
        Ok(())
    }

    fn launch_fused(&mut self, ws: &HostDeviceWorkspace, call: &FusedCall) -> Result<()> {
        let (_, _, block) = device::fused_shape(ws.workspace(), call)?;
        let params = ws.inner.0.params(call.params)?;
        let mut job = self.job(Mode::PerRank, call, params, block)?;
        job.workspace = Some(ws.inner.clone());
        self.enqueue(job)
    }

    fn launch_local(&mut self, call: &FusedCall) -> Result<()> {
        let block = device::local_shape(call)?;
        let job = self.job(Mode::PerRank, call, call.params, block)?;
        self.enqueue(job)
    }

    fn launch_virtual_allreduce(&mut self, call: &FusedCall) -> Result<()> {
        let block = device::virtual_allreduce_shape(call)?;
        let job = self.job(Mode::Collective, call, call.params, block)?;
        self.enqueue(job)
    }

    fn capture(
        &mut self,
        body: &mut dyn FnMut(&mut HostDevice) -> Result<()>,
    ) -> Result<HostGraph> {
        if self.recording.is_some() {
            return Err(Error::Capturing("a capture inside a capture".into()));
        }
        self.recording = Some(Vec::new());
        let r = body(self);
        let jobs = self.recording.take().unwrap_or_default();
        r?;
        Ok(HostGraph { jobs })
    }

    fn replay(&mut self, graph: &HostGraph) -> Result<()> {
        for j in &graph.jobs {
            self.enqueue(j.clone())?;
        }
        Ok(())
    }

    fn sync(&mut self) -> Result<()> {
        self.run_queue()
    }

    fn take_error(&mut self, ws: &HostDeviceWorkspace) -> Result<()> {
        self.run_queue()?;
        ws.inner.0.take_error_shared()
    }

    fn reset_workspace(&mut self, ws: &HostDeviceWorkspace) -> Result<()> {
        self.refuse_while_capturing(|| format!("resetting workspace ({})", ws.workspace()))?;
        self.run_queue()?;
        ws.inner.0.reset_shared()
    }

    fn alloc(&mut self, bytes: u64) -> Result<HostMem> {
        self.refuse_while_capturing(|| format!("allocation of {bytes} bytes"))?;
        self.regions.retain(|_, w| w.strong_count() > 0);
        let region = Arc::new(Region {
            slots: Slots::new(bytes.max(1), 1)?,
        });
        self.regions.insert(region.start(), Arc::downgrade(&region));
        Ok(HostMem { region })
    }

    fn upload(&mut self, dst: &HostMem, offset: u64, src: &[u8]) -> Result<()> {
        let r = range(dst, "upload", offset, src.len())?;
        self.run_queue()?;
        // SAFETY: the range lies inside the allocation (checked); no kernel runs (the
        // queue is empty and the device is borrowed exclusively), and nothing else
        // holds a reference into the memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                (dst.ptr() as usize + r.start) as *mut u8,
                r.len(),
            );
        }
        Ok(())
    }

    fn download(&mut self, src: &HostMem, offset: u64, dst: &mut [u8]) -> Result<()> {
        let r = range(src, "download", offset, dst.len())?;
        self.run_queue()?;
        // SAFETY: as in `upload`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (src.ptr() as usize + r.start) as *const u8,
                dst.as_mut_ptr(),
                r.len(),
            );
        }
        Ok(())
    }

    fn fill(&mut self, buf: &HostMem, offset: u64, bytes: u64, value: u8) -> Result<()> {
        let len = usize::try_from(bytes).map_err(|_| Error::Overflow("fill"))?;
        let r = range(buf, "fill", offset, len)?;
        self.run_queue()?;
        // SAFETY: as in `upload`.
        unsafe {
            std::ptr::write_bytes((buf.ptr() as usize + r.start) as *mut u8, value, r.len());
        }
        Ok(())
    }
}

impl std::fmt::Debug for HostDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostDevice")
            .field("compiler", &self.compiler.version())
            .field("opts", &self.opts)
            .field("queued", &self.queue.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device() -> HostDevice {
        let dir = std::env::temp_dir().join("arfuse-host-unit-tests");
        HostDevice::new(
            Arc::new(Compiler::new(dir).expect("a C++ compiler")),
            HostOptions::default(),
        )
    }

    #[test]
    fn memory_round_trips_and_checks_its_ranges() {
        let mut d = device();
        let m = d.alloc(100).unwrap();
        assert_eq!(m.bytes(), 100);
        d.upload(&m, 10, &[1, 2, 3]).unwrap();
        d.fill(&m, 13, 2, 9).unwrap();
        let mut got = [0u8; 7];
        d.download(&m, 9, &mut got).unwrap();
        assert_eq!(got, [0, 1, 2, 3, 9, 9, 0]);
        let e = d.upload(&m, 99, &[0, 0]).unwrap_err().to_string();
        assert!(e.contains("overruns the 100-byte allocation"), "{e}");
        // The device finds the allocation of an address range, and nothing else.
        assert!(d.region_of(m.ptr() + 50, 50, "t").is_ok());
        let e = d
            .region_of(m.ptr() + 50, 51, "tensor x")
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("tensor x") && e.contains("not inside memory"),
            "{e}"
        );
        let stack = [0u8; 64];
        assert!(d.region_of(stack.as_ptr() as u64, 1, "t").is_err());
        let start = m.ptr();
        drop(m);
        assert!(
            d.region_of(start, 1, "t").is_err(),
            "freed memory is not device memory"
        );
    }

    #[test]
    fn capture_refuses_to_create_anything() {
        let mut d = device();
        let ws = crate::check::workspace_for(2, crate::variants::ActDtype::Bf16, 256, 4).unwrap();
        let g = d
            .capture(&mut |d: &mut HostDevice| {
                assert!(d.is_capturing().unwrap());
                let e = d.alloc(16).unwrap_err();
                assert!(matches!(e, Error::Capturing(_)), "{e}");
                let e = d.create_workspace(Backend::Trtllm, &ws).err().unwrap();
                assert!(matches!(e, Error::Capturing(_)), "{e}");
                let e = d.load(&[crate::variants::virtual_allreduce(
                    2,
                    crate::variants::ActDtype::Bf16,
                )]);
                assert!(matches!(e, Err(Error::Capturing(_))));
                Ok(())
            })
            .unwrap();
        assert!(g.is_empty() && !d.is_capturing().unwrap());
        assert!(d.create_workspace(Backend::Mnnvl, &ws).is_err());
        let w = d.create_workspace(Backend::Trtllm, &ws).unwrap();
        assert_eq!(w.workspace(), &ws);
        d.take_error(&w).unwrap();
    }
}
