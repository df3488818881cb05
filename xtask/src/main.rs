//! `cargo xtask`: the project's commands for people.
//!
//! - `cargo xtask lower [GRAPH|DIR] [--target PRESET|FILE] [--out FILE] [--report table|json] [--dot FILE] [--group NAME] [--shared-hidden H]`
//! - `cargo xtask test [CARGO TEST ARGS]`
//! - `cargo xtask gpu-check [--build-only]`
//!
//! Run `cargo xtask help` for details.

use anyhow::{bail, Context, Result};
use arfuse::{Graph, LowerOptions, Target};
use clap::{Parser, Subcommand, ValueEnum};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The bundled model graph `cargo xtask lower` lowers when given no path.
const DEFAULT_GRAPH: &str = "ir-fixtures/models/llama31_8b_tp8.json";
/// The target preset used when `--target` is not given.
const DEFAULT_TARGET: &str = "h200-sxm-x8";

#[derive(Parser)]
#[command(name = "cargo xtask", about = "arfuse developer and user commands")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum ReportFormat {
    /// A readable table.
    Table,
    /// The report as JSON.
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Lower a graph (arfuse JSON, torch.export JSON or .pt2) or every graph in a
    /// directory for a target, print the report and write the lowered graph.
    Lower {
        /// Graph file or directory. Default: the bundled Llama-3.1-8B TP8 graph on
        /// h200-sxm-x8.
        path: Option<PathBuf>,
        /// Target preset name (see `--list-targets`) or a TOML file. Default: the
        /// presets the graph's `<name>.options.json` lists, else h200-sxm-x8.
        #[arg(long, short)]
        target: Option<String>,
        /// Where to write the lowered graph (one graph and target only). Default:
        /// <checkout>/target/arfuse/<name>.<target>.lowered.json
        #[arg(long, short)]
        out: Option<PathBuf>,
        /// Report format.
        #[arg(long, value_enum, default_value = "table")]
        report: ReportFormat,
        /// Also write the lowered graph as Graphviz DOT (one input only).
        #[arg(long)]
        dot: Option<PathBuf>,
        /// The layers' tensor-parallel process group (default: inferred from the graph).
        #[arg(long)]
        group: Option<String>,
        /// Hidden size of another graph sharing this graph's workspace (e.g. a
        /// speculative-decoding draft); repeatable. The workspace is sized for the widest.
        #[arg(long = "shared-hidden", value_name = "H")]
        shared_hidden: Vec<u64>,
        /// List the target presets and exit.
        #[arg(long)]
        list_targets: bool,
    },
    /// Run every test: install the NVRTC wheel the kernel compile checks need (pip,
    /// idempotent), then `cargo test --workspace` with any extra arguments.
    Test {
        /// Extra arguments for `cargo test`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build the GPU check binary and, on a machine with a GPU, run it.
    GpuCheck {
        /// Only build the binary and print where it is.
        #[arg(long)]
        build_only: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let root = workspace_root();
    let result = match cli.command {
        Command::Lower {
            path,
            target,
            out,
            report,
            dot,
            group,
            shared_hidden,
            list_targets,
        } => {
            if list_targets {
                for name in Target::preset_names() {
                    println!("{name}");
                }
                return ExitCode::SUCCESS;
            }
            lower_cmd(&root, path, target, out, report, dot, group, shared_hidden)
        }
        Command::GpuCheck { build_only } => gpu_check(&root, build_only),
        Command::Test { args } => test_cmd(&root, &args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn workspace_root() -> PathBuf {
    // xtask lives in <root>/xtask.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn load_target(spec: &str) -> Result<(Target, String)> {
    let p = Path::new(spec);
    if p.extension().is_some_and(|e| e == "toml") || p.is_file() {
        let text = std::fs::read_to_string(p)
            .with_context(|| format!("reading target file {}", p.display()))?;
        let t =
            Target::from_toml_str(&text).with_context(|| format!("target file {}", p.display()))?;
        let name = p
            .file_stem()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_else(|| "target".into());
        return Ok((t, name));
    }
    let t = Target::preset(spec)?;
    Ok((t, spec.to_string()))
}

fn read_graph(path: &Path) -> Result<Graph> {
    use std::io::Read;
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if !meta.is_file() {
        bail!("{} is not a regular file", path.display());
    }
    let limit = arfuse::import::MAX_FILE_BYTES as u64;
    if meta.len() > limit {
        bail!(
            "{} is {} bytes, above the {limit} byte limit",
            path.display(),
            meta.len()
        );
    }
    // The length can change under us: read at most limit + 1 bytes, never more.
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(limit + 1).read_to_end(&mut bytes))
        .with_context(|| format!("reading {}", path.display()))?;
    if bytes.len() as u64 > limit {
        bail!("{} is more than the {limit} byte limit", path.display());
    }
    let imported =
        arfuse::import::load_any(&bytes).with_context(|| format!("loading {}", path.display()))?;
    for note in &imported.notes {
        eprintln!("note: {}: {note}", path.display());
    }
    Ok(imported.graph)
}

/// Writes every `(path, contents)` through temporary files in the target directories,
/// renaming them into place only once all were written: a failure leaves no partial
/// file and never touches an existing one.
fn write_all_atomic(files: &[(&Path, String)]) -> Result<()> {
    let mut temps: Vec<(PathBuf, &Path)> = Vec::new();
    let mut result = Ok(());
    for (path, contents) in files {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
        if let Err(e) = std::fs::write(&tmp, contents) {
            result = Err(anyhow::Error::new(e).context(format!("writing {}", path.display())));
            break;
        }
        temps.push((tmp, path));
    }
    if result.is_ok() {
        for (tmp, path) in &temps {
            if let Err(e) = std::fs::rename(tmp, path) {
                result = Err(anyhow::Error::new(e).context(format!("writing {}", path.display())));
                break;
            }
        }
    }
    for (tmp, _) in &temps {
        let _ = std::fs::remove_file(tmp);
    }
    result
}

/// The path with its directory resolved (symlinks, `..`), for comparing destinations.
fn resolved(p: &Path) -> PathBuf {
    if let Ok(c) = std::fs::canonicalize(p) {
        return c;
    }
    let dir = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    match (std::fs::canonicalize(dir), p.file_name()) {
        (Ok(d), Some(n)) => d.join(n),
        _ => p.to_path_buf(),
    }
}

/// Graph files in a directory: `*.json` and `*.pt2`, not option files, sorted.
fn graphs_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let p = e?.path();
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let is_graph =
            (name.ends_with(".json") && !name.ends_with(".options.json")) || name.ends_with(".pt2");
        if p.is_file() && is_graph {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

/// The targets to lower one input for: `--target` when given, else the presets its
/// sibling `<name>.options.json` lists (the model corpus), else the default preset.
fn targets_for(input: &Path, given: &Option<String>) -> Result<Vec<String>> {
    if let Some(t) = given {
        return Ok(vec![t.clone()]);
    }
    let name = input
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let options = input.with_file_name(format!("{}.options.json", name.trim_end_matches(".json")));
    if options.is_file() {
        let text = std::fs::read_to_string(&options)
            .with_context(|| format!("reading {}", options.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {}", options.display()))?;
        let list: Vec<String> = v["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t.as_str().map(str::to_string))
            .collect();
        if !list.is_empty() {
            return Ok(list);
        }
    }
    Ok(vec![DEFAULT_TARGET.to_string()])
}

#[allow(clippy::too_many_arguments)] // one per CLI option
fn lower_cmd(
    root: &Path,
    path: Option<PathBuf>,
    target: Option<String>,
    out: Option<PathBuf>,
    report: ReportFormat,
    dot: Option<PathBuf>,
    group: Option<String>,
    shared_hidden: Vec<u64>,
) -> Result<ExitCode> {
    let default_graph = path.is_none();
    let path = path.unwrap_or_else(|| root.join(DEFAULT_GRAPH));
    // With no arguments: the bundled graph on the default target (not every preset
    // of its options file).
    let target = if default_graph && target.is_none() {
        Some(DEFAULT_TARGET.to_string())
    } else {
        target
    };
    // A bad target is reported once, before any graph is read.
    if let Some(t) = &target {
        let (t, _) = load_target(t)?;
        arfuse::policy::resolve_backend(&t).context("the target")?;
    }
    let inputs = if path.is_dir() {
        graphs_in(&path)?
    } else {
        vec![path.clone()]
    };
    if inputs.is_empty() {
        bail!("no graph files (*.json, *.pt2) in {}", path.display());
    }
    let mut jobs: Vec<(PathBuf, String)> = Vec::new();
    for input in &inputs {
        for t in targets_for(input, &target)? {
            jobs.push((input.clone(), t));
        }
    }
    if jobs.len() > 1 && (out.is_some() || dot.is_some()) {
        bail!(
            "--out and --dot take one input graph and one target (pass --target); {} (graph, target) pairs given",
            jobs.len()
        );
    }
    if let (Some(o), Some(d)) = (&out, &dot) {
        if resolved(o) == resolved(d) {
            bail!("--out and --dot name the same file {}", o.display());
        }
    }
    for o in out.iter().chain(dot.iter()) {
        if inputs.iter().any(|i| resolved(i) == resolved(o)) {
            bail!(
                "{} is an input graph; refusing to overwrite it",
                o.display()
            );
        }
    }
    let options = LowerOptions {
        group,
        shared_hidden_sizes: shared_hidden,
        ..LowerOptions::default()
    };
    let mut failed = 0usize;
    let mut json_reports = Vec::new();
    let mut loaded: Option<(PathBuf, Graph)> = None;
    for (input, target_spec) in &jobs {
        let (target, target_name) = load_target(target_spec)?;
        let stem = input
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| "graph".into());
        let stem = stem
            .trim_end_matches(".json")
            .trim_end_matches(".pt2")
            .to_string();
        if loaded.as_ref().map(|(p, _)| p) != Some(input) {
            match read_graph(input) {
                Ok(g) => loaded = Some((input.clone(), g)),
                Err(e) => {
                    eprintln!("error: {e:#}");
                    failed += 1;
                    loaded = None;
                    continue;
                }
            }
        }
        let Some((_, graph)) = &loaded else { continue };
        if let Some(g) = &options.group {
            let groups: std::collections::BTreeSet<&str> = graph
                .nodes()
                .filter_map(|(_, n)| match &n.op {
                    arfuse::ir::Op::AllReduce { group, .. } => Some(group.as_str()),
                    arfuse::ir::Op::FusedAllreduceNorm(f) => Some(f.group.as_str()),
                    _ => None,
                })
                .collect();
            if !groups.is_empty() && !groups.contains(g.as_str()) {
                let list: Vec<&str> = groups.into_iter().collect();
                eprintln!(
                    "error: {}: --group {g:?} matches no all-reduce; the graph's groups are {}",
                    input.display(),
                    list.join(", ")
                );
                failed += 1;
                continue;
            }
        }
        let start = std::time::Instant::now();
        let lowered = match arfuse::lower_with(graph, &target, &options) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("error: lowering {} for {target_name}: {e}", input.display());
                failed += 1;
                continue;
            }
        };
        let elapsed = start.elapsed();
        match report {
            ReportFormat::Table => {
                println!(
                    "== {} on {target_name} ({} graph nodes, lowered in {:.1} ms)",
                    input.display(),
                    graph.len(),
                    elapsed.as_secs_f64() * 1e3
                );
                println!("{}", lowered.report);
            }
            ReportFormat::Json => json_reports.push(serde_json::json!({
                "input": input.display().to_string(),
                "target": target_name,
                "report": lowered.report,
            })),
        }
        let out_path = match &out {
            Some(p) => p.clone(),
            None => root
                .join("target/arfuse")
                .join(format!("{stem}.{target_name}.lowered.json")),
        };
        if out.is_none() {
            if let Some(dir) = out_path.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
        }
        let mut files: Vec<(&Path, String)> = vec![(&out_path, lowered.graph.to_json_string())];
        if let Some(d) = &dot {
            files.push((d, lowered.graph.to_dot()));
        }
        if let Err(e) = write_all_atomic(&files) {
            eprintln!("error: {e:#} (nothing written)");
            failed += 1;
            continue;
        }
        for (p, _) in &files {
            eprintln!("wrote {}", p.display());
        }
    }
    if matches!(report, ReportFormat::Json) {
        println!("{}", serde_json::to_string_pretty(&json_reports)?);
    }
    if failed > 0 {
        eprintln!("{failed} of {} (graph, target) pair(s) failed", jobs.len());
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

fn cargo() -> std::process::Command {
    std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn test_cmd(root: &Path, args: &[String]) -> Result<ExitCode> {
    let script = root.join(".ci/install-cuda-wheels.sh");
    if script.is_file() {
        let status = std::process::Command::new("bash")
            .arg(&script)
            .current_dir(root)
            .status()
            .context("running .ci/install-cuda-wheels.sh")?;
        if !status.success() {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                bail!(".ci/install-cuda-wheels.sh failed: the NVRTC compile checks need it");
            }
            eprintln!(
                "warning: .ci/install-cuda-wheels.sh failed (python3 with pip is needed to \
                 install NVRTC); the kernel compile checks will print a skip line"
            );
        }
    }
    let status = cargo()
        .current_dir(root)
        .args(["test", "--workspace"])
        .args(args)
        .status()
        .context("running cargo test")?;
    Ok(if status.success() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn gpu_check(root: &Path, build_only: bool) -> Result<ExitCode> {
    let status = cargo()
        .current_dir(root)
        .args([
            "build",
            "--release",
            "-p",
            "arfuse-runtime",
            "--bin",
            "gpu_check",
        ])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("building gpu_check failed");
    }
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|d| if d.is_absolute() { d } else { root.join(d) })
        .unwrap_or_else(|| root.join("target"));
    let bin = target_dir.join("release/gpu_check");
    if build_only {
        println!("{}", bin.display());
        return Ok(ExitCode::SUCCESS);
    }
    let status = std::process::Command::new(&bin)
        .current_dir(root)
        .status()
        .with_context(|| format!("running {}", bin.display()))?;
    // gpu_check exits 0 (all checks passed), 1 (a check failed) or 2 (no CUDA driver:
    // nothing was checked); the status is passed through unchanged.
    let code = status.code().unwrap_or(1);
    if code == 2 {
        eprintln!("gpu-check: no CUDA driver on this machine, nothing was checked (exit status 2)");
    }
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}
