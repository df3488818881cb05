//! Collective forms: a functional all-reduce followed by its `wait_tensor` is the
//! all-reduce.
//!
//! Matches `(wait ?a)` where `?a` holds an all-reduce, and makes the wait's class the
//! all-reduce's class, so every later rule sees `wait(all_reduce(x))` as
//! `all_reduce(x)`. Waits on anything else are left alone.

use super::{rule, union, Rule, Vars};
use crate::analysis::{all_reduce_in, FxGraph};
use egg::Id;

pub(crate) fn rules() -> Result<Vec<Rule>, String> {
    Ok(vec![rule(
        "wait-of-all-reduce",
        "(wait ?a)",
        wait_of_all_reduce,
    )?])
}

/// `(wait ?a)`.
fn wait_of_all_reduce(eg: &mut FxGraph, eclass: Id, &[a, ..]: &Vars) -> bool {
    all_reduce_in(eg, a).is_some() && union(eg, eclass, a)
}
