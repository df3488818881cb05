//! arfuse-policy
