//! The JSON graph format, version 1 (documented in `docs/graph-format.md`).

use crate::error::{LoadError, Problem, ProblemKind, Problems};
use crate::graph::{check_node_id, Graph, Node, NodeId, Value, MAX_NODES};
use crate::{Op, SymbolRange, TensorType};
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fmt;
use std::marker::PhantomData;

/// The `format` tag every graph file carries.
pub const FORMAT_TAG: &str = "arfuse-graph";
/// The format version this build reads and writes.
pub const FORMAT_VERSION: u64 = 1;
/// Largest graph file accepted, in bytes (256 MiB; a 100,000-node graph is about 20 MiB).
pub const MAX_INPUT_BYTES: usize = 256 * 1024 * 1024;

#[derive(Deserialize)]
struct Header {
    format: Option<serde_json::Value>,
    version: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGraph {
    /// Checked by [`check_header`] (as for [`Header`]).
    format: Option<serde_json::Value>,
    /// Checked by [`check_header`] (as for [`Header`]).
    version: Option<serde_json::Value>,
    /// Checked field by field in [`symbol_range`], so that an error names the field.
    #[serde(default)]
    symbols: UniqueMap<serde_json::Value>,
    nodes: BoundedNodes,
    #[serde(default)]
    outputs: Vec<String>,
    #[serde(default)]
    metadata: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    id: String,
    op: String,
    #[serde(default)]
    attrs: UniqueMap<serde_json::Value>,
    #[serde(default)]
    inputs: Vec<String>,
    #[serde(default)]
    outputs: Vec<TensorType>,
    #[serde(default)]
    module: Option<String>,
}

/// A JSON object whose keys must be unique (serde_json keeps the last duplicate silently).
struct UniqueMap<V>(Vec<(String, V)>);

impl<V> Default for UniqueMap<V> {
    fn default() -> Self {
        UniqueMap(Vec::new())
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for UniqueMap<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Vis<V>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for Vis<V> {
            type Value = UniqueMap<V>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<UniqueMap<V>, A::Error> {
                let mut out: Vec<(String, V)> = Vec::new();
                let mut seen = std::collections::HashSet::new();
                while let Some(k) = m.next_key::<String>()? {
                    if !seen.insert(k.clone()) {
                        return Err(de::Error::custom(format!("duplicate key {k:?}")));
                    }
                    if out.len() >= crate::MAX_PORTS {
                        return Err(de::Error::custom(format!(
                            "more than {} keys in one object",
                            crate::MAX_PORTS
                        )));
                    }
                    out.push((k, m.next_value()?));
                }
                Ok(UniqueMap(out))
            }
        }
        d.deserialize_map(Vis(PhantomData))
    }
}

/// The ops of a graph's nodes by their name and attributes: a model repeats the same
/// few ops (every all-reduce of a layer group, every norm with one eps) thousands of
/// times, and parsing one ([`Op::from_name_attrs_owned`]) costs far more than looking
/// it up. The result, error included, is a function of the name and the attribute
/// object, so a repeat gets what parsing it again would give. Memory: one entry per
/// distinct (name, attributes), each no larger than its text in the input.
#[derive(Default)]
struct OpMemo {
    /// Key: the op name, a 0 byte, the attributes as JSON (in their order in the file).
    seen: HashMap<Vec<u8>, Result<Op, String>>,
    key: Vec<u8>,
}

impl OpMemo {
    /// The op named `name` with attributes `attrs`, or why not.
    fn op(&mut self, name: &str, attrs: Vec<(String, serde_json::Value)>) -> Result<Op, String> {
        self.key.clear();
        self.key.extend_from_slice(name.as_bytes());
        self.key.push(0);
        if serde_json::to_writer(&mut self.key, &attrs).is_err() {
            // Not reachable for parsed JSON values; parse without the memo.
            return Op::from_name_attrs_owned(name, attrs.into_iter().collect());
        }
        if let Some(found) = self.seen.get(self.key.as_slice()) {
            return found.clone();
        }
        let op = Op::from_name_attrs_owned(name, attrs.into_iter().collect());
        self.seen.insert(self.key.clone(), op.clone());
        op
    }
}

/// The node list, refused as soon as it exceeds [`MAX_NODES`] (bounded time and memory).
struct BoundedNodes(Vec<RawNode>);

impl<'de> Deserialize<'de> for BoundedNodes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Vis;
        impl<'de> Visitor<'de> for Vis {
            type Value = BoundedNodes;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of nodes")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<BoundedNodes, A::Error> {
                let mut out = Vec::new();
                while let Some(n) = s.next_element::<RawNode>()? {
                    if out.len() >= MAX_NODES {
                        return Err(de::Error::custom(format!(
                            "the graph has more than {MAX_NODES} nodes (the limit)"
                        )));
                    }
                    out.push(n);
                }
                Ok(BoundedNodes(out))
            }
        }
        d.deserialize_seq(Vis)
    }
}

fn json_error(e: serde_json::Error) -> LoadError {
    let full = e.to_string();
    // serde_json appends " at line L column C"; the error already carries both.
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let message = full.strip_suffix(&suffix).unwrap_or(&full).to_string();
    LoadError::Json {
        line: e.line(),
        column: e.column(),
        message,
    }
}

/// Splits `id` or `id:N` into the id and output index.
fn parse_ref(s: &str) -> Result<(&str, u32), String> {
    match s.rsplit_once(':') {
        None => Ok((s, 0)),
        Some((id, n)) => n
            .parse::<u32>()
            .map(|n| (id, n))
            .map_err(|_| format!("bad value reference {s:?}: expected \"id\" or \"id:N\"")),
    }
}

/// The `format` and `version` fields: [`LoadError::Format`] for another format (or
/// none), [`LoadError::Version`] for another version, [`LoadError::Json`] when the
/// version is missing or not a non-negative integer.
fn check_header(
    format: Option<serde_json::Value>,
    version: Option<serde_json::Value>,
) -> Result<(), LoadError> {
    match format {
        Some(serde_json::Value::String(s)) if s == FORMAT_TAG => {}
        Some(other) => {
            return Err(LoadError::Format {
                found: match other {
                    serde_json::Value::String(s) => s,
                    v => v.to_string(),
                },
            })
        }
        None => {
            return Err(LoadError::Format {
                found: "<missing>".into(),
            })
        }
    }
    match version.as_ref().and_then(|v| v.as_u64()) {
        Some(FORMAT_VERSION) => Ok(()),
        Some(v) => Err(LoadError::Version { found: v }),
        None => Err(LoadError::Json {
            line: 1,
            column: 1,
            message: "field \"version\" is missing or not a non-negative integer".into(),
        }),
    }
}

impl Graph {
    /// Loads and validates a graph from JSON bytes.
    ///
    /// Errors: [`LoadError::TooLarge`] above [`MAX_INPUT_BYTES`], [`LoadError::Utf8`],
    /// [`LoadError::Json`] with line and column, [`LoadError::Format`] /
    /// [`LoadError::Version`] for other formats, and [`LoadError::Invalid`] listing every
    /// structural and type problem with its node id. Never a partial graph.
    pub fn from_json_slice(bytes: &[u8]) -> Result<Graph, LoadError> {
        if bytes.len() > MAX_INPUT_BYTES {
            return Err(LoadError::TooLarge {
                size: bytes.len(),
                limit: MAX_INPUT_BYTES,
            });
        }
        let text = std::str::from_utf8(bytes).map_err(|e| LoadError::Utf8 {
            offset: e.valid_up_to(),
        })?;
        Graph::from_json_str(text)
    }

    /// Loads and validates a graph from JSON text. See [`Graph::from_json_slice`].
    pub fn from_json_str(text: &str) -> Result<Graph, LoadError> {
        if text.len() > MAX_INPUT_BYTES {
            return Err(LoadError::TooLarge {
                size: text.len(),
                limit: MAX_INPUT_BYTES,
            });
        }
        // One parse of the whole document. The header's errors come first: when the
        // document does not parse as a graph, the header alone is parsed to say so.
        let mut raw: RawGraph = match serde_json::from_str(text) {
            Ok(raw) => raw,
            Err(e) => {
                let header: Header = serde_json::from_str(text).map_err(json_error)?;
                check_header(header.format, header.version)?;
                return Err(json_error(e));
            }
        };
        check_header(raw.format.take(), raw.version.take())?;
        build(raw).map_err(LoadError::Invalid)
    }

    /// Writes the graph as format-version-1 JSON: one node per line, nodes in
    /// topological order, every attribute written (defaults included).
    pub fn to_json_string(&self) -> String {
        #[derive(Serialize)]
        struct OutNode<'a> {
            id: &'a str,
            op: &'static str,
            #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
            attrs: serde_json::Map<String, serde_json::Value>,
            #[serde(skip_serializing_if = "Vec::is_empty")]
            inputs: Vec<String>,
            outputs: &'a [TensorType],
            #[serde(skip_serializing_if = "Option::is_none")]
            module: Option<&'a str>,
        }
        let to_string = |v: &dyn erased::Ser| v.json();
        let mut out = String::new();
        out.push_str("{\n");
        out.push_str(&format!("  \"format\": \"{FORMAT_TAG}\",\n"));
        out.push_str(&format!("  \"version\": {FORMAT_VERSION},\n"));
        out.push_str(&format!("  \"symbols\": {},\n", to_string(self.symbols())));
        out.push_str("  \"nodes\": [");
        let mut first = true;
        for (_, n) in self.nodes() {
            let node = OutNode {
                id: &n.id,
                op: n.op.name(),
                attrs: n.op.attrs_json(),
                inputs: n.inputs.iter().map(|v| self.value_ref(*v)).collect(),
                outputs: &n.outputs,
                module: n.module.as_deref(),
            };
            out.push_str(if first { "\n    " } else { ",\n    " });
            first = false;
            out.push_str(&to_string(&node));
        }
        out.push_str(if first { "],\n" } else { "\n  ],\n" });
        let outputs: Vec<String> = self.outputs().iter().map(|v| self.value_ref(*v)).collect();
        out.push_str(&format!("  \"outputs\": {}", to_string(&outputs)));
        if let Some(m) = self.metadata() {
            out.push_str(&format!(",\n  \"metadata\": {}", to_string(m)));
        }
        out.push_str("\n}\n");
        out
    }
}

mod erased {
    /// Compact JSON of anything serializable (our own types never fail to serialize).
    pub trait Ser {
        fn json(&self) -> String;
    }
    impl<T: serde::Serialize> Ser for T {
        fn json(&self) -> String {
            serde_json::to_string(self).unwrap_or_else(|e| format!("\"<unserializable: {e}>\""))
        }
    }
}

/// A symbol's `{"min": A, "max": B}`, every error naming the field (`max: 1e30 is not
/// a whole number ...`).
fn symbol_range(v: &serde_json::Value) -> Result<SymbolRange, String> {
    let Some(obj) = v.as_object() else {
        return Err(format!(
            "expected an object {{\"min\": N, \"max\": N}}, got {v}"
        ));
    };
    if let Some(k) = obj.keys().find(|k| *k != "min" && *k != "max") {
        return Err(format!(
            "unknown field {k:?}; a symbol has \"min\" and \"max\""
        ));
    }
    let field = |f: &str| -> Result<u64, String> {
        match obj.get(f) {
            None => Err(format!("field {f:?} is missing")),
            Some(x) => x.as_u64().ok_or_else(|| {
                format!(
                    "field {f:?} is {x}, not a non-negative 64-bit integer (symbol bounds \
                     are integers from 0 to {})",
                    crate::MAX_SYMBOL_VALUE
                )
            }),
        }
    };
    Ok(SymbolRange {
        min: field("min")?,
        max: field("max")?,
    })
}

fn build(raw: RawGraph) -> Result<Graph, Problems> {
    let mut problems = Problems::new();
    let mut g = Graph::new();
    for (name, value) in raw.symbols.0 {
        let loc = format!("symbols.{name}");
        let range = match symbol_range(&value) {
            Ok(r) => r,
            Err(m) => {
                problems.push(Problem::new(loc, ProblemKind::Symbol, m));
                continue;
            }
        };
        if !crate::shape::is_symbol_name(&name) {
            problems.push(Problem::new(
                loc,
                ProblemKind::Symbol,
                "symbol names are [A-Za-z_][A-Za-z0-9_]* (at most 64 bytes)",
            ));
        } else if range.min > range.max {
            problems.push(Problem::new(
                loc,
                ProblemKind::Symbol,
                format!("empty range: min {} > max {}", range.min, range.max),
            ));
        } else {
            g.set_symbol(name, range);
        }
    }
    g.set_metadata(raw.metadata);

    // Ids.
    let nodes = raw.nodes.0;
    let mut index: HashMap<&str, usize> = HashMap::with_capacity(nodes.len());
    for (i, n) in nodes.iter().enumerate() {
        if let Err(m) = check_node_id(&n.id) {
            problems.push(Problem::new(format!("nodes[{i}]"), ProblemKind::BadId, m));
            continue;
        }
        if index.insert(n.id.as_str(), i).is_some() {
            problems.push(Problem::new(
                &n.id,
                ProblemKind::DuplicateId,
                format!("id {:?} is used by more than one node", n.id),
            ));
        }
    }
    // References.
    let mut preds: Vec<Vec<(usize, u32)>> = Vec::with_capacity(nodes.len());
    for n in &nodes {
        let mut p = Vec::with_capacity(n.inputs.len());
        for (k, r) in n.inputs.iter().enumerate() {
            match parse_ref(r) {
                Err(m) => problems.push(Problem::new(
                    &n.id,
                    ProblemKind::MissingInput,
                    format!("input {k}: {m}"),
                )),
                Ok((id, out)) => match index.get(id) {
                    None => problems.push(Problem::new(
                        &n.id,
                        ProblemKind::MissingInput,
                        format!("input {k} refers to node {id:?}, which does not exist"),
                    )),
                    Some(&src) => {
                        let count = nodes[src].outputs.len();
                        if out as usize >= count {
                            problems.push(Problem::new(
                                &n.id,
                                ProblemKind::MissingInput,
                                format!(
                                    "input {k} refers to output {out} of {id:?}, which has {count} output(s)"
                                ),
                            ));
                        } else {
                            p.push((src, out));
                        }
                    }
                },
            }
        }
        preds.push(p);
    }
    if problems.count() > 0 {
        return Err(problems);
    }

    // Topological order (Kahn), keeping file order among ready nodes.
    let mut indeg = vec![0usize; nodes.len()];
    let mut succs: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    for (i, p) in preds.iter().enumerate() {
        indeg[i] = p.len();
        for &(src, _) in p {
            succs[src].push(i);
        }
    }
    let mut ready: BinaryHeap<Reverse<usize>> = (0..nodes.len())
        .filter(|&i| indeg[i] == 0)
        .map(Reverse)
        .collect();
    let mut order = Vec::with_capacity(nodes.len());
    while let Some(Reverse(i)) = ready.pop() {
        order.push(i);
        for &s in &succs[i] {
            indeg[s] -= 1;
            if indeg[s] == 0 {
                ready.push(Reverse(s));
            }
        }
    }
    if order.len() < nodes.len() {
        let stuck: Vec<&str> = (0..nodes.len())
            .filter(|&i| indeg[i] > 0)
            .map(|i| nodes[i].id.as_str())
            .collect();
        let shown: Vec<&str> = stuck.iter().take(10).copied().collect();
        problems.push(Problem::new(
            stuck[0],
            ProblemKind::Cycle,
            format!(
                "{} node(s) are on or behind a cycle (a node that reads itself counts): {:?}{}",
                stuck.len(),
                shown,
                if stuck.len() > 10 { " ..." } else { "" }
            ),
        ));
        return Err(problems);
    }

    // Build in topological order.
    let mut ids: Vec<Option<NodeId>> = vec![None; nodes.len()];
    let mut nodes: Vec<Option<RawNode>> = nodes.into_iter().map(Some).collect();
    let mut ops = OpMemo::default();
    for &i in &order {
        let Some(n) = nodes[i].take() else { continue };
        let op = match ops.op(&n.op, n.attrs.0) {
            Ok(op) => op,
            Err(m) => {
                problems.push(Problem::new(&n.id, ProblemKind::Attribute, m));
                // Keep going with an opaque stand-in so later nodes are still checked.
                Op::Opaque {
                    target: n.op.clone(),
                    attrs: serde_json::Value::Null,
                }
            }
        };
        let inputs = preds[i]
            .iter()
            .map(|&(src, out)| Value::new(ids[src].expect("topological order"), out))
            .collect();
        let node = Node {
            id: n.id,
            op,
            inputs,
            outputs: n.outputs,
            module: n.module,
        };
        match g.add_node(node) {
            Ok(id) => ids[i] = Some(id),
            Err(e) => {
                problems.push(Problem::new(e.id, e.kind, e.message));
                return Err(problems);
            }
        }
    }
    let mut outputs = Vec::with_capacity(raw.outputs.len());
    for (k, r) in raw.outputs.iter().enumerate() {
        let loc = format!("outputs[{k}]");
        match parse_ref(r) {
            Err(m) => problems.push(Problem::new(loc, ProblemKind::MissingInput, m)),
            Ok((id, out)) => match g.find(id) {
                Some(nid) if (out as usize) < g.node(nid).outputs.len() => {
                    outputs.push(Value::new(nid, out))
                }
                Some(_) => problems.push(Problem::new(
                    loc,
                    ProblemKind::MissingInput,
                    format!("graph output {r:?} names an output index that does not exist"),
                )),
                None => problems.push(Problem::new(
                    loc,
                    ProblemKind::MissingInput,
                    format!("graph output {r:?} names a node that does not exist"),
                )),
            },
        }
    }
    if g.set_outputs(outputs).is_err() {
        // Every value was checked above; unreachable in practice, kept as a problem.
        problems.push(Problem::new(
            "outputs",
            ProblemKind::MissingInput,
            "invalid graph outputs",
        ));
    }
    if let Err(more) = crate::validate::validate(&g) {
        problems.extend(more);
    }
    problems.into_result().map(|()| g)
}

#[cfg(test)]
mod tests {
    use super::parse_ref;

    #[test]
    fn value_refs() {
        assert_eq!(parse_ref("a"), Ok(("a", 0)));
        assert_eq!(parse_ref("a:3"), Ok(("a", 3)));
        assert!(parse_ref("a:x").is_err());
    }
}
