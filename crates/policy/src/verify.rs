//! Re-checking any plan, also one given from outside, against a workspace.
//!
//! Required bytes grow with T for every strategy, so checking a range at its first and
//! last T (and at the capacity boundary) is the same as checking every T in it.

use std::collections::BTreeSet;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::plan::{DispatchRange, Plan};
use crate::strategy::Strategy;
use crate::workspace::{Misfit, Workspace};

/// One way a plan is wrong. Token ranges are inclusive; bytes are bytes of one buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Violation {
    /// A fused call needs more than the buffer its strategy uses.
    Capacity {
        /// Hidden size of the site.
        hidden: u64,
        /// First T of the range that does not fit.
        t_first: u64,
        /// Last T of the range (does not fit either).
        t_last: u64,
        /// The strategy planned there.
        strategy: Strategy,
        /// Bytes needed at `t_first`.
        required_bytes: u64,
        /// Bytes needed at `t_last`.
        required_bytes_max: u64,
        /// Bytes of the buffer (one Lamport buffer, or trtllm's comm buffer).
        available_bytes: u64,
    },
    /// Two-shot planned for T < W (two-shot splits tokens over ranks; domain.md §4).
    TwoShotBelowWorldSize {
        /// Hidden size of the site.
        hidden: u64,
        /// First offending T.
        t_first: u64,
        /// Last offending T.
        t_last: u64,
        /// W.
        world_size: u32,
    },
    /// A fused strategy planned above max_token_num (domain.md §4).
    AboveMaxTokenNum {
        /// Hidden size of the site.
        hidden: u64,
        /// First offending T.
        t_first: u64,
        /// Last offending T.
        t_last: u64,
        /// The strategy planned there.
        strategy: Strategy,
        /// The plan's max_token_num.
        max_token_num: u64,
    },
    /// Token counts the graph can run with that no range covers.
    NotCovered {
        /// Hidden size of the site.
        hidden: u64,
        /// First uncovered T.
        t_first: u64,
        /// Last uncovered T.
        t_last: u64,
    },
    /// Token counts claimed by more than one range.
    Overlap {
        /// Hidden size of the site.
        hidden: u64,
        /// First T claimed twice.
        t_first: u64,
        /// Last T claimed twice.
        t_last: u64,
    },
    /// A range with `lo` = 0 or `lo > hi`.
    InvalidRange {
        /// Hidden size of the site.
        hidden: u64,
        /// The range's lo.
        lo: u64,
        /// The range's hi.
        hi: u64,
    },
    /// A fused range in a plan with no backend or no workspace.
    FusedWithoutWorkspace {
        /// Hidden size of the site.
        hidden: u64,
        /// First T.
        t_first: u64,
        /// Last T.
        t_last: u64,
        /// The strategy planned there.
        strategy: Strategy,
    },
    /// A range states required bytes that differ from the true value at its last T.
    WrongRequiredBytes {
        /// Hidden size of the site.
        hidden: u64,
        /// The range's last T.
        t: u64,
        /// The strategy planned there.
        strategy: Strategy,
        /// Bytes the range states.
        stated_bytes: u64,
        /// Bytes it really needs.
        actual_bytes: u64,
    },
    /// The required bytes of a range overflow `u64` or its hidden size is invalid.
    Arithmetic {
        /// Hidden size of the site.
        hidden: u64,
        /// The range's last T.
        t: u64,
        /// The error.
        detail: String,
    },
    /// Deterministic mode with more than one reduction order across T (domain.md §3):
    /// FlashInfer's strategies mixed, or T served by the engine's all-reduce.
    MixedReductionOrders {
        /// The strategies present.
        strategies: Vec<Strategy>,
    },
    /// The workspace is unsound or does not belong to the plan.
    Workspace {
        /// What is wrong.
        detail: String,
    },
}

fn tokens(lo: u64, hi: u64) -> String {
    if lo == hi {
        format!("T={lo}")
    } else {
        format!("T={lo}..={hi}")
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::Capacity {
                t_first,
                t_last,
                strategy,
                required_bytes,
                required_bytes_max,
                available_bytes,
                ..
            } => {
                if t_first == t_last {
                    write!(
                        f,
                        "T={t_first} {strategy}: required {required_bytes} bytes, buffer \
                         {available_bytes} bytes"
                    )
                } else {
                    write!(
                        f,
                        "T={t_first}..={t_last} {strategy}: required {required_bytes} bytes \
                         at T={t_first} up to {required_bytes_max} bytes at T={t_last}, \
                         buffer {available_bytes} bytes"
                    )
                }
            }
            Violation::TwoShotBelowWorldSize {
                t_first,
                t_last,
                world_size,
                ..
            } => write!(
                f,
                "{} two-shot: two-shot needs T >= W = {world_size}",
                tokens(*t_first, *t_last)
            ),
            Violation::AboveMaxTokenNum {
                t_first,
                t_last,
                strategy,
                max_token_num,
                ..
            } => write!(
                f,
                "{} {strategy}: above max_token_num {max_token_num}",
                tokens(*t_first, *t_last)
            ),
            Violation::NotCovered {
                hidden,
                t_first,
                t_last,
            } => write!(
                f,
                "{} at H={hidden}: not covered by any range",
                tokens(*t_first, *t_last)
            ),
            Violation::Overlap {
                hidden,
                t_first,
                t_last,
            } => write!(
                f,
                "{} at H={hidden}: covered by more than one range",
                tokens(*t_first, *t_last)
            ),
            Violation::InvalidRange { hidden, lo, hi } => {
                write!(f, "range {lo}..={hi} at H={hidden}: needs 1 <= lo <= hi")
            }
            Violation::FusedWithoutWorkspace {
                t_first,
                t_last,
                strategy,
                ..
            } => write!(
                f,
                "{} {strategy}: fused without a backend or workspace",
                tokens(*t_first, *t_last)
            ),
            Violation::WrongRequiredBytes {
                t,
                strategy,
                stated_bytes,
                actual_bytes,
                ..
            } => write!(
                f,
                "T={t} {strategy}: range states {stated_bytes} required bytes, actual \
                 {actual_bytes}"
            ),
            Violation::Arithmetic { hidden, t, detail } => {
                write!(f, "T={t} at H={hidden}: {detail}")
            }
            Violation::MixedReductionOrders { strategies } => {
                let names: Vec<&str> = strategies.iter().map(|s| s.name()).collect();
                write!(
                    f,
                    "deterministic mode mixes reduction orders across T: {}",
                    names.join(", ")
                )
            }
            Violation::Workspace { detail } => write!(f, "workspace: {detail}"),
        }
    }
}

/// Re-checks `plan` against `workspace` for every T the plan covers and every extra
/// token count it lists, and returns every violation (empty when the plan is sound):
/// capacity against ONE buffer, two-shot at T < W, fused T above max_token_num, gaps,
/// overlaps and malformed ranges, wrong stated bytes, mixed reduction orders in
/// deterministic mode, and a workspace that is unsound or belongs to another backend,
/// group, dtype or a narrower hidden size.
pub fn verify(plan: &Plan, workspace: &Workspace) -> Vec<Violation> {
    verify_inner(plan, Some(workspace))
}

pub(crate) fn verify_inner(plan: &Plan, workspace: Option<&Workspace>) -> Vec<Violation> {
    let mut out = Vec::new();
    let backend = plan.backend();
    let ws = workspace.filter(|_| backend.is_some());
    if let (Some(ws), Some(backend)) = (ws, backend) {
        for detail in ws.problems() {
            out.push(Violation::Workspace { detail });
        }
        if ws.kernels != plan.kernels
            || ws.backend != backend
            || ws.world_size != plan.world_size
            || ws.dtype != plan.dtype
        {
            out.push(Violation::Workspace {
                detail: format!(
                    "it is a {} {} workspace for W={} {}, the plan is {} {backend} for W={} {}",
                    ws.kernels,
                    ws.backend,
                    ws.world_size,
                    ws.dtype,
                    plan.kernels,
                    plan.world_size,
                    plan.dtype
                ),
            });
        }
    }
    let need = plan
        .points
        .iter()
        .map(|p| p.t)
        .fold(plan.max_planned_tokens, u64::max);
    let mut used = BTreeSet::new();
    for site in &plan.sites {
        let h = site.hidden;
        let mut ranges: Vec<&DispatchRange> = Vec::new();
        for r in &site.ranges {
            if r.lo == 0 || r.lo > r.hi {
                out.push(Violation::InvalidRange {
                    hidden: h,
                    lo: r.lo,
                    hi: r.hi,
                });
            } else {
                ranges.push(r);
            }
        }
        ranges.sort_by_key(|r| r.lo);
        check_coverage(h, &ranges, need, &mut out);
        let fused: Vec<&DispatchRange> = ranges
            .iter()
            .copied()
            .filter(|r| r.strategy.is_fused())
            .collect();
        used.extend(ranges.iter().map(|r| r.strategy));
        if fused.is_empty() {
            continue;
        }
        let Some(ws) = ws else {
            for r in fused {
                out.push(Violation::FusedWithoutWorkspace {
                    hidden: h,
                    t_first: r.lo,
                    t_last: r.hi,
                    strategy: r.strategy,
                });
            }
            continue;
        };
        if ws.hidden < h {
            out.push(Violation::Workspace {
                detail: format!(
                    "sized for H={} but a fused site has H={h}; size one workspace for the \
                     widest hidden size sharing it",
                    ws.hidden
                ),
            });
        }
        for r in fused {
            check_fused(plan, ws, h, r, &mut out);
        }
    }
    // A plan that fuses nothing runs every T through the engine's own path: one order.
    if plan.deterministic
        && plan.backend().is_some()
        && !crate::plan::one_reduction_order(plan.kernels, plan.unfused_all_reduce, &used)
    {
        out.push(Violation::MixedReductionOrders {
            strategies: used.into_iter().collect(),
        });
    }
    out
}

fn check_coverage(h: u64, ranges: &[&DispatchRange], need: u64, out: &mut Vec<Violation>) {
    // First T not yet covered; u128 so that a range ending at u64::MAX covers it.
    let mut next = 1u128;
    let need = u128::from(need);
    for r in ranges {
        let (lo, hi) = (u128::from(r.lo), u128::from(r.hi));
        if lo > next && next <= need {
            out.push(Violation::NotCovered {
                hidden: h,
                t_first: next as u64,
                t_last: (lo - 1).min(need) as u64,
            });
        }
        if lo < next {
            out.push(Violation::Overlap {
                hidden: h,
                t_first: r.lo,
                t_last: hi.min(next - 1) as u64,
            });
        }
        next = next.max(hi + 1);
    }
    if next <= need {
        out.push(Violation::NotCovered {
            hidden: h,
            t_first: next as u64,
            t_last: need as u64,
        });
    }
}

fn check_fused(plan: &Plan, ws: &Workspace, h: u64, r: &DispatchRange, out: &mut Vec<Violation>) {
    let s = r.strategy;
    if r.hi > plan.max_token_num {
        out.push(Violation::AboveMaxTokenNum {
            hidden: h,
            t_first: r.lo.max(plan.max_token_num.saturating_add(1)),
            t_last: r.hi,
            strategy: s,
            max_token_num: plan.max_token_num,
        });
    }
    // The workspace's rule ([`Workspace::misfit`]) at the range's first T: two-shot
    // needs T >= W there (T only grows along the range).
    if let Ok(Some(Misfit::BelowWorldSize { world_size })) = ws.misfit(s, r.lo, h) {
        out.push(Violation::TwoShotBelowWorldSize {
            hidden: h,
            t_first: r.lo,
            t_last: r.hi.min(u64::from(world_size) - 1),
            world_size,
        });
    }
    let arithmetic = |e: crate::PolicyError| Violation::Arithmetic {
        hidden: h,
        t: r.hi,
        detail: e.to_string(),
    };
    let cap = match ws.capacity_tokens(s, h) {
        Ok(c) => c,
        Err(e) => return out.push(arithmetic(e)),
    };
    let at_hi = match ws.required_bytes(s, r.hi, h) {
        Ok(b) => b,
        Err(e) => return out.push(arithmetic(e)),
    };
    if r.hi > cap {
        let t_first = r.lo.max(cap.saturating_add(1));
        match ws.required_bytes(s, t_first, h) {
            Ok(at_first) => out.push(Violation::Capacity {
                hidden: h,
                t_first,
                t_last: r.hi,
                strategy: s,
                required_bytes: at_first,
                required_bytes_max: at_hi,
                available_bytes: ws.available_bytes(s),
            }),
            Err(e) => out.push(arithmetic(e)),
        }
    }
    if r.required_bytes_max != at_hi {
        out.push(Violation::WrongRequiredBytes {
            hidden: h,
            t: r.hi,
            strategy: s,
            stated_bytes: r.required_bytes_max,
            actual_bytes: at_hi,
        });
    }
}
