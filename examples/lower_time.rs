//! Lowering time of one graph file (arfuse JSON, torch.export JSON or a serialized FX
//! graph, `docs/fx-graph-format.md`), for `tools/bench/side_by_side.py`: imports the
//! file once, lowers it `RUNS` times for the target preset, and prints one JSON line:
//! `{"nodes": N, "all_reduces": A, "fused": F, "best_s": S, "runs": R}` (S: the fastest
//! lowering, in seconds, import excluded). Not a timed test.
//!
//! Run: `cargo run --release --example lower_time -- FILE [PRESET] [RUNS]`
//! (defaults: `h200-sxm-x8`, 5).

use arfuse::{advanced::import, Target};
use std::time::Instant;

/// The allocator arfuse's binaries (xtask, the Python module) install.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(path) = args.first() else {
        return Err("usage: lower_time FILE [PRESET] [RUNS]".into());
    };
    let preset = args.get(1).map(String::as_str).unwrap_or("h200-sxm-x8");
    let runs: usize = match args.get(2) {
        Some(r) => r.parse().map_err(|e| format!("RUNS {r:?}: {e}"))?,
        None => 5,
    };
    let imported = import::load_any(&std::fs::read(path)?)?;
    let target = Target::preset(preset)?;
    let mut best = f64::INFINITY;
    let mut fused = 0;
    let mut all_reduces = 0;
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        let l = arfuse::lower(&imported.graph, &target)?;
        best = best.min(t.elapsed().as_secs_f64());
        fused = l.report.all_reduces_fused;
        all_reduces = l.report.all_reduces_seen;
    }
    println!(
        "{{\"nodes\": {}, \"all_reduces\": {all_reduces}, \"fused\": {fused}, \"best_s\": {best:.6}, \"runs\": {}}}",
        imported.graph.len(),
        runs.max(1)
    );
    Ok(())
}
