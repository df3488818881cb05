//! arfuse-ir
