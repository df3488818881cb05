//! The Python step of `cargo xtask test`: a virtual environment it manages
//! (`<target dir>/python-venv`, reused when present) with torch (the PyPI wheel, used on
//! the CPU), transformers, pytest and maturin, the package `arfuse` built and installed
//! from `crates/python` (`pip install`, maturin, a release build), then pytest on
//! `crates/python/tests`.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// What the tests need besides the package (PyPI names). torch's default Linux wheel
/// runs on the CPU; transformers builds the Hugging Face test model.
const REQUIREMENTS: &[&str] = &["torch", "transformers", "pytest", "maturin>=1.7,<2"];

/// Set to `0` to leave the Python tests out of `cargo xtask test` (they are then
/// reported as not run).
pub const SKIP_VAR: &str = "ARFUSE_PYTHON_TESTS";

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|d| if d.is_absolute() { d } else { root.join(d) })
        .unwrap_or_else(|| root.join("target"))
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {what}"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

/// The venv's interpreter, creating the venv with `python3 -m venv` when it is missing.
fn venv_python(root: &Path) -> Result<PathBuf> {
    let venv = target_dir(root).join("python-venv");
    let python = venv.join("bin").join("python");
    if !python.is_file() {
        eprintln!("xtask test: creating {}", venv.display());
        run(
            Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
                .args(["-m", "venv"])
                .arg(&venv),
            "python3 -m venv",
        )?;
    }
    Ok(python)
}

/// Installs what is missing of [`REQUIREMENTS`] (a no-op import check when all are there).
fn install_requirements(python: &Path) -> Result<()> {
    let present = Command::new(python)
        .args(["-c", "import torch, transformers, pytest, maturin"])
        .output()
        .is_ok_and(|o| o.status.success());
    if present {
        return Ok(());
    }
    eprintln!("xtask test: pip install {}", REQUIREMENTS.join(" "));
    run(
        Command::new(python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(REQUIREMENTS),
        "pip install of the Python test requirements",
    )
}

/// `PATH` with the venv's `bin` first (maturin's build backend runs the `maturin`
/// executable it finds there).
fn venv_path(python: &Path) -> std::ffi::OsString {
    let bin = python.parent().map(Path::to_path_buf).unwrap_or_default();
    let rest = std::env::var_os("PATH").unwrap_or_default();
    std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(&rest))).unwrap_or(rest)
}

/// Builds and installs `crates/python` into the venv (maturin from the venv).
fn install_package(root: &Path, python: &Path) -> Result<()> {
    eprintln!("xtask test: pip install crates/python (maturin, release build)");
    run(
        Command::new(python)
            .env("PATH", venv_path(python))
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-build-isolation",
                "--force-reinstall",
                "--no-deps",
            ])
            .arg(root.join("crates/python"))
            .current_dir(root),
        "pip install crates/python",
    )
}

/// The Python step. `Ok(true)`: the tests ran and passed; `Ok(false)`: they failed;
/// `Err`: the environment could not be set up. Skipped (with a line saying so) when
/// [`SKIP_VAR`] is `0`.
pub fn test(root: &Path) -> Result<bool> {
    if std::env::var(SKIP_VAR).is_ok_and(|v| v == "0") {
        eprintln!("xtask test: {SKIP_VAR}=0: the Python tests (crates/python/tests) were NOT run");
        return Ok(true);
    }
    let started = Instant::now();
    let python = venv_python(root)?;
    install_requirements(&python)?;
    install_package(root, &python)?;
    let setup = started.elapsed();
    let tests = Instant::now();
    let status = Command::new(&python)
        .args(["-m", "pytest", "-q", "crates/python/tests"])
        .current_dir(root)
        .env("PATH", venv_path(&python))
        .env_remove("PYTHONPATH")
        .status()
        .context("running pytest")?;
    eprintln!(
        "xtask test: Python set-up {:.0} s, pytest {:.0} s",
        setup.as_secs_f64(),
        tests.elapsed().as_secs_f64()
    );
    Ok(status.success())
}
