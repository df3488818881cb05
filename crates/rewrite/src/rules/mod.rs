//! The rewrite rules, one file per family.
//!
//! Rules for writing rules (after Cranelift's `opts/README`):
//! - a rule only adds equalities that hold on values (up to the documented one-rounding
//!   change of a decomposed norm); whether the result is used is decided later, per
//!   site, from liveness and the policy;
//! - rules are directional: no general commutativity or associativity; where an
//!   operand order varies in real graphs, each order is spelled out;
//! - every condition a rule checks is written next to the rule, and a refused match of
//!   an all-reduce is logged with a reason a person can act on;
//! - an applier returns the classes it changed and nothing else, so the runner can
//!   detect saturation.

pub(crate) mod collective;
pub(crate) mod fuse;
pub(crate) mod norm;
pub(crate) mod quant;
pub(crate) mod view;

use crate::analysis::{FxAnalysis, FxGraph};
use crate::lang::{Fx, Leaf};
use egg::{Applier, Id, Pattern, PatternAst, Rewrite, Runner, SimpleScheduler, StopReason, Subst};
use egg::{Symbol, Var};
use std::cell::RefCell;

/// What one saturated e-graph ran to.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Ran {
    /// Iterations the runner took.
    pub iterations: usize,
    /// E-nodes at the end.
    pub nodes: usize,
    /// E-classes at the end.
    pub classes: usize,
}

/// Step 2 of the pass, running the rules: every rule of `rules` ([`all`]) on one
/// window's `egraph` until saturation, within `iter_limit` iterations and `node_limit`
/// e-nodes.
///
/// Errors: what stopped the runner first, when not saturation (the result would
/// depend on the limits), with the iterations and e-nodes it ran to.
pub(crate) fn saturate<'a>(
    egraph: FxGraph<'a>,
    rules: &[Rewrite<Fx, FxAnalysis<'a>>],
    iter_limit: usize,
    node_limit: usize,
) -> Result<(FxGraph<'a>, Ran), (Stop, Ran)> {
    // The runner's own analysis is replaced by `egraph`'s.
    let placeholder = FxAnalysis::new(egraph.analysis.facts, Default::default());
    let runner: Runner<Fx, FxAnalysis<'a>, ()> = Runner::new(placeholder)
        .with_scheduler(SimpleScheduler)
        .with_iter_limit(iter_limit)
        .with_node_limit(node_limit)
        // No wall-clock limit (egg's default is 5 s): the iteration and e-node budgets
        // bound the work, so the result does not depend on the machine's speed.
        .with_time_limit(std::time::Duration::MAX)
        .with_egraph(egraph)
        .run(rules);
    let eg = runner.egraph;
    let ran = Ran {
        iterations: runner.iterations.len(),
        nodes: eg.total_size(),
        classes: eg.number_of_classes(),
    };
    let stop = match runner.stop_reason {
        Some(StopReason::Saturated) => return Ok((eg, ran)),
        Some(StopReason::IterationLimit(n)) => Stop::Other(format!("iteration limit {n}")),
        Some(StopReason::NodeLimit(n)) => Stop::NodeLimit(n),
        Some(StopReason::TimeLimit(s)) => Stop::Other(format!("time limit {s} s")),
        Some(StopReason::Other(s)) => Stop::Other(s),
        None => Stop::Other("no stop reason".into()),
    };
    Err((stop, ran))
}

/// Why a runner stopped before saturation.
#[derive(Clone, Debug)]
pub(crate) enum Stop {
    /// The e-node limit, with the e-nodes the runner counted when it stopped.
    NodeLimit(usize),
    /// Any other reason, in words.
    Other(String),
}

/// Every rule of the pass, in a fixed order.
///
/// Errors: a rule that does not parse (a bug in this crate, reported as such).
pub(crate) fn all<'a>() -> Result<Vec<Rewrite<Fx, FxAnalysis<'a>>>, String> {
    let mut rules = Vec::new();
    rules.extend(collective::rules()?);
    rules.extend(norm::rules()?);
    rules.extend(view::rules()?);
    rules.extend(fuse::rules()?);
    rules.extend(quant::rules()?);
    Ok(rules)
}

/// The body of a custom applier: gets the e-graph, the matched class and the
/// substitution; returns the classes it changed.
pub(crate) type ApplyFn = fn(&mut FxGraph, Id, &Subst) -> Vec<Id>;

/// An applier given by a function (each rule's conditions live in its function).
pub(crate) struct FnApplier(pub ApplyFn);

impl<'a> Applier<Fx, FxAnalysis<'a>> for FnApplier {
    fn apply_one(
        &self,
        egraph: &mut FxGraph,
        eclass: Id,
        subst: &Subst,
        _searcher_ast: Option<&PatternAst<Fx>>,
        _rule_name: Symbol,
    ) -> Vec<Id> {
        (self.0)(egraph, eclass, subst)
    }
}

/// A rule from a pattern and an applier function.
pub(crate) fn rule<'a>(
    name: &str,
    pattern: &str,
    apply: ApplyFn,
) -> Result<Rewrite<Fx, FxAnalysis<'a>>, String> {
    let p: Pattern<Fx> = pattern
        .parse()
        .map_err(|e| format!("rule {name}: pattern {pattern:?} does not parse: {e}"))?;
    Rewrite::new(name.to_string(), p, FnApplier(apply))
}

/// The class bound to `?name`.
///
/// Parsing a [`Var`] interns its name in egg's global symbol table (a lock), so the
/// parsed variables are kept per thread: appliers run once per match, many thousand
/// times on a large graph.
pub(crate) fn var(subst: &Subst, name: &'static str) -> Option<Id> {
    thread_local! {
        static VARS: RefCell<Vec<(&'static str, Var)>> = const { RefCell::new(Vec::new()) };
    }
    let v = VARS.with(|vars| {
        let mut vars = vars.borrow_mut();
        if let Some((_, v)) = vars.iter().find(|(n, _)| *n == name) {
            return Some(*v);
        }
        let v: Var = name.parse().ok()?;
        vars.push((name, v));
        Some(v)
    })?;
    subst.get(v).copied()
}

/// Unions `a` and `b`, recording the class when it changed.
pub(crate) fn union(eg: &mut FxGraph, a: Id, b: Id, changed: &mut Vec<Id>) {
    if eg.union(a, b) {
        changed.push(eg.find(a));
    }
}

/// The class of a leaf.
pub(crate) fn leaf(eg: &mut FxGraph, l: Leaf) -> Id {
    eg.add(Fx::Leaf(l))
}

/// The class of `(get @port tuple)`.
pub(crate) fn get(eg: &mut FxGraph, port: u8, tuple: Id) -> Id {
    let p = leaf(eg, Leaf::Port(port));
    eg.add(Fx::Get([p, tuple]))
}
