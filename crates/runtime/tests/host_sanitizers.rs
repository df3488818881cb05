//! The kernels under AddressSanitizer + UndefinedBehaviorSanitizer: a second host
//! build of the same sources (`host::Build::Sanitized`, every UB check fatal), run on
//! the host device and checked against the contract like the plain build.
//!
//! An ASan object loads only into a process whose first library is the ASan runtime,
//! and this test binary (Rust) is not instrumented. So this test has its own `main`
//! (`harness = false`): it compiles every sanitized object (without the runtime, the
//! compiler must not inherit it), then starts ITSELF again with
//! `LD_PRELOAD=$(g++ -print-file-name=libasan.so)`; that child loads the objects, runs
//! the cases and reports. The parent passes only if the child exited 0 and its output
//! holds no sanitizer report. Guard gaps after every rank's slice of every tensor are
//! poisoned in the child, so an out-of-bounds READ into them is reported too; each
//! rank's workspace is its own heap allocation with ASan redzones around it.
//!
//! Cases: every fused variant for W in {2, 4, 8} (both strategies, every dtype and
//! epilogue, NVFP4 included) at T = 42 and T = 1 (the seed bug's size: 42 = 5 * 8 + 2
//! tokens, uneven two-shot ownership, and the smallest call), one workspace per
//! (W, dtype) as in the matrix; every local kernel of a norm epilogue (W = 4, T = 42);
//! the virtual-rank all-reduce for W in {2, 4, 8, 16}.

mod common;

use arfuse_runtime::check::{self, Case, Liveness};
use arfuse_runtime::host::cases::{self, CaseIo};
use arfuse_runtime::host::{Build, Compiler, HostKernel, HostWorkspace, LaunchOptions};
use arfuse_runtime::variants::{self, ActDtype, Epilogue, Strategy, Variant};
use std::collections::HashMap;
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "ARFUSE_HOST_SANITIZER_CHILD";
const HIDDEN: u32 = 256;
const TOKENS: [u32; 2] = [42, 1];
const MAX_CTAS: u32 = 4;

fn compiler() -> Compiler {
    common::new_compiler()
}

fn case(world: u32, dtype: ActDtype, epilogue: Epilogue, strategy: Strategy, tokens: u32) -> Case {
    common::weight_form_case(world, dtype, epilogue, strategy, tokens, HIDDEN)
}

/// The fused cases, the unfused-path cases.
fn plan() -> (Vec<Case>, Vec<Case>) {
    let fused = check::cases_for_tokens(HIDDEN, true, &TOKENS);
    let mut unfused = Vec::new();
    for dtype in ActDtype::ALL {
        for e in variants::all_epilogues().into_iter().filter(|e| e.norm) {
            let c = case(4, dtype, e, Strategy::OneShot, 42);
            if c.validate().is_ok() {
                unfused.push(c);
            }
        }
        for w in variants::WORLD_SIZES {
            unfused.push(case(w, dtype, Epilogue::AR_ONLY, Strategy::OneShot, 42));
        }
    }
    (fused, unfused)
}

fn variants_of(fused: &[Case], unfused: &[Case]) -> Vec<Variant> {
    let mut vs: Vec<Variant> = fused.iter().map(Case::variant).collect();
    for c in unfused {
        vs.push(variants::virtual_allreduce(c.world, c.dtype));
        vs.extend(cases::local_variant(c));
    }
    vs.sort();
    vs.dedup();
    vs
}

fn main() -> ExitCode {
    if std::env::var_os(CHILD_ENV).is_some() {
        child()
    } else {
        parent()
    }
}

fn parent() -> ExitCode {
    let c = compiler();
    let (fused, unfused) = plan();
    let vs = variants_of(&fused, &unfused);
    let t0 = Instant::now();
    if let Err(e) = c.objects(&vs, Build::Sanitized, 2) {
        eprintln!("sanitized host build failed: {e}");
        return ExitCode::FAILURE;
    }
    println!(
        "host_sanitizers: {} sanitized variants compiled or cached in {:.1} s ({})",
        vs.len(),
        t0.elapsed().as_secs_f64(),
        c.version()
    );
    let asan = match c.asan_runtime() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("host_sanitizers: {e}");
            return ExitCode::FAILURE;
        }
    };
    let exe = std::env::current_exe().expect("own path");
    let t1 = Instant::now();
    let out = Command::new(exe)
        .env(CHILD_ENV, "1")
        .env("LD_PRELOAD", &asan)
        // Leak checking is off: the Rust test binary is not instrumented and keeps
        // some allocations to exit. Every report is fatal.
        .env(
            "ASAN_OPTIONS",
            "detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86",
        )
        .env(
            "UBSAN_OPTIONS",
            "print_stacktrace=1:halt_on_error=1:exitcode=87",
        )
        .output()
        .expect("starting the sanitized child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    print!("{stdout}");
    let reports: Vec<&str> = stderr
        .lines()
        .filter(|l| {
            l.contains("ERROR: AddressSanitizer")
                || l.contains("runtime error:")
                || l.contains("SUMMARY: ")
                || l.contains("ERROR: LeakSanitizer")
        })
        .collect();
    println!(
        "host_sanitizers: child (LD_PRELOAD={}) exited with {} after {:.1} s, {} sanitizer report lines",
        asan.display(),
        out.status,
        t1.elapsed().as_secs_f64(),
        reports.len()
    );
    if !out.status.success() || !reports.is_empty() {
        eprint!("{stderr}");
        println!("0 passed, 1 failed");
        return ExitCode::FAILURE;
    }
    println!("1 passed, 0 failed");
    ExitCode::SUCCESS
}

fn run_fused(k: &HostKernel, ws: &mut HostWorkspace, c: &Case) -> Result<(), String> {
    let inputs = check::make_inputs(c, 0x5a ^ u64::from(c.tokens)).map_err(|e| e.to_string())?;
    let want = check::expected(c, &inputs).map_err(|e| e.to_string())?;
    let mut io = CaseIo::new(c, &inputs).map_err(|e| e.to_string())?;
    let opts = LaunchOptions::skewed(u64::from(c.tokens) * 7 + 1, Duration::from_micros(200));
    let all = Liveness::all(c).map_err(|e| e.to_string())?;
    let got = cases::run_fused(k, ws, &mut io, all, MAX_CTAS, &opts).map_err(|e| e.to_string())?;
    let v = check::compare(c, &inputs, &want, &got).map_err(|e| e.to_string())?;
    if v.passed() {
        Ok(())
    } else {
        Err(v.summary())
    }
}

fn run_unfused(ks: &HashMap<Variant, Arc<HostKernel>>, c: &Case) -> Result<(), String> {
    let inputs = check::make_inputs(c, 0x5b).map_err(|e| e.to_string())?;
    let want = check::expected(c, &inputs).map_err(|e| e.to_string())?;
    let mut io = CaseIo::new(c, &inputs).map_err(|e| e.to_string())?;
    let ar = &ks[&variants::virtual_allreduce(c.world, c.dtype)];
    let local = cases::local_variant(c).map(|v| ks[&v].as_ref());
    let opts = LaunchOptions::skewed(5, Duration::from_micros(200));
    let got = cases::run_unfused(ar, local, &mut io, MAX_CTAS, &opts).map_err(|e| e.to_string())?;
    let v = check::compare(c, &inputs, &want, &got).map_err(|e| e.to_string())?;
    if v.passed() {
        Ok(())
    } else {
        Err(v.summary())
    }
}

fn child() -> ExitCode {
    let c = compiler();
    let (fused, unfused) = plan();
    let vs = variants_of(&fused, &unfused);
    let ks: HashMap<Variant, Arc<HostKernel>> = match c.kernels(&vs, Build::Sanitized, 1) {
        Ok(k) => vs.iter().copied().zip(k).collect(),
        Err(e) => {
            eprintln!("loading sanitized objects: {e}");
            return ExitCode::FAILURE;
        }
    };
    let t0 = Instant::now();
    let mut failures = Vec::new();
    let mut wss: HashMap<(u32, ActDtype), HostWorkspace> = HashMap::new();
    for c in &fused {
        let ws = wss.entry((c.world, c.dtype)).or_insert_with(|| {
            HostWorkspace::create(
                &check::workspace_for(c.world, c.dtype, HIDDEN, TOKENS[0]).expect("sizes"),
            )
            .expect("workspace")
        });
        if let Err(e) = run_fused(&ks[&c.variant()], ws, c) {
            failures.push(format!("{}: {e}", c.label()));
        }
    }
    for c in &unfused {
        if let Err(e) = run_unfused(&ks, c) {
            failures.push(format!("unfused {}: {e}", c.label()));
        }
    }
    println!(
        "host_sanitizers (child): {} fused + {} unfused cases on {} sanitized variants in {:.1} s, {} failed",
        fused.len(),
        unfused.len(),
        vs.len(),
        t0.elapsed().as_secs_f64(),
        failures.len()
    );
    for f in &failures {
        println!("FAIL {f}");
    }
    if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
