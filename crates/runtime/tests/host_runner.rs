//! The public `Runner` on the host device (`arfuse_runtime::host::HostDevice`): the
//! real kernel sources compiled for the CPU, every rank its own launch stream with
//! seeded random delays and CTA orders, launches queued until `Runner::sync`, checked
//! with the GPU check's inputs and expected outputs, compared bit-exactly
//! (`arfuse_runtime::check`: every output bit-exact against the contract in the
//! kernels' sum order, dead outputs untouched, nothing written past any rank's slice of
//! any output).
//!
//! - `matrix_w2` / `matrix_w4` / `matrix_w8`: every fused pattern x dtype x strategy x
//!   T in {1, 7, 16, 40, 42, 128} at H = 256 (NVFP4 included), each a fused node of its
//!   own (`check::node_for`), the one-shot and two-shot nodes of a (W, dtype) sharing ONE
//!   workspace and alternating call by call; every output live, then only some.
//! - `switching_sequences`: 24 calls with random T and route (one-shot, two-shot,
//!   unfused) on one workspace, queued without a sync between them, so ranks drift
//!   apart across calls (CTAs also pause at random stores); then every call's outputs,
//!   and the workspace left as the protocol says (counter, bookkeeping, every Lamport
//!   byte not holding the last call's data back to the -0.0 sentinel).
//! - `capture_then_replay`: one node with one-shot, two-shot and unfused ranges,
//!   graphs captured per size at both ends of every range, replayed (several times,
//!   and interleaved across sizes) and checked like direct launches.
//! - `missing_rank_*`: W - 1 ranks launch; `Runner::sync` returns an error naming the
//!   node around the kernel's timeout (or, on the unfused path, the collective that
//!   cannot complete), never a hang.
//! - `unfused_route`: every epilogue and dtype through the unfused path (virtual
//!   all-reduce + local kernel), all outputs and only some.

use arfuse_runtime::check::{self, Case, Inputs, Liveness, RankOutputs, FILL_BYTE};
use arfuse_runtime::device::{Allocation, Device, RankTensor};
use arfuse_runtime::host::{Compiler, HostDevice, HostMem, HostOptions, LaunchOptions};
use arfuse_runtime::node::{NodeKernels, Route};
use arfuse_runtime::runner::{NodeTensors, Runner};
use arfuse_runtime::variants::{self, ActDtype, Epilogue, Quant, Strategy};
use arfuse_runtime::Error;
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Hidden size: the smallest H every quant takes (group quant needs H % 128 == 0).
const HIDDEN: u32 = 256;
/// Token counts of the matrix (issue 18).
const TOKENS: [u32; 6] = [1, 7, 16, 40, 42, 128];
/// Largest T of every workspace and tensor here.
const MAX_T: u32 = 128;
/// Bytes after each rank's slice (of the largest call) that no kernel may write.
const GUARD: u64 = 64;

fn compiler() -> Arc<Compiler> {
    static C: OnceLock<Arc<Compiler>> = OnceLock::new();
    C.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("arfuse-host");
        Arc::new(Compiler::new(dir).expect("a C++ compiler (g++, or CXX)"))
    })
    .clone()
}

fn device(opts: HostOptions) -> HostDevice {
    HostDevice::new(compiler(), opts)
}

/// Skewed launches from `seed` (delays up to 300 us), otherwise the defaults.
fn skewed(seed: u64) -> HostOptions {
    HostOptions {
        launch: LaunchOptions::skewed(seed, Duration::from_micros(300)),
        ..HostOptions::default()
    }
}

/// W ranks' slices of one tensor in one allocation at a fixed stride.
struct Strided {
    mem: HostMem,
    stride: u64,
}

impl Strided {
    fn new(dev: &mut HostDevice, world: u32, bytes: u64) -> Strided {
        let stride = bytes.max(16) + GUARD;
        Strided {
            mem: dev.alloc(stride * u64::from(world)).expect("alloc"),
            stride,
        }
    }

    fn tensor(&self, live: bool) -> RankTensor {
        if live {
            RankTensor {
                ptr: self.mem.ptr(),
                rank_stride: self.stride,
            }
        } else {
            RankTensor::default()
        }
    }

    fn upload(&self, dev: &mut HostDevice, per_rank: &[Vec<u8>]) {
        for (r, b) in per_rank.iter().enumerate() {
            dev.upload(&self.mem, r as u64 * self.stride, b)
                .expect("upload");
        }
    }

    /// The first `n` bytes of every rank's slice; an error when a byte after them (up to
    /// the next slice) is no longer FILL_BYTE.
    fn outputs(
        &self,
        dev: &mut HostDevice,
        world: u32,
        n: u64,
        what: &str,
    ) -> Result<Vec<Vec<u8>>, String> {
        let mut all = vec![0u8; (self.stride * u64::from(world)) as usize];
        dev.download(&self.mem, 0, &mut all)
            .map_err(|e| e.to_string())?;
        let (n, stride) = (n as usize, self.stride as usize);
        (0..world as usize)
            .map(|r| {
                let slice = &all[r * stride..(r + 1) * stride];
                if let Some(i) = slice[n..].iter().position(|&b| b != FILL_BYTE) {
                    return Err(format!(
                        "byte {} after rank {r}'s {n}-byte {what} output was written",
                        i
                    ));
                }
                Ok(slice[..n].to_vec())
            })
            .collect()
    }
}

/// The tensors of every call of one (W, dtype): sized for the largest T and quant.
struct Io {
    world: u32,
    x: Strided,
    residual: Strided,
    out: Strided,
    residual_out: Strided,
    quant: Strided,
    scale: Strided,
    gamma: HostMem,
    scale_in: HostMem,
}

impl Io {
    fn new(dev: &mut HostDevice, world: u32, dtype: ActDtype, max_t: u32) -> Io {
        Io::with_hidden(dev, world, dtype, max_t, HIDDEN)
    }

    fn with_hidden(
        dev: &mut HostDevice,
        world: u32,
        dtype: ActDtype,
        max_t: u32,
        hidden: u32,
    ) -> Io {
        let act = u64::from(max_t) * u64::from(hidden) * dtype.element_bytes();
        let (mut q, mut s) = (0, 0);
        for quant in Quant::ALL {
            if let Ok((a, b)) = check::quant_bytes_of(quant, max_t, hidden) {
                q = q.max(a);
                s = s.max(b);
            }
        }
        Io {
            world,
            x: Strided::new(dev, world, act),
            residual: Strided::new(dev, world, act),
            out: Strided::new(dev, world, act),
            residual_out: Strided::new(dev, world, act),
            quant: Strided::new(dev, world, q),
            scale: Strided::new(dev, world, s),
            gamma: dev.alloc(u64::from(hidden) * 4).expect("alloc"),
            scale_in: dev.alloc(4).expect("alloc"),
        }
    }

    fn upload(&self, dev: &mut HostDevice, inputs: &Inputs) {
        self.x.upload(dev, &inputs.x);
        self.residual.upload(dev, &inputs.residual);
        dev.upload(&self.gamma, 0, &inputs.gamma).expect("upload");
        dev.upload(&self.scale_in, 0, &inputs.scale_in.to_le_bytes())
            .expect("upload");
    }

    fn fill_outputs(&self, dev: &mut HostDevice) {
        for s in [&self.out, &self.residual_out, &self.quant, &self.scale] {
            dev.fill(&s.mem, 0, s.mem.bytes(), FILL_BYTE).expect("fill");
        }
    }

    fn tensors(&self, case: &Case, live: Liveness) -> NodeTensors {
        NodeTensors {
            x: self.x.tensor(true),
            residual_in: self.residual.tensor(case.epilogue.residual),
            residual_out: self.residual_out.tensor(live.residual_out),
            out: self.out.tensor(live.out),
            quant_out: self.quant.tensor(live.quant),
            scale_out: self.scale.tensor(live.scale),
            gamma: self.gamma.ptr(),
            scale_in: self.scale_in.ptr(),
        }
    }

    fn outputs(&self, dev: &mut HostDevice, case: &Case) -> Result<Vec<RankOutputs>, String> {
        let b = case.output_bytes().map_err(|e| e.to_string())?;
        let w = self.world;
        let out = self.out.outputs(dev, w, b.out, "norm")?;
        let res = self
            .residual_out
            .outputs(dev, w, b.residual_out, "residual")?;
        let q = self.quant.outputs(dev, w, b.quant, "quant")?;
        let s = self.scale.outputs(dev, w, b.scale, "scale")?;
        Ok((0..w as usize)
            .map(|r| RankOutputs {
                out: out[r].clone(),
                residual_out: res[r].clone(),
                quant: q[r].clone(),
                scale: s[r].clone(),
            })
            .collect())
    }
}

/// One call of `node` through the runner with the outputs of `live` live; returns what
/// every rank wrote.
fn run_call(
    runner: &mut Runner<HostDevice>,
    io: &Io,
    node: &str,
    case: &Case,
    inputs: &Inputs,
    live: Liveness,
) -> Result<Vec<RankOutputs>, String> {
    let dev = runner.device();
    io.upload(dev, inputs);
    io.fill_outputs(dev);
    runner
        .launch(node, case.tokens, &io.tensors(case, live))
        .map_err(|e| e.to_string())?;
    runner.sync().map_err(|e| e.to_string())?;
    io.outputs(runner.device(), case)
}

/// A case all outputs live (against the contract), then only some (against the full
/// run, dead outputs untouched).
fn check_case(
    runner: &mut Runner<HostDevice>,
    io: &Io,
    node: &str,
    case: &Case,
    seed: u64,
) -> Result<(), String> {
    let inputs = check::make_inputs(case, seed).map_err(|e| e.to_string())?;
    let want = check::expected(case, &inputs).map_err(|e| e.to_string())?;
    let all = Liveness::all(case).map_err(|e| e.to_string())?;
    let full = run_call(runner, io, node, case, &inputs, all)?;
    let v = check::compare(case, &inputs, &want, &full).map_err(|e| e.to_string())?;
    if !v.passed() {
        return Err(format!(
            "all outputs: {} (norm up to {} ulp)",
            v.summary(),
            v.max_norm_ulp
        ));
    }
    if let Some(live) = Liveness::partial(case).map_err(|e| e.to_string())? {
        let part = run_call(runner, io, node, case, &inputs, live)?;
        let bad = check::compare_partial(live, &full, &part);
        if bad != 0 {
            return Err(format!("partial outputs: {bad} bytes differ"));
        }
    }
    Ok(())
}

/// Node id of a case's (dtype, pattern, strategy).
fn node_id(c: &Case, route: &str) -> String {
    format!("{}.{}.{route}", c.dtype.name(), c.pattern())
}

/// Every fused case of world size `world`: one node per (dtype, pattern, strategy),
/// all nodes of a dtype on one workspace, cases in `check::cases_for_tokens` order.
fn matrix(world: u32) {
    let t0 = Instant::now();
    let cases: Vec<Case> = check::cases_for_tokens(HIDDEN, true, &TOKENS)
        .into_iter()
        .filter(|c| c.world == world && c.epilogue.norm)
        .collect();
    let mut runner = Runner::new(device(skewed(u64::from(world))));
    let mut added = BTreeMap::new();
    for c in &cases {
        let id = node_id(c, c.strategy.name());
        if added.contains_key(&id) {
            continue;
        }
        let ws = check::workspace_for(world, c.dtype, HIDDEN, MAX_T).expect("workspace");
        let k = check::node_for(c, &id, &ws, &[(1, MAX_T, c.strategy)]).expect("node");
        runner.add(k).expect("add");
        added.insert(id, ());
    }
    let prepared = runner.prepare().expect("prepare");
    assert!(prepared
        .iter()
        .all(|(_, p)| matches!(p, arfuse_runtime::runner::Prepared::Fused(_))));
    assert_eq!(
        runner.workspaces(),
        ActDtype::ALL.len(),
        "one workspace per dtype"
    );
    let t_run = Instant::now();
    let mut failures = Vec::new();
    for dtype in ActDtype::ALL {
        let io = Io::new(runner.device(), world, dtype, MAX_T);
        for c in cases.iter().filter(|c| c.dtype == dtype) {
            let id = node_id(c, c.strategy.name());
            if let Err(e) = check_case(&mut runner, &io, &id, c, 0x5eed ^ u64::from(c.tokens)) {
                failures.push(format!("{}: {e}", c.label()));
            }
        }
    }
    println!(
        "W={world}: {} cases through the runner in {:.1} s ({:.1} s running), {} failed",
        cases.len(),
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

/// A case of W, dtype, epilogue at T with the Llama rounding on residual norms (vLLM's
/// norm of the unrounded f32 sum too, except at W = 4) and the Gemma weight form on the
/// others.
fn case_of(
    world: u32,
    dtype: ActDtype,
    epilogue: Epilogue,
    strategy: Strategy,
    tokens: u32,
) -> Case {
    let offset = !epilogue.residual;
    Case {
        strategy,
        world,
        dtype,
        epilogue,
        tokens,
        hidden: HIDDEN,
        weight_bias: u32::from(offset),
        gamma_f32: offset,
        norm_round_twice: epilogue.residual,
        norm_f32_sum: epilogue.residual && epilogue.norm && world != 4,
    }
}

/// The three nodes of one epilogue on one workspace: one-shot, two-shot and unfused
/// for every T up to MAX_T.
fn three_routes(runner: &mut Runner<HostDevice>, c: &Case) -> [String; 3] {
    let ws = check::workspace_for(c.world, c.dtype, HIDDEN, MAX_T).expect("workspace");
    let ids = [
        node_id(c, "oneshot"),
        node_id(c, "twoshot"),
        node_id(c, "unfused"),
    ];
    for (id, s) in ids
        .iter()
        .zip([Strategy::OneShot, Strategy::TwoShot, Strategy::Unfused])
    {
        runner
            .add(check::node_for(c, id, &ws, &[(1, MAX_T, s)]).expect("node"))
            .expect("add");
    }
    ids
}

/// 24 queued calls with random T and route on one workspace; returns the failures and
/// how far the ranks drifted apart.
fn switching_sequence(
    world: u32,
    dtype: ActDtype,
    epilogue: Epilogue,
    seed: u64,
) -> (Vec<String>, usize) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    // Delays up to 2 ms before every launch of every rank and every CTA, and pauses of
    // CTAs at 1 in 200 stores and fences.
    let opts = HostOptions {
        launch: LaunchOptions::skewed(seed, Duration::from_millis(2)).with_chaos(5),
        ..HostOptions::default()
    };
    let mut runner = Runner::new(device(opts));
    let template = case_of(world, dtype, epilogue, Strategy::OneShot, 1);
    let ids = three_routes(&mut runner, &template);
    runner.prepare().expect("prepare");
    let ts = [1u32, 2, 3, 7, 16, 40, 42, 128];
    // Every call's buffers and inputs first (an upload waits for the queued launches,
    // as on a GPU), then the 24 launches, queued without a sync between them.
    let mut calls = Vec::new();
    for i in 0..24u64 {
        // Mostly fused (the routes that share the protocol state), some unfused.
        let route = match rng.gen_range(0..10) {
            0..=4 => 0,
            5..=8 => 1,
            _ => 2,
        };
        let strategy = if route == 1 {
            Strategy::TwoShot
        } else {
            Strategy::OneShot
        };
        let case = Case {
            strategy,
            tokens: ts[rng.gen_range(0..ts.len())],
            ..template
        };
        let inputs = check::make_inputs(&case, seed ^ i).expect("inputs");
        let want = check::expected(&case, &inputs).expect("expected");
        let io = Io::new(runner.device(), world, dtype, case.tokens);
        io.upload(runner.device(), &inputs);
        io.fill_outputs(runner.device());
        calls.push((route, case, inputs, want, io));
    }
    for (route, case, _, _, io) in &calls {
        let live = Liveness::all(case).expect("liveness");
        let taken = runner
            .launch(&ids[*route], case.tokens, &io.tensors(case, live))
            .expect("launch");
        assert_eq!(matches!(taken, Route::Unfused { .. }), *route == 2);
    }
    let mut bad = Vec::new();
    if let Err(e) = runner.sync() {
        bad.push(format!("sync: {e}"));
    }
    let lead = runner.device().last_run_lead();
    for (i, (route, c, inputs, want, io)) in calls.iter().enumerate() {
        match io
            .outputs(runner.device(), c)
            .and_then(|got| check::compare(c, inputs, want, &got).map_err(|e| e.to_string()))
        {
            Ok(v) if v.passed() => {}
            Ok(v) => bad.push(format!(
                "call {i} ({} via {}): {}",
                c.label(),
                ids[*route],
                v.summary()
            )),
            Err(e) => bad.push(format!("call {i} ({} via {}): {e}", c.label(), ids[*route])),
        }
    }
    let fused: Vec<&Case> = calls.iter().filter(|c| c.0 < 2).map(|c| &c.1).collect();
    if let Err(e) = workspace_is_clean(&mut runner, &ids[0], &fused) {
        bad.push(e);
    }
    (bad, lead)
}

/// After the fused calls `fused` (in order) every rank's workspace holds what the call
/// protocol of `kernels/allreduce_fused.cu` says: the call counter is the number of
/// calls, no CTA is counted as arrived, the last call's buffer records the bytes it
/// wrote and the other two record none, and every Lamport byte except those the last
/// call wrote holds the -0.0 sentinel again (the clearing of call n - 1's buffer left
/// nothing behind under any skew).
fn workspace_is_clean(
    runner: &mut Runner<HostDevice>,
    node: &str,
    fused: &[&Case],
) -> Result<(), String> {
    let Some(last) = fused.last() else {
        return Ok(());
    };
    let k: NodeKernels = runner.kernels(node).expect("node").clone();
    let layout = k.layout().map_err(|e| e.to_string())?;
    let calls = fused.len() as u32;
    let row = u64::from(HIDDEN) * last.dtype.element_bytes();
    let w = u64::from(last.world);
    let used = match last.strategy {
        Strategy::OneShot => w * u64::from(last.tokens) * row,
        Strategy::TwoShot => {
            (w * u64::from(last.tokens).div_ceil(w) + u64::from(last.tokens)) * row
        }
        Strategy::Unfused => return Err("a fused call ran unfused".into()),
    };
    let cur = (calls - 1) % 3;
    let sentinel = last.dtype.sentinel_bits().to_le_bytes();
    let e = last.dtype.element_bytes() as usize;
    let ws = runner.workspace(node).ok_or("no workspace")?.clone();
    for rank in 0..last.world {
        let bytes = runner
            .device()
            .workspace_bytes(&ws, rank)
            .map_err(|e| e.to_string())?;
        let word = |i: usize| u32::from_le_bytes(bytes[i * 4..i * 4 + 4].try_into().unwrap());
        let want_used = |b: u32| if b == cur { used as u32 } else { 0 };
        let state = (word(0), word(1), [word(2), word(3), word(4)]);
        let want = (calls, 0, [want_used(0), want_used(1), want_used(2)]);
        if state != want {
            return Err(format!(
                "rank {rank}: state (counter, arrived, used) {state:?}, want {want:?}"
            ));
        }
        for b in 0..3u64 {
            let start = (layout.lamport_offset + b * layout.lamport_buffer_bytes) as usize;
            let buf = &bytes[start..start + layout.lamport_buffer_bytes as usize];
            let from = if b == u64::from(cur) {
                used as usize
            } else {
                0
            };
            if let Some(i) = buf[from..].chunks(e).position(|c| c != &sentinel[..e]) {
                return Err(format!(
                    "rank {rank}: Lamport buffer {b} byte {} is not the sentinel after {calls} calls",
                    from + i * e
                ));
            }
        }
    }
    Ok(())
}

#[test]
fn switching_sequences() {
    let t0 = Instant::now();
    let fp8grp = Epilogue {
        residual: true,
        norm: true,
        quant: Quant::Fp8Group(arfuse_ir::GroupScaleLayout::PackedUe8m0),
    };
    let nvfp4 = Epilogue {
        residual: false,
        norm: true,
        quant: Quant::Nvfp4(arfuse_runtime::variants::Nvfp4ScaleLayout::Swizzled128x4),
    };
    let runs: [(u32, ActDtype, Epilogue, u64); 4] = [
        (2, ActDtype::Bf16, Epilogue::RES_NORM, 21),
        (4, ActDtype::F16, fp8grp, 22),
        (8, ActDtype::F32, Epilogue::RES_NORM, 23),
        (4, ActDtype::Bf16, nvfp4, 25),
    ];
    let mut failures = Vec::new();
    let mut leads = Vec::new();
    for (world, dtype, e, seed) in runs {
        let (bad, lead) = switching_sequence(world, dtype, e, seed);
        for f in bad {
            failures.push(format!("W={world} {} {}: {f}", dtype.name(), e.name()));
        }
        leads.push(lead);
    }
    println!(
        "switching sequences: {} runs of 24 queued calls in {:.1} s; ranks up to {leads:?} calls apart",
        runs.len(),
        t0.elapsed().as_secs_f64(),
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The calls did overlap: some rank started a call while another was still in an
    // earlier one (else this would only repeat the matrix).
    assert!(
        leads.iter().any(|&l| l >= 1),
        "ranks never drifted: {leads:?}"
    );
}

/// The plan of `capture_then_replay`: one-shot to 16, two-shot to 64, unfused to 128.
const CAPTURE_PLAN: [(u32, u32, Strategy); 3] = [
    (1, 16, Strategy::OneShot),
    (17, 64, Strategy::TwoShot),
    (65, MAX_T, Strategy::Unfused),
];

#[test]
fn capture_then_replay() {
    let t0 = Instant::now();
    let sizes = [1u32, 16, 17, 64, 65, 128];
    let mut failures = Vec::new();
    for (world, dtype, quant) in [
        (8, ActDtype::Bf16, Quant::Fp8PerToken),
        (
            4,
            ActDtype::F16,
            Quant::Nvfp4(arfuse_runtime::variants::Nvfp4ScaleLayout::Swizzled128x4),
        ),
        (2, ActDtype::F32, Quant::None),
    ] {
        let e = Epilogue {
            residual: true,
            norm: true,
            quant,
        };
        let template = case_of(world, dtype, e, Strategy::OneShot, MAX_T);
        let mut runner = Runner::new(device(skewed(31 + u64::from(world))));
        let ws = check::workspace_for(world, dtype, HIDDEN, 64).expect("workspace");
        runner
            .add(check::node_for(&template, "node", &ws, &CAPTURE_PLAN).expect("node"))
            .expect("add");
        runner.prepare().expect("prepare");
        let io = Io::new(runner.device(), world, dtype, MAX_T);
        let all = Liveness::all(&template).expect("liveness");
        let tensors = io.tensors(&template, all);
        let graphs = runner.capture("node", &sizes, &tensors).expect("capture");
        assert_eq!(graphs.sizes(), sizes.to_vec());
        assert_eq!(graphs.node(), "node");
        // Capturing ran nothing: the outputs still hold their fill.
        io.fill_outputs(runner.device());
        runner.sync().expect("sync");
        assert!(io.outputs(runner.device(), &template).is_ok());
        // Interleaved replays of every size first (the protocol state moves on with each
        // fused one), then per size: three replays, and a direct launch, each checked.
        for &t in &sizes {
            runner.replay(&graphs, t).expect("replay");
        }
        runner.sync().expect("interleaved replays");
        for (k, &t) in sizes.iter().enumerate() {
            let case = Case {
                tokens: t,
                ..template
            };
            let inputs = check::make_inputs(&case, 0xa11 ^ u64::from(t)).expect("inputs");
            let want = check::expected(&case, &inputs).expect("expected");
            for mode in ["replayed x3", "direct"] {
                io.upload(runner.device(), &inputs);
                io.fill_outputs(runner.device());
                if mode == "direct" {
                    runner.launch("node", t, &tensors).expect("launch");
                } else {
                    for _ in 0..3 {
                        runner.replay(&graphs, t).expect("replay");
                    }
                }
                let got = runner
                    .sync()
                    .map_err(|e| e.to_string())
                    .and_then(|_| io.outputs(runner.device(), &case))
                    .and_then(|got| {
                        check::compare(&case, &inputs, &want, &got).map_err(|e| e.to_string())
                    });
                match got {
                    Ok(v) if v.passed() => {}
                    Ok(v) => failures.push(format!(
                        "{} {mode}: {} (norm up to {} ulp)",
                        case.label(),
                        v.summary(),
                        v.max_norm_ulp
                    )),
                    Err(e) => failures.push(format!("{} {mode}: {e}", case.label())),
                }
            }
            // The route of each size is the plan's (sizes 2k, 2k+1 are one range's ends).
            let route = runner.kernels("node").unwrap().route(t).unwrap();
            assert_eq!(matches!(route, Route::Unfused { .. }), k >= 4, "T = {t}");
        }
        let e = runner.replay(&graphs, 2).unwrap_err().to_string();
        assert!(e.starts_with("node node:") && e.contains("T = 2"), "{e}");
    }
    println!(
        "capture then replay: 3 nodes x 6 sizes in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// W - 1 ranks launch, rank W - 1 never does: `sync` names the node around the kernel
/// timeout with the strategy's error bit, within the polling timeout (no hang). Then
/// the rank is back: the runner reset the workspace after the timeout, so the next
/// calls give the contract's outputs and leave the workspace as a fresh one would be
/// after them (the call counter counts only the calls since the reset).
fn missing_rank(route: Strategy) -> Error {
    let world = 4;
    let opts = HostOptions {
        timeout_ns: Some(200_000_000),
        absent_rank: Some(world - 1),
        ..skewed(9)
    };
    let mut runner = Runner::new(device(opts));
    let case = case_of(
        world,
        ActDtype::Bf16,
        Epilogue::RES_NORM,
        if route.is_fused() {
            route
        } else {
            Strategy::OneShot
        },
        16,
    );
    let ws = check::workspace_for(world, case.dtype, HIDDEN, 16).expect("workspace");
    runner
        .add(check::node_for(&case, "layers.3.norm", &ws, &[(1, 16, route)]).expect("node"))
        .expect("add");
    runner.prepare().expect("prepare");
    let io = Io::new(runner.device(), world, case.dtype, 16);
    let inputs = check::make_inputs(&case, 3).expect("inputs");
    io.upload(runner.device(), &inputs);
    let t0 = Instant::now();
    runner
        .launch(
            "layers.3.norm",
            16,
            &io.tensors(&case, Liveness::all(&case).unwrap()),
        )
        .expect("a launch is only enqueued");
    let e = runner.sync().expect_err("a rank never arrived");
    let took = t0.elapsed();
    println!("{route:?}: {e} after {:.2} s", took.as_secs_f64());
    // Bounded: the timeout, plus one clock check every 1024 polls.
    assert!(took < Duration::from_secs(60), "took {took:?}");
    // Once reported, the error word is clear.
    runner.sync().expect("the error word was cleared");
    let opts = HostOptions {
        absent_rank: None,
        ..runner.device().options().clone()
    };
    runner.device().set_options(opts).expect("options");
    let mut calls = 0;
    for seed in [4, 5] {
        check_case(&mut runner, &io, "layers.3.norm", &case, seed)
            .unwrap_or_else(|f| panic!("{route:?}: after the timeout, seed {seed}: {f}"));
        calls += 1 + usize::from(Liveness::partial(&case).unwrap().is_some());
    }
    if route.is_fused() {
        let fused = vec![&case; calls];
        workspace_is_clean(&mut runner, "layers.3.norm", &fused)
            .unwrap_or_else(|f| panic!("{route:?}: after the timeout: {f}"));
    }
    e
}

#[test]
fn missing_rank_one_shot_is_an_error_naming_the_node() {
    match missing_rank(Strategy::OneShot) {
        Error::Node { node, source } => {
            assert_eq!(node, "layers.3.norm");
            assert!(matches!(*source, Error::KernelTimeout(1)), "{source}");
        }
        other => panic!("{other}"),
    }
}

#[test]
fn missing_rank_two_shot_is_an_error_naming_the_node() {
    match missing_rank(Strategy::TwoShot) {
        Error::Node { node, source } => {
            assert_eq!(node, "layers.3.norm");
            assert!(matches!(*source, Error::KernelTimeout(2)), "{source}");
        }
        other => panic!("{other}"),
    }
}

#[test]
fn missing_rank_unfused_is_an_error_naming_the_node() {
    let e = missing_rank(Strategy::Unfused);
    let text = e.to_string();
    assert!(
        text.starts_with("node layers.3.norm:") && text.contains("rank 3 is absent"),
        "{text}"
    );
}

/// Every norm epilogue and dtype through the unfused route, all outputs and only some.
#[test]
fn unfused_route() {
    let world = 4;
    let mut runner = Runner::new(device(skewed(77)));
    let mut cases = Vec::new();
    for dtype in ActDtype::ALL {
        let ws = check::workspace_for(world, dtype, HIDDEN, 42).expect("workspace");
        for e in variants::all_epilogues().into_iter().filter(|e| e.norm) {
            let c = case_of(world, dtype, e, Strategy::OneShot, 42);
            if c.validate().is_err() {
                continue;
            }
            let id = node_id(&c, "unfused");
            runner
                .add(check::node_for(&c, &id, &ws, &[(1, 42, Strategy::Unfused)]).expect("node"))
                .expect("add");
            cases.push((id, c));
        }
    }
    runner.prepare().expect("prepare");
    let mut failures = Vec::new();
    let ios: BTreeMap<ActDtype, Io> = ActDtype::ALL
        .iter()
        .map(|&d| (d, Io::new(runner.device(), world, d, 42)))
        .collect();
    for (id, c) in &cases {
        for tokens in [7, 42] {
            let case = Case { tokens, ..*c };
            if let Err(e) = check_case(&mut runner, &ios[&c.dtype], id, &case, 77) {
                failures.push(format!("{}: {e}", case.label()));
            }
        }
    }
    println!("unfused route: {} nodes x 2 T", cases.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// One T written as several fused calls, as the torch op splits a T larger than its
/// workspace holds: each call offsets its rows of the activations and the quant data,
/// and writes rows `scale_row0..scale_row0 + T` of ONE scale tensor of the whole T
/// (`scale_rows`). Every quant with scales at T = 150 in calls of 64, 64 and 22 tokens
/// (W = 2, bf16, H = 1,280; 150 crosses a 128-row NVFP4 tile and is not a multiple of
/// 4, and H gives 10 groups, 3 packed-UE8M0 word columns with a partial last one, and
/// 80 NVFP4 scale columns, so every layout has padding and more than one column),
/// against the contract for the whole T in one call.
#[test]
fn split_calls_write_one_scale_layout() {
    const T: u32 = 150;
    const CHUNK: u32 = 64;
    const H: u32 = 1280;
    let (world, dtype) = (2, ActDtype::Bf16);
    let mut dev = HostDevice::new(compiler(), skewed(150));
    let request = check::workspace_for(world, dtype, H, CHUNK).expect("workspace sizes");
    let ws = dev
        .create_workspace(arfuse_runtime::workspace::Backend::Trtllm, &request)
        .expect("workspace");
    let io = Io::with_hidden(&mut dev, world, dtype, T, H);
    let e = dtype.element_bytes();
    let mut failures = Vec::new();
    for quant in Quant::ALL.into_iter().filter(|q| q.has_scales()) {
        let epilogue = Epilogue {
            residual: true,
            norm: true,
            quant,
        };
        let case = Case {
            hidden: H,
            ..case_of(world, dtype, epilogue, Strategy::OneShot, T)
        };
        let inputs = check::make_inputs(&case, 0x5ca1e).expect("inputs");
        let want = check::expected(&case, &inputs).expect("expected");
        io.upload(&mut dev, &inputs);
        io.fill_outputs(&mut dev);
        let quant_row = check::quant_bytes_of(quant, 1, H).expect("sizes").0;
        let whole = io.tensors(&case, Liveness::all(&case).expect("liveness"));
        let mut start = 0;
        while start < T {
            let t = (T - start).min(CHUNK);
            let at = |r: RankTensor, row_bytes: u64| RankTensor {
                ptr: r.ptr + u64::from(start) * row_bytes,
                ..r
            };
            let act = u64::from(H) * e;
            let strategy = if t <= 16 {
                Strategy::OneShot
            } else {
                Strategy::TwoShot
            };
            let params = arfuse_runtime::device::KernelParams {
                x: at(whole.x, act),
                residual_in: at(whole.residual_in, act),
                residual_out: at(whole.residual_out, act),
                out: at(whole.out, act),
                quant_out: at(whole.quant_out, quant_row),
                scale_out: whole.scale_out,
                scale_row0: start as i32,
                scale_rows: T as i32,
                gamma: whole.gamma,
                scale_in: whole.scale_in,
                eps: check::EPS as f32,
                weight_bias: case.weight_bias as f32,
                gamma_f32: i32::from(case.gamma_f32),
                norm_round_twice: i32::from(case.norm_round_twice),
                norm_f32_sum: i32::from(case.norm_f32_sum),
                ..Default::default()
            };
            let variant = variants::find(
                variants::KernelKind::Fused { strategy, world },
                dtype,
                epilogue,
            )
            .expect("a variant");
            let call = arfuse_runtime::device::FusedCall {
                variant,
                tokens: t,
                hidden: H,
                ranks: world,
                params,
            };
            dev.load(&[variant]).expect("load");
            dev.launch_fused(&ws, &call).expect("launch");
            start += t;
        }
        dev.take_error(&ws).expect("no kernel error");
        let got = match io.outputs(&mut dev, &case) {
            Ok(got) => got,
            Err(e) => {
                failures.push(format!("{quant}: {e}"));
                continue;
            }
        };
        let v = check::compare(&case, &inputs, &want, &got).expect("compare");
        if !v.passed() {
            failures.push(format!("{quant}: {}", v.summary()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
