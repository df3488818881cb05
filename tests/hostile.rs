//! Hostile inputs (issue 7): every file of `ir-fixtures/hostile/` and every generated
//! case below gets its snapshotted answer (an error, or what the pass did) in bounded
//! time and memory; and a bounded smoke of the two fuzz targets (their bodies, shared
//! with `fuzz/` through `#[path]`) on the seed corpus, the crash regressions and
//! deterministic mutations. See docs/fuzzing.md.
//!
//! Memory is measured per case with a counting global allocator: the peak of the bytes
//! the measuring thread holds (allocated minus freed) while the case runs.

use arfuse as af;
use arfuse::policy::Target;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[allow(dead_code)]
#[path = "../fuzz/src/targets.rs"]
mod targets;

// ---------------------------------------------------------------------------------
// Per-thread allocation accounting.
// ---------------------------------------------------------------------------------

struct Counting;

thread_local! {
    static HELD: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn account(delta: isize) {
    let _ = HELD.try_with(|h| {
        let now = h.get() + delta;
        h.set(now);
        let _ = PEAK.try_with(|p| {
            if now > p.get() {
                p.set(now);
            }
        });
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; the accounting
// only touches const-initialised thread-locals, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            account(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            account(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        account(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            account(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f`, returning its result, the wall time and the peak bytes this thread held
/// above what it held before.
fn measure<T>(f: impl FnOnce() -> T) -> (T, Duration, usize) {
    let base = HELD.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let start = Instant::now();
    let out = f();
    let took = start.elapsed();
    let peak = PEAK.with(Cell::get) - base;
    (out, took, peak.max(0) as usize)
}

const MIB: usize = 1 << 20;

/// Time every hostile case must answer in. The issue asks for under a second; tests
/// run unoptimised on a shared 2-core CI machine, so the bound is loose (the release
/// timings are in docs/fuzzing.md).
const TIME_BOUND: Duration = Duration::from_secs(5);
/// Peak memory bound of a small-file case.
const SMALL_MEMORY_BOUND: usize = 64 * MIB;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn hostile_dir() -> PathBuf {
    root().join("ir-fixtures/hostile")
}

// ---------------------------------------------------------------------------------
// What each input gets.
// ---------------------------------------------------------------------------------

const LOWER_PRESET: &str = "h200-sxm-x8";

/// The answer to a graph file: what `import::load_any` says, what the IR loader says,
/// and when a graph loads, what `lower` does with it for [`LOWER_PRESET`].
fn graph_answer(bytes: &[u8]) -> String {
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
fn import_answer(bytes: &[u8]) -> String {
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

fn lower_answer(s: &mut String, g: &af::ir::Graph, options: &af::LowerOptions) {
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
fn target_answer(bytes: &[u8]) -> String {
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

fn answer_file(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap();
    if path.extension().is_some_and(|e| e == "toml") {
        target_answer(&bytes)
    } else {
        graph_answer(&bytes)
    }
}

struct Row {
    name: String,
    took: Duration,
    peak: usize,
}

fn report(rows: &[Row]) {
    eprintln!("{:<48} {:>10} {:>12}", "case", "ms", "peak MiB");
    for r in rows {
        eprintln!(
            "{:<48} {:>10.1} {:>12.2}",
            r.name,
            r.took.as_secs_f64() * 1e3,
            r.peak as f64 / MIB as f64
        );
    }
}

fn files_in(dir: &Path, exts: &[&str]) -> Vec<PathBuf> {
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
// The committed hostile files.
// ---------------------------------------------------------------------------------

#[test]
fn hostile_files_give_their_snapshotted_answer_quickly() {
    let files = files_in(&hostile_dir(), &["json", "toml"]);
    assert!(files.len() >= 60, "{} hostile files", files.len());
    let mut rows = Vec::new();
    for path in &files {
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let (answer, took, peak) = measure(|| answer_file(path));
        insta::assert_snapshot!(format!("file_{name}"), answer);
        assert!(took < TIME_BOUND, "{name}: {took:?}");
        assert!(peak < SMALL_MEMORY_BOUND, "{name}: peak {peak} bytes");
        rows.push(Row { name, took, peak });
    }
    report(&rows);
}

/// The error classes the issue lists, each pinned to its message (beyond the
/// snapshots, so that a snapshot update cannot silently turn an error into a load).
#[test]
fn hostile_files_are_refused_for_the_right_reason() {
    let expect: &[(&str, &str)] = &[
        ("cycle_three_nodes.json", "[cycle]"),
        ("self_loop_all_reduce.json", "[cycle]"),
        ("dim_u64_max.json", "[overflow]"),
        ("byte_count_overflow_symbols.json", "[overflow]"),
        // A symbol bound above MAX_SYMBOL_VALUE: refused once, at the symbol (not again
        // for each of the two tensors it shapes).
        (
            "symbol_max_above_limit.json",
            "1 problem(s) in the graph:\n  - symbols.T [limit]: max 2147483648 is above the limit",
        ),
        ("byte_count_overflow_dtype.json", "[overflow]"),
        (
            "nvfp4_hidden_not_multiple_of_block.json",
            "not a multiple of the NVFP4 block (16)",
        ),
        ("eps_nan_literal.json", "malformed graph JSON"),
        ("eps_nan_string.json", "[attribute]"),
        ("eps_nan_fused_node.json", "[attribute]"),
        (
            "symbol_range_min_above_max.json",
            "empty range: min 8192 > max 1",
        ),
        ("non_utf8_in_id.json", "not UTF-8"),
        ("duplicate_key_top_level.json", "duplicate field `nodes`"),
        ("duplicate_key_attrs.json", "duplicate key \"group\""),
        ("duplicate_key_symbols.json", "duplicate key \"T\""),
        ("all_reduce_no_group.json", "needs attribute `group`"),
        ("deep_nesting_metadata.json", "recursion limit exceeded"),
        ("target_world_size_zero.toml", "world_size"),
    ];
    for (file, needle) in expect {
        let answer = answer_file(&hostile_dir().join(file));
        assert!(
            answer.contains(needle) && answer.contains("error"),
            "{file}: expected an error containing {needle:?}, got:\n{answer}"
        );
        assert!(!answer.contains("lower("), "{file} was lowered:\n{answer}");
    }
}

// ---------------------------------------------------------------------------------
// Generated cases: too large to commit, or built through the API.
// ---------------------------------------------------------------------------------

const HDR: &str = "{\"format\": \"arfuse-graph\", \"version\": 1, \"symbols\": {\"T\": {\"min\": 1, \"max\": 8192}}, \"nodes\": [\n";

fn node_line(id: &str, op: &str, attrs: &str, inputs: &[&str], h: u64) -> String {
    let inputs: Vec<String> = inputs.iter().map(|i| format!("\"{i}\"")).collect();
    format!(
        "{{\"id\": \"{id}\", \"op\": \"{op}\", \"attrs\": {attrs}, \"inputs\": [{}], \"outputs\": [{{\"dtype\": \"bf16\", \"shape\": [\"T\", {h}]}}]}}",
        inputs.join(", ")
    )
}

/// A chain of `n` nodes: an input, then `n - 1` rsqrt nodes each reading the last.
fn chain(n: usize) -> Vec<u8> {
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
fn ring(n: usize) -> Vec<u8> {
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
fn fan_out(users: usize, read: &[&str]) -> Vec<u8> {
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
fn wide_sites(layers: usize) -> Vec<u8> {
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
fn view_chain(n: usize) -> Vec<u8> {
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
fn many_outputs(n: usize) -> Vec<u8> {
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
fn many_problems(n: usize) -> Vec<u8> {
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

fn deep_metadata(depth: usize) -> Vec<u8> {
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
fn zip_bomb(pairs: usize, declared: u32) -> Vec<u8> {
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

/// One generated case: a name, the input built outside the measurement, the answer
/// function, and its time and memory bounds.
struct Generated {
    name: &'static str,
    input: Box<dyn Fn() -> Vec<u8>>,
    answer: fn(&[u8]) -> String,
    memory: usize,
}

fn generated_cases() -> Vec<Generated> {
    fn g(name: &'static str, memory: usize, input: impl Fn() -> Vec<u8> + 'static) -> Generated {
        Generated {
            name,
            input: Box::new(input),
            answer: import_answer,
            memory,
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

#[test]
fn generated_hostile_cases_give_their_snapshotted_answer_in_bounded_time_and_memory() {
    let mut rows = Vec::new();
    for case in generated_cases() {
        let input = (case.input)();
        let (answer, took, peak) = measure(|| (case.answer)(&input));
        drop(input);
        insta::assert_snapshot!(format!("generated_{}", case.name), answer);
        let bound = if case.name == "pt2_zip_bomb_lying" || case.name == "chain_1m_nodes" {
            // Inflating / parsing 256 MiB or 90 MB unoptimised takes a few seconds.
            TIME_BOUND * 4
        } else {
            TIME_BOUND
        };
        assert!(took < bound, "{}: {took:?}", case.name);
        assert!(peak < case.memory, "{}: peak {} MiB", case.name, peak / MIB);
        rows.push(Row {
            name: case.name.to_string(),
            took,
            peak,
        });
    }
    report(&rows);
}

/// The e-graph limit: a runner that exceeds LowerOptions' node or iteration limit is
/// an error naming the limit, never a partial graph.
#[test]
fn egraph_limits_give_a_clear_error() {
    let g = af::ir::Graph::from_json_slice(&wide_sites(8)).unwrap();
    let mut s = String::new();
    for (what, options) in [
        (
            "node_limit = 10",
            af::LowerOptions {
                node_limit: 10,
                ..Default::default()
            },
        ),
        (
            "iter_limit = 1",
            af::LowerOptions {
                iter_limit: 1,
                ..Default::default()
            },
        ),
        ("defaults", af::LowerOptions::default()),
    ] {
        writeln!(s, "{what}:").unwrap();
        let ((), took, _) = measure(|| lower_answer(&mut s, &g, &options));
        assert!(took < TIME_BOUND);
    }
    insta::assert_snapshot!("egraph_limits", s);
    assert!(s.contains("did not saturate: e-node limit 10 "), "{s}");
    assert!(s.contains("did not saturate: iteration limit 1 "), "{s}");
    assert!(s.contains("8 of 8 all-reduce(s) fused"), "{s}");
    assert_eq!(
        af::rewrite::DEFAULT_NODE_LIMIT,
        20 * af::ir::MAX_NODES,
        "docs/fuzzing.md states the default e-node limit"
    );
}

/// Values the JSON format cannot express, built through the IR API: the validator
/// refuses them and the pass refuses the graph.
#[test]
fn api_built_hostile_values_are_refused() {
    use af::ir::{Dim, Graph, InputKind, Node, Op, SymbolRange, TensorType, Value};
    let t = || {
        TensorType::new(
            af::ir::DType::Bf16,
            vec![Dim::symbol("T"), Dim::constant(64)],
        )
    };
    let mut answers = String::new();
    for (name, eps, range) in [
        ("eps NaN", f64::NAN, SymbolRange { min: 1, max: 8 }),
        ("eps +inf", f64::INFINITY, SymbolRange { min: 1, max: 8 }),
        ("eps -0.0", -0.0, SymbolRange { min: 1, max: 8 }),
        ("symbol min > max", 1e-6, SymbolRange { min: 9, max: 8 }),
    ] {
        let mut g = Graph::new();
        g.set_symbol("T", range);
        let x = g
            .add_node(Node {
                id: "x".into(),
                op: Op::Input {
                    kind: InputKind::Activation,
                },
                inputs: vec![],
                outputs: vec![t()],
                module: None,
            })
            .unwrap();
        let w = g
            .add_node(Node {
                id: "w".into(),
                op: Op::Input {
                    kind: InputKind::Parameter,
                },
                inputs: vec![],
                outputs: vec![TensorType::new(
                    af::ir::DType::Bf16,
                    vec![Dim::constant(64)],
                )],
                module: None,
            })
            .unwrap();
        let ar = g
            .add_node(Node {
                id: "ar".into(),
                op: Op::AllReduce {
                    group: "tp".into(),
                    reduce: Default::default(),
                },
                inputs: vec![Value::new(x, 0)],
                outputs: vec![t()],
                module: None,
            })
            .unwrap();
        let n = g
            .add_node(Node {
                id: "n".into(),
                op: Op::RmsNorm {
                    eps,
                    weight_bias: 0.0,
                },
                inputs: vec![Value::new(ar, 0), Value::new(w, 0)],
                outputs: vec![t()],
                module: None,
            })
            .unwrap();
        g.set_outputs(vec![Value::new(n, 0)]).unwrap();
        let err = g.validate().expect_err(name);
        writeln!(answers, "{name}: {err}").unwrap();
        let target = Target::preset(LOWER_PRESET).unwrap();
        assert!(
            matches!(af::lower(&g, &target), Err(af::LowerError::InvalidGraph(_))),
            "{name}"
        );
    }
    // A node with more outputs than MAX_PORTS is refused by add_node.
    let mut g = Graph::new();
    let err = g
        .add_node(Node {
            id: "wide".into(),
            op: Op::Opaque {
                target: "split".into(),
                attrs: serde_json::Value::Null,
            },
            inputs: vec![],
            outputs: vec![t(); af::ir::MAX_PORTS + 1],
            module: None,
        })
        .unwrap_err();
    writeln!(answers, "{} outputs: {err}", af::ir::MAX_PORTS + 1).unwrap();
    insta::assert_snapshot!("api_built_values", answers);
}

// ---------------------------------------------------------------------------------
// Regressions of the bugs this work found (all three fixed in their crates; see
// docs/fuzzing.md). A new open bug gets a reproducer in ir-fixtures/hostile/bugs/ and
// an `#[ignore = "BUG ..."]` test here stating the wanted behaviour.
// ---------------------------------------------------------------------------------

/// Found by `fuzz_bytes` (fixed in arfuse-ir 959db7e): a fused node's carried plan
/// is checked on load. A file claiming a dispatch with gaps, a one-shot range needing
/// far more than the Lamport buffer, an understated byte count or a buffer larger than
/// the workspace is refused, naming the plan.
#[test]
fn fused_plans_from_files_are_checked() {
    for name in [
        "fused_plan_dispatch_gap.json",
        "fused_plan_one_shot_exceeds_buffer.json",
        "fused_plan_understates_bytes.json",
        "fused_plan_buffer_larger_than_workspace.json",
    ] {
        let bytes = std::fs::read(hostile_dir().join(name)).unwrap();
        let err = af::ir::Graph::from_json_slice(&bytes)
            .expect_err(name)
            .to_string();
        assert!(err.contains("fused [attribute]: plan: "), "{name}: {err}");
        assert!(af::import::load_any(&bytes).is_err(), "{name}");
    }
}

/// Found by `fuzz_structured` (fixed in arfuse-rewrite 46f9870): lowering a lowered
/// graph with default options infers the same layer group. Before, the group was
/// inferred from all-reduces only, so once the most frequent group's all-reduces were
/// fused the remaining groups tied and the second run failed with AmbiguousGroup.
#[test]
fn lowering_a_lowered_graph_infers_the_same_group() {
    let bytes = std::fs::read(hostile_dir().join("lower_twice_group_tie.json")).unwrap();
    let g = af::ir::Graph::from_json_slice(&bytes).unwrap();
    let target = Target::preset(LOWER_PRESET).unwrap();
    let once = af::lower(&g, &target).unwrap();
    assert_eq!(once.report.all_reduces_fused, 2);
    let twice =
        af::lower(&once.graph, &target).expect("lowering a lowered graph returns it unchanged");
    assert_eq!(twice.graph.canonical_text(), once.graph.canonical_text());
    assert_eq!(twice.report.group, once.report.group);
}

/// Found while writing the e-graph limit test (fixed in arfuse-rewrite 46f9870): when
/// the runner stops at the e-node limit, the error names the configured limit, not
/// egg's e-node count at the stop.
#[test]
fn node_limit_error_names_the_configured_limit() {
    let g = af::ir::Graph::from_json_slice(&wide_sites(8)).unwrap();
    let target = Target::preset(LOWER_PRESET).unwrap();
    let options = af::LowerOptions {
        node_limit: 10,
        ..Default::default()
    };
    let err = af::lower_with(&g, &target, &options)
        .unwrap_err()
        .to_string();
    assert!(err.contains("e-node limit 10 "), "{err}");
}

// ---------------------------------------------------------------------------------
// Smoke of the fuzz targets: seeds, crash regressions, deterministic mutations.
// ---------------------------------------------------------------------------------

fn seeds_bytes() -> Vec<(String, Vec<u8>)> {
    let mut v = Vec::new();
    for dir in [
        "fuzz/corpus-seed/fuzz_bytes",
        "ir-fixtures/small",
        "ir-fixtures/malformed",
        "ir-fixtures/hostile",
        "ir-fixtures/hostile/bugs",
    ] {
        let d = root().join(dir);
        if !d.is_dir() {
            continue;
        }
        for p in files_in(&d, &["json", "toml", "pt2"]) {
            v.push((p.display().to_string(), std::fs::read(&p).unwrap()));
        }
    }
    v
}

/// Inputs saved from fuzzing runs: `ir-fixtures/hostile/crashes/<target>-<name>`.
fn crash_inputs(target: &str) -> Vec<(String, Vec<u8>)> {
    let d = hostile_dir().join("crashes");
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("{target}-")))
        })
        .map(|p| (p.display().to_string(), std::fs::read(&p).unwrap()))
        .collect();
    v.sort();
    v
}

fn run_caught(what: &str, f: impl FnOnce() + std::panic::UnwindSafe) {
    if let Err(e) = std::panic::catch_unwind(f) {
        let msg = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        panic!("{what}: {msg}");
    }
}

const SMOKE_MUTATIONS: usize = 3_000;
const SMOKE_STRUCTURED: usize = 1_500;

#[test]
fn fuzz_bytes_smoke() {
    let seeds = seeds_bytes();
    assert!(seeds.len() > 80, "{} seeds", seeds.len());
    let start = Instant::now();
    for (name, data) in seeds.iter().chain(crash_inputs("fuzz_bytes").iter()) {
        run_caught(name, || targets::fuzz_bytes(data));
    }
    // Mutations of the small seeds (the big ones are covered above).
    let small: Vec<&(String, Vec<u8>)> = seeds.iter().filter(|(_, d)| d.len() < 8192).collect();
    let mut rng = targets::Rng(0x00a1_f05e_0007);
    for i in 0..SMOKE_MUTATIONS {
        let (name, seed) = small[rng.below(small.len())];
        let input = targets::mutate(&mut rng, seed);
        run_caught(&format!("mutation {i} of {name}"), || {
            targets::fuzz_bytes(&input)
        });
    }
    eprintln!(
        "fuzz_bytes smoke: {} seeds + {SMOKE_MUTATIONS} mutations in {:?}",
        seeds.len(),
        start.elapsed()
    );
}

#[test]
fn fuzz_structured_smoke() {
    let start = Instant::now();
    let mut seeds: Vec<(String, Vec<u8>)> = crash_inputs("fuzz_structured");
    let d = root().join("fuzz/corpus-seed/fuzz_structured");
    if d.is_dir() {
        for p in files_in(&d, &["bin"]) {
            seeds.push((p.display().to_string(), std::fs::read(&p).unwrap()));
        }
    }
    for (name, data) in &seeds {
        run_caught(name, || {
            targets::fuzz_structured(data);
        });
    }
    let mut rng = targets::Rng(0x5747_0007);
    let (mut valid, mut lowered, mut fused) = (0, 0, 0);
    for i in 0..SMOKE_STRUCTURED {
        let len = rng.below(96);
        let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let mut o = targets::StructuredOutcome::default();
        run_caught(&format!("structured input {i}: {data:?}"), {
            let o = &mut o;
            std::panic::AssertUnwindSafe(move || *o = targets::fuzz_structured(&data))
        });
        valid += usize::from(o.valid_graph);
        lowered += usize::from(o.lowered);
        fused += usize::from(o.fused > 0);
    }
    eprintln!(
        "fuzz_structured smoke: {} seeds + {SMOKE_STRUCTURED} inputs in {:?}: {valid} valid graphs, {lowered} lowered, {fused} with fusions",
        seeds.len(),
        start.elapsed()
    );
    // The generator is useful: most graphs validate and some fuse.
    assert!(valid * 2 > SMOKE_STRUCTURED, "{valid} valid graphs");
    assert!(fused * 50 > SMOKE_STRUCTURED, "{fused} graphs with fusions");
}

/// A graph at the node limit: 166,665 fusable layers (all-reduce, fused add + RMSNorm,
/// an opaque attention) sharing one weight, 499,999 nodes in all. Lowering it stays
/// within the default e-graph limits. Minutes unoptimised, so ignored; run it with
/// `cargo test --release --test hostile -- --ignored largest` (timings in
/// docs/fuzzing.md).
#[test]
#[ignore = "slow unoptimised: run in release"]
fn largest_graph_lowers_within_the_limits() {
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
    let target = Target::preset(LOWER_PRESET).unwrap();
    let (l, took, peak) = measure(|| af::lower(&g, &target));
    let l = l.unwrap();
    eprintln!(
        "{} nodes, {layers} layers: lowered in {took:?}, peak {} MiB, {} e-nodes, {} iterations",
        g.len(),
        peak / MIB,
        l.report.runner.egraph_nodes,
        l.report.runner.iterations
    );
    assert_eq!(l.report.all_reduces_fused, layers);
    assert!(l.report.runner.egraph_nodes < af::rewrite::DEFAULT_NODE_LIMIT);
}
