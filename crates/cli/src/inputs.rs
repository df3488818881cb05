//! The inputs of a run: graph files, their options files, and the (graph, target) pairs
//! they make.

use crate::targets::{self, target_from_graph};
use anyhow::{bail, Context, Result};
use arfuse::advanced::import::ImportOptions;
use arfuse::Graph;
use std::path::{Path, PathBuf};

/// The endings of a graph file's name, longest first (`.json.gz` is not read as `.gz`).
const GRAPH_EXTENSIONS: [&str; 3] = [".json.gz", ".json", ".pt2"];

/// A graph file's name without its ending; `None` without one of [`GRAPH_EXTENSIONS`].
pub(crate) fn graph_stem(name: &str) -> Option<&str> {
    GRAPH_EXTENSIONS
        .iter()
        .find_map(|ext| name.strip_suffix(ext))
}

/// The file name of `p` as text (a name that is not UTF-8 is read lossily).
pub(crate) fn file_name(p: &Path) -> String {
    p.file_name()
        .map_or(String::new(), |n| n.to_string_lossy().into_owned())
}

/// The part of an options file the command reads; the corpus's files hold more (how
/// the graph was built, its expected sites), which is left alone.
#[derive(serde::Deserialize)]
struct OptionsFile {
    /// The presets or target files to lower the graph for.
    targets: Option<Vec<String>>,
}

/// The graph files `path` names: itself, or the graph-named entries of a directory
/// (`*.json`, `*.json.gz`, `*.pt2`, not `*.options.json`), sorted. An entry so named that
/// is no file (a directory) is listed: it fails as a pair rather than being skipped.
pub(crate) fn graph_files(path: &Path) -> Result<Vec<PathBuf>> {
    let shown = path.display();
    if !path.exists() {
        bail!("{shown} does not exist");
    }
    if !path.is_dir() {
        if let Some(stem) = file_name(path).strip_suffix(".options.json") {
            bail!("{shown} is an options file (the targets of `{stem}.json`), not a graph");
        }
        return Ok(vec![path.to_path_buf()]);
    }
    let mut inputs = Vec::new();
    for entry in fs_err::read_dir(path)? {
        let (p, name) = entry.map(|e| (e.path(), e.file_name().to_string_lossy().into_owned()))?;
        if graph_stem(&name).is_some() && !name.ends_with(".options.json") {
            inputs.push(p);
        }
    }
    inputs.sort();
    if inputs.is_empty() {
        bail!("no graph files (*.json, *.json.gz, *.pt2) in {shown}");
    }
    Ok(inputs)
}

/// The targets its options file lists for `input` (each once, in order), each loaded and
/// checked; `None` when there is no options file or it lists none. Errors name the file.
fn listed_targets(input: &Path) -> Result<Option<Vec<String>>> {
    let name = file_name(input);
    let stem = graph_stem(&name).unwrap_or(&name);
    let path = input.with_file_name(format!("{stem}.options.json"));
    let shown = path.display();
    if !path.exists() {
        return Ok(None);
    }
    let text = read_small_text(&path)?;
    let parsed: OptionsFile = serde_json::from_str(&text).with_context(|| {
        format!("{shown}: an options file is a JSON object with a \"targets\" list")
    })?;
    let Some(mut list) = parsed.targets else {
        return Ok(None);
    };
    if list.is_empty() {
        bail!("{shown}: \"targets\" is an empty list; name a preset or leave the key out");
    }
    let mut seen = std::collections::BTreeSet::new();
    list.retain(|t| seen.insert(t.clone()));
    for t in &list {
        targets::check_target(t).with_context(|| format!("{shown}: target {t:?}"))?;
    }
    Ok(Some(list))
}

/// The bytes of `path`, at most `limit` of them: a larger file is an error naming it.
fn read_limited(path: &Path, limit: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    fs_err::File::open(path)?
        .take(limit + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        bail!("{} is over {limit} bytes, too large", path.display());
    }
    Ok(bytes)
}

/// The text of a small file the user gives besides graphs (an options file, a target
/// file): at most 1 MiB of UTF-8, a byte order mark read past. Errors name the file.
pub(crate) fn read_small_text(path: &Path) -> Result<String> {
    let text = String::from_utf8(read_limited(path, 1 << 20)?)
        .with_context(|| format!("{} is not UTF-8 text", path.display()))?;
    Ok(text.strip_prefix('\u{feff}').unwrap_or(&text).to_string())
}

/// Reads and imports one graph file (at most the importer's byte limit), printing the
/// importer's notes and warnings. Errors name the file.
pub(crate) fn read_graph(path: &Path, import: &ImportOptions) -> Result<Graph> {
    let bytes = read_limited(path, arfuse::advanced::import::MAX_FILE_BYTES as u64)?;
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

/// One input graph and the targets it is lowered for.
pub(crate) struct Job {
    pub input: PathBuf,
    /// Target specs (presets or files); empty when the graph was read to choose its
    /// target and could not be (`graph` holds why).
    pub targets: Vec<String>,
    /// The graph, when it was read to choose its target.
    pub graph: Option<Result<Graph>>,
}

/// The jobs of the run: each input with the given target, else the targets its options
/// file lists, else the preset of the tensor-parallel size it records (the graph is read
/// for it, and kept). Refused before any graph is lowered: `--out`/`--dot` (`outputs`)
/// with several graphs, a bad options file or listed target, and graphs that record no
/// size (all named in one error).
pub(crate) fn plan_jobs(
    inputs: &[PathBuf],
    given: Option<&str>,
    outputs: &[(&str, PathBuf)],
    import: &ImportOptions,
) -> Result<Vec<Job>> {
    if inputs.len() > 1 && !outputs.is_empty() {
        let (flags, n) = (crate::outputs::flags_take(outputs), inputs.len());
        bail!("{flags} one input graph; the directory has {n} graphs: lower one of them");
    }
    let mut jobs = Vec::new();
    let mut unplannable = Vec::new();
    for input in inputs {
        let job = |targets, graph| Job {
            input: input.clone(),
            targets,
            graph,
        };
        let listed = match given {
            Some(t) => Some(vec![t.to_string()]),
            None => listed_targets(input)?,
        };
        if let Some(list) = listed {
            jobs.push(job(list, None));
            continue;
        }
        let graph = read_graph(input, import);
        match graph.as_ref().map(target_from_graph) {
            Err(_) => jobs.push(job(Vec::new(), Some(graph))),
            Ok(Ok((t, note))) => {
                if let Some(note) = note {
                    eprintln!("note: {}: {note}", input.display());
                }
                jobs.push(job(vec![t], Some(graph)));
            }
            Ok(Err(why)) => unplannable.push(format!("{}: {why}", input.display())),
        }
    }
    if !unplannable.is_empty() {
        bail!(
            "{}\npass --target PRESET|FILE.toml, or --world-size N for the tensor-parallel \
             size the model was exported for (N picks {}-xN; --list-targets lists every \
             preset with its W)",
            unplannable.join("\n"),
            arfuse::advanced::policy::DEFAULT_PRESET_FAMILY,
        );
    }
    Ok(jobs)
}
