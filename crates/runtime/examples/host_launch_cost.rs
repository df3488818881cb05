//! Wall time of one host-device launch (`arfuse_runtime::host`): every rank its own
//! launch, a fused kernel at H = 256 (the host test matrix's size), deterministic and
//! skewed schedules, checked against the contract each time.
//!
//! `cargo run --release -p arfuse-runtime --example host_launch_cost`
//!
//! Measured while writing the host device (2-core VM shared with other builds, so
//! noisy): W = 8, T = 128, bf16 res_norm_fp8tok: 50-90 ms per launch with the
//! hand-written x86-64 context switch, 460-700 ms with ucontext (`-DARF_HOST_UCONTEXT`,
//! whose swapcontext makes a signal-mask syscall per switch); W = 8, T = 1: 1-2 ms.

use arfuse_runtime::check::{self, Case, Liveness};
use arfuse_runtime::host::{cases, Build, Compiler, HostWorkspace, LaunchOptions};
use arfuse_runtime::variants::{ActDtype, Epilogue, Quant, Strategy};
use std::time::{Duration, Instant};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join("arfuse-host-example");
    let c = Compiler::new(dir)?;
    println!("compiler: {}", c.version());
    for (strategy, tokens, world) in [
        (Strategy::OneShot, 128, 8),
        (Strategy::TwoShot, 128, 8),
        (Strategy::OneShot, 1, 8),
        (Strategy::OneShot, 16, 2),
    ] {
        let case = Case {
            strategy,
            world,
            dtype: ActDtype::Bf16,
            epilogue: Epilogue {
                residual: true,
                norm: true,
                quant: Quant::Fp8PerToken,
            },
            tokens,
            hidden: 256,
            weight_bias: 0,
            gamma_f32: false,
            norm_round_twice: false,
            norm_f32_sum: false,
        };
        let k = c.kernel(&case.variant(), Build::Plain)?;
        let mut ws =
            HostWorkspace::create(&check::workspace_for(world, ActDtype::Bf16, 256, 128)?)?;
        let inputs = check::make_inputs(&case, 1)?;
        let want = check::expected(&case, &inputs)?;
        let mut io = cases::CaseIo::new(&case, &inputs)?;
        for (name, opts) in [
            ("deterministic", LaunchOptions::default()),
            (
                "skewed",
                LaunchOptions::skewed(5, Duration::from_micros(300)),
            ),
        ] {
            let n = 10;
            let t0 = Instant::now();
            for _ in 0..n {
                let got = cases::run_fused(&k, &mut ws, &mut io, Liveness::all(&case)?, 4, &opts)?;
                if !check::compare(&case, &inputs, &want, &got)?.passed() {
                    return Err(format!("{} does not match the contract", case.label()).into());
                }
            }
            println!(
                "{:<40} {name:<13} {:8.2} ms per launch",
                case.label(),
                t0.elapsed().as_secs_f64() * 1000.0 / f64::from(n)
            );
        }
    }
    Ok(())
}
