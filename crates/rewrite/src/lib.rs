//! arfuse-rewrite
