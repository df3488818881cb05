//! The contract's CPU computation of arfuse's torch custom ops (`arfuse.torch`): the
//! fused all-reduce -> residual add -> RMSNorm (-> quant) op for a group whose world size
//! the kernels are not built for, and the standalone per-token FP8 quant op, computed by
//! `arfuse::advanced::reference::contract` (the rounding contract), so their bits are
//! the contract's by construction. Groups of 2, 4, 8 or 16 ranks run arfuse's kernels
//! instead (`ranks.rs`).
//!
//! They work on the memory of CPU tensors that `arfuse.torch` allocated or made
//! contiguous and checked (dtype, device, element count) and keeps alive for the call; it
//! passes their addresses (`Tensor.data_ptr()`). These entry points are private
//! (`_`-prefixed) for that reason: an address that is not such a tensor's is undefined
//! behaviour.

use crate::ranks::{check_quant_tensors, dtype_of, quant_of, OutBuf};
use arfuse::advanced::ir::{NormInput, NormRounding};
use arfuse::advanced::reference::contract::{self, Epilogue, FusedParams};
use arfuse::advanced::reference::numerics::FloatFormat;
use arfuse_runtime::check::quant_bytes_for;
use arfuse_runtime::variants::Quant;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Element types the kernels read and write, by torch's name (`torch.bfloat16` ->
/// `bfloat16`).
#[derive(Clone, Copy)]
enum Elem {
    Bf16,
    F16,
    F32,
}

impl Elem {
    fn parse(what: &str, name: &str) -> PyResult<Elem> {
        match name {
            "bfloat16" => Ok(Elem::Bf16),
            "float16" => Ok(Elem::F16),
            "float32" => Ok(Elem::F32),
            _ => Err(PyValueError::new_err(format!(
                "{what}: dtype {name} is not bfloat16, float16 or float32"
            ))),
        }
    }

    fn format(self) -> FloatFormat {
        match self {
            Elem::Bf16 => FloatFormat::Bf16,
            Elem::F16 => FloatFormat::F16,
            Elem::F32 => FloatFormat::F32,
        }
    }
}

/// `n` elements at `addr`, widened exactly to f32.
///
/// Safety: `addr` is the data of a live, contiguous CPU tensor of `n` elements of `e`.
unsafe fn read(addr: usize, n: usize, e: Elem) -> Vec<f32> {
    match e {
        Elem::Bf16 | Elem::F16 => {
            let bits = std::slice::from_raw_parts(addr as *const u16, n);
            match e {
                Elem::Bf16 => bits
                    .iter()
                    .map(|&b| half::bf16::from_bits(b).to_f32())
                    .collect(),
                _ => bits
                    .iter()
                    .map(|&b| half::f16::from_bits(b).to_f32())
                    .collect(),
            }
        }
        Elem::F32 => std::slice::from_raw_parts(addr as *const f32, n).to_vec(),
    }
}

/// Writes `v` (values of `e`, so the narrowing is exact) to `addr`.
///
/// Safety: `addr` is the data of a live, contiguous CPU tensor of `v.len()` elements of
/// `e` that nothing else reads or writes during the call.
unsafe fn write(addr: usize, v: &[f32], e: Elem) {
    match e {
        Elem::Bf16 => {
            let out = std::slice::from_raw_parts_mut(addr as *mut u16, v.len());
            for (o, &x) in out.iter_mut().zip(v) {
                *o = half::bf16::from_f32(x).to_bits();
            }
        }
        Elem::F16 => {
            let out = std::slice::from_raw_parts_mut(addr as *mut u16, v.len());
            for (o, &x) in out.iter_mut().zip(v) {
                *o = half::f16::from_f32(x).to_bits();
            }
        }
        Elem::F32 => std::slice::from_raw_parts_mut(addr as *mut f32, v.len()).copy_from_slice(v),
    }
}

/// Safety: as [`write`], for bytes.
unsafe fn write_bytes(addr: usize, v: &[u8]) {
    std::slice::from_raw_parts_mut(addr as *mut u8, v.len()).copy_from_slice(v);
}

fn check_shape(numel: usize, hidden: usize, addrs: &[(&str, usize)]) -> PyResult<usize> {
    if hidden == 0 || numel % hidden != 0 {
        return Err(PyValueError::new_err(format!(
            "{numel} elements do not form rows of hidden size {hidden}"
        )));
    }
    if let Some((what, _)) = addrs.iter().find(|(_, a)| *a == 0) {
        return Err(PyValueError::new_err(format!("{what}: null data pointer")));
    }
    Ok(numel / hidden)
}

/// `tokens` and `hidden` as u32, after [`check_quant_tensors`] of the quant tensors.
fn checked_quant(
    q: Quant,
    dtype: &str,
    tokens: usize,
    hidden: usize,
    quant_out: OutBuf,
    scale_out: OutBuf,
    scale_in: usize,
) -> PyResult<(u32, u32)> {
    let too_large = || PyValueError::new_err("input size overflows");
    let t = u32::try_from(tokens).map_err(|_| too_large())?;
    let h = u32::try_from(hidden).map_err(|_| too_large())?;
    check_quant_tensors(q, dtype_of(dtype)?, t, h, quant_out, scale_out, scale_in)?;
    Ok((t, h))
}

fn reference_error(e: arfuse::advanced::reference::ReferenceError) -> PyErr {
    PyValueError::new_err(format!("{}: {e}", contract::CONTRACT_NAME))
}

/// The fused op on one rank: `ranks` holds every rank's input in rank order
/// (`[world, numel]` contiguous, all-gathered by the caller), `residual` this rank's
/// residual (0: none), `weight` `[hidden]`. Writes `norm_out` and `residual_out`
/// (`numel` elements of `dtype`) and, for a quant epilogue (`quant`, an op name of
/// `ranks::op_quant_name`), `quant_out` and `scale_out` as (address, bytes) in the
/// kernels' layouts (`arfuse_runtime::check::quant_bytes_of`); `scale_in` is the
/// address of the f32 static FP8 or NVFP4 global scale (0: none). Contract clauses 1-4
/// (the quant applied to the norm output, as the kernels do); `norm_f32_sum` normalises
/// the unrounded f32 sum of the all-reduce and the residual (`NormInput::F32Sum`).
#[pyfunction]
#[pyo3(signature = (dtype, ranks, world, numel, hidden, residual, weight, weight_dtype, eps,
    weight_bias, norm_round_twice, norm_f32_sum, quant, norm_out, residual_out, quant_out, scale_out,
    scale_in))]
#[allow(clippy::too_many_arguments)]
pub fn _fused_allreduce_rms_norm_cpu(
    dtype: &str,
    ranks: usize,
    world: usize,
    numel: usize,
    hidden: usize,
    residual: usize,
    weight: usize,
    weight_dtype: &str,
    eps: f64,
    weight_bias: f64,
    norm_round_twice: bool,
    norm_f32_sum: bool,
    quant: &str,
    norm_out: usize,
    residual_out: usize,
    quant_out: OutBuf,
    scale_out: OutBuf,
    scale_in: usize,
) -> PyResult<()> {
    let e = Elem::parse("input", dtype)?;
    let we = Elem::parse("weight", weight_dtype)?;
    let q = quant_of(quant)?;
    let addrs = [
        ("ranks", ranks),
        ("weight", weight),
        ("norm_out", norm_out),
        ("residual_out", residual_out),
    ];
    let tokens = check_shape(numel, hidden, &addrs)?;
    checked_quant(q, dtype, tokens, hidden, quant_out, scale_out, scale_in)?;
    if world == 0 {
        return Err(PyValueError::new_err("an all-reduce over zero ranks"));
    }
    let step = numel
        .checked_mul(e.format().bytes() as usize)
        .ok_or_else(|| PyValueError::new_err("input size overflows"))?;
    // Safety (every read and write below): the caller passes the data of live,
    // contiguous CPU tensors of the sizes stated above (`arfuse.torch`), checked by
    // `check_quant_tensors` for the quant outputs.
    let inputs: Vec<Vec<f32>> = (0..world)
        .map(|r| unsafe { read(ranks + r * step, numel, e) })
        .collect();
    let slices: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
    let res = (residual != 0).then(|| unsafe { read(residual, numel, e) });
    let gamma = unsafe { read(weight, hidden, we) };
    let params = FusedParams {
        t: e.format(),
        eps,
        weight_bias,
        norm_rounding: if norm_round_twice {
            NormRounding::Twice
        } else {
            NormRounding::Once
        },
        norm_input: if norm_f32_sum {
            NormInput::F32Sum
        } else {
            NormInput::Residual
        },
        epilogue: Epilogue::None,
    };
    let out = contract::fused_allreduce_norm(&slices, res.as_deref(), &gamma, params)
        .map_err(reference_error)?;
    unsafe {
        write(norm_out, &out.norm_out, e);
        write(residual_out, &out.residual_out, e);
    }
    if q != Quant::None {
        _quant_cpu(
            quant, dtype, norm_out, numel, hidden, quant_out, scale_out, scale_in,
        )?;
    }
    Ok(())
}

/// The contract's quant (clause 4) of `x` (`numel` elements of `dtype` in rows of
/// `hidden`): `quant` an op name (`ranks::op_quant_name`), `quant_out` and `scale_out`
/// as (address, bytes) in the kernels' layouts, `scale_in` the address of the f32
/// static FP8 or NVFP4 global scale (0: none). The per-token FP8 op's CPU kernel, and
/// the reference the tests hold the fused op's quant outputs to.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn _quant_cpu(
    quant: &str,
    dtype: &str,
    x: usize,
    numel: usize,
    hidden: usize,
    quant_out: OutBuf,
    scale_out: OutBuf,
    scale_in: usize,
) -> PyResult<()> {
    let e = Elem::parse("input", dtype)?;
    let q = quant_of(quant)?;
    let tokens = check_shape(numel, hidden, &[("x", x)])?;
    let (t32, h32) = checked_quant(q, dtype, tokens, hidden, quant_out, scale_out, scale_in)?;
    // Safety: as in `_fused_allreduce_rms_norm_cpu`; the outputs' sizes were checked.
    let y = unsafe { read(x, numel, e) };
    let scale = if scale_in == 0 {
        0.0
    } else {
        unsafe { read(scale_in, 1, Elem::F32)[0] }
    };
    let (data, scales) = quant_bytes_for(q, t32, h32, &y, scale)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    unsafe {
        if !data.is_empty() {
            write_bytes(quant_out.0, &data);
        }
        if !scales.is_empty() {
            write_bytes(scale_out.0, &scales);
        }
    }
    Ok(())
}
