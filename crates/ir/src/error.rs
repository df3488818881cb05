//! Errors of loading and validation.

use std::fmt;

/// The class of a validation problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProblemKind {
    /// An id that is empty, too long, or contains `:`/whitespace.
    BadId,
    /// Two nodes share an id.
    DuplicateId,
    /// An input (or graph output) names a missing node or output index.
    MissingInput,
    /// The nodes form a cycle (a self-loop included).
    Cycle,
    /// Wrong number of inputs or outputs for the op.
    Arity,
    /// Element type mismatch.
    DType,
    /// Shape mismatch.
    Shape,
    /// An invalid attribute value or an unknown/missing attribute.
    Attribute,
    /// A symbol that is undeclared or has an empty range.
    Symbol,
    /// A byte count that overflows u64.
    Overflow,
    /// A resource limit ([`crate::MAX_NODES`], ...) exceeded.
    Limit,
}

impl fmt::Display for ProblemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            ProblemKind::BadId => "bad id",
            ProblemKind::DuplicateId => "duplicate id",
            ProblemKind::MissingInput => "missing input",
            ProblemKind::Cycle => "cycle",
            ProblemKind::Arity => "arity",
            ProblemKind::DType => "dtype",
            ProblemKind::Shape => "shape",
            ProblemKind::Attribute => "attribute",
            ProblemKind::Symbol => "symbol",
            ProblemKind::Overflow => "overflow",
            ProblemKind::Limit => "limit",
        };
        f.write_str(s)
    }
}

/// One validation problem, naming the node (or the graph-level field) it concerns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The node id, or a graph-level location such as `symbols.T` or `outputs[2]`.
    pub location: String,
    /// The class.
    pub kind: ProblemKind,
    /// What is wrong, and where possible what to do.
    pub message: String,
}

impl Problem {
    pub(crate) fn new(
        location: impl Into<String>,
        kind: ProblemKind,
        message: impl Into<String>,
    ) -> Problem {
        Problem {
            location: location.into(),
            kind,
            message: message.into(),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [{}]: {}", self.location, self.kind, self.message)
    }
}

/// Most problems kept in one report (later ones are counted, not stored).
pub const MAX_PROBLEMS: usize = 100;

/// Every problem found in a graph.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct Problems {
    /// The problems, at most [`MAX_PROBLEMS`].
    pub list: Vec<Problem>,
    /// How many more were found but not stored.
    pub omitted: usize,
}

impl Problems {
    pub(crate) fn new() -> Problems {
        Problems {
            list: Vec::new(),
            omitted: 0,
        }
    }

    pub(crate) fn push(&mut self, p: Problem) {
        if self.list.len() < MAX_PROBLEMS {
            self.list.push(p);
        } else {
            self.omitted += 1;
        }
    }

    /// Total count, stored and omitted.
    pub fn count(&self) -> usize {
        self.list.len() + self.omitted
    }

    pub(crate) fn into_result(self) -> Result<(), Problems> {
        if self.count() == 0 {
            Ok(())
        } else {
            Err(self)
        }
    }
}

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} problem(s) in the graph:", self.count())?;
        for p in &self.list {
            write!(f, "\n  - {p}")?;
        }
        if self.omitted > 0 {
            write!(f, "\n  ... and {} more", self.omitted)?;
        }
        Ok(())
    }
}

/// Error from [`crate::Graph::from_json_str`] and friends.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// The bytes are not UTF-8.
    #[error("the file is not UTF-8 (invalid byte at offset {offset})")]
    Utf8 {
        /// Offset of the first invalid byte.
        offset: usize,
    },
    /// The input exceeds [`crate::MAX_INPUT_BYTES`].
    #[error("the file is {size} bytes, above the limit of {limit} bytes")]
    TooLarge {
        /// Input size in bytes.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// Not valid JSON, or JSON of the wrong structure.
    #[error("malformed graph JSON at line {line}, column {column}: {message}")]
    Json {
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// serde_json's message.
        message: String,
    },
    /// The `format` tag is not `arfuse-graph`.
    #[error("unknown format {found:?}: expected \"arfuse-graph\"")]
    Format {
        /// What the file says.
        found: String,
    },
    /// A version this build does not read.
    #[error("unsupported graph format version {found}: this build reads version 1")]
    Version {
        /// What the file says.
        found: u64,
    },
    /// The JSON parsed but the graph is invalid.
    #[error("{0}")]
    Invalid(Problems),
}
