//! The real kernel sources (`kernels/*.cu`) compiled for the CPU and run on the host
//! device (`arfuse_runtime::host`), checked against arfuse-reference's rounding
//! contract through `arfuse_runtime::check` (the GPU check's cases, inputs, expected
//! outputs and comparison: bit-exact all-reduce and residual outputs, the norm within
//! the stated ulp, quant bit-exact on the kernel's own norm, dead outputs untouched).
//!
//! Every rank is its own launch stream (`host::run_ranks`): rank r launches its
//! kernel with `rank_base = r` and one row of CTAs, after a random delay, with its CTAs
//! started in a random order and its fibers scheduled in a random order per pass
//! (seeded, so a failure reproduces).
//!
//! - `matrix_w2` / `matrix_w4` / `matrix_w8`: every pattern x dtype x strategy x T in
//!   {1, 7, 16, 40, 42, 128} at H = 256 (NVFP4 included: the host has no SM limit),
//!   one workspace per (W, dtype) with the strategies alternating call by call,
//!   every output live and then only some.
//! - `skewed_sequences`: long sequences of calls with changing T, grid and strategy on
//!   one workspace, ranks drifting apart across calls (no join between calls), CTAs
//!   pausing at random stores ("chaos").
//! - `harness_finds_the_lamport_clearing_race`: a copy of the one-shot kernel patched
//!   to clear the wrong Lamport buffer (the race its own comment describes) must fail a
//!   skewed sequence that the real kernel passes.
//! - `missing_rank_*`: W - 1 ranks launched; every waiting rank ends with the kernel's
//!   error flag within the polling timeout.
//! - `wide_tokens`: H with several 16-byte vectors per thread and partial blocks.
//! - `unfused_path`: the virtual-rank all-reduce + local kernel of the unfused path.

use arfuse_ir::GroupScaleLayout;
use arfuse_runtime::check::{self, Case, Liveness, RankOutputs};
use arfuse_runtime::host::cases::{self, CaseIo};
use arfuse_runtime::host::{Build, Compiler, HostKernel, HostWorkspace, LaunchOptions};
use arfuse_runtime::variants::{self, Dtype, Epilogue, Quant, Strategy, Variant};
use arfuse_runtime::Error;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Hidden size of the matrix: the smallest H every quant takes (group quant needs
/// H % 128 == 0; 256 gives two groups and, for bf16, 32 vectors per token).
const HIDDEN: u32 = 256;
/// Token counts of the matrix (issue 18).
const TOKENS: [u32; 6] = [1, 7, 16, 40, 42, 128];
/// CTAs per rank at most (every CTA is an OS thread).
const MAX_CTAS: u32 = 4;
/// Compiler processes at once (the CI machine has two cores).
const COMPILE_THREADS: usize = 2;
/// Random start delay of each rank's launch and each CTA, at most.
const MAX_DELAY: Duration = Duration::from_micros(300);

fn compiler() -> &'static Compiler {
    static C: OnceLock<Compiler> = OnceLock::new();
    C.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("arfuse-host");
        Compiler::new(dir).expect("a C++ compiler (g++, or CXX)")
    })
}

fn kernels(variants: &[Variant]) -> HashMap<Variant, Arc<HostKernel>> {
    let t0 = Instant::now();
    let ks = compiler()
        .kernels(variants, Build::Plain, COMPILE_THREADS)
        .unwrap_or_else(|e| panic!("host build failed: {e}"));
    println!(
        "{} variants compiled or loaded in {:.1} s",
        variants.len(),
        t0.elapsed().as_secs_f64()
    );
    variants.iter().copied().zip(ks).collect()
}

fn request(world: u32, dtype: Dtype, hidden: u32, max_tokens: u32) -> arfuse_policy::Workspace {
    check::workspace_for(world, dtype, hidden, max_tokens).expect("workspace sizes")
}

fn seed_of(case: &Case, salt: u64) -> u64 {
    let mut h = salt ^ 0x5eed;
    for b in case.label().bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Runs one case (all outputs live, then the partial set) and returns what failed.
fn run_case(k: &HostKernel, ws: &mut HostWorkspace, case: &Case) -> Result<(), String> {
    let inputs =
        check::make_inputs(case, 0x5eed ^ u64::from(case.tokens)).map_err(|e| e.to_string())?;
    let want = check::expected(case, &inputs).map_err(|e| e.to_string())?;
    let mut io = CaseIo::new(case, &inputs).map_err(|e| e.to_string())?;
    let opts = LaunchOptions::skewed(seed_of(case, 1), MAX_DELAY);
    let all = Liveness::all(case).map_err(|e| e.to_string())?;
    let full = cases::run_fused(k, ws, &mut io, all, MAX_CTAS, &opts).map_err(|e| e.to_string())?;
    let v = check::compare(case, &inputs, &want, &full).map_err(|e| e.to_string())?;
    if !v.passed() {
        return Err(format!("all outputs: {}", v.summary()));
    }
    if let Some(live) = Liveness::partial(case).map_err(|e| e.to_string())? {
        let opts = LaunchOptions::skewed(seed_of(case, 2), MAX_DELAY);
        let part =
            cases::run_fused(k, ws, &mut io, live, MAX_CTAS, &opts).map_err(|e| e.to_string())?;
        let bad = check::compare_partial(live, &full, &part);
        if bad != 0 {
            return Err(format!("partial outputs: {bad} bytes differ"));
        }
    }
    Ok(())
}

/// Every case of world size `world` (all dtypes), one workspace per dtype, in the
/// order `check::cases_for_tokens` gives (strategies alternate call by call).
fn matrix(world: u32) {
    let t0 = Instant::now();
    let all: Vec<Case> = check::cases_for_tokens(HIDDEN, true, &TOKENS)
        .into_iter()
        .filter(|c| c.world == world)
        .collect();
    let mut vs: Vec<Variant> = all.iter().map(Case::variant).collect();
    vs.sort();
    vs.dedup();
    let ks = kernels(&vs);
    let t_run = Instant::now();
    let mut failures = Vec::new();
    for dtype in Dtype::ALL {
        let max_t = *TOKENS.iter().max().unwrap_or(&1);
        let mut ws =
            HostWorkspace::create(&request(world, dtype, HIDDEN, max_t)).expect("workspace");
        for case in all.iter().filter(|c| c.dtype == dtype) {
            if let Err(e) = run_case(&ks[&case.variant()], &mut ws, case) {
                failures.push(format!("{}: {e}", case.label()));
            }
        }
    }
    println!(
        "W={world}: {} cases ({} variants) in {:.1} s ({:.1} s running), {} failed",
        all.len(),
        vs.len(),
        t0.elapsed().as_secs_f64(),
        t_run.elapsed().as_secs_f64(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn matrix_w2() {
    matrix(2);
}

#[test]
fn matrix_w4() {
    matrix(4);
}

#[test]
fn matrix_w8() {
    matrix(8);
}

/// A random sequence of `steps` calls: T from a set that changes the grid (T < 4 gives
/// fewer CTAs than `MAX_CTAS`) and the token ownership, strategy at random.
fn random_steps(steps: usize, seed: u64) -> Vec<(Strategy, u32)> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let ts = [1u32, 2, 3, 7, 16, 40, 42, 128];
    (0..steps)
        .map(|_| {
            let s = if rng.gen::<bool>() {
                Strategy::OneShot
            } else {
                Strategy::TwoShot
            };
            (s, ts[rng.gen_range(0..ts.len())])
        })
        .collect()
}

fn case_of(
    world: u32,
    dtype: Dtype,
    epilogue: Epilogue,
    strategy: Strategy,
    tokens: u32,
    hidden: u32,
) -> Case {
    let offset = epilogue.norm && !epilogue.residual;
    Case {
        strategy,
        world,
        dtype,
        epilogue,
        tokens,
        hidden,
        weight_bias: u32::from(offset),
        gamma_f32: offset,
        // The Llama order (two roundings) on the residual norms.
        norm_round_twice: epilogue.norm && epilogue.residual,
    }
}

/// Runs `steps` as ONE sequence per rank (no join between calls: a rank may be several
/// calls ahead of another), then checks every call's outputs.
fn skewed_sequence(
    world: u32,
    dtype: Dtype,
    epilogue: Epilogue,
    steps: &[(Strategy, u32)],
    seed: u64,
) -> (Vec<String>, usize) {
    let mut vs: Vec<Variant> = steps
        .iter()
        .map(|&(s, t)| case_of(world, dtype, epilogue, s, t, HIDDEN).variant())
        .collect();
    vs.sort();
    vs.dedup();
    let ks = kernels(&vs);
    // Delays up to 2 ms before every launch of every rank and every CTA, and pauses of
    // CTAs at 1 in 200 stores and fences: the ranks drift apart, and a CTA can stall
    // between any two of its stores.
    let opts = LaunchOptions::skewed(seed, Duration::from_millis(2)).with_chaos(5);
    run_sequence(&ks, world, dtype, epilogue, steps, &opts, 5_000_000_000)
}

/// [`skewed_sequence`] with the kernels given and a polling timeout.
fn run_sequence(
    ks: &HashMap<Variant, Arc<HostKernel>>,
    world: u32,
    dtype: Dtype,
    epilogue: Epilogue,
    steps: &[(Strategy, u32)],
    opts: &LaunchOptions,
    timeout_ns: u64,
) -> (Vec<String>, usize) {
    let seed = opts.seed;
    let cases: Vec<Case> = steps
        .iter()
        .map(|&(s, t)| case_of(world, dtype, epilogue, s, t, HIDDEN))
        .collect();
    let mut ws = HostWorkspace::create(&request(world, dtype, HIDDEN, 128)).expect("workspace");
    let prepared: Vec<(Case, check::Inputs, Vec<RankOutputs>, CaseIo)> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let inputs = check::make_inputs(c, seed ^ i as u64).expect("inputs");
            let want = check::expected(c, &inputs).expect("expected");
            let io = CaseIo::new(c, &inputs).expect("buffers");
            (*c, inputs, want, io)
        })
        .collect();
    let calls: Vec<_> = prepared
        .iter()
        .map(|(c, _, _, io)| {
            let all = Liveness::all(c).expect("liveness");
            cases::fused_launch(&ks[&c.variant()], &ws, io, all, MAX_CTAS, timeout_ns)
                .expect("call")
        })
        .collect();
    let mut bad = Vec::new();
    let mut lead = 0;
    match cases::run_fused_sequence(&mut ws, world, &calls, opts) {
        Ok(trace) => lead = trace.max_lead(),
        Err(e) => bad.push(format!("sequence: {e}")),
    }
    drop(calls);
    for (i, (c, inputs, want, io)) in prepared.iter().enumerate() {
        match io
            .outputs()
            .and_then(|got| check::compare(c, inputs, want, &got))
        {
            Ok(v) if v.passed() => {}
            Ok(v) => bad.push(format!("call {i} ({}): {}", c.label(), v.summary())),
            Err(e) => bad.push(format!("call {i} ({}): {e}", c.label())),
        }
    }
    (bad, lead)
}

#[test]
fn skewed_sequences() {
    let t0 = Instant::now();
    let fp8grp = Epilogue {
        residual: true,
        norm: true,
        quant: Quant::Fp8Group(GroupScaleLayout::PackedUe8m0),
    };
    let nvfp4 = Epilogue {
        residual: false,
        norm: true,
        quant: Quant::Nvfp4Swizzled,
    };
    let runs: [(u32, Dtype, Epilogue, u64); 5] = [
        (2, Dtype::Bf16, Epilogue::RES_NORM, 21),
        (4, Dtype::F16, fp8grp, 22),
        (8, Dtype::Bf16, Epilogue::RES_NORM, 23),
        (8, Dtype::F32, Epilogue::AR_ONLY, 24),
        (4, Dtype::Bf16, nvfp4, 25),
    ];
    let mut failures = Vec::new();
    let mut leads = Vec::new();
    for (world, dtype, e, seed) in runs {
        let steps = random_steps(24, seed);
        let (bad, lead) = skewed_sequence(world, dtype, e, &steps, seed);
        for f in bad {
            failures.push(format!("W={world} {} {}: {f}", dtype.name(), e.name()));
        }
        leads.push(lead);
    }
    println!(
        "skewed sequences: {} runs of 24 calls in {:.1} s; ranks up to {:?} calls apart",
        runs.len(),
        t0.elapsed().as_secs_f64(),
        leads
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The sequences did overlap: some rank started a call while another was still in an
    // earlier one (else this test would only repeat the matrix).
    assert!(
        leads.iter().any(|&l| l >= 1),
        "ranks never drifted: {leads:?}"
    );
}

/// The harness finds the race the one-shot kernel's own comment warns about: clearing
/// the Lamport buffer of call n - 2 ((n + 1) % 3) instead of call n - 1 wipes what a
/// peer that is already one call ahead wrote there, and that call then never completes.
/// A copy of the kernel patched that way must fail a skewed one-shot sequence (timeout
/// or wrong outputs) in at least one of a few attempts; the real kernel passes the same
/// sequences (`skewed_sequences`).
#[test]
fn harness_finds_the_lamport_clearing_race() {
    const ATTEMPTS: u64 = 8;
    let (world, dtype, e) = (4, Dtype::Bf16, Epilogue::RES_NORM);
    let variant = case_of(world, dtype, e, Strategy::OneShot, 1, HIDDEN).variant();
    // Re-fill (and forget) the buffer of call n - 2 instead of call n - 1: the buffer a
    // peer that is one call ahead may already be writing.
    let patched = variants::FUSED_SOURCE
        .replace("st + 2 + (n + 2u) % 3u", "st + 2 + (n + 1u) % 3u")
        .replace(
            "(u64)((s_call + 2u) % 3u) * p.lamport_stride",
            "(u64)((s_call + 1u) % 3u) * p.lamport_stride",
        )
        .replace(
            "st[2 + (call + 2u) % 3u] = 0u;",
            "st[2 + (call + 1u) % 3u] = 0u;",
        );
    assert_eq!(
        patched.matches("+ 1u) % 3u").count(),
        3,
        "the patch no longer applies to kernels/allreduce_fused.cu"
    );
    let k = compiler()
        .kernel_from_source(&variant, Build::Plain, patched)
        .expect("patched kernel builds");
    let racy: HashMap<Variant, Arc<HostKernel>> = [(variant, Arc::new(k))].into_iter().collect();
    let real = kernels(&[variant]);
    let mut caught = None;
    for attempt in 0..ATTEMPTS {
        let steps: Vec<(Strategy, u32)> = random_steps(24, 40 + attempt)
            .into_iter()
            .map(|(_, t)| (Strategy::OneShot, t))
            .collect();
        // Short delays between launches (a rank that finished a call starts the next one
        // soon) and frequent pauses (a CTA stalls in the middle of its clearing).
        let opts = LaunchOptions::skewed(40 + attempt, Duration::from_micros(100)).with_chaos(20);
        // The control: the real kernel passes this very sequence (so a failure below is
        // the patch, not the schedule or a timeout too short for the pauses).
        let (bad, _) = run_sequence(&real, world, dtype, e, &steps, &opts, 2_000_000_000);
        assert!(
            bad.is_empty(),
            "the real kernel failed attempt {attempt}: {}",
            bad.join("; ")
        );
        let (bad, _) = run_sequence(&racy, world, dtype, e, &steps, &opts, 2_000_000_000);
        if !bad.is_empty() {
            caught = Some((attempt, bad));
            break;
        }
    }
    let (attempt, bad) = caught.expect("the patched (racy) kernel passed every skewed sequence");
    println!("race found in attempt {attempt}: {}", bad[0]);
}

/// W - 1 ranks launch, one never does: every waiting rank gives up within the polling
/// timeout and sets the strategy's error bit; the launch returns (no hang).
fn missing_rank(strategy: Strategy, expect_code: u32) {
    let world = 4;
    let case = case_of(world, Dtype::Bf16, Epilogue::RES_NORM, strategy, 16, HIDDEN);
    let ks = kernels(&[case.variant()]);
    let mut ws = HostWorkspace::create(&request(world, case.dtype, HIDDEN, 16)).expect("workspace");
    let inputs = check::make_inputs(&case, 3).expect("inputs");
    let io = CaseIo::new(&case, &inputs).expect("buffers");
    let timeout_ns = 200_000_000;
    let call = cases::fused_launch(
        &ks[&case.variant()],
        &ws,
        &io,
        Liveness::all(&case).unwrap(),
        MAX_CTAS,
        timeout_ns,
    )
    .expect("call");
    let t0 = Instant::now();
    let r = cases::run_fused_sequence(
        &mut ws,
        world - 1,
        &[call],
        &LaunchOptions::skewed(9, MAX_DELAY),
    );
    let took = t0.elapsed();
    println!("{}: {r:?} after {:.2} s", case.label(), took.as_secs_f64());
    match r {
        Err(Error::KernelTimeout(code)) => assert_eq!(code, expect_code, "error word"),
        other => panic!("expected a kernel timeout, got {other:?}"),
    }
    // Bounded: the timeout, plus one clock check every 1024 polls.
    assert!(took < Duration::from_secs(60), "took {took:?}");
    // The error word was cleared by the read.
    assert_eq!(ws.error_word(), 0);
}

#[test]
fn missing_rank_one_shot_times_out() {
    missing_rank(Strategy::OneShot, 1);
}

#[test]
fn missing_rank_two_shot_times_out() {
    missing_rank(Strategy::TwoShot, 2);
}

/// Tokens wider than one vector per thread (H * e / 16 > 1024: several vectors per
/// thread, the last block partly idle) and a hidden size that is not a multiple of
/// 128 (gpt-oss's 2880: 360 vectors, 12 warps).
#[test]
fn wide_tokens() {
    let mut cs = Vec::new();
    for strategy in [Strategy::OneShot, Strategy::TwoShot] {
        for tokens in [1, 7] {
            for (dtype, hidden) in [
                (Dtype::Bf16, 8448),
                (Dtype::F16, 8448),
                (Dtype::F32, 4224),
                (Dtype::Bf16, 2880),
            ] {
                for quant in [
                    Quant::None,
                    Quant::Fp8PerToken,
                    Quant::Fp8Group(GroupScaleLayout::F32RowMajor),
                    Quant::Fp8Group(GroupScaleLayout::F32RowMajorUe8m0),
                    Quant::Nvfp4Linear,
                ] {
                    let e = Epilogue {
                        residual: true,
                        norm: true,
                        quant,
                    };
                    let c = case_of(2, dtype, e, strategy, tokens, hidden);
                    if c.validate().is_ok() {
                        cs.push(c);
                    }
                }
            }
        }
    }
    let mut vs: Vec<Variant> = cs.iter().map(Case::variant).collect();
    vs.sort();
    vs.dedup();
    let ks = kernels(&vs);
    let mut failures = Vec::new();
    let mut wss: HashMap<(Dtype, u32), HostWorkspace> = HashMap::new();
    for c in &cs {
        assert!(
            arfuse_runtime::cuda::block_size(c.hidden, c.dtype).unwrap() > 128 || c.hidden == 2880
        );
        let ws = wss.entry((c.dtype, c.hidden)).or_insert_with(|| {
            HostWorkspace::create(&request(2, c.dtype, c.hidden, 7)).expect("workspace")
        });
        if let Err(e) = run_case(&ks[&c.variant()], ws, c) {
            failures.push(format!("{} H={}: {e}", c.label(), c.hidden));
        }
    }
    println!("wide tokens: {} cases", cs.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The unfused path (virtual-rank all-reduce, then the local kernel in place), for
/// every dtype and every epilogue the pass emits, against the same contract.
#[test]
fn unfused_path() {
    let world = 4;
    let mut cs = Vec::new();
    for dtype in Dtype::ALL {
        for e in variants::all_epilogues() {
            for tokens in [7, 42] {
                let c = case_of(world, dtype, e, Strategy::OneShot, tokens, HIDDEN);
                if c.validate().is_ok() {
                    cs.push(c);
                }
            }
        }
    }
    let mut vs: Vec<Variant> = cs
        .iter()
        .flat_map(|c| {
            [
                Some(variants::virtual_allreduce(world, c.dtype)),
                cases::local_variant(c),
            ]
        })
        .flatten()
        .collect();
    vs.sort();
    vs.dedup();
    let ks = kernels(&vs);
    let mut failures = Vec::new();
    for c in &cs {
        let inputs = check::make_inputs(c, 77).expect("inputs");
        let want = check::expected(c, &inputs).expect("expected");
        let mut io = CaseIo::new(c, &inputs).expect("buffers");
        let ar = &ks[&variants::virtual_allreduce(world, c.dtype)];
        let local = cases::local_variant(c).map(|v| ks[&v].as_ref());
        let opts = LaunchOptions::skewed(seed_of(c, 3), MAX_DELAY);
        match cases::run_unfused(ar, local, &mut io, MAX_CTAS, &opts)
            .and_then(|got| check::compare(c, &inputs, &want, &got))
        {
            Ok(v) if v.passed() => {}
            Ok(v) => failures.push(format!("{}: {}", c.label(), v.summary())),
            Err(e) => failures.push(format!("{}: {e}", c.label())),
        }
    }
    println!("unfused path: {} cases, {} variants", cs.len(), vs.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
