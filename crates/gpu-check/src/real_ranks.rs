//! The real-rank case (issue 43): W = 2 processes on GPU 0, each one rank of a
//! `SocketGroup`, create a workspace (`IpcWorkspace`: fabric handles for mnnvl where
//! the GPU has them, else CUDA IPC handles) and run a one-shot
//! and a two-shot call (non-cooperative launches of one rank each, as on W GPUs), each
//! rank's outputs against the contract. Two processes share one GPU here, so their
//! kernels run time-sliced, not side by side: a correctness check of the IPC workspace
//! and the per-process protocol, never a timing (that needs W GPUs).

use crate::preflight::{cases, child_lines};
use anyhow::{anyhow, Context};
use arfuse_runtime::check::{self, Case, RankOutputs};
use arfuse_runtime::cuda::ipc::IpcWorkspace;
use arfuse_runtime::cuda::{DeviceBuffer, Gpu};
use arfuse_runtime::device::{FusedCall, KernelParams, RankTensor};
use arfuse_runtime::group::SocketGroup;
use arfuse_runtime::workspace::Backend;
use std::time::Duration;

const WORLD: u32 = 2;

/// The parent: W children meeting at a socket; prints each rank's lines.
pub fn run(hidden: u32) -> anyhow::Result<usize> {
    println!(
        "\nreal ranks: {WORLD} processes on GPU 0 (H = {hidden}; time-sliced, correctness only)"
    );
    let dir = std::env::temp_dir().join(format!("arfuse-gpu-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let sock = dir.join("group.sock");
    let handles: Vec<_> = (0..WORLD)
        .map(|r| {
            let args = vec![
                "--real-rank-child".to_string(),
                format!("{r}:{}", sock.display()),
                "--hidden".to_string(),
                hidden.to_string(),
            ];
            std::thread::spawn(move || child_lines(&args, "REALRANK "))
        })
        .collect();
    let mut failures = 0;
    for (r, h) in handles.into_iter().enumerate() {
        match h.join().map_err(|_| anyhow!("rank thread panicked"))? {
            Ok(lines) => {
                for l in lines {
                    if !l.ends_with(": ok") {
                        failures += 1;
                    }
                    println!("  rank {r}: {l}");
                }
            }
            Err(e) => {
                failures += 1;
                println!("  rank {r}: {e}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(failures)
}

/// One rank, in a child process: prints `REALRANK <case>: <outcome>` per case.
pub fn run_child(spec: &str, hidden: u32) -> anyhow::Result<()> {
    let (rank, sock) = spec
        .split_once(':')
        .with_context(|| format!("--real-rank-child {spec:?}: RANK:SOCKET"))?;
    let rank: u32 = rank.parse()?;
    let mut gpu = Gpu::open(0)?;
    let group = SocketGroup::join(sock.as_ref(), rank, WORLD, Duration::from_secs(120))?;
    let stream = gpu.stream() as usize as u64;
    let request =
        check::workspace_for(WORLD, arfuse_runtime::variants::ActDtype::Bf16, hidden, 64)?;
    // mnnvl (fabric handles) where the GPU has multicast and fabric handles, else
    // trtllm (IPC handles): the ranks vote, and the line says which.
    let chain = [Backend::Mnnvl, Backend::Trtllm];
    let mut ws = IpcWorkspace::create(&gpu, &group, &request, &chain, stream)?;
    println!(
        "REALRANK workspace over {:?} (fabric handles {}): ok",
        ws.backend,
        gpu.info().fabric_handles
    );
    for (i, case) in cases(hidden).iter().enumerate() {
        let cell = match one_call(&mut gpu, &mut ws, case, rank, i as u32, stream) {
            Ok(v) if v.passed() => "ok".to_string(),
            Ok(v) => v.summary(),
            Err(e) => format!("ERROR {e:#}"),
        };
        println!("REALRANK {}: {cell}", case.label());
    }
    Ok(())
}

/// This rank's tensors of `case`: inputs uploaded, outputs zeroed.
struct RankIo {
    x: DeviceBuffer,
    residual: DeviceBuffer,
    out: DeviceBuffer,
    residual_out: DeviceBuffer,
    gamma: DeviceBuffer,
}

fn one_call(
    gpu: &mut Gpu,
    ws: &mut IpcWorkspace,
    case: &Case,
    rank: u32,
    tag: u32,
    stream: u64,
) -> anyhow::Result<check::Verdict> {
    let inputs = check::make_inputs(case, 0x5eed ^ u64::from(case.tokens))?;
    let want = check::expected(case, &inputs)?;
    let bytes = case.output_bytes()?;
    let r = rank as usize;
    let io = RankIo {
        x: gpu.alloc(bytes.out)?,
        residual: gpu.alloc(bytes.out)?,
        out: gpu.alloc(bytes.out)?,
        residual_out: gpu.alloc(bytes.residual_out.max(16))?,
        gamma: gpu.alloc(inputs.gamma.len() as u64)?,
    };
    gpu.upload(&io.x, 0, &inputs.x[r])?;
    gpu.upload(&io.residual, 0, &inputs.residual[r])?;
    gpu.upload(&io.gamma, 0, &inputs.gamma)?;
    let own = |b: &DeviceBuffer| RankTensor {
        ptr: b.ptr(),
        rank_stride: 0,
    };
    let params = KernelParams {
        x: own(&io.x),
        residual_in: own(&io.residual),
        residual_out: own(&io.residual_out),
        out: own(&io.out),
        gamma: io.gamma.ptr(),
        eps: check::EPS as f32,
        norm_round_twice: i32::from(case.norm_round_twice),
        timeout_ns: arfuse_runtime::device::DEFAULT_TIMEOUT_NS,
        call_tag: tag,
        ..KernelParams::default()
    };
    let call = FusedCall {
        variant: case.variant(),
        tokens: case.tokens,
        hidden: case.hidden,
        ranks: case.world,
        params,
    };
    ws.launch(gpu, &call, stream)?;
    ws.take_error(gpu, stream)?;
    let mut got = RankOutputs {
        out: vec![0; bytes.out as usize],
        residual_out: vec![0; bytes.residual_out as usize],
        ..RankOutputs::default()
    };
    gpu.download(&io.out, 0, &mut got.out)?;
    gpu.download(&io.residual_out, 0, &mut got.residual_out)?;
    // Only this rank's outputs count; the other entries are the contract's.
    let mut mine = want.clone();
    mine[r] = got;
    Ok(check::compare(case, &inputs, &want, &mine)?)
}
