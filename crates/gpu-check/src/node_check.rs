//! Part 1b of the GPU check: one fused node run through the public runtime API
//! (`NodeKernels` -> `Runner::prepare` -> `launch` / `capture`), with a plan that
//! has one-shot, two-shot and unfused ranges, so the route of every kind (including the
//! unfused path: virtual all-reduce + local kernel) is checked against the contract,
//! directly and from CUDA graphs captured per size.

use anyhow::anyhow;
use arfuse_ir::{
    DType, DispatchRange, FusedAllReduceNorm, FusedOutput, FusedPlan, FusedQuant,
    Strategy as IrStrategy,
};
use arfuse_runtime::check::{self, Case, RankOutputs, FILL_BYTE};
use arfuse_runtime::cuda::{DeviceBuffer, Gpu, RankTensor};
use arfuse_runtime::node::{NodeKernels, Route};
use arfuse_runtime::runner::{NodeTensors, Runner};
use arfuse_runtime::variants::{Dtype, Strategy};

const WORLD: u32 = 8;
/// One-shot up to this T, two-shot up to [`TWO_SHOT_MAX`], unfused up to [`MAX_T`].
const ONE_SHOT_MAX: u64 = 16;
const TWO_SHOT_MAX: u64 = 128;
const MAX_T: u32 = 1024;
/// Token counts checked: both ends of every range.
const TOKENS: [u32; 6] = [1, 16, 17, 128, 129, 1024];

fn attrs(quant: FusedQuant, hidden: u32) -> anyhow::Result<FusedAllReduceNorm> {
    let range = |lo, hi, strategy| DispatchRange {
        min_tokens: lo,
        max_tokens: hi,
        strategy,
        required_bytes: 0,
    };
    // One buffer for one-shot to 16 tokens and two-shot to 128 (bf16):
    // max(16 * W * H * 2, 2 * ceil(128 / W) * W * H * 2).
    let row = u64::from(hidden) * 2;
    let w = u64::from(WORLD);
    let need = (ONE_SHOT_MAX * w * row).max(2 * TWO_SHOT_MAX.div_ceil(w) * w * row);
    let mut outputs = vec![FusedOutput::Norm, FusedOutput::Residual];
    if quant != FusedQuant::None {
        outputs.extend([FusedOutput::Quant, FusedOutput::Scale]);
    }
    Ok(FusedAllReduceNorm {
        group: "tp".into(),
        eps: check::EPS,
        weight_bias: 0.0,
        // The Llama order, so the runner's fused and unfused paths run the
        // two-rounding epilogue (the case matrix runs both forms directly).
        norm_rounding: arfuse_ir::NormRounding::Twice,
        residual: true,
        quant,
        outputs,
        plan: Some(FusedPlan {
            pattern_code: 0,
            max_token_num: TWO_SHOT_MAX,
            workspace: arfuse_policy::Workspace::arfuse(
                arfuse_policy::Backend::Trtllm,
                WORLD,
                u64::from(hidden),
                arfuse_policy::ActDtype::Bf16,
                Some(TWO_SHOT_MAX),
                arfuse_policy::Workspace::arfuse_buffer_for(need)?,
            )?,
            dispatch: vec![
                range(1, ONE_SHOT_MAX, IrStrategy::OneShot),
                range(ONE_SHOT_MAX + 1, TWO_SHOT_MAX, IrStrategy::TwoShot),
                range(TWO_SHOT_MAX + 1, u64::from(MAX_T), IrStrategy::Unfused),
            ],
        }),
    })
}

/// W ranks' tensors at a fixed per-rank stride (the largest T), as an engine holds them.
struct Strided {
    buf: DeviceBuffer,
    stride: u64,
}

impl Strided {
    fn new(gpu: &Gpu, stride: u64) -> anyhow::Result<Strided> {
        Ok(Strided {
            buf: gpu.alloc(stride.max(16) * u64::from(WORLD))?,
            stride,
        })
    }
    fn tensor(&self) -> RankTensor {
        RankTensor {
            ptr: self.buf.ptr(),
            rank_stride: self.stride,
        }
    }
    fn upload(&self, gpu: &Gpu, per_rank: &[Vec<u8>]) -> anyhow::Result<()> {
        for (r, bytes) in per_rank.iter().enumerate() {
            gpu.upload(&self.buf, r as u64 * self.stride, bytes)?;
        }
        Ok(())
    }
    /// The first `n` bytes of every rank's slice.
    fn download(&self, gpu: &Gpu, n: u64) -> anyhow::Result<Vec<Vec<u8>>> {
        (0..u64::from(WORLD))
            .map(|r| {
                let mut v = vec![0u8; usize::try_from(n)?];
                if n > 0 {
                    gpu.download(&self.buf, r * self.stride, &mut v)?;
                }
                Ok(v)
            })
            .collect()
    }
}

/// Runs the node checks; returns the number of failed (T, mode) checks.
pub fn run(hidden: u32, replays: u32) -> anyhow::Result<usize> {
    println!(
        "\nfused node through runner::Runner (W = {WORLD}, H = {hidden}, bf16; one-shot 1..={ONE_SHOT_MAX}, two-shot ..={TWO_SHOT_MAX}, unfused ..={MAX_T}):"
    );
    println!(
        "{:<16} {:>5} {:<9} {:>8} {:>14}",
        "pattern", "T", "route", "direct", "graph"
    );
    let mut failures = 0;
    for quant in [FusedQuant::None, FusedQuant::Fp8PerToken] {
        let a = attrs(quant, hidden)?;
        let kernels = NodeKernels::new(
            "gpu_check.node",
            &a,
            DType::Bf16,
            u64::from(hidden),
            DType::Bf16,
            WORLD,
        )?;
        let id = kernels.node.clone();
        let mut runner = Runner::new(Gpu::open(0)?);
        runner.add(kernels.clone())?;
        let prepared = runner.prepare()?;
        println!("  workspace: {prepared:?}");
        // Buffers at the largest T's per-rank size.
        let big = Case {
            strategy: Strategy::OneShot,
            world: WORLD,
            dtype: Dtype::Bf16,
            epilogue: kernels.epilogue,
            tokens: MAX_T,
            hidden,
            weight_bias: 0,
            gamma_f32: false,
            norm_round_twice: true,
        };
        let b = big.output_bytes()?;
        let gpu = runner.gpu();
        let (x, res, out, res_out, q, s) = (
            Strided::new(gpu, b.out)?,
            Strided::new(gpu, b.out)?,
            Strided::new(gpu, b.out)?,
            Strided::new(gpu, b.residual_out)?,
            Strided::new(gpu, b.quant)?,
            Strided::new(gpu, b.scale)?,
        );
        let gamma = gpu.alloc(u64::from(hidden) * 4)?;
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
            let gpu = runner.gpu();
            x.upload(gpu, &inputs.x)?;
            res.upload(gpu, &inputs.residual)?;
            gpu.upload(&gamma, 0, &inputs.gamma)?;
            let mut verdicts = Vec::new();
            let mut route = None;
            for mode in 0..2 {
                let gpu = runner.gpu();
                for o in [&out, &res_out, &q, &s] {
                    gpu.fill(&o.buf, 0, o.buf.bytes(), FILL_BYTE)?;
                }
                if mode == 0 {
                    route = Some(runner.launch(&id, t, &tensors)?);
                } else {
                    for _ in 0..replays {
                        graphs.replay(t)?;
                    }
                }
                let gpu = runner.gpu();
                gpu.sync()?;
                let (o, r, qq, ss) = (
                    out.download(gpu, n.out)?,
                    res_out.download(gpu, n.residual_out)?,
                    q.download(gpu, n.quant)?,
                    s.download(gpu, n.scale)?,
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
