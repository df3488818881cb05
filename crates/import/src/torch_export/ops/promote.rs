//! Element-wise `add` and `mul` with torch's type promotion made explicit.
//!
//! An ATen element-wise op of a bf16/f16/f32 result computes in f32 ("opmath") and
//! rounds once to the result dtype; its operands enter converted to the result dtype,
//! except a Python number, which enters as an f32 (domain.md §2: a norm that multiplies
//! a bf16 weight by f32 activations relies on this). The IR's `add` and `mul` take one
//! dtype and compute the same way (f32, one rounding), so each torch node becomes:
//!
//! - tensor `a` op tensor `b`: `to_dtype(R, ·)` of each operand whose dtype is not the
//!   result dtype R, then the op in R. Exact: for tensors with dimensions torch's
//!   promotion never narrows (bf16 and f16 both widen to f32), and an integer operand
//!   is converted to R first, as torch does. A 0-dim tensor of another dtype is kept
//!   opaque (it enters at the compute precision on some backends and at R on others).
//! - tensor op Python number `c`: `c` as a constant of R when it is exactly
//!   representable in R (then `round_R(f32(a) op f32(c))` is torch's result); otherwise,
//!   for a 16-bit R, `to_dtype(R, op(to_dtype(f32, a), c_f32))`.
//! - `add` with `alpha` (`a + alpha * b`): 1 is a plain add; -1 is `a + b * -1` in R
//!   (negation is exact); another power of two `2^k` is computed in f32,
//!   `to_dtype(R, to_dtype(f32, a) + to_dtype(f32, b) * 2^k)`, exact because the scaling
//!   is. Any other alpha is kept opaque: torch evaluates `a + alpha * b` with a fused
//!   multiply-add, which the IR cannot express exactly.
//!
//! Bool operands and integer results stay opaque.

use super::{is_none, node, scalar, self_tensor, why, NodeView, Plan};
use crate::torch_export::{Lowering, PIn, PNode};
use arfuse_ir::{broadcast, DType, Op, TensorType};

/// The two element-wise ops.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(in crate::torch_export) enum Bin {
    Add,
    Mul,
}

impl Bin {
    fn op(self) -> Op {
        match self {
            Bin::Add => Op::Add,
            Bin::Mul => Op::Mul,
        }
    }
}

/// The planned nodes of one torch node, helpers first.
struct Chain {
    nodes: Vec<PNode>,
}

/// A planned operand and its type.
#[derive(Clone)]
struct Operand {
    input: PIn,
    ty: TensorType,
}

impl Chain {
    fn helper(
        &mut self,
        suffix: &'static str,
        op: Op,
        inputs: Vec<PIn>,
        ty: TensorType,
    ) -> Operand {
        self.nodes.push(PNode {
            suffix: Some(suffix),
            op,
            inputs,
            outputs: vec![ty.clone()],
        });
        Operand {
            input: PIn::Local(self.nodes.len() - 1),
            ty,
        }
    }

    /// `x` in dtype `d` (a `to_dtype` helper unless it already is).
    fn cast(&mut self, suffix: &'static str, x: Operand, d: DType) -> Operand {
        if x.ty.dtype == d {
            return x;
        }
        let ty = TensorType {
            dtype: d,
            shape: x.ty.shape.clone(),
        };
        self.helper(suffix, Op::ToDtype { dtype: d }, vec![x.input], ty)
    }

    fn constant(&mut self, suffix: &'static str, value: f64, d: DType) -> Operand {
        self.helper(
            suffix,
            Op::Constant { value },
            vec![],
            TensorType::new(d, vec![]),
        )
    }

    /// `a op b` as a helper of dtype `d` (the operands' dtype).
    fn apply(
        &mut self,
        suffix: &'static str,
        bin: Bin,
        a: Operand,
        b: Operand,
    ) -> Result<Operand, Option<String>> {
        let shape = broadcast(&a.ty.shape, &b.ty.shape).ok_or_else(|| {
            why(format!(
                "shapes {} and {} do not broadcast",
                a.ty.shape, b.ty.shape
            ))
        })?;
        let ty = TensorType {
            dtype: a.ty.dtype,
            shape,
        };
        Ok(self.helper(suffix, bin.op(), vec![a.input, b.input], ty))
    }

    /// The last node: `op(inputs)` producing the torch node's output.
    fn finish(mut self, op: Op, inputs: Vec<PIn>, out: &TensorType) -> Plan {
        self.nodes.push(node(op, inputs, vec![out.clone()]));
        Ok(Lowering::Nodes(self.nodes))
    }

    /// The last node: `x` (an f32 helper) cast to the result dtype.
    fn finish_cast(self, x: Operand, out: &TensorType) -> Plan {
        if x.ty.dtype == out.dtype {
            // The last helper is the result: it produces the torch node's output.
            let mut nodes = self.nodes;
            if let Some(last) = nodes.last_mut() {
                last.suffix = None;
            }
            return Ok(Lowering::Nodes(nodes));
        }
        self.finish(Op::ToDtype { dtype: out.dtype }, vec![x.input], out)
    }
}

/// Whether `c` is exactly a value of float dtype `d`.
pub(in crate::torch_export) fn exact_in(c: f64, d: DType) -> bool {
    if !c.is_finite() {
        return false;
    }
    match d {
        DType::F32 => (c as f32) as f64 == c,
        DType::Bf16 => half::bf16::from_f64(c).to_f64() == c,
        DType::F16 => half::f16::from_f64(c).to_f64() == c,
        _ => false,
    }
}

/// Whether `a` is `±2^k` (a scaling that is exact in binary floating point).
fn power_of_two(a: f64) -> bool {
    let m = a.abs();
    m.is_normal() && m == 2f64.powi(m.log2().round() as i32)
}

/// A tensor operand converted to the result dtype `r`, as torch's promotion does.
fn promoted(
    c: &mut Chain,
    suffix: &'static str,
    x: Operand,
    is_bool: bool,
    r: DType,
) -> Result<Operand, Option<String>> {
    if is_bool {
        return Err(why("bool operands"));
    }
    if x.ty.dtype == r {
        return Ok(x);
    }
    if x.ty.shape.rank() == 0 {
        return Err(why(format!(
            "a 0-dim {} tensor operand with a {r} result (torch applies it at the compute \
             precision on some backends and at {r} on others)",
            x.ty.dtype
        )));
    }
    if x.ty.dtype.is_float() && x.ty.dtype.size_bytes() > r.size_bytes() {
        return Err(why(format!(
            "a {} operand with a narrower {r} result, which is not torch's promotion",
            x.ty.dtype
        )));
    }
    Ok(c.cast(suffix, x, r))
}

/// Plans `aten.add` / `aten.mul` (`.Tensor` and `.Scalar`) with promotion.
pub(in crate::torch_export) fn binary(v: &NodeView<'_>, bin: Bin) -> Plan {
    let out = v.one_out()?;
    let (a, aty) = self_tensor(v)?;
    let other = v.arg("other").ok_or_else(|| why("no `other` argument"))?;
    let b = v.tensor_arg("other");
    if a.is_bool || out.1 || b.is_some_and(|b| b.is_bool) {
        return Err(why("bool operands"));
    }
    let r = out.0.dtype;
    if !r.is_float() {
        return Err(why(if b.is_none() {
            format!("a scalar operand with an integer ({}) tensor", aty.dtype)
        } else {
            format!("an integer ({r}) result (only float arithmetic is modelled)")
        }));
    }
    let alpha = match v.arg("alpha") {
        Some(al) if bin == Bin::Add && !is_none(Some(al)) => {
            let al = scalar(al).ok_or_else(|| why("a non-numeric alpha"))?;
            (al != 1.0).then_some(al)
        }
        _ => None,
    };
    let mut c = Chain { nodes: Vec::new() };
    let a = Operand {
        input: PIn::Ext(a.value),
        ty: aty,
    };
    let a = promoted(&mut c, "promote_self", a, false, r)?;
    let Some(b) = b else {
        let k = scalar(other).ok_or_else(|| why("a non-numeric scalar operand"))?;
        if alpha.is_some() {
            return Err(why("alpha with a scalar operand"));
        }
        return scalar_op(c, bin, a, k, &out.0);
    };
    let bty = v.ty(b.value).cloned().ok_or_else(|| why("unknown input"))?;
    let b = Operand {
        input: PIn::Ext(b.value),
        ty: bty,
    };
    let b = promoted(&mut c, "promote_other", b, false, r)?;
    match alpha {
        None => c.finish(bin.op(), vec![a.input, b.input], &out.0),
        Some(-1.0) => {
            let m = c.constant("alpha", -1.0, r);
            let nb = c.apply("scaled", Bin::Mul, b, m)?;
            c.finish(Op::Add, vec![a.input, nb.input], &out.0)
        }
        Some(al) if power_of_two(al) => {
            let a32 = c.cast("self_f32", a, DType::F32);
            let b32 = c.cast("other_f32", b, DType::F32);
            let k = c.constant("alpha", al, DType::F32);
            let scaled = c.apply("scaled", Bin::Mul, b32, k)?;
            let sum = c.apply("sum_f32", Bin::Add, a32, scaled)?;
            c.finish_cast(sum, &out.0)
        }
        Some(al) => Err(why(format!(
            "alpha {al} is not a power of two: torch computes a + alpha * b with a fused \
             multiply-add, which the IR cannot express exactly"
        ))),
    }
}

/// `a op k` for a Python number `k`.
fn scalar_op(mut c: Chain, bin: Bin, a: Operand, k: f64, out: &TensorType) -> Plan {
    let r = out.dtype;
    if !k.is_finite() {
        return Err(why(format!("a non-finite scalar operand ({k})")));
    }
    if exact_in(k, r) {
        let kc = c.constant("scalar", k, r);
        return c.finish(bin.op(), vec![a.input, kc.input], out);
    }
    let a32 = c.cast("self_f32", a, DType::F32);
    let kc = c.constant("scalar", k, DType::F32);
    let y = c.apply("f32", bin, a32, kc)?;
    c.finish_cast(y, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactness_and_powers_of_two() {
        assert!(exact_in(1.0, DType::Bf16));
        assert!(exact_in(0.5, DType::F16));
        assert!(!exact_in(0.1, DType::Bf16));
        assert!(!exact_in(1e-6, DType::F32));
        assert!(exact_in(2f64.powi(-20), DType::F32));
        assert!(!exact_in(65536.0 * 2.0, DType::F16));
        assert!(!exact_in(f64::NAN, DType::F32));
        for p in [1.0, -1.0, 2.0, -0.5, 1024.0] {
            assert!(power_of_two(p), "{p}");
        }
        for p in [0.0, 3.0, -0.3, f64::INFINITY] {
            assert!(!power_of_two(p), "{p}");
        }
    }
}
