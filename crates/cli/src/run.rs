//! Lowering the pairs of a run: each graph read once, lowered, checked when asked,
//! written, and reported.

use crate::inputs::{read_graph, Job};
use crate::outputs::Writer;
use crate::targets::{assumed_world_size_note, load_target, target_name};
use crate::ReportFormat;
use anyhow::Result;
use arfuse::advanced::reference::SiteTokens;
use arfuse::{Graph, Lowered, Target};
use serde_json::{json, Value};
use std::path::Path;
use std::process::ExitCode;

/// What every pair of a run shares.
pub(crate) struct Settings<'a> {
    pub args: &'a crate::LowerArgs,
    pub options: arfuse::LowerOptions,
    pub import: arfuse::advanced::import::ImportOptions,
}

impl Settings<'_> {
    pub fn new(args: &crate::LowerArgs) -> Settings<'_> {
        let mut options = arfuse::LowerOptions::default();
        options.group.clone_from(&args.group);
        options.shared_hidden_sizes.clone_from(&args.shared_hidden);
        let mut import = arfuse::advanced::import::ImportOptions::default();
        import.all_reduce_ops.clone_from(&args.all_reduce_ops);
        Settings {
            args,
            options,
            import,
        }
    }
}

/// Lowers every pair (each graph read once), writing what succeeds; prints the JSON
/// report when asked. Exit status 1 when any pair failed, saying how many.
pub(crate) fn run_jobs(
    s: &Settings<'_>,
    jobs: Vec<Job>,
    outs: Vec<Vec<Writer>>,
) -> Result<ExitCode> {
    let (mut pairs, mut failed, mut json) = (0usize, 0usize, Vec::new());
    for (job, writers) in jobs.into_iter().zip(outs) {
        let input = job.input.as_path();
        let graph = job.graph.unwrap_or_else(|| read_graph(input, &s.import));
        let graph = graph.map_err(|e| format!("{e:#}"));
        // A graph read to choose its target and found unreadable: one pair, no target.
        let none = job.targets.is_empty().then_some(None);
        let specs: Vec<Option<&String>> = job.targets.iter().map(Some).chain(none).collect();
        let mut writers = writers.into_iter();
        for (k, spec) in specs.into_iter().enumerate() {
            pairs += 1;
            let outcome = match (&graph, spec, writers.next()) {
                (Ok(g), Some(spec), Some(w)) => load_target(spec)
                    .map_err(|e| format!("{e:#}"))
                    .and_then(|(target, name)| lower_pair(input, g, &target, &name, s, w)),
                (Err(e), ..) => Err(e.clone()),
                _ => Err(format!("{}: no target or output", input.display())),
            };
            let Err(msg) = outcome.map(|entry| json.extend(entry)) else {
                continue;
            };
            failed += 1;
            let name = spec.map(|t| target_name(t));
            match (&graph, &name) {
                (Err(_), Some(name)) if k > 0 => eprintln!(
                    "error: {}: not lowered for {name}: the graph could not be read (above)",
                    input.display()
                ),
                _ => eprintln!("error: {msg}"),
            }
            json.push(json!({"input": input.display().to_string(), "target": name, "error": msg}));
        }
    }
    if s.args.report == ReportFormat::Json {
        println!("{}", serde_json::to_string_pretty(&json)?);
    }
    if failed > 0 {
        eprintln!("{failed} of {pairs} (graph, target) pair(s) failed");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// Lowers one pair, checks it when asked, writes its outputs, prints its table report;
/// returns its JSON report entry (with `--report json`), or the error naming the input.
fn lower_pair(
    input: &Path,
    graph: &Graph,
    target: &Target,
    name: &str,
    s: &Settings<'_>,
    writer: Writer,
) -> Result<Option<Value>, String> {
    let input = input.display();
    check_group(graph, s.options.group.as_deref()).map_err(|e| format!("{input}: {e}"))?;
    match assumed_world_size_note(graph, target, name) {
        Some(note) if s.args.world_size.is_none() => eprintln!("note: {input}: {note}"),
        _ => {}
    }
    let start = std::time::Instant::now();
    let lowered = arfuse::lower_with(graph, target, &s.options)
        .map_err(|e| format!("lowering {input} for {name}: {e}"))?;
    let took = start.elapsed().as_secs_f64() * 1e3;
    let r = &lowered.report;
    // Only collectives arfuse does not understand: not a success.
    if r.all_reduces_seen == 0 && r.already_fused == 0 && !r.unknown_collectives.is_empty() {
        return Err(format!(
            "{input}: no all-reduce arfuse understands, only collective-looking ops it keeps \
             opaque ({}); if they are all-reduces, name them with --all-reduce-op NAME[=GROUP]",
            r.unknown_collectives.join(", ")
        ));
    }
    // The check before anything is written: a pair whose check fails leaves no output.
    let tokens = match (s.args.check, s.args.check_all) {
        (_, true) => Some(SiteTokens::Plan),
        (true, false) => Some(SiteTokens::PlanPerKind),
        (false, false) => None,
    };
    let check = tokens.map(|t| check_pair(graph, &lowered, target.world_size, t));
    let failed = |e| format!("checking {input} on {name}: {e}");
    let check = check.transpose().map_err(failed)?;
    let differ = check.as_ref().and_then(|(_, _, differ)| differ.clone());
    // The outputs before the report: a reader closing stdout early (`| head`) must not
    // cost the lowered graph.
    let written = match differ {
        None => writer.write(&lowered.graph.to_json_string(), || lowered.graph.to_dot()),
        Some(_) => Ok(Vec::new()),
    };
    let written = written.map_err(|e| format!("{e:#}"))?;
    if s.args.report == ReportFormat::Table {
        let nodes = graph.len();
        println!("== {input} on {name} ({nodes} graph nodes, lowered in {took:.1} ms)");
        let table = if s.args.sites {
            r.display_every_site().to_string()
        } else {
            r.to_string()
        };
        println!("{table}");
    }
    if let Some((summary, ..)) = &check {
        match s.args.report {
            ReportFormat::Table => println!("{summary}"),
            ReportFormat::Json => eprintln!("{summary}"),
        }
    }
    if let Some(why) = differ {
        return Err(format!("{input} on {name}: {why} (nothing written)"));
    }
    for p in &written {
        eprintln!("wrote {}", p.display());
    }
    let mut entry = json!({"input": input.to_string(), "target": name, "report": r});
    if let Some((_, check, _)) = check {
        entry["check"] = check;
    }
    Ok((s.args.report == ReportFormat::Json).then_some(entry))
}

/// That `--group`, when given, names a process group of the graph's all-reduces.
fn check_group(graph: &Graph, group: Option<&str>) -> Result<(), String> {
    use arfuse::advanced::ir::Op;
    let Some(g) = group else { return Ok(()) };
    let groups: std::collections::BTreeSet<&str> = graph
        .nodes()
        .filter_map(|(_, n)| match &n.op {
            Op::AllReduce { group, .. } => Some(group.as_str()),
            Op::FusedAllreduceNorm(f) => Some(f.group.as_str()),
            _ => None,
        })
        .collect();
    if groups.is_empty() || groups.contains(g) {
        return Ok(());
    }
    let list = groups.into_iter().collect::<Vec<_>>().join(", ");
    let why = format!("--group {g:?}: no all-reduce has it (groups: {list})");
    Err(why)
}

/// `--check`: the per-site equivalence check of one lowered pair on `w` ranks: its table
/// (`check (N s): ...`), its JSON report entry, and, when a site differs, how many do.
fn check_pair(
    graph: &Graph,
    lowered: &Lowered,
    w: u32,
    tokens: SiteTokens<'_>,
) -> Result<(String, Value, Option<String>), arfuse::advanced::reference::ReferenceError> {
    const SEED: u64 = 0;
    let start = std::time::Instant::now();
    let sites = &lowered.sites;
    let result =
        arfuse::advanced::reference::check_sites(graph, &lowered.graph, sites, w, tokens, SEED)?;
    let seconds = start.elapsed().as_secs_f64();
    let mut summary = format!("check ({seconds:.2} s): {result}");
    let already = lowered.report.already_fused;
    if already > 0 {
        summary += &format!(
            "  {already} fused node(s) already in the input are kept as they are and not \
             checked (no original chain to compare with)\n"
        );
    }
    let (bad, all) = (result.failures().len(), result.sites.len());
    let differ = (bad > 0)
        .then(|| format!("{bad} of {all} fused sites differ from the chains they replaced"));
    let json = json!({
        "contract": result.contract,
        "equivalent": result.is_equivalent(),
        "world_size": result.world_size,
        "seed": result.seed,
        "sites": all,
        "kept_nodes": result.kept_nodes,
        "already_fused_not_checked": already,
        "groups": result.groups(),
        "seconds": seconds,
    });
    Ok((summary, json, differ))
}
