//! Launching host-compiled kernels: one OS thread per CTA (its CUDA threads are fibers
//! on it, `kernels/arfuse_host.h`), every CTA of a launch at once, in a seeded random
//! start order with random start delays; and W ranks as W independent launch streams,
//! each on its own thread, the way W GPUs run.

use super::compile::Build;
use crate::device::KernelParams;
use crate::error::{Error, Result};
use crate::variants::Variant;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::ffi::c_char;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The launch configuration of one CTA, layout-identical to `ArfHostCta` in
/// `kernels/arfuse_host.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct HostCta {
    grid: [u32; 3],
    block: [u32; 3],
    block_idx: [u32; 3],
    chaos: u32,
    seed: u64,
    stack_base: u64,
    stack_stride: u64,
    stack_bytes: u64,
}

const _: () = assert!(std::mem::size_of::<HostCta>() == 72);
/// What `arf_host_abi` returns for the layouts this crate was built with.
const ABI: u32 =
    (std::mem::size_of::<KernelParams>() * 1000 + std::mem::size_of::<HostCta>()) as u32;

type RunCta = unsafe extern "C" fn(*const KernelParams, *const HostCta, *mut c_char, u32) -> i32;
type AbiFn = unsafe extern "C" fn() -> u32;

/// Most CTAs one host launch may have (each is an OS thread).
pub const MAX_HOST_CTAS: u32 = 4096;
/// Default stack of each fiber (CUDA thread), bytes. The kernels use about 2 KiB.
pub const DEFAULT_FIBER_STACK: usize = 64 * 1024;
/// Stack of each fiber in [`Build::Sanitized`] objects (AddressSanitizer's redzones
/// and the unoptimised frames need more).
pub const SANITIZED_FIBER_STACK: usize = 512 * 1024;

/// The fiber stacks of one CTA: `fibers` stacks of `stack` bytes, each above a
/// PROT_NONE guard page (an overflow faults instead of corrupting a neighbour), in one
/// private anonymous mapping. Mapping (and faulting in) a CTA's stacks cost more than
/// running a small CTA, so released stacks go back to a process-wide pool and the next
/// CTA of the same shape reuses them.
struct Stacks {
    base: usize,
    len: usize,
    fibers: usize,
    stack: usize,
    stride: usize,
}

/// Released stacks kept for reuse, at most this many (a CTA of 1024 threads with
/// 64 KiB stacks maps 68 MiB of address space; only touched pages use memory).
const STACK_POOL_MAX: usize = 256;
static STACK_POOL: std::sync::Mutex<Vec<Stacks>> = std::sync::Mutex::new(Vec::new());

impl Stacks {
    fn take(fibers: usize, stack: usize) -> Result<Stacks> {
        {
            let mut pool = STACK_POOL.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = pool
                .iter()
                .position(|s| s.fibers == fibers && s.stack == stack)
            {
                return Ok(pool.swap_remove(i));
            }
        }
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let stack = stack.max(16384).div_ceil(page) * page;
        let stride = stack + page;
        let len = stride
            .checked_mul(fibers)
            .ok_or(Error::Overflow("fiber stacks"))?;
        // SAFETY: a fresh private anonymous mapping; the result is checked.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::Unsupported(format!(
                "mapping {len} bytes of fiber stacks failed"
            )));
        }
        let s = Stacks {
            base: base as usize,
            len,
            fibers,
            stack,
            stride,
        };
        for i in 0..fibers {
            // SAFETY: the guard page [base + i * stride, + page) lies in the mapping.
            let rc = unsafe {
                libc::mprotect(
                    (s.base + i * stride) as *mut libc::c_void,
                    page,
                    libc::PROT_NONE,
                )
            };
            if rc != 0 {
                return Err(Error::Unsupported(
                    "protecting a fiber stack guard page failed".into(),
                ));
            }
        }
        Ok(s)
    }

    /// (base, stride, bytes) of the usable stacks, as `ArfHostCta` takes them.
    fn layout(&self) -> (u64, u64, u64) {
        let page = self.stride - self.stack;
        (
            (self.base + page) as u64,
            self.stride as u64,
            self.stack as u64,
        )
    }

    fn release(self) {
        let mut pool = STACK_POOL.lock().unwrap_or_else(|p| p.into_inner());
        if pool.len() < STACK_POOL_MAX {
            pool.push(self);
        }
        // else dropped: unmapped
    }
}

impl Drop for Stacks {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `take`, unmapped once (pooled stacks are moved,
        // not dropped, while pooled).
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.len);
        }
    }
}

/// How a launch is perturbed. `Default` is the deterministic launch: CTAs started in
/// order without delays, fibers scheduled in ascending order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LaunchOptions {
    /// Seed of the random CTA start order, the start delays and each CTA's fiber order;
    /// 0 for none of them.
    pub seed: u64,
    /// Upper bound of the random start delay of each CTA (and of each rank's launch in
    /// [`run_ranks`]).
    pub max_delay: Duration,
    /// Stack of each fiber, bytes (0: [`DEFAULT_FIBER_STACK`], or
    /// [`SANITIZED_FIBER_STACK`] for sanitized objects).
    pub fiber_stack: usize,
    /// Chance, per mille, that a CTA pauses (its whole OS thread, 0..2 ms) at each
    /// global store or fence of the kernels (only with a seed): the instruction-level
    /// skew of a GPU, which opens the windows between two accesses of one thread.
    pub chaos_permille: u32,
}

impl LaunchOptions {
    /// Random CTA order and fiber order from `seed`, start delays up to `max_delay`.
    pub fn skewed(seed: u64, max_delay: Duration) -> LaunchOptions {
        LaunchOptions {
            seed: seed.max(1),
            max_delay,
            fiber_stack: 0,
            chaos_permille: 0,
        }
    }

    /// These options with pauses at a `permille` chance per store or fence.
    pub fn with_chaos(self, permille: u32) -> LaunchOptions {
        LaunchOptions {
            chaos_permille: permille.min(1000),
            ..self
        }
    }

    /// The options of derived launch `k` (another seed, same bounds).
    pub(crate) fn derive(&self, k: u64) -> LaunchOptions {
        if self.seed == 0 {
            return *self;
        }
        let mixed =
            (self.seed ^ k.wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        LaunchOptions {
            seed: mixed.max(1),
            ..*self
        }
    }

    fn delay(&self, rng: &mut SmallRng) -> Duration {
        if self.seed == 0 || self.max_delay.is_zero() {
            return Duration::ZERO;
        }
        let us = self.max_delay.as_micros().min(u128::from(u32::MAX)) as u32;
        Duration::from_micros(u64::from(rng.gen_range(0..=us)))
    }
}

/// Whether this process runs with the AddressSanitizer runtime (preloaded).
pub fn asan_runtime_loaded() -> bool {
    let this = libloading::os::unix::Library::this();
    // SAFETY: only the symbol's presence is checked; nothing is called.
    unsafe { this.get::<*const ()>(b"__asan_init\0").is_ok() }
}

/// One kernel variant compiled for the host and loaded.
pub struct HostKernel {
    variant: Variant,
    build: Build,
    path: PathBuf,
    run: RunCta,
    // Keeps `run` valid; dropped last.
    _lib: libloading::Library,
}

impl std::fmt::Debug for HostKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostKernel")
            .field("variant", &self.variant.name())
            .field("build", &self.build)
            .field("path", &self.path)
            .finish()
    }
}

impl HostKernel {
    /// Loads a compiled object and checks its ABI.
    pub(crate) fn load(variant: Variant, build: Build, path: &Path) -> Result<HostKernel> {
        let bad = |msg: String| Error::HostKernel {
            variant: variant.name(),
            msg,
        };
        if build == Build::Sanitized && !asan_runtime_loaded() {
            // dlopen of an ASan object would abort the whole process.
            return Err(bad(
                "a sanitized object loads only into a process started with the ASan runtime preloaded (LD_PRELOAD=$(g++ -print-file-name=libasan.so))".into(),
            ));
        }
        // SAFETY: the object is one this crate compiled from kernels/; its initialisers
        // are the C++ runtime's.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| bad(format!("loading {}: {e}", path.display())))?;
        // SAFETY: the symbols have exactly these C signatures (ARF_HOST_ENTRY).
        let (abi, run) = unsafe {
            let abi: libloading::Symbol<AbiFn> = lib
                .get(b"arf_host_abi\0")
                .map_err(|e| bad(format!("arf_host_abi: {e}")))?;
            let run: libloading::Symbol<RunCta> = lib
                .get(b"arf_host_run_cta\0")
                .map_err(|e| bad(format!("arf_host_run_cta: {e}")))?;
            (abi(), *run)
        };
        if abi != ABI {
            return Err(bad(format!(
                "object ABI {abi} differs from this crate's {ABI} (ArfParams / ArfHostCta sizes)"
            )));
        }
        Ok(HostKernel {
            variant,
            build,
            path: path.to_path_buf(),
            run,
            _lib: lib,
        })
    }

    /// The variant.
    pub fn variant(&self) -> &Variant {
        &self.variant
    }

    /// The build.
    pub fn build(&self) -> Build {
        self.build
    }

    /// Path of the loaded shared object.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn stack(&self, opts: &LaunchOptions) -> u64 {
        let s = match (opts.fiber_stack, self.build) {
            (0, Build::Plain) => DEFAULT_FIBER_STACK,
            (0, Build::Sanitized) => SANITIZED_FIBER_STACK,
            (s, _) => s,
        };
        s as u64
    }

    /// Runs the kernel on grid `(grid_x, grid_y, 1)` with `block` threads per CTA over
    /// host memory: every address in `params` must be valid for what the kernel
    /// touches. One OS thread per CTA, all started before any is joined; returns when
    /// every CTA has returned.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an empty grid, more than [`MAX_HOST_CTAS`] CTAs, or a
    /// block that is not 32..=1024 whole warps; [`Error::HostKernel`] naming the CTA
    /// for an executor error (divergent or deadlocked `__syncthreads`, partial-warp
    /// shuffle, no memory for fiber stacks) or when an OS thread cannot be started.
    ///
    /// # Safety
    /// The kernel dereferences the addresses in `params` (and those it derives from
    /// them) without checks: they must point to memory of the sizes the kernel's
    /// documentation gives, alive and not accessed by anything else until this returns.
    pub unsafe fn launch(
        &self,
        params: &KernelParams,
        grid_x: u32,
        grid_y: u32,
        block: u32,
        opts: &LaunchOptions,
    ) -> Result<()> {
        let ctas = u64::from(grid_x) * u64::from(grid_y);
        if ctas == 0 || ctas > u64::from(MAX_HOST_CTAS) {
            return Err(Error::Invalid(format!(
                "host launch of {grid_x} x {grid_y} CTAs (1..={MAX_HOST_CTAS})"
            )));
        }
        if !(32..=1024).contains(&block) || block % 32 != 0 {
            return Err(Error::Invalid(format!(
                "block of {block} threads: host launches take 32..=1024 whole warps"
            )));
        }
        let mut order: Vec<(u32, u32)> = (0..grid_y)
            .flat_map(|y| (0..grid_x).map(move |x| (x, y)))
            .collect();
        let mut rng = SmallRng::seed_from_u64(opts.seed);
        if opts.seed != 0 {
            order.shuffle(&mut rng);
        }
        let plan: Vec<((u32, u32), Duration, u64)> = order
            .iter()
            .enumerate()
            .map(|(k, &xy)| (xy, opts.delay(&mut rng), opts.derive(k as u64 + 1).seed))
            .collect();
        let stack = self.stack(opts) as usize;
        let mut stacks = Vec::with_capacity(plan.len());
        for _ in &plan {
            stacks.push(Stacks::take(block as usize, stack)?);
        }
        let failures: Vec<String> = std::thread::scope(|s| {
            let mut handles = Vec::with_capacity(plan.len());
            let mut failures = Vec::new();
            for (&((x, y), delay, seed), st) in plan.iter().zip(&stacks) {
                let (stack_base, stack_stride, stack_bytes) = st.layout();
                let cta = HostCta {
                    grid: [grid_x, grid_y, 1],
                    block: [block, 1, 1],
                    block_idx: [x, y, 0],
                    chaos: if opts.seed == 0 {
                        0
                    } else {
                        opts.chaos_permille
                    },
                    seed,
                    stack_base,
                    stack_stride,
                    stack_bytes,
                };
                let run = self.run;
                let spawned = std::thread::Builder::new()
                    .stack_size(256 * 1024)
                    .spawn_scoped(s, move || {
                        if !delay.is_zero() {
                            std::thread::sleep(delay);
                        }
                        let mut msg = [0 as c_char; 256];
                        // SAFETY: `params` outlives the scope; the caller vouches for
                        // the addresses in it; `cta` and `msg` live on this stack.
                        let rc = unsafe { run(params, &cta, msg.as_mut_ptr(), msg.len() as u32) };
                        (rc != 0).then(|| {
                            // SAFETY: the runner NUL-terminates within msg.len().
                            let m = unsafe { std::ffi::CStr::from_ptr(msg.as_ptr()) };
                            format!("CTA ({x}, {y}): {} (code {rc})", m.to_string_lossy())
                        })
                    });
                match spawned {
                    Ok(h) => handles.push(h),
                    // The CTAs already running must still finish: a spinning kernel
                    // then ends through its timeout.
                    Err(e) => failures.push(format!("CTA ({x}, {y}): no OS thread: {e}")),
                }
            }
            for h in handles {
                match h.join() {
                    Ok(Some(f)) => failures.push(f),
                    Ok(None) => {}
                    Err(_) => failures.push("a CTA thread panicked".to_string()),
                }
            }
            failures
        });
        for st in stacks {
            st.release();
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(Error::HostKernel {
                variant: self.variant.name(),
                msg: failures.join("; "),
            })
        }
    }
}

/// One launch of a per-rank sequence: the kernel, its parameters (with `rank_base`
/// overwritten per rank) and its shape `(grid_x, 1, 1) x block`.
#[derive(Debug, Clone, Copy)]
pub struct RankLaunch<'a> {
    /// The kernel.
    pub kernel: &'a HostKernel,
    /// Parameters; `rank_base` is set to the rank.
    pub params: KernelParams,
    /// CTAs per rank.
    pub grid_x: u32,
    /// Threads per CTA.
    pub block: u32,
}

/// When each launch of each rank ran: `spans[r][i]` = (start, end) of rank r's launch
/// i (launches a rank never reached are missing).
#[derive(Debug, Clone, Default)]
pub struct RankTrace {
    /// Per rank, per launch: start and end.
    pub spans: Vec<Vec<(Instant, Instant)>>,
}

impl RankTrace {
    /// How far the ranks drifted apart: the largest `i - k` over ranks r, q and
    /// launches i of r, where k is the number of launches q had finished when r
    /// started launch i. 1 means some rank started a launch while another was still in
    /// the previous one.
    pub fn max_lead(&self) -> usize {
        let mut lead = 0;
        for (r, rs) in self.spans.iter().enumerate() {
            for (q, qs) in self.spans.iter().enumerate() {
                if r == q {
                    continue;
                }
                for (i, &(start, _)) in rs.iter().enumerate() {
                    let finished = qs.iter().filter(|&&(_, end)| end <= start).count();
                    lead = lead.max(i.saturating_sub(finished));
                }
            }
        }
        lead
    }
}

/// Runs `world` ranks as independent launch streams, the way `world` GPUs run: rank r
/// is a thread that launches `launches[0]`, `launches[1]`, ... in order, each with
/// `rank_base = r` and grid `(grid_x, 1, 1)`, after a random delay before each launch
/// (seeded by `opts`), with the CTAs of each launch in a random order. Ranks never wait
/// for each other outside the kernels, so one rank may be several launches ahead of
/// another. Returns when every rank finished its sequence, with when each launch ran.
///
/// # Errors
/// Every rank's first failure, joined (see [`HostKernel::launch`]); a rank that fails
/// skips the rest of its sequence, and the ranks waiting for it end through the
/// kernels' polling timeout.
///
/// # Safety
/// As [`HostKernel::launch`], for every launch of the sequence.
pub unsafe fn run_ranks(
    world: u32,
    launches: &[RankLaunch<'_>],
    opts: &LaunchOptions,
) -> Result<RankTrace> {
    let ranks: Vec<u32> = (0..world).collect();
    // SAFETY: forwarded from the caller.
    unsafe { run_rank_set(&ranks, launches, opts) }
}

/// [`run_ranks`] for the ranks in `ranks` only (a rank left out never launches: its
/// peers wait for it until their polling timeout). `spans[i]` of the trace belongs to
/// `ranks[i]`.
///
/// # Errors
/// As [`run_ranks`].
///
/// # Safety
/// As [`HostKernel::launch`], for every launch of the sequence.
pub unsafe fn run_rank_set(
    ranks: &[u32],
    launches: &[RankLaunch<'_>],
    opts: &LaunchOptions,
) -> Result<RankTrace> {
    type Spans = Vec<(Instant, Instant)>;
    let results: Vec<(Spans, Option<String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|&r| {
                s.spawn(move || -> (Spans, Option<String>) {
                    let ropts = opts.derive(1_000_000 + u64::from(r));
                    let mut rng = SmallRng::seed_from_u64(ropts.seed);
                    let mut spans = Vec::with_capacity(launches.len());
                    for (i, l) in launches.iter().enumerate() {
                        let d = ropts.delay(&mut rng);
                        if !d.is_zero() {
                            std::thread::sleep(d);
                        }
                        let mut p = l.params;
                        p.rank_base = r as i32;
                        let o = ropts.derive(i as u64);
                        let start = Instant::now();
                        // SAFETY: forwarded from the caller.
                        let res = unsafe { l.kernel.launch(&p, l.grid_x, 1, l.block, &o) };
                        spans.push((start, Instant::now()));
                        if let Err(e) = res {
                            return (spans, Some(format!("rank {r}, launch {i}: {e}")));
                        }
                    }
                    (spans, None)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| (Vec::new(), Some("a rank thread panicked".into())))
            })
            .collect()
    });
    let mut trace = RankTrace::default();
    let mut failures = Vec::new();
    for (spans, f) in results {
        trace.spans.push(spans);
        failures.extend(f);
    }
    if failures.is_empty() {
        Ok(trace)
    } else {
        Err(Error::HostKernel {
            variant: "(rank streams)".into(),
            msg: failures.join("; "),
        })
    }
}
