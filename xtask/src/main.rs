//! `cargo xtask`: the project's commands for people.
//!
//! - `cargo xtask lower [GRAPH|DIR] [--target PRESET|FILE] [--out FILE] [--report table|json] [--dot FILE] [--group NAME] [--shared-hidden H] [--all-reduce-op NAME[=GROUP]]`
//! - `cargo xtask test [CARGO TEST ARGS]`
//! - `cargo xtask gpu-check [--build-only] [-- GPU_CHECK ARGS]`
//! - `cargo xtask host-check [-- GPU_CHECK ARGS]`
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
        /// A framework's own all-reduce op to import as a sum all-reduce (repeatable),
        /// e.g. `vllm.all_reduce`; `=GROUP` gives its process group when the op has no
        /// `group_name` argument (torch.export / FX graphs only).
        #[arg(long = "all-reduce-op", value_name = "NAME[=GROUP]")]
        all_reduce_ops: Vec<arfuse::import::CustomAllReduce>,
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
    /// Build the GPU check binary (crates/gpu-check) and, on a machine with a GPU, run
    /// it; arguments after `--` go to `gpu_check` (see `gpu_check --help`).
    GpuCheck {
        /// Only build the binary and print where it is.
        #[arg(long)]
        build_only: bool,
        /// Arguments for `gpu_check`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Run the GPU check's correctness part on the host device (the kernel sources
    /// compiled for the CPU, every rank its own launch stream with seeded skew): every
    /// pattern x dtype x W in {2, 4, 8} x strategy x T in {1, 7, 16, 40, 42, 128, 1024}
    /// at H = 8192, then the fused node through the Runner. Arguments after `--` go to
    /// `gpu_check` (e.g. `-- --hidden 4096 --world 8`).
    HostCheck {
        /// Arguments for `gpu_check` (`--device host` is always passed).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
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
            all_reduce_ops,
            list_targets,
        } => {
            if list_targets {
                for name in Target::preset_names() {
                    println!("{name}");
                }
                return ExitCode::SUCCESS;
            }
            let import = arfuse::import::ImportOptions { all_reduce_ops };
            lower_cmd(
                &root,
                path,
                target,
                out,
                report,
                dot,
                group,
                shared_hidden,
                &import,
            )
        }
        Command::GpuCheck { build_only, args } => gpu_check(&root, build_only, &args),
        Command::HostCheck { args } => host_check(&root, &args),
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

/// True when `--target` names a TOML file rather than a preset.
fn is_target_file(spec: &str) -> bool {
    let p = Path::new(spec);
    p.extension().is_some_and(|e| e == "toml") || p.is_file()
}

/// The name a target goes by in reports and default output names: the preset name,
/// or a target file's stem.
fn target_name(spec: &str) -> String {
    if is_target_file(spec) {
        Path::new(spec)
            .file_stem()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_else(|| "target".into())
    } else {
        spec.to_string()
    }
}

fn load_target(spec: &str) -> Result<(Target, String)> {
    if is_target_file(spec) {
        let p = Path::new(spec);
        let text = std::fs::read_to_string(p)
            .with_context(|| format!("reading target file {}", p.display()))?;
        let t =
            Target::from_toml_str(&text).with_context(|| format!("target file {}", p.display()))?;
        return Ok((t, target_name(spec)));
    }
    let t = Target::preset(spec)?;
    Ok((t, target_name(spec)))
}

/// Where the lowered graph goes without `--out`:
/// `<root>/target/arfuse/<stem>.<target>.lowered.json`. The stem is the file name less
/// `.json` / `.pt2`; for an already lowered graph (`*.lowered.json`) also less
/// `.lowered` and a `.<target>` just before it, so that re-lowering
/// `x.<target>.lowered.json` is named `x.<target>.lowered.json` again, not a stacked
/// `x.<target>.lowered.<target>.lowered.json`. (`lower_cmd` refuses when this is the
/// input itself.)
fn default_out(root: &Path, input: &Path, target_name: &str) -> PathBuf {
    let name = input
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let mut stem = name
        .strip_suffix(".json")
        .or_else(|| name.strip_suffix(".pt2"))
        .unwrap_or(&name);
    if let Some(s) = stem.strip_suffix(".lowered") {
        stem = s
            .strip_suffix(target_name)
            .and_then(|s| s.strip_suffix('.'))
            .filter(|s| !s.is_empty())
            .unwrap_or(s);
    }
    if stem.is_empty() {
        stem = "graph";
    }
    root.join("target/arfuse")
        .join(format!("{stem}.{target_name}.lowered.json"))
}

/// Checks every `--shared-hidden` size once, before any graph is read (each would
/// otherwise fail every (graph, target) pair with the same policy error).
fn check_shared_hidden(sizes: &[u64]) -> Result<()> {
    for &h in sizes {
        // bf16 has the smallest elements of the activation dtypes: a size refused at
        // bf16 is refused at every dtype.
        if let Err(e) = arfuse::policy::check_hidden(h, arfuse::policy::ActDtype::Bf16) {
            let why = match e {
                arfuse::policy::PolicyError::InvalidHidden { reason, .. } => reason,
                other => other.to_string(),
            };
            bail!(
                "--shared-hidden {h}: {why} (give the hidden size, in elements, of another \
                 graph that shares this graph's workspace)"
            );
        }
    }
    Ok(())
}

/// The note printed (stderr) when a graph with all-reduces records no tensor-parallel
/// size: nothing checks that the target's world size is the one it was exported for.
fn assumed_world_size_note(graph: &Graph, target: &Target, target_name: &str) -> Option<String> {
    let has_all_reduce = graph.nodes().any(|(_, n)| {
        matches!(
            n.op,
            arfuse::ir::Op::AllReduce { .. } | arfuse::ir::Op::FusedAllreduceNorm(_)
        )
    });
    if !has_all_reduce || graph.recorded_world_size().is_some() {
        return None;
    }
    Some(format!(
        "the graph records no tensor-parallel size (metadata `tp` or `world_size`, absent \
         from torch.export output): planned for {target_name}'s world_size {}; if the \
         model was exported for another tensor-parallel size, pass a --target with that \
         world_size",
        target.world_size
    ))
}

fn read_graph(path: &Path, import: &arfuse::import::ImportOptions) -> Result<Graph> {
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
    let imported = arfuse::import::load_any_with(&bytes, import)
        .with_context(|| format!("loading {}", path.display()))?;
    for note in &imported.notes {
        match note.strip_prefix("warning: ") {
            Some(w) => eprintln!("warning: {}: {w}", path.display()),
            None => eprintln!("note: {}: {note}", path.display()),
        }
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
    import: &arfuse::import::ImportOptions,
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
    // A bad target or --shared-hidden is reported once, before any graph is read.
    check_shared_hidden(&shared_hidden)?;
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
    let resolved_inputs: Vec<PathBuf> = inputs.iter().map(|i| resolved(i)).collect();
    // Every other file the run reads: target files and the graphs' options files.
    let mut read_files: Vec<PathBuf> = jobs
        .iter()
        .map(|(_, t)| Path::new(t))
        .filter(|p| p.is_file())
        .map(resolved)
        .collect();
    for input in &inputs {
        let name = input
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let options =
            input.with_file_name(format!("{}.options.json", name.trim_end_matches(".json")));
        if options.is_file() {
            read_files.push(resolved(&options));
        }
    }
    for o in out.iter().chain(dot.iter()) {
        let r = resolved(o);
        if resolved_inputs.contains(&r) {
            bail!(
                "{} is an input graph; refusing to overwrite it",
                o.display()
            );
        }
        if read_files.contains(&r) {
            bail!(
                "{} is a file this run reads (a target or options file); refusing to overwrite it",
                o.display()
            );
        }
        // A missing directory is reported now, not after the lowering.
        if let Some(dir) = o.parent().filter(|d| !d.as_os_str().is_empty()) {
            if !dir.is_dir() {
                bail!(
                    "{}: directory {} does not exist",
                    o.display(),
                    dir.display()
                );
            }
        }
    }
    // Every output path, decided (and checked) before anything is lowered or written.
    let out_paths: Vec<PathBuf> = jobs
        .iter()
        .map(|(input, t)| match &out {
            Some(p) => p.clone(),
            None => default_out(root, input, &target_name(t)),
        })
        .collect();
    if out.is_none() {
        let mut seen: std::collections::BTreeMap<PathBuf, &Path> = Default::default();
        for ((input, t), o) in jobs.iter().zip(&out_paths) {
            let r = resolved(o);
            if resolved_inputs.contains(&r) {
                bail!(
                    "the default output for {} on {} is {}, an input graph (it is already \
                     lowered for this target); refusing to overwrite it: pass --out FILE",
                    input.display(),
                    target_name(t),
                    o.display()
                );
            }
            if let Some(other) = seen.insert(r, input) {
                if other != input.as_path() {
                    bail!(
                        "{} and {} would both be written to {}; lower them one at a time \
                         with --out FILE",
                        other.display(),
                        input.display(),
                        o.display()
                    );
                }
            }
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
    for ((input, target_spec), out_path) in jobs.iter().zip(&out_paths) {
        let (target, target_name) = load_target(target_spec)?;
        if loaded.as_ref().map(|(p, _)| p) != Some(input) {
            match read_graph(input, import) {
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
        if let Some(note) = assumed_world_size_note(graph, &target, &target_name) {
            eprintln!("note: {}: {note}", input.display());
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
        // Only collectives arfuse does not understand: not a success, even with nothing
        // to write wrong.
        let r = &lowered.report;
        if r.all_reduces_seen == 0 && r.already_fused == 0 && !r.unknown_collectives.is_empty() {
            eprintln!(
                "error: {}: no all-reduce arfuse understands, only collective-looking ops it \
                 keeps opaque ({}); if they are all-reduces, name them with --all-reduce-op \
                 NAME[=GROUP]",
                input.display(),
                r.unknown_collectives.join(", ")
            );
            failed += 1;
            continue;
        }
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
        if out.is_none() {
            if let Some(dir) = out_path.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
        }
        let mut files: Vec<(&Path, String)> = vec![(out_path, lowered.graph.to_json_string())];
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

/// Builds `target/release/gpu_check` and returns its path.
fn build_gpu_check(root: &Path) -> Result<PathBuf> {
    let status = cargo()
        .current_dir(root)
        .args([
            "build",
            "--release",
            "-p",
            "arfuse-gpu-check",
            "--bin",
            "gpu_check",
        ])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("building gpu_check failed");
    }
    Ok(target_dir(root).join("release/gpu_check"))
}

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|d| if d.is_absolute() { d } else { root.join(d) })
        .unwrap_or_else(|| root.join("target"))
}

fn gpu_check(root: &Path, build_only: bool, args: &[String]) -> Result<ExitCode> {
    let bin = build_gpu_check(root)?;
    if build_only {
        println!("{}", bin.display());
        return Ok(ExitCode::SUCCESS);
    }
    let status = std::process::Command::new(&bin)
        .args(args)
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

/// The arguments `cargo xtask host-check` gives `gpu_check`: the host device, its
/// kernel cache under the target directory, and (unless `args` names them) H = 8192
/// and 2 graph replays per case (each replay is a launch of every rank on the CPU).
fn host_check_args(target: &Path, args: &[String]) -> Vec<String> {
    let given = |flag: &str| {
        args.iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
    };
    let mut out = vec!["--device".to_string(), "host".to_string()];
    for (flag, value) in [
        (
            "--host-cache",
            target.join("tmp/arfuse-host").display().to_string(),
        ),
        ("--hidden", "8192".to_string()),
        ("--replays", "2".to_string()),
    ] {
        if !given(flag) {
            out.push(flag.to_string());
            out.push(value);
        }
    }
    out.extend(args.iter().cloned());
    out
}

fn host_check(root: &Path, args: &[String]) -> Result<ExitCode> {
    let bin = build_gpu_check(root)?;
    let t0 = std::time::Instant::now();
    let status = std::process::Command::new(&bin)
        .args(host_check_args(&target_dir(root), args))
        .current_dir(root)
        .status()
        .with_context(|| format!("running {}", bin.display()))?;
    eprintln!("host-check: {:.0} s", t0.elapsed().as_secs_f64());
    Ok(ExitCode::from(
        u8::try_from(status.code().unwrap_or(1)).unwrap_or(1),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_out_names_do_not_stack() {
        let root = Path::new("/r");
        let out = |input: &str, t: &str| default_out(root, Path::new(input), t);
        let expect = |name: &str| PathBuf::from("/r/target/arfuse").join(name);
        assert_eq!(
            out("m/x.json", "h200-sxm-x8"),
            expect("x.h200-sxm-x8.lowered.json")
        );
        assert_eq!(out("m/x.pt2", "b200-x8"), expect("x.b200-x8.lowered.json"));
        // An already lowered graph: `.lowered` and the same target's name come off.
        assert_eq!(
            out("/tmp/x.lowered.json", "h200-sxm-x8"),
            expect("x.h200-sxm-x8.lowered.json")
        );
        assert_eq!(
            out("target/arfuse/x.h200-sxm-x8.lowered.json", "h200-sxm-x8"),
            expect("x.h200-sxm-x8.lowered.json")
        );
        // Lowered for another target: that target's name stays, `.lowered` does not.
        assert_eq!(
            out("x.h200-sxm-x8.lowered.json", "h100-sxm-x8"),
            expect("x.h200-sxm-x8.h100-sxm-x8.lowered.json")
        );
        // Only a whole `.<target>` component comes off; nothing leaves an empty stem.
        assert_eq!(
            out("xh200-sxm-x8.lowered.json", "h200-sxm-x8"),
            expect("xh200-sxm-x8.h200-sxm-x8.lowered.json")
        );
        assert_eq!(
            out("h200-sxm-x8.lowered.json", "h200-sxm-x8"),
            expect("h200-sxm-x8.h200-sxm-x8.lowered.json")
        );
        assert_eq!(
            out(".lowered.json", "b200-x8"),
            expect("graph.b200-x8.lowered.json")
        );
    }

    #[test]
    fn host_check_passes_the_host_device_and_keeps_the_users_choices() {
        let t = Path::new("/t");
        let a = host_check_args(t, &[]);
        assert_eq!(
            a,
            [
                "--device",
                "host",
                "--host-cache",
                "/t/tmp/arfuse-host",
                "--hidden",
                "8192",
                "--replays",
                "2"
            ]
        );
        let a = host_check_args(t, &["--hidden=4096".into(), "--world".into(), "8".into()]);
        assert_eq!(a.iter().filter(|x| x.starts_with("--hidden")).count(), 1);
        assert!(a.ends_with(&["--hidden=4096".to_string(), "--world".into(), "8".into()]));
    }

    #[test]
    fn shared_hidden_is_checked_with_the_flag_named() {
        check_shared_hidden(&[]).unwrap();
        check_shared_hidden(&[4096, 7168]).unwrap();
        let e = check_shared_hidden(&[4096, 0]).unwrap_err().to_string();
        assert!(e.starts_with("--shared-hidden 0: "), "{e}");
        let e = check_shared_hidden(&[1 << 40]).unwrap_err().to_string();
        assert!(e.starts_with("--shared-hidden 1099511627776: "), "{e}");
    }

    #[test]
    fn assumed_world_size_note_only_without_recorded_tp() {
        let root = workspace_root();
        let target = Target::preset("b300-x4").unwrap();
        let none = arfuse::import::ImportOptions::default();
        let exported = read_graph(
            &root.join("ir-fixtures/exported/gemma3_1b_L2_tp2.exported_program.json"),
            &none,
        )
        .unwrap();
        let note = assumed_world_size_note(&exported, &target, "b300-x4").unwrap();
        assert!(note.contains("b300-x4's world_size 4"), "{note}");
        let corpus =
            read_graph(&root.join("ir-fixtures/models/gemma3_1b_tp4.json"), &none).unwrap();
        assert_eq!(corpus.recorded_world_size(), Some(4));
        assert_eq!(assumed_world_size_note(&corpus, &target, "b300-x4"), None);
    }
}
