//! `arfuse`: lower tensor-parallel graphs for a target (`arfuse lower --help`).

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// mimalloc, as in every arfuse binary (the root `Cargo.toml` says why).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "arfuse",
    version,
    about = "Fuse all-reduce + residual add + RMSNorm (+ quant) in tensor-parallel graphs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Lower a graph (arfuse JSON, torch.export JSON or .pt2) or every graph in a
    /// directory for a target, print the report and write the lowered graph (by default
    /// into the current directory as <name>.<target>.lowered.json).
    Lower(arfuse_cli::LowerArgs),
}

fn main() -> ExitCode {
    arfuse_cli::restore_sigpipe();
    let Command::Lower(args) = Cli::parse().command;
    match arfuse_cli::lower(args, None, std::path::Path::new("")) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
