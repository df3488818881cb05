//! The JSON graph format, version 1 (documented in `docs/graph-format.md`).

use crate::error::{LoadError, Problem, ProblemKind, Problems};
use crate::graph::{check_node_id, Graph, Node, NodeId, Value};
use crate::id_index::IdIndex;
use crate::{Op, SymbolRange, TensorType};
use raw::{Arena, Attr, Header, RawGraph, RawNode, Str};
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

mod raw;

/// The `format` tag every graph file carries.
pub const FORMAT_TAG: &str = "arfuse-graph";
/// The format version this build reads and writes.
pub const FORMAT_VERSION: u64 = 1;
/// Largest graph file accepted, in bytes (256 MiB; a 100,000-node graph is about 20 MiB).
pub const MAX_INPUT_BYTES: usize = 256 * 1024 * 1024;

/// The ops of a graph's nodes by their name and attributes: a model repeats the same
/// few ops (every all-reduce of a layer group, every norm with one eps) thousands of
/// times, and parsing one ([`Op::from_name_attrs_owned`]) costs far more than looking
/// it up. The result, error included, is a function of the name and the attribute
/// object, so a repeat gets what parsing it again would give. Memory: one entry per
/// distinct (name, attributes), each about as large as their text in the input
/// (numbers and lengths take 9 bytes each).
#[derive(Default)]
struct OpMemo {
    /// Key: the op name and the attributes, in their order in the file, encoded by
    /// [`raw::encode_op`].
    seen: HashMap<Vec<u8>, Result<Op, String>>,
    key: Vec<u8>,
}

impl OpMemo {
    /// The op named `name` with attributes `attrs`, or why not.
    fn op(&mut self, name: &str, attrs: &[(Str<'_>, Attr<'_>)]) -> Result<Op, String> {
        self.key.clear();
        raw::encode_op(name, attrs, &mut self.key);
        if let Some(found) = self.seen.get(self.key.as_slice()) {
            return found.clone();
        }
        let map = attrs
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), v.to_json()))
            .collect();
        let op = Op::from_name_attrs_owned(name, map);
        self.seen.insert(self.key.clone(), op.clone());
        op
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
    /// Loads and validates a graph from JSON bytes. A leading UTF-8 byte order mark is
    /// skipped (RFC 8259 lets a parser ignore it; editors on Windows write one); the
    /// line and column of an error then count from after it.
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

    /// Loads and validates a graph from JSON text, a leading byte order mark
    /// (`U+FEFF`) skipped. See [`Graph::from_json_slice`].
    pub fn from_json_str(text: &str) -> Result<Graph, LoadError> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
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

/// Checks the parsed document and builds the graph: every problem found, each with its
/// node id (or its place in the file), or the graph.
fn build(raw: RawGraph<'_>) -> Result<Graph, Problems> {
    let mut problems = Problems::new();
    let mut g = Graph::new();
    add_symbols(&mut g, raw.symbols.0, &mut problems);
    g.set_metadata(raw.metadata);
    let arena = raw.nodes.arena;
    let mut nodes = raw.nodes.nodes;
    let index = index_ids(&nodes, &mut problems);
    let preds = resolve_inputs(&nodes, &arena, &index, &mut problems);
    if problems.count() > 0 {
        return Err(problems);
    }
    let order = match topological_order(&nodes, &preds) {
        Ok(order) => order,
        Err(cycle) => {
            problems.push(cycle);
            return Err(problems);
        }
    };
    let mut ids = index.index;
    let Some(node_of) = add_nodes(&mut g, &mut nodes, &arena, &preds, &order, &mut problems) else {
        return Err(problems);
    };
    // Every node was added, each id checked unique: rename positions to node indices.
    ids.rename(|p| node_of.get(p.index()).copied().unwrap_or(p));
    g.set_id_index(ids);
    set_outputs(&mut g, &raw.outputs, &mut problems);
    if let Err(more) = crate::validate::validate(&g) {
        problems.extend(more);
    }
    problems.into_result().map(|()| g)
}

/// Declares every well-formed symbol; a problem for each other one.
fn add_symbols(g: &mut Graph, symbols: Vec<(String, serde_json::Value)>, problems: &mut Problems) {
    for (name, value) in symbols {
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
}

/// The nodes' positions in the file by id (positions as node indices: those the
/// nodes get in the graph once renamed by [`add_nodes`]'s answer).
struct FileIds<'n, 'a> {
    nodes: &'n [RawNode<'a>],
    index: IdIndex,
}

impl FileIds<'_, '_> {
    /// The position of the node whose id is `id`.
    fn get(&self, id: &str) -> Option<usize> {
        let nodes = self.nodes;
        let id_of = |p: NodeId| nodes.get(p.index()).map(|n| n.id.as_str());
        let found = self.index.find(self.index.hash(id), id, id_of);
        found.map(|p| p.index())
    }
}

/// The position in the file of every node id; a problem for each bad or repeated id.
fn index_ids<'n, 'a>(nodes: &'n [RawNode<'a>], problems: &mut Problems) -> FileIds<'n, 'a> {
    let mut index = IdIndex::with_capacity(nodes.len());
    let id_of = |p: NodeId| nodes.get(p.index()).map(|n| n.id.as_str());
    for (i, n) in nodes.iter().enumerate() {
        let id = n.id.as_str();
        if let Err(m) = check_node_id(id) {
            problems.push(Problem::new(format!("nodes[{i}]"), ProblemKind::BadId, m));
            continue;
        }
        // As a map insert: a repeated id keeps the later position.
        if !index.insert_or_replace(index.hash(id), id, NodeId::new(i), id_of) {
            problems.push(Problem::new(
                id,
                ProblemKind::DuplicateId,
                format!("id {id:?} is used by more than one node"),
            ));
        }
    }
    FileIds { nodes, index }
}

/// The producers of every node's inputs, by position in the file: node `i` reads
/// `values[starts[i]..starts[i + 1]]` (one allocation for the whole graph).
struct Preds {
    starts: Vec<usize>,
    values: Vec<(usize, u32)>,
}

impl Preds {
    /// The (producer, output index) pairs node `i` reads.
    fn of(&self, i: usize) -> &[(usize, u32)] {
        match (self.starts.get(i), self.starts.get(i + 1)) {
            (Some(&a), Some(&b)) => self.values.get(a..b).unwrap_or(&[]),
            _ => &[],
        }
    }
}

/// Resolves every input reference; a problem for each that names no existing output.
fn resolve_inputs(
    nodes: &[RawNode<'_>],
    arena: &Arena<'_>,
    index: &FileIds<'_, '_>,
    problems: &mut Problems,
) -> Preds {
    let total = arena.inputs.len();
    let mut preds = Preds {
        starts: Vec::with_capacity(nodes.len() + 1),
        values: Vec::with_capacity(total),
    };
    preds.starts.push(0);
    for n in nodes {
        let id = n.id.as_str();
        for (k, r) in arena.inputs(n).iter().enumerate() {
            match parse_ref(r.as_str()) {
                Err(m) => problems.push(Problem::new(
                    id,
                    ProblemKind::MissingInput,
                    format!("input {k}: {m}"),
                )),
                Ok((src_id, out)) => match index.get(src_id) {
                    None => problems.push(Problem::new(
                        id,
                        ProblemKind::MissingInput,
                        format!("input {k} refers to node {src_id:?}, which does not exist"),
                    )),
                    Some(src) => {
                        let count = nodes[src].outputs.len();
                        if out as usize >= count {
                            problems.push(Problem::new(
                                id,
                                ProblemKind::MissingInput,
                                format!(
                                    "input {k} refers to output {out} of {src_id:?}, which has {count} output(s)"
                                ),
                            ));
                        } else {
                            preds.values.push((src, out));
                        }
                    }
                },
            }
        }
        preds.starts.push(preds.values.len());
    }
    preds
}

/// The nodes' positions in topological order (Kahn), keeping file order among ready
/// nodes; or the cycle problem naming the nodes on or behind a cycle.
fn topological_order(nodes: &[RawNode<'_>], preds: &Preds) -> Result<Vec<usize>, Problem> {
    let count = nodes.len();
    let mut indeg: Vec<usize> = (0..count).map(|i| preds.of(i).len()).collect();
    // Successors, grouped by producer: those of `p` are `succs[first[p]..first[p + 1]]`.
    let mut first = vec![0usize; count + 1];
    for &(src, _) in &preds.values {
        first[src + 1] += 1;
    }
    for i in 0..count {
        first[i + 1] += first[i];
    }
    let mut next = first.clone();
    let mut succs = vec![0usize; preds.values.len()];
    for i in 0..count {
        for &(src, _) in preds.of(i) {
            succs[next[src]] = i;
            next[src] += 1;
        }
    }
    let mut ready: BinaryHeap<Reverse<usize>> =
        (0..count).filter(|&i| indeg[i] == 0).map(Reverse).collect();
    let mut order = Vec::with_capacity(count);
    while let Some(Reverse(i)) = ready.pop() {
        order.push(i);
        for &s in &succs[first[i]..first[i + 1]] {
            indeg[s] -= 1;
            if indeg[s] == 0 {
                ready.push(Reverse(s));
            }
        }
    }
    if order.len() == count {
        return Ok(order);
    }
    let stuck: Vec<&str> = (0..count)
        .filter(|&i| indeg[i] > 0)
        .map(|i| nodes[i].id.as_str())
        .collect();
    let shown: Vec<&str> = stuck.iter().take(10).copied().collect();
    Err(Problem::new(
        stuck.first().copied().unwrap_or("<graph>"),
        ProblemKind::Cycle,
        format!(
            "{} node(s) are on or behind a cycle (a node that reads itself counts): {:?}{}",
            stuck.len(),
            shown,
            if stuck.len() > 10 { " ..." } else { "" }
        ),
    ))
}

/// Adds the nodes in `order` (topological), each op parsed once per distinct name and
/// attributes (ids not indexed: the caller has checked them and indexes them). The
/// node index of every position in the file, or `None` when the graph refused a node
/// (a limit: nothing more is checked).
fn add_nodes(
    g: &mut Graph,
    nodes: &mut [RawNode<'_>],
    arena: &Arena<'_>,
    preds: &Preds,
    order: &[usize],
    problems: &mut Problems,
) -> Option<Vec<NodeId>> {
    g.reserve(nodes.len(), preds.values.len());
    // Set for each node before any node reads it (topological order).
    let mut node_of: Vec<NodeId> = vec![NodeId::end(); nodes.len()];
    let mut ops = OpMemo::default();
    for &i in order {
        let n = &mut nodes[i];
        let op = match ops.op(n.op.as_str(), arena.attrs(n)) {
            Ok(op) => op,
            Err(m) => {
                problems.push(Problem::new(n.id.as_str(), ProblemKind::Attribute, m));
                // Keep going with an opaque stand-in so later nodes are still checked.
                Op::Opaque {
                    target: n.op.as_str().to_owned(),
                    attrs: serde_json::Value::Null,
                }
            }
        };
        let inputs = preds
            .of(i)
            .iter()
            .map(|&(src, out)| Value::new(node_of[src], out))
            .collect();
        let node = Node {
            id: std::mem::take(&mut n.id.0).into_owned(),
            op,
            inputs,
            outputs: std::mem::take(&mut n.outputs),
            module: n.module.take(),
        };
        match g.add_node_unindexed(node) {
            Ok(id) => node_of[i] = id,
            Err(e) => {
                problems.push(Problem::new(e.id, e.kind, e.message));
                return None;
            }
        }
    }
    Some(node_of)
}

/// Sets the graph outputs; a problem for each reference to no existing output.
fn set_outputs(g: &mut Graph, refs: &[Str<'_>], problems: &mut Problems) {
    let mut outputs = Vec::with_capacity(refs.len());
    for (k, r) in refs.iter().enumerate() {
        let r = r.as_str();
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
}

#[cfg(test)]
mod tests {
    use super::parse_ref;
    use crate::{DType, Dim, Graph, LoadError, Node, Op, ProblemKind, TensorType};

    const T: &str = r#"{"T": {"min": 1, "max": 8192}}"#;

    fn doc(nodes: &str) -> String {
        format!(
            r#"{{"format": "arfuse-graph", "version": 1, "symbols": {T}, "nodes": [{nodes}],
                "outputs": []}}"#
        )
    }

    /// The message of a JSON error, which must be one.
    fn json_message(text: &str) -> String {
        match Graph::from_json_str(text) {
            Err(LoadError::Json { message, .. }) => message,
            other => panic!("expected a JSON error, got {other:?}"),
        }
    }

    const X: &str =
        r#"{"id": "x", "op": "input", "outputs": [{"dtype": "bf16", "shape": ["T", 8]}]}"#;

    #[test]
    fn a_loaded_graph_finds_every_node_and_refuses_its_ids_again() {
        // Written out of topological order: node indices differ from file positions.
        let ar = |id: &str, from: &str| {
            format!(
                r#"{{"id": "{id}", "op": "all_reduce", "attrs": {{"group": "tp"}},
                    "inputs": ["{from}"], "outputs": [{{"dtype": "bf16", "shape": ["T", 8]}}]}}"#
            )
        };
        let text = doc(&format!(
            "{}, {}, {X}, {}",
            ar("c", "b"),
            ar("b", "a"),
            ar("a", "x")
        ));
        let mut g = Graph::from_json_str(&text).expect("valid");
        for (i, n) in g.nodes() {
            assert_eq!(g.find(&n.id), Some(i), "{}", n.id);
        }
        assert_eq!(g.find("nope"), None);
        let input = |id: &str| Node {
            id: id.into(),
            op: Op::Input {
                kind: Default::default(),
            },
            inputs: vec![],
            outputs: vec![TensorType::new(DType::Bf16, vec![Dim::symbol("T")])],
            module: None,
        };
        let again = g.add_node(input("b")).expect_err("b is taken");
        assert_eq!(again.kind, ProblemKind::DuplicateId);
        // Enough new nodes to grow the table: every id still found.
        for k in 0..1000 {
            g.add_node(input(&format!("new{k}"))).expect("fresh id");
        }
        for (i, n) in g.nodes() {
            assert_eq!(g.find(&n.id), Some(i), "{}", n.id);
        }
    }

    #[test]
    fn node_fields_are_refused_as_serde_derive_words_it() {
        let cases = [
            (
                r#"{"id": "x", "opp": "input"}"#,
                "unknown field `opp`, expected one of `id`, `op`, `attrs`, `inputs`, `outputs`, `module`",
            ),
            (r#"{"id": "x", "id": "y", "op": "input"}"#, "duplicate field `id`"),
            (r#"{"op": "input"}"#, "missing field `id`"),
            (r#"{"id": "x"}"#, "missing field `op`"),
            (r#"["x"]"#, "invalid length 1, expected struct RawNode with 6 elements"),
            (r#""x""#, "invalid type: string \"x\", expected struct RawNode"),
            (
                r#"{"id": "x", "op": "input", "inputs": {"a": 1}}"#,
                "invalid type: map, expected a sequence",
            ),
            (
                r#"{"id": "x", "op": "input", "attrs": null}"#,
                "invalid type: null, expected an object",
            ),
        ];
        for (node, want) in cases {
            assert_eq!(json_message(&doc(node)), want, "{node}");
        }
    }

    #[test]
    fn a_node_may_be_an_array_of_its_fields() {
        let node = r#"["x", "input", {}, [], [{"dtype": "bf16", "shape": ["T", 8]}], "m.x"]"#;
        let g = Graph::from_json_str(&doc(node)).expect("valid");
        let x = g.find("x").expect("x");
        assert_eq!(g.node(x).module.as_deref(), Some("m.x"));
    }

    #[test]
    fn repeated_attribute_keys_are_refused_in_small_and_large_objects() {
        for keys in [2usize, 40] {
            let mut attrs: Vec<String> = (0..keys).map(|k| format!(r#""k{k}": {k}"#)).collect();
            attrs.push(r#""k1": 0"#.into());
            let node = format!(
                r#"{X}, {{"id": "a", "op": "opaque", "attrs": {{{}}}, "inputs": ["x"], "outputs": []}}"#,
                attrs.join(", ")
            );
            assert_eq!(
                json_message(&doc(&node)),
                "duplicate key \"k1\"",
                "{keys} keys"
            );
        }
    }

    #[test]
    fn escaped_strings_are_read_as_their_text() {
        let node = r#"{"id": "\u0078", "op": "in\u0070ut", "outputs": [{"dtype": "bf16", "shape": ["T", 8]}]}"#;
        let g = Graph::from_json_str(&doc(node)).expect("valid");
        assert!(g.find("x").is_some());
    }

    #[test]
    fn value_refs() {
        assert_eq!(parse_ref("a"), Ok(("a", 0)));
        assert_eq!(parse_ref("a:3"), Ok(("a", 3)));
        assert!(parse_ref("a:x").is_err());
    }
}
