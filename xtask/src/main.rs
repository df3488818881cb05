//! `cargo xtask`: the project's commands for people working in the checkout.
//!
//! - `cargo xtask lower [ARGS]`: `arfuse lower` (crates/cli) with the checkout's
//!   defaults: the bundled Llama-3.1-8B TP8 graph on h200-sxm-x8 when no graph is given,
//!   outputs under `target/arfuse/`.
//! - `cargo xtask test [CARGO TEST ARGS]` (then the Python tests, `python.rs`)
//! - `cargo xtask gpu-check [--build-only] [-- GPU_CHECK ARGS]`
//! - `cargo xtask host-check [-- GPU_CHECK ARGS]`
//!
//! Run `cargo xtask help` for details.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
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

#[derive(Subcommand)]
enum Command {
    /// `arfuse lower` (crates/cli) in the checkout: with no graph, the bundled
    /// Llama-3.1-8B TP8 graph on h200-sxm-x8; default outputs go to target/arfuse/.
    Lower(arfuse_cli::LowerArgs),
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
    arfuse_cli::restore_sigpipe();
    let cli = Cli::parse();
    let root = workspace_root();
    let result = match cli.command {
        Command::Lower(args) => {
            let graph = root.join(DEFAULT_GRAPH);
            arfuse_cli::lower(args, Some(&graph), &root.join("target/arfuse"))
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

fn workspace_root() -> PathBuf {
    // xtask lives in <root>/xtask.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
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
}
