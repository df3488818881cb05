//! `arfuse lower` end to end: the binary run on the bundled graphs and targets.
//!
//! Runs start in the checkout's root (so that the fixtures' relative paths hold) and
//! write to a temporary directory (`--out`), except where the default output is what is
//! tested: those run in a temporary directory ([`lower_in`]), where default outputs go.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use arfuse::Target;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

const EXAMPLE_TARGET: &str = "ir-fixtures/targets/example-h100-x8.toml";
const LLAMA: &str = "ir-fixtures/models/llama31_8b_tp8.json";
const EXPORTED: &str = "ir-fixtures/exported/llama31_8b_L2_tp8.exported_program.json";

/// Runs `arfuse lower ARGS` in the checkout's root.
fn lower(args: &[&str]) -> Output {
    lower_in(&root(), args)
}

/// Runs `arfuse lower ARGS` in `dir`, where default outputs are written.
fn lower_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_arfuse"))
        .current_dir(dir)
        .arg("lower")
        .args(args)
        .output()
        .expect("running arfuse")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts that the run's stderr contains `text`, showing it when not.
fn assert_says(o: &Output, text: impl AsRef<str>) {
    let e = stderr(o);
    assert!(e.contains(text.as_ref()), "{e}");
}

/// A fresh empty directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("arfuse-cli-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).to_string_lossy().into_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Every field of `Target`, by its TOML name.
fn target_fields() -> Vec<String> {
    let mut t = Target::preset("h100-sxm-x8").unwrap();
    t.max_bytes_override = Some(1); // serialised only when set
    let v = serde_json::to_value(&t).unwrap();
    v.as_object().unwrap().keys().cloned().collect()
}

#[test]
fn every_target_file_parses_and_the_example_shows_every_field() {
    let dir = root().join("ir-fixtures/targets");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            let text = std::fs::read_to_string(&p).unwrap();
            Target::from_toml_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            n += 1;
        }
    }
    assert!(n >= 1, "no target files in {}", dir.display());

    let text = std::fs::read_to_string(root().join(EXAMPLE_TARGET)).unwrap();
    let t = Target::from_toml_str(&text).unwrap();
    assert_eq!(t.world_size, 8);
    // Each field is set or shown commented out, at the start of a line.
    for field in target_fields() {
        let shown = text.lines().any(|l| {
            let l = l.trim_start_matches("# ");
            l.starts_with(&format!("{field} ="))
        });
        assert!(shown, "{EXAMPLE_TARGET} does not show the field `{field}`");
    }
    // And with the commented-out field uncommented it still parses.
    let all = text.replace("\n# max_bytes_override =", "\nmax_bytes_override =");
    assert!(Target::from_toml_str(&all)
        .unwrap()
        .max_bytes_override
        .is_some());
}

#[test]
fn the_cli_docs_name_every_target_field() {
    let docs = std::fs::read_to_string(root().join("docs/cli.md")).unwrap();
    for field in target_fields() {
        assert!(
            docs.contains(&format!("`{field}`")),
            "docs/cli.md does not name the target field `{field}`"
        );
    }
    assert!(
        docs.contains(EXAMPLE_TARGET),
        "docs/cli.md does not point at the example"
    );
}

#[test]
fn example_target_lowers_the_bundled_graph() {
    let tmp = TempDir::new("example");
    let out = tmp.path("llama.json");
    let o = lower(&[
        LLAMA,
        "--target",
        EXAMPLE_TARGET,
        "--out",
        &out,
        "--report",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let reports: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let r = &reports[0];
    assert_eq!(r["target"], "example-h100-x8");
    assert_eq!(r["report"]["target"]["world_size"], 8);
    assert_eq!(r["report"]["all_reduces_seen"], 65);
    assert_eq!(r["report"]["all_reduces_fused"], 65);
    assert!(Path::new(&out).is_file());
}

#[test]
fn relowering_a_lowered_graph_does_not_stack_names_or_overwrite_it() {
    let tmp = TempDir::new("relower");
    let out_dir = TempDir::new("relower-out");
    // A lowered graph: its default output drops `.lowered`.
    let first = tmp.path("x.lowered.json");
    let o = lower(&[LLAMA, "--target", "h200-sxm-x8", "--out", &first]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = lower_in(&out_dir.0, &[&first, "--target", "h200-sxm-x8"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let expected = out_dir.0.join("x.h200-sxm-x8.lowered.json");
    assert_says(&o, "wrote x.h200-sxm-x8.lowered.json");
    // Idempotent: the same graph again.
    assert_eq!(
        std::fs::read(&expected).unwrap(),
        std::fs::read(&first).unwrap()
    );

    // Lowered again where it lies, its default output is the graph itself: refused,
    // asking for --out, and the input untouched.
    let before = std::fs::metadata(&expected).unwrap().modified().unwrap();
    let o = lower_in(
        &out_dir.0,
        &["x.h200-sxm-x8.lowered.json", "-t", "h200-sxm-x8"],
    );
    assert_eq!(o.status.code(), Some(1));
    assert_says(
        &o,
        "error: the default output x.h200-sxm-x8.lowered.json is an input graph (for \
         x.h200-sxm-x8.lowered.json on h200-sxm-x8); refusing to overwrite it",
    );
    assert_eq!(
        before,
        std::fs::metadata(&expected).unwrap().modified().unwrap()
    );
    // Nothing but the graph is left in the directory (no temporary file).
    assert_eq!(std::fs::read_dir(&out_dir.0).unwrap().count(), 1);
}

#[test]
fn shared_hidden_zero_is_a_usage_error_reported_once_for_a_directory() {
    // As `--world-size 0`: refused while the arguments are read (exit 2), before any
    // graph.
    let o = lower(&["ir-fixtures/models", "--shared-hidden", "0"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert_eq!(
        e.matches("invalid value '0' for '--shared-hidden <H>': 0 is not in 1..")
            .count(),
        1,
        "{e}"
    );
    assert!(!e.contains("pair(s) failed"), "{e}");
}

#[test]
fn a_shared_hidden_size_the_policy_refuses_is_reported_once_for_a_directory() {
    let o = lower(&["ir-fixtures/models", "--shared-hidden", "1099511627776"]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert_eq!(
        e.matches("--shared-hidden 1099511627776: ").count(),
        1,
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(!e.contains("pair(s) failed"), "{e}");
}

#[test]
fn a_graph_without_a_tp_size_gets_one_note_naming_the_assumed_world_size() {
    let tmp = TempDir::new("note");
    let o = lower(&[
        EXPORTED,
        "--target",
        "h100-sxm-x8",
        "--out",
        &tmp.path("e.json"),
        "--report",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    let notes: Vec<&str> = e
        .lines()
        .filter(|l| l.contains("records no tensor-parallel size"))
        .collect();
    assert_eq!(notes.len(), 1, "{e}");
    assert!(notes[0].contains("h100-sxm-x8's world_size 8"), "{e}");
    // Not part of the report.
    assert!(!String::from_utf8_lossy(&o.stdout).contains("records no tensor-parallel size"));

    // A graph recording its tp (the corpus) gets no such note.
    let o = lower(&[
        LLAMA,
        "--target",
        "h100-sxm-x8",
        "--out",
        &tmp.path("l.json"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("records no tensor-parallel size"));
}

#[test]
fn two_inputs_with_one_default_output_are_refused_before_lowering() {
    let tmp = TempDir::new("collide");
    std::fs::copy(root().join(LLAMA), tmp.0.join("x.json")).unwrap();
    let o = lower(&[
        LLAMA,
        "--target",
        "h200-sxm-x8",
        "--out",
        &tmp.path("x.lowered.json"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = lower_in(&tmp.0, &[".", "--target", "h200-sxm-x8"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains(
            "./x.json on h200-sxm-x8 and ./x.lowered.json on h200-sxm-x8 would both be \
             written to x.h200-sxm-x8.lowered.json"
        ),
        "{e}"
    );
    assert!(!e.contains("wrote "), "{e}");
    assert_eq!(std::fs::read_dir(&tmp.0).unwrap().count(), 2);
}

#[test]
fn out_never_overwrites_a_file_the_run_reads_and_a_missing_directory_fails_first() {
    let tmp = TempDir::new("out-guard");
    let target = tmp.path("t.toml");
    std::fs::copy(root().join(EXAMPLE_TARGET), &target).unwrap();
    let before = std::fs::read(&target).unwrap();
    let o = lower(&[LLAMA, "--target", &target, "--out", &target]);
    assert!(!o.status.success());
    assert_says(
        &o,
        format!(
            "--out {target} is a target file (for {LLAMA} on {target}); refusing to overwrite it"
        ),
    );
    assert_eq!(
        std::fs::read(&target).unwrap(),
        before,
        "the target file was changed"
    );
    let options = "ir-fixtures/models/llama31_8b_tp8.options.json";
    let before = std::fs::read(root().join(options)).unwrap();
    // The options file is data even when --target means it is not read.
    let o = lower(&[LLAMA, "--target", "h200-sxm-x8", "--out", options]);
    assert!(!o.status.success());
    assert_says(&o, "is an options file (the targets of a graph)");
    assert_eq!(std::fs::read(root().join(options)).unwrap(), before);
    // A missing output directory: refused before lowering, so no report on stdout.
    let missing = tmp.path("nodir/x.json");
    let o = lower(&[LLAMA, "--target", "h200-sxm-x8", "--out", &missing]);
    assert!(!o.status.success());
    assert_says(&o, format!("--out {missing}: no file can be made in "));
    assert_says(&o, "No such file or directory");
    assert!(
        o.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

#[test]
fn out_with_several_graphs_or_targets_names_which_and_an_input_as_out_comes_first() {
    let tmp = TempDir::new("out-one");
    let out = tmp.path("x.lowered.json");
    // The bundled graph's options file lists several targets.
    let o = lower(&[LLAMA, "--out", &out]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("--out takes one target")
            && e.contains("targets its options file lists (h200-sxm-x8, ")
            && e.contains("pick one with --target"),
        "{e}"
    );
    // A directory of two graphs: refused before either is read.
    std::fs::copy(root().join(LLAMA), tmp.0.join("a.json")).unwrap();
    std::fs::copy(root().join(LLAMA), tmp.0.join("b.json")).unwrap();
    let o = lower(&[tmp.0.to_str().unwrap(), "--dot", &out]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("--dot takes one input graph; the directory has 2 graphs"),
        "{e}"
    );
    assert!(!e.contains("note:"), "{e}");
    // --out naming the input, with several targets: the overwrite is what is said.
    let input = tmp.path("a.json");
    std::fs::copy(
        root().join("ir-fixtures/models/llama31_8b_tp8.options.json"),
        tmp.0.join("a.options.json"),
    )
    .unwrap();
    let before = std::fs::read(&input).unwrap();
    let o = lower(&[&input, "--out", &input]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains(&format!(
            "--out {input} is an input graph (for {input} on h200-sxm-x8); refusing to overwrite it"
        )),
        "{e}"
    );
    assert_eq!(std::fs::read(&input).unwrap(), before);
    // So is its options file, before the targets it lists are counted. With a directory
    // of several graphs, --out is refused before any is read.
    let options = tmp.path("a.options.json");
    let o = lower(&[&input, "--dot", &options]);
    let e = stderr(&o);
    assert!(
        e.contains(&format!(
            "--dot {options} is an options file (the targets of a graph); refusing to overwrite it"
        )),
        "{e}"
    );
    let o = lower(&[tmp.0.to_str().unwrap(), "--out", &input]);
    assert_says(
        &o,
        "--out takes one input graph; the directory has 2 graphs",
    );
    // A directory of one graph with several targets: the graph is named.
    std::fs::remove_file(tmp.0.join("b.json")).unwrap();
    let o = lower(&[tmp.0.to_str().unwrap(), "--out", &out]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains(&format!(
            "--out takes one target; {input} is lowered for the 5 targets"
        )),
        "{e}"
    );
    // A missing input is said first: before --out names it, before its options file's
    // targets are counted, before --out's missing directory.
    let missing = tmp.path("missing.json");
    std::fs::copy(
        root().join("ir-fixtures/models/llama31_8b_tp8.options.json"),
        tmp.0.join("missing.options.json"),
    )
    .unwrap();
    let nodir = tmp.path("nodir/x.json");
    for args in [
        vec![missing.as_str(), "-t", "h200-sxm-x8", "--out", &missing],
        vec![missing.as_str(), "--out", &out],
        vec![missing.as_str(), "--out", &nodir],
    ] {
        let o = lower(&args);
        assert_eq!(o.status.code(), Some(1));
        let e = stderr(&o);
        assert_eq!(e, format!("error: {missing} does not exist\n"), "{args:?}");
    }
    assert!(!Path::new(&missing).exists() && !Path::new(&out).exists());
    // What the rename would replace or cannot write, refused before lowering: a
    // device, a name ending in `/` or `/.`, a file as its directory.
    for (bad, why) in [
        (
            "/dev/null".to_string(),
            " is not a regular file (a device, FIFO or socket)",
        ),
        (
            tmp.path("nofile/"),
            " names a directory; it takes a file name",
        ),
        (
            tmp.path("nofile/."),
            " names a directory; it takes a file name",
        ),
        (format!("{input}/x.json"), ": no file can be made in "),
    ] {
        let o = lower(&[LLAMA, "-t", "h200-sxm-x8", "--dot", &bad]);
        assert_eq!(o.status.code(), Some(1));
        let e = stderr(&o);
        assert!(e.starts_with(&format!("error: --dot {bad}{why}")), "{e}");
        assert!(o.stdout.is_empty());
    }
    assert!(!tmp.0.join("nofile").exists());
    // `--dot` at the default output and an options file that does not exist yet:
    // refused before lowering too.
    let fresh = tmp.path("fresh.json");
    std::fs::copy(root().join(LLAMA), &fresh).unwrap();
    let its_options = tmp.path("fresh.options.json");
    for (args, why) in [
        (
            vec![
                fresh.as_str(),
                "-t",
                "h200-sxm-x8",
                "--dot",
                "fresh.h200-sxm-x8.lowered.json",
            ],
            "is where the lowered graph goes; give --dot another file",
        ),
        (
            vec![fresh.as_str(), "-t", "h200-sxm-x8", "--out", &its_options],
            "is an options file (the targets of a graph)",
        ),
    ] {
        let o = lower_in(&tmp.0, &args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        assert_says(&o, why);
        assert!(o.stdout.is_empty());
    }
    assert!(!Path::new(&its_options).exists());
    // An options file whose targets are not a list of strings is an error naming it.
    std::fs::write(&its_options, r#"{"targets": "h200-sxm-x8"}"#).unwrap();
    let o = lower(&[&fresh, "--out", &out]);
    assert_says(
        &o,
        format!("{its_options}: an options file is a JSON object with a \"targets\" list"),
    );
    assert_says(
        &o,
        "invalid type: string \"h200-sxm-x8\", expected a sequence",
    );
}

/// An options file is checked before any graph is lowered: its form, and every target
/// it lists, loaded as `--target` is; an error names the file. No output may be named
/// like an options file, and an output under a broken symlink is refused first too.
#[test]
fn options_files_and_their_targets_are_checked_before_lowering() {
    let tmp = TempDir::new("options");
    let graph = tmp.path("g.json");
    std::fs::copy(root().join(LLAMA), &graph).unwrap();
    let options = tmp.path("g.options.json");
    let out = tmp.path("o.json");
    for (text, want) in [
        (
            r#"{"targets": ["h200-sxm-x8", "bogus-x9"]}"#,
            format!("error: {options}: target \"bogus-x9\": unknown preset `bogus-x9`"),
        ),
        (
            r#"{"targets": ["h200-sxm-x8", 7]}"#,
            format!("error: {options}: an options file is a JSON object with a \"targets\" list"),
        ),
        (
            r#""h200-sxm-x8""#,
            format!("error: {options}: an options file is a JSON object with a \"targets\" list"),
        ),
        (
            r#"{"targets": [], "notes": "x"}"#,
            format!("error: {options}: \"targets\" is an empty list"),
        ),
    ] {
        std::fs::write(&options, text).unwrap();
        let o = lower(&[&graph]);
        assert_eq!(o.status.code(), Some(1), "{text}");
        let e = stderr(&o);
        assert!(e.starts_with(&want), "{e}");
        assert!(!e.contains("wrote "), "{e}");
    }
    // Two targets of one name would share the default output: refused before either is
    // lowered. A target listed twice is lowered once.
    let (ta, tb) = (tmp.0.join("a"), tmp.0.join("b"));
    for d in [&ta, &tb] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::copy(root().join(EXAMPLE_TARGET), d.join("x.toml")).unwrap();
    }
    let (xa, xb) = (ta.join("x.toml"), tb.join("x.toml"));
    let (xa, xb) = (xa.to_string_lossy(), xb.to_string_lossy());
    std::fs::write(&options, format!(r#"{{"targets": ["{xa}", "{xb}"]}}"#)).unwrap();
    let o = lower_in(&tmp.0, &[&graph]);
    let e = stderr(&o);
    assert!(
        e.contains(&format!(
            "{graph} on {xa} and {graph} on {xb} would both be written to g.x.lowered.json"
        )),
        "{e}"
    );
    assert!(!e.contains("wrote "), "{e}");
    // Something other than a file, a file too large or not UTF-8: an error naming it,
    // never ignored.
    std::fs::remove_file(&options).unwrap();
    std::fs::create_dir(&options).unwrap();
    let o = lower(&[&graph]);
    assert_says(
        &o,
        format!("error: failed to read from file `{options}`: Is a directory"),
    );
    std::fs::remove_dir(&options).unwrap();
    for (bytes, want) in [
        (vec![b' '; (1 << 20) + 1], "is over 1048576 bytes"),
        (
            b"{\"targets\": [\"\xff\"]}".to_vec(),
            "is not UTF-8 text: invalid utf-8 sequence of 1 bytes from index 14",
        ),
    ] {
        std::fs::write(&options, bytes).unwrap();
        let o = lower(&[&graph]);
        assert!(
            stderr(&o).starts_with(&format!("error: {options} {want}")),
            "{}",
            stderr(&o)
        );
        assert!(o.stdout.is_empty());
    }
    // A UTF-8 byte order mark is read past.
    std::fs::write(&options, "\u{feff}{\"targets\": [\"b200-x8\"]}").unwrap();
    let o = lower(&[&graph, "--out", &out, "--report", "json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v[0]["target"], "b200-x8");
    std::fs::remove_file(&out).unwrap();
    // Without `targets`, the graph's recorded TP size decides (8: h200-sxm-x8).
    std::fs::write(&options, r#"{"notes": "no targets here"}"#).unwrap();
    let o = lower(&[&graph, "--out", &out, "--report", "json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v[0]["target"], "h200-sxm-x8");
    std::fs::remove_file(&out).unwrap();
    std::fs::write(&options, format!(r#"{{"targets": ["{xa}", "{xa}"]}}"#)).unwrap();
    let o = lower(&[&graph, "--out", &out]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o).matches("wrote ").count(), 1, "{}", stderr(&o));
    std::fs::remove_file(&out).unwrap();
    // Any name of an options file, a graph's or not, is no output.
    let other = tmp.path("other.options.json");
    let o = lower(&[&graph, "-t", "h200-sxm-x8", "--out", &other]);
    assert_says(&o, "is an options file (the targets of a graph)");
    assert!(!Path::new(&other).exists());
    // A directory behind a broken symlink.
    let link = tmp.0.join("gone");
    std::os::unix::fs::symlink(tmp.0.join("nowhere"), &link).unwrap();
    let under = tmp.path("gone/x.json");
    let o = lower(&[&graph, "-t", "h200-sxm-x8", "--out", &under]);
    assert_says(
        &o,
        format!("--out {under}: no file can be made in {}", link.display()),
    );
    assert!(o.stdout.is_empty() && !Path::new(&out).exists());
}

#[test]
fn a_graph_without_a_tp_size_needs_a_target_or_a_world_size() {
    let tmp = TempDir::new("no-tp");
    let out = tmp.path("e.json");
    // No --target: refused before anything is lowered, the presets listed by W.
    let o = lower(&[EXPORTED, "--out", &out]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains(
            "llama31_8b_L2_tp8.exported_program.json: the graph records no tensor-parallel size"
        ),
        "{e}"
    );
    assert!(
        e.contains("pass --target PRESET|FILE.toml, or --world-size N"),
        "{e}"
    );
    assert!(
        e.ends_with("(N picks h200-sxm-xN; --list-targets lists every preset with its W)\n"),
        "{e}"
    );
    assert!(
        o.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(!Path::new(&out).exists());

    // --world-size 8 picks h200-sxm-x8 and says so.
    let o = lower(&[EXPORTED, "--world-size", "8", "--out", &out]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("note: --world-size 8: planned for h200-sxm-x8 (H200 SXM x8, "),
        "{e}"
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains(" on h200-sxm-x8 "));
    assert!(Path::new(&out).exists());

    // --world-size and --target together are refused by the parser.
    let o = lower(&[EXPORTED, "--world-size", "8", "--target", "b200-x8"]);
    assert!(!o.status.success());
    assert_says(&o, "cannot be used with");

    // A misspelled preset: the error names the flag, then lists the presets.
    let o = lower(&[EXPORTED, "--target", "h100-sxm4", "--out", &out]);
    assert!(!o.status.success());
    assert_says(
        &o,
        "error: --target h100-sxm4: unknown preset `h100-sxm4`; known presets: ",
    );
}

#[test]
fn the_table_groups_layers_and_sites_lists_every_one() {
    let tmp = TempDir::new("sites");
    let out = tmp.path("l.json");
    let o = lower(&[LLAMA, "--target", "h200-sxm-x8", "--out", &out]);
    assert!(o.status.success(), "{}", stderr(&o));
    let t = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        t.contains("  T (tokens)       strategy  buffer use, bytes  why\n"),
        "{t}"
    );
    assert!(
        t.contains("65 sites in 4 lines, `*` a layer index (--sites: one line each):"),
        "{t}"
    );
    assert!(
        t.lines().any(|l| l
            .starts_with("  layers.*.self_attn.o_proj -> layers.*.post_attention_layernorm")
            && l.ends_with("fused   0-31 (32 sites)")),
        "{t}"
    );
    assert!(!t.contains("domain.md"), "{t}");
    let o = lower(&[LLAMA, "--target", "h200-sxm-x8", "--out", &out, "--sites"]);
    let t = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        t.contains("layers.31.self_attn.o_proj -> layers.31.post_attention_layernorm"),
        "{t}"
    );
    assert!(!t.contains("layers.*"), "{t}");
}

#[test]
fn a_failed_pair_is_in_the_json_report_with_its_error() {
    let tmp = TempDir::new("json-fail");
    // tp = 8 graph on a W = 4 target: refused.
    let o = lower(&[
        LLAMA,
        "--target",
        "h200-sxm-x4",
        "--out",
        &tmp.path("x.json"),
        "--report",
        "json",
    ]);
    assert!(!o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let entry = &v.as_array().unwrap()[0];
    assert_eq!(entry["target"], "h200-sxm-x4");
    assert!(entry["input"]
        .as_str()
        .unwrap()
        .ends_with("llama31_8b_tp8.json"));
    let err = entry["error"].as_str().unwrap();
    assert!(
        err.starts_with("lowering ") && err.contains("h200-sxm-x4"),
        "{err}"
    );
    assert!(entry.get("report").is_none());
    // A graph that cannot be read to choose its target fails with no target, next to
    // a graph its options file gives one.
    let dir = tmp.0.join("dir");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("broken.json"), "{not json").unwrap();
    std::fs::write(dir.join("listed.json"), "[]").unwrap();
    std::fs::write(
        dir.join("listed.options.json"),
        r#"{"targets": ["h100-sxm-x8"]}"#,
    )
    .unwrap();
    let o = lower(&[&dir.to_string_lossy(), "--report", "json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_says(&o, "2 of 2 (graph, target) pair(s) failed");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let by_input = |name: &str| {
        v.as_array()
            .unwrap()
            .iter()
            .find(|e| e["input"].as_str().unwrap().ends_with(name))
            .unwrap()
            .clone()
    };
    assert_eq!(by_input("broken.json")["target"], serde_json::Value::Null);
    assert_eq!(by_input("listed.json")["target"], "h100-sxm-x8");
    assert!(by_input("broken.json")["error"]
        .as_str()
        .unwrap()
        .contains("broken.json"));
    // An unreadable graph listed for two targets is read once and its error said once;
    // the second pair names its target.
    let twice = tmp.path("twice.json");
    std::fs::write(&twice, "garbage").unwrap();
    std::fs::write(
        tmp.path("twice.options.json"),
        r#"{"targets": ["h200-sxm-x8", "b200-x8"]}"#,
    )
    .unwrap();
    let o = lower(&[&twice]);
    let e = stderr(&o);
    assert_eq!(e.matches("unknown file format").count(), 1, "{e}");
    assert!(
        e.contains(&format!(
            "error: {twice}: not lowered for b200-x8: the graph could not be read (above)"
        )) && e.contains("2 of 2 (graph, target) pair(s) failed"),
        "{e}"
    );
    // Unreadable graphs have no default output to share: `x.json` and `x.pt2` are two
    // failed pairs, not a refusal of the run, and the readable graph beside them is
    // lowered (to its default output, removed after).
    let dir = tmp.0.join("stems");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("x.json"), "garbage").unwrap();
    std::fs::write(dir.join("x.pt2"), "garbage").unwrap();
    std::fs::copy(root().join(LLAMA), dir.join("y.json")).unwrap();
    let o = lower_in(&tmp.0, &["stems", "--report", "json"]);
    let lowered = tmp.0.join("y.h200-sxm-x8.lowered.json").is_file();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_says(&o, "2 of 3 (graph, target) pair(s) failed");
    assert!(lowered, "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let targets: Vec<&serde_json::Value> =
        v.as_array().unwrap().iter().map(|e| &e["target"]).collect();
    assert_eq!(
        targets,
        [
            &serde_json::Value::Null,
            &serde_json::Value::Null,
            &serde_json::json!("h200-sxm-x8")
        ]
    );
}

#[test]
fn list_targets_and_help() {
    let o = lower(&["--list-targets"]);
    let t = String::from_utf8_lossy(&o.stdout).into_owned();
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(lines.len(), 1 + Target::preset_names().len(), "{t}");
    assert_eq!(
        lines[0].split_whitespace().collect::<Vec<_>>(),
        [
            "preset",
            "GPU",
            "SM",
            "W",
            "nodes",
            "interconnect",
            "driver-multicast",
            "backend"
        ],
        "{t}"
    );
    let h200x2 = lines
        .iter()
        .find(|l| l.starts_with("h200-sxm-x2 "))
        .unwrap();
    let cells: Vec<&str> = h200x2.split_whitespace().collect();
    assert_eq!(
        cells,
        [
            "h200-sxm-x2",
            "H200",
            "SXM",
            "90",
            "2",
            "1",
            "nvswitch",
            "yes",
            "mnnvl"
        ]
    );
    assert!(
        t.contains("rtx-pro-6000-x4") && t.contains("none (no fusion)"),
        "{t}"
    );
    // With anything else it is a usage error naming what else was given, not the
    // table with the rest ignored.
    let o = lower(&["--list-targets", "--out", "x.json", "no-such-graph.json"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(o.stdout.is_empty());
    assert_says(
        &o,
        "the argument '--list-targets' cannot be used with one or more of the other specified \
         arguments",
    );
    let o = lower(&["--report", "json", "--list-targets"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = lower(&["--help"]);
    let help = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        help.contains("Usage: arfuse lower [OPTIONS] [GRAPH|DIR]"),
        "{help}"
    );
    // A usage error names the positional argument as the README does.
    let o = lower(&["--check", "--check-all"]);
    assert_eq!(o.status.code(), Some(2));
    assert_says(&o, "Usage: arfuse lower ");
}

#[test]
fn check_verifies_every_site_and_says_which_token_counts() {
    let tmp = TempDir::new("check");
    let out = tmp.path("l.json");
    let o = lower(&[EXPORTED, "--world-size", "8", "--out", &out, "--check"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let t = String::from_utf8_lossy(&o.stdout).into_owned();
    let line = t
        .lines()
        .find(|l| l.starts_with("check ("))
        .unwrap_or_else(|| panic!("{t}"));
    assert!(
        line.ends_with(
            "| W = 8 | seed = 0 | 5 fused site(s), 152 kept node(s) read what they read before | EQUIVALENT"
        ),
        "{line}"
    );
    // The first site of each kind at every T of the plan (from T = 1, though the
    // export's token symbol starts at 2), the others at T = 1 and W.
    assert!(
        t.contains(
            "  H = 4096, T = 1, 7, 8, 16, 17, 64, 65: 3 of 3 sites bit-exact (fused.all_reduce, \
             fused.all_reduce_1, fused.all_reduce_4)\n"
        ),
        "{t}"
    );
    assert!(
        t.contains(
            "  H = 4096, T = 1, 8: 2 of 2 sites bit-exact (fused.all_reduce_2, fused.all_reduce_3)\n"
        ),
        "{t}"
    );

    let o = lower(&[
        EXPORTED,
        "--world-size",
        "8",
        "--out",
        &out,
        "--check-all",
        "--report",
        "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let c = &v[0]["check"];
    assert_eq!(c["equivalent"], true);
    assert_eq!(c["sites"], 5);
    let groups = c["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 1, "{c}");
    assert_eq!(
        groups[0]["tokens"],
        serde_json::json!([1, 7, 8, 16, 17, 64, 65])
    );
    assert_eq!(groups[0]["fused_nodes"].as_array().unwrap().len(), 5);
    assert_eq!(groups[0]["bit_exact"], 5);

    // Both flags: refused by clap.
    let o = lower(&[EXPORTED, "--world-size", "8", "--check", "--check-all"]);
    assert!(!o.status.success());
    assert_says(&o, "cannot be used with");
}

#[test]
fn check_says_when_there_is_nothing_to_check_or_a_node_is_unchecked() {
    let tmp = TempDir::new("check-none");
    // Nothing fuses on h200-nvl-x8: said, not called equivalent.
    let nvl = tmp.path("nvl.json");
    let o = lower(&[LLAMA, "--target", "h200-nvl-x8", "--out", &nvl, "--check"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let t = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        t.contains("| 0 fused site(s), 518 kept node(s) read what they read before | no fused site to check"),
        "{t}"
    );

    // A lowered graph re-lowered: its fused nodes are kept and said to be unchecked.
    let first = tmp.path("first.json");
    let o = lower(&[LLAMA, "--target", "h200-sxm-x8", "--out", &first]);
    assert!(o.status.success(), "{}", stderr(&o));
    let again = tmp.path("again.json");
    let o = lower(&[
        &first,
        "--target",
        "h200-sxm-x8",
        "--out",
        &again,
        "--check",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let t = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        t.contains("65 fused node(s) already in the input are kept as they are and not checked"),
        "{t}"
    );
}

#[test]
fn a_directory_as_out_a_zero_world_size_and_ignored_all_reduce_ops_are_said() {
    let tmp = TempDir::new("misc");
    let o = lower(&[LLAMA, "--target", "h200-sxm-x8", "--out", &tmp.path("")]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("names a directory; it takes a file name") && e.starts_with("error: --out "),
        "{e}"
    );
    // Refused before lowering: no report was printed.
    assert!(
        o.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );

    for bad in ["0", "-1", "8.0", "eight", "4294967296"] {
        let o = lower(&[EXPORTED, "--world-size", bad]);
        assert_eq!(o.status.code(), Some(2), "{bad}");
        assert_says(
            &o,
            format!("invalid value '{bad}' for '--world-size <N>': "),
        );
    }

    let out = tmp.path("l.json");
    let o = lower(&[
        LLAMA,
        "--target",
        "h200-sxm-x8",
        "--out",
        &out,
        "--all-reduce-op",
        "vllm.all_reduce",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("warning: ")
            && e.contains("(vllm.all_reduce) apply to torch.export and FX graphs only"),
        "{e}"
    );
}

#[test]
fn a_directory_as_target_an_options_file_as_graph_and_a_negative_world_size_are_said() {
    let dir = root().join("ir-fixtures/targets");
    let o = lower(&[LLAMA, "--target", &dir.to_string_lossy()]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("target file ") && e.contains("Is a directory"),
        "{e}"
    );
    // A preset's name is the preset, whatever the current directory holds: here a
    // W = 4 target file and a directory named like W = 8 presets.
    let tmp = TempDir::new("preset-names");
    let w4 = std::fs::read_to_string(root().join(EXAMPLE_TARGET))
        .unwrap()
        .replace("world_size = 8", "world_size = 4");
    assert!(w4.contains("world_size = 4"));
    std::fs::write(tmp.0.join("h200-sxm-x8"), w4).unwrap();
    std::fs::create_dir(tmp.0.join("b200-x8")).unwrap();
    let llama = root().join(LLAMA);
    let in_tmp = |args: &[&str]| {
        let mut all = vec![llama.to_str().unwrap()];
        all.extend(args);
        lower_in(&tmp.0, &all)
    };
    for preset in ["h200-sxm-x8", "b200-x8"] {
        let o = in_tmp(&["--target", preset, "--out", "o.json", "--report", "json"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v[0]["target"], preset);
        assert_eq!(v[0]["report"]["target"]["world_size"], 8);
    }

    let options = root().join("ir-fixtures/models/llama31_8b_tp8.options.json");
    let o = lower(&[&options.to_string_lossy()]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("is an options file (the targets of `llama31_8b_tp8.json`), not a graph"),
        "{e}"
    );

    let o = lower(&[LLAMA, "--world-size", "-1"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("invalid value '-1' for '--world-size <N>'"),
        "{e}"
    );
}
