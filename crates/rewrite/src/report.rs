//! What the pass did: per all-reduce, fused (pattern, outputs, backend, dispatch,
//! workspace) or not (why); totals; warnings; the runner's stop reason and e-graph
//! size. Serialises to JSON (`--report json`) and prints as a table.

use crate::plan::{Planned, SiteDecision};
use crate::site::{Choice, Site};
use arfuse_ir::op::FusedOutput;
use arfuse_ir::{Graph, NodeId, Op};
use arfuse_policy::Target;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// Everything the report is made of: the outcomes of the pass's steps.
pub(crate) struct Outcome<'a> {
    /// The input graph.
    pub graph: &'a Graph,
    /// The target.
    pub target: &'a Target,
    /// The layer group and how it was chosen.
    pub group: String,
    /// How the group was chosen.
    pub group_source: String,
    /// The all-reduces of the input, by node index, in graph order.
    pub instances: &'a [u32],
    /// The opaque nodes of the input that look like collectives, in graph order.
    pub opaque_collectives: &'a [u32],
    /// The runner's outcome.
    pub runner: RunnerReport,
    /// The rules' refusals per all-reduce, as [`crate::site::Index::rule_refusals`]
    /// gives them.
    pub rule_refusals: BTreeMap<u32, Vec<String>>,
    /// The sites chosen and the candidates refused.
    pub choice: &'a Choice,
    /// The plan.
    pub planned: &'a Planned,
    /// The sites emitted as fused nodes (`crate::emit::select`), ascending.
    pub selected: &'a [u32],
    /// Fused nodes already in the input.
    pub already_fused: usize,
}

/// Step 6 of the pass, the report: the one place a [`Report`] is made, from the
/// outcomes of the other steps. Per all-reduce in graph order: fused (pattern,
/// outputs, backend, dispatch, workspace) or why not; the totals; the warnings. It
/// needs no emitted graph, so it can be built while the graph is emitted; the fused
/// nodes' ids are filled in after ([`name_fused_nodes`]).
pub(crate) fn build(o: Outcome<'_>) -> Report {
    let Outcome {
        graph,
        target,
        group,
        group_source,
        instances,
        opaque_collectives,
        runner,
        mut rule_refusals,
        choice,
        planned,
        selected,
        already_fused,
    } = o;
    let mut by_pattern: BTreeMap<String, PatternCount> = BTreeMap::new();
    let mut sites = Vec::with_capacity(instances.len());
    for &inst in instances {
        let notes = choice.notes.get(&inst).cloned().unwrap_or_default();
        let entry = match choice.chosen.get(&inst) {
            Some(s) => {
                let d = s
                    .hidden()
                    .and_then(|h| planned.decisions.get(&(s.x_ty.dtype, h)));
                let fused = selected.binary_search(&inst).is_ok();
                let pattern = s.pattern_name();
                let count = match by_pattern.get_mut(&pattern) {
                    Some(c) => c,
                    None => by_pattern.entry(pattern.clone()).or_default(),
                };
                count.total += 1;
                count.fused += usize::from(fused && d.is_some());
                matched_site(graph, s, pattern, notes, fused, d)
            }
            None => {
                let mut reasons = rule_refusals.remove(&inst).unwrap_or_default();
                reasons.extend(choice.why_not.get(&inst).into_iter().flatten().cloned());
                if reasons.is_empty() {
                    reasons.push(no_match_reason(graph, inst));
                }
                let mut entry = unmatched_site(graph, inst, notes);
                entry.reason = Some(reasons.join("; "));
                entry
            }
        };
        sites.push(entry);
    }
    let all_reduces_fused = selected.len();
    let (unknown_collectives, mut warnings) =
        unknown_collective_warnings(graph, opaque_collectives);
    let enabled = target.requested_backend != arfuse_policy::RequestedBackend::Off;
    if enabled && all_reduces_fused == 0 && already_fused == 0 {
        warnings.push(nothing_fused_warning(instances.len(), &unknown_collectives));
    }
    let workspaces = planned
        .workspaces
        .iter()
        .map(|w| WorkspaceReport {
            group: group.clone(),
            ..w.clone()
        })
        .collect();
    Report {
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
        all_reduces_seen: instances.len(),
        all_reduces_fused,
        already_fused,
        by_pattern,
        sites,
        unknown_collectives,
        warnings,
        notes: planned.notes.clone(),
        runner,
    }
}

/// Names the fused node of every fused site of `report` (built by [`build`] over
/// `instances`, one entry each, in graph order, ascending): its id in the emitted
/// graph, by all-reduce instance (`crate::emit::Emitted::fused_id_of`, whose ids it
/// takes). One walk over both, in instance order.
pub(crate) fn name_fused_nodes(
    report: &mut Report,
    instances: &[u32],
    fused_id_of: BTreeMap<u32, String>,
) {
    let mut ids = fused_id_of.into_iter().peekable();
    for (entry, &inst) in report.sites.iter_mut().zip(instances) {
        while ids.next_if(|(i, _)| *i < inst).is_some() {}
        let id = ids.next_if(|(i, _)| *i == inst).map(|(_, id)| id);
        if entry.fused {
            entry.fused_node = id;
        }
    }
}

/// The entry of an all-reduce no site was chosen for (its reason is set by the caller).
fn unmatched_site(graph: &Graph, inst: u32, notes: Vec<String>) -> SiteReport {
    let ar = graph.node(NodeId::new(inst as usize));
    let name = ar.module.clone().unwrap_or_else(|| ar.id.clone());
    site_entry(graph, inst, ar.module.clone(), name, notes)
}

/// An entry with its all-reduce's fields, `layer` and `name`, and nothing matched.
fn site_entry(
    graph: &Graph,
    inst: u32,
    layer: Option<String>,
    name: String,
    notes: Vec<String>,
) -> SiteReport {
    let ar = graph.node(NodeId::new(inst as usize));
    SiteReport {
        all_reduce: ar.id.clone(),
        fused_node: None,
        layer,
        name,
        all_reduce_module: ar.module.clone(),
        norm_module: None,
        pattern: None,
        fused: false,
        outputs: Vec::new(),
        hidden: None,
        backend: None,
        backend_reason: None,
        pattern_code: None,
        dispatch: Arc::default(),
        workspace_bytes: None,
        reason: None,
        notes,
    }
}

/// The entry of a chosen site: fused (when it was emitted and the policy decided its
/// size) with its plan, else the policy's reason.
fn matched_site(
    graph: &Graph,
    s: &Site,
    pattern: String,
    notes: Vec<String>,
    fused: bool,
    d: Option<&SiteDecision>,
) -> SiteReport {
    let ar = graph.node(NodeId::new(s.inst as usize));
    let start = ar.module.as_deref().unwrap_or(&ar.id);
    let norm = s.norm_node.map(|n| graph.node(NodeId::new(n as usize)));
    let name = match norm {
        Some(norm) => format!("{start} -> {}", norm.module.as_deref().unwrap_or(&norm.id)),
        None => start.to_string(),
    };
    let mut entry = site_entry(graph, s.inst, s.module.clone(), name, notes);
    entry.pattern = Some(pattern);
    entry.hidden = s.hidden();
    entry.norm_module = norm.and_then(|n| n.module.clone());
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
    if s.kind.f32_sum {
        entry.notes.push(
            "the RMSNorm normalises the unrounded f32 sum of the all-reduce output and \
             the residual, which is rounded only for the residual output (vLLM's native \
             fused_add_rms_norm); the fused node does the same (norm_input = f32_sum)"
                .into(),
        );
    }
    match (fused, d) {
        // The fused node is named once emitted (`name_fused_nodes`).
        (true, Some(d)) => {
            entry.fused = true;
            entry.backend_reason = Some(d.reason.clone());
            if let Some(p) = &d.plan {
                entry.backend = Some(p.backend().to_string());
                entry.workspace_bytes = Some(p.workspace.total_bytes_per_rank);
                entry.pattern_code = Some(s.pattern_code());
                entry.dispatch = d.dispatch.clone();
            }
        }
        (_, Some(d)) => entry.reason = Some(d.reason.clone()),
        _ => entry.reason = Some("the policy gave no decision for this size".into()),
    }
    entry
}

/// The warning when fusion is enabled and nothing was fused.
fn nothing_fused_warning(all_reduces: usize, unknown_collectives: &[String]) -> String {
    if all_reduces == 0 && !unknown_collectives.is_empty() {
        format!(
            "fusion is enabled but the graph has no all-reduce arfuse understands, only \
             collective-looking opaque ops ({}): nothing fused, and this is not a result \
             to trust",
            unknown_collectives.join(", ")
        )
    } else if all_reduces == 0 {
        "fusion is enabled but the graph has no all-reduce: nothing fused".to_string()
    } else {
        format!(
            "fusion is enabled but none of the {all_reduces} all-reduce(s) was fused; see the \
             reasons per all-reduce"
        )
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

pub(crate) fn strategy_name(s: arfuse_ir::Strategy) -> &'static str {
    match s {
        arfuse_ir::Strategy::OneShot => "one_shot",
        arfuse_ir::Strategy::TwoShot => "two_shot",
        arfuse_ir::Strategy::Unfused => "unfused",
    }
}

/// The targets of the opaque ops `nodes` of `graph` that look like collectives (in
/// graph order) and one warning for each target, naming it, its node count and its
/// first node.
fn unknown_collective_warnings(graph: &Graph, nodes: &[u32]) -> (Vec<String>, Vec<String>) {
    let mut seen: Vec<(String, usize, String)> = Vec::new();
    for &i in nodes {
        let n = graph.node(NodeId::new(i as usize));
        let Op::Opaque { target, .. } = &n.op else {
            continue;
        };
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

/// One token range of a fused site's dispatch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RangeReport {
    /// First token count, inclusive.
    pub min_tokens: u64,
    /// Last token count, inclusive.
    pub max_tokens: u64,
    /// `one_shot`, `two_shot` or `unfused`.
    pub strategy: String,
    /// Bytes of one buffer the largest T of the range needs (0 when unfused).
    pub required_bytes: u64,
    /// The range and the policy's reason for it, as one sentence.
    pub reason: String,
    /// The policy's reason alone (without the range and byte counts).
    pub short_reason: String,
}

/// One all-reduce of the input graph and what became of it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SiteReport {
    /// The all-reduce's node id in the input graph.
    pub all_reduce: String,
    /// The fused node's id in the output graph, when fused.
    pub fused_node: Option<String>,
    /// Module of the norm (or of the all-reduce), e.g. `model.layers.3.post_attention_layernorm`.
    pub layer: Option<String>,
    /// The site's name: `<all-reduce module> -> <norm module>` (node ids where a node
    /// has no module; the all-reduce alone when no norm was matched).
    pub name: String,
    /// Module of the all-reduce node.
    pub all_reduce_module: Option<String>,
    /// Module of the norm the chain ends in (node id of its last node when it has
    /// none), when a pattern matched.
    pub norm_module: Option<String>,
    /// The pattern matched (e.g. `allreduce+residual+rms_norm+fp8_per_token`), when one
    /// was.
    pub pattern: Option<String>,
    /// True when fused.
    pub fused: bool,
    /// Outputs the fused node writes (`norm`, `residual`, `quant`, `scale`).
    pub outputs: Vec<String>,
    /// Hidden size H (elements), when a pattern matched.
    pub hidden: Option<u64>,
    /// Backend (`trtllm`, `mnnvl`), when fused.
    pub backend: Option<String>,
    /// The policy's reason for the backend, when fused.
    pub backend_reason: Option<String>,
    /// FlashInfer pattern code, when fused.
    pub pattern_code: Option<u32>,
    /// Dispatch by token range, when fused (else empty). Every site with the same plan
    /// (activation dtype and hidden size) shares one list: a report of N such sites
    /// holds its reasons once, not N times.
    pub dispatch: Arc<[RangeReport]>,
    /// Workspace bytes per rank (the whole allocation), when fused.
    pub workspace_bytes: Option<u64>,
    /// Why not fused, in words a person can act on.
    pub reason: Option<String>,
    /// Notes (numerics of a decomposed norm, an epilogue left unfused, ...).
    pub notes: Vec<String>,
}

/// Fused and total sites of one pattern.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PatternCount {
    /// Sites fused.
    pub fused: usize,
    /// Sites matched (fused or refused by the policy or liveness).
    pub total: usize,
}

/// The e-graph runner's outcome.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RunnerReport {
    /// Why the runner stopped (always `saturated` in a returned report: every e-graph
    /// built saturated).
    pub stop_reason: String,
    /// Iterations run: the most any e-graph took (0 when none was built).
    pub iterations: usize,
    /// E-nodes at the end, summed over the e-graphs built (a node of a window's halo
    /// counts in every window holding it).
    pub egraph_nodes: usize,
    /// E-classes at the end, summed over the e-graphs built.
    pub egraph_classes: usize,
    /// E-graphs built: 1 for a graph of at most `LowerOptions::window_nodes` nodes
    /// (`whole_graph`), else one per window that holds an all-reduce (0 when none
    /// does).
    pub windows: usize,
    /// Whether the graph was one window, its e-graph the whole graph's; false when it
    /// was cut into windows.
    pub whole_graph: bool,
    /// The limits it ran under.
    pub limits: RunnerLimits,
}

/// The limits the e-graph runner runs under (`LowerOptions`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct RunnerLimits {
    /// Most iterations.
    pub iterations: usize,
    /// Most e-nodes.
    pub egraph_nodes: usize,
}

/// The target, as the report prints it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TargetReport {
    /// Compute capability (90, 100, ...).
    pub sm: u32,
    /// Ranks in the all-reduce group, W.
    pub world_size: u32,
    /// Nodes the group spans.
    pub group_nodes: u32,
    /// Activation dtype the target names.
    pub dtype: String,
    /// The backend requested (`auto`, `trtllm`, `mnnvl`, `off`).
    pub requested_backend: String,
    /// The kernels planned for (`arfuse`, `flashinfer`).
    pub kernels: String,
}

/// One workspace the plan sizes: per (group, backend, dtype), shared by every fused
/// site of that dtype and by the graphs named in `LowerOptions::shared_hidden_sizes`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WorkspaceReport {
    /// The group.
    pub group: String,
    /// Activation dtype.
    pub dtype: String,
    /// The kernels planned for (`arfuse`, `flashinfer`).
    pub kernels: String,
    /// Backend (`trtllm`, `mnnvl`); `None` when the policy does not fuse.
    pub backend: Option<String>,
    /// The policy's reason for the backend (or for no fusion).
    pub reason: String,
    /// The hidden size the workspace is sized for: the widest of this graph's and the
    /// shared ones that the fused kernels can run (a size they cannot run never uses the
    /// workspace; for a shared one, [`Report::notes`] says why). `None` when no workspace
    /// is planned.
    pub hidden: Option<u64>,
    /// This graph's hidden sizes planned on it (descending).
    pub own_hidden_sizes: Vec<u64>,
    /// Hidden sizes of other graphs sharing it (descending).
    pub shared_hidden_sizes: Vec<u64>,
    /// Largest fused T (tokens), M.
    pub max_token_num: u64,
    /// Bytes of ONE Lamport buffer (what a call's required bytes are checked against).
    pub lamport_buffer_bytes: Option<u64>,
    /// Bytes allocated per rank, the whole workspace.
    pub bytes_per_rank: Option<u64>,
    /// For arfuse's kernels: what FlashInfer's sizing would allocate per rank for the
    /// same target, backend, hidden size and M (bytes), for comparison.
    pub flashinfer_bytes_per_rank: Option<u64>,
}

/// What [`crate::lower`] did.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    /// The layer's tensor-parallel group the pass fused; empty when the graph has no
    /// all-reduce and none was given ([`Report::group_source`] says so).
    pub group: String,
    /// How the group was chosen (given, or inferred and how).
    pub group_source: String,
    /// The target planned for.
    pub target: TargetReport,
    /// The workspaces planned (one per activation dtype of the fused sites).
    pub workspaces: Vec<WorkspaceReport>,
    /// All-reduces in the input graph.
    pub all_reduces_seen: usize,
    /// All-reduces fused by this run.
    pub all_reduces_fused: usize,
    /// Fused nodes already present in the input (a lowered graph lowered again).
    pub already_fused: usize,
    /// Per pattern: fused / total.
    pub by_pattern: BTreeMap<String, PatternCount>,
    /// One entry per all-reduce, in graph order.
    pub sites: Vec<SiteReport>,
    /// Opaque ops whose target looks like a collective
    /// (`arfuse_ir::looks_like_collective`): arfuse does not see the all-reduces they
    /// may be, so sites may be missed. Each target once, in order; also in `warnings`.
    pub unknown_collectives: Vec<String>,
    /// Warnings (nothing fused while fusion is enabled, a dtype mismatch, ...).
    pub warnings: Vec<String>,
    /// Notes that apply to the whole graph.
    pub notes: Vec<String>,
    /// The e-graph runner.
    pub runner: RunnerReport,
}

impl Report {
    /// The table with one line per site (the default [`fmt::Display`] groups sites
    /// that differ only in their layer index).
    pub fn display_every_site(&self) -> impl fmt::Display + '_ {
        EverySite(self)
    }

    /// The sites table: one line per site when `every`,
    /// else one line per group of sites that share pattern, outputs, status and name
    /// up to their layer indices.
    fn sites_table(
        &self,
        f: &mut fmt::Formatter<'_>,
        root: Option<&str>,
        names: &[String],
        every: bool,
    ) -> fmt::Result {
        if self.sites.is_empty() {
            return Ok(());
        }
        let mut rows: Vec<SiteRow> = Vec::new();
        for (s, n) in self.sites.iter().zip(names) {
            let pattern = s.pattern.clone().unwrap_or_else(|| "-".into());
            let outputs = if s.outputs.is_empty() {
                "-".to_string()
            } else {
                s.outputs.join(",")
            };
            let status = if s.fused { "fused" } else { "not fused" };
            let (template, index) = layer_template(n);
            let same = |r: &&mut SiteRow| {
                !r.layers.is_empty()
                    && r.template == template
                    && r.pattern == pattern
                    && r.outputs == outputs
                    && r.status == status
            };
            match (every, index) {
                (false, Some(i)) => match rows.iter_mut().find(same) {
                    Some(r) => r.layers.push(i),
                    None => rows.push(SiteRow {
                        first: n.clone(),
                        template,
                        pattern,
                        outputs,
                        status,
                        layers: vec![i],
                    }),
                },
                _ => rows.push(SiteRow {
                    first: n.clone(),
                    template: n.clone(),
                    pattern,
                    outputs,
                    status,
                    layers: Vec::new(),
                }),
            }
        }
        // A group of one is shown with its own name.
        for r in &mut rows {
            if r.layers.len() == 1 {
                r.template = r.first.clone();
                r.layers.clear();
            }
        }
        let width =
            |k: fn(&SiteRow) -> usize, min: usize| rows.iter().map(k).max().unwrap_or(0).max(min);
        let wn = width(|r| r.template.len(), 4);
        let wp = width(|r| r.pattern.len(), 7);
        let wo = width(|r| r.outputs.len(), 7);
        let ws = width(|r| r.status.len(), 6);
        writeln!(
            f,
            "sites{}{}:",
            root.map(|r| format!(" (modules under `{r}`)"))
                .unwrap_or_default(),
            if every || rows.len() == self.sites.len() {
                String::new()
            } else {
                format!(
                    "; {} sites in {} lines, `*` a layer index (--sites: one line each)",
                    self.sites.len(),
                    rows.len()
                )
            }
        )?;
        writeln!(
            f,
            "  {:<wn$}  {:<wp$}  {:<wo$}  {:<ws$}  layers",
            "site", "pattern", "outputs", "status"
        )?;
        for r in &rows {
            let layers = if r.layers.is_empty() {
                "-".to_string()
            } else {
                format!("{} ({} sites)", index_ranges(&r.layers), r.layers.len())
            };
            writeln!(
                f,
                "  {:<wn$}  {:<wp$}  {:<wo$}  {:<ws$}  {layers}",
                r.template, r.pattern, r.outputs, r.status
            )?;
        }
        Ok(())
    }

    /// The report as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

/// `1179648` as `1,179,648`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `text` with every free-standing integer of four or more digits written with
/// thousands separators (`524288 bytes` -> `524,288 bytes`), so that the policy's
/// sentences read like the rest of the report. Digits inside names, decimals and
/// exponents (`fp8_e4m3`, `0.00001`, `1e-5`) are left alone.
fn group_digits(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len() + 8);
    let mut i = 0;
    let glued = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b'.' || c == b'-';
    while i < b.len() {
        if b[i].is_ascii_digit() && (i == 0 || !glued(b[i - 1])) {
            let mut j = i;
            while j < b.len() && b[j].is_ascii_digit() {
                j += 1;
            }
            // A trailing full stop ends a sentence; any other glued character means
            // the digits belong to a longer token.
            let after_ok = j == b.len()
                || !glued(b[j])
                || (b[j] == b'.' && (j + 1 == b.len() || b[j + 1] == b' '));
            let run = &text[i..j];
            match run.parse::<u64>() {
                Ok(n) if after_ok && run.len() >= 4 && !run.starts_with('0') => {
                    out.push_str(&thousands(n))
                }
                _ => out.push_str(run),
            }
            i = j;
        } else {
            let c = text[i..].chars().next().unwrap_or(' ');
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

fn opt_bytes(b: Option<u64>) -> String {
    b.map(|b| format!("{} bytes", thousands(b)))
        .unwrap_or_else(|| "-".into())
}

/// `T=a..=b` (or `T=a`).
fn tokens(lo: u64, hi: u64) -> String {
    if lo == hi {
        format!("T={}", thousands(lo))
    } else {
        format!("T={}..={}", thousands(lo), thousands(hi))
    }
}

/// Most site names listed on one "not fused" line.
const MAX_NAMES_PER_REASON: usize = 8;

/// The first dotted segment shared by every name's all-reduce and norm modules
/// (`model.`), trimmed for display when every one of them has more than one segment.
fn common_root(sites: &[SiteReport]) -> Option<String> {
    let mut root: Option<&str> = None;
    let mut any = false;
    for s in sites {
        for m in [s.all_reduce_module.as_deref(), s.norm_module.as_deref()]
            .into_iter()
            .flatten()
        {
            any = true;
            let (first, rest) = m.split_once('.')?;
            if rest.is_empty() {
                return None;
            }
            match root {
                None => root = Some(first),
                Some(r) if r == first => {}
                Some(_) => return None,
            }
        }
        // A name that falls back to a node id has no module to trim.
        s.all_reduce_module.as_ref()?;
    }
    if !any {
        return None;
    }
    root.map(|r| format!("{r}."))
}

fn display_name(s: &SiteReport, root: Option<&str>) -> String {
    match root {
        Some(r) => s
            .name
            .split(" -> ")
            .map(|part| part.strip_prefix(r).unwrap_or(part))
            .collect::<Vec<_>>()
            .join(" -> "),
        None => s.name.clone(),
    }
}

/// One line of the sites table: a site, or sites that differ only in layer indices.
struct SiteRow {
    /// The first site's name.
    first: String,
    /// The name shown: the first's, or with layer indices as `*` for a group.
    template: String,
    pattern: String,
    outputs: String,
    status: &'static str,
    /// The group's layer indices (empty: one site shown by its name).
    layers: Vec<u64>,
}

/// [`Report::display_every_site`].
struct EverySite<'a>(&'a Report);

impl fmt::Display for EverySite<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.render(f, true)
    }
}

/// The name with every all-digit dotted segment (`layers.3.mlp`) replaced by `*`, and
/// the first such number: `("layers.*.mlp", Some(3))`.
fn layer_template(name: &str) -> (String, Option<u64>) {
    let mut first = None;
    let parts: Vec<String> = name
        .split('.')
        .map(|seg| match seg.parse::<u64>() {
            Ok(i) if !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit()) => {
                first.get_or_insert(i);
                "*".to_string()
            }
            _ => seg.to_string(),
        })
        .collect();
    (parts.join("."), first)
}

/// `[0, 1, 2, 5, 7, 8]` as `0-2, 5, 7-8`.
fn index_ranges(idx: &[u64]) -> String {
    let mut sorted = idx.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            sorted[i].to_string()
        } else {
            format!("{}-{}", sorted[i], sorted[j])
        });
        i = j + 1;
    }
    out.join(", ")
}

/// A dispatch shared by sites: hidden size and ranges (bounds, strategy, bytes).
type DispatchKey = (u64, Vec<(u64, u64, String, u64)>);

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.render(f, false)
    }
}

impl Report {
    /// The table; `every_site`: one line per site, else sites grouped by layer.
    fn render(&self, f: &mut fmt::Formatter<'_>, every_site: bool) -> fmt::Result {
        let t = &self.target;
        writeln!(
            f,
            "arfuse lower: {} ({}); target SM {}, W={}, {} node{}, {}, backend {}, \
             {} kernels; all-reduces fused {} / {}{}",
            if self.group.is_empty() {
                "no group".to_string()
            } else {
                format!("group `{}`", self.group)
            },
            self.group_source,
            t.sm,
            t.world_size,
            t.group_nodes,
            if t.group_nodes == 1 { "" } else { "s" },
            t.dtype,
            t.requested_backend,
            t.kernels,
            self.all_reduces_fused,
            self.all_reduces_seen,
            if self.already_fused > 0 {
                format!(
                    "; {} fused node(s) already in the input",
                    self.already_fused
                )
            } else {
                String::new()
            }
        )?;

        // Workspaces.
        for w in &self.workspaces {
            match (&w.backend, w.hidden) {
                (Some(b), Some(h)) => {
                    writeln!(
                        f,
                        "workspace `{}` {b} {} ({}'s kernels): {}",
                        w.group,
                        w.dtype,
                        w.kernels,
                        group_digits(&w.reason)
                    )?;
                    let sizes = |v: &[u64]| {
                        v.iter()
                            .map(|h| thousands(*h))
                            .collect::<Vec<_>>()
                            .join(", ")
                    };
                    let shared = if w.shared_hidden_sizes.is_empty() {
                        String::new()
                    } else {
                        format!("; shared with H = {}", sizes(&w.shared_hidden_sizes))
                    };
                    writeln!(
                        f,
                        "  sized for H = {} (this graph: H = {}{shared})",
                        thousands(h),
                        sizes(&w.own_hidden_sizes)
                    )?;
                    writeln!(
                        f,
                        "  max_token_num {} tokens; one Lamport buffer {}; allocated per rank {}",
                        thousands(w.max_token_num),
                        opt_bytes(w.lamport_buffer_bytes),
                        opt_bytes(w.bytes_per_rank)
                    )?;
                    if let (Some(ours), Some(fi)) = (w.bytes_per_rank, w.flashinfer_bytes_per_rank)
                    {
                        writeln!(
                            f,
                            "  FlashInfer's sizing for the same M and H would allocate {} per \
                             rank (arfuse / FlashInfer = {:.3})",
                            opt_bytes(Some(fi)),
                            ours as f64 / fi as f64
                        )?;
                    }
                }
                _ => writeln!(
                    f,
                    "workspace `{}` {}: none, no fusion: {}",
                    w.group,
                    w.dtype,
                    group_digits(&w.reason)
                )?,
            }
        }

        // Dispatch blocks: one per distinct (H, ranges), in order of H then ranges.
        let mut blocks: BTreeMap<DispatchKey, (usize, Vec<String>)> = BTreeMap::new();
        for s in self.sites.iter().filter(|s| s.fused) {
            let key = (
                s.hidden.unwrap_or(0),
                s.dispatch
                    .iter()
                    .map(|r| {
                        (
                            r.min_tokens,
                            r.max_tokens,
                            r.strategy.clone(),
                            r.required_bytes,
                        )
                    })
                    .collect(),
            );
            let e = blocks.entry(key).or_insert_with(|| {
                (
                    0,
                    s.dispatch.iter().map(|r| r.short_reason.clone()).collect(),
                )
            });
            e.0 += 1;
        }
        for ((h, ranges), (count, why)) in &blocks {
            writeln!(
                f,
                "dispatch H = {} ({count} site{}):",
                thousands(*h),
                if *count == 1 { "" } else { "s" }
            )?;
            writeln!(
                f,
                "  {:<16} {:<9} {:>17}  why",
                "T (tokens)", "strategy", "buffer use, bytes"
            )?;
            for ((lo, hi, strategy, bytes), why) in ranges.iter().zip(why) {
                let need = if strategy == "unfused" {
                    "-".to_string()
                } else {
                    thousands(*bytes)
                };
                writeln!(
                    f,
                    "  {:<16} {:<9} {:>17}  {}",
                    tokens(*lo, *hi),
                    strategy,
                    need,
                    group_digits(why)
                )?;
            }
        }

        if !self.by_pattern.is_empty() {
            writeln!(f, "patterns:")?;
            let w = self.by_pattern.keys().map(|k| k.len()).max().unwrap_or(0);
            for (p, c) in &self.by_pattern {
                writeln!(f, "  {p:<w$}  {} / {} fused", c.fused, c.total)?;
            }
        }

        let root = common_root(&self.sites);
        let names: Vec<String> = self
            .sites
            .iter()
            .map(|s| display_name(s, root.as_deref()))
            .collect();
        self.sites_table(f, root.as_deref(), &names, every_site)?;

        // Not fused, grouped by reason (in order of first appearance).
        let mut reasons: Vec<(String, Vec<&str>)> = Vec::new();
        for (s, n) in self.sites.iter().zip(&names) {
            if s.fused {
                continue;
            }
            let r = s.reason.as_deref().unwrap_or("no reason recorded");
            match reasons.iter_mut().find(|(k, _)| k == r) {
                Some((_, v)) => v.push(n),
                None => reasons.push((r.to_string(), vec![n])),
            }
        }
        if !reasons.is_empty() {
            writeln!(f, "not fused:")?;
        }
        for (r, sites) in &reasons {
            let r = group_digits(r);
            if let [only] = sites.as_slice() {
                writeln!(f, "  {only}: {r}")?;
            } else {
                let mut list = sites
                    .iter()
                    .take(MAX_NAMES_PER_REASON)
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ");
                if sites.len() > MAX_NAMES_PER_REASON {
                    list.push_str(&format!(
                        ", and {} more",
                        sites.len() - MAX_NAMES_PER_REASON
                    ));
                }
                writeln!(f, "  {} sites: {r}: {list}", sites.len())?;
            }
        }

        for w in &self.warnings {
            writeln!(f, "warning: {}", group_digits(w))?;
        }
        for n in &self.notes {
            writeln!(f, "note: {}", group_digits(n))?;
        }
        // Per-site notes, each once, with how many sites it applies to.
        let mut notes: Vec<(&str, usize)> = Vec::new();
        for n in self.sites.iter().flat_map(|s| &s.notes) {
            match notes.iter_mut().find(|(k, _)| *k == n) {
                Some((_, c)) => *c += 1,
                None => notes.push((n, 1)),
            }
        }
        for (n, c) in &notes {
            writeln!(
                f,
                "note ({c} site{}): {}",
                if *c == 1 { "" } else { "s" },
                group_digits(n)
            )?;
        }
        let r = &self.runner;
        if !r.whole_graph && r.windows == 0 {
            writeln!(
                f,
                "e-graph: none built: no window of the graph holds an all-reduce (limits: {} iterations per window, {} e-nodes in all)",
                r.limits.iterations, r.limits.egraph_nodes
            )
        } else if !r.whole_graph {
            writeln!(
                f,
                "e-graph: {} in each of {} window(s), after at most {} iteration(s); {} e-nodes, {} e-classes in all (limits: {} iterations per window, {} e-nodes in all)",
                r.stop_reason,
                r.windows,
                r.iterations,
                r.egraph_nodes,
                r.egraph_classes,
                r.limits.iterations,
                r.limits.egraph_nodes
            )
        } else {
            writeln!(
                f,
                "e-graph: {} after {} iteration(s), {} e-nodes, {} e-classes (limits: {} iterations, {} e-nodes)",
                r.stop_reason,
                r.iterations,
                r.egraph_nodes,
                r.egraph_classes,
                r.limits.iterations,
                r.limits.egraph_nodes
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{group_digits, index_ranges, layer_template, thousands};

    #[test]
    fn layer_templates_and_index_ranges() {
        assert_eq!(
            layer_template("layers.3.self_attn -> layers.3.post_attention_layernorm"),
            (
                "layers.*.self_attn -> layers.*.post_attention_layernorm".to_string(),
                Some(3)
            )
        );
        assert_eq!(layer_template("norm"), ("norm".to_string(), None));
        assert_eq!(layer_template("v1.2x"), ("v1.2x".to_string(), None));
        assert_eq!(index_ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        assert_eq!(index_ranges(&[4]), "4");
    }

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_179_648), "1,179,648");
        assert_eq!(thousands(u64::MAX), "18,446,744,073,709,551,615");
    }

    #[test]
    fn digits_in_sentences_are_grouped_but_not_in_names() {
        assert_eq!(
            group_digits("fits one Lamport buffer of 1179648 bytes (T=40, H=6144)."),
            "fits one Lamport buffer of 1,179,648 bytes (T=40, H=6,144)."
        );
        assert_eq!(group_digits("ends at 8192."), "ends at 8,192.");
        assert_eq!(
            group_digits("eps 0.00001, 1e-5, fp8_e4m3, layers.1234.mlp, v1024x, 0123"),
            "eps 0.00001, 1e-5, fp8_e4m3, layers.1234.mlp, v1024x, 0123"
        );
        assert_eq!(group_digits("µ 12345 µ"), "µ 12,345 µ");
    }
}
