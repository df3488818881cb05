//! Times loading and validating a generated 100,000-node graph (issue 2's figure).
//! Run: `cargo run --release -p arfuse-ir --example load_bench`.

use arfuse_ir::Graph;
use std::time::Instant;

fn main() {
    let nodes = 100_000usize;
    let mut s = String::from(
        r#"{"format":"arfuse-graph","version":1,"symbols":{"T":{"min":1,"max":8192}},"nodes":[
{"id":"x","op":"input","outputs":[{"dtype":"bf16","shape":["T",4096]}]},
{"id":"w","op":"input","attrs":{"kind":"parameter"},"outputs":[{"dtype":"bf16","shape":[4096]}]}"#,
    );
    // Chains of all_reduce -> fused_add_rms_norm (4 nodes of work per step).
    let mut prev = "x".to_string();
    let mut res = "x".to_string();
    let mut k = 0;
    while k + 2 < nodes {
        s.push_str(&format!(
            ",\n{{\"id\":\"ar{k}\",\"op\":\"all_reduce\",\"attrs\":{{\"group\":\"tp\"}},\"inputs\":[\"{prev}\"],\"outputs\":[{{\"dtype\":\"bf16\",\"shape\":[\"T\",4096]}}]}}"
        ));
        s.push_str(&format!(
            ",\n{{\"id\":\"n{k}\",\"op\":\"fused_add_rms_norm\",\"attrs\":{{\"eps\":1e-5}},\"inputs\":[\"ar{k}\",\"{res}\",\"w\"],\"outputs\":[{{\"dtype\":\"bf16\",\"shape\":[\"T\",4096]}},{{\"dtype\":\"bf16\",\"shape\":[\"T\",4096]}}]}}"
        ));
        prev = format!("n{k}");
        res = format!("n{k}:1");
        k += 2;
    }
    s.push_str(&format!("],\"outputs\":[\"{prev}\"]}}"));
    let bytes = s.len();
    if std::env::var_os("BASELINE").is_some() {
        baseline(&s);
    }
    let mut best = f64::MAX;
    let mut count = 0;
    for _ in 0..5 {
        let t = Instant::now();
        let g = Graph::from_json_str(&s).expect("generated graph is valid");
        best = best.min(t.elapsed().as_secs_f64());
        count = g.len();
    }
    println!(
        "loaded and validated {count} nodes ({bytes} bytes of JSON): best of 5 = {:.1} ms",
        best * 1e3
    );
}

#[allow(dead_code)]
fn baseline(s: &str) {
    let t = Instant::now();
    let v: serde_json::Value = serde_json::from_str(s).unwrap();
    println!(
        "baseline serde_json::Value parse: {:.1} ms ({})",
        t.elapsed().as_secs_f64() * 1e3,
        v.is_object()
    );
}
