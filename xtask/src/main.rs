//! `cargo xtask`: the project's commands for people.
//!
//! - `cargo xtask lower [GRAPH|DIR] [--target PRESET|FILE | --world-size N] [--out FILE] [--report table|json] [--sites] [--check | --check-all] [--dot FILE] [--group NAME] [--shared-hidden H] [--all-reduce-op NAME[=GROUP]]`
//! - `cargo xtask lower --list-targets`
//! - `cargo xtask test [CARGO TEST ARGS]` (then the Python tests, `python.rs`)
//! - `cargo xtask gpu-check [--build-only] [-- GPU_CHECK ARGS]`
//! - `cargo xtask host-check [-- GPU_CHECK ARGS]`
//!
//! Run `cargo xtask help` for details.

use anyhow::{bail, Context, Result};
use arfuse::advanced::reference::SiteTokens;
use arfuse::{Graph, LowerOptions, Target};
use clap::{Parser, Subcommand, ValueEnum};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

mod python;

/// mimalloc, as in every arfuse binary: a lowering makes about 150 small allocations
/// per site (mostly egg's e-classes), which glibc's malloc serves about a third
/// slower (`crates/rewrite/benches/lower.rs` measures both).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The bundled model graph `cargo xtask lower` lowers when given no path.
const DEFAULT_GRAPH: &str = "ir-fixtures/models/llama31_8b_tp8.json";
/// The target preset used when `--target` is not given.
const DEFAULT_TARGET: &str = "h200-sxm-x8";

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "arfuse developer and user commands"
)]
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
    #[command(
        override_usage = "cargo xtask lower [OPTIONS] [GRAPH|DIR]\n       cargo xtask lower --list-targets"
    )]
    Lower {
        /// Graph file or directory. Default: the bundled Llama-3.1-8B TP8 graph on
        /// h200-sxm-x8.
        #[arg(value_name = "GRAPH|DIR")]
        path: Option<PathBuf>,
        /// Target preset name (see `--list-targets`) or a TOML file. Default: the
        /// presets the graph's `<name>.options.json` lists, else the H200 SXM preset of
        /// the tensor-parallel size the graph records; a graph with all-reduces that
        /// records none needs `--target` or `--world-size`.
        #[arg(long, short, conflicts_with = "world_size")]
        target: Option<String>,
        /// The tensor-parallel size W the graph was exported for: plans for the H200 SXM
        /// preset with W ranks (`h200-sxm-xW`, else the one preset with W ranks). A
        /// graph that records no TP size needs this or `--target`.
        #[arg(
            long = "world-size",
            value_name = "N",
            allow_negative_numbers = true,
            value_parser = parse_world_size
        )]
        world_size: Option<u32>,
        /// Where to write the lowered graph (one graph and target only). Default:
        /// <checkout>/target/arfuse/<name>.<target>.lowered.json
        #[arg(long, short)]
        out: Option<PathBuf>,
        /// Report format.
        #[arg(long, value_enum, default_value = "table")]
        report: ReportFormat,
        /// Also write the lowered graph as Graphviz DOT (one graph and target only).
        #[arg(long)]
        dot: Option<PathBuf>,
        /// The layers' tensor-parallel process group (default: inferred from the graph).
        #[arg(long)]
        group: Option<String>,
        /// Hidden size of another graph sharing this graph's workspace (e.g. a
        /// speculative-decoding draft); repeatable. The workspace is sized for the widest
        /// the fused kernels can run; a row over their maximum is refused, and a size they
        /// cannot run is said in the report's notes.
        #[arg(
            long = "shared-hidden",
            value_name = "H",
            allow_negative_numbers = true,
            value_parser = parse_shared_hidden
        )]
        shared_hidden: Vec<u64>,
        /// A framework's own all-reduce op to import as a sum all-reduce (repeatable),
        /// e.g. `vllm.all_reduce`; `=GROUP` gives its process group when the op has no
        /// `group_name` argument (torch.export / FX graphs only).
        #[arg(long = "all-reduce-op", value_name = "NAME[=GROUP]")]
        all_reduce_ops: Vec<arfuse::advanced::import::CustomAllReduce>,
        /// In the table report, one line per site (default: sites that differ only in
        /// their layer index on one line).
        #[arg(long)]
        sites: bool,
        /// After lowering, check every fused site against the chain it replaced: the
        /// wiring of the whole lowered graph, then each chain cut out of the original
        /// at its real hidden size against its fused node alone, on W ranks with random
        /// per-rank inputs, bit for bit under the rounding contract: every site at
        /// T = 1 and T = W, the first site of each kind at every T of its plan (T = 1,
        /// W - 1 and W, both ends of each fused range, the first T of each unfused
        /// range); never a T the graph or the plan cannot run. Fails the pair, writing
        /// nothing, on any difference.
        #[arg(long)]
        check: bool,
        /// `--check` with every site at every T of its plan.
        #[arg(long, conflicts_with = "check")]
        check_all: bool,
        /// List the target presets (GPU, W, nodes, interconnect, the backend each
        /// resolves to) and exit; takes no other argument.
        #[arg(
            long,
            conflicts_with_all = [
                "path", "target", "world_size", "out", "report", "dot", "group",
                "shared_hidden", "all_reduce_ops", "sites", "check", "check_all",
            ]
        )]
        list_targets: bool,
    },
    /// Run every test: install the NVRTC wheel the kernel compile checks need (pip,
    /// idempotent), then `cargo test --workspace` with any extra arguments, then the
    /// Python package's tests (a venv in <target dir>/python-venv with torch,
    /// transformers, pytest and the package built from crates/python; a skipped Python
    /// test fails the command; ARFUSE_PYTHON_TESTS=0 leaves them out, reported as NOT
    /// RUN, and is refused under CI=true).
    Test {
        /// Only the Python step (venv, package, pytest), no `cargo test`.
        #[arg(long)]
        python_only: bool,
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
    // Rust ignores SIGPIPE, so printing into a closed pipe (`cargo xtask lower | head`)
    // would panic; the default action ends the process quietly, as for any Unix tool.
    #[cfg(unix)]
    // SAFETY: called once at start, before any thread exists; SIG_DFL is a valid action.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let root = workspace_root();
    let result = match cli.command {
        Command::Lower {
            path,
            target,
            world_size,
            out,
            report,
            dot,
            group,
            shared_hidden,
            all_reduce_ops,
            sites,
            check,
            check_all,
            list_targets,
        } => {
            if list_targets {
                print!("{}", targets_table());
                return ExitCode::SUCCESS;
            }
            let mut import = arfuse::advanced::import::ImportOptions::default();
            import.all_reduce_ops = all_reduce_ops;
            lower_cmd(
                &root,
                path,
                target,
                world_size,
                out,
                Output {
                    report,
                    sites,
                    check: match (check, check_all) {
                        (_, true) => Some(SiteTokens::Plan),
                        (true, false) => Some(SiteTokens::PlanPerKind),
                        (false, false) => None,
                    },
                },
                dot,
                group,
                shared_hidden,
                &import,
            )
        }
        Command::GpuCheck { build_only, args } => gpu_check(&root, build_only, &args),
        Command::HostCheck { args } => host_check(&root, &args),
        Command::Test { python_only, args } => {
            if python_only {
                python::test(&root).map(|outcome| {
                    eprintln!("xtask test: Python tests {}", outcome.describe());
                    if outcome == python::Outcome::Passed {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::FAILURE
                    }
                })
            } else {
                test_cmd(&root, &args)
            }
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// How `lower` prints its report.
struct Output {
    report: ReportFormat,
    /// One table line per site.
    sites: bool,
    /// Run the per-site equivalence check after lowering, at these token counts
    /// (`--check`: `PlanPerKind`, `--check-all`: `Plan`).
    check: Option<SiteTokens<'static>>,
}

/// `--list-targets`: one line per preset with its machine and the backend the
/// policy resolves it to. `driver-multicast` is what the preset says every GPU's
/// driver reports (`multicast_all_ranks`), which the backend needs but which does not
/// decide it alone (a bridged-NVLink or InfiniBand group is not fused).
fn targets_table() -> String {
    let mut rows = vec![[
        "preset".to_string(),
        "GPU".into(),
        "SM".into(),
        "W".into(),
        "nodes".into(),
        "interconnect".into(),
        "driver-multicast".into(),
        "backend".into(),
    ]];
    for p in arfuse::advanced::policy::PRESETS {
        let backend = match arfuse::advanced::policy::resolve_backend(&p.target()) {
            Ok(d) => d
                .backend()
                .map(|b| b.to_string())
                .unwrap_or_else(|| "none (no fusion)".into()),
            Err(e) => format!("error: {e}"),
        };
        rows.push([
            p.name.to_string(),
            p.gpu.to_string(),
            p.sm.to_string(),
            p.world_size.to_string(),
            p.group_nodes.to_string(),
            p.interconnect.to_string(),
            if p.multicast_all_ranks { "yes" } else { "no" }.to_string(),
            backend,
        ]);
    }
    let mut width = [0usize; 8];
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = String::new();
    for r in &rows {
        let cells: Vec<String> = r
            .iter()
            .zip(width)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

fn workspace_root() -> PathBuf {
    // xtask lives in <root>/xtask.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// True when `--target` names a TOML file rather than a preset: a preset's name is
/// always the preset (a file of that name in the current directory does not replace
/// it); any other spec is a file when it ends in `.toml` or a file by that name exists.
fn is_target_file(spec: &str) -> bool {
    if Target::preset_names().contains(&spec) {
        return false;
    }
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
    if !Target::preset_names().contains(&spec) && Path::new(spec).is_dir() {
        bail!("target {spec} is a directory; give a preset name (--list-targets) or a TOML target file");
    }
    if is_target_file(spec) {
        let p = Path::new(spec);
        let text = read_small_text(p, "; a target file is TOML, as ir-fixtures/targets/*.toml")?;
        let t =
            Target::from_toml_str(&text).with_context(|| format!("target file {}", p.display()))?;
        return Ok((t, target_name(spec)));
    }
    let t = Target::preset(spec)?;
    Ok((t, target_name(spec)))
}

/// The endings of a graph file's name: arfuse or torch.export JSON, perhaps gzipped, or
/// a `.pt2` archive (longest first, so that `.json.gz` is not read as `.gz`).
const GRAPH_EXTENSIONS: [&str; 3] = [".json.gz", ".json", ".pt2"];

/// A graph file's name without its ending ([`GRAPH_EXTENSIONS`]).
fn graph_stem(name: &str) -> Option<&str> {
    GRAPH_EXTENSIONS
        .iter()
        .find_map(|ext| name.strip_suffix(ext))
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
    let mut stem = graph_stem(&name).unwrap_or(&name);
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
        if let Err(e) =
            arfuse::advanced::policy::check_hidden(h, arfuse::advanced::policy::ActDtype::Bf16)
        {
            let why = match e {
                arfuse::advanced::policy::PolicyError::InvalidHidden { reason, .. } => reason,
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
    if !has_all_reduce(graph) || graph.recorded_world_size().is_some() {
        return None;
    }
    Some(format!(
        "the graph records no tensor-parallel size (metadata `tp` or `world_size`, absent \
         from torch.export output): planned for {target_name}'s world_size {}; if the \
         model was exported for another tensor-parallel size, plan for that size \
         (--world-size N, or a --target with that world_size)",
        target.world_size
    ))
}

fn read_graph(path: &Path, import: &arfuse::advanced::import::ImportOptions) -> Result<Graph> {
    use std::io::Read;
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if !meta.is_file() {
        bail!("{} is not a regular file", path.display());
    }
    let limit = arfuse::advanced::import::MAX_FILE_BYTES as u64;
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
    let imported = arfuse::advanced::import::load_any_with(&bytes, import)
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
/// renaming them into place only once all were written: a failure to write leaves no
/// partial file and never touches an existing one ("nothing written"). The temporary
/// files are made exclusively under random names ([`new_file_in`]) and removed when
/// anything fails. A rename that fails after others (rare: the destinations are
/// checked before lowering, [`check_output_path`]) leaves those in place, and the error
/// names them.
fn write_all_atomic(files: &[(&Path, String)]) -> Result<()> {
    use std::io::Write;
    let mut temps = Vec::with_capacity(files.len());
    for (path, contents) in files {
        let written = new_file_in(dir_of(path)).and_then(|mut tmp| {
            tmp.as_file_mut().write_all(contents.as_bytes())?;
            Ok(tmp)
        });
        match written {
            Ok(tmp) => temps.push((tmp, *path)),
            // The temporary files made so far are removed as `temps` is dropped.
            Err(e) => bail!("writing {}: {e} (nothing written)", path.display()),
        }
    }
    let mut done: Vec<String> = Vec::new();
    for (tmp, path) in temps {
        if let Err(e) = tmp.persist(path) {
            // `e.file`, the temporary file, is removed as it is dropped here.
            let written = if done.is_empty() {
                "nothing written".to_string()
            } else {
                format!("{} written before it", done.join(", "))
            };
            bail!("writing {}: {} ({written})", path.display(), e.error);
        }
        done.push(path.display().to_string());
    }
    Ok(())
}

/// The directory a file `p` is written in: its parent, `.` for a bare name.
fn dir_of(p: &Path) -> &Path {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// A new empty file in `dir`, made exclusively (never through a symlink or over a file
/// there) under a random hidden name, with the mode a plain write gets (0o666 less the
/// umask); removed when dropped unless renamed into place first.
fn new_file_in(dir: &Path) -> std::io::Result<tempfile::NamedTempFile> {
    let mut b = tempfile::Builder::new();
    b.prefix(".arfuse-").suffix(".tmp");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        b.permissions(std::fs::Permissions::from_mode(0o666));
    }
    b.tempfile_in(dir)
}

/// The path resolved (symlinks, `..`; the last component too when it exists), for
/// comparing files: the same file however it is named.
fn resolved(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| destination(p))
}

/// Where a file written to `p` by rename lands: `p` with its directory resolved but not
/// its last component (a symlink there is replaced, not written through).
fn destination(p: &Path) -> PathBuf {
    match (std::fs::canonicalize(dir_of(p)), p.file_name()) {
        (Ok(d), Some(n)) => d.join(n),
        _ => p.to_path_buf(),
    }
}

/// Graph files in a directory: `*.json`, `*.json.gz` and `*.pt2`, not option files,
/// sorted. An entry with such a name that is no regular file (a directory, a broken
/// link) is listed too: reading it fails, so it is a failed pair, not skipped unsaid.
fn graphs_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let p = e?.path();
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        if graph_stem(&name).is_some() && !name.ends_with(".options.json") {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

/// Why `--out` or `--dot` (`outputs`) cannot be used with `jobs`, the (graph, target)
/// pairs of one graph whose options file lists more than one target.
fn one_target_refusal(jobs: &[(PathBuf, String)], outputs: &[(&str, &Path)]) -> String {
    let graph = jobs.first().map(|(g, _)| g.display().to_string());
    let targets: Vec<&str> = jobs.iter().map(|(_, t)| t.as_str()).collect();
    format!(
        "{} one target; {} is lowered for the {} targets its options file lists ({}): pick one with --target",
        flags_take(outputs),
        graph.unwrap_or_default(),
        targets.len(),
        targets.join(", ")
    )
}

/// The targets to lower one input for, decided without reading it: `--target` (or
/// `--world-size`'s preset) when given, else the presets its sibling
/// `<name>.options.json` lists (the model corpus); `None` when neither decides (the
/// graph itself must be read: [`target_from_graph`]). Errors: an options file that
/// cannot be read or parsed, is not a JSON object, or whose `targets` is not a
/// non-empty list of strings.
fn targets_for(input: &Path, given: &Option<String>) -> Result<Option<Vec<String>>> {
    if let Some(t) = given {
        return Ok(Some(vec![t.clone()]));
    }
    let options = options_file_of(input);
    if let Some(text) = read_options_file(&options)? {
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {}", options.display()))?;
        if !v.is_object() {
            bail!(
                "{} is not a JSON object; an options file is one, with a \"targets\" list",
                options.display()
            );
        }
        let list = match v.get("targets") {
            // Other options only: the graph decides.
            None => return Ok(None),
            Some(serde_json::Value::Array(a)) => {
                let mut list = Vec::with_capacity(a.len());
                let mut seen = std::collections::BTreeSet::new();
                for (k, t) in a.iter().enumerate() {
                    let Some(t) = t.as_str() else {
                        bail!(
                            "{}: \"targets\"[{k}] is {t}, not a string; the list holds \
                             preset names or target files",
                            options.display()
                        );
                    };
                    // A target listed twice is lowered once.
                    if seen.insert(t) {
                        list.push(t.to_string());
                    }
                }
                if list.is_empty() {
                    bail!(
                        "{}: \"targets\" is an empty list; list the preset names or \
                         target files to lower for, e.g. [\"h200-sxm-x8\"], or leave the \
                         key out",
                        options.display()
                    );
                }
                list
            }
            Some(other) => bail!(
                "{}: \"targets\" is {other}, not a list; it lists preset names or target \
                 files, e.g. [\"h200-sxm-x8\"]",
                options.display()
            ),
        };
        return Ok(Some(list));
    }
    Ok(None)
}

/// The most bytes an options file or a target file may hold: the bundled ones hold
/// about 1 KiB and 4 KiB.
const MAX_SMALL_FILE_BYTES: u64 = 1 << 20;

/// The text of options file `path`, `None` when there is none; an error naming it
/// otherwise, as [`read_small_text`] says.
fn read_options_file(path: &Path) -> Result<Option<String>> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => bail!("reading {}: {e}", path.display()),
        Ok(_) => read_small_text(
            path,
            "; an options file is a JSON object with a \"targets\" list",
        )
        .map(Some),
    }
}

/// The text of a small file the user gives besides graphs (an options file, a target
/// file), a UTF-8 byte order mark read past (as in a graph file: RFC 8259 allows it).
/// Errors, naming the file: something other than a regular file is there (a
/// directory, a FIFO, whose read would wait for a writer, a device, a broken symlink;
/// `hint` ends that message), it cannot be read, it is over [`MAX_SMALL_FILE_BYTES`], or
/// it is not UTF-8.
fn read_small_text(path: &Path, hint: &str) -> Result<String> {
    use std::io::Read;
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => {}
        Ok(_) => bail!("{} is not a regular file{hint}", path.display()),
        Err(e) if std::fs::symlink_metadata(path).is_ok() => {
            bail!("reading {}: {e} (a broken symlink?)", path.display())
        }
        Err(e) => bail!("reading {}: {e}", path.display()),
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_SMALL_FILE_BYTES + 1).read_to_end(&mut bytes))
        .with_context(|| format!("reading {}", path.display()))?;
    if bytes.len() as u64 > MAX_SMALL_FILE_BYTES {
        bail!(
            "{} is over {MAX_SMALL_FILE_BYTES} bytes, too large{hint}",
            path.display()
        );
    }
    match String::from_utf8(bytes) {
        Ok(text) => Ok(match text.strip_prefix('\u{feff}') {
            Some(rest) => rest.to_string(),
            None => text,
        }),
        Err(e) => bail!(
            "{} is not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        ),
    }
}

/// A flag's count: an integer from 1 to `max`; any other value is a usage error (exit
/// 2), 0 and -1 alike, whose message says what the count is (`meaning`) and its range.
fn count_from_one<T>(s: &str, meaning: &str, max: T) -> std::result::Result<T, String>
where
    T: std::str::FromStr + PartialOrd + From<u8> + std::fmt::Display,
{
    match s.parse::<T>() {
        Ok(n) if n >= T::from(1) => Ok(n),
        _ => Err(format!("{meaning}, an integer from 1 to {max}")),
    }
}

/// `--world-size`'s value: an integer from 1 that fits a target's `world_size`.
fn parse_world_size(s: &str) -> std::result::Result<u32, String> {
    let meaning = "a world size is the number of ranks in the tensor-parallel group";
    count_from_one(s, meaning, u32::MAX)
}

/// `--shared-hidden`'s value: an integer count of elements, at least 1; sizes the
/// policy refuses are refused by [`check_shared_hidden`], with the reason.
fn parse_shared_hidden(s: &str) -> std::result::Result<u64, String> {
    let meaning = "a hidden size is the number of elements of a row of another graph \
                   sharing this graph's workspace";
    count_from_one(s, meaning, u64::MAX).map_err(|e| {
        format!(
            "{e} (a size whose row is over the fused kernels' maximum is refused next, with \
             the reason)"
        )
    })
}

/// The preset `--world-size W` (or a graph recording tensor-parallel size W) plans
/// for, and the note saying which and what else has W ranks. W is at least 1: the
/// flag's parser and the IR's validation of `metadata.tp` and `metadata.world_size`
/// refuse 0.
fn world_size_choice(w: u32) -> Result<(String, String)> {
    let p = arfuse::advanced::policy::preset_for_world_size(w)
        .with_context(|| format!("--world-size {w}"))?;
    let others: Vec<&str> = arfuse::advanced::policy::presets_with_world_size(w)
        .filter(|o| o.name != p.name)
        .map(|o| o.name)
        .collect();
    let mut note = format!(
        "--world-size {w}: planned for {} ({} x{w}, {})",
        p.name, p.gpu, p.description
    );
    if !others.is_empty() {
        note.push_str(&format!(
            "; other presets with world_size {w}: {} (pass --target NAME)",
            others.join(", ")
        ));
    }
    Ok((p.name.to_string(), note))
}

/// The target of a graph lowered with neither `--target`, `--world-size` nor an
/// options file, and a note when the choice deserves one. A graph that records its
/// tensor-parallel size W is planned for the preset of W ([`world_size_choice`]); a
/// graph without all-reduces for the default preset (nothing depends on W); a graph
/// with all-reduces that records no size is refused (`Err` says why): its W would be a
/// guess.
fn target_from_graph(graph: &Graph) -> std::result::Result<(String, Option<String>), String> {
    if !has_all_reduce(graph) {
        return Ok((DEFAULT_TARGET.to_string(), None));
    }
    let Some(w) = graph.recorded_world_size() else {
        return Err(
            "the graph records no tensor-parallel size (metadata `tp` or `world_size`; \
             torch.export output has none), so its world size would be a guess"
                .to_string(),
        );
    };
    let w =
        u32::try_from(w).map_err(|_| format!("the graph records tp = {w}, no machine has that"))?;
    // The choice's messages name `--world-size`, which this user did not pass.
    let flag = format!("--world-size {w}");
    let (name, note) = world_size_choice(w).map_err(|e| {
        let why = format!("{e:#}");
        let why = why.strip_prefix(&format!("{flag}: ")).unwrap_or(&why);
        format!("the graph records tp = {w}: {why}")
    })?;
    Ok((
        name,
        Some(note.replacen(&flag, &format!("recorded tp = {w}"), 1)),
    ))
}

/// Every preset name grouped by world size, one line per W: `  W=2: a, b, c`.
fn presets_by_world_size() -> String {
    let mut sizes: Vec<u32> = arfuse::advanced::policy::PRESETS
        .iter()
        .map(|p| p.world_size)
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes
        .iter()
        .map(|&w| {
            let names: Vec<&str> = arfuse::advanced::policy::presets_with_world_size(w)
                .map(|p| p.name)
                .collect();
            format!("  W={w}: {}", names.join(", "))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// True when the graph has an all-reduce (plain or already fused).
fn has_all_reduce(graph: &Graph) -> bool {
    graph.nodes().any(|(_, n)| {
        matches!(
            n.op,
            arfuse::advanced::ir::Op::AllReduce { .. }
                | arfuse::advanced::ir::Op::FusedAllreduceNorm(_)
        )
    })
}

/// The graphs of one run, each with the targets it is lowered for.
struct Jobs {
    /// (graph file, target spec) pairs, in order.
    pairs: Vec<(PathBuf, String)>,
    /// Graphs read to choose their target, kept for the lowering.
    preloaded: std::collections::BTreeMap<PathBuf, Result<Graph>>,
}

impl Jobs {
    /// Whether `input` was read to choose its target and could not be: its one pair
    /// fails with the read error, no target chosen (its target spec only stands in),
    /// and writes nothing.
    fn unreadable(&self, input: &Path) -> bool {
        matches!(self.preloaded.get(input), Some(Err(_)))
    }
}

#[allow(clippy::too_many_arguments)] // one per CLI option
fn lower_cmd(
    root: &Path,
    path: Option<PathBuf>,
    target: Option<String>,
    world_size: Option<u32>,
    out: Option<PathBuf>,
    output: Output,
    dot: Option<PathBuf>,
    group: Option<String>,
    shared_hidden: Vec<u64>,
    import: &arfuse::advanced::import::ImportOptions,
) -> Result<ExitCode> {
    let default_graph = path.is_none();
    let path = path.unwrap_or_else(|| root.join(DEFAULT_GRAPH));
    let inputs = graph_files(&path)?;
    let target = given_target(default_graph, target, world_size, &shared_hidden)?;
    let resolved_inputs: Vec<PathBuf> = inputs.iter().map(|i| resolved(i)).collect();
    let (out, dot) = (out.as_deref(), dot.as_deref());
    let outputs: Vec<(&str, &Path)> = [("--out", out), ("--dot", dot)]
        .into_iter()
        .filter_map(|(flag, o)| Some((flag, o?)))
        .collect();
    refuse_outputs_before_reading(&inputs, &resolved_inputs, target.as_deref(), &outputs)?;
    let listed = inputs
        .iter()
        .map(|i| targets_for(i, &target))
        .collect::<Result<Vec<_>>>()?;
    if target.is_none() {
        check_listed_targets(&inputs, &listed, &outputs)?;
    }
    refuse_several_graphs(&path, &inputs, &outputs)?;
    let mut jobs = plan_jobs(&inputs, listed, import)?;
    check_outputs(&jobs.pairs, &outputs)?;
    let out_paths = output_paths(root, &jobs, &resolved_inputs, out, dot)?;
    let mut options = LowerOptions::default().with_shared_hidden_sizes(shared_hidden);
    options.group = group;
    let run = Run {
        out_is_default: out.is_none(),
        dot,
        world_size_given: world_size.is_some(),
        options: &options,
        output: &output,
        import,
    };
    run_jobs(&run, &mut jobs, &out_paths)
}

/// The target every graph of the run is lowered for, when one is given: `--target`, or
/// `--world-size`'s preset (its choice said in a note), or with no arguments at all the
/// default target; checked (and `--shared-hidden` too) before any graph is read, so
/// that a bad one is reported once. `None`: each graph's own (its options file, or the
/// TP size it records).
fn given_target(
    default_graph: bool,
    target: Option<String>,
    world_size: Option<u32>,
    shared_hidden: &[u64],
) -> Result<Option<String>> {
    // With no arguments: the bundled graph on the default target (not every preset
    // of its options file).
    let target = if default_graph && target.is_none() {
        Some(DEFAULT_TARGET.to_string())
    } else {
        target
    };
    check_shared_hidden(shared_hidden)?;
    let target = match world_size {
        Some(w) => {
            let (name, note) = world_size_choice(w)?;
            eprintln!("note: {note}");
            Some(name)
        }
        None => target,
    };
    if let Some(t) = &target {
        let (t, _) = load_target(t)?;
        arfuse::advanced::policy::resolve_backend(&t).context("the target")?;
    }
    Ok(target)
}

/// The graph files `path` names: itself, or the graphs of a directory (at least one).
/// An options file given as the graph is refused, naming its graph.
fn graph_files(path: &Path) -> Result<Vec<PathBuf>> {
    if !path.exists() {
        bail!("{} does not exist", path.display());
    }
    let inputs = if path.is_dir() {
        graphs_in(path)?
    } else {
        let name = path.file_name().map(|n| n.to_string_lossy().to_string());
        if let Some(stem) = name
            .as_deref()
            .and_then(|n| n.strip_suffix(".options.json"))
        {
            // The graph it belongs to: the first of these that exists, else `.json`.
            let graph = GRAPH_EXTENSIONS
                .map(|ext| format!("{stem}{ext}"))
                .into_iter()
                .find(|g| path.with_file_name(g).is_file())
                .unwrap_or_else(|| format!("{stem}.json"));
            bail!(
                "{} is an options file (the targets of `{graph}`), not a graph; lower `{graph}`",
                path.display()
            );
        }
        vec![path.to_path_buf()]
    };
    if inputs.is_empty() {
        bail!(
            "no graph files (*.json, *.json.gz, *.pt2) in {}",
            path.display()
        );
    }
    // The options file's name and the default output's are made from the graph's.
    if let Some(bad) = inputs
        .iter()
        .find(|i| i.file_name().is_some_and(|n| n.to_str().is_none()))
    {
        bail!(
            "{}: the file name is not UTF-8; arfuse names a graph's options file and \
             outputs after it: rename it",
            bad.display()
        );
    }
    Ok(inputs)
}

/// What `--out`/`--dot` (`outputs`, each with its flag) cannot name, known before any
/// file of the run is read, in this order: an input graph (as given or through a
/// symlink), an options file (any `*.options.json`: the targets of a graph, which a
/// directory run would skip as a graph; an input's options file, existing or not), the
/// `--target` file; a path that is no file to write ([`check_output_path`]); the same
/// file for both.
fn refuse_outputs_before_reading(
    inputs: &[PathBuf],
    resolved_inputs: &[PathBuf],
    target: Option<&str>,
    outputs: &[(&str, &Path)],
) -> Result<()> {
    // An input's options file, by the input as given and as resolved.
    let options_files: Vec<PathBuf> = inputs
        .iter()
        .chain(resolved_inputs)
        .map(|i| resolved(&options_file_of(i)))
        .collect();
    let target_file = target.map(Path::new).filter(|t| t.is_file()).map(resolved);
    for (flag, o) in outputs {
        let r = resolved(o);
        let options_name = o
            .file_name()
            .is_some_and(|n| n.to_string_lossy().ends_with(".options.json"));
        let why = if resolved_inputs.contains(&r) {
            "is an input graph"
        } else if options_name || options_files.contains(&r) {
            "is an options file (the targets of a graph)"
        } else if target_file.as_ref() == Some(&r) {
            "is the --target file"
        } else {
            continue;
        };
        bail!("{flag} {} {why}; refusing to overwrite it", o.display());
    }
    for (flag, o) in outputs {
        check_output_path(flag, o)?;
    }
    if let [(_, o), (_, d)] = outputs {
        if destination(o) == destination(d) {
            bail!("--out and --dot name the same file {}", o.display());
        }
    }
    Ok(())
}

/// Every target the inputs' options files list (`listed`, [`targets_for`], when no
/// target is given), loaded and checked as `--target` is before any graph is read; an
/// error names the options file. And `--out`/`--dot` (`outputs`) may not name one of
/// these target files.
fn check_listed_targets(
    inputs: &[PathBuf],
    listed: &[Option<Vec<String>>],
    outputs: &[(&str, &Path)],
) -> Result<()> {
    let mut checked: std::collections::BTreeSet<&str> = Default::default();
    for (input, targets) in inputs.iter().zip(listed) {
        let options = options_file_of(input);
        for t in targets.iter().flatten() {
            if !checked.insert(t) {
                continue;
            }
            let (loaded, _) =
                load_target(t).with_context(|| format!("{}: target {t:?}", options.display()))?;
            arfuse::advanced::policy::resolve_backend(&loaded)
                .with_context(|| format!("{}: target {t:?}", options.display()))?;
            let file = Path::new(t);
            for (flag, o) in outputs {
                if file.is_file() && resolved(o) == resolved(file) {
                    bail!(
                        "{flag} {} is a target file {} lists; refusing to overwrite it",
                        o.display(),
                        options.display()
                    );
                }
            }
        }
    }
    Ok(())
}

/// `--out`/`--dot` (`outputs`) take one graph: refused for a directory `path` of
/// several (`inputs`), before any of them is read.
fn refuse_several_graphs(path: &Path, inputs: &[PathBuf], outputs: &[(&str, &Path)]) -> Result<()> {
    if inputs.len() > 1 && !outputs.is_empty() {
        bail!(
            "{} one input graph; {} has {} entries to lower as graphs (*.json, *.json.gz, \
             *.pt2): lower one of them",
            flags_take(outputs),
            path.display(),
            inputs.len()
        );
    }
    Ok(())
}

/// "--out takes", "--dot takes" or "--out and --dot take": the flags of `outputs`.
fn flags_take(outputs: &[(&str, &Path)]) -> String {
    match outputs {
        [(flag, _)] => format!("{flag} takes"),
        _ => "--out and --dot take".to_string(),
    }
}

/// That output `o` of flag `flag` names a file arfuse can write by renaming a new file
/// over it ([`why_unwritable`]). Checked before anything is lowered.
fn check_output_path(flag: &str, o: &Path) -> Result<()> {
    match why_unwritable(o, false) {
        Some(why) => bail!("{flag} {}{why}", o.display()),
        None => Ok(()),
    }
}

/// That a default output `o` is a file arfuse can write by renaming a new file over it,
/// its directory made when missing ([`why_unwritable`]).
fn check_default_out(o: &Path) -> Result<()> {
    match why_unwritable(o, true) {
        Some(why) => bail!(
            "the default output {}{why}; lower the graph alone with --out FILE",
            o.display()
        ),
        None => Ok(()),
    }
}

/// Why no file can be renamed to `o`, as the end of a sentence about it: it is a
/// directory, or ends in `/`, `/.` or `/..`; the nearest of its ancestors that is there
/// is not a directory (a file, a broken symlink); its directory does not exist (unless
/// `dir_may_be_made`); it is something other than a regular file (a device such as
/// `/dev/null`, a FIFO, a socket), which the rename would replace; its name is over
/// [`MAX_NAME_BYTES`]; it is under `/dev`, `/proc` or `/sys`; no file can be made
/// and removed in its directory, or in the nearest ancestor there when the directory
/// is still to be made ([`probe_new_file`]). `None` when none of these holds. (A symlink
/// at `o` is replaced by the file, not written through.)
fn why_unwritable(o: &Path, dir_may_be_made: bool) -> Option<String> {
    let text = o.as_os_str().to_string_lossy();
    let names_dir = [".", ".."].contains(&text.as_ref())
        || ["/", "/.", "/.."].iter().any(|end| text.ends_with(end))
        || o.file_name().is_none()
        || o.is_dir();
    if names_dir {
        return Some(" names a directory; it takes a file name".into());
    }
    let dir = dir_of(o);
    // The nearest ancestor there is (a relative path's is the current directory when
    // none is): a directory, not a file or a broken symlink.
    let there = dir
        .ancestors()
        .filter(|a| !a.as_os_str().is_empty())
        .find(|a| std::fs::symlink_metadata(a).is_ok());
    if let Some(a) = there {
        if !a.exists() {
            return Some(format!(": {} is a broken symlink", a.display()));
        }
        if !a.is_dir() {
            return Some(format!(": {} is not a directory", a.display()));
        }
    }
    if !dir.exists() && !dir_may_be_made {
        return Some(format!(": directory {} does not exist", dir.display()));
    }
    if let Ok(m) = std::fs::metadata(o) {
        if !m.is_file() {
            return Some(
                " is not a regular file (a device, FIFO or socket): arfuse writes by \
                 renaming a new file over its output, which would replace it; give a file \
                 name"
                    .into(),
            );
        }
    }
    let name_bytes = o.file_name().map_or(0, |n| n.as_encoded_bytes().len());
    if name_bytes > MAX_NAME_BYTES {
        return Some(format!(
            ": its name is {name_bytes} bytes, over the {MAX_NAME_BYTES} a file name may have"
        ));
    }
    if let Some(system) = ["/dev", "/proc", "/sys"]
        .into_iter()
        .find(|s| destination(o).starts_with(s))
    {
        return Some(format!(
            " is under {system}, which holds the system's devices and files, not outputs \
             (arfuse writes by renaming a new file into place); give another file"
        ));
    }
    // Where the write makes its temporary file: the directory, or, for one still to be
    // made, the nearest ancestor there, where it will be made.
    // (Past the checks above, `there` is a directory.)
    let probed = there.unwrap_or(Path::new("."));
    match probe_new_file(probed) {
        Err(e) => Some(format!(
            ": no file can be made and removed in {}: {e}",
            probed.display()
        )),
        Ok(()) => None,
    }
}

/// Makes and removes an empty file in `dir`, as the write's temporary file will be
/// ([`new_file_in`]): a directory arfuse may not write to (permissions, a read-only file
/// system, `/sys`, an append-only directory) fails here, before lowering, not after.
fn probe_new_file(dir: &Path) -> std::io::Result<()> {
    new_file_in(dir)?.close()
}

/// The most bytes of a file name (Linux's `NAME_MAX`; most file systems have it).
const MAX_NAME_BYTES: usize = 255;

/// The options file beside graph `input`: `<name>.options.json`, `<name>` its file name
/// less `.json`, `.json.gz` or `.pt2`, whether the options file exists or not.
fn options_file_of(input: &Path) -> PathBuf {
    let name = input
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let stem = graph_stem(&name).unwrap_or(&name);
    input.with_file_name(format!("{stem}.options.json"))
}

/// The (graph, target) pairs of the run: each input with its targets decided without
/// reading it (`listed`, [`targets_for`]: the given target, or the presets its options
/// file lists), else the one its recorded TP size picks (the graph is read for it, and
/// kept). Every graph that records none is named in one error.
fn plan_jobs(
    inputs: &[PathBuf],
    listed: Vec<Option<Vec<String>>>,
    import: &arfuse::advanced::import::ImportOptions,
) -> Result<Jobs> {
    let mut jobs = Jobs {
        pairs: Vec::new(),
        preloaded: Default::default(),
    };
    let mut unplannable: Vec<String> = Vec::new();
    for (input, list) in inputs.iter().zip(listed) {
        if let Some(list) = list {
            jobs.pairs
                .extend(list.into_iter().map(|t| (input.clone(), t)));
            continue;
        }
        let graph = read_graph(input, import);
        let t = match &graph {
            // The read error is reported with the pair's other failures, with no target
            // (`run_jobs`); this one only stands in for it.
            Err(_) => DEFAULT_TARGET.to_string(),
            Ok(g) => match target_from_graph(g) {
                Ok((t, note)) => {
                    if let Some(note) = note {
                        eprintln!("note: {}: {note}", input.display());
                    }
                    t
                }
                Err(why) => {
                    unplannable.push(format!("{}: {why}", input.display()));
                    continue;
                }
            },
        };
        jobs.preloaded.insert(input.clone(), graph);
        jobs.pairs.push((input.clone(), t));
    }
    if !unplannable.is_empty() {
        bail!(
            "{}\npass --target PRESET|FILE.toml, or --world-size N for the tensor-parallel size \
             the model was exported for (N picks {}-xN); the presets by world size:\n{}",
            unplannable.join("\n"),
            arfuse::advanced::policy::DEFAULT_PRESET_FAMILY,
            presets_by_world_size()
        );
    }
    Ok(jobs)
}

/// What `--out`/`--dot` (`outputs`) cannot be given with, once the pairs are known:
/// several targets for one graph.
fn check_outputs(pairs: &[(PathBuf, String)], outputs: &[(&str, &Path)]) -> Result<()> {
    if pairs.len() > 1 && !outputs.is_empty() {
        bail!("{}", one_target_refusal(pairs, outputs));
    }
    Ok(())
}

/// Every pair's output path, decided (and checked) before anything is lowered or
/// written: `--out`, else the default, which may be neither an input graph, nor shared
/// by two pairs (two inputs, or two targets of one name), nor `--dot`'s file, nor a
/// path no file can be renamed to ([`check_default_out`]). The path of an unreadable
/// graph's pair ([`Jobs::unreadable`]) is not checked: it has no target, and nothing
/// is written there.
fn output_paths(
    root: &Path,
    jobs: &Jobs,
    resolved_inputs: &[PathBuf],
    out: Option<&Path>,
    dot: Option<&Path>,
) -> Result<Vec<PathBuf>> {
    let pairs = &jobs.pairs;
    if let Some(p) = out {
        return Ok(vec![p.to_path_buf(); pairs.len()]);
    }
    let out_paths: Vec<PathBuf> = pairs
        .iter()
        .map(|(input, t)| default_out(root, input, &target_name(t)))
        .collect();
    let checked = || {
        pairs
            .iter()
            .zip(&out_paths)
            .filter(|((input, _), _)| !jobs.unreadable(input))
    };
    for (_, o) in checked() {
        if dot.is_some_and(|d| destination(d) == destination(o)) {
            bail!(
                "--dot {} is where the lowered graph goes by default; give --dot another \
                 file (or --out one)",
                o.display()
            );
        }
        check_default_out(o)?;
    }
    let mut seen: std::collections::BTreeMap<PathBuf, (&Path, &str)> = Default::default();
    for ((input, t), o) in checked() {
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
        if let Some((other, other_t)) = seen.insert(r, (input, t)) {
            if other == input.as_path() {
                bail!(
                    "{} on {other_t} and on {t} would both be written to {} (the targets \
                     share the name {}); lower them one at a time with --out FILE",
                    input.display(),
                    o.display(),
                    target_name(t)
                );
            }
            bail!(
                "{} and {} would both be written to {}; lower them one at a time with \
                 --out FILE",
                other.display(),
                input.display(),
                o.display()
            );
        }
    }
    Ok(out_paths)
}

/// What every pair of a run shares.
struct Run<'a> {
    /// No `--out`: each pair goes to its default output.
    out_is_default: bool,
    dot: Option<&'a Path>,
    world_size_given: bool,
    options: &'a LowerOptions,
    output: &'a Output,
    import: &'a arfuse::advanced::import::ImportOptions,
}

/// Lowers every pair (a graph read once for its consecutive pairs), writing what
/// succeeds; prints the JSON report when asked; fails when any pair failed, saying how
/// many.
fn run_jobs(run: &Run<'_>, jobs: &mut Jobs, out_paths: &[PathBuf]) -> Result<ExitCode> {
    let mut failed = 0usize;
    let mut json_reports = Vec::new();
    // The graph of the pairs in hand (consecutive pairs share their graph), or why it
    // could not be read.
    let mut loaded: Option<(PathBuf, std::result::Result<Graph, String>)> = None;
    for ((input, target_spec), out_path) in jobs.pairs.iter().zip(out_paths) {
        // A graph read to choose its target and found unreadable has no target: its
        // pair's target spec is a placeholder.
        let target_chosen = !jobs.unreadable(input);
        // Whether this graph's read already failed for an earlier pair (said then).
        let failed_before = matches!(&loaded, Some((p, Err(_))) if p == input);
        // Every target was loaded once before lowering; one that fails now (a file
        // changed meanwhile) fails its pair.
        let outcome = load_target(target_spec)
            .map_err(|e| format!("{e:#}"))
            .and_then(|(target, target_name)| {
                let pair = Pair {
                    input,
                    target: &target,
                    target_name: &target_name,
                    out_path,
                    default_out: run.out_is_default,
                    dot: run.dot,
                    world_size_given: run.world_size_given,
                };
                if !matches!(&loaded, Some((p, _)) if p == input) {
                    loaded = None;
                }
                let (_, graph) = loaded.get_or_insert_with(|| {
                    let g = match jobs.preloaded.remove(input) {
                        Some(g) => g,
                        None => read_graph(input, run.import),
                    };
                    (input.clone(), g.map_err(|e| format!("{e:#}")))
                });
                match graph {
                    Ok(g) => lower_pair(&pair, g, run.options, run.output),
                    Err(e) => Err(e.clone()),
                }
            });
        match outcome {
            Ok(Some(json)) => json_reports.push(json),
            Ok(None) => {}
            Err(msg) => {
                if failed_before {
                    eprintln!(
                        "error: {}: not lowered for {}: the graph could not be read (above)",
                        input.display(),
                        target_name(target_spec)
                    );
                } else {
                    eprintln!("error: {msg}");
                }
                failed += 1;
                // A failed pair is in the JSON report too, with its error.
                json_reports.push(serde_json::json!({
                    "input": input.display().to_string(),
                    "target": target_chosen.then(|| target_name(target_spec)),
                    "error": msg,
                }));
            }
        }
    }
    if matches!(run.output.report, ReportFormat::Json) {
        println!("{}", serde_json::to_string_pretty(&json_reports)?);
    }
    if failed > 0 {
        eprintln!(
            "{failed} of {} (graph, target) pair(s) failed",
            jobs.pairs.len()
        );
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// One (graph, target) pair of `lower` and where its outputs go.
struct Pair<'a> {
    input: &'a Path,
    target: &'a Target,
    target_name: &'a str,
    out_path: &'a Path,
    /// `out_path` is the default under `target/arfuse/` (its directory may be created).
    default_out: bool,
    dot: Option<&'a Path>,
    /// The world size came from `--world-size` (the user stated it: no note that it
    /// was assumed).
    world_size_given: bool,
}

/// Lowers one pair, prints its table report, writes its outputs; returns its JSON
/// report entry (with `--report json`), or the error, naming the input.
fn lower_pair(
    pair: &Pair<'_>,
    graph: &Graph,
    options: &LowerOptions,
    output: &Output,
) -> std::result::Result<Option<serde_json::Value>, String> {
    let Pair {
        input,
        target,
        target_name,
        out_path,
        ..
    } = *pair;
    if let Some(g) = &options.group {
        let groups: std::collections::BTreeSet<&str> = graph
            .nodes()
            .filter_map(|(_, n)| match &n.op {
                arfuse::advanced::ir::Op::AllReduce { group, .. } => Some(group.as_str()),
                arfuse::advanced::ir::Op::FusedAllreduceNorm(f) => Some(f.group.as_str()),
                _ => None,
            })
            .collect();
        if !groups.is_empty() && !groups.contains(g.as_str()) {
            let list: Vec<&str> = groups.into_iter().collect();
            return Err(format!(
                "{}: --group {g:?} matches no all-reduce; the graph's groups are {}",
                input.display(),
                list.join(", ")
            ));
        }
    }
    if !pair.world_size_given {
        if let Some(note) = assumed_world_size_note(graph, target, target_name) {
            eprintln!("note: {}: {note}", input.display());
        }
    }
    let start = std::time::Instant::now();
    let lowered = match arfuse::lower_with(graph, target, options) {
        Ok(l) => l,
        Err(e) => {
            return Err(format!(
                "lowering {} for {target_name}: {e}",
                input.display()
            ))
        }
    };
    let elapsed = start.elapsed();
    // Only collectives arfuse does not understand: not a success, even with nothing
    // to write wrong.
    let r = &lowered.report;
    if r.all_reduces_seen == 0 && r.already_fused == 0 && !r.unknown_collectives.is_empty() {
        return Err(format!(
            "{}: no all-reduce arfuse understands, only collective-looking ops it \
                 keeps opaque ({}); if they are all-reduces, name them with --all-reduce-op \
                 NAME[=GROUP]",
            input.display(),
            r.unknown_collectives.join(", ")
        ));
    }
    // `--check` before anything is written: a pair whose check fails leaves no output.
    let check = match output.check {
        Some(tokens) => Some(check_pair(pair, graph, &lowered, tokens)?),
        None => None,
    };
    if let Some(Checked {
        failure: Some(why),
        summary,
        ..
    }) = &check
    {
        print_report(pair, graph, &lowered, output, elapsed);
        match output.report {
            ReportFormat::Table => println!("{summary}"),
            ReportFormat::Json => eprintln!("{summary}"),
        }
        return Err(format!("{why} (nothing written)"));
    }
    // The outputs before the report: a reader that closes stdout early (`| head`) must
    // not cost the lowered graph.
    if pair.default_out {
        if let Some(dir) = out_path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        }
    }
    let mut files: Vec<(&Path, String)> = vec![(out_path, lowered.graph.to_json_string())];
    if let Some(d) = pair.dot {
        files.push((d, lowered.graph.to_dot()));
    }
    write_all_atomic(&files).map_err(|e| format!("{e:#}"))?;
    print_report(pair, graph, &lowered, output, elapsed);
    if let (Some(c), ReportFormat::Table) = (&check, &output.report) {
        println!("{}", c.summary);
    }
    for (p, _) in &files {
        eprintln!("wrote {}", p.display());
    }
    Ok(matches!(output.report, ReportFormat::Json).then(|| {
        let mut entry = serde_json::json!({
            "input": input.display().to_string(),
            "target": target_name,
            "report": lowered.report,
        });
        if let Some(c) = check {
            entry["check"] = c.json;
        }
        entry
    }))
}

/// The table report of one pair (nothing with `--report json`).
fn print_report(
    pair: &Pair<'_>,
    graph: &Graph,
    lowered: &arfuse::Lowered,
    output: &Output,
    elapsed: std::time::Duration,
) {
    if let ReportFormat::Table = output.report {
        println!(
            "== {} on {} ({} graph nodes, lowered in {:.1} ms)",
            pair.input.display(),
            pair.target_name,
            graph.len(),
            elapsed.as_secs_f64() * 1e3
        );
        if output.sites {
            println!("{}", lowered.report.display_every_site());
        } else {
            println!("{}", lowered.report);
        }
    }
}

/// What `--check` found for one pair.
struct Checked {
    /// `check (N s): ...`, the check's table.
    summary: String,
    /// The JSON report's `check` entry.
    json: serde_json::Value,
    /// Why the pair fails, when a site differs.
    failure: Option<String>,
}

/// `--check`: the per-site equivalence check of one lowered pair, or the error when it
/// could not run.
fn check_pair(
    pair: &Pair<'_>,
    graph: &Graph,
    lowered: &arfuse::Lowered,
    tokens: SiteTokens<'_>,
) -> std::result::Result<Checked, String> {
    const SEED: u64 = 0;
    let start = std::time::Instant::now();
    let result = arfuse::advanced::reference::check_sites(
        graph,
        &lowered.graph,
        &lowered.sites,
        pair.target.world_size,
        tokens,
        SEED,
    )
    .map_err(|e| {
        format!(
            "checking {} on {}: {e}",
            pair.input.display(),
            pair.target_name
        )
    })?;
    let seconds = start.elapsed().as_secs_f64();
    let mut summary = format!("check ({seconds:.2} s): {result}");
    if lowered.report.already_fused > 0 {
        summary.push_str(&format!(
            "  {} fused node(s) already in the input are kept as they are and not checked \
             (no original chain to compare with)\n",
            lowered.report.already_fused
        ));
    }
    let failure = (!result.is_equivalent()).then(|| {
        format!(
            "{} on {}: {} of {} fused sites differ from the chains they replaced",
            pair.input.display(),
            pair.target_name,
            result.failures().len(),
            result.sites.len()
        )
    });
    let groups: Vec<serde_json::Value> = result
        .groups()
        .into_iter()
        .map(|g| {
            serde_json::json!({
                "hidden": g.hidden,
                "tokens": g.tokens,
                "skipped_tokens": g.skipped_tokens,
                "fused_nodes": g.fused_nodes,
                "bit_exact": g.bit_exact,
            })
        })
        .collect();
    let json = serde_json::json!({
        "contract": result.contract,
        "equivalent": result.is_equivalent(),
        "world_size": result.world_size,
        "seed": result.seed,
        "sites": result.sites.len(),
        "kept_nodes": result.kept_nodes,
        "already_fused_not_checked": lowered.report.already_fused,
        "groups": groups,
        "seconds": seconds,
    });
    Ok(Checked {
        summary,
        json,
        failure,
    })
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
    // The Python package and its tests (torch.compile on gloo): see python.rs.
    let python = python::test(root).context("the Python tests (crates/python/tests)")?;
    eprintln!(
        "xtask test: cargo test {}; Python tests {}",
        if status.success() { "passed" } else { "FAILED" },
        python.describe()
    );
    // Left out on request (not in CI), the Python tests do not fail the command; the
    // line above says they did not run.
    Ok(if status.success() && python != python::Outcome::Failed {
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

    /// A directory's graph-named entries are all listed, so one that is no regular
    /// file fails as a pair instead of being skipped unsaid.
    #[test]
    fn graphs_in_lists_every_graph_named_entry() {
        let dir = std::env::temp_dir().join(format!("arfuse-graphs-in-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub.json")).unwrap();
        for f in [
            "good.json",
            "b.json.gz",
            "c.pt2",
            "good.options.json",
            "notes.md",
        ] {
            std::fs::write(dir.join(f), b"{}").unwrap();
        }
        #[cfg(unix)]
        std::os::unix::fs::symlink(dir.join("missing"), dir.join("broken.json")).unwrap();
        let names: Vec<String> = graphs_in(&dir)
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        let mut want = vec!["b.json.gz", "c.pt2", "good.json", "sub.json"];
        if cfg!(unix) {
            want.insert(1, "broken.json");
        }
        assert_eq!(names, want);
        let none = arfuse::advanced::import::ImportOptions::default();
        let err = read_graph(&dir.join("sub.json"), &none).unwrap_err();
        assert!(
            format!("{err:#}").contains("is not a regular file"),
            "{err:#}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn shared_hidden_values_are_integers_with_a_reason() {
        assert_eq!(parse_shared_hidden("4096"), Ok(4096));
        for bad in ["-4096", "4k", "", "0"] {
            let e = parse_shared_hidden(bad).unwrap_err();
            assert!(
                e.starts_with("a hidden size is the number of elements"),
                "{e}"
            );
        }
    }

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
        assert_eq!(
            out("m/x.json.gz", "b200-x8"),
            expect("x.b200-x8.lowered.json")
        );
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
    fn a_graph_without_tp_is_refused_and_a_recorded_tp_picks_its_preset() {
        let root = workspace_root();
        let none = arfuse::advanced::import::ImportOptions::default();
        let exported = read_graph(
            &root.join("ir-fixtures/exported/qwen3_30b_a3b_L2_tp4.exported_program.json"),
            &none,
        )
        .unwrap();
        let why = target_from_graph(&exported).unwrap_err();
        assert!(
            why.starts_with("the graph records no tensor-parallel size"),
            "{why}"
        );
        // A corpus graph records tp = 4: the H200 SXM preset with 4 ranks, said so.
        let corpus =
            read_graph(&root.join("ir-fixtures/models/gemma3_1b_tp4.json"), &none).unwrap();
        let (t, note) = target_from_graph(&corpus).unwrap();
        assert_eq!(t, "h200-sxm-x4");
        let note = note.unwrap();
        assert!(
            note.starts_with("recorded tp = 4: planned for h200-sxm-x4 (H200 SXM x4, "),
            "{note}"
        );
        assert!(
            note.contains("h100-sxm-x4, b200-x4, b300-x4, rtx-pro-6000-x4"),
            "{note}"
        );
        // A recorded size no preset has: said without naming a flag nobody passed.
        let mut odd = corpus.clone();
        odd.set_metadata(Some(serde_json::json!({"tp": 3})));
        let why = target_from_graph(&odd).unwrap_err();
        assert!(
            why.starts_with("the graph records tp = 3: no preset has world_size 3"),
            "{why}"
        );
        assert!(!why.contains("--world-size"), "{why}");
    }

    #[test]
    fn world_size_names_the_preset_it_picks() {
        let (t, note) = world_size_choice(2).unwrap();
        assert_eq!(t, "h200-sxm-x2");
        assert_eq!(
            note,
            "--world-size 2: planned for h200-sxm-x2 (H200 SXM x2, HGX node, NVSwitch, \
             multicast (NVLS) on every GPU); other presets with world_size 2: h100-sxm-x2, \
             b200-x2 (pass --target NAME)"
        );
        let e = format!("{:#}", world_size_choice(6).unwrap_err());
        assert_eq!(
            e,
            "--world-size 6: no preset has world_size 6 (the presets have 2, 4, 8, 16); pass \
             --target with a TOML file for this machine"
        );
        let list = presets_by_world_size();
        assert_eq!(list.lines().count(), 4, "{list}");
        assert!(
            list.starts_with("  W=2: h100-sxm-x2, h200-sxm-x2, b200-x2\n"),
            "{list}"
        );
    }

    #[test]
    fn assumed_world_size_note_only_without_recorded_tp() {
        let root = workspace_root();
        let target = Target::preset("b300-x4").unwrap();
        let none = arfuse::advanced::import::ImportOptions::default();
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
