//! The Python step of `cargo xtask test`: a virtual environment it manages
//! (`<target dir>/python-venv`, reused when present) with torch (the PyPI wheel, used on
//! the CPU), transformers, pytest and maturin, the package `arfuse` built and installed
//! from `crates/python` (`pip install`, maturin, a release build), then pytest on
//! `crates/python/tests`.
//!
//! A skipped test is a failure here: pytest runs with `ARFUSE_PYTEST_NO_SKIP=1`, under
//! which `crates/python/tests/conftest.py` fails the session when any test or module
//! was skipped (a missing torch would otherwise turn the gloo test into a pass).

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// What the tests need besides the package (PyPI names). torch's default Linux wheel
/// (about 5 GB with its CUDA libraries) runs on the CPU; transformers builds the
/// Hugging Face test model.
const REQUIREMENTS: &[&str] = &["torch", "transformers", "pytest", "maturin>=1.7,<2"];

/// Set to `0` to leave the Python tests out of `cargo xtask test` outside CI: they are
/// then reported as NOT RUN, never as passed. Refused when `CI=true`.
pub const SKIP_VAR: &str = "ARFUSE_PYTHON_TESTS";

/// Set by the Python step for pytest: `conftest.py` then fails the run on any skip.
const NO_SKIP_VAR: &str = "ARFUSE_PYTEST_NO_SKIP";

/// How the Python step ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every test ran and passed (none skipped).
    Passed,
    /// pytest failed (a failed or skipped test, or no test collected).
    Failed,
    /// Left out on request ([`SKIP_VAR`]`=0`).
    NotRun,
}

impl Outcome {
    /// The words of `cargo xtask test`'s summary line.
    pub fn describe(self) -> &'static str {
        match self {
            Outcome::Passed => "passed",
            Outcome::Failed => "FAILED",
            Outcome::NotRun => "NOT RUN (ARFUSE_PYTHON_TESTS=0)",
        }
    }
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|d| if d.is_absolute() { d } else { root.join(d) })
        .unwrap_or_else(|| root.join("target"))
}

/// A command that runs without a terminal's help: pip never asks (CI has no stdin).
fn quiet_command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    cmd.env("PIP_NO_INPUT", "1")
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .stdin(std::process::Stdio::null());
    cmd
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {what}"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

/// The venv's interpreter, creating the venv with `python3 -m venv` (or `$PYTHON`) when
/// it is missing.
fn venv_python(root: &Path) -> Result<PathBuf> {
    let venv = target_dir(root).join("python-venv");
    let python = venv.join("bin").join("python");
    if !python.is_file() {
        eprintln!("xtask test: creating {}", venv.display());
        let base = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        run(
            quiet_command(&base).args(["-m", "venv"]).arg(&venv),
            &format!("{base} -m venv (python3 with its venv module is needed)"),
        )?;
    }
    Ok(python)
}

/// The modules of [`REQUIREMENTS`], looked up without importing them (importing torch
/// takes seconds, minutes on a loaded machine; a broken install fails in pytest).
const FIND_MODULES: &str = "import importlib.util as u, sys; \
    sys.exit(0 if all(u.find_spec(m) for m in ('torch', 'transformers', 'pytest', 'maturin')) else 1)";

/// Installs [`REQUIREMENTS`] unless all of them are found in the venv.
fn install_requirements(python: &Path) -> Result<()> {
    let present = quiet_command(python)
        .args(["-c", FIND_MODULES])
        .output()
        .is_ok_and(|o| o.status.success());
    if present {
        return Ok(());
    }
    eprintln!(
        "xtask test: pip install {} (the first time: about 5 GB)",
        REQUIREMENTS.join(" ")
    );
    run(
        quiet_command(python)
            .args(["-m", "pip", "install", "--progress-bar", "off"])
            .args(REQUIREMENTS),
        "pip install of the Python test requirements (a broken venv: delete it and rerun)",
    )
}

/// `PATH` with the venv's `bin` first (maturin's build backend runs the `maturin`
/// executable it finds there).
fn venv_path(python: &Path) -> std::ffi::OsString {
    let bin = python.parent().map(Path::to_path_buf).unwrap_or_default();
    let rest = std::env::var_os("PATH").unwrap_or_default();
    std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(&rest))).unwrap_or(rest)
}

/// Builds and installs `crates/python` into the venv (maturin from the venv, a release
/// build in the workspace's target dir).
fn install_package(root: &Path, python: &Path) -> Result<()> {
    eprintln!("xtask test: pip install crates/python (maturin, release build)");
    run(
        quiet_command(python)
            .env("PATH", venv_path(python))
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-build-isolation",
                "--force-reinstall",
                "--no-deps",
            ])
            .arg(root.join("crates/python"))
            .current_dir(root),
        "pip install crates/python",
    )
}

/// pytest on `crates/python/tests`, skips counted as failures; true when it passed.
fn pytest(root: &Path, python: &Path) -> Result<bool> {
    let status = quiet_command(python)
        .args(["-m", "pytest", "-q", "-rs", "crates/python/tests"])
        .current_dir(root)
        .env("PATH", venv_path(python))
        .env(NO_SKIP_VAR, "1")
        .env_remove("PYTHONPATH")
        .status()
        .context("running pytest")?;
    Ok(status.success())
}

fn secs(d: Duration) -> String {
    format!("{:.0} s", d.as_secs_f64())
}

/// The Python step. `Err`: the environment could not be set up (or the opt-out was
/// used in CI).
pub fn test(root: &Path) -> Result<Outcome> {
    if std::env::var(SKIP_VAR).is_ok_and(|v| v == "0") {
        if in_ci() {
            bail!("{SKIP_VAR}=0 is not allowed in CI (CI=true): the Python tests must run");
        }
        eprintln!("xtask test: {SKIP_VAR}=0: the Python tests (crates/python/tests) were NOT run");
        return Ok(Outcome::NotRun);
    }
    let t = Instant::now();
    let python = venv_python(root)?;
    let venv = t.elapsed();
    let t = Instant::now();
    install_requirements(&python)?;
    let requirements = t.elapsed();
    let t = Instant::now();
    install_package(root, &python)?;
    let package = t.elapsed();
    let t = Instant::now();
    let passed = pytest(root, &python)?;
    eprintln!(
        "xtask test: Python step: venv {}, requirements {}, package build + install {}, pytest {}",
        secs(venv),
        secs(requirements),
        secs(package),
        secs(t.elapsed())
    );
    Ok(if passed {
        Outcome::Passed
    } else {
        Outcome::Failed
    })
}
