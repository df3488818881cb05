//! arfuse fuzz targets: the bodies live in `targets.rs` (shared with the CI smoke test
//! in `tests/hostile.rs`); `fuzz_targets/*.rs` are the libFuzzer entry points.
//! See `docs/fuzzing.md`.

/// The arfuse API the bodies use, named as the `arfuse` facade names it (the layers
/// under `arfuse::advanced`, the pass at its top; `tests/hostile.rs` builds the same
/// module from the facade).
pub mod af {
    pub use arfuse_import as import;
    pub use arfuse_ir as ir;
    pub use arfuse_policy as policy;
    pub use arfuse_rewrite::{lower, lower_with, LowerError, LowerOptions, Lowered};
}

pub mod targets;

#[cfg(test)]
mod tests {
    use super::targets::*;

    /// The structured generator mostly builds graphs that validate and lower.
    #[test]
    fn structured_generator_stats() {
        let mut rng = Rng(0x5eed);
        let (mut valid, mut lowered, mut fused) = (0, 0, 0);
        let n = 2000;
        for _ in 0..n {
            let len = rng.below(256);
            let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            let o = fuzz_structured(&data);
            valid += usize::from(o.valid_graph);
            lowered += usize::from(o.lowered);
            fused += usize::from(o.fused > 0);
        }
        eprintln!("{n} inputs: {valid} valid graphs, {lowered} lowered, {fused} with fusions");
    }
}

#[cfg(test)]
mod pick {
    /// `PICK_DIR=... cargo test --release --lib pick -- --nocapture`: lists corpus
    /// inputs of fuzz_structured that lower with fusions (to refresh corpus-seed/).
    #[test]
    fn pick_structured_seeds() {
        let Ok(dir) = std::env::var("PICK_DIR") else {
            return;
        };
        let mut rows = Vec::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let data = std::fs::read(&p).unwrap();
            let o = super::targets::fuzz_structured(&data);
            if o.lowered {
                rows.push((o.fused, data.len(), p));
            }
        }
        rows.sort();
        for (f, n, p) in rows {
            println!("{f} {n} {}", p.display());
        }
    }
}
