//! CI check without a GPU: every kernel variant compiles with NVRTC for sm_90a and
//! sm_100a (NVRTC also runs ptxas for real architectures, so inline PTX is checked),
//! uses no spills, and the variant list matches its snapshot.
//!
//! NVRTC comes from the PyPI wheel (`.ci/install-cuda-wheels.sh`), found without any
//! environment variable. Without NVRTC the compile test prints a skip line, except
//! under `CI=true`, where a missing NVRTC is a failure.

use arfuse_runtime::nvrtc::{self, PtxasStats};
use arfuse_runtime::variants::{self, Arch};
use std::time::Instant;

#[test]
fn variant_list_snapshot() {
    let mut text = String::new();
    for v in variants::all() {
        let archs: Vec<&str> = v.archs().iter().map(|a| a.name()).collect();
        let defines: Vec<String> = v.defines().iter().map(|(k, x)| format!("{k}={x}")).collect();
        text.push_str(&format!(
            "{:<40} {:<8} {:<16} {}\n",
            v.name(),
            v.entry(),
            archs.join(","),
            defines.join(" ")
        ));
    }
    insta::assert_snapshot!("variants", text);
}

#[test]
fn every_variant_compiles_for_sm90a_and_sm100a_without_spills() {
    let n = match nvrtc::nvrtc() {
        Ok(n) => n,
        Err(e) => {
            if std::env::var("CI").map(|v| v == "true").unwrap_or(false) {
                panic!("CI=true but NVRTC is missing: {e}");
            }
            println!("skipped: NVRTC not found ({e}); run .ci/install-cuda-wheels.sh");
            return;
        }
    };
    println!(
        "NVRTC {}.{} from {}",
        n.version().0,
        n.version().1,
        n.path()
    );
    assert!(
        n.supports_sm100a(),
        "NVRTC {:?} cannot target sm_100a (needs >= 12.8)",
        n.version()
    );
    let start = Instant::now();
    let mut failures = Vec::new();
    let mut compiled = 0usize;
    let mut max_regs = (0u32, String::new());
    for v in variants::all() {
        for arch in v.archs() {
            match variants::compile(&v, arch, true) {
                Ok(out) => {
                    compiled += 1;
                    assert!(!out.cubin.is_empty(), "{v} {}: empty cubin", arch.name());
                    assert!(
                        out.ptx.contains(".entry ") || out.ptx.is_empty(),
                        "{v}: PTX without an entry"
                    );
                    match PtxasStats::parse(&out.log) {
                        Some(s) => {
                            if s.spill_stores != 0 || s.spill_loads != 0 || s.stack_frame != 0 {
                                failures.push(format!("{v} {}: spills {s:?}", arch.name()));
                            }
                            if s.registers > max_regs.0 {
                                max_regs = (s.registers, format!("{v} {}", arch.name()));
                            }
                        }
                        None => failures.push(format!("{v} {}: no ptxas stats in log", arch.name())),
                    }
                }
                Err(e) => failures.push(e.to_string()),
            }
        }
    }
    let expected: usize = variants::all().iter().map(|v| v.archs().len()).sum();
    println!(
        "compiled {compiled}/{expected} variant x arch in {:.1} s; max registers {} ({})",
        start.elapsed().as_secs_f64(),
        max_regs.0,
        max_regs.1
    );
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
    assert_eq!(compiled, expected);
    // Both architectures really are exercised.
    assert!(variants::all().iter().any(|v| v.archs().contains(&Arch::Sm90a)));
}
