//! # arfuse-rewrite
//!
//! The compiler pass: finds every all-reduce -> (residual add ->) RMSNorm (-> quant)
//! chain of a tensor-parallel graph and replaces it by one `fused_allreduce_norm`
//! node carrying its plan from `arfuse-policy`; refuses every look-alike that is not
//! the pattern; and says what it did ([`Report`]).
//!
//! ## Pipeline
//!
//! 1. IR -> e-graph (`convert`): the ops the rules look into become e-nodes, every other
//!    value an opaque leaf keyed by the IR value; all-reduces carry their instance.
//! 2. Rules, one file per family (`rules/`): normalisation of every norm spelling to
//!    `rms_norm`, views and waits seen through, the fusion of the residual and the
//!    first-layer forms (Gemma included), and the quant epilogues. Conditions that
//!    depend on types and groups are checked by the appliers, which log refusals.
//! 3. The runner runs to saturation within explicit limits ([`LowerOptions`]); anything
//!    else is an error.
//! 4. Sites (`site`): each all-reduce's fused candidates are checked against the IR's
//!    use counts (nothing outside the chain may read an intermediate; only live outputs
//!    are written) and at most one is kept, the most complete first.
//! 5. Policy (`plan`): one plan per activation dtype over the sites' hidden sizes.
//! 6. E-graph -> IR (`emit`): each kept site becomes one fused node writing only its
//!    live outputs. Then every original all-reduce is checked to appear exactly once,
//!    and the result is validated.
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
mod lang;
mod plan;
mod report;
mod rules;
mod site;

pub use error::LowerError;
pub use report::{
    PatternCount, RangeReport, Report, RunnerLimits, RunnerReport, SiteReport, TargetReport,
    WorkspaceReport,
};

use arfuse_ir::op::{FusedOutput, FusedQuant};
use arfuse_ir::{Graph, NodeId, Op};
use arfuse_policy::Target;
use egg::{Runner, SimpleScheduler, StopReason};
use lang::QKind;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// Default iteration limit of the e-graph runner. The snapshot corpus saturates in 1 to
/// 5 iterations (normalise, see through views, fuse, add the epilogue); the margin is
/// for long view chains.
pub const DEFAULT_ITER_LIMIT: usize = 64;
/// Default e-node limit: about 20 e-nodes per IR node of the largest graph the IR
/// accepts ([`arfuse_ir::MAX_NODES`]).
pub const DEFAULT_NODE_LIMIT: usize = 20 * arfuse_ir::MAX_NODES;
/// Default time limit of the runner, in seconds (a 4,096-layer stack takes well under
/// one).
pub const DEFAULT_TIME_LIMIT_S: u64 = 300;

/// Options of [`lower_with`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LowerOptions {
    /// The layers' tensor-parallel process group. `None`: the group of the graph's
    /// all-reduces if they share one, else the most frequent one (the report says
    /// which); a tie is an error asking to set it.
    pub group: Option<String>,
    /// Most runner iterations. Default [`DEFAULT_ITER_LIMIT`].
    pub iter_limit: usize,
    /// Most e-nodes. Default [`DEFAULT_NODE_LIMIT`].
    pub node_limit: usize,
    /// Most runner time. Default [`DEFAULT_TIME_LIMIT_S`] seconds. Hitting any limit is
    /// [`LowerError::NotSaturated`], never a partial result.
    pub time_limit: Duration,
    /// Hidden sizes (elements) of other graphs that share this graph's workspace, e.g.
    /// a speculative-decoding draft model: the workspace is sized for the widest of
    /// them and of this graph's own (domain.md §5), so `max_token_num` is the one the
    /// shared allocation really has. Default empty (the workspace is this graph's).
    /// An invalid size is [`LowerError::Policy`].
    pub shared_hidden_sizes: Vec<u64>,
}

impl Default for LowerOptions {
    fn default() -> Self {
        LowerOptions {
            group: None,
            iter_limit: DEFAULT_ITER_LIMIT,
            node_limit: DEFAULT_NODE_LIMIT,
            time_limit: Duration::from_secs(DEFAULT_TIME_LIMIT_S),
            shared_hidden_sizes: Vec::new(),
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
}

/// The result of [`lower`]: the new graph and what was done.
#[derive(Clone, Debug)]
pub struct Lowered {
    /// The graph with every fused site replaced; valid ([`Graph::validate`]).
    pub graph: Graph,
    /// Per all-reduce: fused or why not; totals; warnings.
    pub report: Report,
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
    graph.validate().map_err(LowerError::InvalidGraph)?;
    target.validate()?;
    // The shared hidden sizes are checked whatever the graph holds (a graph without a
    // site refuses `[0]` as one with sites does); each dtype's plan checks them again
    // for its own dtype.
    for &h in &options.shared_hidden_sizes {
        arfuse_policy::check_hidden(h, target.dtype)?;
    }
    check_world_size(graph, target)?;
    let (group, group_source) = choose_group(graph, options)?;

    let conv = convert::convert(graph, &group);
    let rules = rules::all().map_err(LowerError::Internal)?;
    let runner = Runner::default()
        .with_scheduler(SimpleScheduler)
        .with_iter_limit(options.iter_limit)
        .with_node_limit(options.node_limit)
        .with_time_limit(options.time_limit)
        .with_egraph(conv.egraph)
        .run(&rules);
    let iterations = runner.iterations.len();
    let eg = runner.egraph;
    match runner.stop_reason {
        Some(StopReason::Saturated) => {}
        other => {
            return Err(LowerError::NotSaturated {
                reason: match other {
                    Some(StopReason::IterationLimit(n)) => format!("iteration limit {n}"),
                    // egg reports the e-node count it stopped at; name the configured limit.
                    Some(StopReason::NodeLimit(n)) => format!(
                        "e-node limit {} (the e-graph had {n} e-nodes when it stopped)",
                        options.node_limit
                    ),
                    Some(StopReason::TimeLimit(s)) => format!("time limit {s} s"),
                    Some(StopReason::Other(s)) => s,
                    _ => "no stop reason".into(),
                },
                iterations,
                nodes: eg.total_size(),
            });
        }
    }
    let runner_report = RunnerReport {
        stop_reason: "saturated".into(),
        iterations,
        egraph_nodes: eg.total_size(),
        egraph_classes: eg.number_of_classes(),
        limits: RunnerLimits {
            iterations: options.iter_limit,
            egraph_nodes: options.node_limit,
            seconds: options.time_limit.as_secs(),
        },
    };

    // Sites: per all-reduce, the first candidate that passes the IR checks.
    let index = site::Index::new(graph, &eg, &conv.value_class);
    let op_refusals = name_op_refusals(&eg, &index);
    let candidates = index.candidates();
    let nvfp4_ok = plan::nvfp4_ok(target);
    let mut claimed: BTreeSet<u32> = BTreeSet::new();
    let mut chosen: BTreeMap<u32, site::Site> = BTreeMap::new();
    let mut why_not: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    let mut site_notes: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    let ars: Vec<u32> = eg.analysis.instances.keys().copied().collect();
    for &inst in &ars {
        let Some(cands) = candidates.get(&inst) else {
            continue;
        };
        for (class, ch, kind) in cands {
            if matches!(kind.quant, QKind::Nvfp4 { .. }) && !nvfp4_ok {
                site_notes.entry(inst).or_default().push(format!(
                    "the NVFP4 quant epilogue is not fused: it needs SM >= 100, the target is \
                     SM {}; the quant runs unfused after the fused node",
                    target.sm
                ));
                continue;
            }
            if let QKind::Fp8Group { group_size, .. } = kind.quant {
                if let Some(why) = arfuse_policy::group_quant_unsupported_reason(group_size) {
                    site_notes.entry(inst).or_default().push(format!(
                        "the per-token-group FP8 quant epilogue is not fused: {why}; the \
                         quant runs unfused after the fused node"
                    ));
                    continue;
                }
            }
            match index.check(inst, *class, *ch, *kind, &claimed) {
                Ok(s) => {
                    chosen.insert(inst, s);
                    break;
                }
                Err(e) => why_not.entry(inst).or_default().push(e),
            }
        }
        if let Some(s) = chosen.get(&inst) {
            claimed.extend(s.region.iter().copied());
        }
    }

    // Policy: one plan per dtype over the hidden sizes of the chosen sites.
    let mut keys: BTreeMap<(arfuse_ir::DType, u64), Option<u64>> = BTreeMap::new();
    for s in chosen.values() {
        let Some(h) = s.x_ty.shape.last().and_then(|d| d.as_const()) else {
            continue;
        };
        let t = index.max_tokens(&s.x_ty);
        let e = keys.entry((s.x_ty.dtype, h)).or_insert(t);
        *e = match (*e, t) {
            (Some(a), Some(b)) => Some(a.max(b)),
            _ => None,
        };
    }
    // Fused nodes already in the input share the workspace and must carry exactly the
    // plan this target gets (else the input was lowered for another machine).
    let mut existing = Vec::new();
    for (_, n) in graph.nodes() {
        if let Op::FusedAllreduceNorm(f) = &n.op {
            let Some(x) = n.inputs.first().and_then(|v| graph.value_type(*v)) else {
                continue;
            };
            let Some(h) = x.shape.last().and_then(|d| d.as_const()) else {
                continue;
            };
            let t = index.max_tokens(x);
            let e = keys.entry((x.dtype, h)).or_insert(t);
            *e = match (*e, t) {
                (Some(a), Some(b)) => Some(a.max(b)),
                _ => None,
            };
            existing.push((n.id.clone(), x.dtype, h, f.plan.clone()));
        }
    }
    let mut notes = Vec::new();
    let (decisions, planned) =
        plan::decide(target, &keys, &options.shared_hidden_sizes, &mut notes)?;
    for (id, dtype, h, carried) in existing {
        let Some(carried) = carried else {
            notes.push(format!(
                "fused node `{id}` carries no plan; it is kept as written"
            ));
            continue;
        };
        let fresh = decisions
            .get(&(dtype, h))
            .filter(|d| d.fused)
            .and_then(|d| d.plan.clone());
        match fresh {
            None => {
                return Err(LowerError::StalePlan {
                    node: id,
                    detail: format!("this target fuses no {dtype} all-reduce of H = {h}"),
                })
            }
            Some(mut p) => {
                p.pattern_code = carried.pattern_code;
                if p != carried {
                    return Err(LowerError::StalePlan {
                        node: id,
                        detail: format!(
                            "carried: max_token_num {}, {}; this target: max_token_num {}, {}",
                            carried.max_token_num, carried.workspace, p.max_token_num, p.workspace
                        ),
                    });
                }
            }
        }
    }

    let mut emits = Vec::new();
    let mut fused_insts: BTreeSet<u32> = BTreeSet::new();
    for (inst, s) in &chosen {
        let h = s.x_ty.shape.last().and_then(|d| d.as_const()).unwrap_or(0);
        let Some(d) = decisions.get(&(s.x_ty.dtype, h)) else {
            continue;
        };
        let (true, Some(mut plan)) = (d.fused, d.plan.clone()) else {
            continue;
        };
        plan.pattern_code = pattern_code(s);
        emits.push(emit::Emit {
            site: s,
            plan,
            group: group.clone(),
            module: site_module(graph, s),
        });
        fused_insts.insert(*inst);
    }
    let (out, fused_ids) = emit::emit(graph, &emits)?;
    let fused_id_of: BTreeMap<u32, String> =
        emits.iter().map(|e| e.site.inst).zip(fused_ids).collect();

    // Every original all-reduce appears exactly once: kept as is, or in one fused node.
    let kept_ars: BTreeSet<&str> = out
        .nodes()
        .filter(|(_, n)| matches!(n.op, Op::AllReduce { .. }))
        .map(|(_, n)| n.id.as_str())
        .collect();
    for &inst in &ars {
        let id = graph.node(NodeId::new(inst as usize)).id.as_str();
        let kept = kept_ars.contains(id);
        let fused = fused_insts.contains(&inst);
        if kept == fused {
            return Err(LowerError::Internal(format!(
                "all-reduce `{id}` appears {} times in the result",
                usize::from(kept) + usize::from(fused)
            )));
        }
    }
    let fused_before = graph
        .nodes()
        .filter(|(_, n)| matches!(n.op, Op::FusedAllreduceNorm(_)))
        .count();
    let collectives_after = out.nodes().filter(|(_, n)| n.op.is_collective()).count();
    if collectives_after != ars.len() + fused_before {
        return Err(LowerError::Internal(format!(
            "{} collectives in, {collectives_after} out",
            ars.len() + fused_before
        )));
    }
    out.validate()
        .map_err(|p| LowerError::Internal(format!("the rewritten graph fails validation: {p}")))?;

    // The report.
    let mut sites = Vec::with_capacity(ars.len());
    let mut by_pattern: BTreeMap<String, PatternCount> = BTreeMap::new();
    for &inst in &ars {
        let ar = graph.node(NodeId::new(inst as usize));
        let mut entry = SiteReport {
            all_reduce: ar.id.clone(),
            fused_node: None,
            layer: ar.module.clone(),
            name: ar.module.clone().unwrap_or_else(|| ar.id.clone()),
            all_reduce_module: ar.module.clone(),
            norm_module: None,
            pattern: None,
            fused: false,
            outputs: Vec::new(),
            hidden: None,
            backend: None,
            backend_reason: None,
            pattern_code: None,
            dispatch: Vec::new(),
            workspace_bytes: None,
            reason: None,
            notes: site_notes.remove(&inst).unwrap_or_default(),
        };
        if let Some(s) = chosen.get(&inst) {
            let name = pattern_name(s);
            let h = s.x_ty.shape.last().and_then(|d| d.as_const());
            entry.pattern = Some(name.clone());
            entry.hidden = h;
            entry.layer = site_module(graph, s);
            if let Some(n) = s.norm_node {
                let norm = graph.node(NodeId::new(n as usize));
                let end = norm.module.clone().unwrap_or_else(|| norm.id.clone());
                entry.name = format!("{} -> {end}", entry.name);
                entry.norm_module = norm.module.clone();
            }
            entry.outputs = s
                .ports
                .iter()
                .map(|p| output_name(p.output).into())
                .collect();
            if s.kind.twice {
                entry.notes.push(
                    "the RMSNorm rounds twice as written (Hugging Face's Llama order, \
                     round_T(round_T(h * r) * w)); the fused node does the same \
                     (norm_rounding = twice)"
                        .into(),
                );
            }
            let count = by_pattern.entry(name).or_default();
            count.total += 1;
            let d = h.and_then(|h| decisions.get(&(s.x_ty.dtype, h)));
            match (fused_id_of.get(&inst), d) {
                (Some(fid), Some(d)) => {
                    count.fused += 1;
                    entry.fused = true;
                    entry.fused_node = Some(fid.clone());
                    entry.backend_reason = Some(d.reason.clone());
                    if let Some(p) = &d.plan {
                        entry.backend = Some(p.backend().to_string());
                        entry.workspace_bytes = Some(p.workspace.total_bytes_per_rank);
                        entry.pattern_code = Some(pattern_code(s));
                        entry.dispatch = p
                            .dispatch
                            .iter()
                            .zip(d.range_reasons.iter().zip(&d.range_why))
                            .map(|(r, (why, short))| RangeReport {
                                min_tokens: r.min_tokens,
                                max_tokens: r.max_tokens,
                                strategy: strategy_name(r.strategy).into(),
                                required_bytes: r.required_bytes,
                                reason: why.clone(),
                                short_reason: short.clone(),
                            })
                            .collect();
                    }
                }
                (_, Some(d)) => entry.reason = Some(d.reason.clone()),
                _ => entry.reason = Some("the policy gave no decision for this size".into()),
            }
        } else {
            let mut reasons: Vec<String> = eg
                .analysis
                .refusals
                .get(&inst)
                .map(|r| r.iter().cloned().collect())
                .unwrap_or_default();
            reasons.extend(op_refusals.get(&inst).into_iter().flatten().cloned());
            reasons.extend(why_not.remove(&inst).unwrap_or_default());
            if reasons.is_empty() {
                reasons.push(no_match_reason(graph, inst));
            }
            entry.reason = Some(reasons.join("; "));
        }
        sites.push(entry);
    }
    let (unknown_collectives, mut warnings) = unknown_collective_warnings(graph);
    let enabled = target.requested_backend != arfuse_policy::RequestedBackend::Off;
    if enabled && fused_insts.is_empty() && fused_before == 0 {
        warnings.push(if ars.is_empty() && !unknown_collectives.is_empty() {
            format!(
                "fusion is enabled but the graph has no all-reduce arfuse understands, only \
                 collective-looking opaque ops ({}): nothing fused, and this is not a result \
                 to trust",
                unknown_collectives.join(", ")
            )
        } else if ars.is_empty() {
            "fusion is enabled but the graph has no all-reduce: nothing fused".to_string()
        } else {
            format!(
                "fusion is enabled but none of the {} all-reduce(s) was fused; see the reasons \
                 per all-reduce",
                ars.len()
            )
        });
    }
    let workspaces: Vec<WorkspaceReport> = planned
        .into_iter()
        .map(|w| WorkspaceReport {
            group: group.clone(),
            ..w
        })
        .collect();
    let report = Report {
        group,
        group_source,
        target: TargetReport {
            sm: target.sm,
            world_size: target.world_size,
            group_nodes: target.group_nodes,
            dtype: target.dtype.to_string(),
            requested_backend: target.requested_backend.to_string(),
            kernels: target.kernels.to_string(),
        },
        workspaces,
        all_reduces_seen: ars.len(),
        all_reduces_fused: fused_insts.len(),
        already_fused: fused_before,
        by_pattern,
        sites,
        unknown_collectives,
        warnings,
        notes,
        runner: runner_report,
    };
    Ok(Lowered { graph: out, report })
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

fn choose_group(graph: &Graph, options: &LowerOptions) -> Result<(String, String), LowerError> {
    if let Some(g) = &options.group {
        let found: BTreeSet<&str> = graph
            .nodes()
            .filter_map(|(_, n)| match &n.op {
                Op::AllReduce { group, .. } => Some(group.as_str()),
                Op::FusedAllreduceNorm(f) => Some(f.group.as_str()),
                _ => None,
            })
            .collect();
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
    // A fused node holds one all-reduce of its group: counting it keeps the inferred
    // group of a lowered graph the same as before lowering (idempotence).
    for (_, n) in graph.nodes() {
        match &n.op {
            Op::AllReduce { group, .. } => *counts.entry(group.as_str()).or_default() += 1,
            Op::FusedAllreduceNorm(f) => *counts.entry(f.group.as_str()).or_default() += 1,
            _ => {}
        }
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

fn output_name(o: FusedOutput) -> &'static str {
    match o {
        FusedOutput::Norm => "norm",
        FusedOutput::Residual => "residual",
        FusedOutput::Quant => "quant",
        FusedOutput::Scale => "scale",
    }
}

fn strategy_name(s: arfuse_ir::Strategy) -> &'static str {
    match s {
        arfuse_ir::Strategy::OneShot => "one_shot",
        arfuse_ir::Strategy::TwoShot => "two_shot",
        arfuse_ir::Strategy::Unfused => "unfused",
    }
}

/// `allreduce[+residual]+rms_norm[(gemma)][+<quant>]`.
fn pattern_name(s: &site::Site) -> String {
    let mut name = String::from("allreduce");
    if s.kind.residual {
        name.push_str("+residual");
    }
    name.push_str("+rms_norm");
    if f64::from_bits(s.kind.bias) == 1.0 {
        name.push_str("(gemma)");
    }
    if s.kind.twice {
        name.push_str("(round_twice)");
    }
    if s.kind.quant != QKind::None {
        name.push('+');
        name.push_str(s.kind.quant.name());
    }
    name
}

/// FlashInfer's pattern code (domain.md §1): 1 norm; 2/4 static FP8 without/with the
/// norm output; 3/5 NVFP4; 8/9 per-token-group FP8; 10/11 dynamic per-token FP8.
fn pattern_code(s: &site::Site) -> u32 {
    let norm = s.ports.iter().any(|p| p.output == FusedOutput::Norm);
    match s.kind.quant.to_ir() {
        FusedQuant::None => 1,
        FusedQuant::Fp8Static => {
            if norm {
                4
            } else {
                2
            }
        }
        FusedQuant::Nvfp4 { .. } => {
            if norm {
                5
            } else {
                3
            }
        }
        FusedQuant::Fp8PerTokenGroup { .. } => {
            if norm {
                9
            } else {
                8
            }
        }
        FusedQuant::Fp8PerToken => {
            if norm {
                11
            } else {
                10
            }
        }
    }
}

fn site_module(graph: &Graph, s: &site::Site) -> Option<String> {
    s.norm_node
        .and_then(|n| graph.node(NodeId::new(n as usize)).module.clone())
        .or_else(|| graph.node(NodeId::new(s.inst as usize)).module.clone())
}

/// The opaque ops of `graph` that look like collectives (by target, in graph order)
/// and one warning for each target, naming it, its node count and its first node.
fn unknown_collective_warnings(graph: &Graph) -> (Vec<String>, Vec<String>) {
    let mut seen: Vec<(String, usize, String)> = Vec::new();
    for (_, n) in graph.nodes() {
        let Op::Opaque { target, .. } = &n.op else {
            continue;
        };
        if !arfuse_ir::looks_like_collective(target) {
            continue;
        }
        match seen.iter_mut().find(|(t, _, _)| t == target) {
            Some(e) => e.1 += 1,
            None => seen.push((target.clone(), 1, n.id.clone())),
        }
    }
    let warnings = seen
        .iter()
        .map(|(t, k, first)| {
            format!(
                "{k} opaque `{t}` node(s) (first: `{first}`) look like a collective arfuse does \
                 not understand: the all-reduce sites they stand for are not seen, so sites \
                 may be missed (name a framework's all-reduce with --all-reduce-op NAME / \
                 arfuse::import::ImportOptions::all_reduce_ops)"
            )
        })
        .collect();
    (seen.into_iter().map(|(t, _, _)| t).collect(), warnings)
}

/// The refusals logged at an op, by instance, each naming the op's IR node.
fn name_op_refusals(
    eg: &analysis::FxGraph,
    index: &site::Index<'_>,
) -> BTreeMap<u32, BTreeSet<String>> {
    let mut out: BTreeMap<u32, BTreeSet<String>> = BTreeMap::new();
    for (inst, at, why) in &eg.analysis.refusals_at {
        let at = index
            .node_of(*at)
            .unwrap_or_else(|| "an op with no node of its own".into());
        out.entry(*inst)
            .or_default()
            .insert(format!("the norm at {at}: {why}"));
    }
    out
}

/// Why no rule matched an all-reduce: what its output feeds.
fn no_match_reason(graph: &Graph, inst: u32) -> String {
    let id = NodeId::new(inst as usize);
    let mut users: Vec<String> = graph
        .users(id)
        .map(|(u, _)| {
            let n = graph.node(u);
            format!("`{}` ({})", n.id, n.op.name())
        })
        .collect();
    users.sort();
    users.dedup();
    if users.is_empty() {
        return "the all-reduce output is not read by any node".into();
    }
    format!(
        "no residual add + RMSNorm follows the all-reduce: its output feeds {}",
        users.join(", ")
    )
}
