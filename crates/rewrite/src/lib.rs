//! # arfuse-rewrite
//!
//! The compiler pass: finds every all-reduce -> (residual add ->) RMSNorm (-> quant)
//! chain of a tensor-parallel graph and replaces it by one `fused_allreduce_norm`
//! node carrying its plan from `arfuse-policy`; refuses every look-alike that is not
//! the pattern; and says what it did ([`Report`]).
//!
//! ```
//! use arfuse_ir::{DType, Dim, Graph, InputKind, Node, Op, SymbolRange, TensorType, Value};
//! use arfuse_rewrite::{lower_with, LowerOptions};
//!
//! // x [T, 4096] bf16 -> all_reduce over "tp" -> rms_norm with a weight of 4096.
//! let act = || TensorType::new(DType::Bf16, vec![Dim::symbol("T"), Dim::constant(4096)]);
//! let mut g = Graph::new();
//! g.set_symbol("T", SymbolRange { min: 1, max: 8192 });
//! let mut add = |id: &str, op: Op, inputs: Vec<Value>, out: TensorType| {
//!     let node = Node { id: id.into(), op, inputs, outputs: vec![out], module: None };
//!     g.add_node(node).map(|n| Value::new(n, 0))
//! };
//! let x = add("x", Op::Input { kind: InputKind::Activation }, vec![], act())?;
//! let w_ty = TensorType::new(DType::Bf16, vec![Dim::constant(4096)]);
//! let w = add("w", Op::Input { kind: InputKind::Parameter }, vec![], w_ty)?;
//! let reduce = Op::AllReduce { group: "tp".into(), reduce: Default::default() };
//! let ar = add("ar", reduce, vec![x], act())?;
//! let norm = Op::RmsNorm { eps: 1e-6, weight_bias: 0.0, norm_rounding: Default::default() };
//! let y = add("norm", norm, vec![ar, w], act())?;
//! g.set_outputs(vec![y])?;
//!
//! let target = arfuse_policy::Target::preset("h200-sxm-x8")?;
//! let lowered = lower_with(&g, &target, &LowerOptions::default())?;
//! assert_eq!(lowered.report.all_reduces_fused, 1);
//! // The all-reduce and the norm are one fused node now.
//! assert_eq!(lowered.graph.len(), 3);
//! println!("{}", lowered.report);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Pipeline
//!
//! [`lower_with`] is these steps, each one function of the module that owns it. Steps
//! 1 to 3 run window by window (`find`, `window`): a graph larger than
//! [`LowerOptions::window_nodes`] is cut into consecutive ranges of a third of that
//! many nodes, and each range's all-reduces are decided in an e-graph of the range
//! and a halo around it (every modeled node up to 16 steps downstream of those
//! all-reduces and 8 steps upstream, views free), so the e-graph's work and memory
//! per site do not grow with the model (the other steps still read and write the
//! whole graph); the result is the whole graph's (`tests/windows.rs`). The windows
//! are spread over [`LowerOptions::threads`] threads, each window's steps 1 to 3 on
//! one, and the calling thread takes their answers in window order; the result does
//! not depend on the thread count. With more than one thread, a graph cut into windows
//! is also validated while the facts below are gathered, and its report is built while
//! the output is emitted and checked (`par`): the same result, sooner.
//!
//! 1. Convert (`convert::convert`): IR -> e-graph. The ops the rules look into become
//!    e-nodes, every other value an opaque leaf keyed by the IR value; all-reduces
//!    carry their instance. What the whole graph says once (its collectives:
//!    `convert::collectives`; every value's type, every all-reduce and its uses:
//!    `convert::facts`, `uses::Uses`) is read before the first window and lent to
//!    each.
//! 2. Run the rules (`rules::saturate`), one file per family (`rules/`):
//!    normalisation of every norm spelling to `rms_norm`, views and waits seen
//!    through, the fusion of the residual and the first-layer forms (Gemma included),
//!    and the quant epilogues. Conditions that depend on types and groups are checked
//!    by the appliers, which log refusals. The runner runs to saturation within
//!    explicit limits ([`LowerOptions`]); anything else is an error.
//! 3. Choose sites (`site::choose`): each all-reduce's fused candidates are checked
//!    against the IR's use counts (nothing outside the chain may read an
//!    intermediate; only live outputs are written) and at most one is kept, the most
//!    complete first.
//! 4. Plan (`plan::plan_graph`): one plan per activation dtype over the sites' hidden
//!    sizes from `arfuse-policy`; fused nodes already in the input must carry it.
//! 5. Emit and check (`emit::select`, `emit::emit_sites`, `emit::check`): the sites
//!    the plan fuses, e-graph -> IR, the fused node once however many projections are
//!    live; then every original all-reduce is checked to appear exactly once, and the
//!    result is validated (the nodes added or rewired; the rest are as in the
//!    validated input).
//! 6. Report (`report::build`): the one place the [`Report`] is made (the fused
//!    nodes' ids are filled in once emitted: `report::name_fused_nodes`).
//!
//! There is no cost model in the pass: a kept site always replaces at least an
//! all-reduce and a norm kernel by one kernel, so fusing a legal site never loses at
//! plan time. Whether the fused kernel pays at a given token count is the policy's
//! decision (a plan's unfused ranges, `arfuse-policy`), not the e-graph's.
//!
//! Architecture invariants: collectives are never merged, dropped or duplicated
//! (instance leaves, the exactly-once check); untouched nodes keep their ids; the
//! output is a function of the input bytes (no hash-map order reaches it); lowering a
//! lowered graph returns it unchanged.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod analysis;
mod convert;
mod emit;
mod error;
mod find;
mod lang;
mod par;
mod plan;
mod report;
mod rules;
mod site;
mod uses;
mod window;

pub use error::LowerError;
pub use report::{
    PatternCount, RangeReport, Report, RunnerLimits, RunnerReport, SiteReport, TargetReport,
    WorkspaceReport,
};

use arfuse_ir::{Graph, Op};
use arfuse_policy::Target;
use std::collections::{BTreeMap, BTreeSet};

/// Default iteration limit of the e-graph runner. The rules reach saturation in about
/// six iterations (normalise, see through views, fuse, add the epilogue, check); the
/// margin is for long view chains.
pub const DEFAULT_ITER_LIMIT: usize = 64;
/// Default e-node limit: about 20 e-nodes per IR node of the largest graph the IR
/// accepts ([`arfuse_ir::MAX_NODES`]).
pub const DEFAULT_NODE_LIMIT: usize = 20 * arfuse_ir::MAX_NODES;
/// Default window size, in IR nodes: the e-graph of a larger graph is built one window
/// at a time, each deciding 1,024 nodes (see [`LowerOptions::window_nodes`]). Every
/// graph of the bundled corpus (at most 2,754 nodes) is one window; with cores of 1,024
/// nodes the halos add about 20% to a dense decomposed stack's e-nodes (10% with
/// `rms_norm`). Graphs of 3,073 to 4,096 nodes are cut, not kept whole, because then
/// their windows saturate on two threads: the 128-layer decomposed stack (3,854 nodes)
/// lowered in 3.16 to 3.82 ms against 3.88 to 4.76 ms as one e-graph (eight alternating
/// runs on this repository's 2-core VM, fastest of 30 lowerings each).
pub const DEFAULT_WINDOW_NODES: usize = 3072;

/// Options of [`lower_with`]. Non-exhaustive: start from [`LowerOptions::default`] and
/// set fields (or use the `with_*` methods), so that a new option is not a breaking
/// change.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LowerOptions {
    /// The layers' tensor-parallel process group. `None`: the group of the graph's
    /// all-reduces if they share one, else the most frequent one (the report says
    /// which); a tie is an error asking to set it.
    pub group: Option<String>,
    /// Most runner iterations. Default [`DEFAULT_ITER_LIMIT`].
    pub iter_limit: usize,
    /// Most e-nodes, over every window. Default [`DEFAULT_NODE_LIMIT`]. Hitting either
    /// limit is [`LowerError::NotSaturated`], never a partial result. There is no time
    /// limit: the result must not depend on the machine's speed (the two budgets bound
    /// the work).
    pub node_limit: usize,
    /// The most nodes of a graph one e-graph holds whole. A larger graph's nodes, in
    /// order, are cut into ranges of a third of this many (at least 1; a smaller
    /// e-graph stays in cache), and each range's all-reduces are matched in an e-graph
    /// of the range plus every modeled node up to 16 steps downstream of them and 8
    /// steps upstream (its halo), so the e-graph's work and memory per site do not grow
    /// with the model. Default [`DEFAULT_WINDOW_NODES`]; 0 counts as 1. The sites,
    /// plans and output do not depend on it (tested down to windows of one node); the
    /// report's e-graph totals do, and so do the e-nodes counted against
    /// `node_limit`: a halo's nodes count in every window holding them, so smaller
    /// windows count more (at the default, a dense decomposed stack's halos add about
    /// 20%; at windows of a few nodes, the count can be many times the whole graph's).
    pub window_nodes: usize,
    /// Hidden sizes (elements) of other graphs that share this graph's workspace, e.g.
    /// a speculative-decoding draft model: the workspace is sized for the widest of
    /// them and of this graph's own (domain.md §5) that the fused kernels can run, so
    /// `max_token_num` is the one the shared allocation really has. A size the kernels
    /// cannot run (a row that is not a multiple of their 16-byte vectors, for one) never
    /// uses the workspace, so it does not size it; when a workspace is planned, the
    /// report's notes say why. Default empty (the workspace is this graph's). An invalid
    /// size (0, or a row over the kernels' maximum, `arfuse_policy::check_hidden`) is
    /// [`LowerError::Policy`].
    pub shared_hidden_sizes: Vec<u64>,
    /// The most threads that convert, saturate and choose the sites of the windows of a
    /// graph cut into windows, the calling thread included; 0 (the default): as many as
    /// `std::thread::available_parallelism` says. At most 8 either way; fewer when the
    /// system will not start as many (the calling thread then does the rest). A graph
    /// that is one window is lowered on the calling thread alone. With more than one
    /// thread, a graph cut into windows also runs pairs of whole-graph steps on two
    /// threads, one helper each (validation with gathering the facts, the report with
    /// emit and its checks, within emit the copying of the kept nodes with the adding
    /// of the sites, and the checks in two halves), before and after its windows; the
    /// copying's helper runs beside the report's, so those steps run on three threads
    /// at once (even when this is 2). The helpers are scoped threads of this call
    /// (none outlives it). A window helper works ahead of the calling thread, which
    /// takes every window's result in order, by at most two windows; a window or a
    /// step that its helper has not started by the time the calling thread needs it
    /// (a late start, a helper without a core on a loaded machine) runs on the calling
    /// thread instead (the call still ends only once every helper has started and
    /// ended).
    ///
    /// The output, the report and every error do not depend on it (`tests/windows.rs`);
    /// the time and the peak memory do. Each window helper adds up to two windows' e-graphs
    /// and its own tables sized by the whole graph: 14 bytes per IR node (its window
    /// search and its claims) and 16 per IR value (two value-class tables).
    pub threads: usize,
}

impl Default for LowerOptions {
    fn default() -> Self {
        LowerOptions {
            group: None,
            iter_limit: DEFAULT_ITER_LIMIT,
            node_limit: DEFAULT_NODE_LIMIT,
            window_nodes: DEFAULT_WINDOW_NODES,
            shared_hidden_sizes: Vec::new(),
            threads: 0,
        }
    }
}

impl LowerOptions {
    /// With the layer group set.
    pub fn with_group(mut self, group: impl Into<String>) -> Self {
        self.group = Some(group.into());
        self
    }

    /// With the hidden sizes of the other graphs sharing the workspace.
    pub fn with_shared_hidden_sizes(mut self, sizes: impl Into<Vec<u64>>) -> Self {
        self.shared_hidden_sizes = sizes.into();
        self
    }

    /// With at most `iter_limit` runner iterations.
    pub fn with_iter_limit(mut self, iter_limit: usize) -> Self {
        self.iter_limit = iter_limit;
        self
    }

    /// With at most `node_limit` e-nodes.
    pub fn with_node_limit(mut self, node_limit: usize) -> Self {
        self.node_limit = node_limit;
        self
    }

    /// With windows of `window_nodes` nodes (see [`LowerOptions::window_nodes`]).
    pub fn with_window_nodes(mut self, window_nodes: usize) -> Self {
        self.window_nodes = window_nodes;
        self
    }

    /// With at most `threads` threads (0: the machine's cores, at most 8).
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads;
        self
    }
}

/// The result of [`lower`]: the new graph and what was done.
#[derive(Clone, Debug)]
pub struct Lowered {
    /// The graph with every fused site replaced; valid ([`Graph::validate`]).
    pub graph: Graph,
    /// Per all-reduce: fused or why not; totals; warnings.
    pub report: Report,
    /// One per fused node this lowering added, in the order of their all-reduces: the
    /// chain of the input graph it replaces (what `arfuse_reference::check_sites`
    /// checks site by site).
    pub sites: Vec<arfuse_ir::SiteMap>,
}

/// Lowers `graph` for `target` with [`LowerOptions::default`].
///
/// Errors: see [`lower_with`].
pub fn lower(graph: &Graph, target: &Target) -> Result<Lowered, LowerError> {
    lower_with(graph, target, &LowerOptions::default())
}

/// Lowers `graph` for `target`: every all-reduce -> (residual add ->) RMSNorm
/// (-> quant) chain over the layer group that the target's plan fuses becomes one
/// `fused_allreduce_norm` node carrying the plan.
///
/// Errors: [`LowerError::InvalidGraph`] (the graph fails validation),
/// [`LowerError::AmbiguousGroup`], [`LowerError::Policy`] (the target is wrong),
/// [`LowerError::NotSaturated`] (a runner limit was hit), [`LowerError::Internal`].
pub fn lower_with(
    graph: &Graph,
    target: &Target,
    options: &LowerOptions,
) -> Result<Lowered, LowerError> {
    // A graph cut into windows pairs steps on two threads (`par`).
    let cut = !window::is_whole(graph.len(), options.window_nodes);
    let pairs = cut && find::thread_count(options.threads) > 1;
    let prepared = if pairs {
        let (valid, prepared) = par::both(true, || graph.validate(), || prepare(graph, options));
        valid.map_err(LowerError::InvalidGraph)?;
        prepared
    } else {
        graph.validate().map_err(LowerError::InvalidGraph)?;
        prepare(graph, options)
    };
    target.validate()?;
    // The shared hidden sizes are checked whatever the graph holds (a graph without a
    // site refuses `[0]` as one with sites does); each dtype's plan checks them again
    // for its own dtype.
    for &h in &options.shared_hidden_sizes {
        arfuse_policy::check_hidden(h, target.dtype)?;
    }
    check_world_size(graph, target)?;
    let Prepared { collectives, found } = prepared;
    let ((group, group_source), facts, shapes) = found?;
    let instances = &collectives.all_reduces[..];

    let find::Found {
        uses,
        mut choice,
        rule_refusals,
        runner,
    } = find::find_sites(graph, target, options, facts, shapes, instances)?;
    let planned = plan::plan_graph(
        graph,
        target,
        &choice.chosen,
        &collectives.fused,
        &options.shared_hidden_sizes,
    )?;
    let (selected, site_maps) = emit::select(&mut choice.chosen, &planned.decisions)?;
    let (mut report, emitted) = par::both(
        pairs,
        || {
            report::build(report::Outcome {
                graph,
                target,
                group: group.clone(),
                group_source,
                instances,
                opaque_collectives: &collectives.opaque_collectives,
                runner,
                rule_refusals,
                choice: &choice,
                planned: &planned,
                selected: &selected,
                already_fused: collectives.fused.len(),
            })
        },
        || {
            let emitted = emit::emit_sites(
                graph,
                &uses,
                &choice.chosen,
                site_maps,
                &planned.decisions,
                &group,
                pairs,
            )?;
            emit::check(graph, &collectives, &emitted, pairs)?;
            Ok::<_, LowerError>(emitted)
        },
    );
    let emitted = emitted?;
    report::name_fused_nodes(&mut report, instances, emitted.fused_id_of);
    Ok(Lowered {
        graph: emitted.graph,
        report,
        sites: emitted.sites,
    })
}

/// What the steps read of the input graph besides the graph itself, gathered while it
/// is validated (the two at once for a graph cut into windows: [`par::both`]).
struct Prepared {
    collectives: convert::Collectives,
    /// The layer group and where it came from, the graph's facts for it and its shape
    /// table; or why no group could be chosen.
    found: Result<((String, String), analysis::Facts, analysis::Shapes), LowerError>,
}

/// The collectives of `graph`, its layer group and the facts for that group. Relies
/// only on what `Graph` guarantees by construction (inputs name existing outputs of
/// earlier nodes, at most `MAX_PORTS` of them), and its work is linear in the graph's
/// nodes and inputs, so it is bounded on a graph that fails validation, which it meets
/// only while that graph is validated on another thread; its result is then not used.
fn prepare(graph: &Graph, options: &LowerOptions) -> Prepared {
    let collectives = convert::collectives(graph);
    let found = choose_group(graph, &collectives, options).map(|group| {
        let (facts, shapes) = convert::facts(graph, &group.0, uses::Uses::new(graph));
        (group, facts, shapes)
    });
    Prepared { collectives, found }
}

/// The graph's own tensor-parallel size, when its metadata records one (`tp` or
/// `world_size`, as `arfuse-models` writes), must be the target's group size.
fn check_world_size(graph: &Graph, target: &Target) -> Result<(), LowerError> {
    match graph.recorded_world_size() {
        Some(w) if w != u64::from(target.world_size) => Err(LowerError::WorldSizeMismatch {
            graph: w,
            target: target.world_size,
        }),
        _ => Ok(()),
    }
}

/// The layer group: the one given, else the group of the graph's all-reduces (and of
/// its fused nodes, `collectives`) if they share one, else the most frequent one.
fn choose_group(
    graph: &Graph,
    collectives: &convert::Collectives,
    options: &LowerOptions,
) -> Result<(String, String), LowerError> {
    let group_of = |i: &u32| match &graph.node(arfuse_ir::NodeId::new(*i as usize)).op {
        Op::AllReduce { group, .. } => Some(group.as_str()),
        Op::FusedAllreduceNorm(f) => Some(f.group.as_str()),
        _ => None,
    };
    // A fused node holds one all-reduce of its group: counting it keeps the inferred
    // group of a lowered graph the same as before lowering (idempotence).
    let groups = || {
        collectives
            .all_reduces
            .iter()
            .chain(&collectives.fused)
            .filter_map(group_of)
    };
    if let Some(g) = &options.group {
        let found: BTreeSet<&str> = groups().collect();
        // Not an error: an all-reduce over another group is a refusal, not bad input.
        // But a group nothing uses (often a typo) is said in the report's header.
        if !found.is_empty() && !found.contains(g.as_str()) {
            let list: Vec<&str> = found.into_iter().collect();
            return Ok((
                g.clone(),
                format!(
                    "given; WARNING: no all-reduce of the graph uses it (its groups: {})",
                    list.join(", ")
                ),
            ));
        }
        return Ok((g.clone(), "given".into()));
    }
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for group in groups() {
        *counts.entry(group).or_default() += 1;
    }
    let Some(&max) = counts.values().max() else {
        return Ok((String::new(), "no all-reduce in the graph".into()));
    };
    let top: Vec<&str> = counts
        .iter()
        .filter(|(_, c)| **c == max)
        .map(|(g, _)| *g)
        .collect();
    match top.as_slice() {
        [only] if counts.len() == 1 => Ok((
            only.to_string(),
            "inferred: the only group of the graph's all-reduces".into(),
        )),
        [only] => Ok((
            only.to_string(),
            format!(
                "inferred: the most frequent group ({max} of {} all-reduces)",
                counts.values().sum::<usize>()
            ),
        )),
        _ => Err(LowerError::AmbiguousGroup {
            candidates: top.iter().map(|s| s.to_string()).collect(),
            count: max,
        }),
    }
}
