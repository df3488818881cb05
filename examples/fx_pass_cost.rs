//! The Rust part of `arfuse.torch.FusionPass` on one FX graph in the compact form
//! (`arfuse._arfuse._fx_graph_json`, gzip or plain): import, lower and splice, each
//! timed, the first call (what one compilation pays) and the median of warm calls.
//!
//!     cargo run --release --example fx_pass_cost -- GRAPH.fx.json[.gz] [PRESET] [RUNS]
//!
//! Prints milliseconds per step and the site count. A benchmark, not a test.

use std::io::Read;
use std::time::Instant;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: fx_pass_cost GRAPH.fx.json[.gz] [PRESET] [RUNS]")?;
    let preset = args.next().unwrap_or_else(|| "h200-sxm-x2".into());
    let runs: usize = args.next().map(|r| r.parse()).transpose()?.unwrap_or(20);
    let raw = std::fs::read(&path).map_err(|e| format!("{path}: {e}"))?;
    let text = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut s = String::new();
        flate2::read::MultiGzDecoder::new(&raw[..]).read_to_string(&mut s)?;
        s
    } else {
        String::from_utf8(raw)?
    };
    let fx: arfuse::advanced::import::torch_export::fx::FxGraph = serde_json::from_str(&text)?;
    let target = arfuse::Target::preset(&preset)?;
    let opts = arfuse::advanced::import::ImportOptions::default();
    let mut rows: Vec<[f64; 3]> = Vec::new();
    let mut sites = 0;
    for _ in 0..runs.max(1) {
        let t0 = Instant::now();
        let imported = arfuse::advanced::import::torch_export::fx::import(&fx, &opts)?;
        let t1 = Instant::now();
        let lowered = arfuse::lower(&imported.graph, &target)?;
        let t2 = Instant::now();
        let splice = arfuse::splice::splice(&imported.graph, &imported.tensors, &lowered.graph)?;
        let t3 = Instant::now();
        sites = splice.sites.len();
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        rows.push([ms(t0, t1), ms(t1, t2), ms(t2, t3)]);
    }
    let first = rows[0];
    let mut warm: Vec<[f64; 3]> = rows[1..].to_vec();
    let median = |k: usize| {
        let mut v: Vec<f64> = warm.iter().map(|r| r[k]).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let med = [median(0), median(1), median(2)];
    warm.clear();
    println!(
        "{path}: {} FX nodes, {sites} sites spliced, {preset}",
        fx.nodes.len()
    );
    println!("step     first ms   warm median ms");
    for (k, name) in ["import", "lower", "splice"].iter().enumerate() {
        println!("{name:<8} {:>8.2}   {:>8.2}", first[k], med[k]);
    }
    println!(
        "total    {:>8.2}   {:>8.2}",
        first.iter().sum::<f64>(),
        med.iter().sum::<f64>()
    );
    Ok(())
}
