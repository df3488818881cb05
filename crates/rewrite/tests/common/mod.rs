#![allow(dead_code)] // shared by several test binaries; each uses only part of it
pub mod builder;

use arfuse_policy::Target;
use arfuse_rewrite::{lower, Lowered};

/// 8x H200 SXM (SM 90, W = 8, NVSwitch).
pub fn h200() -> Target {
    Target::preset("h200-sxm-x8").expect("preset")
}

/// 8x B200 (SM 100).
pub fn b200() -> Target {
    Target::preset("b200-x8").expect("preset")
}

/// Lowers or panics with the error (tests only).
pub fn lowered(g: &arfuse_ir::Graph, t: &Target) -> Lowered {
    match lower(g, t) {
        Ok(l) => l,
        Err(e) => panic!("lower failed: {e}"),
    }
}

/// One line per all-reduce: id, status, pattern, outputs, reason (stable across policy
/// wording changes except the reasons of refusals this crate writes).
pub fn summary(l: &Lowered) -> String {
    let mut out = format!(
        "fused {} / {} all-reduces\n",
        l.report.all_reduces_fused, l.report.all_reduces_seen
    );
    for s in &l.report.sites {
        out.push_str(&format!(
            "{}: {} {} [{}]{}\n",
            s.all_reduce,
            if s.fused { "fused" } else { "NOT fused" },
            s.pattern.as_deref().unwrap_or("-"),
            s.outputs.join(","),
            if s.fused {
                format!(" code {:?}", s.pattern_code.unwrap_or(0))
            } else {
                format!(" because {}", s.reason.as_deref().unwrap_or("?"))
            }
        ));
    }
    for w in &l.report.warnings {
        out.push_str(&format!("warning: {w}\n"));
    }
    out
}
