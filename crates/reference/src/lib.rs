//! arfuse-reference
