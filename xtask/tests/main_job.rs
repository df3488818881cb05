//! `cargo xtask lower` with no arguments, the README's main job: the bundled
//! Llama-3.1-8B TP8 graph on h200-sxm-x8, written under target/arfuse/.

use std::path::Path;
use std::process::Command;

#[test]
fn xtask_lower_runs_the_main_job() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let written = root.join("target/arfuse/llama31_8b_tp8.h200-sxm-x8.lowered.json");
    let o = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .current_dir(root.join("crates"))
        .args(["lower", "--report", "json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v[0]["target"], "h200-sxm-x8");
    assert!(v[0]["input"]
        .as_str()
        .unwrap()
        .ends_with("ir-fixtures/models/llama31_8b_tp8.json"));
    assert_eq!(v[0]["report"]["all_reduces_seen"], 65);
    assert_eq!(v[0]["report"]["all_reduces_fused"], 65);
    assert!(
        stderr.contains(&format!("wrote {}", written.display())),
        "{stderr}"
    );
    let lowered = std::fs::read_to_string(&written).unwrap();
    assert_eq!(lowered.matches("\"fused_allreduce_norm\"").count(), 65);
}
