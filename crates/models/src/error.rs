//! Errors of the graph builder. Every error names the config field or build option at
//! fault; the builder never panics on a bad config.

/// Why a graph could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// A field the architecture needs is absent (or `null`).
    #[error("config field `{field}` is missing")]
    MissingField {
        /// The config.json key, dotted for nested keys.
        field: String,
    },
    /// A field is present but has the wrong type or an impossible value.
    #[error("config field `{field}` is invalid: {reason}")]
    BadField {
        /// The config.json key, dotted for nested keys.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The config asks for something this builder does not model.
    #[error("config field `{field}` = {value}: not supported ({reason})")]
    Unsupported {
        /// The config.json key.
        field: String,
        /// Its value, as JSON text.
        value: String,
        /// Why, and what is supported.
        reason: String,
    },
    /// A size cannot be split across the tensor-parallel ranks.
    #[error("config field `{field}` = {value} cannot be split over tp = {tp}: {reason}")]
    NotDivisible {
        /// The config.json key.
        field: String,
        /// Its value.
        value: u64,
        /// The tensor-parallel size.
        tp: u32,
        /// What would have to divide what.
        reason: String,
    },
    /// A build option is out of range.
    #[error("build option `{option}` is invalid: {reason}")]
    BadOption {
        /// The option (a field of [`crate::BuildOptions`]).
        option: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// Adding a node failed (a builder bug: ids are generated).
    #[error("internal graph construction error: {0}")]
    Graph(#[from] arfuse_ir::BuildError),
    /// The built graph does not validate (a builder bug).
    #[error("the built graph does not validate: {0}")]
    Invalid(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, BuildError>;

impl BuildError {
    pub(crate) fn missing(field: impl Into<String>) -> BuildError {
        BuildError::MissingField {
            field: field.into(),
        }
    }

    pub(crate) fn bad(field: impl Into<String>, reason: impl Into<String>) -> BuildError {
        BuildError::BadField {
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn unsupported(
        field: impl Into<String>,
        value: &serde_json::Value,
        reason: impl Into<String>,
    ) -> BuildError {
        BuildError::Unsupported {
            field: field.into(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}
