//! Collective forms: a functional all-reduce followed by its `wait_tensor` is the
//! all-reduce.
//!
//! Matches `(wait ?a)` where `?a` holds an all-reduce, and makes the wait's class the
//! all-reduce's class, so every later rule sees `wait(all_reduce(x))` as
//! `all_reduce(x)`. Waits on anything else are left alone.

use super::{rule, union, var};
use crate::analysis::{all_reduce_in, FxAnalysis, FxGraph};
use crate::lang::Fx;
use egg::{Id, Rewrite, Subst};

pub(crate) fn rules<'a>() -> Result<Vec<Rewrite<Fx, FxAnalysis<'a>>>, String> {
    Ok(vec![rule(
        "wait-of-all-reduce",
        "(wait ?a)",
        wait_of_all_reduce,
    )?])
}

fn wait_of_all_reduce(eg: &mut FxGraph, eclass: Id, subst: &Subst) -> Vec<Id> {
    let mut changed = Vec::new();
    if let Some(a) = var(subst, "?a") {
        if all_reduce_in(eg, a).is_some() {
            union(eg, eclass, a, &mut changed);
        }
    }
    changed
}
