//! The error of every front end.

use arfuse_ir::{BuildError, LoadError, Problems};

/// Why a file could not be imported. Every variant names what it concerns (a node, a
/// tensor, a JSON position, an archive member) so that the message alone says where
/// to look.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    /// The input (or the program inside an archive) is above the size limit.
    #[error("{what} is {size} bytes, above the limit of {limit} bytes")]
    TooLarge {
        /// What was measured (`"the file"`, `"archive member models/model.json"`).
        what: String,
        /// Its size in bytes (for an archive member: the size read so far).
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The bytes are neither arfuse JSON, torch.export JSON nor a `.pt2` archive.
    #[error("unknown file format: {hint}")]
    UnknownFormat {
        /// What the file looks like instead.
        hint: String,
    },
    /// The arfuse-JSON loader refused the file.
    #[error("{}", arfuse_message(.0))]
    Arfuse(LoadError),
    /// The program JSON is not UTF-8.
    #[error("torch.export JSON is not UTF-8 (invalid byte at offset {offset})")]
    Utf8 {
        /// Offset of the first invalid byte.
        offset: usize,
    },
    /// The program is not valid JSON (a truncated file ends up here).
    #[error("torch.export JSON is malformed at line {line}, column {column}: {message}")]
    Json {
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The parser's message.
        message: String,
    },
    /// A schema version this importer does not read.
    #[error(
        "unsupported torch.export schema version {found}: this importer reads schema major version {supported}"
    )]
    SchemaVersion {
        /// The version the file declares (`"9.0"`, `"<missing>"`).
        found: String,
        /// The major version supported.
        supported: u64,
    },
    /// Valid JSON whose structure is not what the schema says.
    #[error("malformed ExportedProgram at {location}: {message}")]
    Malformed {
        /// A JSON path such as `graph_module.graph.nodes[12] (linear_3)`.
        location: String,
        /// What is wrong.
        message: String,
    },
    /// A node (or a graph input/output) names a tensor that no earlier node produced.
    #[error("{node}: refers to tensor {tensor:?}, which no graph input or earlier node produces")]
    MissingTensor {
        /// The node, graph input or output naming it.
        node: String,
        /// The tensor name.
        tensor: String,
    },
    /// A tensor that the program uses has no entry in `tensor_values`.
    #[error("tensor {tensor:?} (used by {node}) has no metadata in graph.tensor_values")]
    MissingMetadata {
        /// The node that produces or uses it.
        node: String,
        /// The tensor name.
        tensor: String,
    },
    /// A tensor's element type has no arfuse counterpart.
    #[error("tensor {tensor:?} has dtype {dtype}, which arfuse IR cannot represent")]
    UnsupportedDtype {
        /// The tensor name.
        tensor: String,
        /// The schema's name and code of the dtype (`DOUBLE (8)`).
        dtype: String,
    },
    /// A tensor dimension that cannot be imported.
    #[error("tensor {tensor:?}, dimension {dim}: {message}")]
    Dimension {
        /// The tensor name.
        tensor: String,
        /// The dimension index.
        dim: usize,
        /// What is wrong.
        message: String,
    },
    /// A gzip stream that does not decompress, or holds something other than JSON.
    #[error("gzip: {message}")]
    Gzip {
        /// What is wrong.
        message: String,
    },
    /// The `.pt2` zip archive is unreadable or holds no program.
    #[error(".pt2 archive: {message}")]
    Archive {
        /// What is wrong.
        message: String,
    },
    /// A resource limit was exceeded.
    #[error("{what}: more than the limit of {limit}")]
    Limit {
        /// What was counted.
        what: String,
        /// The limit.
        limit: usize,
    },
    /// The IR refused a node while the graph was being built.
    #[error("building the graph: {0}")]
    Build(BuildError),
    /// The imported graph does not validate (an importer bug or a file whose metadata
    /// contradicts itself).
    #[error("the imported graph does not validate: {0}")]
    Invalid(Problems),
}

// The inner errors are part of the message above, so they are not also exposed as
// `source()` (error reporters would print them twice).
impl From<LoadError> for ImportError {
    fn from(e: LoadError) -> Self {
        ImportError::Arfuse(e)
    }
}

impl From<BuildError> for ImportError {
    fn from(e: BuildError) -> Self {
        ImportError::Build(e)
    }
}

impl ImportError {
    pub(crate) fn malformed(location: impl Into<String>, message: impl Into<String>) -> Self {
        ImportError::Malformed {
            location: location.into(),
            message: message.into(),
        }
    }

    pub(crate) fn json(e: serde_json::Error) -> Self {
        let (line, column, message) = json_parts(&e);
        ImportError::Json {
            line,
            column,
            message,
        }
    }
}

/// The message of [`ImportError::Arfuse`]: the loader's, after "arfuse graph JSON: ";
/// a JSON error worded as torch.export's ("... is malformed at line L, column C: ..."),
/// not "arfuse graph JSON: malformed graph JSON ...".
fn arfuse_message(e: &LoadError) -> String {
    match e {
        LoadError::Json {
            line,
            column,
            message,
        } => format!("arfuse graph JSON is malformed at line {line}, column {column}: {message}"),
        other => format!("arfuse graph JSON: {other}"),
    }
}

/// serde_json's error as (line, column, message): its message without the
/// " at line L column C" it appends.
pub(crate) fn json_parts(e: &serde_json::Error) -> (usize, usize, String) {
    let full = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let message = full.strip_suffix(&suffix).unwrap_or(&full).to_string();
    (e.line(), e.column(), message)
}
