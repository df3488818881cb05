//! The snapshot corpus: every model graph under ir-fixtures/models/, lowered for every
//! target preset its options file names. Snapshots hold the report and a per-site
//! summary a reviewer can read (each kind of site: the nodes it replaced and its fused
//! node); the whole lowered graph's canonical text is a checked fixture under
//! ir-fixtures/lowered/ (`ARFUSE_BLESS=1` rewrites it); assertions hold the site counts.

use arfuse::advanced::policy::{resolve_backend, BackendDecision};
use arfuse::{Graph, LowerOptions, Target};

mod common;
use common::{fixtures, load, root, Fixture};

/// Hidden sizes of the graphs named in `shares_workspace_with` (a speculative-decoding
/// draft and its target share one workspace).
fn shared_hidden_sizes(f: &Fixture) -> Vec<u64> {
    let mut out = Vec::new();
    for other in f.options["shares_workspace_with"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let other = load(
            &root()
                .join("ir-fixtures/models")
                .join(format!("{}.options.json", other.as_str().unwrap())),
        );
        out.extend(hidden_sizes(&other.graph));
    }
    out
}

/// Last dims of every all-reduce in a graph.
fn hidden_sizes(g: &Graph) -> Vec<u64> {
    let mut hs: Vec<u64> = g
        .nodes()
        .filter(|(_, n)| matches!(n.op, arfuse::advanced::ir::Op::AllReduce { .. }))
        .filter_map(|(_, n)| n.outputs[0].shape.last().and_then(|d| d.as_const()))
        .collect();
    hs.sort();
    hs.dedup();
    hs
}

#[test]
fn every_model_lowers_for_every_target_with_the_expected_sites() {
    let all = fixtures();
    assert!(
        all.len() >= 10,
        "expected the model corpus, found {}",
        all.len()
    );
    for f in &all {
        let expected = f.options["expected_sites"].as_u64().unwrap() as usize;
        let targets = f.targets();
        assert!(!targets.is_empty(), "{}: no targets", f.name);
        for t in &targets {
            let target = Target::preset(t).unwrap();
            let options = LowerOptions::default().with_shared_hidden_sizes(shared_hidden_sizes(f));
            let lowered = arfuse::lower_with(&f.graph, &target, &options)
                .unwrap_or_else(|e| panic!("{} on {t}: {e}", f.name));
            let report = &lowered.report;
            assert_eq!(
                report.all_reduces_seen,
                f.options["all_reduces"].as_u64().unwrap() as usize,
                "{} on {t}",
                f.name
            );
            match resolve_backend(&target).unwrap() {
                BackendDecision::Fuse { .. } => assert_eq!(
                    report.all_reduces_fused, expected,
                    "{} on {t}: fused {} of {} sites\n{report}",
                    f.name, report.all_reduces_fused, expected
                ),
                BackendDecision::NoFusion { reason } => {
                    assert_eq!(report.all_reduces_fused, 0, "{} on {t}", f.name);
                    assert!(
                        report
                            .sites
                            .iter()
                            .all(|s| s.reason.as_deref().is_some_and(|r| !r.is_empty())),
                        "{} on {t}: every unfused site needs a reason",
                        f.name
                    );
                    assert!(!reason.is_empty());
                }
            }
            lowered.graph.validate().unwrap();
            let mut settings = insta::Settings::clone_current();
            settings.set_snapshot_suffix(format!("{}@{t}", f.name));
            settings.set_prepend_module_to_snapshot(false);
            settings.bind(|| {
                insta::assert_snapshot!("report", report.to_string());
                insta::assert_snapshot!("sites", site_summary(&f.graph, &lowered));
            });
            check_lowered_fixture(&format!("{}@{t}", f.name), &lowered.graph.canonical_text());
        }
    }
}

/// One node without its operands, as the canonical text writes it: op, attributes,
/// output types, module; a layer index in the module written `*`.
fn node_text(n: &arfuse::advanced::ir::Node) -> String {
    let mut out = n.op.name().to_string();
    let attrs = n.op.attrs_json();
    if !attrs.is_empty() {
        out += &format!(" {}", serde_json::Value::Object(attrs));
    }
    let types: Vec<String> = n.outputs.iter().map(|t| t.to_string()).collect();
    out += &format!(" : {}", types.join(", "));
    if let Some(m) = &n.module {
        let parts: Vec<&str> = m
            .split('.')
            .map(|p| match p.parse::<u64>() {
                Ok(_) => "*",
                Err(_) => p,
            })
            .collect();
        out += &format!("  # {}", parts.join("."));
    }
    out
}

/// The reviewable summary of a lowering: for each kind of site (the same fused node and
/// replaced nodes, but for layer indices), how many there are, the first one's
/// all-reduce, the nodes it replaced and the fused node, in the order of first use.
fn site_summary(original: &Graph, lowered: &arfuse::Lowered) -> String {
    let mut kinds: Vec<(String, usize, String)> = Vec::new();
    for site in &lowered.sites {
        let node = |g: &Graph, id: &str| node_text(g.node(g.find(id).unwrap()));
        let mut block = String::from("  replaced:\n");
        for id in &site.replaced_nodes {
            block += &format!("    {}\n", node(original, id));
        }
        block += &format!("  fused:\n    {}\n", node(&lowered.graph, &site.fused_node));
        match kinds.iter_mut().find(|(b, ..)| *b == block) {
            Some((_, n, _)) => *n += 1,
            None => kinds.push((block, 1, site.all_reduce.clone())),
        }
    }
    let mut out = format!("{} sites, {} kinds\n", lowered.sites.len(), kinds.len());
    for (block, n, first) in kinds {
        out += &format!("{n} site(s), the first at all-reduce `{first}`:\n{block}");
    }
    out
}

/// Compares a lowered graph's canonical text with its checked fixture,
/// `ir-fixtures/lowered/<name>.txt.gz`, naming the first line that differs;
/// `ARFUSE_BLESS=1` writes the fixture instead.
fn check_lowered_fixture(name: &str, text: &str) {
    use std::io::{Read, Write};
    let path = root().join(format!("ir-fixtures/lowered/{name}.txt.gz"));
    if std::env::var("ARFUSE_BLESS").is_ok_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut gz = flate2::GzBuilder::new()
            .mtime(0)
            .write(Vec::new(), flate2::Compression::best());
        gz.write_all(text.as_bytes()).unwrap();
        std::fs::write(&path, gz.finish().unwrap()).unwrap();
        return;
    }
    let bless = "ARFUSE_BLESS=1 cargo test -p arfuse --test models rewrites it";
    let gz = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e} ({bless})", path.display()));
    let mut want = String::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_string(&mut want)
        .unwrap();
    if want == text {
        return;
    }
    let (got_lines, want_lines) = (text.lines().count(), want.lines().count());
    let first = text.lines().zip(want.lines()).position(|(a, b)| a != b);
    let at = first.unwrap_or(got_lines.min(want_lines));
    panic!(
        "{name}: the lowered graph differs from {} at line {} ({got_lines} lines, fixture \
         {want_lines})\n  now:     {}\n  fixture: {}\nif the change is intended, {bless}",
        path.display(),
        at + 1,
        text.lines().nth(at).unwrap_or("(end)"),
        want.lines().nth(at).unwrap_or("(end)"),
    );
}

#[test]
fn glm5_fp8_on_h200_is_the_seed_case_handled() {
    let f = load(&root().join("ir-fixtures/models/glm5_fp8_tp8.options.json"));
    let target = Target::preset("h200-sxm-x8").unwrap();
    let lowered = arfuse::lower(&f.graph, &target).unwrap();
    let fused: Vec<_> = lowered
        .graph
        .nodes()
        .filter_map(|(_, n)| match &n.op {
            arfuse::advanced::ir::Op::FusedAllreduceNorm(a) => Some(a.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(fused.len(), 157);
    for a in &fused {
        let plan = a.plan.as_ref().expect("a fused node carries its plan");
        assert_eq!(plan.backend(), arfuse::advanced::ir::Backend::Mnnvl);
        assert_eq!(plan.max_token_num, 42);
        assert_eq!(plan.workspace.lamport_buffer_bytes, 1_179_648);
        // arfuse's kernels: 256 + 3 * 1,179,648, against FlashInfer's 3,540,992.
        assert_eq!(plan.workspace.total_bytes_per_rank, 3_539_200);
        let ranges: Vec<(u64, u64, arfuse::advanced::ir::Strategy)> = plan
            .dispatch
            .iter()
            .map(|r| (r.min_tokens, r.max_tokens, r.strategy))
            .collect();
        assert_eq!(
            ranges,
            vec![
                (1, 10, arfuse::advanced::ir::Strategy::OneShot),
                (11, 42, arfuse::advanced::ir::Strategy::TwoShot),
                (43, 8192, arfuse::advanced::ir::Strategy::Unfused)
            ]
        );
        // Every fused T fits ONE Lamport buffer (the seed failure needed 3,932,160 at T=40).
        for r in &plan.dispatch {
            assert!(r.required_bytes <= plan.workspace.lamport_buffer_bytes);
        }
    }
}

/// Issue 17: deterministic mode keeps fusion with arfuse's kernels (every strategy and
/// arfuse-runtime's unfused path reduce in one order) and the report says so.
#[test]
fn deterministic_llama_fuses_every_site_and_states_batch_invariance() {
    let f = load(&root().join("ir-fixtures/models/llama31_8b_tp8.options.json"));
    let mut target = Target::preset("h200-sxm-x8").unwrap();
    target.deterministic = true;
    let lowered = arfuse::lower(&f.graph, &target).unwrap();
    let r = &lowered.report;
    assert_eq!((r.all_reduces_fused, r.all_reduces_seen), (65, 65));
    let text = r.to_string();
    assert!(
        text.contains("batch-invariant: one reduction order on all paths"),
        "{text}"
    );
    // With the engine's all-reduce serving T > 64 it is refused, with the reason.
    target.unfused_all_reduce = arfuse::advanced::policy::UnfusedAllReduce::Engine;
    let lowered = arfuse::lower(&f.graph, &target).unwrap();
    assert_eq!(lowered.report.all_reduces_fused, 0);
    assert!(lowered.report.to_string().contains("engine's all-reduce"));
}

#[test]
fn lowering_twice_changes_nothing_and_is_deterministic() {
    for f in fixtures()
        .iter()
        .filter(|f| f.name.starts_with("llama31_8b") || f.name.starts_with("deepseek_v3"))
    {
        let target = Target::preset("b200-x8").unwrap();
        let a = arfuse::lower(&f.graph, &target).unwrap();
        let b = arfuse::lower(&f.graph, &target).unwrap();
        assert_eq!(
            a.graph.to_json_string(),
            b.graph.to_json_string(),
            "{}",
            f.name
        );
        let again = arfuse::lower(&a.graph, &target).unwrap();
        assert_eq!(
            again.graph.to_json_string(),
            a.graph.to_json_string(),
            "{}",
            f.name
        );
    }
}

#[test]
fn a_graph_is_only_lowered_for_its_own_tensor_parallel_size() {
    let f = load(&root().join("ir-fixtures/models/llama31_8b_tp8.options.json"));
    let err = arfuse::lower(&f.graph, &Target::preset("b300-x4").unwrap()).unwrap_err();
    assert!(
        matches!(
            err,
            arfuse::LowerError::WorldSizeMismatch {
                graph: 8,
                target: 4
            }
        ),
        "{err}"
    );
}

#[test]
fn a_lowered_graph_is_refused_for_another_target_instead_of_keeping_a_stale_plan() {
    let f = load(&root().join("ir-fixtures/models/llama31_8b_tp8.options.json"));
    let h200 = Target::preset("h200-sxm-x8").unwrap();
    let lowered = arfuse::lower(&f.graph, &h200).unwrap().graph;
    // Same target: unchanged (idempotent).
    assert_eq!(
        arfuse::lower(&lowered, &h200)
            .unwrap()
            .graph
            .to_json_string(),
        lowered.to_json_string()
    );
    // B200 plans another max_token_num (1 MiB cap at W=8, not 0.5 MiB).
    for other in ["b200-x8", "h200-nvl-x8"] {
        let err = arfuse::lower(&lowered, &Target::preset(other).unwrap()).unwrap_err();
        assert!(
            matches!(err, arfuse::LowerError::StalePlan { .. }),
            "{other}: {err}"
        );
    }
}
