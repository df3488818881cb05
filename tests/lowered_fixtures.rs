//! Committed lowered graphs match the current planner (issue 13): every graph under
//! `ir-fixtures/` (except the deliberately malformed and hostile ones) that already
//! carries fused nodes is lowered again for each target its `<name>.options.json`
//! names, which fails with `StalePlan` unless every carried plan is exactly the one
//! this planner makes, and must give back the same graph.

use arfuse::{Graph, Target};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn carried_plans(g: &Graph) -> usize {
    g.nodes()
        .filter(|(_, n)| matches!(&n.op, arfuse::advanced::ir::Op::FusedAllreduceNorm(a) if a.plan.is_some()))
        .count()
}

fn graphs_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if p.is_dir() {
            if name != "malformed" && name != "hostile" {
                graphs_under(&p, out);
            }
        } else if name.ends_with(".json") && !name.ends_with(".options.json") {
            out.push(p);
        }
    }
}

fn targets_of(graph: &Path) -> Vec<String> {
    let stem = graph
        .file_name()
        .unwrap()
        .to_string_lossy()
        .replace(".json", "");
    let options = graph.with_file_name(format!("{stem}.options.json"));
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&options).unwrap_or_else(|_| {
            panic!(
                "{} is lowered but has no options file naming its target",
                graph.display()
            )
        }))
        .unwrap();
    v["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn every_committed_lowered_graph_re_plans_to_its_carried_plan() {
    let mut paths = Vec::new();
    graphs_under(&root().join("ir-fixtures"), &mut paths);
    paths.sort();
    let mut checked = 0usize;
    for p in paths {
        let Ok(loaded) = arfuse::advanced::import::load_any(&std::fs::read(&p).unwrap()) else {
            continue; // not an arfuse or torch.export graph (e.g. a config)
        };
        let g = loaded.graph;
        if carried_plans(&g) == 0 {
            continue;
        }
        for t in targets_of(&p) {
            let target = Target::preset(&t).unwrap();
            let again = arfuse::lower(&g, &target)
                .unwrap_or_else(|e| panic!("{} on {t}: {e}", p.display()));
            assert_eq!(
                again.graph.to_json_string(),
                g.to_json_string(),
                "{} on {t}: re-lowering changed the graph",
                p.display()
            );
            checked += 1;
        }
    }
    assert!(checked >= 1, "no lowered fixture found");
}

/// The stale-plan check itself: the same fixture for another machine is refused,
/// naming the node and both plans.
#[test]
fn a_lowered_fixture_is_refused_for_another_target() {
    let p = root().join("ir-fixtures/small/nvfp4_final_norm.json");
    let g = Graph::from_json_slice(&std::fs::read(&p).unwrap()).unwrap();
    let e = arfuse::lower(&g, &Target::preset("b300-x4").unwrap()).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("fused node `fused`") && text.contains("max_token_num 73"),
        "{text}"
    );
}
