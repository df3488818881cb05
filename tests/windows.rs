//! Windows change nothing but the e-graph totals: every graph the repository holds
//! (the model corpus on every target of its options file, every torch.export graph,
//! post-grad graph and all-reduce spelling) and deep builder stacks lower to the same
//! graph, site maps and report (the runner's totals aside) whether the e-graph holds
//! the whole graph or windows of a few nodes (`LowerOptions::window_nodes`), whose
//! boundaries then cut through every layer. And the threads that work on the windows
//! (`LowerOptions::threads`) change nothing at all, the runner's totals included (the
//! errors of a runner stopped at a limit: `crates/rewrite/tests/stacks.rs`).

use arfuse::{Graph, LowerOptions, Lowered, Target};
use std::path::{Path, PathBuf};

mod common;
mod hostile_cases;
use common::{fixtures, root};

/// Window sizes tried against the whole graph: a few nodes (a boundary in every
/// layer, windows smaller than one chain), odd sizes, about a layer, several layers,
/// and the default.
const WINDOWS: [usize; 6] = [
    1,
    16,
    37,
    100,
    512,
    arfuse::advanced::rewrite::DEFAULT_WINDOW_NODES,
];

fn lower(g: &Graph, target: &Target, window_nodes: usize, threads: usize) -> Lowered {
    let options = LowerOptions::default()
        .with_window_nodes(window_nodes)
        .with_threads(threads);
    arfuse::lower_with(g, target, &options)
        .unwrap_or_else(|e| panic!("window {window_nodes}, {threads} threads: {e}"))
}

/// Requires `a` and `b` to be the same lowering, report and runner totals included.
fn same_lowering(what: &str, a: &Lowered, b: &Lowered) {
    assert_eq!(
        a.graph.to_string(),
        b.graph.to_string(),
        "{what}: lowered graph"
    );
    assert_eq!(a.sites, b.sites, "{what}: site maps");
    assert_eq!(a.report, b.report, "{what}: report");
}

/// Lowers `g` whole and in every window size of [`WINDOWS`] smaller than it, on one
/// thread and on three (more than this machine may have: the helpers then share its
/// cores), and requires the same result.
fn same_in_windows(name: &str, g: &Graph, target: &Target) {
    let whole = lower(g, target, usize::MAX, 1);
    assert_eq!(whole.report.runner.windows, 1, "{name}: the whole graph");
    for w in WINDOWS.into_iter().filter(|&w| w < g.len()) {
        let cut = lower(g, target, w, 1);
        let what = format!("{name}, windows of {w} nodes");
        same_lowering(&format!("{what}, 3 threads"), &cut, &lower(g, target, w, 3));
        if w == 1 {
            // One window per all-reduce (a core range of one node holds at most one).
            assert_eq!(
                cut.report.runner.windows, whole.report.all_reduces_seen,
                "{what}: windows"
            );
        }
        assert_eq!(
            whole.graph.to_string(),
            cut.graph.to_string(),
            "{what}: lowered graph"
        );
        assert_eq!(whole.sites, cut.sites, "{what}: site maps");
        let mut report = cut.report.clone();
        report.runner = whole.report.runner.clone();
        assert_eq!(whole.report, report, "{what}: report");
    }
}

#[test]
fn corpus_models_lower_the_same_in_windows() {
    let all = fixtures();
    assert!(all.len() >= 10, "expected the model corpus");
    for f in &all {
        for t in f.targets() {
            let target = Target::preset(&t).unwrap();
            same_in_windows(&format!("{} on {t}", f.name), &f.graph, &target);
        }
    }
}

/// Every graph file under `dir` (recursively) that imports with the default options.
fn exported_graphs(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        let name = p.to_string_lossy().to_string();
        if p.is_dir() {
            exported_graphs(&p, out);
        } else if (name.ends_with(".json") || name.ends_with(".json.gz"))
            && !name.ends_with("manifest.json")
        {
            out.push(p);
        }
    }
}

#[test]
fn exported_and_post_grad_graphs_lower_the_same_in_windows() {
    let mut files = Vec::new();
    exported_graphs(&root().join("ir-fixtures/exported"), &mut files);
    exported_graphs(&root().join("ir-fixtures/postgrad"), &mut files);
    let mut lowered = 0;
    for path in &files {
        let bytes = std::fs::read(path).unwrap();
        // Spellings that need an option to import (a framework's own all-reduce) are
        // covered by tests/hf_exports.rs; a file that is not a graph is skipped.
        let Ok(imported) = arfuse::advanced::import::load_any(&bytes) else {
            continue;
        };
        let g = imported.graph;
        let mut target = Target::preset("h200-sxm-x8").unwrap();
        if let Some(w) = g.recorded_world_size() {
            target.world_size = w as u32;
        }
        same_in_windows(&path.display().to_string(), &g, &target);
        lowered += 1;
    }
    assert!(
        lowered >= 90,
        "expected the exported corpus, lowered {lowered} graphs"
    );
}

#[test]
fn generated_hostile_graphs_lower_the_same_in_windows() {
    // The generated hostile cases that load: fan-outs of 5,000 users, 2,000 sites on one
    // value, a chain of 10,000 views between an all-reduce and its norm (the halos
    // follow views to the end), hundreds of outputs on one node.
    let mut lowered = 0;
    for case in hostile_cases::generated_cases() {
        if case.slow {
            continue; // refused while parsing or inflating: no graph
        }
        let Ok(imported) = arfuse::advanced::import::load_any(&(case.input)()) else {
            continue;
        };
        let target = Target::preset(hostile_cases::LOWER_PRESET).unwrap();
        if arfuse::lower(&imported.graph, &target).is_err() {
            continue; // the snapshot in tests/hostile.rs holds the error
        }
        same_in_windows(case.name, &imported.graph, &target);
        lowered += 1;
    }
    assert!(
        lowered >= 5,
        "expected the generated graphs, lowered {lowered}"
    );
}
