//! The canonical text form (for snapshots) and Graphviz DOT export.

use crate::{Graph, Value};
use std::collections::HashMap;
use std::fmt::Write;

/// One node a line, ids renumbered `%0, %1, ...` in the graph's topological order, so
/// that a snapshot diff shows only what changed:
///
/// ```text
/// sym T in 1..=8192
/// %0 = input {"kind":"activation"} : bf16[T,4096]
/// %1 = all_reduce(%0) {"group":"tp","reduce":"sum"} : bf16[T,4096]  # layers.0.mlp
/// return %1
/// ```
///
/// Values other than output 0 are written `%N.k`; a node with several outputs lists
/// their types in parentheses. The original id is not printed.
pub fn canonical_text(g: &Graph) -> String {
    let mut out = String::new();
    for (name, r) in g.symbols() {
        let _ = writeln!(out, "sym {name} in {}..={}", r.min, r.max);
    }
    let mut num: HashMap<u32, usize> = HashMap::with_capacity(g.len());
    for (k, (id, _)) in g.nodes().enumerate() {
        num.insert(id.index() as u32, k);
    }
    let val = |v: &Value| {
        let n = num
            .get(&(v.node.index() as u32))
            .copied()
            .unwrap_or(usize::MAX);
        if v.output == 0 {
            format!("%{n}")
        } else {
            format!("%{n}.{}", v.output)
        }
    };
    for (k, (_, n)) in g.nodes().enumerate() {
        let _ = write!(out, "%{k} = {}", n.op.name());
        if !n.inputs.is_empty() {
            let ins: Vec<String> = n.inputs.iter().map(val).collect();
            let _ = write!(out, "({})", ins.join(", "));
        }
        let attrs = n.op.attrs_json();
        if !attrs.is_empty() {
            let _ = write!(out, " {}", serde_json::Value::Object(attrs));
        }
        let tys: Vec<String> = n.outputs.iter().map(|t| t.to_string()).collect();
        match tys.len() {
            1 => {
                let _ = write!(out, " : {}", tys[0]);
            }
            _ => {
                let _ = write!(out, " : ({})", tys.join(", "));
            }
        }
        if let Some(m) = &n.module {
            let _ = write!(out, "  # {m}");
        }
        out.push('\n');
    }
    let outs: Vec<String> = g.outputs().iter().map(val).collect();
    let _ = writeln!(out, "return {}", outs.join(", "));
    out
}

fn dot_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Graphviz DOT: one box per node (id, op, output types), edges labelled with the
/// output index when it is not 0, graph outputs as a sink node.
pub fn to_dot(g: &Graph) -> String {
    let mut out = String::from("digraph arfuse {\n  node [shape=box, fontname=\"monospace\"];\n");
    for (id, n) in g.nodes() {
        let tys: Vec<String> = n.outputs.iter().map(|t| t.to_string()).collect();
        let style = if n.op.is_collective() {
            ", style=filled, fillcolor=\"#ffe0b0\""
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "  n{} [label=\"{}\\n{}\\n{}\"{style}];",
            id.index(),
            dot_escape(&n.id),
            n.op.name(),
            dot_escape(&tys.join(", "))
        );
    }
    for (id, n) in g.nodes() {
        for v in &n.inputs {
            if v.output == 0 {
                let _ = writeln!(out, "  n{} -> n{};", v.node.index(), id.index());
            } else {
                let _ = writeln!(
                    out,
                    "  n{} -> n{} [label=\"{}\"];",
                    v.node.index(),
                    id.index(),
                    v.output
                );
            }
        }
    }
    if !g.outputs().is_empty() {
        out.push_str("  outputs [shape=doublecircle, label=\"outputs\"];\n");
        for (k, v) in g.outputs().iter().enumerate() {
            let _ = writeln!(out, "  n{} -> outputs [label=\"{k}\"];", v.node.index());
        }
    }
    out.push_str("}\n");
    out
}

impl Graph {
    /// The canonical text form; see [`canonical_text`].
    pub fn canonical_text(&self) -> String {
        canonical_text(self)
    }

    /// Graphviz DOT; see [`to_dot`].
    pub fn to_dot(&self) -> String {
        to_dot(self)
    }
}
