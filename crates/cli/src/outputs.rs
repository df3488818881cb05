//! Where each pair's outputs go, decided before anything is lowered: every output's
//! temporary file is made in its directory first (that is the check that the directory
//! exists and can be written), and renamed into place only once its pair lowered.

use crate::inputs::{file_name, graph_stem, Job};
use crate::targets::{is_target_file, target_name};
use anyhow::{bail, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use tempfile::NamedTempFile;

/// Whether `a` and `b` are one file: the same path, or, when both exist, the same file
/// however named (symlinks, hard links).
fn same(a: &Path, b: &Path) -> bool {
    let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    abs(a) == abs(b) || same_file::is_same_file(a, b).unwrap_or(false)
}

/// "--out takes", "--dot takes" or "--out and --dot take": the flags of `requested`.
pub(crate) fn flags_take(requested: &[(&str, PathBuf)]) -> String {
    match requested {
        [(flag, _)] => format!("{flag} takes"),
        _ => "--out and --dot take".to_string(),
    }
}

/// What `--out`/`--dot` (`requested`) may never be: a directory, something other than a
/// regular file (`/dev/null`, which the rename would replace), an options file (any
/// `*.options.json`), both flags one file.
fn check_requested(requested: &[(&str, PathBuf)]) -> Result<()> {
    for (flag, o) in requested {
        let text = o.to_string_lossy();
        let why = if o.is_dir() || text.ends_with('/') || text.ends_with("/.") {
            "names a directory; it takes a file name"
        } else if o.exists() && !o.is_file() {
            "is not a regular file (a device, FIFO or socket); give a file name"
        } else if file_name(o).ends_with(".options.json") {
            "is an options file (the targets of a graph); refusing to overwrite it"
        } else {
            continue;
        };
        bail!("{flag} {} {why}", o.display());
    }
    match requested {
        [(_, o), (_, d)] if same(o, d) => {
            bail!("--out and --dot name the same file {}", o.display())
        }
        _ => Ok(()),
    }
}

/// Where a pair's lowered graph goes by default: `<out_dir>/<stem>.<target>.lowered.json`.
/// For a graph already lowered (`x.lowered.json`, `x.<target>.lowered.json`) the stem
/// drops `.lowered` and that target's name, so names never stack.
pub(crate) fn default_out(out_dir: &Path, input: &Path, target: &str) -> PathBuf {
    let name = file_name(input);
    let mut stem = graph_stem(&name).unwrap_or(&name);
    if let Some(s) = stem.strip_suffix(".lowered") {
        stem = s
            .strip_suffix(target)
            .and_then(|s| s.strip_suffix('.'))
            .filter(|s| !s.is_empty())
            .unwrap_or(s);
    }
    let stem = if stem.is_empty() { "graph" } else { stem };
    out_dir.join(format!("{stem}.{target}.lowered.json"))
}

/// A new empty file in `path`'s directory, made exclusively under a random hidden name,
/// with the mode a plain write gets (0o666 less the umask), that becomes `path` when
/// persisted and is removed when dropped. `what` names the output in the error.
fn temp_beside(path: &Path, what: &str) -> Result<(PathBuf, NamedTempFile)> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut b = tempfile::Builder::new();
    b.prefix(".arfuse-").suffix(".tmp");
    #[cfg(unix)]
    b.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    let temp = b.tempfile_in(dir).map_err(|e| {
        let (p, d) = (path.display(), dir.display());
        anyhow::anyhow!("{what} {p}: no file can be made in {d}: {e}")
    })?;
    Ok((path.to_path_buf(), temp))
}

/// Decides and checks every pair's outputs before anything is lowered (per job, per
/// target): `--out`, else the default under `out_dir` (made when missing). Refused: an
/// output that is a file the run reads (a graph, a target file), `--dot` at a default
/// output, two pairs with one output, a directory no file can be made in.
pub(crate) fn destinations(
    jobs: &[Job],
    requested: &[(&str, PathBuf)],
    out_dir: &Path,
) -> Result<Vec<Vec<Writer>>> {
    check_requested(requested)?;
    let given = |flag: &str| requested.iter().find(|(f, _)| *f == flag).map(|(_, p)| p);
    let (out, dot) = (given("--out"), given("--dot"));
    let what = out.map_or("the default output", |_| "--out");
    let specs = jobs.iter().flat_map(|j| &j.targets);
    let targets: Vec<&Path> = specs.filter(|t| is_target_file(t)).map(Path::new).collect();
    if out.is_none() && jobs.iter().any(|j| !j.targets.is_empty()) {
        fs_err::create_dir_all(out_dir)?;
    }
    let mut made: Vec<(PathBuf, String)> = Vec::new();
    let mut all = Vec::new();
    for job in jobs {
        let mut writers = Vec::new();
        for spec in &job.targets {
            let pair = format!("{} on {spec}", job.input.display());
            let default = || default_out(out_dir, &job.input, &target_name(spec));
            let path = out.cloned().unwrap_or_else(default);
            let shown = path.display();
            if jobs.iter().any(|j| same(&j.input, &path)) {
                bail!("{what} {shown} is an input graph (for {pair}); refusing to overwrite it");
            }
            if targets.iter().any(|t| same(t, &path)) {
                bail!("{what} {shown} is a target file (for {pair}); refusing to overwrite it");
            }
            if dot.is_some_and(|d| same(d, &path)) {
                bail!("--dot {shown} is where the lowered graph goes; give --dot another file");
            }
            if !made.is_empty() && !requested.is_empty() {
                let (flags, list) = (flags_take(requested), job.targets.join(", "));
                let (input, n) = (job.input.display(), job.targets.len());
                bail!(
                    "{flags} one target; {input} is lowered for the {n} targets its options \
                     file lists ({list}): pick one with --target"
                );
            }
            if let Some((_, other)) = made.iter().find(|(p, _)| same(p, &path)) {
                bail!("{other} and {pair} would both be written to {shown}; lower them one at a time with --out FILE");
            }
            let mut files = vec![temp_beside(&path, what)?];
            files.extend(dot.map(|d| temp_beside(d, "--dot")).transpose()?);
            writers.push(Writer(files));
            made.push((path, pair));
        }
        all.push(writers);
    }
    Ok(all)
}

/// The outputs of one pair (the lowered graph, then its DOT), each with its temporary
/// file, written together once the pair lowered.
pub(crate) struct Writer(Vec<(PathBuf, NamedTempFile)>);

impl Writer {
    /// Writes the lowered graph (and its DOT) into the temporary files and renames them
    /// into place, returning the paths written; an error says which were.
    pub fn write(self, graph_json: &str, dot: impl FnOnce() -> String) -> Result<Vec<PathBuf>> {
        let dot = (self.0.len() > 1).then(dot).unwrap_or_default();
        for ((path, temp), text) in self.0.iter().zip([graph_json, &dot]) {
            if let Err(e) = temp.as_file().write_all(text.as_bytes()) {
                bail!("writing {}: {e} (nothing written)", path.display());
            }
        }
        let mut done: Vec<PathBuf> = Vec::new();
        for (path, temp) in self.0 {
            if let Err(e) = temp.persist(&path) {
                let (path, e) = (path.display(), e.error);
                bail!("writing {path}: {e} (written before it: {done:?})");
            }
            done.push(path);
        }
        Ok(done)
    }
}
