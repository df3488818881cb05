//! The hostile cases shared by `tests/hostile.rs` (their answers, snapshotted) and
//! `examples/hostile_bounds.rs` (their time and memory bounds): the answer each input
//! gets and the generators of the cases too large to commit. See docs/fuzzing.md.

#![allow(dead_code)]

/// The arfuse API these cases use: the layers (`arfuse::advanced`) and the pass.
mod af {
    pub use arfuse::advanced::{import, ir, policy};
    pub use arfuse::{lower_with, LowerOptions};
}
use arfuse::advanced::policy::Target;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// One MiB in bytes.
pub const MIB: usize = 1 << 20;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn hostile_dir() -> PathBuf {
    root().join("ir-fixtures/hostile")
}

// ---------------------------------------------------------------------------------
// What each input gets.
// ---------------------------------------------------------------------------------

pub const LOWER_PRESET: &str = "h200-sxm-x8";

/// The answer to a graph file: what `import::load_any` says, what the IR loader says,
/// and when a graph loads, what `lower` does with it for [`LOWER_PRESET`].
pub fn graph_answer(bytes: &[u8]) -> String {
    let mut s = String::new();
    match af::import::load_any(bytes) {
        Err(e) => writeln!(s, "import::load_any: error: {e}").unwrap(),
        Ok(imported) => {
            let g = &imported.graph;
            writeln!(s, "import::load_any: loaded {} node(s)", g.len()).unwrap();
            for note in &imported.notes {
                writeln!(s, "  note: {note}").unwrap();
            }
            lower_answer(&mut s, g, &af::LowerOptions::default());
        }
    }
    match af::ir::Graph::from_json_slice(bytes) {
        Err(e) => writeln!(s, "ir::Graph::from_json_slice: error: {e}").unwrap(),
        Ok(g) => writeln!(s, "ir::Graph::from_json_slice: loaded {} node(s)", g.len()).unwrap(),
    }
    s
}

/// The answer to a generated graph: `import::load_any` (which hands arfuse JSON to the
/// IR loader) and, when it loads, `lower`.
pub fn import_answer(bytes: &[u8]) -> String {
    let mut s = String::new();
    match af::import::load_any(bytes) {
        Err(e) => writeln!(s, "import::load_any: error: {e}").unwrap(),
        Ok(imported) => {
            writeln!(
                s,
                "import::load_any: loaded {} node(s)",
                imported.graph.len()
            )
            .unwrap();
            lower_answer(&mut s, &imported.graph, &af::LowerOptions::default());
        }
    }
    s
}

pub fn lower_answer(s: &mut String, g: &af::ir::Graph, options: &af::LowerOptions) {
    let target = Target::preset(LOWER_PRESET).unwrap();
    match af::lower_with(g, &target, options) {
        Err(e) => writeln!(s, "lower({LOWER_PRESET}): error: {e}").unwrap(),
        Ok(l) => writeln!(
            s,
            "lower({LOWER_PRESET}): {} node(s) out, {} of {} all-reduce(s) fused, {} e-node(s), {} iteration(s)",
            l.graph.len(),
            l.report.all_reduces_fused,
            l.report.all_reduces_seen,
            l.report.runner.egraph_nodes,
            l.report.runner.iterations
        )
        .unwrap(),
    }
}

/// The answer to a target TOML file: the parse/validation error, or the plan for
/// H = 4096 (its token ranges), or the planner's error.
pub fn target_answer(bytes: &[u8]) -> String {
    let text = match std::str::from_utf8(bytes) {
        Ok(t) => t,
        Err(e) => return format!("not UTF-8: {e}\n"),
    };
    let target = match Target::from_toml_str(text) {
        Err(e) => return format!("Target::from_toml_str: error: {e}\n"),
        Ok(t) => t,
    };
    let mut s = String::from("Target::from_toml_str: ok\n");
    match af::policy::plan(&target, &[4096]) {
        Err(e) => writeln!(s, "plan(H=4096): error: {e}").unwrap(),
        Ok(p) => {
            writeln!(
                s,
                "plan(H=4096): backend {:?}, max_token_num {}, max_planned_tokens {}",
                p.backend(),
                p.max_token_num,
                p.max_planned_tokens
            )
            .unwrap();
            for site in &p.sites {
                for r in &site.ranges {
                    writeln!(
                        s,
                        "  H={} T={}..={} {:?} needs {} of {} bytes",
                        site.hidden,
                        r.lo,
                        r.hi,
                        r.strategy,
                        r.required_bytes_max,
                        r.available_bytes
                    )
                    .unwrap();
                }
            }
            if let Some(ws) = &p.workspace {
                let v = af::policy::verify(&p, ws);
                writeln!(s, "verify: {} violation(s)", v.len()).unwrap();
            }
        }
    }
    s
}

pub fn answer_file(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap();
    if path.extension().is_some_and(|e| e == "toml") {
        target_answer(&bytes)
    } else {
        graph_answer(&bytes)
    }
}

pub fn files_in(dir: &Path, exts: &[&str]) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .filter(|p| {
            p.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| exts.contains(&e))
        })
        .collect();
    v.sort();
    v
}

// ---------------------------------------------------------------------------------
// Generated cases: too large to commit, or built through the API.
// ---------------------------------------------------------------------------------

pub const HDR: &str = "{\"format\": \"arfuse-graph\", \"version\": 1, \"symbols\": {\"T\": {\"min\": 1, \"max\": 8192}}, \"nodes\": [\n";

pub fn node_line(id: &str, op: &str, attrs: &str, inputs: &[&str], h: u64) -> String {
    let inputs: Vec<String> = inputs.iter().map(|i| format!("\"{i}\"")).collect();
    format!(
        "{{\"id\": \"{id}\", \"op\": \"{op}\", \"attrs\": {attrs}, \"inputs\": [{}], \"outputs\": [{{\"dtype\": \"bf16\", \"shape\": [\"T\", {h}]}}]}}",
        inputs.join(", ")
    )
}

/// A chain of `n` nodes: an input, then `n - 1` rsqrt nodes each reading the last.
pub fn chain(n: usize) -> Vec<u8> {
    let mut s = String::with_capacity(n * 100);
    s.push_str(HDR);
    s.push_str(&node_line("n0", "input", "{}", &[], 64));
    for i in 1..n {
        s.push_str(",\n");
        s.push_str(&node_line(
            &format!("n{i}"),
            "rsqrt",
            "{}",
            &[&format!("n{}", i - 1)],
            64,
        ));
    }
    write!(s, "\n], \"outputs\": [\"n{}\"]}}\n", n - 1).unwrap();
    s.into_bytes()
}

/// A ring of `n` adds: node i reads node i-1 and node 0 reads node n-1.
pub fn ring(n: usize) -> Vec<u8> {
    let mut s = String::from(HDR);
    for i in 0..n {
        if i > 0 {
            s.push_str(",\n");
        }
        let prev = format!("n{}", (i + n - 1) % n);
        s.push_str(&node_line(&format!("n{i}"), "rsqrt", "{}", &[&prev], 64));
    }
    s.push_str("\n], \"outputs\": [\"n0\"]}\n");
    s.into_bytes()
}

/// One layer (all-reduce, fused add + RMSNorm) whose values `read` (of `ar`, `n`,
/// `n:1`) have `users` extra readers each.
pub fn fan_out(users: usize, read: &[&str]) -> Vec<u8> {
    let mut lines = vec![
        node_line("x", "input", "{}", &[], 4096),
        node_line("res", "input", "{}", &[], 4096),
        "{\"id\": \"w\", \"op\": \"input\", \"attrs\": {\"kind\": \"parameter\"}, \"outputs\": [{\"dtype\": \"bf16\", \"shape\": [4096]}]}".to_string(),
        node_line("ar", "all_reduce", "{\"group\": \"tp\"}", &["x"], 4096),
        "{\"id\": \"n\", \"op\": \"fused_add_rms_norm\", \"attrs\": {\"eps\": 1e-6}, \"inputs\": [\"ar\", \"res\", \"w\"], \"outputs\": [{\"dtype\": \"bf16\", \"shape\": [\"T\", 4096]}, {\"dtype\": \"bf16\", \"shape\": [\"T\", 4096]}]}".to_string(),
    ];
    for i in 0..users {
        for (k, src) in read.iter().enumerate() {
            lines.push(node_line(
                &format!("u{k}_{i}"),
                "opaque",
                "{\"target\": \"aten.clone\"}",
                &[src],
                4096,
            ));
        }
    }
    let mut s = String::from(HDR);
    s.push_str(&lines.join(",\n"));
    s.push_str("\n], \"outputs\": [\"n\", \"n:1\"]}\n");
    s.into_bytes()
}

/// `layers` fusable decoder layers sharing one residual stream, every all-reduce
/// reading the same input `x` (many sites of one pattern on one value).
pub fn wide_sites(layers: usize) -> Vec<u8> {
    let mut lines = vec![
        node_line("x", "input", "{}", &[], 4096),
        node_line("res", "input", "{}", &[], 4096),
        "{\"id\": \"w\", \"op\": \"input\", \"attrs\": {\"kind\": \"parameter\"}, \"outputs\": [{\"dtype\": \"bf16\", \"shape\": [4096]}]}".to_string(),
    ];
    let mut res = "res".to_string();
    for i in 0..layers {
        lines.push(node_line(
            &format!("ar{i}"),
            "all_reduce",
            "{\"group\": \"tp\"}",
            &["x"],
            4096,
        ));
        lines.push(format!(
            "{{\"id\": \"n{i}\", \"op\": \"fused_add_rms_norm\", \"attrs\": {{\"eps\": 1e-6}}, \"inputs\": [\"ar{i}\", \"{res}\", \"w\"], \"outputs\": [{{\"dtype\": \"bf16\", \"shape\": [\"T\", 4096]}}, {{\"dtype\": \"bf16\", \"shape\": [\"T\", 4096]}}]}}"
        ));
        res = format!("n{i}:1");
    }
    let mut s = String::from(HDR);
    s.push_str(&lines.join(",\n"));
    write!(s, "\n], \"outputs\": [\"{res}\", \"n{}\"]}}\n", layers - 1).unwrap();
    s.into_bytes()
}

/// An all-reduce, then `n` reshapes alternating `[T, 4096]` and `[T, 64, 64]`, then
/// add + RMSNorm on the last `[T, 4096]` view: the view rules must see through the
/// chain without the e-graph growing with its square.
pub fn view_chain(n: usize) -> Vec<u8> {
    let mut s = String::from(HDR);
    s.push_str(&node_line("x", "input", "{}", &[], 4096));
    s.push_str(",\n");
    s.push_str(&node_line("res", "input", "{}", &[], 4096));
    s.push_str(",\n{\"id\": \"w\", \"op\": \"input\", \"attrs\": {\"kind\": \"parameter\"}, \"outputs\": [{\"dtype\": \"bf16\", \"shape\": [4096]}]}");
    s.push_str(",\n");
    s.push_str(&node_line(
        "v0",
        "all_reduce",
        "{\"group\": \"tp\"}",
        &["x"],
        4096,
    ));
    for i in 1..=n {
        let shape = if i % 2 == 1 {
            "[\"T\", 64, 64]"
        } else {
            "[\"T\", 4096]"
        };
        write!(
            s,
            ",\n{{\"id\": \"v{i}\", \"op\": \"reshape\", \"inputs\": [\"v{}\"], \"outputs\": [{{\"dtype\": \"bf16\", \"shape\": {shape}}}]}}",
            i - 1
        )
        .unwrap();
    }
    let last = format!("v{}", n - n % 2);
    s.push_str(",\n");
    s.push_str(&node_line("h", "add", "{}", &[&last, "res"], 4096));
    s.push_str(",\n");
    s.push_str(&node_line(
        "n",
        "rms_norm",
        "{\"eps\": 1e-6}",
        &["h", "w"],
        4096,
    ));
    s.push_str("\n], \"outputs\": [\"n\", \"h\"]}\n");
    s.into_bytes()
}

/// A node with `n` outputs (an opaque op), read by an all-reduce -> RMSNorm chain.
pub fn many_outputs(n: usize) -> Vec<u8> {
    let outs: Vec<&str> = (0..n)
        .map(|_| "{\"dtype\": \"bf16\", \"shape\": [\"T\", 4096]}")
        .collect();
    let mut s = String::from(HDR);
    s.push_str(&node_line("x", "input", "{}", &[], 4096));
    write!(
        s,
        ",\n{{\"id\": \"split\", \"op\": \"opaque\", \"attrs\": {{\"target\": \"aten.split\"}}, \"inputs\": [\"x\"], \"outputs\": [{}]}}",
        outs.join(", ")
    )
    .unwrap();
    s.push_str(",\n{\"id\": \"w\", \"op\": \"input\", \"attrs\": {\"kind\": \"parameter\"}, \"outputs\": [{\"dtype\": \"bf16\", \"shape\": [4096]}]}");
    let last = format!("split:{}", n - 1);
    s.push_str(",\n");
    s.push_str(&node_line(
        "ar",
        "all_reduce",
        "{\"group\": \"tp\"}",
        &[&last],
        4096,
    ));
    s.push_str(",\n");
    s.push_str(&node_line(
        "n",
        "rms_norm",
        "{\"eps\": 1e-6}",
        &["ar", "w"],
        4096,
    ));
    s.push_str("\n], \"outputs\": [\"n\", \"split\"]}\n");
    s.into_bytes()
}

/// `n` nodes each naming a missing input: far more problems than one error lists.
pub fn many_problems(n: usize) -> Vec<u8> {
    let mut s = String::from(HDR);
    for i in 0..n {
        if i > 0 {
            s.push_str(",\n");
        }
        s.push_str(&node_line(&format!("n{i}"), "rsqrt", "{}", &["ghost"], 64));
    }
    s.push_str("\n]}\n");
    s.into_bytes()
}

pub fn deep_metadata(depth: usize) -> Vec<u8> {
    let mut s = String::from(HDR);
    s.push_str(&node_line("x", "input", "{}", &[], 64));
    s.push_str("\n], \"outputs\": [\"x\"], \"metadata\": ");
    s.push_str(&"[".repeat(depth));
    s.push_str(&"]".repeat(depth));
    s.push_str("}\n");
    s.into_bytes()
}

/// A `.pt2`-style zip archive holding `archive/models/model.json` compressed with
/// deflate: a space, then `pairs` back-references of 258 bytes (about 258 * pairs
/// bytes of spaces from 13 bits each). `declared` is the uncompressed size the headers
/// claim.
pub fn zip_bomb(pairs: usize, declared: u32) -> Vec<u8> {
    // Deflate, one fixed-Huffman block; bits are packed from the least significant.
    struct Bits {
        out: Vec<u8>,
        acc: u64,
        n: u32,
    }
    impl Bits {
        fn put(&mut self, v: u64, n: u32) {
            self.acc |= v << self.n;
            self.n += n;
            while self.n >= 8 {
                self.out.push(self.acc as u8);
                self.acc >>= 8;
                self.n -= 8;
            }
        }
        /// A Huffman code, most significant bit first.
        fn code(&mut self, code: u64, n: u32) {
            let mut rev = 0;
            for i in 0..n {
                rev |= ((code >> i) & 1) << (n - 1 - i);
            }
            self.put(rev, n);
        }
    }
    let mut b = Bits {
        out: Vec::new(),
        acc: 0,
        n: 0,
    };
    b.put(1, 1); // BFINAL
    b.put(1, 2); // BTYPE = fixed Huffman
    b.code(0x30 + u64::from(b' '), 8); // literal ' '
    for _ in 0..pairs {
        b.code(0b1100_0101, 8); // length code 285: 258 bytes
        b.code(0, 5); // distance code 0: distance 1
    }
    b.code(0, 7); // end of block (256)
    b.put(0, 7); // flush
    let data = b.out;
    let name = b"archive/models/model.json";
    let mut z = Vec::new();
    let le16 = |z: &mut Vec<u8>, v: u16| z.extend_from_slice(&v.to_le_bytes());
    let le32 = |z: &mut Vec<u8>, v: u32| z.extend_from_slice(&v.to_le_bytes());
    le32(&mut z, 0x0403_4b50);
    for v in [20u16, 0, 8, 0, 0] {
        le16(&mut z, v);
    }
    le32(&mut z, 0); // crc32 (never reached: the reader stops at the size limit)
    le32(&mut z, data.len() as u32);
    le32(&mut z, declared);
    le16(&mut z, name.len() as u16);
    le16(&mut z, 0);
    z.extend_from_slice(name);
    z.extend_from_slice(&data);
    let cd = z.len() as u32;
    le32(&mut z, 0x0201_4b50);
    for v in [20u16, 20, 0, 8, 0, 0] {
        le16(&mut z, v);
    }
    le32(&mut z, 0);
    le32(&mut z, data.len() as u32);
    le32(&mut z, declared);
    for v in [name.len() as u16, 0, 0, 0, 0] {
        le16(&mut z, v);
    }
    le32(&mut z, 0);
    le32(&mut z, 0); // local header offset
    z.extend_from_slice(name);
    let cd_len = z.len() as u32 - cd;
    le32(&mut z, 0x0605_4b50);
    for v in [0u16, 0, 1, 1] {
        le16(&mut z, v);
    }
    le32(&mut z, cd_len);
    le32(&mut z, cd);
    le16(&mut z, 0);
    z
}

/// One generated case: a name, the input (built outside any measurement), the answer
/// function, and the bounds `examples/hostile_bounds.rs` holds it to.
pub struct Generated {
    /// The snapshot name (`generated_<name>`).
    pub name: &'static str,
    /// Builds the input bytes.
    pub input: Box<dyn Fn() -> Vec<u8>>,
    /// What the pass says about the input.
    pub answer: fn(&[u8]) -> String,
    /// Peak allocation bound in bytes (the input itself excluded).
    pub memory: usize,
    /// Parses or inflates hundreds of MB: gets four times the time bound.
    pub slow: bool,
}

pub fn generated_cases() -> Vec<Generated> {
    fn g(name: &'static str, memory: usize, input: impl Fn() -> Vec<u8> + 'static) -> Generated {
        Generated {
            name,
            input: Box::new(input),
            answer: import_answer,
            memory,
            slow: matches!(name, "chain_1m_nodes" | "pt2_zip_bomb_lying"),
        }
    }
    vec![
        // 1,000,000 nodes (about 90 MB): refused at node 500,001 while parsing.
        g("chain_1m_nodes", 512 * MIB, || chain(1_000_000)),
        g("deep_nesting_1m_levels", 16 * MIB, || {
            deep_metadata(1_000_000)
        }),
        g("torch_export_deep_nesting_1m_levels", 16 * MIB, || {
            let seed = std::fs::read_to_string(
                root().join("fuzz/corpus-seed/fuzz_bytes/torch_export_allreduce_norm.json"),
            )
            .unwrap();
            let deep = format!("{}{}", "[".repeat(1_000_000), "]".repeat(1_000_000));
            seed.replacen("\"metadata\": {}", &format!("\"metadata\": {deep}"), 1)
                .into_bytes()
        }),
        g("cycle_ring_100k_nodes", 256 * MIB, || ring(100_000)),
        g("problems_10k", 64 * MIB, || many_problems(10_000)),
        // Fan-out: 5,000 extra readers of each of one layer's values; lowered (the
        // all-reduce output is live, so the site is refused)...
        g("fan_out_5000_users_each", 256 * MIB, || {
            fan_out(5_000, &["ar", "n", "n:1"])
        }),
        // ...and of the outputs the fused node writes (fused).
        g("fan_out_5000_users_of_norm_outputs", 256 * MIB, || {
            fan_out(5_000, &["n", "n:1"])
        }),
        // 2,000 all-reduces of one value, each with its own norm; lowered.
        g("wide_2000_sites_one_value", 256 * MIB, || wide_sites(2_000)),
        // 10,000 alternating views between the all-reduce and the norm.
        g("view_chain_10k", 256 * MIB, || view_chain(10_000)),
        g("outputs_1000_on_one_node", 64 * MIB, || many_outputs(1_000)),
        g("outputs_1025_on_one_node", 64 * MIB, || many_outputs(1_025)),
        g("file_above_max_input_bytes", 16 * MIB, || {
            vec![0u8; af::ir::MAX_INPUT_BYTES + 1]
        }),
        // A 1.9 MB zip that inflates to about 300 MB, its size declared honestly...
        g("pt2_zip_bomb_declared", 16 * MIB, || {
            zip_bomb(1_200_000, 309_600_001)
        }),
        // ...and declared as 1 KB: the reader stops one byte past the limit.
        g("pt2_zip_bomb_lying", 600 * MIB, || {
            zip_bomb(1_200_000, 1_000)
        }),
    ]
}

/// A graph at the node limit: (MAX_NODES - 2) / 3 = 166,666 fusable layers
/// (all-reduce, fused add + RMSNorm, an opaque attention) sharing one weight, 500,000
/// nodes in all. Returns the graph and its layer count.
pub fn largest_graph() -> (af::ir::Graph, usize) {
    use af::ir::{Dim, Graph, InputKind, Node, Op, TensorType, Value};
    let act = || {
        TensorType::new(
            af::ir::DType::Bf16,
            vec![Dim::symbol("T"), Dim::constant(4096)],
        )
    };
    let mut g = Graph::new();
    g.set_symbol("T", af::ir::SymbolRange { min: 1, max: 8192 });
    let mut add = |id: String, op: Op, inputs: Vec<Value>, outputs: Vec<TensorType>| {
        g.add_node(Node {
            id,
            op,
            inputs,
            outputs,
            module: None,
        })
        .unwrap()
    };
    let input = |kind| Op::Input { kind };
    let x = add(
        "x".into(),
        input(InputKind::Activation),
        vec![],
        vec![act()],
    );
    let w = add(
        "w".into(),
        input(InputKind::Parameter),
        vec![],
        vec![TensorType::new(
            af::ir::DType::Bf16,
            vec![Dim::constant(4096)],
        )],
    );
    let (mut prev, mut res) = (Value::new(x, 0), Value::new(x, 0));
    let layers = (af::ir::MAX_NODES - 2) / 3;
    for i in 0..layers {
        let ar = add(
            format!("ar{i}"),
            Op::AllReduce {
                group: "tp".into(),
                reduce: Default::default(),
            },
            vec![prev],
            vec![act()],
        );
        let n = add(
            format!("n{i}"),
            Op::FusedAddRmsNorm {
                eps: 1e-6,
                weight_bias: 0.0,
                norm_rounding: Default::default(),
                norm_input: Default::default(),
            },
            vec![Value::new(ar, 0), res, Value::new(w, 0)],
            vec![act(), act()],
        );
        let a = add(
            format!("attn{i}"),
            Op::Opaque {
                target: "attention".into(),
                attrs: serde_json::Value::Null,
            },
            vec![Value::new(n, 0)],
            vec![act()],
        );
        prev = Value::new(a, 0);
        res = Value::new(n, 1);
    }
    g.set_outputs(vec![prev, res]).unwrap();
    (g, layers)
}
