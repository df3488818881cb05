//! Lowering time of dense stacks, 8 to 4,096 layers (`--release`), as a table:
//! layers, IR nodes, sites, milliseconds (best of a few runs), microseconds per site.
//!
//! The work per site is constant (instruction counts under callgrind: about 300k per
//! site for the decomposed form at 256 and at 2,048 layers); what still grows with the
//! size is the cost of cache misses in the e-graph's hash tables once they outgrow the
//! caches, so time per site rises somewhat on large graphs and varies with the load of
//! the machine (best of several runs is printed).
//!
//! `cargo run --release -p arfuse-rewrite --example bench [-- decomposed]`

#[path = "../tests/common/builder.rs"]
mod builder;

use builder::{NormForm, Stack};
use std::time::Instant;

fn main() {
    let decomposed = std::env::args().any(|a| a == "decomposed");
    let target = arfuse_policy::Target::preset("h200-sxm-x8").expect("preset");
    println!(
        "| layers | IR nodes | sites fused | ms | us/site | e-nodes |  ({})",
        if decomposed {
            "decomposed norms"
        } else {
            "rms_norm"
        }
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for layers in [8usize, 32, 128, 512, 1024, 2048, 4096] {
        let g = Stack {
            layers,
            norm: if decomposed {
                NormForm::Decomposed
            } else {
                NormForm::RmsNorm
            },
            ..Stack::default()
        }
        .build();
        let runs = if layers <= 512 { 5 } else { 3 };
        let mut best = f64::INFINITY;
        let mut last = None;
        for _ in 0..runs {
            // The previous result is dropped first: one lowering's memory at a time.
            drop(last.take());
            let t = Instant::now();
            let l = arfuse_rewrite::lower(&g, &target).expect("lower");
            best = best.min(t.elapsed().as_secs_f64());
            last = Some(l);
        }
        let l = last.expect("one run");
        let sites = l.report.all_reduces_fused;
        assert_eq!(sites, 2 * layers + 1);
        println!(
            "| {layers} | {} | {sites} | {:.1} | {:.1} | {} | {} it |",
            g.len(),
            best * 1e3,
            best * 1e6 / sites as f64,
            l.report.runner.egraph_nodes,
            l.report.runner.iterations
        );
    }
}
