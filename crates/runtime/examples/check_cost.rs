//! CPU cost of the GPU check's host side for its largest case (W = 8, T = 1024,
//! H = 4096, bf16): inputs, expected outputs from the reference contract, comparison.
//! It bounds how long `gpu_check` spends off the GPU (the device budget is minutes).
//!
//! `cargo run --release -p arfuse-runtime --example check_cost`

use arfuse_runtime::check::{self, Case};
use arfuse_runtime::variants::{ActDtype, Epilogue, Quant, Strategy};
use std::time::Instant;

fn main() {
    for quant in [
        Quant::None,
        Quant::Fp8PerToken,
        Quant::Nvfp4(arfuse_runtime::variants::Nvfp4ScaleLayout::Swizzled128x4),
    ] {
        let c = Case {
            strategy: Strategy::OneShot,
            world: 8,
            dtype: ActDtype::Bf16,
            epilogue: Epilogue {
                residual: true,
                norm: true,
                quant,
            },
            tokens: 1024,
            hidden: 4096,
            weight_bias: 0,
            gamma_f32: false,
            norm_round_twice: false,
            norm_f32_sum: false,
        };
        let t = Instant::now();
        let inputs = check::make_inputs(&c, 1).expect("inputs");
        let t_inputs = t.elapsed();
        let want = check::expected(&c, &inputs).expect("expected");
        let t_expected = t.elapsed() - t_inputs;
        let v = check::compare(&c, &inputs, &want, &want).expect("compare");
        let t_compare = t.elapsed() - t_inputs - t_expected;
        assert!(v.passed());
        println!(
            "{}: inputs {:.0} ms, expected {:.0} ms, compare {:.0} ms ({} threads)",
            c.label(),
            t_inputs.as_secs_f64() * 1e3,
            t_expected.as_secs_f64() * 1e3,
            t_compare.as_secs_f64() * 1e3,
            std::thread::available_parallelism().map_or(1, |n| n.get())
        );
    }
}
