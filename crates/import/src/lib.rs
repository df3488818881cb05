//! arfuse-import: front ends that turn other tools' graph files into arfuse IR.
