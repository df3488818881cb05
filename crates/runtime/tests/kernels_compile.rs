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
        let defines: Vec<String> = v
            .defines()
            .iter()
            .map(|(k, x)| format!("{k}={x}"))
            .collect();
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
    // Two plain threads (the CI machine has two cores); NVRTC is thread safe.
    let jobs: Vec<(variants::Variant, Arch)> = variants::all()
        .into_iter()
        .flat_map(|v| v.archs().into_iter().map(move |a| (v, a)))
        .collect();
    let results: Vec<(String, Arch, Result<PtxasStats, String>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2)
            .map(|k| {
                let jobs = &jobs;
                scope.spawn(move || {
                    let mut out = Vec::new();
                    for (v, arch) in jobs.iter().skip(k).step_by(2) {
                        let tag = format!("{v} {}", arch.name());
                        let r = variants::compile(v, *arch, true)
                            .map_err(|e| e.to_string())
                            .and_then(|c| {
                                if c.cubin.is_empty() {
                                    return Err("empty cubin".to_string());
                                }
                                PtxasStats::parse(&c.log)
                                    .ok_or_else(|| "no ptxas stats in log".to_string())
                            });
                        out.push((tag, *arch, r));
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("compile thread panicked"))
            .collect()
    });
    let mut failures = Vec::new();
    let mut compiled = 0usize;
    // Highest register count per architecture, with the variant that has it.
    let mut max_regs: Vec<(Arch, u32, String)> =
        Arch::ALL.iter().map(|a| (*a, 0, String::new())).collect();
    for (tag, arch, r) in results {
        match r {
            Ok(s) => {
                compiled += 1;
                // No variant may spill: every spill is a defect to fix in the kernel.
                if s.spill_stores > 0 || s.spill_loads > 0 {
                    failures.push(format!("{tag}: spills {s:?}"));
                }
                if let Some(m) = max_regs.iter_mut().find(|m| m.0 == arch) {
                    if s.registers > m.1 {
                        *m = (arch, s.registers, tag);
                    }
                }
            }
            Err(e) => failures.push(format!("{tag}: {e}")),
        }
    }
    let expected: usize = variants::all().iter().map(|v| v.archs().len()).sum();
    println!(
        "compiled {compiled}/{expected} variant x arch ({} variants) in {:.1} s, no spills allowed",
        variants::all().len(),
        start.elapsed().as_secs_f64(),
    );
    for (arch, regs, tag) in &max_regs {
        println!("max registers {}: {regs} ({tag})", arch.name());
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_eq!(compiled, expected);
    // Both architectures really are exercised.
    assert!(jobs.iter().any(|(_, a)| *a == Arch::Sm90a));
    assert!(jobs.iter().any(|(_, a)| *a == Arch::Sm100a));
}
