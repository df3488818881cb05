//! The committed corpus under `ir-fixtures/models/` is exactly what the builder makes
//! from the options in `arfuse_models::corpus()`. `ARFUSE_REGENERATE=1` rewrites it.

mod common;

use arfuse_models::corpus;
use common::{config, fixtures_dir, observe};

#[test]
fn committed_fixtures_match_the_builder() {
    let regenerate = std::env::var_os("ARFUSE_REGENERATE").is_some_and(|v| v == "1");
    let dir = fixtures_dir().join("models");
    if regenerate {
        std::fs::create_dir_all(&dir).unwrap();
    }
    let mut expected_files = std::collections::BTreeSet::new();
    let mut stale = Vec::new();
    for f in corpus() {
        let cfg = config(f.config_file);
        let (g, options) = f.build(&cfg).unwrap_or_else(|e| panic!("{}: {e}", f.name));
        g.validate().unwrap_or_else(|e| panic!("{}: {e}", f.name));
        let files = [
            (format!("{}.json", f.name), g.to_json_string()),
            (format!("{}.options.json", f.name), options.to_json_string()),
        ];
        for (file, text) in files {
            let path = dir.join(&file);
            expected_files.insert(file.clone());
            if regenerate {
                std::fs::write(&path, &text).unwrap();
            } else if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                stale.push(file);
            }
        }
    }
    assert!(
        stale.is_empty(),
        "fixtures differ from the builder: {stale:?}; rerun with ARFUSE_REGENERATE=1 and review the diff"
    );
    let present: std::collections::BTreeSet<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let extra: Vec<_> = present.difference(&expected_files).collect();
    assert!(
        extra.is_empty(),
        "files in ir-fixtures/models not made by the corpus: {extra:?}"
    );
}

#[test]
fn committed_fixtures_load_validate_and_have_their_sites() {
    let dir = fixtures_dir().join("models");
    for f in corpus() {
        let text = std::fs::read_to_string(dir.join(format!("{}.json", f.name))).unwrap();
        let g =
            arfuse_ir::Graph::from_json_str(&text).unwrap_or_else(|e| panic!("{}: {e}", f.name));
        g.validate().unwrap();
        let opts_text =
            std::fs::read_to_string(dir.join(format!("{}.options.json", f.name))).unwrap();
        let opts: arfuse_models::FixtureOptions = serde_json::from_str(&opts_text).unwrap();
        assert!(
            fixtures_dir().join(&opts.config).is_file(),
            "{}",
            opts.config
        );
        let seen = observe(&g);
        assert_eq!(seen.sites, opts.expected_sites, "{}: sites", f.name);
        assert_eq!(
            seen.all_reduces, opts.all_reduces,
            "{}: all-reduces",
            f.name
        );
        assert_eq!(
            seen.with_quant, opts.sites_with_quant,
            "{}: sites with quant",
            f.name
        );
        assert!(!opts.targets.is_empty(), "{}", f.name);
        for s in &opts.shares_workspace_with {
            assert!(dir.join(format!("{s}.json")).is_file(), "{}: {s}", f.name);
        }
    }
}
