//! The model corpus under `ir-fixtures/models/`, shared by the integration tests: each
//! `<name>.json` graph with its `<name>.options.json` (target presets, expected sites).

use arfuse::Graph;
use std::path::{Path, PathBuf};

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One model fixture.
pub struct Fixture {
    /// File stem, e.g. `llama31_8b_tp8`.
    pub name: String,
    /// The graph.
    pub graph: Graph,
    /// Its options file.
    pub options: serde_json::Value,
}

impl Fixture {
    /// The target presets its options file names.
    #[allow(dead_code)] // not every test crate that includes this module uses it
    pub fn targets(&self) -> Vec<String> {
        self.options["targets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect()
    }
}

/// Loads the fixture of an options file.
pub fn load(options_path: &Path) -> Fixture {
    let name = options_path
        .file_name()
        .unwrap()
        .to_string_lossy()
        .trim_end_matches(".options.json")
        .to_string();
    let options: serde_json::Value =
        serde_json::from_slice(&std::fs::read(options_path).unwrap()).unwrap();
    let graph_path = options_path.with_file_name(format!("{name}.json"));
    let graph = Graph::from_json_slice(&std::fs::read(&graph_path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", graph_path.display()));
    Fixture {
        name,
        graph,
        options,
    }
}

/// Every fixture, sorted by name.
pub fn fixtures() -> Vec<Fixture> {
    let dir = root().join("ir-fixtures/models");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".options.json"))
        .collect();
    paths.sort();
    paths.iter().map(|p| load(p)).collect()
}
