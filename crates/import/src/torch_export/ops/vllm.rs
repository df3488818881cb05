//! vLLM's ops (vLLM 0.32; the schemas are `csrc/torch_bindings.cpp` and
//! `vllm/ir/ops/layernorm.py`), each mapped onto the IR op that computes what vLLM's op
//! computes, or kept opaque with the reason noted (`docs/torch-export.md`, "vLLM's ops"):
//!
//! - `vllm_ir.rms_norm(x, weight, epsilon, variance_size=None)` and
//!   `vllm_ir.fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None) ->
//!   (out, residual)`, vLLM's IR ops, with the rounding of their native form (the form
//!   vLLM tests every provider against): `x.to(f32)`, the f32 sum of the residual
//!   normalised unrounded and rounded only for the residual output (`norm_input =
//!   f32_sum`), and `x.to(weight.dtype) * weight`, which rounds twice for a weight of
//!   the activation dtype (`norm_rounding = twice`) and once for an f32 weight. A
//!   `variance_size` or a missing weight is not a fused norm.
//! - Under `higher_order.auto_functionalized` (the functional form torch.compile gives
//!   an op that writes its arguments; the tensor outputs are the written arguments in
//!   schema order):
//!   - `_C.rms_norm(result!, input, weight, epsilon)`: one rounding, the weight applied
//!     in f32 (vLLM's CUDA and CPU kernels, `csrc/layernorm_kernels.cu`,
//!     `csrc/cpu/layernorm.cpp`);
//!   - `_C.fused_add_rms_norm(input!, residual!, weight, epsilon)`: the residual
//!     rounded, then normalised, one rounding (the CUDA kernels); `input` gets the norm,
//!     `residual` the sum;
//!   - `_C.static_scaled_fp8_quant(result!, input, scale, ...)`: `input * (1 / scale)`,
//!     saturated to e4m3 (the contract's static FP8);
//!   - `_C.dynamic_per_token_scaled_fp8_quant(result!, input, scale!, scale_ub)` without
//!     `scale_ub`: the contract's per-token FP8;
//!   - `_C.per_token_group_fp8_quant`: kept opaque (its kernel takes the scale layout
//!     from the scale tensor's strides, which the graph's metadata does not hold);
//!   - `_C.scaled_fp4_quant`: kept opaque (its element scale is `rcp.approx(SF *
//!     rcp.approx(1 / global_scale))`, not the contract's `global_scale / SF`);
//!   - an op named in `ImportOptions::all_reduce_ops` (vLLM's CPU `_C.shm_allreduce`):
//!     the all-reduce of its tensor argument.
//!
//! An op named in `ImportOptions::opaque_ops` is kept opaque with the reason given there.

use super::{collective, is_none, node, scalar, why, NodeView, Plan};
use crate::torch_export::{Bound, Lowering, PIn};
use arfuse_ir::{DType, NormInput, NormRounding, Op};

/// The IR's rounding of `x.to(weight.dtype) * weight` in vLLM's native norm: twice for a
/// 16-bit weight of the activation dtype, once for an f32 weight (or f32 activations).
fn native_rounding(v: &NodeView<'_>, x: Bound, w: Bound) -> Result<NormRounding, Option<String>> {
    let (Some(tx), Some(tw)) = (v.ty(x.value), v.ty(w.value)) else {
        return Err(why("unknown input"));
    };
    if tw.dtype == DType::F32 || tx.dtype == DType::F32 {
        Ok(NormRounding::Once)
    } else if tw.dtype == tx.dtype {
        Ok(NormRounding::Twice)
    } else {
        Err(why(format!(
            "a {} weight with {} activations (vLLM casts the normalised value to the \
             weight's dtype, which no fused form computes)",
            tw.dtype, tx.dtype
        )))
    }
}

/// `epsilon`, checked as an RMSNorm epsilon.
fn epsilon(v: &NodeView<'_>) -> Result<f64, Option<String>> {
    let eps = v
        .arg("epsilon")
        .and_then(scalar)
        .ok_or_else(|| why("no epsilon"))?;
    if !arfuse_ir::valid_eps(eps) {
        return Err(why(format!(
            "epsilon = {eps} is not an RMSNorm epsilon (finite, in (0, 1), non-zero in f32)"
        )));
    }
    Ok(eps)
}

fn tensor(v: &NodeView<'_>, name: &str) -> Result<Bound, Option<String>> {
    v.tensor_arg(name)
        .ok_or_else(|| why(format!("no tensor `{name}` argument")))
}

/// The weight of a vLLM norm (`None` is an unweighted norm, not fused), and no
/// `variance_size` (a norm over part of the row).
fn norm_weight(v: &NodeView<'_>) -> Result<Bound, Option<String>> {
    if !is_none(v.arg("variance_size")) {
        return Err(why(
            "variance_size is set (the variance of part of the row is not a fused norm)",
        ));
    }
    v.tensor_arg("weight")
        .ok_or_else(|| why("no weight (an unweighted norm is not fused)"))
}

/// `vllm_ir.rms_norm.default`.
pub(super) fn ir_rms_norm(v: &NodeView<'_>) -> Plan {
    let x = tensor(v, "x")?;
    let w = norm_weight(v)?;
    let eps = epsilon(v)?;
    rms_norm(v, x, w, eps, native_rounding(v, x, w)?)
}

fn rms_norm(v: &NodeView<'_>, x: Bound, w: Bound, eps: f64, norm_rounding: NormRounding) -> Plan {
    let out = v.one_out()?;
    Ok(Lowering::Nodes(vec![node(
        Op::RmsNorm {
            eps,
            weight_bias: 0.0,
            norm_rounding,
        },
        vec![PIn::Ext(x.value), PIn::Ext(w.value)],
        vec![out.0.clone()],
    )]))
}

/// `vllm_ir.fused_add_rms_norm.default`.
pub(super) fn ir_fused_add_rms_norm(v: &NodeView<'_>) -> Plan {
    let x = tensor(v, "x")?;
    let r = tensor(v, "x_residual")?;
    let w = norm_weight(v)?;
    let eps = epsilon(v)?;
    fused_add(
        v,
        x,
        r,
        w,
        eps,
        native_rounding(v, x, w)?,
        NormInput::F32Sum,
    )
}

fn fused_add(
    v: &NodeView<'_>,
    x: Bound,
    r: Bound,
    w: Bound,
    eps: f64,
    norm_rounding: NormRounding,
    norm_input: NormInput,
) -> Plan {
    let [(norm, _), (res, _)] = v.outs else {
        return Err(why(format!(
            "{} tensor outputs, two expected (norm, residual)",
            v.outs.len()
        )));
    };
    Ok(Lowering::Nodes(vec![node(
        Op::FusedAddRmsNorm {
            eps,
            weight_bias: 0.0,
            norm_rounding,
            norm_input,
        },
        vec![PIn::Ext(x.value), PIn::Ext(r.value), PIn::Ext(w.value)],
        vec![norm.clone(), res.clone()],
    )]))
}

/// The op an `auto_functionalized` node wraps (its `_op` argument), without `torch.ops.`.
pub(super) fn wrapped_op<'a>(v: &'a NodeView<'_>) -> Option<std::borrow::Cow<'a, str>> {
    v.arg("_op").and_then(|a| a.string())
}

/// `higher_order.auto_functionalized(_op, **kwargs)`: the wrapped op, when it is one of
/// the module documentation's.
pub(super) fn auto_functionalized(v: &NodeView<'_>) -> Plan {
    let Some(op) = wrapped_op(v) else {
        return Err(why("no `_op` argument"));
    };
    let op = op.strip_prefix("torch.ops.").unwrap_or(&op);
    if let Some(c) = v.opts.custom_all_reduce(op) {
        return collective::custom(v, c);
    }
    match op {
        "_C.rms_norm.default" => {
            let x = tensor(v, "input")?;
            let w = tensor(v, "weight")?;
            let eps = epsilon(v)?;
            rms_norm(v, x, w, eps, NormRounding::Once)
        }
        "_C.fused_add_rms_norm.default" => {
            let x = tensor(v, "input")?;
            let r = tensor(v, "residual")?;
            let w = tensor(v, "weight")?;
            let eps = epsilon(v)?;
            fused_add(v, x, r, w, eps, NormRounding::Once, NormInput::Residual)
        }
        "_C.static_scaled_fp8_quant.default" => {
            let x = tensor(v, "input")?;
            let s = tensor(v, "scale")?;
            let out = v.one_out()?;
            Ok(Lowering::Nodes(vec![node(
                Op::QuantFp8Static,
                vec![PIn::Ext(x.value), PIn::Ext(s.value)],
                vec![out.0.clone()],
            )]))
        }
        "_C.dynamic_per_token_scaled_fp8_quant.default" => {
            if !is_none(v.arg("scale_ub")) {
                return Err(why(
                    "scale_ub is set (the per-token amax is clamped, which the fused \
                     per-token FP8 epilogue does not do)",
                ));
            }
            let x = tensor(v, "input")?;
            let [(q, _), (s, _)] = v.outs else {
                return Err(why(format!(
                    "{} tensor outputs, two expected (result, scale)",
                    v.outs.len()
                )));
            };
            Ok(Lowering::Nodes(vec![node(
                Op::QuantFp8PerToken,
                vec![PIn::Ext(x.value)],
                vec![q.clone(), s.clone()],
            )]))
        }
        "_C.per_token_group_fp8_quant.default" => Err(why(
            "vLLM's kernel takes the scale layout (row-major, column-major or TMA-aligned) \
             from the scale tensor's strides, which the graph's metadata does not hold",
        )),
        "_C.scaled_fp4_quant.default" => Err(why(
            "vLLM's kernel scales each element by rcp.approx(SF * rcp.approx(1 / \
             global_scale)), not by global_scale / SF as the fused NVFP4 epilogue does \
             (arfuse rounding contract, clause 4)",
        )),
        _ => Err(None),
    }
}
