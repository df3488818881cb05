//! The all-reduce spellings: torch's functional collectives (out-of-place and
//! in-place), the in-place `c10d.allreduce_`, and a framework's own op named in
//! [`ImportOptions::all_reduce_ops`](crate::ImportOptions::all_reduce_ops). Each becomes
//! `all_reduce {group}` when its reduce op is a sum; every other reduce op stays opaque
//! with the reason noted. In-place forms also rebind the tensor they mutate (done by
//! the builder for every in-place op), so later readers of it read the all-reduce.

use super::{is_none, node, why, NodeView, Plan};
use crate::torch_export::{Bound, Lowering, PIn};
use crate::CustomAllReduce;
use arfuse_ir::{Op, ReduceOp, TensorType};
use std::borrow::Cow;

/// c10d's `ReduceOp::SUM` code (`torch.distributed.ReduceOp.SUM`).
const C10D_SUM: i64 = 0;

fn string_arg<'a>(v: &'a NodeView<'_>, name: &str) -> Option<Cow<'a, str>> {
    v.arg(name).and_then(|a| a.string())
}

/// The all-reduce node, once its input, group and output are known.
fn all_reduce(v: &NodeView<'_>, x: Bound, group: &str) -> Plan {
    let ty = v.ty(x.value).cloned().ok_or_else(|| why("unknown input"))?;
    if x.is_bool || !ty.dtype.is_float() {
        return Err(why(format!(
            "an all-reduce of a {} tensor (only float sums are modelled)",
            if x.is_bool {
                "bool".to_string()
            } else {
                ty.dtype.to_string()
            }
        )));
    }
    let out: &TensorType = match v.outs {
        [o] => &o.0,
        [] => return Err(why("no tensor output")),
        many => {
            return Err(why(format!(
                "{} tensor outputs (a coalesced all-reduce of several tensors)",
                many.len()
            )))
        }
    };
    if *out != ty {
        return Err(why(format!("output {out} differs from the input {ty}")));
    }
    if group.trim().is_empty() {
        return Err(why("an empty group name"));
    }
    Ok(Lowering::Nodes(vec![node(
        Op::AllReduce {
            group: group.to_string(),
            reduce: ReduceOp::Sum,
        },
        vec![PIn::Ext(x.value)],
        vec![out.clone()],
    )]))
}

fn require_sum(reduce: &str) -> Result<(), Option<String>> {
    if reduce.eq_ignore_ascii_case("sum") {
        Ok(())
    } else {
        Err(why(format!("reduce op {reduce:?} (only sum is modelled)")))
    }
}

/// `_c10d_functional.all_reduce(input, reduce_op, group_name)` and its in-place form
/// `all_reduce_` (same arguments, returns `input`).
pub(in crate::torch_export) fn functional(v: &NodeView<'_>) -> Plan {
    let x = v
        .tensor_arg("input")
        .or_else(|| v.tensor_arg("self"))
        .ok_or_else(|| why("no tensor `input` argument"))?;
    let reduce = string_arg(v, "reduce_op").ok_or_else(|| why("no reduce_op string"))?;
    require_sum(&reduce)?;
    let group = string_arg(v, "group_name").ok_or_else(|| why("no group_name string"))?;
    all_reduce(v, x, &group)
}

/// `c10d.allreduce_(tensors, process_group, reduce_op, sparse_indices, async_op,
/// timeout) -> (tensors, work)`: in place, one tensor. The group is the process-group
/// object's name in the graph; the reduce op must be readable as a sum (code 0 or the
/// string `sum`): a `ReduceOp` object records no value in the serialized graph, so such
/// a node stays opaque unless the op is named in the options (which asserts a sum).
pub(in crate::torch_export) fn c10d_inplace(v: &NodeView<'_>) -> Plan {
    let x = single_tensor_of(v, "tensors")?;
    if !is_none(v.arg("sparse_indices")) {
        return Err(why("a sparse all-reduce (sparse_indices given)"));
    }
    let reduce = v.arg("reduce_op");
    match reduce {
        Some(a) if a.int() == Some(C10D_SUM) => {}
        Some(a) if a.string().is_some() => {
            require_sum(&a.string().unwrap_or_default())?;
        }
        Some(a) if a.int_text().is_some() => {
            return Err(why(format!(
                "reduce op code {} (only sum, code {C10D_SUM}, is modelled)",
                a.int_text().unwrap_or_default()
            )))
        }
        _ => {
            return Err(why(
                "the reduce op is a ReduceOp object whose value the serialized graph does \
                 not record; name the op with --all-reduce-op c10d.allreduce_[=GROUP] \
                 (ImportOptions::all_reduce_ops) to assert that it is a sum",
            ))
        }
    }
    let group = v
        .arg("process_group")
        .and_then(|a| a.custom_obj_name())
        .map(Cow::Borrowed)
        .or_else(|| string_arg(v, "process_group"))
        .ok_or_else(|| why("no process_group object or name"))?;
    all_reduce(v, x, &group)
}

/// The one tensor of list argument `name` (or the first tensor argument when there is
/// no such argument).
fn single_tensor_of(v: &NodeView<'_>, name: &str) -> Result<Bound, Option<String>> {
    if let Some(a) = v.arg(name) {
        if let Some(len) = a.tensor_list_len() {
            if len != 1 {
                return Err(why(format!(
                    "an all-reduce of {len} tensors at once (coalesced)"
                )));
            }
            return v.tensor_in_list(name).ok_or_else(|| why("unknown input"));
        }
        if let Some(b) = v.tensor_arg(name) {
            return Ok(b);
        }
    }
    v.ins
        .first()
        .copied()
        .ok_or_else(|| why("no tensor argument"))
}

/// A framework's op named in the options: sums its first tensor argument over the
/// group (the option's, else the op's `group_name` or `group` string argument). A
/// string argument `reduce_op`, `op` or `reduce`, when present, must say `sum`.
pub(in crate::torch_export) fn custom(v: &NodeView<'_>, c: &CustomAllReduce) -> Plan {
    let first_list = v.args.first().map(|(n, _)| n.as_str()).unwrap_or("");
    let x = single_tensor_of(v, first_list)?;
    for name in ["reduce_op", "op", "reduce"] {
        if let Some(r) = string_arg(v, name) {
            require_sum(&r)?;
        }
    }
    let group = match &c.group {
        Some(g) => Cow::Borrowed(g.as_str()),
        None => string_arg(v, "group_name")
            .or_else(|| string_arg(v, "group"))
            .ok_or_else(|| {
                why(format!(
                    "named as an all-reduce ({c}), but it has no group_name or group string \
                     argument: give the group as {}=GROUP",
                    c.target
                ))
            })?,
    };
    all_reduce(v, x, &group)
}
