//! arfuse facade
