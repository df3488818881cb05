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
//! - an applier says whether it changed the e-graph (a union that merged two classes)
//!   and nothing else, so the runner can detect saturation.
//!
//! The runner ([`saturate`]) is not egg's `Runner` but a loop of its own that runs as
//! `Runner` with its `SimpleScheduler` would, iteration for iteration (the same
//! searches on the rebuilt e-graph, the same application order, the same limits and stop reasons, the same iteration count, except that an
//! iteration stopped by a limit before its search is not counted), but it matches each
//! rule's pattern directly against the classes holding its root op, with no pattern
//! machine and no substitution per match: a pattern here is one op with variables for
//! its children, or one op one of whose children is another such op.

pub(crate) mod collective;
pub(crate) mod fuse;
pub(crate) mod norm;
pub(crate) mod quant;
pub(crate) mod view;

use crate::analysis::FxGraph;
use crate::lang::{Fx, Leaf};
use egg::{ENodeOrVar, Id, Language, Pattern};

/// What one saturated e-graph ran to.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Ran {
    /// Iterations the runner took.
    pub iterations: usize,
    /// E-nodes at the end.
    pub nodes: usize,
    /// E-classes at the end.
    pub classes: usize,
    /// The most e-nodes counted at any check of the e-node limit. The runner's only
    /// dependence on that limit is those checks, so a run with any limit of at least
    /// this many e-nodes is this run, step for step (what lets a window be saturated
    /// before the e-nodes of the windows ahead of it are known, `crate::find`).
    pub peak: usize,
}

/// Why a runner stopped before saturation.
#[derive(Clone, Debug)]
pub(crate) enum Stop {
    /// The e-node limit, with the e-nodes the runner counted when it stopped.
    NodeLimit(usize),
    /// The iteration limit, after this many iterations.
    IterationLimit(usize),
}

/// Most variables one pattern binds.
pub(crate) const MAX_VARS: usize = 4;

/// The classes a pattern's variables are bound to, in the order they appear in the
/// pattern (`(to_dtype ?t (mul ?a ?b))` binds `[t, a, b]`).
pub(crate) type Vars = [Id; MAX_VARS];

/// The body of a rule: gets the e-graph, the matched class and the variables; says
/// whether it changed the e-graph.
pub(crate) type ApplyFn = fn(&mut FxGraph, Id, &Vars) -> bool;

/// One rule: its pattern and what it does at each match.
pub(crate) struct Rule {
    /// The op at the pattern's root (its children are placeholders).
    root: Fx,
    /// For a pattern nesting an op in one child of the root: that child and the op.
    nested: Option<(usize, Fx)>,
    apply: ApplyFn,
}

/// A rule from a pattern in egg's syntax and an applier function. The pattern is an op
/// whose children are variables, or whose children are variables but one, itself an op
/// whose children are variables; the variables are distinct, at most [`MAX_VARS`].
///
/// Errors: a pattern that does not parse or is not of that form (a bug in this crate,
/// reported as such).
pub(crate) fn rule(name: &'static str, pattern: &str, apply: ApplyFn) -> Result<Rule, String> {
    let bad = |why: &str| format!("rule {name}: pattern {pattern:?} {why}");
    let p: Pattern<Fx> = pattern
        .parse()
        .map_err(|e| bad(&format!("does not parse: {e}")))?;
    let ast = &p.ast;
    let op_of = |i: Id| match &ast[i] {
        ENodeOrVar::ENode(n) => Some(n.clone()),
        ENodeOrVar::Var(_) => None,
    };
    let root = op_of(Id::from(ast.as_ref().len() - 1)).ok_or_else(|| bad("is a variable"))?;
    let mut nested = None;
    let mut vars = 0;
    for (k, &c) in root.children().iter().enumerate() {
        match op_of(c) {
            None => vars += 1,
            Some(inner) if nested.is_none() => {
                if inner.children().iter().any(|&g| op_of(g).is_some()) {
                    return Err(bad("nests deeper than one op"));
                }
                vars += inner.children().len();
                nested = Some((k, inner));
            }
            Some(_) => return Err(bad("nests more than one op")),
        }
    }
    if vars > MAX_VARS || p.vars().len() != vars {
        return Err(bad("needs distinct variables, at most four"));
    }
    Ok(Rule {
        root,
        nested,
        apply,
    })
}

impl Rule {
    /// Every match of the pattern in `eg` (rebuilt), in egg's order: the classes holding
    /// the root op, each class's matching nodes in order, and for a nested op the
    /// child class's matching nodes in order.
    fn search(&self, eg: &FxGraph, out: &mut Vec<(Id, Vars)>) {
        let Some(classes) = eg.classes_for_op(&self.root.discriminant()) else {
            return;
        };
        for class in classes {
            for node in eg[class].nodes.iter().filter(|n| self.root.matches(n)) {
                let Some((at, inner)) = &self.nested else {
                    out.push((class, vars_of(node.children(), None)));
                    continue;
                };
                let child = node.children()[*at];
                for inner_node in eg[child].nodes.iter().filter(|n| inner.matches(n)) {
                    let nested = Some((*at, inner_node.children()));
                    out.push((class, vars_of(node.children(), nested)));
                }
            }
        }
    }
}

/// The variables of one match: the root's children in order, the children of the
/// nested op (`Some((position, children))`) standing in for it.
fn vars_of(children: &[Id], nested: Option<(usize, &[Id])>) -> Vars {
    let mut vars = [Id::from(0usize); MAX_VARS];
    let mut k = 0;
    for (i, &c) in children.iter().enumerate() {
        match nested {
            Some((at, inner)) if at == i => {
                for &g in inner {
                    vars[k] = g;
                    k += 1;
                }
            }
            _ => {
                vars[k] = c;
                k += 1;
            }
        }
    }
    vars
}

/// Step 2 of the pass, running the rules: every rule of `rules` ([`all`]) on one
/// window's `egraph` until saturation, within `iter_limit` iterations and `node_limit`
/// e-nodes, as egg's `Runner` with its `SimpleScheduler` runs them: each iteration
/// searches every rule on the rebuilt e-graph, then applies every match in rule order
/// (stopping at the e-node limit), then rebuilds; it saturates when no applier changed
/// anything and the e-node and e-class counts did not move. (The last iteration's
/// rebuild, which has nothing to do, is skipped.)
///
/// Errors: what stopped the runner first, when not saturation (the result would
/// depend on the limits), with the iterations and e-nodes it ran to.
pub(crate) fn saturate<'a>(
    mut eg: FxGraph<'a>,
    rules: &[Rule],
    iter_limit: usize,
    node_limit: usize,
) -> Result<(FxGraph<'a>, Ran), (Stop, Ran)> {
    let peak = std::cell::Cell::new(0);
    let limit = |iterations: usize, eg: &FxGraph<'a>| {
        let size = eg.total_size();
        peak.set(peak.get().max(size));
        if size > node_limit {
            Some(Stop::NodeLimit(size))
        } else if iterations >= iter_limit {
            Some(Stop::IterationLimit(iterations))
        } else {
            None
        }
    };
    let ran = |iterations: usize, eg: &FxGraph<'a>| Ran {
        iterations,
        nodes: eg.total_size(),
        classes: eg.number_of_classes(),
        peak: peak.get(),
    };
    eg.rebuild();
    let mut matches: Vec<Vec<(Id, Vars)>> = rules.iter().map(|_| Vec::new()).collect();
    let mut iterations = 0;
    loop {
        let (nodes, classes) = (eg.total_size(), eg.number_of_classes());
        let mut stop = limit(iterations, &eg);
        let mut changed = false;
        // An iteration stopped by a limit before its search did nothing: it is not
        // counted (egg's runner records it; the error would say one iteration ran).
        let searched = stop.is_none();
        if searched {
            for (r, m) in rules.iter().zip(&mut matches) {
                m.clear();
                r.search(&eg, m);
            }
            for (r, m) in rules.iter().zip(&matches) {
                for (class, vars) in m {
                    changed |= (r.apply)(&mut eg, *class, vars);
                }
                stop = limit(iterations, &eg);
                if stop.is_some() {
                    break;
                }
            }
        }
        iterations += usize::from(searched);
        // Saturated: no applier merged two classes and no e-node or e-class was added,
        // so nothing is pending and the e-graph is exactly as the last rebuild left it;
        // egg's runner would rebuild it once more to the same state.
        let same = nodes == eg.total_size() && classes == eg.number_of_classes();
        if stop.is_none() && !changed && same {
            let done = ran(iterations, &eg);
            return Ok((eg, done));
        }
        eg.rebuild();
        if let Some(stop) = stop {
            return Err((stop, ran(iterations, &eg)));
        }
        if !changed && nodes == eg.total_size() && classes == eg.number_of_classes() {
            let done = ran(iterations, &eg);
            return Ok((eg, done));
        }
        if let Some(stop) = limit(iterations, &eg) {
            return Err((stop, ran(iterations, &eg)));
        }
    }
}

/// Every rule of the pass, in a fixed order, built once per process.
///
/// Errors: a rule whose pattern is not of the form [`rule`] takes (a bug in this
/// crate, reported as such).
pub(crate) fn all() -> Result<&'static [Rule], String> {
    static RULES: std::sync::OnceLock<Result<Vec<Rule>, String>> = std::sync::OnceLock::new();
    match RULES.get_or_init(build_all) {
        Ok(rules) => Ok(rules),
        Err(e) => Err(e.clone()),
    }
}

/// The rules of [`all`], built.
fn build_all() -> Result<Vec<Rule>, String> {
    let mut rules = Vec::new();
    rules.extend(collective::rules()?);
    rules.extend(norm::rules()?);
    rules.extend(view::rules()?);
    rules.extend(fuse::rules()?);
    rules.extend(quant::rules()?);
    Ok(rules)
}

/// Unions `a` and `b`; whether that merged two classes.
pub(crate) fn union(eg: &mut FxGraph, a: Id, b: Id) -> bool {
    eg.union(a, b)
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
