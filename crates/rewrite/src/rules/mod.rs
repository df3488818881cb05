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
use egg::{Applier, Id, Pattern, PatternAst, Rewrite, Subst, Symbol, Var};
use std::cell::RefCell;

/// Every rule of the pass, in a fixed order.
///
/// Errors: a rule that does not parse (a bug in this crate, reported as such).
pub(crate) fn all() -> Result<Vec<Rewrite<Fx, FxAnalysis>>, String> {
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

impl Applier<Fx, FxAnalysis> for FnApplier {
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
pub(crate) fn rule(
    name: &str,
    pattern: &str,
    apply: ApplyFn,
) -> Result<Rewrite<Fx, FxAnalysis>, String> {
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
