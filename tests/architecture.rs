//! The dependency invariants of ARCHITECTURE.md, read from the manifests and sources:
//! the ABI depends on nothing (serde only as an optional feature); the IR knows nothing
//! of egg or CUDA and of arfuse only the ABI and the policy; the policy depends on no
//! arfuse crate but the ABI; only the runtime links cudarc, and inside it only `cuda.rs` uses
//! it; the facade does not depend on the runtime; anyhow only in the binaries (the
//! `arfuse` command, whose library part only shares its code with xtask; xtask;
//! gpu-check).

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The names in a manifest's `[dependencies]` table (not dev- or build-dependencies).
fn dependencies(manifest: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(manifest).unwrap();
    let mut in_deps = false;
    let mut out = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
            continue;
        }
        if in_deps && !line.is_empty() && !line.starts_with('#') {
            let name = line.split(['=', '.', ' ']).next().unwrap().trim();
            out.push(name.to_string());
        }
    }
    out
}

fn crate_deps(dir: &str) -> Vec<String> {
    dependencies(&root().join(dir).join("Cargo.toml"))
}

#[test]
fn crate_dependencies_follow_the_architecture() {
    // The ABI: no dependency but an optional serde (for the enums' spellings).
    let abi_manifest = std::fs::read_to_string(root().join("crates/abi/Cargo.toml")).unwrap();
    assert_eq!(crate_deps("crates/abi"), ["serde"]);
    assert!(
        abi_manifest.contains("optional = true"),
        "arfuse-abi's serde must stay optional"
    );
    let ir = crate_deps("crates/ir");
    assert!(!ir.is_empty());
    for d in &ir {
        assert!(d != "egg" && d != "cudarc", "arfuse-ir depends on {d}");
        assert!(
            !d.starts_with("arfuse-") || d == "arfuse-policy" || d == "arfuse-abi",
            "arfuse-ir depends on {d}"
        );
    }
    let policy = crate_deps("crates/policy");
    assert!(
        policy
            .iter()
            .all(|d| !d.starts_with("arfuse") || d == "arfuse-abi"),
        "{policy:?}"
    );

    let facade = dependencies(&root().join("Cargo.toml"));
    assert!(facade.contains(&"arfuse-rewrite".to_string()), "{facade:?}");
    assert!(
        !facade.contains(&"arfuse-runtime".to_string()),
        "{facade:?}"
    );

    let mut members: Vec<String> = std::fs::read_dir(root().join("crates"))
        .unwrap()
        .map(|e| format!("crates/{}", e.unwrap().file_name().to_string_lossy()))
        .collect();
    members.push("xtask".into());
    members.sort();
    let mut cudarc = Vec::new();
    let mut anyhow = Vec::new();
    for m in &members {
        let deps = crate_deps(m);
        if deps.iter().any(|d| d == "cudarc") {
            cudarc.push(m.as_str());
        }
        if deps.iter().any(|d| d == "anyhow") {
            anyhow.push(m.as_str());
        }
    }
    assert_eq!(cudarc, ["crates/runtime"]);
    assert_eq!(anyhow, ["crates/cli", "crates/gpu-check", "xtask"]);
    assert!(!facade.contains(&"anyhow".to_string()));
}

#[test]
fn inside_the_runtime_only_cuda_uses_cudarc() {
    let mut users = Vec::new();
    let mut stack = vec![root().join("crates/runtime/src")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).unwrap();
                // Code, not comments: a path into the crate.
                if text
                    .lines()
                    .filter(|l| !l.trim_start().starts_with("//"))
                    .any(|l| l.contains("cudarc::"))
                {
                    users.push(p.file_name().unwrap().to_string_lossy().to_string());
                }
            }
        }
    }
    assert_eq!(users, ["cuda.rs"]);
}
