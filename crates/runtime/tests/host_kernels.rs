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
//! The fused patterns go through the public `Runner` in `host_runner.rs`; this file
//! keeps what needs the kernels themselves:
//!
//! - `all_reduce_only`: the all-reduce-only variants (no fused node of the IR has this
//!   epilogue; the GPU check's unfused baseline uses them) over every dtype x strategy x
//!   W in {2, 4, 8} x T in {1, 7, 16, 40, 42, 128}, and one long skewed sequence.
//! - `harness_finds_the_lamport_clearing_race`: a copy of the one-shot kernel patched
//!   to clear the wrong Lamport buffer (the race its own comment describes) must fail a
//!   skewed sequence that the real kernel passes.
//! - `sentinel_inputs_never_hang_and_a_float_compare_would`: inputs that are all -0.0
//!   (the Lamport sentinel) or all the smallest negative subnormal, through both
//!   strategies: exact against the contract; a copy of the kernels patched to test the
//!   sentinel with a float compare under flush-to-zero (the public bug) never sees the
//!   subnormals arrive and ends in the kernel's timeout.
//! - `wide_tokens`: H with several 16-byte vectors per thread and partial blocks.
//! - `every_emittable_node_runs_at_every_world_size`: every (W, dtype, quant, strategy)
//!   the planner can emit (W in the ABI's `WORLD_SIZES`, W = 16 included, which the
//!   GPU check's matrix leaves out) has a built variant and runs on the host device.

use arfuse_ir::{GroupScaleLayout, Nvfp4ScaleLayout};
use arfuse_runtime::check::{self, Case, Liveness, RankOutputs};
use arfuse_runtime::host::cases::{self, CaseIo};
use arfuse_runtime::host::{Build, Compiler, HostKernel, HostWorkspace, LaunchOptions};
use arfuse_runtime::variants::{self, ActDtype, Epilogue, Quant, Strategy, Variant};
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

fn request(world: u32, dtype: ActDtype, hidden: u32, max_tokens: u32) -> arfuse_policy::Workspace {
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

/// The all-reduce-only variants: every dtype x strategy x W x T, then one 24-call
/// skewed sequence (W = 8, f32).
#[test]
fn all_reduce_only() {
    let t0 = Instant::now();
    let cases: Vec<Case> = check::cases_for_tokens(HIDDEN, true, &TOKENS)
        .into_iter()
        .filter(|c| c.epilogue == Epilogue::AR_ONLY)
        .collect();
    assert_eq!(cases.len(), 3 * 3 * 2 * TOKENS.len());
    let mut vs: Vec<Variant> = cases.iter().map(Case::variant).collect();
    vs.sort();
    vs.dedup();
    let ks = kernels(&vs);
    let mut failures = Vec::new();
    let mut wss: HashMap<(u32, ActDtype), HostWorkspace> = HashMap::new();
    for c in &cases {
        let ws = wss.entry((c.world, c.dtype)).or_insert_with(|| {
            HostWorkspace::create(&request(c.world, c.dtype, HIDDEN, 128)).expect("workspace")
        });
        if let Err(e) = run_case(&ks[&c.variant()], ws, c) {
            failures.push(format!("{}: {e}", c.label()));
        }
    }
    let steps = random_steps(24, 24);
    let (bad, lead) = skewed_sequence(8, ActDtype::F32, Epilogue::AR_ONLY, &steps, 24);
    failures.extend(bad.into_iter().map(|b| format!("skewed sequence: {b}")));
    println!(
        "all-reduce only: {} cases and a 24-call sequence (ranks up to {lead} calls apart) in {:.1} s",
        cases.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every (W, dtype, quant, strategy) the planner can emit (the ABI's world sizes, its
/// dtypes, every quant a dtype supports, both fused strategies), as a residual + RMSNorm
/// node: the variant is in the matrix and the kernel runs on the host device against
/// the contract at T = 7.
#[test]
fn every_emittable_node_runs_at_every_world_size() {
    let t0 = Instant::now();
    const T: u32 = 7;
    let mut cases = Vec::new();
    for world in arfuse_abi::WORLD_SIZES {
        for dtype in ActDtype::ALL {
            for quant in Quant::ALL.into_iter().filter(|q| q.supports(dtype)) {
                for strategy in Strategy::FUSED {
                    let epilogue = Epilogue {
                        residual: true,
                        norm: true,
                        quant,
                    };
                    let c = case_of(world, dtype, epilogue, strategy, T, HIDDEN);
                    c.validate()
                        .unwrap_or_else(|e| panic!("{}: {e}", c.label()));
                    let v = c.variant();
                    assert_eq!(
                        variants::find(v.kind, v.dtype, v.epilogue),
                        Some(v),
                        "{v} is not built"
                    );
                    cases.push(c);
                }
            }
        }
    }
    // 4 world sizes x (8 + 8 + 6 quants) x 2 strategies.
    assert_eq!(cases.len(), 4 * 22 * 2);
    let mut vs: Vec<Variant> = cases.iter().map(Case::variant).collect();
    vs.sort();
    vs.dedup();
    let ks = kernels(&vs);
    let mut failures = Vec::new();
    let mut wss: HashMap<(u32, ActDtype), HostWorkspace> = HashMap::new();
    for c in &cases {
        let ws = wss.entry((c.world, c.dtype)).or_insert_with(|| {
            HostWorkspace::create(&request(c.world, c.dtype, HIDDEN, T)).expect("workspace")
        });
        if let Err(e) = run_case(&ks[&c.variant()], ws, c) {
            failures.push(format!("{}: {e}", c.label()));
        }
    }
    println!(
        "{} emittable nodes (W up to 16) in {:.1} s",
        cases.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
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
    dtype: ActDtype,
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
        // vLLM's native form (the norm of the unrounded f32 sum) at W = 2, 8, 16.
        norm_f32_sum: epilogue.norm && epilogue.residual && world != 4,
    }
}

/// Runs `steps` as ONE sequence per rank (no join between calls: a rank may be several
/// calls ahead of another), then checks every call's outputs.
fn skewed_sequence(
    world: u32,
    dtype: ActDtype,
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
    run_sequence(
        &ks,
        world,
        dtype,
        epilogue,
        steps,
        &opts,
        5_000_000_000,
        &check_inputs,
    )
}

/// The GPU check's inputs of a case.
fn check_inputs(case: &Case, seed: u64) -> check::Inputs {
    check::make_inputs(case, seed).expect("inputs")
}

/// [`skewed_sequence`] with the kernels given, a polling timeout and the inputs of each
/// call from `make` (case, seed).
#[allow(clippy::too_many_arguments)]
fn run_sequence(
    ks: &HashMap<Variant, Arc<HostKernel>>,
    world: u32,
    dtype: ActDtype,
    epilogue: Epilogue,
    steps: &[(Strategy, u32)],
    opts: &LaunchOptions,
    timeout_ns: u64,
    make: &dyn Fn(&Case, u64) -> check::Inputs,
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
            let inputs = make(c, seed ^ i as u64);
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

/// Runs `attempts` skewed one-shot sequences of `steps` calls with chaos on (short
/// delays between launches, frequent pauses; seeds from `seed`) through the real kernel
/// of `variant` (W = 4, bf16, residual + RMSNorm), which must pass each one (the
/// control: a failure of `patched` is then the patch, not the schedule or a timeout too
/// short for the pauses), and through `patched`: the first attempt `patched` fails, with
/// what failed.
fn first_failing_attempt(
    patched: HostKernel,
    variant: Variant,
    attempts: u64,
    steps: usize,
    seed: u64,
) -> Option<(u64, Vec<String>)> {
    let (world, dtype, e) = (4, ActDtype::Bf16, Epilogue::RES_NORM);
    let patched: HashMap<Variant, Arc<HostKernel>> =
        [(variant, Arc::new(patched))].into_iter().collect();
    let real = kernels(&[variant]);
    for attempt in 0..attempts {
        let calls: Vec<(Strategy, u32)> = random_steps(steps, seed + attempt)
            .into_iter()
            .map(|(_, t)| (Strategy::OneShot, t))
            .collect();
        let opts = LaunchOptions::skewed(seed + attempt, Duration::from_micros(100)).with_chaos(20);
        let run = |ks| {
            run_sequence(
                ks,
                world,
                dtype,
                e,
                &calls,
                &opts,
                2_000_000_000,
                &check_inputs,
            )
            .0
        };
        let bad = run(&real);
        assert!(
            bad.is_empty(),
            "the real kernel failed attempt {attempt}: {}",
            bad.join("; ")
        );
        let bad = run(&patched);
        if !bad.is_empty() {
            return Some((attempt, bad));
        }
    }
    None
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
    let (world, dtype, e) = (4, ActDtype::Bf16, Epilogue::RES_NORM);
    let variant = case_of(world, dtype, e, Strategy::OneShot, 1, HIDDEN).variant();
    // Re-fill (and forget) the buffer of call n - 2 instead of call n - 1: the buffer a
    // peer that is one call ahead may already be writing.
    let patched = variants::FUSED_SOURCE
        .replace(
            "ARF_STATE_USED + (n + ARF_NBUF - 1u) % ARF_NBUF",
            "ARF_STATE_USED + (n + 1u) % ARF_NBUF",
        )
        .replace(
            "(u64)((s_call + ARF_NBUF - 1u) % ARF_NBUF) * p.lamport_stride",
            "(u64)((s_call + 1u) % ARF_NBUF) * p.lamport_stride",
        )
        .replace(
            "st[ARF_STATE_USED + (call + ARF_NBUF - 1u) % ARF_NBUF] = 0u;",
            "st[ARF_STATE_USED + (call + 1u) % ARF_NBUF] = 0u;",
        );
    assert_eq!(
        patched.matches("+ 1u) % ARF_NBUF").count(),
        3,
        "the patch no longer applies to kernels/allreduce_fused.cu"
    );
    let k = compiler()
        .kernel_from_source(&variant, Build::Plain, patched)
        .expect("patched kernel builds");
    // Short delays between launches (a rank that finished a call starts the next one
    // soon) and frequent pauses (a CTA stalls in the middle of its clearing).
    let caught = first_failing_attempt(k, variant, ATTEMPTS, 24, 40);
    let (attempt, bad) = caught.expect("the patched (racy) kernel passed every skewed sequence");
    println!("race found in attempt {attempt}: {}", bad[0]);
}

/// The harness finds a readiness test that looks at one word of a 16-byte vector: with
/// chaos on, the host device's vector stores tear (their four words land in a random
/// order with pauses between them, as PTX allows), so a poll that sees the first word
/// written reads the others before they land. A copy of the kernel patched that way
/// must fail a skewed sequence with chaos; the real kernel passes the same sequence.
#[test]
fn harness_finds_a_readiness_test_of_one_word() {
    const ATTEMPTS: u64 = 4;
    let (world, dtype, e) = (4, ActDtype::Bf16, Epilogue::RES_NORM);
    let variant = case_of(world, dtype, e, Strategy::OneShot, 1, HIDDEN).variant();
    let common = variants::COMMON_HEADER.replace(
        "return arf_word_ready(v.x) && arf_word_ready(v.y) && arf_word_ready(v.z) && arf_word_ready(v.w);",
        "return arf_word_ready(v.x);",
    );
    assert_ne!(
        common,
        variants::COMMON_HEADER,
        "the patch no longer applies to kernels/arfuse_common.cuh"
    );
    let patched = variants::FUSED_SOURCE.replace("#include \"arfuse_common.cuh\"", &common);
    let k = compiler()
        .kernel_from_source(&variant, Build::Plain, patched)
        .expect("patched kernel builds");
    let caught = first_failing_attempt(k, variant, ATTEMPTS, 12, 70);
    let (attempt, bad) = caught.expect("the one-word readiness test passed every torn sequence");
    println!("one-word readiness caught in attempt {attempt}: {}", bad[0]);
}

/// Inputs whose every x element is `bits` on every rank (the residual and weight as
/// the GPU check makes them).
fn uniform_inputs(case: &Case, seed: u64, bits: u32) -> check::Inputs {
    let mut inputs = check_inputs(case, seed);
    let e = case.dtype.element_bytes() as usize;
    for x in &mut inputs.x {
        for el in x.chunks_exact_mut(e) {
            el.copy_from_slice(&bits.to_le_bytes()[..e]);
        }
    }
    inputs
}

/// The sequence of `sentinel_inputs_never_hang_and_a_float_compare_would`: both
/// strategies, with every x element -0.0 (even calls) or the smallest negative
/// subnormal (odd calls).
const SENTINEL_STEPS: [(Strategy, u32); 6] = [
    (Strategy::OneShot, 4),
    (Strategy::OneShot, 4),
    (Strategy::TwoShot, 4),
    (Strategy::TwoShot, 7),
    (Strategy::OneShot, 7),
    (Strategy::TwoShot, 3),
];

fn sentinel_inputs(case: &Case, seed: u64) -> check::Inputs {
    let sentinel = case.dtype.sentinel_bits();
    // seed ^ i: the call index is the low bit of the seed's xor (the seed is even).
    let bits = if seed & 1 == 0 {
        sentinel
    } else {
        sentinel + 1
    };
    uniform_inputs(case, seed, bits)
}

/// -0.0 is the Lamport "empty" value, tested bitwise; a -0.0 input is sent as +0.0, and
/// a negative subnormal (the sentinel's bits plus one) is data. With every element of
/// x one of them, both strategies complete and the all-reduce is exact: W x -0.0 gives
/// +0.0, W x the smallest negative subnormal gives W times it (bits sentinel + W). The
/// public bug tested the sentinel with a float compare under flush-to-zero, which takes
/// a negative subnormal for -0.0: a copy of the kernels patched to test it that way
/// (bf16: sign set and exponent zero) waits for data that never arrives and ends with
/// the kernel's error word instead of hanging.
#[test]
fn sentinel_inputs_never_hang_and_a_float_compare_would() {
    let world = 4;
    let e = Epilogue::AR_ONLY;
    for dtype in ActDtype::ALL {
        let vs: Vec<Variant> = [Strategy::OneShot, Strategy::TwoShot]
            .iter()
            .map(|&s| case_of(world, dtype, e, s, 1, HIDDEN).variant())
            .collect();
        let ks = kernels(&vs);
        let opts = LaunchOptions::skewed(60, MAX_DELAY);
        let (bad, _) = run_sequence(
            &ks,
            world,
            dtype,
            e,
            &SENTINEL_STEPS,
            &opts,
            2_000_000_000,
            &sentinel_inputs,
        );
        assert!(bad.is_empty(), "{}: {}", dtype.name(), bad.join("; "));
        // The expected values themselves (the contract's, which the run matched).
        let sentinel = dtype.sentinel_bits();
        for (i, &(s, t)) in SENTINEL_STEPS.iter().enumerate() {
            let c = case_of(world, dtype, e, s, t, HIDDEN);
            let want = check::expected(&c, &sentinel_inputs(&c, 60 ^ i as u64)).unwrap();
            let got = check::decode(dtype, &want[0].out);
            let bits = if i % 2 == 0 { 0 } else { sentinel + world };
            let as_bits = |v: f32| match dtype {
                ActDtype::Bf16 => u32::from(half::bf16::from_f32(v).to_bits()),
                ActDtype::F16 => u32::from(half::f16::from_f32(v).to_bits()),
                ActDtype::F32 => v.to_bits(),
            };
            assert!(
                got.iter().all(|v| as_bits(*v) == bits),
                "{} call {i}",
                dtype.name()
            );
        }
    }
    // The float compare under FTZ, patched into the poll of a bf16 copy of the kernels.
    let dtype = ActDtype::Bf16;
    let ftz = r"
// Fault injection (test only): an element is 'empty' when a float compare under
// flush-to-zero says it is -0.0: sign set, exponent zero (a negative subnormal too).
__device__ __forceinline__ bool arf_ftz_word_ready(u32 w) {
  return (w & 0xff80u) != 0x8000u && ((w >> 16) & 0xff80u) != 0x8000u;
}
__device__ __forceinline__ bool arf_ftz_vec_ready(const uint4 v) {
  return arf_ftz_word_ready(v.x) && arf_ftz_word_ready(v.y) && arf_ftz_word_ready(v.z) &&
         arf_ftz_word_ready(v.w);
}
";
    let include = "#include \"arfuse_common.cuh\"\n";
    assert_eq!(variants::FUSED_SOURCE.matches(include).count(), 1);
    // Both polls: a vector's (arf_poll_vec) and the batched slots' (arf_reduce_slots).
    assert_eq!(
        variants::FUSED_SOURCE.matches("!arf_vec_ready(d").count(),
        2
    );
    let patched = variants::FUSED_SOURCE
        .replace(include, &format!("{include}{ftz}"))
        .replace("!arf_vec_ready(d", "!arf_ftz_vec_ready(d");
    let mut racy = HashMap::new();
    for s in [Strategy::OneShot, Strategy::TwoShot] {
        let v = case_of(world, dtype, e, s, 1, HIDDEN).variant();
        let k = compiler()
            .kernel_from_source(&v, Build::Plain, patched.clone())
            .expect("patched kernel builds");
        racy.insert(v, Arc::new(k));
    }
    // -0.0 alone passes the patched test too; the negative subnormals do not.
    let opts = LaunchOptions::skewed(60, MAX_DELAY);
    let t0 = Instant::now();
    let (bad, _) = run_sequence(
        &racy,
        world,
        dtype,
        e,
        &SENTINEL_STEPS[..1],
        &opts,
        300_000_000,
        &sentinel_inputs,
    );
    assert!(bad.is_empty(), "{}", bad.join("; "));
    let (bad, _) = run_sequence(
        &racy,
        world,
        dtype,
        e,
        &SENTINEL_STEPS[..2],
        &opts,
        300_000_000,
        &sentinel_inputs,
    );
    println!(
        "FTZ compare: {} after {:.2} s",
        bad.join("; "),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        bad.first()
            .is_some_and(|b| b.contains("kernel protocol timeout (error word 0x1)")),
        "{bad:?}"
    );
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
                (ActDtype::Bf16, 8448),
                (ActDtype::F16, 8448),
                (ActDtype::F32, 4224),
                (ActDtype::Bf16, 2880),
            ] {
                for quant in [
                    Quant::None,
                    Quant::Fp8PerToken,
                    Quant::Fp8Group(GroupScaleLayout::F32RowMajor),
                    Quant::Fp8Group(GroupScaleLayout::F32RowMajorUe8m0),
                    Quant::Nvfp4(Nvfp4ScaleLayout::Linear),
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
    let mut wss: HashMap<(ActDtype, u32), HostWorkspace> = HashMap::new();
    for c in &cs {
        assert!(
            arfuse_runtime::device::block_size(c.hidden, c.dtype).unwrap() > 128
                || c.hidden == 2880
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
