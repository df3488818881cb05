//! The mapping of ATen, prims and collective targets onto IR ops.
//!
//! [`lower`] returns the planned IR nodes for one torch node, `Err(None)` for a target
//! that is simply not modelled (it becomes `opaque`) and `Err(Some(why))` for a
//! modelled target whose arguments do not fit the IR op (it becomes `opaque`, and the
//! reason is noted). The caller type-checks every plan with the IR validator.
//!
//! The same table serves torch.export graphs and the post-grad graphs a torch.compile
//! pass serializes (`docs/fx-graph-format.md`): `prims.convert_element_type` is a cast,
//! `aten._unsafe_view` a view, `aten.sum.dim_IntList` followed by a division by the
//! element count a `mean` (paired by the builder, [`mean_of_sum`]), and element-wise
//! ops follow torch's type promotion ([`promote`]). Collectives: [`collective`].

mod collective;
mod promote;
mod vllm;

use super::arg::Arg;
use super::{Bound, Lowering, PIn, PNode};
use crate::ImportOptions;
use arfuse_ir::{Graph, Op, TensorType, Value};

/// One torch node as the mapper sees it.
pub(super) struct NodeView<'a> {
    /// The target without `torch.ops.`.
    pub target: &'a str,
    /// The named arguments.
    pub args: &'a [(String, Arg)],
    /// Its tensor arguments, resolved, in argument order.
    pub ins: &'a [Bound],
    /// Its tensor outputs' types (and whether each is bool).
    pub outs: &'a [(TensorType, bool)],
    /// The graph built so far.
    pub g: &'a Graph,
    /// The import options (custom all-reduce ops).
    pub opts: &'a ImportOptions,
}

type Plan = Result<Lowering, Option<String>>;

/// Targets whose output is their (only) tensor input, unchanged.
const IDENTITY: &[&str] = &[
    "_c10d_functional.wait_tensor.default",
    "c10d_functional.wait_tensor.default",
    "aten.contiguous.default",
    "aten.clone.default",
    "aten.alias.default",
    "aten.detach.default",
    "aten.lift_fresh_copy.default",
];

/// Casts: the output dtype comes from the output's metadata.
const CASTS: &[&str] = &[
    "prims.convert_element_type.default",
    "aten.to.dtype",
    "aten.to.dtype_layout",
    "aten.to.device",
    "aten.to.other",
    "aten._to_copy.default",
    "aten.type_as.default",
];

/// Views that keep the element count (`expand` only when it does).
const VIEWS: &[&str] = &[
    "aten.view.default",
    "aten.reshape.default",
    "aten._unsafe_view.default",
    "aten.unsqueeze.default",
    "aten.squeeze.default",
    "aten.squeeze.dim",
    "aten.squeeze.dims",
    "aten.flatten.using_ints",
    "aten.unflatten.int",
    "aten.expand.default",
];

impl NodeView<'_> {
    fn arg(&self, name: &str) -> Option<&Arg> {
        super::arg(self.args, name)
    }

    /// The argument's tensor, if it holds exactly one (a tensor, or a present optional
    /// tensor).
    fn tensor_arg(&self, name: &str) -> Option<Bound> {
        // `ins` holds the tensors of every argument, in argument order.
        let mut k = 0;
        for (n, a) in self.args {
            if n == name {
                return if a.is_single_tensor() {
                    self.ins.get(k).copied()
                } else {
                    None
                };
            }
            k += a.tensor_count();
        }
        None
    }

    /// The first tensor of list argument `name`.
    fn tensor_in_list(&self, name: &str) -> Option<Bound> {
        let mut k = 0;
        for (n, a) in self.args {
            if n == name {
                return (a.tensor_count() > 0)
                    .then(|| self.ins.get(k).copied())
                    .flatten();
            }
            k += a.tensor_count();
        }
        None
    }

    fn ty(&self, v: Value) -> Option<&TensorType> {
        self.g.value_type(v)
    }

    fn one_out(&self) -> Result<&(TensorType, bool), Option<String>> {
        match self.outs {
            [o] => Ok(o),
            _ => Err(Some(format!(
                "{} tensor outputs, one expected",
                self.outs.len()
            ))),
        }
    }
}

/// A Python number argument (an int or a float).
fn scalar(a: &Arg) -> Option<f64> {
    a.number()
}

fn is_none(a: Option<&Arg>) -> bool {
    match a {
        None => true,
        Some(a) => a.is_none(),
    }
}

fn why(s: impl Into<String>) -> Option<String> {
    Some(s.into())
}

fn node(op: Op, inputs: Vec<PIn>, outputs: Vec<TensorType>) -> PNode {
    PNode {
        suffix: None,
        op,
        inputs,
        outputs,
    }
}

/// Plans the IR nodes of one torch node.
pub(super) fn lower(v: &NodeView<'_>) -> Plan {
    let t = v.target;
    let inner = vllm::wrapped_op(v);
    if let Some(reason) = v.opts.opaque_reason(inner.as_deref().unwrap_or(t)) {
        return Err(why(reason));
    }
    if let Some(c) = v.opts.custom_all_reduce(t) {
        return collective::custom(v, c);
    }
    if IDENTITY.contains(&t) {
        return identity(v);
    }
    if CASTS.contains(&t) {
        return cast(v);
    }
    if VIEWS.contains(&t) {
        return view(v);
    }
    match t {
        "_c10d_functional.all_reduce.default"
        | "_c10d_functional.all_reduce_.default"
        | "c10d_functional.all_reduce.default" => collective::functional(v),
        "c10d.allreduce_.default" => collective::c10d_inplace(v),
        "aten.add.Tensor" | "aten.add.Scalar" => promote::binary(v, promote::Bin::Add),
        "aten.mul.Tensor" | "aten.mul.Scalar" => promote::binary(v, promote::Bin::Mul),
        "aten.copy_.default" => copy(v),
        "aten.pow.Tensor_Scalar" => pow(v),
        "aten.mean.dim" => mean(v),
        "aten.rsqrt.default" => unary_float(v, Op::Rsqrt),
        "aten.linear.default" => linear(v),
        "aten.mm.default" | "aten.matmul.default" => matmul(v),
        "aten.embedding.default" => embedding(v),
        "aten.rms_norm.default" => rms_norm(v),
        "higher_order.auto_functionalized" => vllm::auto_functionalized(v),
        "vllm_ir.rms_norm.default" => vllm::ir_rms_norm(v),
        "vllm_ir.fused_add_rms_norm.default" => vllm::ir_fused_add_rms_norm(v),
        ARFUSE_QUANT_FP8_PER_TOKEN => quant_fp8_per_token(v),
        _ => Err(None),
    }
}

/// `auto_functionalized(OP)` for a node that wraps OP (the name notes and warnings
/// give it), or `None`.
pub(super) fn wrapped_op_name(v: &NodeView<'_>) -> Option<String> {
    if !v.target.starts_with("higher_order.auto_functionalized") {
        return None;
    }
    vllm::wrapped_op(v).map(|op| format!("{}({op})", v.target))
}

/// arfuse's own dynamic per-token FP8 quant op, `torch.ops.arfuse.quant_fp8_per_token`
/// (registered by the Python package `arfuse`, contract clause 4): `(Tensor input) ->
/// (Tensor quant, Tensor scale)`, e4m3 values `[..., H]` and f32 scales `[..., 1]`.
pub const ARFUSE_QUANT_FP8_PER_TOKEN: &str = "arfuse.quant_fp8_per_token.default";

/// `arfuse.quant_fp8_per_token(input)`: the IR's `quant_fp8_per_token` (two outputs,
/// typed from the metadata; the IR validator checks them).
fn quant_fp8_per_token(v: &NodeView<'_>) -> Plan {
    let (b, _) = self_tensor(v)?;
    let [(q, q_bool), (s, s_bool)] = v.outs else {
        return Err(why(format!(
            "{} tensor outputs, two expected (quant, scale)",
            v.outs.len()
        )));
    };
    if b.is_bool || *q_bool || *s_bool {
        return Err(why("a bool tensor"));
    }
    Ok(Lowering::Nodes(vec![node(
        Op::QuantFp8PerToken,
        vec![PIn::Ext(b.value)],
        vec![q.clone(), s.clone()],
    )]))
}

/// Whether `target` mutates its first argument in place (ATen's naming: the op name
/// ends in `_`, `aten.add_.Tensor`, `aten.copy_.default`, `c10d.allreduce_.default`;
/// dunder names such as `__and__` do not).
pub(super) fn mutates_first_argument(target: &str) -> bool {
    // The name: what follows the namespace, up to the overload.
    let Some((_ns, rest)) = target.split_once('.') else {
        return false;
    };
    let name = rest.split_once('.').map_or(rest, |(name, _)| name);
    name.ends_with('_') && !name.starts_with("__")
}

fn self_tensor(v: &NodeView<'_>) -> Result<(Bound, TensorType), Option<String>> {
    let b = v
        .tensor_arg("self")
        .or_else(|| v.tensor_arg("input"))
        .or_else(|| v.tensor_arg("tensor"))
        .or_else(|| v.tensor_arg("a"))
        .ok_or_else(|| why("no tensor `self` argument"))?;
    let ty = v.ty(b.value).cloned().ok_or_else(|| why("unknown input"))?;
    Ok((b, ty))
}

fn identity(v: &NodeView<'_>) -> Plan {
    let (b, ty) = self_tensor(v)?;
    let out = v.one_out()?;
    if out.0 != ty || out.1 != b.is_bool {
        return Err(why(format!("output {} differs from input {ty}", out.0)));
    }
    Ok(Lowering::Forward(b.value))
}

fn cast(v: &NodeView<'_>) -> Plan {
    let (b, ty) = self_tensor(v)?;
    let out = v.one_out()?;
    if out.0.shape != ty.shape {
        return Err(why(format!("output {} changes the shape of {ty}", out.0)));
    }
    if out.0.dtype == ty.dtype && out.1 == b.is_bool {
        return Ok(Lowering::Forward(b.value));
    }
    if out.1 || b.is_bool {
        return Err(why("a cast from or to bool"));
    }
    Ok(Lowering::Nodes(vec![node(
        Op::ToDtype { dtype: out.0.dtype },
        vec![PIn::Ext(b.value)],
        vec![out.0.clone()],
    )]))
}

fn view(v: &NodeView<'_>) -> Plan {
    let (b, ty) = self_tensor(v)?;
    let out = v.one_out()?;
    if out.0 == ty {
        return Ok(Lowering::Forward(b.value));
    }
    if b.is_bool {
        return Err(why("a bool tensor"));
    }
    if out.0.shape.numel() != ty.shape.numel() {
        return Err(why("the element count changes (a broadcasting expand)"));
    }
    Ok(Lowering::Nodes(vec![node(
        Op::Reshape,
        vec![PIn::Ext(b.value)],
        vec![out.0.clone()],
    )]))
}

/// `aten.copy_(self, src)`: `self` now holds `src` converted to `self`'s dtype (the
/// builder rebinds `self` for later readers). A broadcasting copy stays opaque.
fn copy(v: &NodeView<'_>) -> Plan {
    let dst = v
        .tensor_arg("self")
        .ok_or_else(|| why("no tensor `self` argument"))?;
    let src = v
        .tensor_arg("src")
        .ok_or_else(|| why("no tensor `src` argument"))?;
    let (dty, sty) = match (v.ty(dst.value), v.ty(src.value)) {
        (Some(d), Some(s)) => (d.clone(), s.clone()),
        _ => return Err(why("unknown input")),
    };
    let out = v.one_out()?;
    if out.0 != dty || dst.is_bool != out.1 {
        return Err(why(format!("output {} differs from `self` {dty}", out.0)));
    }
    if sty.shape != dty.shape {
        return Err(why(format!("a broadcasting copy of {sty} into {dty}")));
    }
    if sty.dtype == dty.dtype && src.is_bool == dst.is_bool {
        return Ok(Lowering::Forward(src.value));
    }
    if src.is_bool || dst.is_bool {
        return Err(why("a copy from or to bool"));
    }
    Ok(Lowering::Nodes(vec![node(
        Op::ToDtype { dtype: dty.dtype },
        vec![PIn::Ext(src.value)],
        vec![dty],
    )]))
}

fn pow(v: &NodeView<'_>) -> Plan {
    let (b, _) = self_tensor(v)?;
    let out = v.one_out()?;
    let e = v
        .arg("exponent")
        .and_then(scalar)
        .ok_or_else(|| why("a non-numeric exponent"))?;
    Ok(Lowering::Nodes(vec![node(
        Op::Pow { exponent: e },
        vec![PIn::Ext(b.value)],
        vec![out.0.clone()],
    )]))
}

/// `aten.sum.dim_IntList(x, dims, keepdim)` whose only reader divides it by the number
/// of summed elements, both in f32: the IR's `mean` (the f32 sum divided by the count,
/// one rounding). The builder decides the pairing ([`sum_divisor`]) and forwards the
/// division to this node.
pub(super) fn mean_of_sum(v: &NodeView<'_>) -> Plan {
    mean(v)
}

/// The divisor a division by the element count of `sum` must use: the product of the
/// reduced dims of the f32 input, when every one of them is a constant and the sum
/// keeps f32 (`dtype` absent). `None` when a `sum` cannot become a `mean`.
pub(super) fn sum_divisor(
    args: &[(String, Arg)],
    input: &TensorType,
    out: &TensorType,
) -> Option<u64> {
    let arg = |n: &str| super::arg(args, n);
    if input.dtype != arfuse_ir::DType::F32 || out.dtype != input.dtype || !is_none(arg("dtype")) {
        return None;
    }
    let dims = arg("dim")?.ints()?;
    let rank = input.shape.rank() as i64;
    let mut n: u64 = 1;
    let mut seen = Vec::new();
    for d in dims {
        let d = d?;
        let k = if d < 0 { d + rank } else { d };
        if k < 0 || k >= rank || seen.contains(&k) {
            return None;
        }
        seen.push(k);
        n = n.checked_mul(input.shape.dims()[k as usize].as_const()?)?;
    }
    (!seen.is_empty()).then_some(n)
}

fn mean(v: &NodeView<'_>) -> Plan {
    let (b, _) = self_tensor(v)?;
    let out = v.one_out()?;
    if !is_none(v.arg("dtype")) {
        return Err(why("an explicit dtype"));
    }
    let dims: Vec<i64> = v
        .arg("dim")
        .and_then(Arg::ints)
        .map(|l| l.into_iter().flatten().collect())
        .ok_or_else(|| why("no dim list"))?;
    let keepdim = match v.arg("keepdim") {
        None => false,
        Some(a) => a.bool().ok_or_else(|| why("keepdim is not a bool"))?,
    };
    Ok(Lowering::Nodes(vec![node(
        Op::Mean { dims, keepdim },
        vec![PIn::Ext(b.value)],
        vec![out.0.clone()],
    )]))
}

fn unary_float(v: &NodeView<'_>, op: Op) -> Plan {
    let (b, _) = self_tensor(v)?;
    let out = v.one_out()?;
    Ok(Lowering::Nodes(vec![node(
        op,
        vec![PIn::Ext(b.value)],
        vec![out.0.clone()],
    )]))
}

fn linear(v: &NodeView<'_>) -> Plan {
    let x = v
        .tensor_arg("input")
        .ok_or_else(|| why("no input tensor"))?;
    let w = v
        .tensor_arg("weight")
        .ok_or_else(|| why("no weight tensor"))?;
    let out = v.one_out()?;
    let mm = node(
        Op::Matmul { transpose_b: true },
        vec![PIn::Ext(x.value), PIn::Ext(w.value)],
        vec![out.0.clone()],
    );
    match v.tensor_arg("bias") {
        None if is_none(v.arg("bias")) => Ok(Lowering::Nodes(vec![mm])),
        None => Err(why("a bias that is not a tensor")),
        Some(bias) => Ok(Lowering::Nodes(vec![
            PNode {
                suffix: Some("matmul"),
                ..mm
            },
            node(
                Op::Add,
                vec![PIn::Local(0), PIn::Ext(bias.value)],
                vec![out.0.clone()],
            ),
        ])),
    }
}

fn matmul(v: &NodeView<'_>) -> Plan {
    let x = v.tensor_arg("self").ok_or_else(|| why("no self tensor"))?;
    let w = v
        .tensor_arg("mat2")
        .or_else(|| v.tensor_arg("other"))
        .ok_or_else(|| why("no second operand"))?;
    let out = v.one_out()?;
    Ok(Lowering::Nodes(vec![node(
        Op::Matmul { transpose_b: false },
        vec![PIn::Ext(x.value), PIn::Ext(w.value)],
        vec![out.0.clone()],
    )]))
}

fn embedding(v: &NodeView<'_>) -> Plan {
    let w = v
        .tensor_arg("weight")
        .ok_or_else(|| why("no weight tensor"))?;
    let ids = v
        .tensor_arg("indices")
        .ok_or_else(|| why("no indices tensor"))?;
    let out = v.one_out()?;
    // padding_idx, scale_grad_by_freq and sparse only change gradients.
    Ok(Lowering::Nodes(vec![node(
        Op::Embedding,
        vec![PIn::Ext(w.value), PIn::Ext(ids.value)],
        vec![out.0.clone()],
    )]))
}

fn rms_norm(v: &NodeView<'_>) -> Plan {
    let x = v
        .tensor_arg("input")
        .ok_or_else(|| why("no input tensor"))?;
    let w = v
        .tensor_arg("weight")
        .ok_or_else(|| why("no weight (elementwise_affine=False)"))?;
    let eps = match v.arg("eps") {
        a if is_none(a) => {
            return Err(why(
                "no explicit eps (torch's default depends on the dtype)",
            ))
        }
        Some(a) => {
            scalar(a).ok_or_else(|| why(format!("eps is not a number: {}", a.schema_json())))?
        }
        None => {
            return Err(why(
                "no explicit eps (torch's default depends on the dtype)",
            ))
        }
    };
    if !arfuse_ir::valid_eps(eps) {
        return Err(why(format!(
            "eps = {eps} is not an RMSNorm epsilon (finite, in (0, 1), non-zero in f32)"
        )));
    }
    let shape_len = v.arg("normalized_shape").and_then(Arg::int_list_len);
    if shape_len != Some(1) {
        return Err(why("normalized_shape is not one dimension"));
    }
    let out = v.one_out()?;
    Ok(Lowering::Nodes(vec![node(
        Op::RmsNorm {
            eps,
            weight_bias: 0.0,
            norm_rounding: Default::default(),
        },
        vec![PIn::Ext(x.value), PIn::Ext(w.value)],
        vec![out.0.clone()],
    )]))
}
