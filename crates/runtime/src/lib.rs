//! arfuse-runtime
