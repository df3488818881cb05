//! Real ranks on the host device (issue 43): W = 2 and W = 4 processes, each one rank of
//! a [`SocketGroup`], create a workspace in shared memory collectively and run the
//! fused kernels over it, every rank's outputs compared bit for bit with the reference
//! contract; and the faults, each of which must end in its error on every surviving
//! rank within a bound, never a hang or a wrong result:
//! - an allocation that fails on one rank;
//! - a rank that calls with another T;
//! - a rank that skips a call;
//! - a rank killed in the middle of a call;
//! - a rank late past the polling timeout, then a correct call after the reset.
//!
//! The test binary runs itself once per rank (`ARFUSE_RANK_CHILD` names the scenario,
//! the rank, W and the socket); the parent waits for every child with a deadline and
//! kills them past it, so a hang is a failure, not a stuck CI job. Each child prints one
//! `OUTCOME` line per call.

use arfuse_runtime::check::{self, Case, Liveness};
use arfuse_runtime::device::{FusedCall, RankTensor};
use arfuse_runtime::group::SocketGroup;
use arfuse_runtime::host::cases::CaseIo;
use arfuse_runtime::host::{Build, Compiler, LaunchOptions, RankOptions, RankWorkspace};
use arfuse_runtime::variants::{ActDtype, Epilogue, Quant, Strategy};
use arfuse_runtime::workspace::Backend;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const HIDDEN: u32 = 256;
const MAX_TOKENS: u32 = 16;
const CHILD_ENV: &str = "ARFUSE_RANK_CHILD";
/// A child that has not finished by then is killed and the scenario fails.
const DEADLINE: Duration = Duration::from_secs(120);

fn compiler() -> Compiler {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("arfuse-host");
    Compiler::new(dir).expect("a C++ compiler (g++, or CXX)")
}

fn case(world: u32, strategy: Strategy, tokens: u32, quant: Quant) -> Case {
    Case {
        strategy,
        world,
        dtype: ActDtype::Bf16,
        epilogue: Epilogue {
            residual: true,
            norm: true,
            quant,
        },
        tokens,
        hidden: HIDDEN,
        weight_bias: 0,
        gamma_f32: false,
        norm_round_twice: true,
        norm_f32_sum: false,
    }
}

/// One rank's part of a call of `case`: its inputs (all ranks' inputs made from one
/// seed, as every rank can), its tensors, the launch; `Ok(true)` when its outputs are
/// the contract's ([`check::compare`]).
fn call(
    ws: &mut RankWorkspace,
    compiler: &Compiler,
    case: &Case,
    seed: u64,
    tag: u32,
    timeout: Duration,
    chaos: u32,
) -> Result<bool, String> {
    let rank = ws.rank() as usize;
    let inputs = check::make_inputs(case, seed).map_err(|e| e.to_string())?;
    let want = check::expected(case, &inputs).map_err(|e| e.to_string())?;
    let io = CaseIo::new(case, &inputs).map_err(|e| e.to_string())?;
    let mut p = io.params(Liveness::all(case).map_err(|e| e.to_string())?);
    for t in [
        &mut p.x,
        &mut p.residual_in,
        &mut p.residual_out,
        &mut p.out,
        &mut p.quant_out,
        &mut p.scale_out,
    ] {
        if t.ptr != 0 {
            *t = RankTensor {
                ptr: t.ptr + rank as u64 * t.rank_stride,
                rank_stride: 0,
            };
        }
    }
    p.timeout_ns = timeout.as_nanos() as u64;
    p.call_tag = tag;
    let c = FusedCall {
        variant: case.variant(),
        tokens: case.tokens,
        hidden: case.hidden,
        ranks: case.world,
        params: p,
    };
    let kernel = compiler
        .kernel(&case.variant(), Build::Plain)
        .map_err(|e| e.to_string())?;
    let opts = LaunchOptions::skewed(seed ^ 0x5eed, Duration::from_micros(200)).with_chaos(chaos);
    // SAFETY: every tensor address is this rank's slot of `io`, alive until the end.
    unsafe { ws.launch(&kernel, &c, 4, &opts) }.map_err(|e| e.to_string())?;
    let got = io.outputs().map_err(|e| e.to_string())?;
    // Judged by the GPU check's comparison (every clause of the contract, bit for bit);
    // only this rank's outputs count, the other slots are the peers' processes'.
    let mut mine = want.clone();
    mine[rank] = got[rank].clone();
    let v = check::compare(case, &inputs, &want, &mine).map_err(|e| e.to_string())?;
    if !v.passed() {
        eprintln!("rank {rank}, {}: {}", case.label(), v.summary());
    }
    Ok(v.passed())
}

/// What a child does, by scenario. Prints `OUTCOME <rank> <what>` lines.
fn child(spec: &str) {
    let parts: Vec<&str> = spec.split(':').collect();
    let (scenario, rank, world, sock) = (
        parts[0],
        parts[1].parse::<u32>().unwrap(),
        parts[2].parse::<u32>().unwrap(),
        PathBuf::from(parts[3]),
    );
    let say = |what: String| println!("OUTCOME {rank} {what}");
    let group = match SocketGroup::join(&sock, rank, world, Duration::from_secs(20)) {
        Ok(g) => g,
        Err(e) => return say(format!("join: {e}")),
    };
    let compiler = compiler();
    let request = check::workspace_for(world, ActDtype::Bf16, HIDDEN, MAX_TOKENS).unwrap();
    let mut opts = RankOptions::default();
    if scenario == "alloc" && rank == 1 {
        opts = opts.with_max_bytes(Some(4096));
    }
    let chain = [Backend::Mnnvl, Backend::Trtllm];
    if scenario == "vote" && rank == world - 1 {
        opts = opts.with_backends(true, false);
    }
    let mut ws = match RankWorkspace::create(&group, &request, &chain, &opts) {
        Ok(ws) => ws,
        Err(e) => return say(format!("create: {e}")),
    };
    say(format!("backend {}", ws.backend));
    let timeout = if scenario == "late" {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(5)
    };
    let plain = Quant::None;
    // (strategy, T, quant, tag) of the calls every rank makes, in order.
    let mut calls = vec![
        (Strategy::OneShot, 3, plain, 0),
        (Strategy::TwoShot, 16, Quant::Fp8PerToken, 1),
        (Strategy::OneShot, 1, plain, 2),
        (Strategy::TwoShot, 5, plain, 3),
    ];
    match scenario {
        "tokens" if rank == 1 => calls[1].1 = 15,
        "skip" if rank == 1 => {
            calls.remove(1);
        }
        _ => {}
    }
    for &(strategy, tokens, quant, _) in &calls {
        let v = case(world, strategy, tokens, quant).variant();
        if let Err(e) = compiler.kernel(&v, Build::Plain) {
            return say(format!("compile: {e}"));
        }
    }
    if scenario == "kill" && rank == 1 {
        // Killed mid-call: the kernel's CTAs are inside the call when SIGKILL comes.
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(30));
            // SAFETY: kill(2) of this process.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        });
    }
    // The rank to be killed pauses at half its stores, so that its calls outlast 30 ms.
    let chaos = if scenario == "kill" && rank == 1 {
        500
    } else {
        20
    };
    for (i, &(strategy, tokens, quant, tag)) in calls.iter().enumerate() {
        if scenario == "late" && rank == 1 && i == 1 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        let c = case(world, strategy, tokens, quant);
        let started = Instant::now();
        match call(&mut ws, &compiler, &c, 1000 + i as u64, tag, timeout, chaos) {
            Ok(true) => say(format!("call {i} ok")),
            Ok(false) => say(format!("call {i} WRONG OUTPUT")),
            Err(e) => {
                say(format!("call {i} error after {:?}: {e}", started.elapsed()));
                match ws.reset(&group) {
                    Ok(()) => say("reset ok".into()),
                    Err(e) => {
                        say(format!("reset error: {e}"));
                        return;
                    }
                }
                if scenario == "late" || scenario == "tokens" || scenario == "skip" {
                    // After the collective reset, the same call on every rank is correct.
                    let c = case(world, Strategy::OneShot, 4, plain);
                    match call(&mut ws, &compiler, &c, 77, 9, timeout, 20) {
                        Ok(true) => say("after reset ok".into()),
                        Ok(false) => say("after reset WRONG OUTPUT".into()),
                        Err(e) => say(format!("after reset error: {e}")),
                    }
                }
                return;
            }
        }
    }
}

/// Runs `scenario` on `world` processes; returns each rank's outcome lines (a killed
/// rank's may be cut short).
fn run(scenario: &str, world: u32) -> Vec<Vec<String>> {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "real-ranks-{}-{scenario}-{world}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("g.sock");
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..world)
        .map(|r| {
            Command::new(&exe)
                .env(
                    CHILD_ENV,
                    format!("{scenario}:{r}:{world}:{}", sock.display()),
                )
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap()
        })
        .collect();
    let start = Instant::now();
    loop {
        let done = children
            .iter_mut()
            .all(|c| c.try_wait().map(|s| s.is_some()).unwrap_or(true));
        if done {
            break;
        }
        if start.elapsed() > DEADLINE {
            for c in &mut children {
                let _ = c.kill();
            }
            panic!("{scenario} at W = {world}: a rank hangs past {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = children
        .into_iter()
        .map(|c| {
            let o = c.wait_with_output().unwrap();
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| l.strip_prefix("OUTCOME "))
                .map(|l| {
                    l.split_once(' ')
                        .map(|(_, w)| w.to_string())
                        .unwrap_or_default()
                })
                .collect()
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "{scenario} W = {world}: {:.1} s, {out:?}",
        start.elapsed().as_secs_f64()
    );
    out
}

fn expect(cond: bool, what: &str, out: &[Vec<String>], failures: &mut Vec<String>) {
    if !cond {
        failures.push(format!("{what}: {out:#?}"));
    }
}

fn has(lines: &[String], pat: &str) -> bool {
    lines.iter().any(|l| l.contains(pat))
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child(&spec);
        return;
    }
    // `cargo test` passes filters and flags; this suite runs whole, or not at all when
    // a filter names something else.
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if !filters.is_empty() && !filters.iter().any(|f| "real_ranks".contains(f.as_str())) {
        return;
    }
    let mut failures = Vec::new();
    for world in [2, 4] {
        let out = run("ok", world);
        let ok = out
            .iter()
            .all(|r| (0..4).all(|i| has(r, &format!("call {i} ok"))) && has(r, "backend mnnvl"));
        expect(
            ok,
            &format!("W = {world}: every call correct on every rank"),
            &out,
            &mut failures,
        );

        let out = run("alloc", world);
        expect(
            out.iter().all(|r| {
                r.len() == 1
                    && r[0].contains("create: rank 1 failed in allocation: the workspace needs")
            }),
            &format!("W = {world}: rank 1's allocation fails on every rank"),
            &out,
            &mut failures,
        );

        let out = run("vote", world);
        expect(
            out.iter()
                .all(|r| has(r, "backend trtllm") && has(r, "call 3 ok")),
            &format!("W = {world}: the weakest rank's backend wins"),
            &out,
            &mut failures,
        );

        for scenario in ["tokens", "skip", "late"] {
            let out = run(scenario, world);
            let ended = out.iter().all(|r| {
                has(r, "call 0 ok")
                    && r.iter().any(|l| l.starts_with("call 1 error"))
                    && has(r, "reset ok")
                    && has(r, "after reset ok")
                    && !r.iter().any(|l| l.contains("WRONG"))
            });
            expect(
                ended,
                &format!(
                    "W = {world}: {scenario}: call 1 fails on every rank, then a correct call"
                ),
                &out,
                &mut failures,
            );
            if scenario != "late" {
                expect(
                    out.iter().all(|r| has(r, "ranks disagree on the call")),
                    &format!("W = {world}: {scenario}: the mismatch is named"),
                    &out,
                    &mut failures,
                );
            }
        }

        let out = run("kill", world);
        let survivors_ok = out
            .iter()
            .enumerate()
            .filter(|(r, _)| *r != 1)
            .all(|(_, r)| {
                r.iter().any(|l| l.contains(" error after "))
                    && has(r, "reset error")
                    && !r.iter().any(|l| l.contains("WRONG"))
            });
        expect(
            survivors_ok && !has(&out[1], "call 3 ok"),
            &format!("W = {world}: a rank killed mid-call: an error on every survivor"),
            &out,
            &mut failures,
        );
    }
    if !failures.is_empty() {
        eprintln!("{}", failures.join("\n\n"));
        std::process::exit(1);
    }
    println!("real_ranks: every scenario passed");
}
