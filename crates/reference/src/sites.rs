//! The per-site equivalence check: every fused site of a lowered graph, at the graph's
//! real hidden size, without evaluating the whole model.
//!
//! [`crate::check_equivalent`] evaluates both graphs whole, which a real model cannot afford
//! (an embedding table alone exceeds [`crate::eval::MAX_TENSOR_ELEMENTS`]).
//! [`check_sites`] proves the same thing in two parts:
//!
//! 1. The wiring ([`check_wiring`]): every node the lowering kept (same id, op and
//!    output types) reads what it read in the original graph, or a fused output that
//!    replaces exactly that value; every fused input reads the value its [`SiteMap`]
//!    names; every original node is kept, replaced by a site, or a constant only
//!    replaced nodes read; every node new in the lowered graph is a fused node with a
//!    map or a reshape. So the lowered graph is the original with each chain swapped
//!    for its fused node, and nothing else changed.
//! 2. The numerics ([`cut_site`], then the comparison of [`crate::check_equivalent`] on the two cuts): each
//!    site's chain (the original nodes it replaced, with every value they read from
//!    outside as an input of the cut, constants copied) against the fused node alone
//!    with the same inputs, at the graph's own shapes, on W ranks with random per-rank
//!    activations, bit for bit under the rounding contract, at the token counts of the
//!    site's plan ([`site_token_counts`]).
//!
//! Together: each output of the lowered graph is the original's, bit for bit, for the
//! inputs and token counts checked.

use crate::equiv::{check_cut, validate_pair, EquivalenceReport};
use crate::error::{ReferenceError, Result};
use crate::eval::token_symbols;
use arfuse_ir::{
    FusedPlan, Graph, InputKind, Node, NodeId, NodeOutput, Op, SiteMap, Strategy, TensorType, Value,
};
use rayon::prelude::*;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;

/// One site's chain and fused node, each as a graph of its own with the same inputs
/// (ids and types): what [`check_sites`] evaluates.
#[derive(Clone, Debug)]
pub struct SiteCut {
    /// The original nodes the site replaced, their outside operands as inputs (constants
    /// copied); outputs: every value the fused node replaces, in [`SiteMap::outputs`]
    /// order.
    pub original: Graph,
    /// The fused node alone (plus the reshapes it reads or is read through), same
    /// inputs and outputs.
    pub lowered: Graph,
}

/// The check of one site.
#[derive(Clone, Debug, PartialEq)]
pub struct SiteCheck {
    /// The fused node's id in the lowered graph.
    pub fused_node: String,
    /// The all-reduce it replaced (original id).
    pub all_reduce: String,
    /// Hidden size H of the all-reduce input (elements), when constant.
    pub hidden: Option<u64>,
    /// The comparison at each token count checked (its `per_tokens` say which).
    pub report: EquivalenceReport,
    /// Token counts asked for but not checked because T * H * W is above
    /// [`SITE_ELEMENT_BUDGET`] (a T above the graph's token range or the plan's last T is
    /// not asked for: it never runs).
    pub skipped_tokens: Vec<u64>,
}

impl SiteCheck {
    /// The token counts checked, in order.
    pub fn tokens(&self) -> Vec<u64> {
        self.report.per_tokens.iter().map(|t| t.tokens).collect()
    }
}

/// Result of [`check_sites`].
#[derive(Clone, Debug, PartialEq)]
pub struct SitesReport {
    /// The contract both sides were evaluated under.
    pub contract: &'static str,
    /// World size W.
    pub world_size: u32,
    /// The seed of the inputs.
    pub seed: u64,
    /// Nodes the lowering kept whose inputs [`check_wiring`] checked.
    pub kept_nodes: usize,
    /// One per site, in the order given.
    pub sites: Vec<SiteCheck>,
}

impl SitesReport {
    /// True when every output of every site at every token count is bit-exact.
    pub fn is_equivalent(&self) -> bool {
        self.sites.iter().all(|s| s.report.is_equivalent())
    }

    /// The sites that are not.
    pub fn failures(&self) -> Vec<&SiteCheck> {
        self.sites
            .iter()
            .filter(|s| !s.report.is_equivalent())
            .collect()
    }
}

/// Sites checked alike: the same hidden size, token counts and skipped token counts.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SiteGroup {
    /// Hidden size H (elements), when constant.
    pub hidden: Option<u64>,
    /// The token counts checked.
    pub tokens: Vec<u64>,
    /// The token counts left out ([`SiteCheck::skipped_tokens`]).
    pub skipped_tokens: Vec<u64>,
    /// The fused node of each site of the group, in site order.
    pub fused_nodes: Vec<String>,
    /// How many of them were bit-exact at every T.
    pub bit_exact: usize,
}

impl SitesReport {
    /// The sites grouped by hidden size, token counts and skipped token counts, in
    /// that order.
    pub fn groups(&self) -> Vec<SiteGroup> {
        type Key = (Option<u64>, Vec<u64>, Vec<u64>);
        let mut groups: BTreeMap<Key, (Vec<String>, usize)> = BTreeMap::new();
        for s in &self.sites {
            let g = groups
                .entry((s.hidden, s.tokens(), s.skipped_tokens.clone()))
                .or_default();
            g.0.push(s.fused_node.clone());
            g.1 += usize::from(s.report.is_equivalent());
        }
        groups
            .into_iter()
            .map(
                |((hidden, tokens, skipped_tokens), (fused_nodes, bit_exact))| SiteGroup {
                    hidden,
                    tokens,
                    skipped_tokens,
                    fused_nodes,
                    bit_exact,
                },
            )
            .collect()
    }
}

impl fmt::Display for SitesReport {
    /// One line for the whole check, then one per group of sites ([`Self::groups`]),
    /// then every failing site's comparison.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let failed = self.failures();
        let verdict = match (self.sites.is_empty(), failed.is_empty()) {
            (true, _) => "no fused site to check",
            (false, true) => "EQUIVALENT",
            (false, false) => "NOT EQUIVALENT",
        };
        writeln!(
            f,
            "{} | W = {} | seed = {} | {} fused site(s), {} kept node(s) read what they read before | {verdict}",
            self.contract,
            self.world_size,
            self.seed,
            self.sites.len(),
            self.kept_nodes,
        )?;
        let list = |t: &[u64]| {
            t.iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        for g in self.groups() {
            let h = g.hidden.map_or("?".to_string(), |h| h.to_string());
            write!(
                f,
                "  H = {h}, T = {}: {} of {} sites bit-exact",
                list(&g.tokens),
                g.bit_exact,
                g.fused_nodes.len()
            )?;
            if g.fused_nodes.len() <= 4 {
                write!(f, " ({})", g.fused_nodes.join(", "))?;
            }
            if !g.skipped_tokens.is_empty() {
                write!(
                    f,
                    " (not checked: T = {}, T*H*W above the check's {SITE_ELEMENT_BUDGET} elements)",
                    list(&g.skipped_tokens)
                )?;
            }
            writeln!(f)?;
        }
        for s in failed {
            writeln!(f, "site {} (all-reduce {}):", s.fused_node, s.all_reduce)?;
            write!(f, "{}", s.report)?;
        }
        Ok(())
    }
}

/// Most elements (T * H * W: one activation over all ranks) a site is checked at; a
/// larger T is left out and listed in [`SiteCheck::skipped_tokens`]. Each row of a
/// chain is computed independently of the others, so a large T adds rows, not new
/// arithmetic; the budget keeps one site's tensors near 32 MiB each.
pub const SITE_ELEMENT_BUDGET: u64 = 1 << 23;

/// Which token counts [`check_sites`] runs each site at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SiteTokens<'a> {
    /// Every site at every T of its plan ([`site_token_counts`]).
    Plan,
    /// Every site at T = 1 and T = W; the first site of each kind (the same fused
    /// attributes and plan, the same input and output types: in a decoder, one per
    /// distinct layer pattern) at every T of its plan. A model then costs about one
    /// layer at every T plus one token row per site.
    PlanPerKind,
    /// Every site at these T.
    Given(&'a [u64]),
}

/// The token counts a site with `plan` is checked at: 1; the first and last T of every
/// fused range and the first T of every unfused range (so every strategy switch is
/// crossed); W - 1 and W where they are at most the largest of those.
pub fn site_token_counts(plan: &FusedPlan, world_size: u32) -> Vec<u64> {
    let mut t: BTreeSet<u64> = BTreeSet::from([1]);
    for r in &plan.dispatch {
        t.insert(r.min_tokens);
        if r.strategy != Strategy::Unfused {
            t.insert(r.max_tokens);
        }
    }
    let top = t.last().copied().unwrap_or(1);
    let w = u64::from(world_size);
    for extra in [w.saturating_sub(1), w] {
        if extra >= 1 && extra <= top {
            t.insert(extra);
        }
    }
    t.into_iter().collect()
}

/// Checks every site of `sites` (from `arfuse_rewrite::Lowered::sites`) of `lowered`
/// against `original` on `world_size` virtual ranks: the wiring of the whole lowered
/// graph, then each site's chain against its fused node (see the module doc).
///
/// `tokens` says at which T ([`SiteTokens`]). A T above the graph's token range or
/// above the last T of the site's plan is left out, and so is a T with T * H * W above [`SITE_ELEMENT_BUDGET`] (listed in
/// [`SiteCheck::skipped_tokens`]); the report says which T were checked. T from 1 is
/// checked whatever the graph's range starts at, as the plan dispatches from T = 1.
///
/// Memory: one site's tensors at a time per worker thread (a chain at H = 16,384, T =
/// 17, W = 8 is a few MiB).
///
/// Errors: [`ReferenceError::NotComparable`] naming the node when `lowered` is not a
/// lowering of `original` as `sites` describe it, [`ReferenceError::InvalidParameter`]
/// when a site has no token count to check or its plan is for another world size, and
/// any evaluation error of a cut.
pub fn check_sites(
    original: &Graph,
    lowered: &Graph,
    sites: &[SiteMap],
    world_size: u32,
    tokens: SiteTokens<'_>,
    seed: u64,
) -> Result<SitesReport> {
    validate_pair(original, lowered)?;
    let kept_nodes = check_wiring(original, lowered, sites)?;
    let first_of_kind = first_of_kind(original, lowered, sites);
    let checks: Vec<Result<SiteCheck>> = sites
        .par_iter()
        .zip(first_of_kind)
        .map(|(site, first)| check_one(original, lowered, site, world_size, tokens, first, seed))
        .collect();
    Ok(SitesReport {
        contract: crate::contract::CONTRACT_NAME,
        world_size,
        seed,
        kept_nodes,
        sites: checks.into_iter().collect::<Result<Vec<_>>>()?,
    })
}

/// For each site, whether it is the first of its kind: no earlier site has the same
/// fused node attributes (plan included) and the same input and output types.
fn first_of_kind(original: &Graph, lowered: &Graph, sites: &[SiteMap]) -> Vec<bool> {
    let mut seen: HashSet<String> = HashSet::new();
    sites
        .iter()
        .map(|s| {
            let op = lowered
                .find(&s.fused_node)
                .map(|id| format!("{:?}", lowered.node(id).op))
                .unwrap_or_default();
            let types: Vec<String> = s
                .inputs
                .iter()
                .map(|i| {
                    let t = i
                        .value
                        .resolve(original)
                        .and_then(|v| original.value_type(v));
                    format!("{:?}/{:?}", t, i.view)
                })
                .chain(s.outputs.iter().flat_map(|o| {
                    o.replaces.iter().map(|r| {
                        format!(
                            "{:?}",
                            r.resolve(original).and_then(|v| original.value_type(v))
                        )
                    })
                }))
                .collect();
            seen.insert(format!("{op}|{}", types.join("|")))
        })
        .collect()
}

fn check_one(
    original: &Graph,
    lowered: &Graph,
    site: &SiteMap,
    world_size: u32,
    tokens: SiteTokens<'_>,
    first_of_kind: bool,
    seed: u64,
) -> Result<SiteCheck> {
    let cut = cut_site(original, lowered, site)?;
    let fused = fused_node(lowered, site)?;
    let plan = match &lowered.node(fused).op {
        Op::FusedAllreduceNorm(attrs) => attrs.plan.as_ref(),
        _ => None,
    };
    let w = u64::from(world_size.max(1));
    let wanted = match (tokens, plan) {
        (SiteTokens::Given(t), _) => t.to_vec(),
        (SiteTokens::PlanPerKind, _) if !first_of_kind => {
            if w == 1 {
                vec![1]
            } else {
                vec![1, w]
            }
        }
        (_, Some(plan)) => site_token_counts(plan, world_size),
        (_, None) => vec![1, w],
    };
    let x = lowered.node(fused).inputs.first().copied();
    let hidden = x
        .and_then(|v| lowered.value_type(v))
        .and_then(|t| t.shape.last())
        .and_then(|d| d.as_const());
    if let Some(plan) = plan.filter(|p| p.workspace.world_size != world_size) {
        return Err(ReferenceError::InvalidParameter(format!(
            "site {}: checked for world size {world_size}, but its plan is for {}",
            site.fused_node, plan.workspace.world_size
        )));
    }
    // Neither above the graph's token range nor above the plan's last T.
    let max = token_max(&cut.original).min(
        plan.and_then(|p| p.dispatch.last())
            .map_or(u64::MAX, |r| r.max_tokens),
    );
    let fits = |t: &u64| {
        t.checked_mul(hidden.unwrap_or(1))
            .and_then(|e| e.checked_mul(w))
            .is_some_and(|e| e <= SITE_ELEMENT_BUDGET)
    };
    let (tokens, skipped_tokens): (Vec<u64>, Vec<u64>) =
        wanted.into_iter().filter(|&t| t <= max).partition(fits);
    if tokens.is_empty() {
        return Err(ReferenceError::InvalidParameter(format!(
            "site {}: no token count to check (asked for {skipped_tokens:?}; the graph's \
             largest is {max}, the check's budget T * H * W <= {SITE_ELEMENT_BUDGET})",
            site.fused_node
        )));
    }
    let report = check_cut(&cut.original, &cut.lowered, world_size, &tokens, seed)?;
    Ok(SiteCheck {
        fused_node: site.fused_node.clone(),
        all_reduce: site.all_reduce.clone(),
        hidden,
        report,
        skipped_tokens,
    })
}

/// The largest token count the graph's token symbol allows.
fn token_max(g: &Graph) -> u64 {
    token_symbols(g)
        .into_iter()
        .filter(|(_, one)| !one)
        .filter_map(|(name, _)| g.symbols().get(&name).map(|r| r.max))
        .min()
        .unwrap_or(u64::MAX)
}

fn fused_node(lowered: &Graph, site: &SiteMap) -> Result<NodeId> {
    lowered
        .find(&site.fused_node)
        .filter(|&id| matches!(lowered.node(id).op, Op::FusedAllreduceNorm(_)))
        .ok_or_else(|| {
            ReferenceError::NotComparable(format!(
                "site {}: no fused node with that id in the lowered graph",
                site.fused_node
            ))
        })
}

fn resolve(g: &Graph, v: &NodeOutput, what: &str, site: &SiteMap) -> Result<Value> {
    v.resolve(g).ok_or_else(|| {
        ReferenceError::NotComparable(format!(
            "site {}: {what} {v} is not in the original graph",
            site.fused_node
        ))
    })
}

/// Cuts `site` out of both graphs (see [`SiteCut`]). The cuts keep the graphs' symbols,
/// with the token symbol's range starting at 1.
///
/// Errors: [`ReferenceError::NotComparable`] when a replaced node, input or replaced
/// value is missing, when a replaced value is not computed by the chain, or when the
/// fused node is not in `lowered`.
pub fn cut_site(original: &Graph, lowered: &Graph, site: &SiteMap) -> Result<SiteCut> {
    let mut region: Vec<NodeId> = Vec::with_capacity(site.replaced_nodes.len());
    for id in &site.replaced_nodes {
        region.push(original.find(id).ok_or_else(|| {
            ReferenceError::NotComparable(format!(
                "site {}: replaced node {id:?} is not in the original graph",
                site.fused_node
            ))
        })?);
    }
    region.sort_unstable();
    let mut site_inputs = Vec::with_capacity(site.inputs.len());
    for i in &site.inputs {
        site_inputs.push(resolve(original, &i.value, "input", site)?);
    }
    let nodes = with_input_views(original, &region, &site_inputs);
    let in_cut: HashSet<NodeId> = nodes.iter().copied().collect();

    // Every value the cut's nodes or the fused node read from outside them, in order.
    let mut boundary: Vec<Value> = Vec::new();
    let mut seen: HashSet<Value> = HashSet::new();
    let reads = nodes
        .iter()
        .flat_map(|&n| original.node(n).inputs.iter().copied())
        .collect::<Vec<_>>();
    for v in reads.into_iter().chain(site_inputs.iter().copied()) {
        if !in_cut.contains(&v.node) && seen.insert(v) {
            boundary.push(v);
        }
    }
    let mut taken: HashSet<String> = nodes.iter().map(|&n| original.node(n).id.clone()).collect();
    let leaves: Vec<(Value, Node)> = boundary
        .iter()
        .map(|&v| Ok((v, leaf(original, v, &mut taken)?)))
        .collect::<Result<_>>()?;

    let original_cut = original_side(original, site, &nodes, &region, &leaves)?;
    let lowered_cut = lowered_side(original, lowered, site, &site_inputs, &leaves)?;
    Ok(SiteCut {
        original: original_cut,
        lowered: lowered_cut,
    })
}

/// Most view nodes between a fused input and the value the chain reads.
const MAX_VIEW_CHAIN: usize = 16;

/// A node that forwards its one input's elements: a reshape, or a wait of a
/// functional collective ([`Graph::is_forwarding_wait`]).
fn is_view(g: &Graph, n: NodeId) -> bool {
    match g.node(n).op {
        Op::Reshape => g.node(n).inputs.len() == 1,
        _ => g.is_forwarding_wait(n),
    }
}

/// The chain's nodes plus the view nodes outside it that lead from a fused input to a
/// value the chain reads (the pass saw through them, so the fused node reads the value
/// before the views while the chain reads it after): the cut recomputes those views
/// instead of taking their results as unrelated inputs. In graph order.
fn with_input_views(g: &Graph, region: &[NodeId], site_inputs: &[Value]) -> Vec<NodeId> {
    let in_region: HashSet<NodeId> = region.iter().copied().collect();
    let targets: HashSet<Value> = site_inputs.iter().copied().collect();
    let mut nodes: BTreeSet<NodeId> = region.iter().copied().collect();
    for &n in region {
        for &v in &g.node(n).inputs {
            if in_region.contains(&v.node) || targets.contains(&v) {
                continue;
            }
            let mut chain = Vec::new();
            let mut u = v;
            while chain.len() < MAX_VIEW_CHAIN && is_view(g, u.node) {
                chain.push(u.node);
                u = g.node(u.node).inputs[0];
                if targets.contains(&u) {
                    nodes.extend(chain.drain(..));
                    break;
                }
            }
        }
    }
    nodes.into_iter().collect()
}

/// The node that stands for outside value `v` in a cut: a copy of a constant, else an
/// input of the producer's kind (activation when it is computed).
fn leaf(g: &Graph, v: Value, taken: &mut HashSet<String>) -> Result<Node> {
    let p = g.node(v.node);
    let ty = value_type(g, v)?;
    if let Op::Constant { .. } = p.op {
        taken.insert(p.id.clone());
        return Ok(p.clone());
    }
    let kind = match p.op {
        Op::Input { kind } => kind,
        _ => InputKind::Activation,
    };
    let base = if v.output == 0 {
        p.id.clone()
    } else {
        format!("{}.out{}", p.id, v.output)
    };
    let mut id = base.clone();
    let mut k = 2;
    while !taken.insert(id.clone()) {
        id = format!("{base}.{k}");
        k += 1;
    }
    Ok(Node {
        id,
        op: Op::Input { kind },
        inputs: Vec::new(),
        outputs: vec![ty],
        module: p.module.clone(),
    })
}

fn value_type(g: &Graph, v: Value) -> Result<TensorType> {
    g.value_type(v)
        .cloned()
        .ok_or_else(|| ReferenceError::Ir(format!("value {} has no type", g.value_ref(v))))
}

/// A graph with the original's symbols (token symbol from 1) and the cut's leaves.
fn cut_with_leaves(
    original: &Graph,
    leaves: &[(Value, Node)],
) -> Result<(Graph, HashMap<Value, Value>)> {
    let mut g = Graph::new();
    let tokens: HashSet<String> = token_symbols(original)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    for (name, r) in original.symbols() {
        let mut r = *r;
        if tokens.contains(name) {
            r.min = 1;
        }
        g.set_symbol(name.clone(), r);
    }
    let mut map = HashMap::new();
    for (v, n) in leaves {
        let id = add(&mut g, n.clone())?;
        let k = if matches!(n.op, Op::Constant { .. }) {
            v.output
        } else {
            0
        };
        map.insert(*v, Value::new(id, k));
    }
    Ok((g, map))
}

fn add(g: &mut Graph, n: Node) -> Result<NodeId> {
    g.add_node(n)
        .map_err(|e| ReferenceError::Ir(format!("building a site cut: {e}")))
}

fn original_side(
    original: &Graph,
    site: &SiteMap,
    nodes: &[NodeId],
    region: &[NodeId],
    leaves: &[(Value, Node)],
) -> Result<Graph> {
    let (mut g, mut map) = cut_with_leaves(original, leaves)?;
    for &n in nodes {
        let node = original.node(n);
        let inputs = node.inputs.iter().map(|v| map[v]).collect();
        // A wait forwards its input: the identity, which the evaluator knows as a
        // reshape to the same type.
        let op = if is_view(original, n) {
            Op::Reshape
        } else {
            node.op.clone()
        };
        let id = add(
            &mut g,
            Node {
                op,
                inputs,
                ..node.clone()
            },
        )?;
        for k in 0..node.outputs.len() as u32 {
            map.insert(Value::new(n, k), Value::new(id, k));
        }
    }
    let mut outs = Vec::new();
    for o in &site.outputs {
        for r in &o.replaces {
            let v = resolve(original, r, "replaced value", site)?;
            if !region.contains(&v.node) {
                return Err(ReferenceError::NotComparable(format!(
                    "site {}: replaced value {r} is not computed by the chain",
                    site.fused_node
                )));
            }
            outs.push(map[&v]);
        }
    }
    g.set_outputs(outs)
        .map_err(|e| ReferenceError::Ir(format!("building a site cut: {e}")))?;
    Ok(g)
}

fn lowered_side(
    original: &Graph,
    lowered: &Graph,
    site: &SiteMap,
    site_inputs: &[Value],
    leaves: &[(Value, Node)],
) -> Result<Graph> {
    let fused = fused_node(lowered, site)?;
    let f = lowered.node(fused);
    if f.inputs.len() != site.inputs.len() || f.outputs.len() != site.outputs.len() {
        return Err(ReferenceError::NotComparable(format!(
            "site {}: the map names {} inputs and {} outputs, the fused node has {} and {}",
            site.fused_node,
            site.inputs.len(),
            site.outputs.len(),
            f.inputs.len(),
            f.outputs.len()
        )));
    }
    let (mut g, map) = cut_with_leaves(original, leaves)?;
    let mut inputs = Vec::with_capacity(f.inputs.len());
    for (i, (si, v)) in site.inputs.iter().zip(site_inputs).enumerate() {
        let src = map[v];
        inputs.push(match &si.view {
            None => src,
            Some(t) => Value::new(reshape(&mut g, format!("{}.in{i}.view", f.id), src, t)?, 0),
        });
    }
    let fid = add(
        &mut g,
        Node {
            inputs,
            ..f.clone()
        },
    )?;
    let mut outs = Vec::new();
    for (k, o) in site.outputs.iter().enumerate() {
        let port = Value::new(fid, k as u32);
        let mut views: BTreeMap<String, Value> = BTreeMap::new();
        for r in &o.replaces {
            let v = resolve(original, r, "replaced value", site)?;
            let ty = value_type(original, v)?;
            if Some(&ty) == f.outputs.get(k) {
                outs.push(port);
                continue;
            }
            let key = ty.to_string();
            let view = match views.get(&key) {
                Some(&view) => view,
                None => {
                    let id = format!("{}.out{k}.view{}", f.id, views.len());
                    let view = Value::new(reshape(&mut g, id, port, &ty)?, 0);
                    views.insert(key, view);
                    view
                }
            };
            outs.push(view);
        }
    }
    g.set_outputs(outs)
        .map_err(|e| ReferenceError::Ir(format!("building a site cut: {e}")))?;
    Ok(g)
}

fn reshape(g: &mut Graph, id: String, src: Value, ty: &TensorType) -> Result<NodeId> {
    add(
        g,
        Node {
            id,
            op: Op::Reshape,
            inputs: vec![src],
            outputs: vec![ty.clone()],
            module: None,
        },
    )
}

/// Checks that `lowered` is `original` with each site's chain replaced by its fused
/// node and nothing else changed (module doc, part 1). Returns the number of kept
/// nodes checked.
///
/// Errors: [`ReferenceError::NotComparable`] naming the first node that breaks it.
pub fn check_wiring(original: &Graph, lowered: &Graph, sites: &[SiteMap]) -> Result<usize> {
    let by_fused: HashMap<&str, &SiteMap> =
        sites.iter().map(|s| (s.fused_node.as_str(), s)).collect();
    let w = Wiring {
        original,
        lowered,
        by_fused: &by_fused,
    };
    let err = |m: String| Err(ReferenceError::NotComparable(m));
    let mut kept_nodes = 0;
    for (id, n) in lowered.nodes() {
        if let Some(o) = w.kept(id) {
            kept_nodes += 1;
            let before = &original.node(o).inputs;
            if before.len() != n.inputs.len() {
                return err(format!("node {:?}: its input count changed", n.id));
            }
            for (j, (&now, &then)) in n.inputs.iter().zip(before).enumerate() {
                if !w.stands_for(now).contains(&NodeOutput::of(original, then)) {
                    return err(format!(
                        "node {:?} input {j}: the lowered graph reads {}, which does not \
                         stand for {}, the value it read in the original",
                        n.id,
                        lowered.value_ref(now),
                        original.value_ref(then)
                    ));
                }
            }
            continue;
        }
        match &n.op {
            Op::FusedAllreduceNorm(_) => {
                let Some(site) = by_fused.get(n.id.as_str()) else {
                    return err(format!(
                        "fused node {:?} is new in the lowered graph but has no site map",
                        n.id
                    ));
                };
                for (i, (&u, si)) in n.inputs.iter().zip(&site.inputs).enumerate() {
                    if !w.stands_for(u).contains(&si.value) {
                        return err(format!(
                            "fused node {:?} input {i}: reads {}, the site map says {}",
                            n.id,
                            lowered.value_ref(u),
                            si.value
                        ));
                    }
                }
            }
            Op::Reshape => {}
            op => {
                return err(format!(
                    "node {:?} ({}) is neither in the original graph nor a fused node or a \
                     reshape",
                    n.id,
                    op.name()
                ))
            }
        }
    }
    for s in sites {
        fused_node(lowered, s)?;
    }
    if lowered.outputs().len() != original.outputs().len() {
        return err(format!(
            "{} graph outputs, the original has {}",
            lowered.outputs().len(),
            original.outputs().len()
        ));
    }
    for (j, (&now, &then)) in lowered.outputs().iter().zip(original.outputs()).enumerate() {
        if !w.stands_for(now).contains(&NodeOutput::of(original, then)) {
            return err(format!(
                "graph output {j}: {} does not stand for {}",
                lowered.value_ref(now),
                original.value_ref(then)
            ));
        }
    }
    let replaced: HashSet<&str> = sites
        .iter()
        .flat_map(|s| s.replaced_nodes.iter().map(String::as_str))
        .collect();
    for (id, n) in original.nodes() {
        let kept = lowered.find(&n.id).is_some_and(|l| w.kept(l) == Some(id));
        let dropped_constant = matches!(n.op, Op::Constant { .. })
            && original
                .users(id)
                .all(|(u, _)| replaced.contains(original.node(u).id.as_str()));
        if !kept && !replaced.contains(n.id.as_str()) && !dropped_constant {
            return err(format!(
                "original node {:?} ({}) is neither kept nor replaced by a site",
                n.id,
                n.op.name()
            ));
        }
    }
    Ok(kept_nodes)
}

struct Wiring<'a> {
    original: &'a Graph,
    lowered: &'a Graph,
    by_fused: &'a HashMap<&'a str, &'a SiteMap>,
}

impl Wiring<'_> {
    /// The original node a lowered node is (same id, op and output types).
    fn kept(&self, id: NodeId) -> Option<NodeId> {
        let n = self.lowered.node(id);
        self.original.find(&n.id).filter(|&o| {
            let on = self.original.node(o);
            on.op == n.op && on.outputs == n.outputs
        })
    }

    /// The original values a lowered value stands for: a kept node's output itself; a
    /// fused output, the values its site map says it replaces; a new reshape, what its
    /// operand stands for.
    fn stands_for(&self, u: Value) -> Vec<NodeOutput> {
        let mut u = u;
        // A chain of new reshapes is at most as long as the lowered graph.
        for _ in 0..=self.lowered.len() {
            if let Some(o) = self.kept(u.node) {
                return vec![NodeOutput::of(self.original, Value::new(o, u.output))];
            }
            let n = self.lowered.node(u.node);
            match (&n.op, n.inputs.as_slice()) {
                (Op::FusedAllreduceNorm(_), _) => {
                    return self
                        .by_fused
                        .get(n.id.as_str())
                        .and_then(|s| s.outputs.get(u.output as usize))
                        .map(|o| o.replaces.clone())
                        .unwrap_or_default()
                }
                (Op::Reshape, [src]) => u = *src,
                _ => return Vec::new(),
            }
        }
        Vec::new()
    }
}
