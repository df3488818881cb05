//! The `arfuse` command line: `arfuse lower` lowers graph files for a target, prints the
//! report and writes the lowered graphs. `cargo xtask lower` in a checkout runs the same
//! code ([`lower`]) with the checkout's defaults.
//!
//! What a run promises: a (graph, target) pair whose lowering fails writes nothing, an
//! input (graph, options file, target file) is never overwritten, and every error names
//! the file and the flag it is about. `docs/cli.md` gives the flags, the options files,
//! the outputs and the exit codes.

use anyhow::{bail, Result};
use clap::{value_parser, Args, ValueEnum};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

mod inputs;
mod outputs;
mod run;
mod targets;
#[cfg(test)]
mod tests;

pub use targets::{targets_table, DEFAULT_TARGET};

/// How `lower` prints its report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ReportFormat {
    /// A readable table.
    Table,
    /// The report as JSON: one entry per (graph, target) pair.
    Json,
}

/// The arguments of `lower` (`arfuse lower`, `cargo xtask lower`).
#[derive(Args, Debug)]
pub struct LowerArgs {
    /// Graph file (arfuse JSON, torch.export JSON, either gzipped, or .pt2) or a
    /// directory of them.
    #[arg(value_name = "GRAPH|DIR")]
    pub path: Option<PathBuf>,
    /// Target preset name (see `--list-targets`) or a TOML target file. Default: the
    /// presets the graph's `<name>.options.json` lists, else the H200 SXM preset of the
    /// tensor-parallel size the graph records; a graph with all-reduces that records
    /// none needs `--target` or `--world-size`.
    #[arg(long, short, conflicts_with = "world_size")]
    pub target: Option<String>,
    /// The tensor-parallel size W the graph was exported for: plans for `h200-sxm-xW`
    /// (else the one preset with W ranks).
    #[arg(long = "world-size", value_name = "N", allow_negative_numbers = true,
          value_parser = value_parser!(u32).range(1..))]
    pub world_size: Option<u32>,
    /// Where to write the lowered graph (one graph and one target only). Default:
    /// `<output directory>/<name>.<target>.lowered.json`.
    #[arg(long, short)]
    pub out: Option<PathBuf>,
    /// Report format.
    #[arg(long, value_enum, default_value = "table")]
    pub report: ReportFormat,
    /// Also write the lowered graph as Graphviz DOT (one graph and one target only).
    #[arg(long)]
    pub dot: Option<PathBuf>,
    /// The layers' tensor-parallel process group (default: inferred from the graph).
    #[arg(long)]
    pub group: Option<String>,
    /// Hidden size, in elements, of another graph sharing this graph's workspace (e.g.
    /// a speculative-decoding draft); repeatable.
    #[arg(long = "shared-hidden", value_name = "H", allow_negative_numbers = true,
          value_parser = value_parser!(u64).range(1..))]
    pub shared_hidden: Vec<u64>,
    /// A framework's own all-reduce op to import as a sum all-reduce (repeatable), e.g.
    /// `vllm.all_reduce`; `=GROUP` gives its process group when the op has no
    /// `group_name` argument (torch.export / FX graphs only).
    #[arg(long = "all-reduce-op", value_name = "NAME[=GROUP]")]
    pub all_reduce_ops: Vec<arfuse::advanced::import::CustomAllReduce>,
    /// In the table report, one line per site (default: sites that differ only in their
    /// layer index share a line).
    #[arg(long)]
    pub sites: bool,
    /// After lowering, check every fused site against the chain it replaced, bit for bit
    /// on W ranks with random inputs: every site at T = 1 and W, the first site of each
    /// kind at every T of its plan. A difference fails the pair, which writes nothing.
    #[arg(long)]
    pub check: bool,
    /// `--check` with every site at every T of its plan.
    #[arg(long, conflicts_with = "check")]
    pub check_all: bool,
    /// List the target presets (GPU, W, nodes, interconnect, the backend each resolves
    /// to) and exit.
    #[arg(long, exclusive = true)]
    pub list_targets: bool,
}

/// Runs `lower`: exit status 0 when every pair lowered (and checked, with `--check`),
/// 1 when any failed (each said on stderr, and in the JSON report). `default_graph` is
/// lowered, on [`DEFAULT_TARGET`], when no path is given (`None`: a path is required);
/// default outputs go to `out_dir` (made when missing; empty: the current directory).
/// Errors: whatever stops the run before any pair is lowered (a missing input, a bad
/// target or options file, an output that would overwrite an input).
pub fn lower(args: LowerArgs, default_graph: Option<&Path>, out_dir: &Path) -> Result<ExitCode> {
    if args.list_targets {
        print!("{}", targets_table());
        return Ok(ExitCode::SUCCESS);
    }
    let Some(path) = args.path.as_deref().or(default_graph) else {
        bail!("give a graph file or directory to lower (arfuse lower --help)")
    };
    let inputs = inputs::graph_files(path)?;
    let target = targets::given_target(args.path.is_none(), &args)?;
    let requested: Vec<(&str, PathBuf)> = [("--out", &args.out), ("--dot", &args.dot)]
        .into_iter()
        .filter_map(|(flag, p)| Some((flag, p.clone()?)))
        .collect();
    let settings = run::Settings::new(&args);
    let jobs = inputs::plan_jobs(&inputs, target.as_deref(), &requested, &settings.import)?;
    let dests = outputs::destinations(&jobs, &requested, out_dir)?;
    run::run_jobs(&settings, jobs, dests)
}

/// Puts SIGPIPE back to its default action, so that printing into a closed pipe
/// (`arfuse lower | head`) ends the process quietly instead of panicking. Call once at
/// the start of `main`.
pub fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: SIG_DFL is a valid action; called before the program starts threads.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
