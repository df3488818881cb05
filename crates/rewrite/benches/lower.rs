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
//! fastest lowering criterion saw (ms, and us per site), the fastest of the
//! interleaved rounds (us per site, below), the spread of us per site between the
//! sizes of a form (slowest / fastest) for both, and the peak heap growth of one
//! lowering per IR node (bytes; counted by this binary's allocator wrapper in a
//! lowering of its own: while counting, every allocation costs two atomic updates of
//! counters all threads share, so the timed lowerings run with counting off).
//!
//! Criterion measures one size after the other, so on a machine whose speed drifts
//! (a shared VM's fast and slow phases, which differ by up to 1.6x on this project's
//! 2-core VM) a spread between sizes can be the drift. The interleaved rounds lower
//! every stack criterion ran, one size after the other, `ARFUSE_BENCH_ROUNDS` times
//! (default 10; 0 skips them), each size `max(1, 512 / layers)` times per round, and
//! keep each size's fastest lowering: every size sees the same phases.
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
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
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

/// Whether allocations are counted (only during [`peak_of_one`]).
static COUNTING: AtomicBool = AtomicBool::new(false);
/// Bytes allocated less bytes freed since counting started (negative when more was
/// freed than allocated: memory from before counting).
static LIVE: AtomicIsize = AtomicIsize::new(0);
/// The most `LIVE` was since counting started.
static PEAK: AtomicIsize = AtomicIsize::new(0);

/// Adds `bytes` (negative: freed) to the live count, when counting.
fn count(bytes: isize) {
    if COUNTING.load(Ordering::Relaxed) {
        let now = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

/// A size in bytes as a count (a layout's size fits `isize`).
fn signed(bytes: usize) -> isize {
    isize::try_from(bytes).unwrap_or(isize::MAX)
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = inner().alloc(layout);
        if !p.is_null() {
            count(signed(layout.size()));
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        inner().dealloc(p, layout);
        count(-signed(layout.size()));
    }
    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let q = inner().realloc(p, layout, new_size);
        if !q.is_null() {
            count(signed(new_size) - signed(layout.size()));
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
    /// The fastest lowering of the interleaved rounds ([`interleaved`]).
    interleaved: Duration,
    peak_bytes: usize,
}

thread_local! {
    /// (group, size) -> what was seen, for the closing table.
    static SEEN: RefCell<BTreeMap<(String, usize), Seen>> = const { RefCell::new(BTreeMap::new()) };
}

/// The lowering options: the defaults, `threads` from `ARFUSE_BENCH_THREADS` when set
/// (read when the bench runs; 0 or unset: the default, the machine's cores).
fn options() -> arfuse_rewrite::LowerOptions {
    let threads = env_count("ARFUSE_BENCH_THREADS", 0);
    arfuse_rewrite::LowerOptions::default().with_threads(threads)
}

/// One lowering's peak heap growth in bytes (the graph itself excluded), counted with
/// the allocator's counters on for this lowering alone.
fn peak_of_one(g: &Graph, target: &Target) -> (usize, usize) {
    LIVE.store(0, Ordering::Relaxed);
    PEAK.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::SeqCst);
    let l = arfuse_rewrite::lower_with(g, target, &options()).expect("the benchmark graph lowers");
    COUNTING.store(false, Ordering::SeqCst);
    let peak = usize::try_from(PEAK.load(Ordering::Relaxed)).unwrap_or(0);
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
                        interleaved: Duration::MAX,
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

/// The benchmarked norm forms, by group name.
const FORMS: [(&str, NormForm); 2] = [
    ("rms_norm", NormForm::RmsNorm),
    ("decomposed", NormForm::Decomposed),
];

/// The dense stack of `layers` layers with the norm written as `norm`.
fn stack(layers: usize, norm: NormForm) -> Graph {
    Stack {
        layers,
        norm,
        ..Stack::default()
    }
    .build()
}

fn stacks(c: &mut Criterion) {
    for (name, norm) in FORMS {
        for layers in LAYERS {
            bench_graph(c, name, layers, 10, || stack(layers, norm));
        }
    }
}

/// The interleaved rounds (see the crate doc) over the stacks criterion ran, recorded
/// as each one's `interleaved` time.
fn interleaved() {
    let rounds = env_count("ARFUSE_BENCH_ROUNDS", DEFAULT_ROUNDS);
    let ran: Vec<(String, usize)> = SEEN.with(|s| {
        let seen = s.borrow();
        seen.keys()
            .filter(|(g, _)| g != "max_nodes")
            .cloned()
            .collect()
    });
    if rounds == 0 || ran.is_empty() {
        return;
    }
    let target = Target::preset("h200-sxm-x8").expect("preset");
    let options = options();
    let graphs: Vec<((String, usize), Graph)> = ran
        .into_iter()
        .filter_map(|(group, layers)| {
            let (_, norm) = FORMS.iter().find(|(name, _)| *name == group)?;
            let g = stack(layers, *norm);
            Some(((group, layers), g))
        })
        .collect();
    let mut best = vec![Duration::MAX; graphs.len()];
    for _ in 0..rounds {
        for (((_, layers), g), best) in graphs.iter().zip(&mut best) {
            for _ in 0..(512 / layers).max(1) {
                let t = Instant::now();
                let l = arfuse_rewrite::lower_with(g, &target, &options);
                let took = t.elapsed();
                drop(std::hint::black_box(l));
                *best = (*best).min(took);
            }
        }
    }
    SEEN.with(|s| {
        let mut seen = s.borrow_mut();
        for ((key, _), best) in graphs.iter().zip(best) {
            if let Some(x) = seen.get_mut(key) {
                x.interleaved = best;
            }
        }
    });
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
                 one window (up to 3,072 nodes) is lowered on one"
            ),
            t => println!("threads: {t} (ARFUSE_BENCH_THREADS)"),
        }
        println!(
            "| graph | size | IR nodes | sites | best ms | us/site | interleaved us/site | \
             peak bytes/IR node |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|");
        // Per form and measure (criterion, interleaved): the fastest and slowest us/site.
        let mut per_form: BTreeMap<(&str, &str), (f64, f64)> = BTreeMap::new();
        for ((group, size), x) in seen.iter() {
            if x.best == Duration::MAX {
                continue;
            }
            let per_site = |d: Duration| d.as_secs_f64() * 1e6 / x.sites.max(1) as f64;
            let us = per_site(x.best);
            let inter = (x.interleaved != Duration::MAX).then(|| per_site(x.interleaved));
            println!(
                "| {group} | {size} | {} | {} | {:.1} | {us:.1} | {} | {:.0} |",
                x.nodes,
                x.sites,
                x.best.as_secs_f64() * 1e3,
                inter.map_or("-".to_string(), |i| format!("{i:.1}")),
                x.peak_bytes as f64 / x.nodes.max(1) as f64
            );
            if group == "max_nodes" {
                continue;
            }
            let measures = [("criterion", Some(us)), ("interleaved", inter)];
            for (measure, v) in measures {
                if let Some(v) = v {
                    let e = per_form.entry((group, measure)).or_insert((f64::MAX, 0.0));
                    e.0 = e.0.min(v);
                    e.1 = e.1.max(v);
                }
            }
        }
        for ((form, measure), (lo, hi)) in per_form {
            println!(
                "spread of us/site, {form}, {measure}: {hi:.1} / {lo:.1} = {:.2}x",
                hi / lo
            );
        }
    });
}

criterion_group!(benches, stacks, max_nodes);

/// Interleaved rounds when `ARFUSE_BENCH_ROUNDS` is not set.
const DEFAULT_ROUNDS: usize = 10;

/// The count in environment variable `name`, `default` when it is unset. A value that
/// is no count ends the run with a message naming the variable (before anything is
/// measured: [`check_env`]).
fn env_count(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Err(_) => default,
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            eprintln!("{name}={v:?}: expected a non-negative integer");
            std::process::exit(2)
        }),
    }
}

/// Reads every environment variable the bench takes, so that a bad one stops the run
/// before criterion measures anything rather than after.
fn check_env() {
    env_count("ARFUSE_BENCH_THREADS", 0);
    env_count("ARFUSE_BENCH_ROUNDS", DEFAULT_ROUNDS);
}

fn main() {
    check_env();
    benches();
    Criterion::default().configure_from_args().final_summary();
    interleaved();
    summary();
}
