//! Malformed input: each gives a clear error naming what is wrong, and nothing panics.

mod common;

use arfuse_import::{detect, load_any, torch_export, Format, ImportError};
use common::{arg, bytes, export_bytes, meta, node, program, t};
use serde_json::json;

fn err(b: &[u8]) -> ImportError {
    match load_any(b) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

#[test]
fn truncated_file() {
    let full = export_bytes("llama31_8b_L2_tp8");
    let half = &full[..full.len() / 2];
    assert_eq!(detect(half), Format::TorchExportJson);
    let e = err(half);
    assert!(matches!(e, ImportError::Json { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("EOF") && msg.contains("line"), "{msg}");
}

#[test]
fn detection_reads_keys_not_values() {
    for (text, want) in [
        (&b"{\"graph_module\" : {}}"[..], Format::TorchExportJson),
        (
            b"{\"x\": 1, \"schema_version\":\n{}}",
            Format::TorchExportJson,
        ),
        (b"{\"a\": [\"graph_module\"]}", Format::Unknown),
        (b"{\"a\": \"schema_version\"}", Format::Unknown),
        // The first key decides: a torch.export key named in a value before the tag
        // does not count.
        (
            b"{\"note\": \"graph_module\", \"format\": \"arfuse-graph\"}",
            Format::ArfuseJson,
        ),
        (
            b"{\"format\": \"other\", \"format\" :\t\"arfuse-graph\"}",
            Format::ArfuseJson,
        ),
        (b"{\"format\"", Format::Unknown),
        (b"{\"format\":", Format::Unknown),
        (b"{\"schema_version\"", Format::Unknown),
        (
            b"{\"schema_version\": {}, \"format\": \"arfuse-graph\"}",
            Format::TorchExportJson,
        ),
        // Keys of nested objects, and names inside strings, are not the file's keys.
        (b"{\"a\": {\"graph_module\": 1}}", Format::Unknown),
        (
            b"{\"metadata\": {\"schema_version\": \"1.0\"}, \"nodes\": []}",
            Format::Unknown,
        ),
        (
            b"{\"a\": [{\"format\": \"arfuse-graph\"}], \"graph_module\": {}}",
            Format::TorchExportJson,
        ),
        (
            b"{\"n\": \"x\\\"graph_module\\\": 1\", \"format\": \"arfuse-graph\"}",
            Format::ArfuseJson,
        ),
        (
            b"{\"a\": \"\\\\\", \"graph_module\": 1}",
            Format::TorchExportJson,
        ),
        // Form feed is no JSON whitespace.
        (b"\x0c{\"format\": \"arfuse-graph\"}", Format::Unknown),
        (b"\r\n\t {\"format\": \"arfuse-graph\"}", Format::ArfuseJson),
    ] {
        assert_eq!(detect(text), want, "{}", String::from_utf8_lossy(text));
    }
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let full = export_bytes("qwen3_30b_a3b_L2_tp4");
    let mut at = 0;
    while at < full.len() {
        assert!(load_any(&full[..at]).is_err(), "prefix of {at} bytes");
        at += 7919;
    }
}

#[test]
fn wrong_schema_major_version() {
    let text = String::from_utf8(export_bytes("gemma3_1b_L2_tp2")).unwrap();
    let changed = text.replacen("\"major\": 8", "\"major\": 9", 1);
    assert_ne!(changed, text, "the fixture spells the version as expected");
    let e = err(changed.as_bytes());
    assert!(matches!(e, ImportError::SchemaVersion { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        "unsupported torch.export schema version 9.20: this importer reads schema major version 8"
    );
    // Missing entirely.
    let mut v = program(vec![], vec![], &["x"]);
    v.as_object_mut().unwrap().remove("schema_version");
    let e = err(&bytes(&v));
    assert!(e.to_string().contains("<missing>"), "{e}");
}

#[test]
fn node_referring_to_a_missing_tensor() {
    let mut v: serde_json::Value =
        serde_json::from_slice(&export_bytes("llama31_8b_L2_tp8")).unwrap();
    let nodes = v["graph_module"]["graph"]["nodes"].as_array_mut().unwrap();
    let ar = nodes
        .iter_mut()
        .find(|n| n["name"] == "all_reduce_1")
        .expect("the o_proj all-reduce");
    ar["inputs"][0]["arg"]["as_tensor"]["name"] = json!("no_such_tensor");
    let e = err(&bytes(&v));
    assert!(matches!(e, ImportError::MissingTensor { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("all_reduce_1") && msg.contains("no_such_tensor"),
        "{msg}"
    );
    // A graph output naming nothing.
    let v = program(vec![], vec![], &["nothing"]);
    let e = err(&bytes(&v));
    assert!(
        matches!(e, ImportError::MissingTensor { ref node, .. } if node == "graph output 0"),
        "{e:?}"
    );
}

#[test]
fn tensor_without_metadata() {
    let v = program(
        vec![node(
            "y",
            "aten.rsqrt.default",
            vec![arg("self", t("x"))],
            "m.layer",
        )],
        vec![],
        &["y"],
    );
    let e = err(&bytes(&v));
    assert!(matches!(e, ImportError::MissingMetadata { .. }), "{e:?}");
    assert!(e.to_string().contains("\"y\""), "{e}");
}

#[test]
fn unsupported_dtype_names_the_tensor() {
    let v = program(
        vec![node(
            "y",
            "aten.rsqrt.default",
            vec![arg("self", t("x"))],
            "m.layer",
        )],
        vec![("y", meta(8, &[json!("s0"), json!(8)]))],
        &["y"],
    );
    let e = err(&bytes(&v));
    assert_eq!(
        e.to_string(),
        "tensor \"y\" has dtype DOUBLE (float64) (8), which arfuse IR cannot represent"
    );
}

#[test]
fn size_expression_without_a_range() {
    let v = program(
        vec![node(
            "y",
            "aten.rsqrt.default",
            vec![arg("self", t("x"))],
            "m.layer",
        )],
        vec![("y", meta(13, &[json!("Foo(s0)"), json!(8)]))],
        &["y"],
    );
    let e = err(&bytes(&v));
    assert!(matches!(e, ImportError::Dimension { dim: 0, .. }), "{e:?}");
    assert!(e.to_string().contains("Foo(s0)"), "{e}");
}

#[test]
fn garbage_and_other_formats() {
    for (b, want) in [
        (&b""[..], "the file is empty"),
        (
            b"   \n",
            "the file holds no JSON, only whitespace or a UTF-8 byte order mark",
        ),
        (b"\xEF\xBB\xBF", "the file holds no JSON, only whitespace"),
        // Well-formed JSON of another kind says which kind it is.
        (
            b"[1, 2, 3]",
            "unknown file format: the file is JSON, but an array, not an object: a graph is a \
             JSON object",
        ),
        (b" null\n", "the file is JSON, but null, not an object"),
        (
            b"\"graph\"",
            "the file is JSON, but a string, not an object",
        ),
        (b"-4.5e3", "the file is JSON, but a number, not an object"),
        (b"true", "the file is JSON, but a boolean, not an object"),
        // 200 arrays opened and never closed.
        (
            &[b'['; 200],
            "the file begins with `[` but is not well-formed JSON: at line 1, column 200: EOF",
        ),
        (
            b"\x00\x01\x02garbage",
            "expected arfuse graph JSON or torch.export JSON (either may be gzip-compressed), \
             or a .pt2 zip archive; the file starts with bytes 00 01 02",
        ),
        // Malformed or not UTF-8, whatever the kind: the parser's position, or the byte.
        (
            b"[1, 2",
            "unknown file format: the file begins with `[` but is not well-formed JSON: at \
             line 1, column 5: EOF while parsing a list",
        ),
        (
            b"nul",
            "the file begins with `n` but is not well-formed JSON: at line 1",
        ),
        (
            b"[\"a\xff\"]",
            "the file begins with `[` but is not UTF-8 text (invalid byte at offset 3 of the \
             file)",
        ),
        (b"\x0c[1]", "the file starts with bytes 0c 5b 31 5d"),
        (
            b"graph():\n    %x : [num_users=1] = placeholder[target=x]\n",
            "the file is the text torch.fx prints for a graph, which holds no tensor types; \
             save the model with torch.export",
        ),
        (
            b"class GraphModule(torch.nn.Module):\n    def forward(self, x):\n",
            "the file is the text torch.fx prints for a graph",
        ),
        (
            b"{\"hello\": 1}",
            "unknown file format: the file is a JSON object that is neither an arfuse graph \
             (no \"format\": \"arfuse-graph\" key) nor a torch.export ExportedProgram (no \
             \"graph_module\" or \"schema_version\" key)",
        ),
        // A torch.export key as a value is no key.
        (
            b"{\"a\": [\"graph_module\"], \"b\": \"schema_version\"}",
            "a JSON object that is neither an arfuse graph",
        ),
        // Text that only opens like an object is not called one.
        (
            b"{",
            "unknown file format: the file begins with `{` but is not well-formed JSON: at \
             line 1, column 1: EOF while parsing an object",
        ),
        (
            b"{not json",
            "unknown file format: the file begins with `{` but is not well-formed JSON: at \
             line 1, column 2: key must be a string",
        ),
        (
            b"{\"format\": \"arfuse-graf\", \"nodes\": [",
            "the file begins with `{` but is not well-formed JSON: at line 1, column 36: EOF \
             while parsing a list",
        ),
        // serde skips a bad byte in a string it ignores: the UTF-8 check says it.
        (
            b"{\"version\": 1, \"nodes\": [\"\xff\xfe\"]}",
            "the file begins with `{` but is not UTF-8 text (invalid byte at offset 26 of the \
             file)",
        ),
        // The offset counts the byte order mark.
        (
            b"\xEF\xBB\xBF{\"a\": \"\xff\"}",
            "but is not UTF-8 text (invalid byte at offset 10 of the file)",
        ),
        // UTF-16, with its byte order mark or without (ASCII text: every other byte NUL).
        (
            b"{\x00\"\x00a\x00\"\x00:\x001\x00}\x00",
            "the file is UTF-16 LE text; arfuse reads JSON in UTF-8",
        ),
        (b"\xFF\xFE{\x00}\x00", "the file is UTF-16 LE text"),
        (
            b"\x00{\x00\"\x00a\x00\"\x00:\x001\x00}",
            "the file is UTF-16 BE text",
        ),
        (b"\xFE\xFF\x00{\x00}", "the file is UTF-16 BE text"),
        (b"\n\x00{\x00}\x00", "the file is UTF-16 LE text"),
        // UTF-32 by its byte order mark (the LE one begins with UTF-16 LE's).
        (
            b"\xFF\xFE\x00\x00{\x00\x00\x00}\x00\x00\x00",
            "the file is UTF-32 LE text; arfuse reads JSON in UTF-8",
        ),
        (
            b"\x00\x00\xFE\xFF\x00\x00\x00{\x00\x00\x00}",
            "the file is UTF-32 BE text",
        ),
        // A stray NUL in UTF-8 is no UTF-16: the parser names its position.
        (
            b"{\"hello\": \"\x00world\", \"n\": 1}",
            "but is not well-formed JSON: at line 1, column 11: control character",
        ),
        // The bytes shown are the file's, byte order mark included.
        (
            b"\xEF\xBB\xBF\xEF\xBB\xBF{}",
            "the file starts with bytes ef bb bf ef bb bf 7b 7d",
        ),
    ] {
        let e = err(b);
        assert!(matches!(e, ImportError::UnknownFormat { .. }), "{e:?}");
        assert!(e.to_string().contains(want), "{e}");
    }
    // Well-formed UTF-8 JSON of another kind is said to be nothing else.
    let e = err(b"{\"hello\": 1}").to_string();
    assert!(!e.contains("; nor"), "{e}");
    // Looks like torch.export JSON but the structure is wrong.
    let e = err(br#"{"schema_version": {"major": 8, "minor": 20}, "graph_module": 3}"#);
    assert!(matches!(e, ImportError::Json { .. }), "{e:?}");
    // Not UTF-8.
    let e = torch_export::import(b"{\"graph_module\": \"\xff\"}").unwrap_err();
    assert!(matches!(e, ImportError::Utf8 { offset: 18 }), "{e:?}");
    // arfuse JSON errors come from the IR loader.
    let e = err(br#"{"format": "arfuse-graph", "version": 2, "nodes": []}"#);
    assert!(matches!(e, ImportError::Arfuse(_)), "{e:?}");
}

#[test]
fn broken_archives() {
    // Zip magic, then junk.
    let e = err(b"PK\x03\x04 this is not a zip");
    assert!(matches!(e, ImportError::Archive { .. }), "{e:?}");
    // A valid zip without a program.
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    w.start_file(
        "x/data/weights/w.pt",
        zip::write::SimpleFileOptions::default(),
    )
    .unwrap();
    let z = w.finish().unwrap().into_inner();
    let e = err(&z);
    assert!(e.to_string().contains("no program JSON"), "{e}");
    assert!(e.to_string().contains("x/data/weights/w.pt"), "{e}");
}

#[test]
fn random_mutations_never_panic() {
    let base = bytes(&program(
        vec![
            node(
                "f",
                "aten.to.dtype",
                vec![
                    arg("self", t("x")),
                    arg("dtype", json!({"as_scalar_type": 7})),
                ],
                "m.layer.norm",
            ),
            node(
                "p",
                "aten.pow.Tensor_Scalar",
                vec![arg("self", t("f")), arg("exponent", json!({"as_int": 2}))],
                "m.layer.norm",
            ),
            node(
                "y",
                "aten.linear.default",
                vec![
                    arg("input", t("x")),
                    arg("weight", t("lw")),
                    arg("bias", t("lb")),
                ],
                "m.layer.proj",
            ),
        ],
        vec![
            ("f", meta(7, &[json!("s0"), json!(8)])),
            ("p", meta(7, &[json!("s0"), json!(8)])),
            ("y", meta(13, &[json!("s0"), json!(4)])),
        ],
        &["p", "y"],
    ));
    assert!(load_any(&base).is_ok());
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut rand = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let alphabet = b"{}[]\":,0123456789-eE.abcdefghijklmnopqrstuvwxyz_ \x00\xff";
    for _ in 0..3000 {
        let mut b = base.clone();
        for _ in 0..(1 + rand() % 4) {
            let at = (rand() % b.len() as u64) as usize;
            match rand() % 3 {
                0 => b[at] = alphabet[(rand() % alphabet.len() as u64) as usize],
                1 => {
                    b.remove(at);
                }
                _ => b.insert(at, alphabet[(rand() % alphabet.len() as u64) as usize]),
            }
        }
        let _ = load_any(&b);
    }
}

/// A UTF-8 byte order mark before an arfuse graph is skipped, as before torch.export
/// JSON: the graph loads as without it, and an error in it keeps its own position
/// (it read "line 1, column 1: expected value", the mark itself).
#[test]
fn a_byte_order_mark_before_an_arfuse_graph_is_skipped() {
    let plain = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../ir-fixtures/models/llama31_8b_tp8.json"
    ))
    .unwrap();
    let with_bom = [b"\xEF\xBB\xBF".as_slice(), &plain].concat();
    let a = load_any(&plain).unwrap().graph;
    let b = load_any(&with_bom).unwrap().graph;
    assert_eq!(b.len(), 518);
    assert_eq!(a.canonical_text(), b.canonical_text());

    let cut = plain.len() / 2;
    let plain_err = err(&plain[..cut]).to_string();
    let bom_err = err(&with_bom[..cut + 3]).to_string();
    assert!(
        plain_err.starts_with("arfuse graph JSON is malformed at line "),
        "{plain_err}"
    );
    assert_eq!(bom_err, plain_err);
}

/// A graph whose "format" key comes last, after its nodes, loads; and a gzip file of
/// two members (`cat a.gz b.gz`), perhaps zero-padded, is read whole, as `gzip -d`
/// reads it.
#[test]
fn a_late_format_key_and_a_multi_member_gzip_load() {
    use flate2::{write::GzEncoder, Compression};
    use std::io::Write;
    let plain = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../ir-fixtures/models/llama31_8b_tp8.json"
    ))
    .unwrap();
    let want = load_any(&plain).unwrap().graph.canonical_text();
    // The format tag moved from the first key to the last.
    let text = String::from_utf8(plain.clone()).unwrap();
    let tag = "\"format\": \"arfuse-graph\",";
    assert_eq!(text.matches(tag).count(), 1);
    let body = text.replacen(tag, "", 1);
    let end = body.rfind('}').unwrap();
    let late = format!("{}, \"format\": \"arfuse-graph\"}}", &body[..end]);
    assert!(late.find("\"format\"").unwrap() > 100_000);
    assert_eq!(detect(late.as_bytes()), Format::ArfuseJson);
    let g = load_any(late.as_bytes()).unwrap().graph;
    assert_eq!(g.canonical_text(), want);
    let gz = |b: &[u8]| {
        let mut e = GzEncoder::new(Vec::new(), Compression::default());
        e.write_all(b).unwrap();
        e.finish().unwrap()
    };
    let (a, b) = plain.split_at(plain.len() / 3);
    let two = [gz(a), gz(b)].concat();
    assert_eq!(load_any(&two).unwrap().graph.canonical_text(), want);
    // Zero padding after the last member is read past, as `gzip -d` does; other bytes
    // are an error naming their offset.
    let padded = [two.as_slice(), &[0u8; 1024]].concat();
    assert_eq!(load_any(&padded).unwrap().graph.canonical_text(), want);
    let e = err(&[two.as_slice(), b"garbage"].concat());
    assert!(matches!(e, ImportError::Gzip { .. }), "{e:?}");
    assert!(
        e.to_string().contains(&format!(
            "7 bytes after the gzip stream (from offset {}) are neither another gzip member \
             nor zero padding",
            two.len()
        )),
        "{e}"
    );
}

/// A gzip stream's content is named as such in an unknown format's hint, and an
/// offset in it is an offset of that content.
#[test]
fn a_gzip_streams_content_is_named_in_the_hint() {
    use flate2::{write::GzEncoder, Compression};
    use std::io::Write;
    let gz = |b: &[u8]| {
        let mut e = GzEncoder::new(Vec::new(), Compression::default());
        e.write_all(b).unwrap();
        e.finish().unwrap()
    };
    assert_eq!(
        err(&gz(b"")).to_string(),
        "unknown file format: the decompressed content is empty"
    );
    let e = err(&gz(b"{\"caf\xe9\": 1}")).to_string();
    assert!(
        e.ends_with(
            "the decompressed content begins with `{` but is not UTF-8 text (invalid byte at \
             offset 5 of the decompressed content)"
        ),
        "{e}"
    );
}
