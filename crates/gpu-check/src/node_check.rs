//! Part 1b of the GPU check: one fused node run through the public runtime API
//! (`NodeKernels` -> `Runner::prepare` -> `launch` / `capture` + `replay` ->
//! `sync`), with a plan that has one-shot, two-shot and unfused ranges, so the route of
//! every kind (including the unfused path: virtual all-reduce + local kernel) is checked
//! against the contract, directly and from graphs captured per size. On any device.

use anyhow::anyhow;
use arfuse_runtime::check::{self, Case, RankOutputs, FILL_BYTE};
use arfuse_runtime::device::{Allocation, Device, RankTensor};
use arfuse_runtime::node::Route;
use arfuse_runtime::runner::{NodeTensors, Runner};
use arfuse_runtime::variants::{ActDtype, Epilogue, Quant, Strategy};

const WORLD: u32 = 8;
/// One-shot up to this T, two-shot up to [`TWO_SHOT_MAX`], unfused up to [`MAX_T`].
const ONE_SHOT_MAX: u32 = 16;
const TWO_SHOT_MAX: u32 = 128;
const MAX_T: u32 = 1024;
/// Token counts checked: both ends of every range.
const TOKENS: [u32; 6] = [1, 16, 17, 128, 129, 1024];

/// W ranks' tensors at a fixed per-rank stride (the largest T), as an engine holds them.
struct Strided<B> {
    buf: B,
    stride: u64,
}

impl<B: Allocation> Strided<B> {
    fn new<D: Device<Buffer = B>>(dev: &mut D, stride: u64) -> anyhow::Result<Strided<B>> {
        Ok(Strided {
            buf: dev.alloc(stride.max(16) * u64::from(WORLD))?,
            stride,
        })
    }
    fn tensor(&self) -> RankTensor {
        RankTensor {
            ptr: self.buf.ptr(),
            rank_stride: self.stride,
        }
    }
    fn upload<D: Device<Buffer = B>>(
        &self,
        dev: &mut D,
        per_rank: &[Vec<u8>],
    ) -> anyhow::Result<()> {
        for (r, bytes) in per_rank.iter().enumerate() {
            dev.upload(&self.buf, r as u64 * self.stride, bytes)?;
        }
        Ok(())
    }
    /// The first `n` bytes of every rank's slice.
    fn download<D: Device<Buffer = B>>(&self, dev: &mut D, n: u64) -> anyhow::Result<Vec<Vec<u8>>> {
        (0..u64::from(WORLD))
            .map(|r| {
                let mut v = vec![0u8; usize::try_from(n)?];
                if n > 0 {
                    dev.download(&self.buf, r * self.stride, &mut v)?;
                }
                Ok(v)
            })
            .collect()
    }
}

/// Runs the node checks on devices `open` makes (one per node); returns the number of
/// failed (T, mode) checks.
pub fn run<D: Device>(
    open: &dyn Fn() -> anyhow::Result<D>,
    hidden: u32,
    replays: u32,
) -> anyhow::Result<usize> {
    println!(
        "\nfused node through runner::Runner (W = {WORLD}, H = {hidden}, bf16; one-shot 1..={ONE_SHOT_MAX}, two-shot ..={TWO_SHOT_MAX}, unfused ..={MAX_T}):"
    );
    println!(
        "{:<16} {:>5} {:<9} {:>8} {:>14}",
        "pattern", "T", "route", "direct", "graph"
    );
    let mut failures = 0;
    for quant in [Quant::None, Quant::Fp8PerToken] {
        // The Llama order, so the runner's fused and unfused paths run the
        // two-rounding epilogue (the case matrix runs both forms directly).
        let big = Case {
            strategy: Strategy::OneShot,
            world: WORLD,
            dtype: ActDtype::Bf16,
            epilogue: Epilogue {
                residual: true,
                norm: true,
                quant,
            },
            tokens: MAX_T,
            hidden,
            weight_bias: 0,
            gamma_f32: false,
            norm_round_twice: true,
            norm_f32_sum: false,
        };
        let ws = check::workspace_for(WORLD, ActDtype::Bf16, hidden, TWO_SHOT_MAX)?;
        let kernels = check::node_for(
            &big,
            "gpu_check.node",
            &ws,
            &[
                (1, ONE_SHOT_MAX, Strategy::OneShot),
                (ONE_SHOT_MAX + 1, TWO_SHOT_MAX, Strategy::TwoShot),
                (TWO_SHOT_MAX + 1, MAX_T, Strategy::Unfused),
            ],
        )?;
        let id = kernels.node.clone();
        let mut runner = Runner::new(open()?);
        runner.add(kernels)?;
        let prepared = runner.prepare()?;
        println!("  workspace: {prepared:?}");
        // Buffers at the largest T's per-rank size.
        let b = big.output_bytes()?;
        let dev = runner.device();
        let (x, res, out, res_out, q, s) = (
            Strided::new(dev, b.out)?,
            Strided::new(dev, b.out)?,
            Strided::new(dev, b.out)?,
            Strided::new(dev, b.residual_out)?,
            Strided::new(dev, b.quant)?,
            Strided::new(dev, b.scale)?,
        );
        let gamma = dev.alloc(u64::from(hidden) * 4)?;
        let tensors = NodeTensors {
            x: x.tensor(),
            residual_in: res.tensor(),
            residual_out: res_out.tensor(),
            out: out.tensor(),
            quant_out: if b.quant > 0 {
                q.tensor()
            } else {
                RankTensor::default()
            },
            scale_out: if b.scale > 0 {
                s.tensor()
            } else {
                RankTensor::default()
            },
            gamma: gamma.ptr(),
            scale_in: 0,
        };
        let graphs = runner.capture(&id, &TOKENS, &tensors)?;
        for t in TOKENS {
            let case = Case { tokens: t, ..big };
            let inputs = check::make_inputs(&case, 0xa11 ^ u64::from(t))?;
            let want = check::expected(&case, &inputs)?;
            let n = case.output_bytes()?;
            let dev = runner.device();
            x.upload(dev, &inputs.x)?;
            res.upload(dev, &inputs.residual)?;
            dev.upload(&gamma, 0, &inputs.gamma)?;
            let mut verdicts = Vec::new();
            let mut route = None;
            for mode in 0..2 {
                let dev = runner.device();
                for o in [&out, &res_out, &q, &s] {
                    dev.fill(&o.buf, 0, o.buf.bytes(), FILL_BYTE)?;
                }
                if mode == 0 {
                    route = Some(runner.launch(&id, t, &tensors)?);
                } else {
                    for _ in 0..replays {
                        runner.replay(&graphs, t)?;
                    }
                }
                runner.sync()?;
                let dev = runner.device();
                let (o, r, qq, ss) = (
                    out.download(dev, n.out)?,
                    res_out.download(dev, n.residual_out)?,
                    q.download(dev, n.quant)?,
                    s.download(dev, n.scale)?,
                );
                let got: Vec<RankOutputs> = (0..WORLD as usize)
                    .map(|k| RankOutputs {
                        out: o[k].clone(),
                        residual_out: r[k].clone(),
                        quant: qq[k].clone(),
                        scale: ss[k].clone(),
                    })
                    .collect();
                verdicts.push(check::compare(&case, &inputs, &want, &got)?);
            }
            let route = match route.ok_or_else(|| anyhow!("no launch"))? {
                Route::Fused(v) => v.name().split('_').next().unwrap_or("fused").to_string(),
                Route::Unfused { .. } => "unfused".to_string(),
            };
            failures += verdicts.iter().filter(|v| !v.passed()).count();
            println!(
                "{:<16} {t:>5} {route:<9} {:>8} {:>14}",
                case.pattern(),
                verdicts[0].summary(),
                verdicts[1].summary()
            );
        }
    }
    Ok(failures)
}
