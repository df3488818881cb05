//! Unit tests of the steps `lower` is made of.

use crate::inputs::{graph_files, read_graph};
use crate::outputs::default_out;
use crate::targets::{assumed_world_size_note, preset_for, target_from_graph};
use arfuse::Target;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

/// A directory's graph-named entries are all listed, so one that is no regular file
/// fails as a pair instead of being skipped unsaid.
#[test]
fn a_directory_lists_every_graph_named_entry() {
    let dir = std::env::temp_dir().join(format!("arfuse-graphs-in-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("sub.json")).unwrap();
    for f in [
        "good.json",
        "b.json.gz",
        "c.pt2",
        "good.options.json",
        "notes.md",
    ] {
        std::fs::write(dir.join(f), b"{}").unwrap();
    }
    std::os::unix::fs::symlink(dir.join("missing"), dir.join("broken.json")).unwrap();
    let names: Vec<String> = graph_files(&dir)
        .unwrap()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        ["b.json.gz", "broken.json", "c.pt2", "good.json", "sub.json"]
    );
    let none = arfuse::advanced::import::ImportOptions::default();
    let err = format!(
        "{:#}",
        read_graph(&dir.join("sub.json"), &none).unwrap_err()
    );
    assert!(
        err.contains("sub.json") && err.contains("Is a directory"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn default_out_names_do_not_stack() {
    let out = |input: &str, t: &str| default_out(Path::new("/r"), Path::new(input), t);
    let expect = |name: &str| PathBuf::from("/r").join(name);
    assert_eq!(
        out("m/x.json", "h200-sxm-x8"),
        expect("x.h200-sxm-x8.lowered.json")
    );
    assert_eq!(out("m/x.pt2", "b200-x8"), expect("x.b200-x8.lowered.json"));
    assert_eq!(
        out("m/x.json.gz", "b200-x8"),
        expect("x.b200-x8.lowered.json")
    );
    // An already lowered graph: `.lowered` and the same target's name come off.
    assert_eq!(
        out("/tmp/x.lowered.json", "h200-sxm-x8"),
        expect("x.h200-sxm-x8.lowered.json")
    );
    assert_eq!(
        out("target/arfuse/x.h200-sxm-x8.lowered.json", "h200-sxm-x8"),
        expect("x.h200-sxm-x8.lowered.json")
    );
    // Lowered for another target: that target's name stays, `.lowered` does not.
    assert_eq!(
        out("x.h200-sxm-x8.lowered.json", "h100-sxm-x8"),
        expect("x.h200-sxm-x8.h100-sxm-x8.lowered.json")
    );
    // Only a whole `.<target>` component comes off; nothing leaves an empty stem.
    assert_eq!(
        out("xh200-sxm-x8.lowered.json", "h200-sxm-x8"),
        expect("xh200-sxm-x8.h200-sxm-x8.lowered.json")
    );
    assert_eq!(
        out("h200-sxm-x8.lowered.json", "h200-sxm-x8"),
        expect("h200-sxm-x8.h200-sxm-x8.lowered.json")
    );
    assert_eq!(
        out(".lowered.json", "b200-x8"),
        expect("graph.b200-x8.lowered.json")
    );
}

#[test]
fn a_graph_without_tp_is_refused_and_a_recorded_tp_picks_its_preset() {
    let none = arfuse::advanced::import::ImportOptions::default();
    let exported = root().join("ir-fixtures/exported/qwen3_30b_a3b_L2_tp4.exported_program.json");
    let why = target_from_graph(&read_graph(&exported, &none).unwrap()).unwrap_err();
    assert!(
        why.starts_with("the graph records no tensor-parallel size"),
        "{why}"
    );
    // A corpus graph records tp = 4: the H200 SXM preset with 4 ranks, said so.
    let corpus = read_graph(&root().join("ir-fixtures/models/gemma3_1b_tp4.json"), &none).unwrap();
    let (t, note) = target_from_graph(&corpus).unwrap();
    assert_eq!(t, "h200-sxm-x4");
    let note = note.unwrap();
    assert!(
        note.starts_with("recorded tp = 4: planned for h200-sxm-x4 (H200 SXM x4, "),
        "{note}"
    );
    assert!(
        note.contains("h100-sxm-x4, b200-x4, b300-x4, rtx-pro-6000-x4"),
        "{note}"
    );
    // A recorded size no preset has: said without naming a flag nobody passed.
    let mut odd = corpus.clone();
    odd.set_metadata(Some(serde_json::json!({"tp": 3})));
    let why = target_from_graph(&odd).unwrap_err();
    assert!(
        why.starts_with("the graph records tp = 3: no preset has world_size 3"),
        "{why}"
    );
    assert!(!why.contains("--world-size"), "{why}");
}

#[test]
fn world_size_names_the_preset_it_picks() {
    let (t, note) = preset_for(2, "--world-size 2").unwrap();
    assert_eq!(t, "h200-sxm-x2");
    assert_eq!(
        note,
        "--world-size 2: planned for h200-sxm-x2 (H200 SXM x2, HGX node, NVSwitch, \
         multicast (NVLS) on every GPU); other presets with world_size 2: h100-sxm-x2, \
         b200-x2 (pass --target NAME)"
    );
    let e = format!("{:#}", preset_for(6, "--world-size 6").unwrap_err());
    assert_eq!(
        e,
        "--world-size 6: no preset has world_size 6 (the presets have 2, 4, 8, 16); pass \
         --target with a TOML file for this machine"
    );
}

#[test]
fn assumed_world_size_note_only_without_recorded_tp() {
    let target = Target::preset("b300-x4").unwrap();
    let none = arfuse::advanced::import::ImportOptions::default();
    let exported = root().join("ir-fixtures/exported/gemma3_1b_L2_tp2.exported_program.json");
    let exported = read_graph(&exported, &none).unwrap();
    let note = assumed_world_size_note(&exported, &target, "b300-x4").unwrap();
    assert!(note.contains("b300-x4's world_size 4"), "{note}");
    let corpus = read_graph(&root().join("ir-fixtures/models/gemma3_1b_tp4.json"), &none).unwrap();
    assert_eq!(corpus.recorded_world_size(), Some(4));
    assert_eq!(assumed_world_size_note(&corpus, &target, "b300-x4"), None);
}
