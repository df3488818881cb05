//! The preflight, run before the matrix: the launch unknowns nobody has seen on a GPU
//! yet, one at a time. Four launch modes of the fused kernel on virtual ranks
//! (cooperative + PDL, cooperative alone, PDL with a non-cooperative grid sized to what
//! the GPU holds at once, neither), each in its own child process (a fault or a hang in
//! one mode cannot spoil the next: a child past its bound is killed and reported as a
//! hang), each running a one-shot and a two-shot case directly and from a captured
//! graph against the contract. Then the real-rank case (`real_ranks`).

use crate::{run_case, Io};
use anyhow::Context;
use arfuse_runtime::check::{self, Case};
use arfuse_runtime::cuda::Gpu;
use arfuse_runtime::device::Device;
use arfuse_runtime::variants::{ActDtype, Epilogue, Strategy};
use arfuse_runtime::workspace::Backend;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The launch modes: (name, cooperative, PDL).
pub const MODES: [(&str, bool, bool); 4] = [
    ("cooperative + PDL", true, true),
    ("cooperative", true, false),
    ("PDL, grid sized to fit", false, true),
    ("neither", false, false),
];

/// A child that has not finished by then hangs: it is killed.
const CHILD_BOUND: Duration = Duration::from_secs(180);

/// Graph replays per case in the preflight.
const REPLAYS: u32 = 10;

/// The preflight's cases at `hidden`: W = 2 bf16, residual + RMSNorm, one-shot at
/// T = 16 and two-shot at T = 64.
pub fn cases(hidden: u32) -> [Case; 2] {
    let case = |strategy, tokens| Case {
        strategy,
        world: 2,
        dtype: ActDtype::Bf16,
        epilogue: Epilogue::RES_NORM,
        tokens,
        hidden,
        weight_bias: 0,
        gamma_f32: false,
        norm_round_twice: true,
        norm_f32_sum: false,
    };
    [case(Strategy::OneShot, 16), case(Strategy::TwoShot, 64)]
}

/// Runs `this program ARGS` with a bound; its stdout lines that start with `prefix`,
/// or why there are none (exit status, hang).
pub fn child_lines(args: &[String], prefix: &str) -> Result<Vec<String>, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if start.elapsed() > CHILD_BOUND => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("HANG: killed after {CHILD_BOUND:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e.to_string()),
        }
    };
    let mut out = String::new();
    if let Some(mut s) = child.stdout.take() {
        let _ = s.read_to_string(&mut out);
    }
    let lines: Vec<String> = out
        .lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .map(str::to_string)
        .collect();
    if lines.is_empty() {
        return Err(format!("no result ({status})"));
    }
    Ok(lines)
}

/// The parent: every mode in its own child; prints the table. Returns the failures.
pub fn run(hidden: u32) -> anyhow::Result<usize> {
    println!("\npreflight: launch modes of the fused kernel (W = 2 virtual ranks, H = {hidden}; direct, partial outputs, {REPLAYS} graph replays)");
    let mut failures = 0;
    for (i, (name, _, _)) in MODES.iter().enumerate() {
        let args = vec![
            "--preflight-mode".to_string(),
            i.to_string(),
            "--hidden".to_string(),
            hidden.to_string(),
        ];
        match child_lines(&args, "PREFLIGHT ") {
            Ok(lines) => {
                for l in lines {
                    if !l.ends_with(": ok") {
                        failures += 1;
                    }
                    println!("  {name:<24} {l}");
                }
            }
            Err(e) => {
                failures += 1;
                println!("  {name:<24} {e}");
            }
        }
    }
    Ok(failures)
}

/// One mode, in a child process: prints `PREFLIGHT <case>: <outcome>` per case.
pub fn run_mode(mode: usize, hidden: u32) -> anyhow::Result<()> {
    let (_, cooperative, pdl) = *MODES
        .get(mode)
        .with_context(|| format!("preflight mode {mode} of {}", MODES.len()))?;
    let mut gpu = Gpu::open(0)?;
    gpu.set_cooperative(cooperative);
    gpu.set_pdl(pdl);
    let cases = cases(hidden);
    let ws = gpu.create_workspace(
        Backend::Trtllm,
        &check::workspace_for(2, ActDtype::Bf16, hidden, 64)?,
    )?;
    let io = Io::new(&mut gpu, 2, ActDtype::Bf16, hidden, 64)?;
    for case in &cases {
        let cell = match run_case(&mut gpu, &ws, &io, case, REPLAYS) {
            Ok(o) => o.cell(),
            Err(e) => format!("ERROR {e:#}"),
        };
        println!("PREFLIGHT {}: {cell}", case.label());
    }
    Ok(())
}
