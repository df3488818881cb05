//! Lowering time per site and peak memory per IR node, with criterion.
//!
//! Groups:
//! - `lower/rms_norm/L` and `lower/decomposed/L`: dense stacks of L = 8 to 4,096 layers
//!   (2L + 1 sites, all fused) with the norm written as `rms_norm` or as the
//!   decomposition torch emits (tests/common/builder.rs);
//! - `lower/max_nodes`: the largest graph the IR accepts, `arfuse_ir::MAX_NODES` =
//!   500,000 nodes (all-reduce, fused_add_rms_norm, an opaque attention per layer), the
//!   shape of `tests/hostile.rs`'s `largest_graph_lowers_within_the_limits`.
//!
//! After criterion's own report, a table: per group and size, IR nodes, sites, the
//! fastest lowering criterion saw (ms, and us per site), the spread of us per site
//! between the sizes of a form (slowest / fastest), and the peak heap growth of one
//! lowering per IR node (bytes; counted by this binary's allocator wrapper, which
//! costs every allocation two relaxed atomic updates).
//!
//! Lowered with the default options (`LowerOptions::threads` = 0: a graph cut into
//! windows is saturated on as many threads as the machine has cores, at most 8);
//! `ARFUSE_BENCH_THREADS=N` in the environment sets the thread count instead. The
//! table's header says which.
//!
//! The allocator under the wrapper is mimalloc, the one arfuse's binaries (xtask, the
//! Python module) install; built with `ARFUSE_BENCH_ALLOC=system` in the environment,
//! it is the system's (glibc) malloc, the one a program that sets no allocator gets.
//! The table's header says which.
//!
//! `cargo bench -p arfuse-rewrite --bench lower` (all), `-- decomposed` (one form),
//! `-- max_nodes` (the 500,000-node graph alone). The figures depend on the machine's
//! load: read them next to `uptime`.

#[path = "../tests/common/builder.rs"]
mod builder;

use arfuse_ir::{DType, Dim, Graph, InputKind, Node, Op, TensorType, Value};
use arfuse_policy::Target;
use builder::{NormForm, Stack};
use criterion::{criterion_group, BenchmarkId, Criterion};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// mimalloc, or the system allocator ([`system_alloc`]), counting live and peak heap
/// bytes.
struct Counting;

/// Whether the bench was built with `ARFUSE_BENCH_ALLOC=system` (cargo rebuilds it
/// when that changes).
fn system_alloc() -> bool {
    matches!(option_env!("ARFUSE_BENCH_ALLOC"), Some("system"))
}

/// The allocator under the counter.
fn inner() -> &'static dyn GlobalAlloc {
    if system_alloc() {
        &System
    } else {
        &mimalloc::MiMalloc
    }
}

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = inner().alloc(layout);
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        inner().dealloc(p, layout);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let q = inner().realloc(p, layout, new_size);
        if !q.is_null() {
            if new_size >= layout.size() {
                let grow = new_size - layout.size();
                let now = LIVE.fetch_add(grow, Ordering::Relaxed) + grow;
                PEAK.fetch_max(now, Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Dense stack sizes, in layers.
const LAYERS: [usize; 7] = [8, 32, 128, 512, 1024, 2048, 4096];

/// What one benchmark saw.
struct Seen {
    nodes: usize,
    sites: usize,
    best: Duration,
    peak_bytes: usize,
}

thread_local! {
    /// (group, size) -> what was seen, for the closing table.
    static SEEN: RefCell<BTreeMap<(String, usize), Seen>> = const { RefCell::new(BTreeMap::new()) };
}

/// The lowering options: the defaults, `threads` from `ARFUSE_BENCH_THREADS` when set
/// (read when the bench runs; 0 or unset: the default, the machine's cores).
fn options() -> arfuse_rewrite::LowerOptions {
    let threads = std::env::var("ARFUSE_BENCH_THREADS")
        .ok()
        .map(|t| t.parse().expect("ARFUSE_BENCH_THREADS: a thread count"))
        .unwrap_or(0);
    arfuse_rewrite::LowerOptions {
        threads,
        ..Default::default()
    }
}

/// One lowering's peak heap growth in bytes (the graph itself excluded).
fn peak_of_one(g: &Graph, target: &Target) -> (usize, usize) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let l = arfuse_rewrite::lower_with(g, target, &options()).expect("the benchmark graph lowers");
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    (peak, l.report.all_reduces_fused)
}

/// Benchmarks lowering the graph `build` makes as `group/size`, recording the fastest
/// lowering. The graph is built (and its peak memory measured) only when criterion's
/// filter selects the benchmark.
fn bench_graph(
    c: &mut Criterion,
    group: &str,
    size: usize,
    sample_size: usize,
    build: impl Fn() -> Graph,
) {
    let target = Target::preset("h200-sxm-x8").expect("preset");
    let options = options();
    let key = (group.to_string(), size);
    let mut graph: Option<Graph> = None;
    let mut grp = c.benchmark_group(format!("lower/{group}"));
    grp.sample_size(sample_size);
    grp.bench_function(BenchmarkId::from_parameter(size), |b| {
        let g = graph.get_or_insert_with(|| {
            let g = build();
            let (peak_bytes, sites) = peak_of_one(&g, &target);
            SEEN.with(|s| {
                s.borrow_mut().insert(
                    key.clone(),
                    Seen {
                        nodes: g.len(),
                        sites,
                        best: Duration::MAX,
                        peak_bytes,
                    },
                )
            });
            g
        });
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                let l = arfuse_rewrite::lower_with(g, &target, &options);
                let took = t.elapsed();
                // The result is dropped outside the timed part.
                drop(std::hint::black_box(l));
                total += took;
                SEEN.with(|s| {
                    if let Some(seen) = s.borrow_mut().get_mut(&key) {
                        seen.best = seen.best.min(took);
                    }
                });
            }
            total
        })
    });
    grp.finish();
}

fn stacks(c: &mut Criterion) {
    for (name, norm) in [
        ("rms_norm", NormForm::RmsNorm),
        ("decomposed", NormForm::Decomposed),
    ] {
        for layers in LAYERS {
            bench_graph(c, name, layers, 10, || {
                Stack {
                    layers,
                    norm,
                    ..Stack::default()
                }
                .build()
            });
        }
    }
}

/// The 500,000-node graph: layers of all-reduce -> fused_add_rms_norm -> an opaque
/// attention, as many as fit in `arfuse_ir::MAX_NODES`.
fn max_nodes_graph() -> Graph {
    let mut g = Graph::new();
    g.set_symbol("T", arfuse_ir::SymbolRange { min: 1, max: 8192 });
    let act = || TensorType::new(DType::Bf16, vec![Dim::symbol("T"), Dim::constant(4096)]);
    let mut add = |id: String, op: Op, inputs: Vec<Value>, outputs: Vec<TensorType>| {
        g.add_node(Node {
            id,
            op,
            inputs,
            outputs,
            module: None,
        })
        .expect("a valid node")
    };
    let x = add(
        "x".into(),
        Op::Input {
            kind: InputKind::Activation,
        },
        vec![],
        vec![act()],
    );
    let w = add(
        "w".into(),
        Op::Input {
            kind: InputKind::Parameter,
        },
        vec![],
        vec![TensorType::new(DType::Bf16, vec![Dim::constant(4096)])],
    );
    let (mut prev, mut res) = (Value::new(x, 0), Value::new(x, 0));
    for i in 0..(arfuse_ir::MAX_NODES - 2) / 3 {
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
    g.set_outputs(vec![prev, res]).expect("valid outputs");
    g
}

fn max_nodes(c: &mut Criterion) {
    let nodes = 2 + 3 * ((arfuse_ir::MAX_NODES - 2) / 3);
    bench_graph(c, "max_nodes", nodes, 10, max_nodes_graph);
}

/// The closing table.
fn summary() {
    SEEN.with(|s| {
        let seen = s.borrow();
        if seen.is_empty() {
            return;
        }
        println!();
        let alloc = if system_alloc() {
            "the system's malloc (ARFUSE_BENCH_ALLOC=system)"
        } else {
            "mimalloc"
        };
        println!("allocator: {alloc}");
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        match options().threads {
            0 => println!(
                "threads: the default (this machine's {cores} core(s), at most 8); a graph of \
                 one window (up to 4,096 nodes) is lowered on one"
            ),
            t => println!("threads: {t} (ARFUSE_BENCH_THREADS)"),
        }
        println!("| graph | size | IR nodes | sites | best ms | us/site | peak bytes/IR node |");
        println!("|---|---:|---:|---:|---:|---:|---:|");
        let mut per_form: BTreeMap<&str, (f64, f64)> = BTreeMap::new();
        for ((group, size), x) in seen.iter() {
            if x.best == Duration::MAX {
                continue;
            }
            let us = x.best.as_secs_f64() * 1e6 / x.sites.max(1) as f64;
            println!(
                "| {group} | {size} | {} | {} | {:.1} | {us:.1} | {:.0} |",
                x.nodes,
                x.sites,
                x.best.as_secs_f64() * 1e3,
                x.peak_bytes as f64 / x.nodes.max(1) as f64
            );
            if group != "max_nodes" {
                let e = per_form.entry(group).or_insert((f64::MAX, 0.0));
                e.0 = e.0.min(us);
                e.1 = e.1.max(us);
            }
        }
        for (form, (lo, hi)) in per_form {
            println!(
                "spread of us/site, {form}: {hi:.1} / {lo:.1} = {:.2}x",
                hi / lo
            );
        }
    });
}

criterion_group!(benches, stacks, max_nodes);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    summary();
}
