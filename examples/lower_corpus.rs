//! Benchmark: lowering time of every model graph in ir-fixtures/models/ on each of its
//! target presets (best of 5 runs), printed as a table. Not a timed test.
//!
//! Run: `cargo run --release --example lower_corpus`

use arfuse::{Graph, Target};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ir-fixtures/models");
    let mut options: Vec<_> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".options.json"))
        .collect();
    options.sort();
    println!("| model | target | nodes | all-reduces | fused | best of 5 (ms) | us / site |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for opt in options {
        let o: serde_json::Value = serde_json::from_slice(&std::fs::read(&opt)?)?;
        let name = opt
            .file_name()
            .unwrap()
            .to_string_lossy()
            .trim_end_matches(".options.json")
            .to_string();
        let g = Graph::from_json_slice(&std::fs::read(dir.join(format!("{name}.json")))?)?;
        for t in o["targets"].as_array().into_iter().flatten() {
            let t = t.as_str().unwrap_or_default();
            let target = Target::preset(t)?;
            let mut best = f64::MAX;
            let mut last = None;
            for _ in 0..5 {
                let start = Instant::now();
                let l = arfuse::lower(&g, &target)?;
                best = best.min(start.elapsed().as_secs_f64());
                last = Some(l);
            }
            let r = last.map(|l| l.report).expect("five runs");
            println!(
                "| {name} | {t} | {} | {} | {} | {:.2} | {:.1} |",
                g.len(),
                r.all_reduces_seen,
                r.all_reduces_fused,
                best * 1e3,
                best * 1e6 / r.all_reduces_seen.max(1) as f64
            );
        }
    }
    Ok(())
}
