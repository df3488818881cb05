//! Round trips over every fixture, error snapshots of the malformed corpus, and
//! garbage input.

use arfuse_ir::{Graph, LoadError, ProblemKind};
use std::path::{Path, PathBuf};

fn fixtures_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ir-fixtures")
}

/// Every `*.json` graph under ir-fixtures/ except the malformed and hostile corpora.
fn valid_fixtures() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![fixtures_root()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if p.is_dir() {
                if name != "malformed"
                    && name != "hostile"
                    && name != "configs"
                    && name != "exported"
                {
                    stack.push(p);
                }
            } else if name.ends_with(".json") && !name.ends_with(".options.json") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn every_fixture_round_trips() {
    let files = valid_fixtures();
    assert!(files.len() >= 3, "fixtures not found: {files:?}");
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let g = Graph::from_json_str(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let written = g.to_json_string();
        let g2 = Graph::from_json_str(&written)
            .unwrap_or_else(|e| panic!("{} (rewritten): {e}", f.display()));
        assert_eq!(g.canonical_text(), g2.canonical_text(), "{}", f.display());
        assert_eq!(
            written,
            g2.to_json_string(),
            "{}: writing is not idempotent",
            f.display()
        );
        assert_eq!(g.len(), g2.len());
        for ((_, a), (_, b)) in g.nodes().zip(g2.nodes()) {
            assert_eq!(a, b, "{}", f.display());
        }
        assert_eq!(g.metadata(), g2.metadata());
    }
}

#[test]
fn malformed_fixtures_give_snapshotted_errors() {
    insta::glob!("../../../ir-fixtures", "malformed/*.json", |path| {
        let bytes = std::fs::read(path).unwrap();
        let err = Graph::from_json_slice(&bytes).expect_err("a malformed fixture must not load");
        insta::assert_snapshot!(err.to_string());
    });
}

fn problem_kinds(name: &str) -> Vec<ProblemKind> {
    let p = fixtures_root().join("malformed").join(name);
    match Graph::from_json_slice(&std::fs::read(p).unwrap()) {
        Err(LoadError::Invalid(ps)) => ps.list.iter().map(|p| p.kind).collect(),
        other => panic!("{name}: expected a validation error, got {other:?}"),
    }
}

#[test]
fn each_error_class_is_classified() {
    for (file, kind) in [
        ("duplicate_id.json", ProblemKind::DuplicateId),
        ("missing_input_node.json", ProblemKind::MissingInput),
        ("missing_output_index.json", ProblemKind::MissingInput),
        ("cycle.json", ProblemKind::Cycle),
        ("self_loop.json", ProblemKind::Cycle),
        ("wrong_arity.json", ProblemKind::Arity),
        ("dtype_mismatch.json", ProblemKind::DType),
        ("shape_mismatch_add.json", ProblemKind::Shape),
        ("eps_not_positive.json", ProblemKind::Attribute),
        ("group_size_not_dividing_h.json", ProblemKind::Attribute),
        (
            "hidden_not_multiple_of_nvfp4_block.json",
            ProblemKind::Attribute,
        ),
        ("byte_count_overflow.json", ProblemKind::Overflow),
        ("undeclared_symbol.json", ProblemKind::Symbol),
        ("symbol_range_empty.json", ProblemKind::Symbol),
        ("unknown_op.json", ProblemKind::Attribute),
        ("unknown_attribute.json", ProblemKind::Attribute),
        ("all_reduce_without_group.json", ProblemKind::Attribute),
        ("missing_graph_output.json", ProblemKind::MissingInput),
        ("output_type_wrong.json", ProblemKind::DType),
        ("fused_plan_dispatch_gap.json", ProblemKind::Attribute),
        ("fused_plan_understates_bytes.json", ProblemKind::Attribute),
    ] {
        assert_eq!(problem_kinds(file), vec![kind], "{file}");
    }
    let syntax = Graph::from_json_slice(
        &std::fs::read(fixtures_root().join("malformed/syntax_error.json")).unwrap(),
    );
    assert!(
        matches!(syntax, Err(LoadError::Json { line: 5, .. })),
        "{syntax:?}"
    );
    let version = Graph::from_json_slice(
        &std::fs::read(fixtures_root().join("malformed/unknown_version.json")).unwrap(),
    );
    assert_eq!(version.unwrap_err(), LoadError::Version { found: 2 });
}

#[test]
fn truncated_and_garbage_bytes_are_errors_not_panics() {
    let text = std::fs::read(fixtures_root().join("small/first_layer_and_block.json")).unwrap();
    for cut in 0..text.len() {
        // Every strict prefix is invalid JSON (the object closes on the last byte).
        let trimmed = String::from_utf8_lossy(&text[..cut]);
        if trimmed.trim_end().ends_with('}') && cut + 2 >= text.len() {
            continue;
        }
        assert!(
            Graph::from_json_slice(&text[..cut]).is_err(),
            "prefix of {cut} bytes loaded"
        );
    }
    // A tiny xorshift so the test is deterministic without a dependency.
    let mut s: u64 = 0x9E37_79B9_7F4A_7C15;
    for len in [0usize, 1, 7, 64, 1000] {
        for _ in 0..50 {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    s as u8
                })
                .collect();
            assert!(Graph::from_json_slice(&bytes).is_err());
        }
    }
    assert!(matches!(
        Graph::from_json_slice(&[0xff, 0xfe, b'{']),
        Err(LoadError::Utf8 { offset: 0 })
    ));
}

#[test]
fn deep_nesting_is_an_error() {
    let mut s = String::from(r#"{"format":"arfuse-graph","version":1,"nodes":[],"metadata":"#);
    s.push_str(&"[".repeat(100_000));
    assert!(matches!(
        Graph::from_json_str(&s),
        Err(LoadError::Json { .. })
    ));
}

#[test]
fn three_d_view_graph_checks_element_counts() {
    let text =
        std::fs::read_to_string(fixtures_root().join("small/decomposed_norm_3d.json")).unwrap();
    let g = Graph::from_json_str(&text).unwrap();
    let bad = text.replace(
        r#""shape": ["B*S", 2048]}]}"#,
        r#""shape": ["B*S", 1024]}]}"#,
    );
    assert_ne!(bad, text);
    let err = Graph::from_json_str(&bad).unwrap_err().to_string();
    assert!(
        err.contains("flat") && err.contains("element count"),
        "{err}"
    );
    insta::assert_snapshot!("decomposed_norm_3d_canonical", g.canonical_text());
    insta::assert_snapshot!("decomposed_norm_3d_dot", g.to_dot());
}
