//! The timings of the GPU check (CUDA only; the host device's times say nothing about
//! a GPU): what the first GPU run must answer about the kernels' speed.
//!
//! 1. A device-to-device copy of 1 GiB: the bandwidth every other figure is set
//!    against.
//! 2. Latency: per-call microseconds at T = 1, 2, 4, 8 of the fused call (residual +
//!    RMSNorm), one-shot and two-shot, with programmatic dependent launch (PDL) on and
//!    off, next to the unfused pair (arfuse's all-reduce-only kernel, then the local
//!    epilogue kernel).
//! 3. Bandwidth: T = 256, 1024, 4096 for every timed epilogue, achieved GB/s over the
//!    bytes the algorithm moves (`check::bytes_moved`) and over the fewest bytes any
//!    algorithm must move (`check::minimum_bytes`), each as a fraction of the copy.
//!
//! Every time is the median over 20 replays of a CUDA graph holding
//! `--calls-per-graph` calls, divided by that count.

use crate::{fused_call, median, params, rank_tensor, upload_inputs, Args, Io};
use arfuse_runtime::check::{self, Case, Liveness};
use arfuse_runtime::cuda::{DeviceBuffer, Gpu, VirtualWorkspace};
use arfuse_runtime::device::{Device, FusedCall, RankTensor};
use arfuse_runtime::variants::{ActDtype, Epilogue, KernelKind, Quant, Strategy, Variant};
use arfuse_runtime::workspace::Backend;

/// Token counts of the latency table.
const LATENCY_TOKENS: [u32; 4] = [1, 2, 4, 8];
/// Token counts of the bandwidth table.
const BANDWIDTH_TOKENS: [u32; 3] = [256, 1024, 4096];

/// The timings: copy bandwidth, latency table, bandwidth table, the workspace used.
///
/// # Errors
/// Driver errors, a kernel timeout, cases the kernels refuse.
pub fn run(gpu: &mut Gpu, args: &Args) -> anyhow::Result<()> {
    let copy_gbs = copy_bandwidth(gpu)?;
    println!("\ndevice-to-device copy: {copy_gbs:.0} GB/s (1 GiB, read + write)");
    let rig = Rig::new(gpu, args)?;
    println!(
        "W = {}, H = {}, bf16, per call replayed from a CUDA graph of {} calls (median of 20)",
        rig.world, rig.hidden, args.calls_per_graph
    );
    latency_table(gpu, &rig, args)?;
    bandwidth_table(gpu, &rig, args, copy_gbs)?;
    gpu.set_pdl(true);
    println!(
        "workspace: {} bytes allocated for {w} virtual ranks = {w} x {} (layout per rank), nothing more",
        rig.ws.memory.bytes(),
        rig.ws.layout.bytes_per_rank,
        w = rig.world
    );
    Ok(())
}

/// GB/s of a 1 GiB device-to-device copy (read + write counted), median of 10.
fn copy_bandwidth(gpu: &mut Gpu) -> anyhow::Result<f64> {
    let big = 1u64 << 30;
    let (src, dst) = (gpu.alloc(big)?, gpu.alloc(big)?);
    gpu.copy_d2d(&dst, &src, big)?;
    gpu.sync()?;
    let mut copy = Vec::new();
    for _ in 0..10 {
        copy.push(f64::from(gpu.time_ms(|g| g.copy_d2d(&dst, &src, big))?));
    }
    Ok(2.0 * big as f64 / (median(copy) * 1e-3) / 1e9)
}

/// What every timed call shares: one workspace for the largest T, the tensors, the
/// loaded kernels.
struct Rig {
    world: u32,
    hidden: u32,
    dtype: ActDtype,
    quants: Vec<Quant>,
    ws: VirtualWorkspace,
    io: Io<DeviceBuffer>,
}

impl Rig {
    fn new(gpu: &mut Gpu, args: &Args) -> anyhow::Result<Rig> {
        let (world, hidden, dtype) = (args.timing_world, args.hidden, ActDtype::Bf16);
        let max_t = BANDWIDTH_TOKENS[BANDWIDTH_TOKENS.len() - 1];
        let ws = gpu.create_workspace(
            Backend::Trtllm,
            &check::workspace_for(world, dtype, hidden, max_t)?,
        )?;
        let io = Io::new(gpu, world, dtype, hidden, max_t)?;
        let mut quants = vec![Quant::None, Quant::Fp8PerToken];
        if gpu.info().sm >= 100 {
            quants.push(Quant::Nvfp4(
                arfuse_runtime::variants::Nvfp4ScaleLayout::Swizzled128x4,
            ));
        }
        let rig = Rig {
            world,
            hidden,
            dtype,
            quants,
            ws,
            io,
        };
        gpu.load(&rig.variants())?;
        Ok(rig)
    }

    /// The residual + RMSNorm epilogue with `quant`.
    fn epilogue(quant: Quant) -> Epilogue {
        Epilogue {
            residual: true,
            norm: true,
            quant,
        }
    }

    /// Every kernel a timed call launches: the fused variants of both strategies (with
    /// the epilogue and all-reduce only) and the local epilogue kernels.
    fn variants(&self) -> Vec<Variant> {
        let mut v = Vec::new();
        for &q in &self.quants {
            let e = Rig::epilogue(q);
            for s in [Strategy::OneShot, Strategy::TwoShot] {
                for ep in [e, Epilogue::AR_ONLY] {
                    v.push(self.fused_variant(s, ep));
                }
            }
            v.push(Variant {
                kind: KernelKind::Local,
                dtype: self.dtype,
                epilogue: e,
            });
        }
        v
    }

    fn fused_variant(&self, strategy: Strategy, epilogue: Epilogue) -> Variant {
        Variant {
            kind: KernelKind::Fused {
                strategy,
                world: self.world,
            },
            dtype: self.dtype,
            epilogue,
        }
    }

    fn case(&self, strategy: Strategy, quant: Quant, tokens: u32) -> Case {
        Case {
            strategy,
            world: self.world,
            dtype: self.dtype,
            epilogue: Rig::epilogue(quant),
            tokens,
            hidden: self.hidden,
            weight_bias: 0,
            gamma_f32: false,
            norm_round_twice: false,
            norm_f32_sum: false,
        }
    }

    /// The fused call of `case` and its unfused pair: the all-reduce-only kernel of
    /// the same strategy into `ar_out`, then the local kernel reading it.
    fn calls(&self, case: &Case) -> anyhow::Result<(FusedCall, FusedCall, FusedCall)> {
        let p = params(&self.io, case, Liveness::all(case)?)?;
        let b = case.output_bytes()?;
        let ar_p = arfuse_runtime::device::KernelParams {
            residual_in: RankTensor::default(),
            residual_out: RankTensor::default(),
            quant_out: RankTensor::default(),
            scale_out: RankTensor::default(),
            out: rank_tensor(&self.io.ar_out, b.out, true),
            ..p
        };
        let ar = FusedCall {
            variant: self.fused_variant(case.strategy, Epilogue::AR_ONLY),
            tokens: case.tokens,
            hidden: case.hidden,
            ranks: case.world,
            params: ar_p,
        };
        let local = FusedCall {
            variant: Variant {
                kind: KernelKind::Local,
                dtype: self.dtype,
                epilogue: case.epilogue,
            },
            params: arfuse_runtime::device::KernelParams {
                x: rank_tensor(&self.io.ar_out, b.out, true),
                ..p
            },
            ..ar
        };
        Ok((fused_call(case, p), ar, local))
    }
}

/// Per-call microseconds of one case.
struct Timing {
    fused_us: f64,
    unfused_us: f64,
}

/// Times the fused call of `case` and its unfused pair with PDL as `pdl`.
fn time_case(
    gpu: &mut Gpu,
    rig: &Rig,
    args: &Args,
    case: &Case,
    pdl: bool,
) -> anyhow::Result<Timing> {
    gpu.set_pdl(pdl);
    let inputs = check::make_inputs(case, 1)?;
    upload_inputs(gpu, &rig.io, &inputs)?;
    let (fused, ar, local) = rig.calls(case)?;
    let fused_us = crate::time_graph(gpu, args.calls_per_graph, |g| {
        g.launch_fused(&rig.ws, &fused)
    })?;
    let unfused_us = crate::time_graph(gpu, args.calls_per_graph, |g| {
        g.launch_fused(&rig.ws, &ar)?;
        g.launch_local(&local)
    })?;
    Device::take_error(gpu, &rig.ws)?;
    Ok(Timing {
        fused_us,
        unfused_us,
    })
}

/// What every timing table says of itself: virtual ranks on one GPU move their "peer"
/// data within one GPU's memory, so no table claims the latency or bandwidth targets
/// (domain.md section 6), which need W GPUs and real ranks.
const VIRTUAL_NOTE: &str = "W virtual ranks on ONE GPU: no NVLink hop, so not a measure of the latency or bandwidth targets (those need real ranks on W GPUs)";

/// The latency table: T = 1, 2, 4, 8, residual + RMSNorm, both strategies, PDL on and
/// off, fused against the unfused pair (labelled [`VIRTUAL_NOTE`]).
fn latency_table(gpu: &mut Gpu, rig: &Rig, args: &Args) -> anyhow::Result<()> {
    println!("\nlatency (residual + RMSNorm; {VIRTUAL_NOTE}):");
    println!(
        "{:>3} {:<8} {:>12} {:>13} {:>14} {:>8}",
        "T", "strategy", "fused PDL us", "fused no-PDL", "unfused PDL us", "speedup"
    );
    for tokens in LATENCY_TOKENS {
        for strategy in [Strategy::OneShot, Strategy::TwoShot] {
            let case = rig.case(strategy, Quant::None, tokens);
            let on = time_case(gpu, rig, args, &case, true)?;
            let off = time_case(gpu, rig, args, &case, false)?;
            println!(
                "{tokens:>3} {:<8} {:>12.2} {:>13.2} {:>14.2} {:>7.2}x",
                strategy.name(),
                on.fused_us,
                off.fused_us,
                on.unfused_us,
                on.unfused_us / on.fused_us,
            );
        }
    }
    Ok(())
}

/// The bandwidth table: T = 256, 1024, 4096, every timed epilogue, both strategies,
/// PDL on; GB/s over the algorithm's bytes and over the minimum bytes, each against
/// the copy (labelled [`VIRTUAL_NOTE`]).
fn bandwidth_table(gpu: &mut Gpu, rig: &Rig, args: &Args, copy_gbs: f64) -> anyhow::Result<()> {
    println!(
        "\nbandwidth (PDL on; alg = the algorithm's bytes, min = the fewest any algorithm moves; {VIRTUAL_NOTE}):"
    );
    println!(
        "{:<18} {:>5} {:<8} {:>9} {:>11} {:>8} {:>8} {:>6} {:>8} {:>6}",
        "pattern",
        "T",
        "strategy",
        "fused us",
        "unfused us",
        "speedup",
        "alg GB/s",
        "% copy",
        "min GB/s",
        "% copy"
    );
    for &q in &rig.quants {
        for tokens in BANDWIDTH_TOKENS {
            for strategy in [Strategy::OneShot, Strategy::TwoShot] {
                let case = rig.case(strategy, q, tokens);
                let t = time_case(gpu, rig, args, &case, true)?;
                let gbs = |bytes: u64| bytes as f64 / (t.fused_us * 1e-6) / 1e9;
                let alg = gbs(check::bytes_moved(&case)?);
                let min = gbs(check::minimum_bytes(&case)?);
                println!(
                    "{:<18} {tokens:>5} {:<8} {:>9.2} {:>11.2} {:>7.2}x {alg:>8.0} {:>5.1}% {min:>8.0} {:>5.1}%",
                    case.pattern(),
                    strategy.name(),
                    t.fused_us,
                    t.unfused_us,
                    t.unfused_us / t.fused_us,
                    100.0 * alg / copy_gbs,
                    100.0 * min / copy_gbs,
                );
            }
        }
    }
    Ok(())
}
