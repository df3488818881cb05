//! Workspace bytes per rank of every model graph in ir-fixtures/models/ on each of its
//! target presets: what arfuse's kernels allocate (sized for exactly what the plan
//! dispatches) next to what FlashInfer's sizing would allocate for the same target,
//! hidden size and M, with the ratio and the totals. A report, not a test.
//!
//! Run: `cargo run --release --example workspace_bytes`

use arfuse::{Graph, Target};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ir-fixtures/models");
    let mut options: Vec<_> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".options.json"))
        .collect();
    options.sort();
    println!(
        "| model | target | backend | H | M | arfuse bytes/rank | FlashInfer bytes/rank | ratio |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|");
    let (mut ours, mut theirs, mut over) = (0u64, 0u64, 0usize);
    for opt in options {
        let o: serde_json::Value = serde_json::from_slice(&std::fs::read(&opt)?)?;
        let name = opt
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .trim_end_matches(".options.json")
            .to_string();
        let g = Graph::from_json_slice(&std::fs::read(dir.join(format!("{name}.json")))?)?;
        for t in o["targets"].as_array().into_iter().flatten() {
            let t = t.as_str().unwrap_or_default();
            let report = arfuse::lower(&g, &Target::preset(t)?)?.report;
            for w in &report.workspaces {
                let (Some(a), Some(f)) = (w.bytes_per_rank, w.flashinfer_bytes_per_rank) else {
                    println!("| {name} | {t} | none | | | | | |");
                    continue;
                };
                ours += a;
                theirs += f;
                over += usize::from(a > f);
                println!(
                    "| {name} | {t} | {} | {} | {} | {a} | {f} | {:.4} |",
                    w.backend.as_deref().unwrap_or("-"),
                    w.hidden.unwrap_or(0),
                    w.max_token_num,
                    a as f64 / f as f64
                );
            }
        }
    }
    println!(
        "| total | | | | | {ours} | {theirs} | {:.4} |",
        ours as f64 / theirs as f64
    );
    println!("\nworkspaces where arfuse allocates more than FlashInfer: {over}");
    Ok(())
}
