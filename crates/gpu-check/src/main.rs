//! `gpu_check`: the one prepared script for a GPU machine. Built here
//! (`cargo xtask gpu-check --build-only`), carried and run there.
//!
//! 0. Preflight (`preflight`, `real_ranks`): the launch unknowns one at a time, each in
//!    its own child process with a bound (a fault or hang is reported, not inherited):
//!    the fused kernel on virtual ranks launched cooperative + PDL, cooperative alone,
//!    PDL with a non-cooperative grid sized to fit, and neither, each directly and from
//!    a captured graph; then W = 2 real ranks (two processes on GPU 0 over CUDA IPC).
//!    Only then the matrix.
//! 1. Correctness, on virtual ranks (W logical ranks on one GPU, one cooperative
//!    launch): every fused pattern x dtype x W in {2, 4, 8} x strategy x T in
//!    {1, 7, 16, 40, 42, 128, 1024} (`arfuse_runtime::check::all_cases`), checked
//!    against arfuse-reference's rounding contract (`arfuse_runtime::check`): once by a
//!    direct launch with every output live, once with only some outputs live (dead
//!    outputs must stay untouched), and once more after `--replays` (default 1,000)
//!    replays of a CUDA graph. One-shot and two-shot alternate on one workspace.
//!    Then one fused node through the public API (`NodeKernels`, `runner::Runner`) with a
//!    plan of one-shot, two-shot and unfused ranges, at both ends of every range,
//!    directly and from per-size CUDA graphs (`node_check`).
//! 2. Timings (W = 8 unless `--timing-world`; `timings`): median microseconds per call
//!    replayed from a CUDA graph. Latency at T = 1, 2, 4, 8 with PDL on and off, fused
//!    vs unfused (arfuse's all-reduce-only kernel + local kernel); bandwidth at T = 256,
//!    1024, 4096 as GB/s over the algorithm's bytes (`check::bytes_moved`) and over the
//!    fewest bytes any algorithm moves (`check::minimum_bytes`), each against a
//!    measured device-to-device copy. Every table is labelled as W virtual ranks on one
//!    GPU (no NVLink hop) and claims none of the latency or bandwidth targets: those
//!    need real ranks on W GPUs.
//! 3. The same unfused sequence written with torch ops (`torch_baseline.py` next to this
//!    crate, run with the machine's `python3`), when PyTorch is there.
//!
//! Exit status: 0 every check passed; 1 a check failed or the GPU run errored; 2
//! nothing was checked (no CUDA driver on this machine); 64 bad arguments.

mod node_check;
mod preflight;
mod real_ranks;
mod timings;

use anyhow::{anyhow, Context};
use arfuse_runtime::check::{self, Case, Inputs, Liveness, RankOutputs, FILL_BYTE};
use arfuse_runtime::cuda::Gpu;
use arfuse_runtime::device::{self, Allocation, Device, FusedCall, KernelParams, RankTensor};
use arfuse_runtime::host::{Compiler, HostDevice, HostOptions, LaunchOptions};
use arfuse_runtime::variants::{ActDtype, Strategy, Variant};
use arfuse_runtime::workspace::Backend;
use arfuse_runtime::Error;
use clap::{Parser, ValueEnum};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which device runs the check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DeviceKind {
    /// The CUDA GPU 0 (W virtual ranks in one cooperative launch).
    Cuda,
    /// The host device: the same kernel sources compiled with the machine's C++
    /// compiler, every rank its own launch stream with seeded skew (no timings).
    Host,
}

#[derive(Parser, Debug)]
#[command(
    name = "gpu_check",
    about = "Checks arfuse's fused kernels on this GPU against the reference contract, then times them"
)]
struct Args {
    /// The device: cuda (GPU 0) or host (the kernels compiled for the CPU; correctness
    /// only).
    #[arg(long, value_enum, default_value = "cuda")]
    device: DeviceKind,
    /// Host device: where compiled kernel objects are cached.
    #[arg(long, default_value = "target/tmp/arfuse-host")]
    host_cache: std::path::PathBuf,
    /// Host device: seed of the ranks' random start delays and CTA orders.
    #[arg(long, default_value_t = 1)]
    host_seed: u64,
    /// Host device: most CTAs per rank of a launch (each CTA is an OS thread).
    #[arg(long, default_value_t = 4)]
    host_ctas: u32,
    /// Hidden size H of every case (elements).
    #[arg(long, default_value_t = 4096)]
    hidden: u32,
    /// CUDA graph replays before the second comparison.
    #[arg(long, default_value_t = 1000)]
    replays: u32,
    /// Only these world sizes (repeatable; default 2, 4, 8).
    #[arg(long = "world")]
    worlds: Vec<u32>,
    /// Only these dtypes (bf16, f16, f32; repeatable).
    #[arg(long = "dtype")]
    dtypes: Vec<String>,
    /// Only patterns whose name contains this text (e.g. `fp8tok`, `res_norm`).
    #[arg(long)]
    pattern: Option<String>,
    /// Token counts to check instead of 1, 7, 16, 40, 42, 128, 1024 (repeatable).
    #[arg(long = "tokens")]
    tokens: Vec<u32>,
    /// Skip the correctness matrix.
    #[arg(long)]
    no_correctness: bool,
    /// Skip the timings.
    #[arg(long)]
    no_timings: bool,
    /// Launch without programmatic dependent launch (PDL) in the correctness part
    /// (the latency table times both ways regardless).
    #[arg(long)]
    no_pdl: bool,
    /// World size of the timing table.
    #[arg(long, default_value_t = 8)]
    timing_world: u32,
    /// Calls per captured graph in the timings (per-call time = graph time / calls).
    #[arg(long, default_value_t = 50)]
    calls_per_graph: u32,
    /// NVRTC compile threads.
    #[arg(long, default_value_t = 8)]
    compile_threads: usize,
    /// The torch-ops baseline script run after the timings (`python3 SCRIPT`); skipped
    /// with a note when the file, python3 or PyTorch is missing.
    #[arg(long, default_value = "crates/gpu-check/torch_baseline.py")]
    torch_script: std::path::PathBuf,
    /// Skip the torch baseline.
    #[arg(long)]
    no_torch: bool,
    /// Skip the preflight (launch modes, real ranks).
    #[arg(long)]
    no_preflight: bool,
    /// Internal: run preflight launch mode N in this process.
    #[arg(long, hide = true)]
    preflight_mode: Option<usize>,
    /// Internal: run one real rank (`RANK:SOCKET`) in this process.
    #[arg(long, hide = true)]
    real_rank_child: Option<String>,
}

/// Device buffers for W ranks' tensors of the largest case, reused by every case.
struct Io<B> {
    x: B,
    residual: B,
    out: B,
    residual_out: B,
    quant: B,
    scale: B,
    gamma: B,
    scale_in: B,
    /// Unfused baseline: the all-reduce output the local kernel reads.
    ar_out: B,
}

impl<B: Allocation> Io<B> {
    fn new<D: Device<Buffer = B>>(
        gpu: &mut D,
        world: u32,
        dtype: ActDtype,
        hidden: u32,
        max_t: u32,
    ) -> anyhow::Result<Io<B>> {
        // Largest output of any case at (W, dtype, H, max T): try every quant.
        let mut big = check::OutputBytes::default();
        for e in arfuse_runtime::variants::all_epilogues() {
            let c = Case {
                strategy: Strategy::OneShot,
                world,
                dtype,
                epilogue: e,
                tokens: max_t,
                hidden,
                weight_bias: 0,
                gamma_f32: false,
                norm_round_twice: false,
                norm_f32_sum: false,
            };
            if let Ok(b) = c.output_bytes() {
                big.out = big.out.max(b.out);
                big.residual_out = big.residual_out.max(b.residual_out);
                big.quant = big.quant.max(b.quant);
                big.scale = big.scale.max(b.scale);
            }
        }
        let w = u64::from(world);
        let mut alloc = |b: u64| gpu.alloc(b.max(16) * w);
        Ok(Io {
            x: alloc(big.out)?,
            residual: alloc(big.out)?,
            out: alloc(out_stride(big.out.max(16)))?,
            residual_out: alloc(out_stride(big.out.max(16)))?,
            quant: alloc(out_stride(big.quant.max(16)))?,
            scale: alloc(out_stride(big.scale.max(16)))?,
            gamma: alloc(u64::from(hidden) * 4)?,
            scale_in: alloc(4)?,
            ar_out: alloc(big.out)?,
        })
    }
}

/// Bytes after each rank's slice of every output that no kernel may write. They are
/// filled with FILL_BYTE with the outputs and must still hold it after each launch, so a
/// write past the end of a tensor sized as the engines allocate it (scale padding past
/// vLLM's packed UE8M0 allocation, say) fails the case.
const GUARD_BYTES: u64 = 64;

/// Per-rank stride of an output of `n` bytes: the slice plus its guard.
fn out_stride(n: u64) -> u64 {
    n + GUARD_BYTES
}

/// An output tensor of `n` bytes per rank at a stride of [`out_stride`].
fn out_tensor(buf: &impl Allocation, n: u64, live: bool) -> RankTensor {
    if live && n > 0 {
        RankTensor {
            ptr: buf.ptr(),
            rank_stride: out_stride(n),
        }
    } else {
        RankTensor::default()
    }
}

fn rank_tensor(buf: &impl Allocation, per_rank: u64, live: bool) -> RankTensor {
    if live && per_rank > 0 {
        RankTensor {
            ptr: buf.ptr(),
            rank_stride: per_rank,
        }
    } else {
        RankTensor::default()
    }
}

fn params<B: Allocation>(io: &Io<B>, case: &Case, live: Liveness) -> anyhow::Result<KernelParams> {
    let b = case.output_bytes()?;
    Ok(KernelParams {
        x: rank_tensor(&io.x, b.out, true),
        residual_in: rank_tensor(&io.residual, b.out, case.epilogue.residual),
        residual_out: out_tensor(&io.residual_out, b.residual_out, live.residual_out),
        out: out_tensor(&io.out, b.out, live.out),
        quant_out: out_tensor(&io.quant, b.quant, live.quant),
        scale_out: out_tensor(&io.scale, b.scale, live.scale),
        gamma: io.gamma.ptr(),
        scale_in: if case.epilogue.quant.takes_scale_input() {
            io.scale_in.ptr()
        } else {
            0
        },
        eps: check::EPS as f32,
        weight_bias: case.weight_bias as f32,
        gamma_f32: i32::from(case.gamma_f32),
        norm_round_twice: i32::from(case.norm_round_twice),
        norm_f32_sum: i32::from(case.norm_f32_sum),
        timeout_ns: device::DEFAULT_TIMEOUT_NS,
        ..KernelParams::default()
    })
}

fn upload_inputs<D: Device>(
    gpu: &mut D,
    io: &Io<D::Buffer>,
    inputs: &Inputs,
) -> anyhow::Result<()> {
    gpu.upload(&io.x, 0, &inputs.x.concat())?;
    if !inputs.residual.is_empty() {
        gpu.upload(&io.residual, 0, &inputs.residual.concat())?;
    }
    gpu.upload(&io.gamma, 0, &inputs.gamma)?;
    gpu.upload(&io.scale_in, 0, &inputs.scale_in.to_le_bytes())?;
    Ok(())
}

/// Fills every output of the case, guards included, with FILL_BYTE (so unwritten
/// bytes show).
fn fill_outputs<D: Device>(gpu: &mut D, io: &Io<D::Buffer>, case: &Case) -> anyhow::Result<()> {
    let b = case.output_bytes()?;
    let w = u64::from(case.world);
    for (buf, n) in [
        (&io.out, b.out),
        (&io.residual_out, b.residual_out),
        (&io.quant, b.quant),
        (&io.scale, b.scale),
    ] {
        if n > 0 {
            gpu.fill(buf, 0, out_stride(n) * w, FILL_BYTE)?;
        }
    }
    gpu.sync()?;
    Ok(())
}

/// Every rank's slice of each output; an error when a guard byte after a slice was
/// written (the kernel wrote past the output's end).
fn download_outputs<D: Device>(
    gpu: &mut D,
    io: &Io<D::Buffer>,
    case: &Case,
) -> anyhow::Result<Vec<RankOutputs>> {
    let b = case.output_bytes()?;
    let w = case.world as usize;
    let mut get = |buf: &D::Buffer, n: u64, what: &str| -> anyhow::Result<Vec<Vec<u8>>> {
        if n == 0 {
            return Ok(vec![Vec::new(); w]);
        }
        let stride = usize::try_from(out_stride(n))?;
        let n = usize::try_from(n)?;
        let mut all = vec![0u8; stride * w];
        gpu.download(buf, 0, &mut all)?;
        for r in 0..w {
            let guard = &all[r * stride + n..(r + 1) * stride];
            let hit = guard.iter().filter(|&&x| x != FILL_BYTE).count();
            if hit > 0 {
                return Err(anyhow!(
                    "{}: {hit} of the {GUARD_BYTES} bytes after rank {r}'s {n}-byte {what} output were written",
                    case.label()
                ));
            }
        }
        Ok((0..w)
            .map(|r| all[r * stride..r * stride + n].to_vec())
            .collect())
    };
    let (out, res, q, s) = (
        get(&io.out, b.out, "norm")?,
        get(&io.residual_out, b.residual_out, "residual")?,
        get(&io.quant, b.quant, "quant")?,
        get(&io.scale, b.scale, "scale")?,
    );
    Ok((0..w)
        .map(|r| RankOutputs {
            out: out[r].clone(),
            residual_out: res[r].clone(),
            quant: q[r].clone(),
            scale: s[r].clone(),
        })
        .collect())
}

fn fused_call(case: &Case, p: KernelParams) -> FusedCall {
    FusedCall {
        variant: case.variant(),
        tokens: case.tokens,
        hidden: case.hidden,
        ranks: case.world,
        params: p,
    }
}

/// Outcome of one case.
#[derive(Default, Clone)]
struct Outcome {
    direct: Option<check::Verdict>,
    partial_bad: Option<u64>,
    replayed: Option<check::Verdict>,
    error: Option<String>,
}

impl Outcome {
    fn passed(&self) -> bool {
        self.error.is_none()
            && self.direct.is_some_and(|v| v.passed())
            && self.partial_bad.unwrap_or(0) == 0
            && self.replayed.is_some_and(|v| v.passed())
    }
    fn cell(&self) -> String {
        if let Some(e) = &self.error {
            let short: String = e.chars().take(24).collect();
            return format!("ERR {short}");
        }
        if self.passed() {
            return "ok".into();
        }
        let mut parts = Vec::new();
        if let Some(v) = self.direct.filter(|v| !v.passed()) {
            parts.push(format!("D:{}", v.summary()));
        }
        if let Some(n) = self.partial_bad.filter(|n| *n > 0) {
            parts.push(format!("P:{n}"));
        }
        if let Some(v) = self.replayed.filter(|v| !v.passed()) {
            parts.push(format!("R:{}", v.summary()));
        }
        parts.join(" ")
    }
}

fn run_case<D: Device>(
    gpu: &mut D,
    ws: &D::Workspace,
    io: &Io<D::Buffer>,
    case: &Case,
    replays: u32,
) -> anyhow::Result<Outcome> {
    let mut o = Outcome::default();
    let inputs = check::make_inputs(case, 0x5eed ^ u64::from(case.tokens))?;
    let want = check::expected(case, &inputs)?;
    upload_inputs(gpu, io, &inputs)?;
    let all = Liveness::all(case)?;

    // 1. Direct launch, every output live.
    fill_outputs(gpu, io, case)?;
    gpu.launch_fused(ws, &fused_call(case, params(io, case, all)?))?;
    gpu.take_error(ws)?;
    let full = download_outputs(gpu, io, case)?;
    o.direct = Some(check::compare(case, &inputs, &want, &full)?);

    // 2. Some outputs dead: live ones identical, dead ones untouched.
    if let Some(live) = Liveness::partial(case)? {
        fill_outputs(gpu, io, case)?;
        gpu.launch_fused(ws, &fused_call(case, params(io, case, live)?))?;
        gpu.take_error(ws)?;
        let part = download_outputs(gpu, io, case)?;
        o.partial_bad = Some(check::compare_partial(live, &full, &part));
    }

    // 3. A graph of one call, replayed `replays` times; the last replay's outputs.
    let call = fused_call(case, params(io, case, all)?);
    let graph = gpu.capture(&mut |g: &mut D| g.launch_fused(ws, &call))?;
    fill_outputs(gpu, io, case)?;
    for _ in 0..replays {
        gpu.replay(&graph)?;
    }
    gpu.take_error(ws)?;
    let replayed = download_outputs(gpu, io, case)?;
    o.replayed = Some(check::compare(case, &inputs, &want, &replayed)?);
    Ok(o)
}

fn dtype_of(name: &str) -> anyhow::Result<ActDtype> {
    ActDtype::ALL
        .into_iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| anyhow!("unknown dtype {name:?} (bf16, f16, f32)"))
}

/// The cases the arguments select. Checked before the GPU is opened, so bad
/// arguments are reported the same way on every machine.
fn select_cases(args: &Args, nvfp4: bool) -> anyhow::Result<Vec<Case>> {
    let dtypes: Vec<ActDtype> = args
        .dtypes
        .iter()
        .map(|d| dtype_of(d))
        .collect::<anyhow::Result<_>>()?;
    if let Some(w) = args.worlds.iter().find(|w| !check::WORLDS.contains(w)) {
        return Err(anyhow!(
            "--world {w}: the check runs W in {:?}",
            check::WORLDS
        ));
    }
    if let Some(t) = args.tokens.iter().find(|t| !(1..=65_535).contains(*t)) {
        return Err(anyhow!("--tokens {t}: T must be in 1..=65535"));
    }
    for d in ActDtype::ALL {
        device::block_size(args.hidden, d).map_err(|e| anyhow!("--hidden {}: {e}", args.hidden))?;
    }
    if !arfuse_runtime::variants::WORLD_SIZES.contains(&args.timing_world) {
        return Err(anyhow!(
            "--timing-world {}: W must be 2, 4, 8 or 16",
            args.timing_world
        ));
    }
    let tokens = if args.tokens.is_empty() {
        check::TOKENS.to_vec()
    } else {
        args.tokens.clone()
    };
    let cases: Vec<Case> = check::cases_for_tokens(args.hidden, nvfp4, &tokens)
        .into_iter()
        .filter(|c| args.worlds.is_empty() || args.worlds.contains(&c.world))
        .filter(|c| dtypes.is_empty() || dtypes.contains(&c.dtype))
        .filter(|c| {
            args.pattern
                .as_ref()
                .map_or(true, |p| c.pattern().contains(p.as_str()))
        })
        .collect();
    if cases.is_empty() {
        return Err(anyhow!(
            "no case matches the filters (patterns are e.g. ar, res_norm, norm_fp8tok, res_norm_nvfp4_swz)"
        ));
    }
    Ok(cases)
}

/// The correctness matrix on `gpu`; `nvfp4` whether the device runs the NVFP4 variants
/// (SM100+, or the host). Returns the number of failed cases.
fn correctness<D: Device>(gpu: &mut D, args: &Args, nvfp4: bool) -> anyhow::Result<usize> {
    let cases = select_cases(args, nvfp4)?;
    let mut variants: Vec<Variant> = cases.iter().map(Case::variant).collect();
    variants.sort();
    variants.dedup();
    let t0 = Instant::now();
    gpu.load(&variants)?;
    println!(
        "compiled and loaded {} kernel variants in {:.1} s; {} cases{}",
        variants.len(),
        t0.elapsed().as_secs_f64(),
        cases.len(),
        if nvfp4 { "" } else { " (no NVFP4: SM < 100)" }
    );
    let max_t = cases.iter().map(|c| c.tokens).max().unwrap_or(1);
    // Rows: (W, dtype, pattern, strategy) -> T -> outcome.
    type Row = (u32, &'static str, String, &'static str);
    let mut table: BTreeMap<Row, BTreeMap<u32, Outcome>> = BTreeMap::new();
    let mut max_ulp: BTreeMap<Row, u64> = BTreeMap::new();
    let mut failures = 0usize;
    let t0 = Instant::now();
    let mut groups: Vec<(u32, ActDtype)> = cases.iter().map(|c| (c.world, c.dtype)).collect();
    groups.sort();
    groups.dedup();
    for (world, dtype) in groups {
        let ws = gpu
            .create_workspace(
                Backend::Trtllm,
                &check::workspace_for(world, dtype, args.hidden, max_t)?,
            )
            .with_context(|| format!("workspace W={world} {}", dtype.name()))?;
        let io = Io::new(gpu, world, dtype, args.hidden, max_t)?;
        for case in cases
            .iter()
            .filter(|c| c.world == world && c.dtype == dtype)
        {
            let o = match run_case(gpu, &ws, &io, case, args.replays) {
                Ok(o) => o,
                Err(e) => {
                    let msg = format!("{e:#}");
                    eprintln!("{}: {msg}", case.label());
                    Outcome {
                        error: Some(msg),
                        ..Outcome::default()
                    }
                }
            };
            if !o.passed() {
                failures += 1;
                eprintln!("FAIL {}: {}", case.label(), o.cell());
            }
            let row = (world, dtype.name(), case.pattern(), case.strategy.name());
            let ulp = o
                .direct
                .map(|v| v.max_norm_ulp)
                .max(o.replayed.map(|v| v.max_norm_ulp))
                .unwrap_or(0);
            let m = max_ulp.entry(row.clone()).or_default();
            *m = (*m).max(ulp);
            table.entry(row).or_default().insert(case.tokens, o);
        }
    }
    let tokens: Vec<u32> = {
        let mut t: Vec<u32> = cases.iter().map(|c| c.tokens).collect();
        t.sort();
        t.dedup();
        t
    };
    println!(
        "\ncorrectness vs {} (H = {}; each cell: direct, partial outputs, after {} graph replays; ulp = max norm distance)",
        arfuse_runtime::check::CONTRACT,
        args.hidden,
        args.replays
    );
    let mut head = format!(
        "{:>2} {:<5} {:<22} {:<8}",
        "W", "dtype", "pattern", "strategy"
    );
    for t in &tokens {
        head.push_str(&format!(" {:>6}", format!("T={t}")));
    }
    head.push_str("  ulp");
    println!("{head}");
    for (row, cells) in &table {
        let mut line = format!("{:>2} {:<5} {:<22} {:<8}", row.0, row.1, row.2, row.3);
        for t in &tokens {
            let c = cells
                .get(t)
                .map(Outcome::cell)
                .unwrap_or_else(|| "-".into());
            line.push_str(&format!(" {c:>6}"));
        }
        line.push_str(&format!("  {}", max_ulp.get(row).copied().unwrap_or(0)));
        println!("{line}");
    }
    println!(
        "{} cases, {} failed, {:.1} s",
        cases.len(),
        failures,
        t0.elapsed().as_secs_f64()
    );
    Ok(failures)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Median microseconds per call of what `body` enqueues, captured `calls` times in one
/// graph and replayed 20 times (after 3 warm-up replays).
fn time_graph(
    gpu: &mut Gpu,
    calls: u32,
    mut body: impl FnMut(&mut Gpu) -> arfuse_runtime::Result<()>,
) -> anyhow::Result<f64> {
    let graph = gpu.capture(&mut |g: &mut Gpu| {
        for _ in 0..calls {
            body(g)?;
        }
        Ok(())
    })?;
    for _ in 0..3 {
        graph.launch()?;
    }
    gpu.sync()?;
    let mut v = Vec::new();
    for _ in 0..20 {
        let ms = gpu.time_ms(|_| graph.launch())?;
        v.push(f64::from(ms) * 1000.0 / f64::from(calls));
    }
    Ok(median(v))
}

/// Runs the torch-ops baseline in a child process (it needs the GPU memory this
/// process no longer uses: the timing buffers are dropped by then).
fn torch_baseline(args: &Args) {
    if !args.torch_script.is_file() {
        println!(
            "\ntorch baseline: {} not found (run from the repository root); skipped",
            args.torch_script.display()
        );
        return;
    }
    println!();
    let status = std::process::Command::new("python3")
        .arg(&args.torch_script)
        .args(["--world", &args.timing_world.to_string()])
        .args(["--hidden", &args.hidden.to_string()])
        .args(["--calls", &args.calls_per_graph.to_string()])
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => println!("torch baseline: exited with {s}; no torch figures"),
        Err(e) => println!("torch baseline: cannot run python3 ({e}); no torch figures"),
    }
}

/// Checks every argument (before the GPU is opened).
fn validate(args: &Args) -> anyhow::Result<()> {
    if args.replays == 0 || args.calls_per_graph == 0 {
        return Err(anyhow!(
            "--replays and --calls-per-graph must be at least 1"
        ));
    }
    select_cases(args, true).map(|_| ())
}

fn run(args: &Args) -> anyhow::Result<usize> {
    if let Some(mode) = args.preflight_mode {
        preflight::run_mode(mode, args.hidden)?;
        return Ok(0);
    }
    if let Some(spec) = &args.real_rank_child {
        real_ranks::run_child(spec, args.hidden)?;
        return Ok(0);
    }
    match args.device {
        DeviceKind::Cuda => run_cuda(args),
        DeviceKind::Host => run_host(args),
    }
}

fn run_cuda(args: &Args) -> anyhow::Result<usize> {
    let mut gpu = Gpu::open(0)?;
    gpu.set_compile_threads(args.compile_threads);
    gpu.set_pdl(!args.no_pdl);
    let info = gpu.info().clone();
    let nv = arfuse_runtime::nvrtc::nvrtc()?;
    println!(
        "device: {} (SM {}, {} SMs, multicast {}, {:.1} GiB free); NVRTC {}.{} at {}",
        info.name,
        info.sm,
        info.sm_count,
        info.multicast,
        info.free_bytes as f64 / (1u64 << 30) as f64,
        nv.version().0,
        nv.version().1,
        nv.path()
    );
    let mut failures = 0;
    if !args.no_preflight {
        failures += preflight::run(args.hidden)?;
        failures += real_ranks::run(args.hidden)?;
    }
    if !args.no_correctness {
        failures += correctness(&mut gpu, args, info.sm >= 100)?;
        let open = || -> anyhow::Result<Gpu> {
            let mut g = Gpu::open(0)?;
            g.set_compile_threads(args.compile_threads);
            g.set_pdl(!args.no_pdl);
            Ok(g)
        };
        failures += node_check::run(&open, args.hidden, args.replays)?;
    }
    if !args.no_timings {
        timings::run(&mut gpu, args)?;
        if !args.no_torch {
            torch_baseline(args);
        }
    }
    Ok(failures)
}

/// The host device of `--device host`.
fn host_device(args: &Args, compiler: &Arc<Compiler>) -> HostDevice {
    HostDevice::new(
        compiler.clone(),
        HostOptions {
            launch: LaunchOptions::skewed(args.host_seed, Duration::from_micros(300)),
            max_ctas: args.host_ctas.max(1),
            compile_threads: args.compile_threads,
            ..HostOptions::default()
        },
    )
}

fn run_host(args: &Args) -> anyhow::Result<usize> {
    let compiler = Arc::new(Compiler::new(&args.host_cache)?);
    println!(
        "device: host ({}; {} CTAs per rank at most, seed {}; every rank its own launch stream)",
        compiler.version(),
        args.host_ctas.max(1),
        args.host_seed
    );
    let mut failures = 0;
    if !args.no_correctness {
        failures += correctness(&mut host_device(args, &compiler), args, true)?;
        let open = || -> anyhow::Result<HostDevice> { Ok(host_device(args, &compiler)) };
        failures += node_check::run(&open, args.hidden, args.replays)?;
    }
    if !args.no_timings {
        println!("\ntimings: not on the host device (its times say nothing about a GPU)");
    }
    Ok(failures)
}

/// Exit status for bad arguments (sysexits.h EX_USAGE), distinct from a failed check.
const USAGE: u8 = 64;

fn main() -> std::process::ExitCode {
    // Exit status: 0 passed, 1 a check failed or the run errored, 2 no CUDA driver,
    // 64 (EX_USAGE) bad arguments; --help and --version exit 0.
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let usage = e.use_stderr();
            let _ = e.print();
            return std::process::ExitCode::from(if usage { USAGE } else { 0 });
        }
    };
    if let Err(e) = validate(&args) {
        eprintln!("gpu_check: error: {e:#}");
        return std::process::ExitCode::from(USAGE);
    }
    match run(&args) {
        Ok(0) => {
            // Say exactly what ran: with --no-correctness nothing was checked.
            let ran = match (
                args.no_correctness,
                args.no_timings || args.device == DeviceKind::Host,
            ) {
                (false, false) => "all correctness checks passed; timings printed above",
                (false, true) => "all correctness checks passed (timings skipped)",
                (true, false) => {
                    "timings printed above; no correctness check ran (--no-correctness)"
                }
                (true, true) if args.device == DeviceKind::Host && !args.no_timings => {
                    "nothing ran (--no-correctness; the host device has no timings)"
                }
                (true, true) => "nothing ran (--no-correctness and --no-timings)",
            };
            println!("\ngpu_check: {ran}");
            std::process::ExitCode::SUCCESS
        }
        Ok(n) => {
            println!("\ngpu_check: {n} cases FAILED");
            std::process::ExitCode::from(1)
        }
        Err(e) => {
            if let Some(Error::NoDriver(m)) = e.downcast_ref::<Error>() {
                eprintln!(
                    "gpu_check: skipped: no CUDA driver ({m}); nothing was checked. Run it on a machine with an NVIDIA GPU."
                );
                return std::process::ExitCode::from(2);
            }
            eprintln!("gpu_check: error: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("gpu_check").chain(list.iter().copied()))
            .expect("parses")
    }

    #[test]
    fn bad_arguments_are_refused_before_any_device_opens() {
        for (list, want) in [
            (&["--world", "3"][..], "--world 3"),
            (&["--tokens", "0"], "--tokens 0"),
            (&["--tokens", "70000"], "--tokens 70000"),
            (&["--hidden", "100"], "--hidden 100"),
            (&["--timing-world", "6"], "--timing-world 6"),
            (&["--replays", "0"], "--replays"),
            (&["--pattern", "no_such_pattern"], "no case matches"),
            (&["--dtype", "fp8"], "unknown dtype"),
        ] {
            let e = validate(&args(list)).unwrap_err().to_string();
            assert!(e.contains(want), "{list:?}: {e}");
        }
        assert!(Args::try_parse_from(["gpu_check", "--device", "tpu"]).is_err());
    }

    #[test]
    fn the_default_selection_is_the_full_matrix_on_either_device() {
        for device in [&[][..], &["--device", "host"]] {
            let a = args(device);
            validate(&a).unwrap();
            assert_eq!(
                select_cases(&a, true).unwrap().len(),
                check::all_cases(4096, true).len()
            );
        }
        assert_eq!(args(&["--device", "host"]).device, DeviceKind::Host);
        let some = args(&[
            "--world",
            "2",
            "--dtype",
            "f16",
            "--tokens",
            "7",
            "--pattern",
            "fp8tok",
        ]);
        let cases = select_cases(&some, false).unwrap();
        assert!(!cases.is_empty());
        assert!(cases.iter().all(|c| c.world == 2
            && c.dtype == ActDtype::F16
            && c.tokens == 7
            && c.pattern().contains("fp8tok")));
    }
}
