//! arfuse-import: front ends that turn other tools' graph files into arfuse IR.
//!
//! Two formats are read:
//!
//! - arfuse's own graph JSON (format version 1), handed to
//!   [`Graph::from_json_slice`];
//! - torch.export's serialized `ExportedProgram` (schema major version 8), either as
//!   the bare JSON or inside the `.pt2` zip archive that `torch.export.save` writes
//!   (see [`torch_export`] and `docs/torch-export.md`), and the same schema written by
//!   a torch.compile pass for a post-grad FX graph (`docs/fx-graph-format.md`).
//!
//! Either JSON may be gzip-compressed (`.json.gz`). [`detect`] tells the formats apart
//! from the bytes alone; [`load_any`] detects and imports; [`load_any_with`] takes
//! [`ImportOptions`] (a framework's own all-reduce ops). Every failure is an [`ImportError`] naming the node, tensor or position it
//! concerns; no input makes the importer panic, and memory is bounded by
//! [`MAX_FILE_BYTES`] and the limits in [`torch_export`].
//!
//! ```
//! let text = br#"{"format": "arfuse-graph", "version": 1, "nodes": [
//!   {"id": "x", "op": "input", "outputs": [{"dtype": "bf16", "shape": [4096]}]}],
//!   "outputs": ["x"]}"#;
//! assert_eq!(arfuse_import::detect(text), arfuse_import::Format::ArfuseJson);
//! let imported = arfuse_import::load_any(text).unwrap();
//! assert_eq!(imported.graph.len(), 1);
//! ```

mod error;
mod options;
pub mod torch_export;

pub use error::ImportError;
pub use options::{CustomAllReduce, CustomAllReduceParseError, ImportOptions};

use arfuse_ir::{Graph, Op, Value};
use std::collections::{BTreeMap, BTreeSet};

/// Largest input accepted, in bytes, for every format (for a `.pt2` archive: the
/// archive and, separately, the program JSON inside it). The same 256 MiB as the arfuse
/// JSON loader; a two-layer export is under 0.5 MiB and a 126-layer one about 30 MiB.
pub const MAX_FILE_BYTES: usize = arfuse_ir::MAX_INPUT_BYTES;

/// The format of a graph file, as [`detect`] sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// arfuse's graph JSON (`"format": "arfuse-graph"`).
    ArfuseJson,
    /// torch.export's serialized ExportedProgram as bare JSON.
    TorchExportJson,
    /// A zip archive, as `torch.export.save` writes (`.pt2`).
    TorchExportPt2,
    /// A gzip stream (`.json.gz`): one of the JSON formats, compressed.
    Gzip,
    /// None of the above.
    Unknown,
}

/// The result of an import: the graph and what the importer did to get it.
#[derive(Clone, Debug)]
pub struct Imported {
    /// The graph, validated.
    pub graph: Graph,
    /// What was dropped, forwarded or approximated, one finding a line (for example
    /// `dropped 16 aten._assert_tensor_metadata.default checks`). Empty for arfuse JSON.
    pub notes: Vec<String>,
    /// The original targets of every `opaque` node in the graph.
    pub opaque_targets: BTreeSet<String>,
    /// For torch.export and FX input: the IR value each torch tensor name (a graph
    /// input, or an output of a node; for an FX graph, the FX node's name) was imported
    /// as. A forwarded tensor (`wait_tensor`, a view that changes nothing) maps to the
    /// value it was forwarded to, so several names can map to one value; the outputs of
    /// dropped checks and non-tensor values are absent. The binding is the one made
    /// when the tensor was produced: an in-place op that later rebinds the name for
    /// its readers does not change it. Lets a graph compiler map a lowered graph back
    /// onto its own nodes (`arfuse::splice`). Empty for arfuse JSON.
    pub tensors: BTreeMap<String, Value>,
}

impl Imported {
    /// Wraps a graph, collecting its opaque targets.
    pub fn from_graph(graph: Graph, notes: Vec<String>) -> Imported {
        let opaque_targets = graph
            .nodes()
            .filter_map(|(_, n)| match &n.op {
                Op::Opaque { target, .. } => Some(target.clone()),
                _ => None,
            })
            .collect();
        Imported {
            graph,
            notes,
            opaque_targets,
            tensors: BTreeMap::new(),
        }
    }
}

/// Tells the format of `bytes` without parsing all of them.
///
/// A zip local-file or end-of-archive signature means [`Format::TorchExportPt2`], the
/// gzip signature (`1f 8b`) [`Format::Gzip`]. A
/// JSON object (after optional JSON whitespace and UTF-8 byte-order mark) is arfuse
/// JSON when a top-level `"format"` key with the value `"arfuse-graph"` comes before
/// any top-level `"graph_module"` or `"schema_version"` key, and torch.export JSON when
/// one of those keys comes first (a name as a value, or as a key of a nested object, is
/// no such key). The keys are found by a scan of quotes, escapes and brackets that
/// stops at the first one that decides (for the writers' files, the first key), not by
/// a parse; a key spelled with an escape (`"form\u0061t"`) is not recognised. Anything
/// else is [`Format::Unknown`].
pub fn detect(bytes: &[u8]) -> Format {
    if bytes.starts_with(b"PK\x03\x04") || bytes.starts_with(b"PK\x05\x06") {
        return Format::TorchExportPt2;
    }
    if bytes.starts_with(GZIP_MAGIC) {
        return Format::Gzip;
    }
    let body = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    let start = body.iter().position(|b| !is_json_space(b));
    let Some(start) = start else {
        return Format::Unknown;
    };
    if body[start] != b'{' {
        return Format::Unknown;
    }
    let object = &body[start..];
    for (key, value) in top_level_keys(object) {
        match key {
            b"\"format\"" if skip_whitespace(object, value).starts_with(b"\"arfuse-graph\"") => {
                return Format::ArfuseJson
            }
            b"\"graph_module\"" | b"\"schema_version\"" => return Format::TorchExportJson,
            _ => {}
        }
    }
    Format::Unknown
}

/// The keys of the object that `w` opens (JSON text from its `{`, perhaps cut short),
/// in order: each key's text with its quotes, and the position just past its `:`. A
/// scan of quotes, escapes and brackets, not a parse: strings and nested values are
/// stepped over, so a key's name as a value (`["graph_module"]`) or as a key of a
/// nested object is none. Ends at the object's end or at the end of `w`.
fn top_level_keys(w: &[u8]) -> impl Iterator<Item = (&[u8], usize)> {
    let mut i = 1;
    let mut depth = 1u32;
    std::iter::from_fn(move || {
        while i < w.len() {
            match w[i] {
                b'"' => {
                    let start = i;
                    i += 1;
                    while i < w.len() && w[i] != b'"' {
                        i += if w[i] == b'\\' { 2 } else { 1 };
                    }
                    if i >= w.len() {
                        return None;
                    }
                    i += 1;
                    let key = &w[start..i];
                    let rest = skip_whitespace(w, i);
                    if depth == 1 && rest.first() == Some(&b':') {
                        i = w.len() - rest.len() + 1;
                        return Some((key, i));
                    }
                }
                b'{' | b'[' => {
                    depth += 1;
                    i += 1;
                }
                b'}' | b']' => {
                    depth -= 1;
                    i += 1;
                    if depth == 0 {
                        i = w.len();
                    }
                }
                _ => i += 1,
            }
        }
        None
    })
}

/// `w` from `i` on, past any JSON whitespace.
fn skip_whitespace(w: &[u8], i: usize) -> &[u8] {
    let rest = w.get(i..).unwrap_or_default();
    let n = rest.iter().take_while(|b| is_json_space(b)).count();
    &rest[n..]
}

/// JSON's whitespace (RFC 8259): space, tab, line feed, carriage return.
fn is_json_space(b: &u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// Detects the format of `bytes` and imports it, with [`ImportOptions::default`].
///
/// Errors: see [`load_any_with`].
pub fn load_any(bytes: &[u8]) -> Result<Imported, ImportError> {
    load_any_with(bytes, &ImportOptions::default())
}

/// Detects the format of `bytes` and imports it.
///
/// arfuse JSON goes to [`Graph::from_json_slice`]; torch.export JSON and `.pt2`
/// archives go to [`torch_export::import_with`] with `options`; a gzip stream is
/// decompressed (at most [`MAX_FILE_BYTES`]) and its content detected again (it may not
/// be another gzip stream or a zip archive). Errors: [`ImportError::TooLarge`] above
/// [`MAX_FILE_BYTES`] (compressed or not), [`ImportError::Gzip`] for a corrupt stream,
/// [`ImportError::UnknownFormat`] for anything else, and the errors of the chosen front
/// end.
pub fn load_any_with(bytes: &[u8], options: &ImportOptions) -> Result<Imported, ImportError> {
    check_size("the file", bytes.len())?;
    match detect(bytes) {
        Format::Gzip => {
            let inner = gunzip(bytes)?;
            match detect(&inner) {
                Format::Gzip | Format::TorchExportPt2 => Err(ImportError::Gzip {
                    message: "the decompressed content is itself compressed or an archive; \
                              arfuse reads one gzip layer around a JSON graph"
                        .into(),
                }),
                _ => load_plain(&inner, "the decompressed content", options),
            }
        }
        _ => load_plain(bytes, "the file", options),
    }
}

/// Loads `bytes` by their detected format; `what` names them in an unknown format's
/// hint ("the file", or "the decompressed content" of a gzip stream).
fn load_plain(bytes: &[u8], what: &str, options: &ImportOptions) -> Result<Imported, ImportError> {
    match detect(bytes) {
        Format::ArfuseJson => {
            // Framework all-reduce ops are a torch front-end option: an arfuse graph
            // spells its all-reduces `all_reduce` (and keeps other ops opaque as written).
            let notes = if options.all_reduce_ops.is_empty() {
                Vec::new()
            } else {
                let names: Vec<&str> = options
                    .all_reduce_ops
                    .iter()
                    .map(|o| o.target.as_str())
                    .collect();
                vec![format!(
                    "warning: the framework all-reduce ops given ({}) apply to torch.export \
                     and FX graphs only; this is an arfuse JSON graph, whose all-reduces are \
                     `all_reduce` nodes: ignored",
                    names.join(", ")
                )]
            };
            Ok(Imported::from_graph(Graph::from_json_slice(bytes)?, notes))
        }
        Format::TorchExportJson | Format::TorchExportPt2 => {
            torch_export::import_with(bytes, options)
        }
        Format::Gzip | Format::Unknown => Err(ImportError::UnknownFormat {
            hint: unknown_hint(bytes, what),
        }),
    }
}

/// The gzip signature.
const GZIP_MAGIC: &[u8] = b"\x1f\x8b";

/// The content of a gzip stream: every member of it, as `gzip -d` reads `cat a.gz
/// b.gz`, then only zero bytes (padding, as `gzip -d` accepts) or nothing. Read up to
/// [`MAX_FILE_BYTES`] + 1 bytes, so that a small file that inflates without bound is
/// refused, not held in memory.
///
/// Errors: [`ImportError::Gzip`] for a corrupt member, or other bytes after the last
/// member (their offset said); [`ImportError::TooLarge`].
fn gunzip(bytes: &[u8]) -> Result<Vec<u8>, ImportError> {
    use std::io::Read;
    let limit = MAX_FILE_BYTES as u64 + 1;
    let mut out = Vec::new();
    let mut rest = bytes;
    loop {
        let mut member = flate2::bufread::GzDecoder::new(rest);
        (&mut member)
            .take(limit - out.len() as u64)
            .read_to_end(&mut out)
            .map_err(|e| ImportError::Gzip {
                message: e.to_string(),
            })?;
        check_size("the decompressed file (read so far)", out.len())?;
        rest = member.into_inner();
        if rest.iter().all(|&b| b == 0) {
            return Ok(out);
        }
        if !rest.starts_with(GZIP_MAGIC) {
            return Err(ImportError::Gzip {
                message: format!(
                    "{} bytes after the gzip stream (from offset {}) are neither another gzip \
                     member nor zero padding",
                    rest.len(),
                    bytes.len() - rest.len()
                ),
            });
        }
    }
}

pub(crate) fn check_size(what: &str, size: usize) -> Result<(), ImportError> {
    if size > MAX_FILE_BYTES {
        return Err(ImportError::TooLarge {
            what: what.to_string(),
            size: size as u64,
            limit: MAX_FILE_BYTES as u64,
        });
    }
    Ok(())
}

/// What bytes of no known format (`what`: "the file", or a gzip stream's "decompressed
/// content") look like instead: UTF-16 or UTF-32 text; nothing but whitespace; text
/// that begins like a JSON value but is malformed or not UTF-8 (and where); JSON of
/// another kind (an object that is no graph, or a value that is no object); torch.fx's
/// printed text of a graph; or anything else, by its first bytes.
fn unknown_hint(bytes: &[u8], what: &str) -> String {
    if let Some(encoding) = utf16_or_32_encoding(bytes) {
        return format!("{what} is {encoding} text; arfuse reads JSON in UTF-8 (save it as UTF-8)");
    }
    let body = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    let Some(&first) = body.iter().find(|b| !is_json_space(b)) else {
        return if bytes.is_empty() {
            format!("{what} is empty")
        } else {
            format!("{what} holds no JSON, only whitespace or a UTF-8 byte order mark")
        };
    };
    let Some(kind) = json_kind(first) else {
        // `print(gm.graph)` / `gm.print_readable()` text: readable, but no serialized graph.
        if body.starts_with(b"graph(") || body.starts_with(b"class ") {
            return format!(
                "{what} is the text torch.fx prints for a graph, which holds no tensor types; \
                 save the model with torch.export (`torch.export.save`, or the program's \
                 JSON: docs/torch-export.md)"
            );
        }
        let head: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
        return format!(
            "expected arfuse graph JSON or torch.export JSON (either may be gzip-compressed), or a .pt2 zip archive; {what} starts with bytes {}",
            head.join(" ")
        );
    };
    match not_json_text(bytes, body, what) {
        Some(why) => format!("{what} begins with `{}` but is {why}", char::from(first)),
        None if first == b'{' => format!(
            "{what} is a JSON object that is neither an arfuse graph (no \"format\": \
             \"arfuse-graph\" key) nor a torch.export ExportedProgram (no \"graph_module\" or \
             \"schema_version\" key)"
        ),
        None => format!("{what} is JSON, but {kind}, not an object: a graph is a JSON object"),
    }
}

/// The kind of JSON value whose text starts with byte `first` ("an object", "an
/// array", ...); `None` when no JSON value starts so.
fn json_kind(first: u8) -> Option<&'static str> {
    Some(match first {
        b'{' => "an object",
        b'[' => "an array",
        b'"' => "a string",
        b'-' | b'0'..=b'9' => "a number",
        b't' | b'f' => "a boolean",
        b'n' => "null",
        _ => return None,
    })
}

/// How many leading bytes [`utf16_or_32_encoding`] looks at without a byte order mark.
const UTF16_PROBE_BYTES: usize = 64;

/// The encoding's name when `bytes` look like UTF-32 or UTF-16 text: a UTF-32 byte
/// order mark (`FF FE 00 00`, `00 00 FE FF`; the LE one begins with UTF-16 LE's), a
/// UTF-16 one (`FF FE`, `FE FF`), or, within the first [`UTF16_PROBE_BYTES`], a NUL
/// byte at every odd offset and none at an even one (UTF-16 LE; ASCII text such as
/// JSON's punctuation and keys), or the other way round (BE). A UTF-8 file with a stray
/// NUL is not UTF-16: the JSON parser then names the NUL's position.
fn utf16_or_32_encoding(bytes: &[u8]) -> Option<&'static str> {
    if bytes.starts_with(b"\xFF\xFE\x00\x00") {
        return Some("UTF-32 LE");
    }
    if bytes.starts_with(b"\x00\x00\xFE\xFF") {
        return Some("UTF-32 BE");
    }
    if bytes.starts_with(b"\xFF\xFE") {
        return Some("UTF-16 LE");
    }
    if bytes.starts_with(b"\xFE\xFF") {
        return Some("UTF-16 BE");
    }
    let probe = &bytes[..bytes.len().min(UTF16_PROBE_BYTES) & !1];
    let pairs = probe.chunks_exact(2);
    if probe.is_empty() {
        None
    } else if pairs.clone().all(|p| p[0] != 0 && p[1] == 0) {
        Some("UTF-16 LE")
    } else if pairs.clone().all(|p| p[0] == 0 && p[1] != 0) {
        Some("UTF-16 BE")
    } else {
        None
    }
}

/// Why `body` (`bytes` without a UTF-8 byte order mark) is no JSON text: not UTF-8 (the
/// offset of the first bad byte in `bytes`, which `what` names), or not well-formed
/// (line and column, as the loaders give them); `None` when it is well-formed JSON. A
/// truncated or broken file fails the format check first, so this says what else is
/// wrong.
fn not_json_text(bytes: &[u8], body: &[u8], what: &str) -> Option<String> {
    if let Err(e) = std::str::from_utf8(body) {
        let offset = bytes.len() - body.len() + e.valid_up_to();
        return Some(format!(
            "not UTF-8 text (invalid byte at offset {offset} of {what})"
        ));
    }
    // `IgnoredAny` keeps nothing, and serde_json skips an ignored value without
    // recursing (a 5,000-deep array of `ir-fixtures/hostile/` passes).
    let e = serde_json::from_slice::<serde::de::IgnoredAny>(body).err()?;
    let (line, column, message) = error::json_parts(&e);
    Some(format!(
        "not well-formed JSON: at line {line}, column {column}: {message}"
    ))
}
