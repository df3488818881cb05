//! A thin adapter over `arfuse-policy`: one plan per activation dtype over every
//! hidden size the graph's sites have, then each site's dispatch, clipped to the token
//! counts the graph can run with, mapped onto the IR's [`FusedPlan`].

use crate::error::LowerError;
use crate::report::{strategy_name, RangeReport, WorkspaceReport};
use crate::site::Site;
use arfuse_ir::{DType, DispatchRange, FusedPlan, Graph, Op, TensorType};
use arfuse_policy::{Plan, Target};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// What [`plan_graph`] returns: the policy's decision per (activation dtype, hidden
/// size), the workspaces planned (their `group` filled in by the report), and the
/// notes that apply to the whole graph.
pub(crate) struct Planned {
    /// Per (dtype, H).
    pub decisions: BTreeMap<(DType, u64), SiteDecision>,
    /// One per activation dtype, in dtype order.
    pub workspaces: Vec<WorkspaceReport>,
    /// Notes for the report.
    pub notes: Vec<String>,
}

/// Step 4 of the pass, the plan: one plan per activation dtype over the hidden sizes
/// of the chosen sites and of the fused nodes already in the input (which share the
/// workspace; `fused` are their node indices, [`crate::convert::Collectives::fused`]),
/// with the largest token count the graph runs per (dtype, H).
///
/// Errors: those of [`decide`], and [`LowerError::StalePlan`] when a fused node of the
/// input carries a plan other than the one this target gets.
pub(crate) fn plan_graph(
    graph: &Graph,
    target: &Target,
    chosen: &BTreeMap<u32, Site>,
    fused: &[u32],
    shared: &[u64],
) -> Result<Planned, LowerError> {
    let mut keys: BTreeMap<(DType, u64), Option<u64>> = BTreeMap::new();
    // Sites in a row mostly share their type; adding a type again changes nothing.
    let mut last: Option<&TensorType> = None;
    for s in chosen.values() {
        if last != Some(&s.x_ty) {
            add_key(&mut keys, graph, &s.x_ty);
            last = Some(&s.x_ty);
        }
    }
    // Fused nodes already in the input share the workspace and must carry exactly the
    // plan this target gets (else the input was lowered for another machine).
    let mut existing = Vec::new();
    for &i in fused {
        let n = graph.node(arfuse_ir::NodeId::new(i as usize));
        if let Op::FusedAllreduceNorm(f) = &n.op {
            let Some(x) = n.inputs.first().and_then(|v| graph.value_type(*v)) else {
                continue;
            };
            let Some(h) = add_key(&mut keys, graph, x) else {
                continue;
            };
            existing.push((n.id.as_str(), x.dtype, h, f.plan.as_ref()));
        }
    }
    let mut notes = Vec::new();
    let (decisions, workspaces) = decide(target, &keys, shared, &mut notes)?;
    for (id, dtype, h, carried) in existing {
        match carried {
            None => notes.push(format!(
                "fused node `{id}` carries no plan; it is kept as written"
            )),
            Some(carried) => check_carried(&decisions, id, dtype, h, carried)?,
        }
    }
    Ok(Planned {
        decisions,
        workspaces,
        notes,
    })
}

/// Adds the (dtype, H) key of an all-reduce input of type `x` with its largest token
/// count (`None` when unknown: then the key's is unknown too); its H, or `None` when
/// H is not a constant (no key).
fn add_key(
    keys: &mut BTreeMap<(DType, u64), Option<u64>>,
    graph: &Graph,
    x: &TensorType,
) -> Option<u64> {
    let h = x.shape.last().and_then(|d| d.as_const())?;
    let t = max_tokens(graph, x);
    let e = keys.entry((x.dtype, h)).or_insert(t);
    *e = match (*e, t) {
        (Some(a), Some(b)) => Some(a.max(b)),
        _ => None,
    };
    Some(h)
}

/// The largest token count of a value of type `t` (product of the leading dims at the
/// symbols' maxima), when known.
fn max_tokens(graph: &Graph, t: &TensorType) -> Option<u64> {
    t.shape.leading()?.max_value(graph.symbols())
}

/// A fused node of the input must carry the plan this target gets for its (dtype, H),
/// its own pattern code aside.
fn check_carried(
    decisions: &BTreeMap<(DType, u64), SiteDecision>,
    id: &str,
    dtype: DType,
    h: u64,
    carried: &FusedPlan,
) -> Result<(), LowerError> {
    let fresh = decisions
        .get(&(dtype, h))
        .filter(|d| d.fused)
        .and_then(|d| d.plan.clone());
    let Some(mut p) = fresh else {
        return Err(LowerError::StalePlan {
            node: id.to_string(),
            detail: format!("this target fuses no {dtype} all-reduce of H = {h}"),
        });
    };
    p.pattern_code = carried.pattern_code;
    if p != *carried {
        return Err(LowerError::StalePlan {
            node: id.to_string(),
            detail: format!(
                "carried: max_token_num {}, {}; this target: max_token_num {}, {}",
                carried.max_token_num, carried.workspace, p.max_token_num, p.workspace
            ),
        });
    }
    Ok(())
}

/// What the policy says about one site.
#[derive(Clone, Debug)]
pub(crate) struct SiteDecision {
    /// Fused for some T.
    pub fused: bool,
    /// The policy's reason (the backend decision, or why no T fuses).
    pub reason: String,
    /// The plan the fused node carries (pattern code filled by the caller).
    pub plan: Option<FusedPlan>,
    /// The plan's dispatch as the report states it, with the policy's reason per range
    /// (empty when not fused): made once per decision, and every site it decides shares
    /// it ([`crate::SiteReport::dispatch`]).
    pub dispatch: Arc<[RangeReport]>,
}

/// What [`decide`] returns: per (dtype, hidden) the site decision, and the
/// workspaces planned (one per dtype, in dtype order).
/// Per (dtype, H) decision, and one workspace per activation dtype (its `group` is
/// filled in by the caller).
pub(crate) type Decisions = (BTreeMap<(DType, u64), SiteDecision>, Vec<WorkspaceReport>);

/// The plans for every (dtype, hidden) the sites need, with the graph's largest token
/// count per key (`None` when unknown). `shared` are the hidden sizes of other graphs
/// sharing the workspace (domain.md §5): each dtype's workspace is planned for the
/// widest of them and of the sites' own.
///
/// Errors: [`LowerError::Policy`] when the target itself is wrong (an invalid field,
/// an explicit backend the machine cannot run) or a shared hidden size is invalid; a
/// hidden size of this graph the policy rejects only leaves its sites unfused, with the
/// reason.
fn decide(
    target: &Target,
    keys: &BTreeMap<(DType, u64), Option<u64>>,
    shared: &[u64],
    notes: &mut Vec<String>,
) -> Result<Decisions, LowerError> {
    let mut out = BTreeMap::new();
    let mut workspaces = Vec::new();
    let dtypes: BTreeSet<DType> = keys.keys().map(|k| k.0).collect();
    for dtype in dtypes {
        let Some(act) = dtype.activation() else {
            for (&(d, h), _) in keys.iter().filter(|(k, _)| k.0 == dtype) {
                out.insert(
                    (d, h),
                    refuse(format!("activation dtype {d} has no fused kernel")),
                );
            }
            continue;
        };
        let mut t = target.clone();
        if t.dtype != act {
            notes.push(format!(
                "the target says activations are {}, the graph's are {act}; planned for {act}",
                t.dtype
            ));
            t.dtype = act;
        }
        let mut hiddens: Vec<u64> = Vec::new();
        for (&(_, h), _) in keys.iter().filter(|(k, _)| k.0 == dtype) {
            match arfuse_policy::check_hidden(h, act) {
                Ok(()) => hiddens.push(h),
                Err(e) => {
                    out.insert((dtype, h), refuse(e.to_string()));
                }
            }
        }
        if hiddens.is_empty() {
            continue;
        }
        hiddens.sort_unstable_by(|a, b| b.cmp(a));
        let mut shared_sizes: Vec<u64> = shared.to_vec();
        for &h in &shared_sizes {
            arfuse_policy::check_hidden(h, act)?;
        }
        shared_sizes.sort_unstable_by(|a, b| b.cmp(a));
        shared_sizes.dedup();
        let mut all: Vec<u64> = hiddens.iter().chain(&shared_sizes).copied().collect();
        all.sort_unstable_by(|a, b| b.cmp(a));
        all.dedup();
        let plan = arfuse_policy::plan(&t, &all)?;
        // The planner's own notes (size-table entry, capture sizes beyond the engine's
        // max, PDL, ...) belong in the report, each once: a note already there (another
        // dtype's plan gave it word for word) is not repeated. The decision and the
        // workspace have their own report lines; skip their notes.
        for n in &plan.notes {
            let own_line = n.starts_with("fuse with")
                || n.starts_with("no fusion")
                || n.contains(" workspace (W=");
            if !own_line && !notes.contains(n) {
                notes.push(n.clone());
            }
        }
        let ws = plan.workspace.as_ref();
        if let Some(ws) = ws {
            notes.extend(unfusable_shared_notes(&t, &shared_sizes, ws.hidden)?);
        }
        workspaces.push(WorkspaceReport {
            group: String::new(),
            dtype: dtype.to_string(),
            kernels: t.kernels.to_string(),
            backend: plan
                .backend()
                .filter(|_| ws.is_some())
                .map(|b| b.to_string()),
            reason: plan.decision.reason().to_string(),
            hidden: ws.map(|w| w.hidden),
            own_hidden_sizes: hiddens.clone(),
            shared_hidden_sizes: shared_sizes,
            max_token_num: plan.max_token_num,
            lamport_buffer_bytes: ws.map(|w| w.lamport_buffer_bytes),
            bytes_per_rank: ws.map(|w| w.total_bytes_per_rank),
            flashinfer_bytes_per_rank: plan
                .flashinfer_workspace
                .as_ref()
                .map(|w| w.total_bytes_per_rank),
        });
        for h in hiddens {
            let tmax = keys.get(&(dtype, h)).copied().flatten();
            out.insert((dtype, h), site(&plan, h, tmax));
        }
    }
    Ok((out, workspaces))
}

/// One note per shared hidden size (`shared`, of other graphs sharing the workspace)
/// that `target`'s kernels cannot run at its dtype: its all-reduces stay unfused, so it
/// does not size the workspace planned for that dtype (of `ws_hidden` elements); without
/// the note the report would list it as shared while sizing for a narrower H. Called only
/// when a workspace is planned (with none, nothing fuses, for the plan's own reason).
///
/// Errors: [`LowerError::Policy`] when a row's byte count overflows (checked before).
fn unfusable_shared_notes(
    target: &Target,
    shared: &[u64],
    ws_hidden: u64,
) -> Result<Vec<String>, LowerError> {
    let mut notes = Vec::new();
    for &h in shared {
        let Some(why) = arfuse_policy::row_unsupported_reason(target.kernels, h, target.dtype)?
        else {
            continue;
        };
        notes.push(format!(
            "shared hidden size H = {h} is not fused: {why}; the all-reduces of a graph of \
             that size stay unfused and do not use the {} workspace, which is sized for \
             H = {ws_hidden}",
            target.dtype
        ));
    }
    Ok(notes)
}

fn refuse(reason: String) -> SiteDecision {
    SiteDecision {
        fused: false,
        reason,
        plan: None,
        dispatch: Arc::default(),
    }
}

fn site(plan: &Plan, h: u64, tmax: Option<u64>) -> SiteDecision {
    let reason = plan.decision.reason().to_string();
    let (Some(_), Some(ws)) = (plan.backend(), plan.workspace.as_ref()) else {
        return refuse(format!("no fusion: {reason}"));
    };
    let ranges = match plan.dispatch_for_hidden(h) {
        Ok(r) => r,
        Err(e) => return refuse(e.to_string()),
    };
    // Ranges clipped to the token counts the graph can run with; a clipped fused range
    // states the bytes of its own last T (the IR checks that on load).
    let cap = tmax.unwrap_or(u64::MAX);
    let mut clipped = Vec::new();
    for mut r in ranges.into_iter().filter(|r| r.lo <= cap) {
        if r.hi > cap {
            r.hi = cap;
            if r.strategy.is_fused() {
                match ws.required_bytes(r.strategy, r.hi, h) {
                    Ok(b) => r.required_bytes_max = b,
                    Err(e) => return refuse(e.to_string()),
                }
            }
        }
        clipped.push(r);
    }
    if !clipped.iter().any(|r| r.strategy.is_fused()) {
        let why = clipped
            .iter()
            .map(|r| r.reason.clone())
            .next()
            .unwrap_or_else(|| reason.clone());
        return refuse(format!("no token count is fused at H = {h}: {why}"));
    }
    let dispatch = clipped.iter().map(DispatchRange::from).collect();
    SiteDecision {
        fused: true,
        reason,
        plan: Some(FusedPlan {
            pattern_code: 0,
            max_token_num: plan.max_token_num,
            workspace: ws.clone(),
            dispatch,
        }),
        dispatch: clipped
            .iter()
            .map(|r| RangeReport {
                min_tokens: r.lo,
                max_tokens: r.hi,
                strategy: strategy_name(r.strategy).into(),
                required_bytes: r.required_bytes_max,
                reason: r.to_string(),
                short_reason: r.reason.clone(),
            })
            .collect(),
    }
}

/// Whether an NVFP4 epilogue may be fused on this target (SM >= 100).
pub(crate) fn nvfp4_ok(target: &Target) -> bool {
    arfuse_policy::nvfp4_quant_supported(target.sm)
}
