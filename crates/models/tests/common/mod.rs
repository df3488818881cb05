//! Test helpers: loading corpus configs and an independent structural site counter.

#![allow(dead_code)]

use arfuse_ir::{Graph, NodeId, Op, Value};
use std::collections::{BTreeSet, VecDeque};
use std::path::PathBuf;

/// `ir-fixtures/` of the workspace.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../ir-fixtures")
}

/// A config from `ir-fixtures/configs/`.
pub fn config(file: &str) -> serde_json::Value {
    let path = fixtures_dir().join("configs").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// What a structural walk of a graph finds.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Observed {
    pub all_reduces: u32,
    pub sites: u32,
    pub without_residual: u32,
    pub with_quant: u32,
    /// Ids of the all-reduces that are sites.
    pub site_ids: Vec<String>,
}

/// Consumers (node, input index) of output 0 of `n`, seeing through reshapes.
fn users_through_reshapes(g: &Graph, n: NodeId) -> Vec<(NodeId, u32)> {
    let mut out = Vec::new();
    let mut queue = VecDeque::from([n]);
    while let Some(x) = queue.pop_front() {
        for (u, e) in g.users(x) {
            if e.output != 0 {
                continue;
            }
            if matches!(g.node(u).op, Op::Reshape) {
                queue.push_back(u);
            } else {
                out.push((u, e.input));
            }
        }
    }
    out
}

/// True when `n` starts an RMSNorm: `rms_norm` / `fused_add_rms_norm` reading it as
/// input 0, or the decomposition's `to_dtype(f32)` feeding a `pow`.
fn starts_norm(g: &Graph, n: NodeId, input: u32) -> Option<bool /* fused add */> {
    match &g.node(n).op {
        Op::RmsNorm { .. } if input == 0 => Some(false),
        Op::FusedAddRmsNorm { .. } if input == 0 => Some(true),
        Op::ToDtype { dtype } if *dtype == arfuse_ir::DType::F32 => g
            .users(n)
            .any(|(u, _)| matches!(g.node(u).op, Op::Pow { .. }))
            .then_some(false),
        _ => None,
    }
}

fn is_quant(op: &Op) -> bool {
    matches!(
        op,
        Op::QuantFp8PerTokenGroup { .. }
            | Op::QuantNvfp4 { .. }
            | Op::QuantFp8PerToken
            | Op::QuantFp8Static
    )
}

/// Whether the norm starting at `start` feeds a quant op: walks the nodes of the
/// norm's module (the decomposition shares it) and looks for a quant consumer.
fn norm_feeds_quant(g: &Graph, start: NodeId) -> bool {
    let module = g.node(start).module.clone();
    let mut seen = BTreeSet::new();
    let mut queue = VecDeque::from([start]);
    while let Some(x) = queue.pop_front() {
        if !seen.insert(x) {
            continue;
        }
        for (u, _) in g.users(x) {
            let un = g.node(u);
            if is_quant(&un.op) {
                return true;
            }
            if un.module == module && !matches!(un.op, Op::Add) {
                queue.push_back(u);
            }
        }
    }
    false
}

/// Counts all-reduces and fusion sites: an all-reduce whose output (through reshapes)
/// starts a norm, or feeds an `add` whose output starts one.
pub fn observe(g: &Graph) -> Observed {
    let mut o = Observed::default();
    for (id, n) in g.nodes() {
        if !matches!(n.op, Op::AllReduce { .. }) {
            continue;
        }
        o.all_reduces += 1;
        let mut found: Option<(bool, NodeId)> = None;
        for (u, input) in users_through_reshapes(g, id) {
            if let Some(fused) = starts_norm(g, u, input) {
                found = Some((fused, u));
                break;
            }
            if matches!(g.node(u).op, Op::Add) {
                for (w, wi) in users_through_reshapes(g, u) {
                    if starts_norm(g, w, wi).is_some() {
                        found = Some((true, w));
                    }
                }
            }
        }
        if let Some((residual, norm)) = found {
            o.sites += 1;
            o.site_ids.push(n.id.clone());
            if !residual {
                o.without_residual += 1;
            }
            if norm_feeds_quant(g, norm) {
                o.with_quant += 1;
            }
        }
    }
    o
}

/// Nodes whose op name is `name`.
pub fn count_op(g: &Graph, name: &str) -> usize {
    g.nodes().filter(|(_, n)| n.op.name() == name).count()
}

/// The node with string id `id`.
pub fn node<'g>(g: &'g Graph, id: &str) -> &'g arfuse_ir::Node {
    let n = g.find(id).unwrap_or_else(|| panic!("no node {id:?}"));
    g.node(n)
}

/// Ids of the producers of `id`'s inputs.
pub fn input_ids(g: &Graph, id: &str) -> Vec<String> {
    node(g, id)
        .inputs
        .iter()
        .map(|v: &Value| g.value_ref(*v))
        .collect()
}

/// Ids of the consumers of output 0 of `id`, sorted.
pub fn user_ids(g: &Graph, id: &str) -> Vec<String> {
    let n = g.find(id).unwrap();
    let mut v: Vec<String> = g
        .users(n)
        .filter(|(_, e)| e.output == 0)
        .map(|(u, _)| g.node(u).id.clone())
        .collect();
    v.sort();
    v
}

/// Shape of output 0 of `id` as text (`[T,4096]`).
pub fn shape(g: &Graph, id: &str) -> String {
    node(g, id).outputs[0].to_string()
}
