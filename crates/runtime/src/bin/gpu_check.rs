//! `gpu_check`: the one prepared script for a GPU machine (wired to
//! `cargo xtask gpu-check` by the lead). Built here, run there.
//!
//! Prints a correctness table for the all-reduce-only and residual + RMSNorm
//! patterns (bf16) x W in {2, 4, 8} x strategy x T in {1, 7, 16, 40, 42, 128, 1024},
//! on virtual ranks, checked against the host contract (`protocol::allreduce_reference`,
//! `protocol::res_norm_reference`; all-reduce and residual bit-exact, norm within
//! 1 ulp), then again after 1,000 replays of a CUDA graph per T; then timings
//! (median us of fused vs unfused, achieved GB/s against a measured D2D copy).
//!
//! Exit codes: 0 all checks passed; 1 a check failed or the GPU run errored;
//! 2 nothing was checked (no CUDA driver on this machine).
//!
//! Usage: `gpu_check [--hidden H] [--replays N]`.

use arfuse_runtime::cuda::{
    self, CaptureSet, FusedCall, Gpu, KernelParams, RankTensor, VirtualWorkspace,
};
use arfuse_runtime::layout::WorkspaceRequest;
use arfuse_runtime::protocol::{allreduce_reference, res_norm_reference};
use arfuse_runtime::variants::{Dtype, Epilogue, KernelKind, Strategy, Variant};
use arfuse_runtime::{Error, Result};
use half::bf16;

const TOKENS: [u32; 7] = [1, 7, 16, 40, 42, 128, 1024];
const WORLDS: [u32; 3] = [2, 4, 8];

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn values(&mut self, n: usize) -> Vec<bf16> {
        (0..n)
            .map(|_| match self.next() % 32 {
                0 => bf16::from_bits(0x8000),
                1 => bf16::from_bits(0x8001),
                _ => bf16::from_f32((self.next() % 4096) as f32 / 1024.0 - 2.0),
            })
            .collect()
    }
}

fn bytes(v: &[bf16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}
fn from_bytes(b: &[u8]) -> Vec<bf16> {
    b.chunks_exact(2)
        .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}
/// Distance in ulps between two bf16 values (sign-magnitude mapped to a line).
fn ulps(a: bf16, b: bf16) -> u32 {
    let key = |x: bf16| {
        let v = x.to_bits() as i32;
        if v & 0x8000 != 0 {
            -(v & 0x7fff)
        } else {
            v
        }
    };
    (key(a) - key(b)).unsigned_abs()
}

struct Case {
    epilogue: Epilogue,
    world: u32,
    tokens: u32,
}

struct Buffers {
    x: cuda::DeviceBuffer,
    res: cuda::DeviceBuffer,
    res_out: cuda::DeviceBuffer,
    out: cuda::DeviceBuffer,
    gamma: cuda::DeviceBuffer,
}

fn params(b: &Buffers, t: u32, h: u32, residual: bool) -> KernelParams {
    let stride = u64::from(t) * u64::from(h) * 2;
    let rt = |p: u64| RankTensor {
        ptr: p,
        rank_stride: stride,
    };
    KernelParams {
        x: rt(b.x.ptr()),
        residual_in: if residual {
            rt(b.res.ptr())
        } else {
            RankTensor::default()
        },
        residual_out: rt(b.res_out.ptr()),
        out: rt(b.out.ptr()),
        gamma: b.gamma.ptr(),
        eps: 1e-6,
        weight_bias: 0.0,
        ..KernelParams::default()
    }
}

/// Compares the device outputs with the host contract; returns mismatching elements.
fn verify(
    gpu: &Gpu,
    b: &Buffers,
    c: &Case,
    h: u32,
    xs: &[Vec<bf16>],
    res: &[Vec<bf16>],
    gamma: &[bf16],
) -> Result<usize> {
    let n = (c.tokens * h) as usize;
    let mut out = vec![0u8; n * 2 * c.world as usize];
    let mut rout = vec![0u8; n * 2 * c.world as usize];
    gpu.download(&b.out, 0, &mut out)?;
    gpu.download(&b.res_out, 0, &mut rout)?;
    let (out, rout) = (from_bytes(&out), from_bytes(&rout));
    let a = allreduce_reference(xs);
    let mut bad = 0;
    for r in 0..c.world as usize {
        let o = &out[r * n..(r + 1) * n];
        if !c.epilogue.norm {
            bad += o
                .iter()
                .zip(&a)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
        } else {
            let (want_res, want_norm) = res_norm_reference(&a, Some(&res[r]), gamma, 1e-6, 0.0);
            let ro = &rout[r * n..(r + 1) * n];
            bad += ro
                .iter()
                .zip(&want_res)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
            bad += o
                .iter()
                .zip(&want_norm)
                .filter(|(x, y)| ulps(**x, **y) > 1)
                .count();
        }
    }
    Ok(bad)
}

fn run(hidden: u32, replays: u32) -> Result<usize> {
    let mut gpu = Gpu::open(0)?;
    let info = gpu.info().clone();
    println!(
        "device: {} (SM {}, {} SMs, multicast {}, {:.1} GiB free)",
        info.name,
        info.sm,
        info.sm_count,
        info.multicast,
        info.free_bytes as f64 / (1u64 << 30) as f64
    );
    let mut failures = 0usize;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let max_t = *TOKENS.iter().max().unwrap_or(&1);
    println!(
        "{:<10} {:>2} {:<8} {:>5} {:>10} {:>14}",
        "pattern",
        "W",
        "strategy",
        "T",
        "direct",
        format!("after {replays}")
    );
    for world in WORLDS {
        let ws = VirtualWorkspace::create(
            &gpu,
            WorkspaceRequest {
                world,
                hidden,
                dtype: Dtype::Bf16,
                max_tokens: max_t,
                oneshot_max_tokens: max_t,
            },
        )?;
        let elems = u64::from(world) * u64::from(max_t) * u64::from(hidden) * 2;
        let bufs = Buffers {
            x: gpu.alloc(elems)?,
            res: gpu.alloc(elems)?,
            res_out: gpu.alloc(elems)?,
            out: gpu.alloc(elems)?,
            gamma: gpu.alloc(u64::from(hidden) * 2)?,
        };
        let gamma = rng.values(hidden as usize);
        gpu.upload(&bufs.gamma, 0, &bytes(&gamma))?;
        for epilogue in [Epilogue::AR_ONLY, Epilogue::RES_NORM] {
            for strategy in [Strategy::OneShot, Strategy::TwoShot] {
                let variant = Variant {
                    kind: KernelKind::Fused { strategy, world },
                    dtype: Dtype::Bf16,
                    epilogue,
                };
                for tokens in TOKENS {
                    let c = Case {
                        epilogue,
                        world,
                        tokens,
                    };
                    let n = (tokens * hidden) as usize;
                    let xs: Vec<Vec<bf16>> = (0..world).map(|_| rng.values(n)).collect();
                    let res: Vec<Vec<bf16>> = (0..world).map(|_| rng.values(n)).collect();
                    gpu.upload(&bufs.x, 0, &bytes(&xs.concat()))?;
                    gpu.upload(&bufs.res, 0, &bytes(&res.concat()))?;
                    let call = FusedCall {
                        variant,
                        tokens,
                        ranks: world,
                        params: params(&bufs, tokens, hidden, epilogue.residual),
                    };
                    cuda::launch_fused(&mut gpu, &ws, &call)?;
                    gpu.sync()?;
                    ws.take_error(&gpu)?;
                    let direct = verify(&gpu, &bufs, &c, hidden, &xs, &res, &gamma)?;
                    // Graph: capture this T once, replay `replays` times, check again.
                    let graphs = CaptureSet::capture(&gpu, &[tokens], |_| {
                        let p = call.params.with_virtual_workspace(
                            &ws.layout,
                            ws.memory.ptr(),
                            ws.err.ptr(),
                        )?;
                        let mut p = p;
                        p.tokens = tokens as i32;
                        p.hidden = hidden as i32;
                        p.timeout_ns = cuda::DEFAULT_TIMEOUT_NS;
                        let f = gpu_kernel_cached(&gpu, &variant)?;
                        let block = cuda::block_size(hidden, Dtype::Bf16)?;
                        let gx = tokens.min(256).min(gpu.resident_ctas(f, block)? / world);
                        gpu.launch(f, gx, world, block, &p, true, false)
                    })?;
                    for _ in 0..replays {
                        graphs.replay(tokens)?;
                    }
                    gpu.sync()?;
                    ws.take_error(&gpu)?;
                    let replayed = verify(&gpu, &bufs, &c, hidden, &xs, &res, &gamma)?;
                    failures += usize::from(direct != 0) + usize::from(replayed != 0);
                    let show = |k: usize| {
                        if k == 0 {
                            "ok".to_string()
                        } else {
                            format!("{k} bad")
                        }
                    };
                    let name = if epilogue.norm { "res_norm" } else { "ar" };
                    println!(
                        "{name:<10} {world:>2} {:<8} {tokens:>5} {:>10} {:>14}",
                        strategy.name(),
                        show(direct),
                        show(replayed)
                    );
                }
            }
        }
        if world == 8 {
            timings(&mut gpu, &ws, &bufs, hidden)?;
        }
    }
    Ok(failures)
}

/// The kernel handle for a variant already loaded by a direct launch (nothing is
/// compiled or allocated while capturing).
fn gpu_kernel_cached(gpu: &Gpu, v: &Variant) -> Result<cuda::KernelFn> {
    gpu.cached_kernel(v)
        .ok_or_else(|| Error::Invalid(format!("{v} not loaded before capture")))
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f32::NAN)
}

fn timings(gpu: &mut Gpu, ws: &VirtualWorkspace, b: &Buffers, hidden: u32) -> Result<()> {
    let world = 8u32;
    // Device-to-device copy baseline: 256 MiB.
    let big = 256u64 << 20;
    let (s, d) = (gpu.alloc(big)?, gpu.alloc(big)?);
    let mut copy = Vec::new();
    for _ in 0..20 {
        copy.push(gpu.time_ms(|g| g.copy_d2d(&d, &s, big))?);
    }
    let copy_gbs = 2.0 * big as f64 / (f64::from(median(copy)) * 1e-3) / 1e9;
    println!("\nD2D copy: {copy_gbs:.0} GB/s (read + write)");
    println!(
        "{:>5} {:<8} {:>10} {:>12} {:>8} {:>9}",
        "T", "strategy", "fused us", "unfused us", "GB/s", "% of copy"
    );
    for tokens in [1u32, 16, 128, 1024] {
        for strategy in [Strategy::OneShot, Strategy::TwoShot] {
            let fused = Variant {
                kind: KernelKind::Fused { strategy, world },
                dtype: Dtype::Bf16,
                epilogue: Epilogue::RES_NORM,
            };
            let ar = Variant {
                kind: KernelKind::Fused { strategy, world },
                dtype: Dtype::Bf16,
                epilogue: Epilogue::AR_ONLY,
            };
            let local = Variant {
                kind: KernelKind::Local,
                dtype: Dtype::Bf16,
                epilogue: Epilogue::RES_NORM,
            };
            let p = params(b, tokens, hidden, true);
            let fcall = FusedCall {
                variant: fused,
                tokens,
                ranks: world,
                params: p,
            };
            let mut ar_p = p;
            ar_p.residual_in = RankTensor::default();
            ar_p.residual_out = RankTensor::default();
            ar_p.out = RankTensor {
                ptr: b.out.ptr(),
                rank_stride: p.out.rank_stride,
            };
            let arcall = FusedCall {
                variant: ar,
                tokens,
                ranks: world,
                params: ar_p,
            };
            let mut lp = p;
            lp.x = RankTensor {
                ptr: b.out.ptr(),
                rank_stride: p.out.rank_stride,
            };
            lp.out = RankTensor {
                ptr: b.x.ptr(),
                rank_stride: p.x.rank_stride,
            };
            let lcall = FusedCall {
                variant: local,
                tokens,
                ranks: world,
                params: lp,
            };
            let mut tf = Vec::new();
            let mut tu = Vec::new();
            // Warm-up (loads the kernels outside the timed region).
            cuda::launch_fused(gpu, ws, &fcall)?;
            cuda::launch_fused(gpu, ws, &arcall)?;
            cuda::launch_local(gpu, &lcall, hidden)?;
            for _ in 0..100 {
                let ms = gpu.time_ms(|g| cuda::launch_fused(g, ws, &fcall))?;
                tf.push(ms * 1000.0);
                let ms = gpu.time_ms(|g| {
                    cuda::launch_fused(g, ws, &arcall)?;
                    cuda::launch_local(g, &lcall, hidden)
                })?;
                tu.push(ms * 1000.0);
            }
            ws.take_error(gpu)?;
            let (mf, mu) = (median(tf), median(tu));
            // Bytes per rank: read x, residual; write residual_out, norm_out.
            let moved = 4.0 * f64::from(world) * f64::from(tokens) * f64::from(hidden) * 2.0;
            let gbs = moved / (f64::from(mf) * 1e-6) / 1e9;
            println!(
                "{tokens:>5} {:<8} {mf:>10.1} {mu:>12.1} {gbs:>8.0} {:>8.1}%",
                strategy.name(),
                100.0 * gbs / copy_gbs
            );
        }
    }
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, default: u32| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let hidden = arg("--hidden", 4096);
    let replays = arg("--replays", 1000);
    match run(hidden, replays) {
        Ok(0) => println!("\ngpu_check: all checks passed"),
        Ok(n) => {
            println!("\ngpu_check: {n} checks FAILED");
            std::process::exit(1);
        }
        Err(Error::NoDriver(m)) => {
            eprintln!("gpu_check: skipped: no CUDA driver ({m}); nothing was checked. Run it on the GPU machine.");
            std::process::exit(2);
        }
        Err(e) => {
            eprintln!("gpu_check: error: {e}");
            std::process::exit(1);
        }
    }
}
