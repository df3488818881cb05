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

/// Most problems with one kind and message (each on another node) stored; the rest
/// are counted ([`Problems::identical_omitted`]) and shown as one line with a count.
pub const MAX_IDENTICAL_LISTED: usize = 5;

/// Every problem found in a graph.
///
/// Problems with the same kind and message (one mistake repeated on many nodes) are
/// shown as one line: the count and the first node ids.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct Problems {
    /// The problems, at most [`MAX_PROBLEMS`], and at most [`MAX_IDENTICAL_LISTED`] of
    /// any one kind and message.
    pub list: Vec<Problem>,
    /// How many more were found but not stored (those in `identical_omitted` included).
    pub omitted: usize,
    /// Of the omitted ones, how many repeat the kind and message of a stored problem,
    /// by (kind, message).
    pub identical_omitted: std::collections::BTreeMap<(ProblemKind, String), usize>,
}

impl Problems {
    pub(crate) fn new() -> Problems {
        Problems {
            list: Vec::new(),
            omitted: 0,
            identical_omitted: Default::default(),
        }
    }

    pub(crate) fn push(&mut self, p: Problem) {
        let same = self
            .list
            .iter()
            .filter(|q| q.kind == p.kind && q.message == p.message)
            .count();
        if self.list.len() < MAX_PROBLEMS && same < MAX_IDENTICAL_LISTED {
            self.list.push(p);
            return;
        }
        self.omitted += 1;
        if same > 0 {
            *self
                .identical_omitted
                .entry((p.kind, p.message))
                .or_insert(0) += 1;
        }
    }

    /// Adds every problem of `other`.
    pub(crate) fn extend(&mut self, other: Problems) {
        for p in other.list {
            self.push(p);
        }
        self.omitted += other.omitted;
        for (k, n) in other.identical_omitted {
            *self.identical_omitted.entry(k).or_insert(0) += n;
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
        // Stored problems grouped by (kind, message), in order of first appearance.
        let mut groups: Vec<(&Problem, Vec<&str>)> = Vec::new();
        for p in &self.list {
            match groups
                .iter_mut()
                .find(|(q, _)| q.kind == p.kind && q.message == p.message)
            {
                Some((_, locs)) => locs.push(&p.location),
                None => groups.push((p, vec![&p.location])),
            }
        }
        let mut grouped_omitted = 0;
        for (p, locs) in groups {
            let more = self
                .identical_omitted
                .get(&(p.kind, p.message.clone()))
                .copied()
                .unwrap_or(0);
            grouped_omitted += more;
            if locs.len() == 1 && more == 0 {
                write!(f, "\n  - {p}")?;
                continue;
            }
            let total = locs.len() + more;
            write!(
                f,
                "\n  - {total} times [{}]: {} (at {}{})",
                p.kind,
                p.message,
                locs.join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            )?;
        }
        let rest = self.omitted.saturating_sub(grouped_omitted);
        if rest > 0 {
            write!(f, "\n  ... and {rest} more")?;
        }
        Ok(())
    }
}

/// Error from [`crate::Graph::from_json_str`] and friends.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
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
