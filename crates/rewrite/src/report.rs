//! What the pass did: per all-reduce, fused (pattern, outputs, backend, dispatch,
//! workspace) or not (why); totals; warnings; the runner's stop reason and e-graph
//! size. Serialises to JSON (`--report json`) and prints as a table.

use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;

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
    /// The policy's reason for this range.
    pub reason: String,
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
    /// Dispatch by token range, when fused.
    pub dispatch: Vec<RangeReport>,
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
    /// Why the runner stopped (always `saturated` in a returned report).
    pub stop_reason: String,
    /// Iterations run.
    pub iterations: usize,
    /// E-nodes at the end.
    pub egraph_nodes: usize,
    /// E-classes at the end.
    pub egraph_classes: usize,
    /// The limits it ran under: iterations, e-nodes, seconds.
    pub limits: (usize, usize, u64),
}

/// What [`crate::lower`] did.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    /// The layer's tensor-parallel group the pass fused.
    pub group: String,
    /// How the group was chosen (given, or inferred and how).
    pub group_source: String,
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
    /// Warnings (nothing fused while fusion is enabled, a dtype mismatch, ...).
    pub warnings: Vec<String>,
    /// Notes that apply to the whole graph.
    pub notes: Vec<String>,
    /// The e-graph runner.
    pub runner: RunnerReport,
}

impl Report {
    /// The report as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

fn mib(b: u64) -> String {
    format!("{:.2} MiB", b as f64 / 1_048_576.0)
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "arfuse lower: group `{}` ({}); all-reduces fused {} / {}{}",
            self.group,
            self.group_source,
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
        if !self.by_pattern.is_empty() {
            writeln!(f, "  {:<48} {:>6} {:>6}", "pattern", "fused", "total")?;
            for (p, c) in &self.by_pattern {
                writeln!(f, "  {:<48} {:>6} {:>6}", p, c.fused, c.total)?;
            }
        }
        writeln!(
            f,
            "  {:<28} {:<34} {:<9} {:<22} {:<8} {:>12}",
            "all-reduce", "layer", "status", "outputs", "backend", "workspace"
        )?;
        for s in &self.sites {
            writeln!(
                f,
                "  {:<28} {:<34} {:<9} {:<22} {:<8} {:>12}",
                s.all_reduce,
                s.layer.as_deref().unwrap_or("-"),
                if s.fused { "fused" } else { "not fused" },
                if s.outputs.is_empty() {
                    "-".to_string()
                } else {
                    s.outputs.join(",")
                },
                s.backend.as_deref().unwrap_or("-"),
                s.workspace_bytes.map(mib).unwrap_or_else(|| "-".into()),
            )?;
            if let Some(p) = &s.pattern {
                writeln!(
                    f,
                    "      pattern {p}{}{}",
                    s.hidden.map(|h| format!(", H = {h}")).unwrap_or_default(),
                    s.pattern_code
                        .map(|c| format!(", pattern code {c}"))
                        .unwrap_or_default()
                )?;
            }
            if let Some(r) = &s.reason {
                writeln!(f, "      why not: {r}")?;
            }
            if let Some(r) = &s.backend_reason {
                writeln!(f, "      backend: {r}")?;
            }
            for r in &s.dispatch {
                writeln!(
                    f,
                    "      T={}..={} {} ({} bytes)",
                    r.min_tokens, r.max_tokens, r.strategy, r.required_bytes
                )?;
            }
            for n in &s.notes {
                writeln!(f, "      note: {n}")?;
            }
        }
        for w in &self.warnings {
            writeln!(f, "  warning: {w}")?;
        }
        for n in &self.notes {
            writeln!(f, "  note: {n}")?;
        }
        writeln!(
            f,
            "  e-graph: {} after {} iteration(s), {} e-nodes, {} e-classes (limits: {} iterations, {} e-nodes, {} s)",
            self.runner.stop_reason,
            self.runner.iterations,
            self.runner.egraph_nodes,
            self.runner.egraph_classes,
            self.runner.limits.0,
            self.runner.limits.1,
            self.runner.limits.2
        )
    }
}
