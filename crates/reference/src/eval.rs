//! The reference evaluator: runs an IR graph over W virtual ranks on the CPU.
//!
//! Every rank has its own input tensors; `all_reduce` and the fused node
//! combine the ranks per [`crate::contract`]; every other op runs per rank
//! with a plain, slow, exact implementation:
//!
//! - elementwise ops on bf16/f16/f32 (`add`, `mul`, `pow`, `rsqrt`) compute
//!   in f32 and round the result once to the tensor dtype (PyTorch's "opmath"
//!   semantics); `add`/`mul` broadcast NumPy-style;
//! - `mean` sums sequentially in f32 over the reduced elements (row-major
//!   order), divides by the count in f32, rounds once;
//! - `matmul` accumulates `x[i, k] * w[k, j]` in f32 for k = 0, 1, ... and
//!   rounds once (an f32-accumulating GEMM);
//! - `embedding` copies table rows (ids out of range are an error);
//! - `to_dtype` rounds to nearest even; to fp8_e4m3 it does NOT saturate
//!   (out-of-range becomes NaN, as PyTorch's cast) -- the quant ops saturate;
//!   float to integer truncates toward zero (NaN or out of range is an error);
//! - `rms_norm`, `fused_add_rms_norm`, the quant ops and
//!   `fused_allreduce_norm` follow [`crate::contract`] exactly (the fused
//!   node with the RMSNorm rounding its `norm_rounding` names);
//! - `opaque` is an error naming the node.
//!
//! Memory is bounded: no tensor may exceed [`MAX_TENSOR_ELEMENTS`] elements
//! (per rank) and the live tensors of all ranks together may not exceed
//! [`MAX_LIVE_ELEMENTS`]; values are dropped after their last use. A graph
//! above these limits is refused with an error naming the node.

use crate::contract::{self, Epilogue, QuantOut};
use crate::error::{ReferenceError, Result};
use crate::numerics::fp8::{e4m3_from_f32, e4m3_to_f32, Saturation};
use crate::numerics::quant::{nvfp4_scale_offset, GroupScales};
use crate::numerics::ue8m0::ue8m0_to_f32;
use crate::numerics::FloatFormat;
use crate::tensor::{float_format, is_int_dtype, numel, Storage, Tensor, TensorData};
use arfuse_ir::{DType, FusedOutput, FusedQuant, Graph, InputKind, Node, Op, Shape, TensorType};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;

/// Largest tensor (elements, one rank) the reference evaluates: 64 Mi.
pub const MAX_TENSOR_ELEMENTS: u64 = 64 * 1024 * 1024;
/// Largest total of live elements over all ranks: 256 Mi (1 GiB of f32).
pub const MAX_LIVE_ELEMENTS: u64 = 256 * 1024 * 1024;
/// Largest world size the reference simulates (domain.md section 3: mnnvl up to 64).
pub const MAX_WORLD_SIZE: u32 = 64;

/// Values of the graph's symbols (`T`, `B`, `S`, ...).
pub type Bindings = BTreeMap<String, u64>;

/// Inputs of an evaluation: graph input node id -> one tensor per rank.
pub type RankInputs = BTreeMap<String, Vec<Tensor>>;

/// Result of [`evaluate`]: `outputs[i][r]` is graph output `i` on rank `r`.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// Graph outputs, in order, one tensor per rank.
    pub outputs: Vec<Vec<Tensor>>,
}

fn eval_err(node: &str, message: impl Into<String>) -> ReferenceError {
    ReferenceError::Eval {
        node: node.to_string(),
        message: message.into(),
    }
}

/// Binds the graph's symbols for a call with `tokens` tokens.
///
/// Rule: a symbol named `T` takes `tokens`; without `T`, a graph with `B`
/// and `S` gets `B = 1`, `S = tokens` (a 3-D activation, domain.md section
/// 2: T = B*S); without those, a graph with exactly one symbol binds it to
/// `tokens`. Every other symbol must have a single-valued range (`min ==
/// max`). Every value must lie in its declared range.
pub fn bind_tokens(graph: &Graph, tokens: u64) -> Result<Bindings> {
    let syms = graph.symbols();
    let mut b: Bindings = token_symbols(graph)
        .into_iter()
        .map(|(name, one)| (name, if one { 1 } else { tokens }))
        .collect();
    for (name, r) in syms {
        if !b.contains_key(name) {
            if r.min == r.max {
                b.insert(name.clone(), r.min);
            } else {
                return Err(ReferenceError::InvalidParameter(format!(
                    "cannot bind symbol {name:?} (range {}..={}): only T, or B and S, are bound from the token count",
                    r.min, r.max
                )));
            }
        }
        let v = b[name];
        if v < r.min || v > r.max {
            return Err(ReferenceError::InvalidParameter(format!(
                "symbol {name} = {v} is outside its declared range {}..={}",
                r.min, r.max
            )));
        }
    }
    Ok(b)
}

/// The symbols [`bind_tokens`] binds from the token count, with `true` for the one it
/// binds to 1 (`B` of a `B`, `S` graph).
pub(crate) fn token_symbols(graph: &Graph) -> Vec<(String, bool)> {
    let syms = graph.symbols();
    if syms.contains_key("T") {
        vec![("T".into(), false)]
    } else if syms.contains_key("B") && syms.contains_key("S") {
        vec![("B".into(), true), ("S".into(), false)]
    } else if syms.len() == 1 {
        syms.keys().map(|name| (name.clone(), false)).collect()
    } else {
        Vec::new()
    }
}

/// The concrete shape of `shape` under `bindings`, with the per-tensor
/// element budget checked. `node` names the node in errors.
pub fn concrete_shape(shape: &Shape, bindings: &Bindings, node: &str) -> Result<Vec<usize>> {
    let mut out = Vec::with_capacity(shape.rank());
    let mut total: u64 = 1;
    for d in shape.dims() {
        let v = d.eval(|s| bindings.get(s).copied()).ok_or_else(|| {
            eval_err(
                node,
                format!("dimension {d} has an unbound symbol or overflows"),
            )
        })?;
        total = total.saturating_mul(v);
        out.push(usize::try_from(v).map_err(|_| ReferenceError::SizeOverflow("dimension"))?);
    }
    if total > MAX_TENSOR_ELEMENTS {
        return Err(ReferenceError::TensorTooLarge {
            node: node.to_string(),
            elements: total,
            budget: MAX_TENSOR_ELEMENTS,
        });
    }
    Ok(out)
}

fn check_world(world_size: u32) -> Result<usize> {
    if world_size == 0 || world_size > MAX_WORLD_SIZE {
        return Err(ReferenceError::InvalidParameter(format!(
            "world size must be in 1..={MAX_WORLD_SIZE}, got {world_size}"
        )));
    }
    Ok(world_size as usize)
}

fn validate(graph: &Graph) -> Result<()> {
    graph
        .validate()
        .map_err(|p| ReferenceError::Ir(p.to_string()))
}

// ---------------------------------------------------------------------------
// Random inputs
// ---------------------------------------------------------------------------

/// How an input is used, which decides how its values are sampled.
#[derive(Debug, Clone, Copy, PartialEq)]
enum InputRole {
    /// Generic float data: uniform in [-2, 2), rounded to the dtype.
    Data,
    /// A matmul weight `[K, N]` / `[N, K]`: uniform in [-1, 1) / sqrt(K).
    MatmulWeight { k: usize },
    /// Token ids of an embedding with `vocab` rows: uniform in [0, vocab).
    TokenIds { vocab: usize },
    /// A static FP8 dequant scale: uniform in [0.004, 0.016) (exercises
    /// saturation for |y| > ~2).
    Fp8Scale,
    /// An NVFP4 global scale: uniform in [64, 512) (keeps the block scales in
    /// the normal e4m3 range, sometimes saturating at 448).
    Nvfp4GlobalScale,
}

fn input_roles(graph: &Graph, bindings: &Bindings) -> BTreeMap<String, InputRole> {
    let mut roles: BTreeMap<String, InputRole> = BTreeMap::new();
    let mut set = |graph: &Graph, v: arfuse_ir::Value, role: InputRole| {
        let producer = graph.node(v.node);
        if matches!(producer.op, Op::Input { .. }) {
            let e = roles.entry(producer.id.clone()).or_insert(role);
            // Token ids: keep the smallest vocabulary seen.
            if let (InputRole::TokenIds { vocab: a }, InputRole::TokenIds { vocab: b }) = (*e, role)
            {
                *e = InputRole::TokenIds { vocab: a.min(b) };
            }
        }
    };
    let dim_of = |t: &TensorType, i: usize| -> Option<usize> {
        t.shape
            .dims()
            .get(i)?
            .eval(|s| bindings.get(s).copied())
            .and_then(|v| usize::try_from(v).ok())
    };
    for (_, n) in graph.nodes() {
        match &n.op {
            Op::Embedding if n.inputs.len() == 2 => {
                if let Some(vocab) = graph.value_type(n.inputs[0]).and_then(|t| dim_of(t, 0)) {
                    set(graph, n.inputs[1], InputRole::TokenIds { vocab });
                }
            }
            Op::Matmul { transpose_b } if n.inputs.len() == 2 => {
                let k_axis = usize::from(*transpose_b);
                if let Some(k) = graph
                    .value_type(n.inputs[1])
                    .and_then(|t| dim_of(t, k_axis))
                {
                    set(graph, n.inputs[1], InputRole::MatmulWeight { k });
                }
            }
            Op::QuantFp8Static if n.inputs.len() == 2 => {
                set(graph, n.inputs[1], InputRole::Fp8Scale)
            }
            Op::QuantNvfp4 { .. } if n.inputs.len() == 2 => {
                set(graph, n.inputs[1], InputRole::Nvfp4GlobalScale)
            }
            Op::FusedAllreduceNorm(f) => {
                let extra = 2 + usize::from(f.residual);
                if let Some(&v) = n.inputs.get(extra) {
                    match f.quant {
                        FusedQuant::Fp8Static => set(graph, v, InputRole::Fp8Scale),
                        FusedQuant::Nvfp4 { .. } => set(graph, v, InputRole::Nvfp4GlobalScale),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    roles
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn sample_tensor(
    dtype: DType,
    shape: Vec<usize>,
    role: InputRole,
    rng: &mut SmallRng,
) -> Result<Tensor> {
    let n = numel(&shape).ok_or(ReferenceError::SizeOverflow("input elements"))?;
    if is_int_dtype(dtype) {
        let hi = match role {
            InputRole::TokenIds { vocab } => vocab.max(1) as i64,
            _ => 16,
        };
        let v = (0..n).map(|_| rng.gen_range(0..hi)).collect();
        return Tensor::from_i64(dtype, shape, v);
    }
    let values: Vec<f32> = match (dtype, float_format(dtype)) {
        (_, Some(fmt)) => (0..n)
            .map(|_| {
                let x: f32 = match role {
                    InputRole::MatmulWeight { k } => {
                        rng.gen_range(-1.0f32..1.0) / (k.max(1) as f32).sqrt()
                    }
                    InputRole::Fp8Scale => rng.gen_range(0.004f32..0.016),
                    InputRole::Nvfp4GlobalScale => rng.gen_range(64.0f32..512.0),
                    _ => rng.gen_range(-2.0f32..2.0),
                };
                fmt.round(x)
            })
            .collect(),
        (DType::Fp8E4m3, _) => (0..n)
            .map(|_| {
                let c: u8 = rng.gen_range(0..=0xFD);
                e4m3_to_f32(if c >= 0x7F { c + 1 } else { c }) // skip 0x7F (NaN); 0xFF excluded by range
            })
            .collect(),
        (DType::Ue8m0, _) => (0..n)
            .map(|_| ue8m0_to_f32(rng.gen_range(100u8..=154)))
            .collect(),
        // fp4_e2m1x2 and u8: any byte.
        _ => (0..n)
            .map(|_| f32::from(rng.gen_range(0u8..=255)))
            .collect(),
    };
    Tensor::from_f32(dtype, shape, values)
}

/// Random inputs for every `input` node of `graph`, deterministic in `seed`.
///
/// Activations get independent values per rank; parameters and buffers are
/// identical on every rank (weights are replicated). Every value is exactly
/// representable in its dtype. Sampling per use (see the module source):
/// token ids in `[0, vocab)`, matmul weights scaled by `1/sqrt(K)`, static
/// FP8 scales in `[0.004, 0.016)`, NVFP4 global scales in `[64, 512)`,
/// other floats in `[-2, 2)` before rounding to the dtype (so `[-2, 2]`
/// after), other integers in `[0, 16)`.
///
/// The stream of an input depends only on (`seed`, node id, rank), not on
/// the node's position, so two graphs sharing input ids get the same values.
pub fn random_inputs(
    graph: &Graph,
    world_size: u32,
    bindings: &Bindings,
    seed: u64,
) -> Result<RankInputs> {
    let w = check_world(world_size)?;
    let roles = input_roles(graph, bindings);
    let mut out = RankInputs::new();
    let mut total: u64 = 0;
    for (_, n) in graph.nodes() {
        let Op::Input { kind } = n.op else { continue };
        let t = n
            .outputs
            .first()
            .ok_or_else(|| eval_err(&n.id, "input node without an output type"))?;
        let shape = concrete_shape(&t.shape, bindings, &n.id)?;
        total = total.saturating_add(
            (shape.iter().map(|&d| d as u64).product::<u64>()).saturating_mul(w as u64),
        );
        if total > MAX_LIVE_ELEMENTS {
            return Err(ReferenceError::TensorTooLarge {
                node: n.id.clone(),
                elements: total,
                budget: MAX_LIVE_ELEMENTS,
            });
        }
        let role = roles.get(&n.id).copied().unwrap_or(InputRole::Data);
        let base = seed ^ fnv1a(&n.id).rotate_left(17);
        let per_rank = kind == InputKind::Activation;
        let mut tensors: Vec<Tensor> = Vec::with_capacity(w);
        for r in 0..w {
            if !per_rank && r > 0 {
                let first = tensors[0].clone();
                tensors.push(first);
                continue;
            }
            let stream = if per_rank { r as u64 + 1 } else { 0 };
            let mut rng =
                SmallRng::seed_from_u64(base ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            tensors.push(sample_tensor(t.dtype, shape.clone(), role, &mut rng)?);
        }
        out.insert(n.id.clone(), tensors);
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// Evaluation
// ---------------------------------------------------------------------------

/// Evaluates `graph` over `world_size` virtual ranks.
///
/// `bindings` gives every symbol a value ([`bind_tokens`]); `inputs` gives,
/// for every `input` node id, one tensor per rank with the node's dtype and
/// bound shape (extra entries are ignored). The graph is validated first.
///
/// Errors: invalid graph, missing or mistyped input, opaque op
/// ([`ReferenceError::OpaqueOp`]), a tensor or the live set above the
/// budget ([`ReferenceError::TensorTooLarge`]), or an op that cannot be
/// evaluated on its operands ([`ReferenceError::Eval`]), each naming the node.
pub fn evaluate(
    graph: &Graph,
    world_size: u32,
    bindings: &Bindings,
    inputs: &RankInputs,
) -> Result<Evaluation> {
    let w = check_world(world_size)?;
    validate(graph)?;
    let n_nodes = graph.len();
    // Last position at which each node's outputs are read; graph outputs are kept.
    let mut last_use = vec![0usize; n_nodes];
    for (id, n) in graph.nodes() {
        for v in &n.inputs {
            last_use[v.node.index()] = last_use[v.node.index()].max(id.index());
        }
    }
    for v in graph.outputs() {
        last_use[v.node.index()] = usize::MAX;
    }
    let mut values: Vec<Option<Vec<Vec<Tensor>>>> = vec![None; n_nodes];
    let mut live: u64 = 0;
    for (id, n) in graph.nodes() {
        let declared = n
            .outputs
            .iter()
            .map(|t| Ok((t.dtype, concrete_shape(&t.shape, bindings, &n.id)?)))
            .collect::<Result<Vec<_>>>()?;
        let new_elems: u64 = declared
            .iter()
            .map(|(_, s)| s.iter().map(|&d| d as u64).product::<u64>())
            .fold(0u64, |a, b| a.saturating_add(b))
            .saturating_mul(w as u64);
        if live.saturating_add(new_elems) > MAX_LIVE_ELEMENTS {
            return Err(ReferenceError::TensorTooLarge {
                node: n.id.clone(),
                elements: live.saturating_add(new_elems),
                budget: MAX_LIVE_ELEMENTS,
            });
        }
        let ins: Vec<&[Tensor]> = n
            .inputs
            .iter()
            .map(|v| {
                values[v.node.index()]
                    .as_ref()
                    .and_then(|o| o.get(v.output as usize))
                    .map(Vec::as_slice)
                    .ok_or_else(|| {
                        eval_err(&n.id, "an input value is missing (internal liveness error)")
                    })
            })
            .collect::<Result<_>>()?;
        let outs = eval_node(n, &ins, &declared, w, inputs)?;
        if outs.len() != declared.len() {
            return Err(eval_err(
                &n.id,
                format!(
                    "produced {} outputs, {} declared",
                    outs.len(),
                    declared.len()
                ),
            ));
        }
        for (k, (per_rank, (dt, shape))) in outs.iter().zip(&declared).enumerate() {
            for t in per_rank {
                if t.dtype != *dt || &t.shape != shape {
                    return Err(eval_err(
                        &n.id,
                        format!(
                            "output {k} computed as {}{:?}, declared {dt}{shape:?}",
                            t.dtype, t.shape
                        ),
                    ));
                }
            }
        }
        live = live.saturating_add(new_elems);
        values[id.index()] = Some(outs);
        // Free values whose last reader was this node.
        for v in &n.inputs {
            let p = v.node.index();
            if last_use[p] == id.index() {
                if let Some(o) = values[p].take() {
                    let freed: u64 = o.iter().flatten().map(|t| t.numel() as u64).sum();
                    live = live.saturating_sub(freed);
                }
            }
        }
    }
    let outputs = graph
        .outputs()
        .iter()
        .map(|v| {
            values[v.node.index()]
                .as_ref()
                .and_then(|o| o.get(v.output as usize))
                .cloned()
                .ok_or_else(|| eval_err(&graph.node(v.node).id, "graph output was not computed"))
        })
        .collect::<Result<_>>()?;
    Ok(Evaluation { outputs })
}

type Outs = Vec<Vec<Tensor>>;

fn eval_node(
    n: &Node,
    ins: &[&[Tensor]],
    declared: &[(DType, Vec<usize>)],
    w: usize,
    inputs: &RankInputs,
) -> Result<Outs> {
    let id = n.id.as_str();
    let e = |m: String| eval_err(id, m);
    let per_rank = |f: &dyn Fn(usize) -> std::result::Result<Vec<Tensor>, String>| -> Result<Outs> {
        let mut outs: Outs = vec![Vec::with_capacity(w); declared.len()];
        for r in 0..w {
            let o = f(r).map_err(e)?;
            if o.len() != declared.len() {
                return Err(eval_err(
                    id,
                    format!("produced {} outputs, {} declared", o.len(), declared.len()),
                ));
            }
            for (k, t) in o.into_iter().enumerate() {
                outs[k].push(t);
            }
        }
        Ok(outs)
    };
    let replicate = |t: Tensor| -> Outs { vec![vec![t; w]] };
    match &n.op {
        Op::Input { .. } => {
            let given = inputs
                .get(id)
                .ok_or_else(|| eval_err(id, "no value given for this graph input"))?;
            if given.len() != w {
                return Err(eval_err(
                    id,
                    format!("input has {} rank tensors, world size is {w}", given.len()),
                ));
            }
            let (dt, shape) = &declared[0];
            for (r, t) in given.iter().enumerate() {
                if t.dtype != *dt
                    || &t.shape != shape
                    || t.numel() != numel(shape).unwrap_or(usize::MAX)
                {
                    return Err(eval_err(
                        id,
                        format!(
                            "rank {r} input is {}{:?}, declared {dt}{shape:?}",
                            t.dtype, t.shape
                        ),
                    ));
                }
            }
            Ok(vec![given.clone()])
        }
        Op::Constant { value } => {
            let (dt, shape) = &declared[0];
            let fmt = float_format(*dt).ok_or_else(|| e(format!("constant of dtype {dt}")))?;
            let v = fmt.round_f64(*value);
            Ok(replicate(Tensor::from_f32(*dt, shape.clone(), vec![v])?))
        }
        Op::AllReduce { .. } => {
            let x = ins.first().ok_or_else(|| e("missing input".into()))?;
            let fmt = float_format(x[0].dtype)
                .ok_or_else(|| e(format!("all_reduce of {}", x[0].dtype)))?;
            let ranks: Vec<&[f32]> = x.iter().map(|t| t.f32s().unwrap_or(&[])).collect();
            let a = contract::all_reduce(&ranks, fmt).map_err(|er| e(er.to_string()))?;
            Ok(replicate(Tensor::from_f32(
                x[0].dtype,
                x[0].shape.clone(),
                a,
            )?))
        }
        Op::Add | Op::Mul => {
            let mul = matches!(n.op, Op::Mul);
            per_rank(&|r| Ok(vec![binary(&ins[0][r], &ins[1][r], mul)?]))
        }
        Op::ToDtype { dtype } => per_rank(&|r| Ok(vec![to_dtype(&ins[0][r], *dtype)?])),
        Op::Pow { exponent } => per_rank(&|r| {
            let p = *exponent;
            Ok(vec![unary(&ins[0][r], |x| pow_f32(x, p))?])
        }),
        Op::Rsqrt => per_rank(&|r| Ok(vec![unary(&ins[0][r], |x| 1.0 / x.sqrt())?])),
        Op::Mean { dims, keepdim } => per_rank(&|r| Ok(vec![mean(&ins[0][r], dims, *keepdim)?])),
        Op::Reshape => {
            let (_, shape) = &declared[0];
            per_rank(&|r| {
                let x = &ins[0][r];
                if numel(shape) != Some(x.numel()) {
                    return Err(format!(
                        "reshape of {:?} to {shape:?} changes the element count",
                        x.shape
                    ));
                }
                Ok(vec![Tensor {
                    dtype: x.dtype,
                    shape: shape.clone(),
                    data: x.data.clone(),
                    storage: Storage::Plain,
                }])
            })
        }
        Op::RmsNorm {
            eps,
            weight_bias,
            norm_rounding,
        } => per_rank(&|r| {
            let (x, wt) = (&ins[0][r], &ins[1][r]);
            let fmt = float_of(x)?;
            let y = contract::rms_norm_with(
                f32s(x)?,
                f32s(wt)?,
                *eps,
                *weight_bias,
                *norm_rounding,
                fmt,
            )
            .map_err(|er| er.to_string())?;
            Ok(vec![like(x, y)?])
        }),
        Op::FusedAddRmsNorm {
            eps,
            weight_bias,
            norm_rounding,
            norm_input,
        } => per_rank(&|r| {
            let (x, res, wt) = (&ins[0][r], &ins[1][r], &ins[2][r]);
            let fmt = float_of(x)?;
            if res.shape != x.shape || res.dtype != x.dtype {
                return Err("residual differs from the input in shape or dtype".into());
            }
            let (h, norm_in) =
                contract::residual_and_norm_input(f32s(x)?, Some(f32s(res)?), *norm_input, fmt)
                    .map_err(|er| er.to_string())?;
            let y = contract::rms_norm_with(
                &norm_in,
                f32s(wt)?,
                *eps,
                *weight_bias,
                *norm_rounding,
                fmt,
            )
            .map_err(|er| er.to_string())?;
            Ok(vec![like(x, y)?, like(x, h)?])
        }),
        Op::QuantFp8Static => {
            per_rank(&|r| quant_op(&ins[0][r], FusedQuant::Fp8Static, Some(&ins[1][r])))
        }
        Op::QuantFp8PerToken => per_rank(&|r| quant_op(&ins[0][r], FusedQuant::Fp8PerToken, None)),
        Op::QuantFp8PerTokenGroup {
            group_size,
            scale_layout,
        } => per_rank(&|r| {
            quant_op(
                &ins[0][r],
                FusedQuant::Fp8PerTokenGroup {
                    group_size: *group_size,
                    scale_layout: *scale_layout,
                },
                None,
            )
        }),
        Op::QuantNvfp4 { scale_layout } => per_rank(&|r| {
            quant_op(
                &ins[0][r],
                FusedQuant::Nvfp4 {
                    scale_layout: *scale_layout,
                },
                Some(&ins[1][r]),
            )
        }),
        Op::Matmul { transpose_b } => {
            per_rank(&|r| Ok(vec![matmul(&ins[0][r], &ins[1][r], *transpose_b)?]))
        }
        Op::Embedding => per_rank(&|r| Ok(vec![embedding(&ins[0][r], &ins[1][r])?])),
        Op::Opaque { target, .. } => Err(ReferenceError::OpaqueOp {
            node: id.to_string(),
            op: target.clone(),
        }),
        Op::FusedAllreduceNorm(f) => fused(n, f, ins, w),
    }
}

fn f32s(t: &Tensor) -> std::result::Result<&[f32], String> {
    t.f32s()
        .ok_or_else(|| format!("expected a float tensor, got {}", t.dtype))
}

fn float_of(t: &Tensor) -> std::result::Result<FloatFormat, String> {
    float_format(t.dtype).ok_or_else(|| format!("expected bf16, f16 or f32, got {}", t.dtype))
}

fn like(x: &Tensor, values: Vec<f32>) -> std::result::Result<Tensor, String> {
    Tensor::from_f32(x.dtype, x.shape.clone(), values).map_err(|e| e.to_string())
}

fn unary(x: &Tensor, f: impl Fn(f32) -> f32) -> std::result::Result<Tensor, String> {
    let fmt = float_of(x)?;
    like(x, f32s(x)?.iter().map(|&v| fmt.round(f(v))).collect())
}

/// `x^p` in f32: exact special cases for p in {0, 1, 2, -1, 0.5}, else `powf`.
fn pow_f32(x: f32, p: f64) -> f32 {
    if p == 2.0 {
        x * x
    } else if p == 1.0 {
        x
    } else if p == 0.0 {
        1.0
    } else if p == -1.0 {
        1.0 / x
    } else if p == 0.5 {
        x.sqrt()
    } else {
        x.powf(p as f32)
    }
}

/// NumPy broadcast of two concrete shapes.
fn broadcast_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    (0..n)
        .map(|i| {
            let da = (i + a.len()).checked_sub(n).map(|k| a[k]);
            let db = (i + b.len()).checked_sub(n).map(|k| b[k]);
            match (da, db) {
                (Some(x), None) | (None, Some(x)) => Some(x),
                (Some(x), Some(y)) if x == y => Some(x),
                (Some(1), Some(y)) => Some(y),
                (Some(x), Some(1)) => Some(x),
                _ => None,
            }
        })
        .collect()
}

/// For every element of `out` (row-major), the index of the element of a
/// tensor of shape `s` broadcast to it.
fn broadcast_indices(s: &[usize], out: &[usize]) -> Vec<usize> {
    let n = out.len();
    let mut strides = vec![0usize; n];
    let mut acc = 1usize;
    for i in (0..s.len()).rev() {
        let o = i + n - s.len();
        strides[o] = if s[i] == 1 { 0 } else { acc };
        acc *= s[i];
    }
    let total: usize = out.iter().product();
    let mut idx = vec![0usize; n];
    let mut res = Vec::with_capacity(total);
    let mut cur = 0usize;
    for _ in 0..total {
        res.push(cur);
        // odometer increment
        for d in (0..n).rev() {
            idx[d] += 1;
            cur += strides[d];
            if idx[d] < out[d] {
                break;
            }
            cur -= strides[d] * idx[d];
            idx[d] = 0;
        }
    }
    res
}

fn binary(a: &Tensor, b: &Tensor, mul: bool) -> std::result::Result<Tensor, String> {
    if a.dtype != b.dtype {
        return Err(format!(
            "operands of different dtypes {} and {}",
            a.dtype, b.dtype
        ));
    }
    let shape = broadcast_shape(&a.shape, &b.shape)
        .ok_or_else(|| format!("shapes {:?} and {:?} do not broadcast", a.shape, b.shape))?;
    let ia = broadcast_indices(&a.shape, &shape);
    let ib = broadcast_indices(&b.shape, &shape);
    match (&a.data, &b.data) {
        (TensorData::F32(x), TensorData::F32(y)) => {
            let fmt = float_of(a)?;
            let v = ia
                .iter()
                .zip(&ib)
                .map(|(&i, &j)| fmt.round(if mul { x[i] * y[j] } else { x[i] + y[j] }))
                .collect();
            Tensor::from_f32(a.dtype, shape, v).map_err(|e| e.to_string())
        }
        (TensorData::I64(x), TensorData::I64(y)) => {
            let v = ia
                .iter()
                .zip(&ib)
                .map(|(&i, &j)| {
                    if mul {
                        x[i].checked_mul(y[j])
                    } else {
                        x[i].checked_add(y[j])
                    }
                    .ok_or_else(|| "integer overflow".to_string())
                })
                .collect::<std::result::Result<Vec<_>, _>>()?;
            Tensor::from_i64(a.dtype, shape, v).map_err(|e| e.to_string())
        }
        _ => Err("mixed integer and float operands".into()),
    }
}

fn to_dtype(x: &Tensor, to: DType) -> std::result::Result<Tensor, String> {
    let shape = x.shape.clone();
    let unsupported = || {
        format!(
            "to_dtype from {} to {to} is not supported by the reference",
            x.dtype
        )
    };
    let from_is_real =
        float_format(x.dtype).is_some() || matches!(x.dtype, DType::Fp8E4m3 | DType::Ue8m0);
    let int_like = |d: DType| is_int_dtype(d) || d == DType::U8;
    // Source values as f64 (exact for every f32-held type; i64 rounded above 2^53).
    let src: Vec<f64> = match &x.data {
        TensorData::F32(v) => v.iter().map(|&f| f64::from(f)).collect(),
        TensorData::I64(v) => v.iter().map(|&i| i as f64).collect(),
    };
    if let Some(fmt) = float_format(to) {
        if !(from_is_real || int_like(x.dtype)) {
            return Err(unsupported());
        }
        // f32-held sources round once from their exact f32 value; integers
        // round once from f64 (exact up to 2^53).
        let v = match &x.data {
            TensorData::F32(vals) => vals.iter().map(|&s| fmt.round(s)).collect(),
            TensorData::I64(_) => src.iter().map(|&s| fmt.round_f64(s)).collect(),
        };
        return Tensor::from_f32(to, shape, v).map_err(|e| e.to_string());
    }
    match to {
        DType::Fp8E4m3 if from_is_real => {
            // Sources are f32-exact, so f64 -> f32 is exact here.
            let v = src
                .iter()
                .map(|&s| e4m3_to_f32(e4m3_from_f32(s as f32, Saturation::NonSaturating)))
                .collect();
            Tensor::from_f32(to, shape, v).map_err(|e| e.to_string())
        }
        DType::I32 | DType::I64 | DType::U8 if from_is_real || int_like(x.dtype) => {
            let (lo, hi) = match to {
                DType::I32 => (f64::from(i32::MIN), f64::from(i32::MAX)),
                DType::U8 => (0.0, 255.0),
                _ => (i64::MIN as f64, i64::MAX as f64),
            };
            let ints = match &x.data {
                TensorData::I64(v) => v.clone(),
                TensorData::F32(_) => src
                    .iter()
                    .map(|&s| {
                        let t = s.trunc();
                        if t.is_nan() || t < lo || t > hi {
                            Err(format!("value {s} does not fit {to}"))
                        } else {
                            Ok(t as i64)
                        }
                    })
                    .collect::<std::result::Result<Vec<_>, _>>()?,
            };
            if ints.iter().any(|&i| (i as f64) < lo || (i as f64) > hi) {
                return Err(format!("a value does not fit {to}"));
            }
            if to == DType::U8 {
                Tensor::from_f32(to, shape, ints.iter().map(|&i| i as f32).collect())
                    .map_err(|e| e.to_string())
            } else {
                Tensor::from_i64(to, shape, ints).map_err(|e| e.to_string())
            }
        }
        _ => Err(unsupported()),
    }
}

fn mean(x: &Tensor, dims: &[i64], keepdim: bool) -> std::result::Result<Tensor, String> {
    let fmt = float_of(x)?;
    let v = f32s(x)?;
    let rank = x.shape.len() as i64;
    let mut reduced = vec![false; x.shape.len()];
    for &d in dims {
        let k = if d < 0 { d + rank } else { d };
        if k < 0 || k >= rank {
            return Err(format!("mean dim {d} out of range for rank {rank}"));
        }
        reduced[k as usize] = true;
    }
    let out_full: Vec<usize> = x
        .shape
        .iter()
        .zip(&reduced)
        .map(|(&d, &red)| if red { 1 } else { d })
        .collect();
    let count: usize = x
        .shape
        .iter()
        .zip(&reduced)
        .filter(|(_, &red)| red)
        .map(|(&d, _)| d)
        .product();
    // Map every input element to its output element: broadcasting the output
    // (reduced dims of size 1) back over the input shape gives exactly that map.
    let map = broadcast_indices(&out_full, &x.shape);
    let n_out: usize = out_full.iter().product();
    let mut sums = vec![0.0f32; n_out];
    for (i, &o) in map.iter().enumerate() {
        sums[o] += v[i];
    }
    let values = sums
        .into_iter()
        .map(|s| fmt.round(s / count as f32))
        .collect();
    let shape = if keepdim {
        out_full
    } else {
        x.shape
            .iter()
            .zip(&reduced)
            .filter(|(_, &red)| !red)
            .map(|(&d, _)| d)
            .collect()
    };
    Tensor::from_f32(x.dtype, shape, values).map_err(|e| e.to_string())
}

fn matmul(x: &Tensor, wt: &Tensor, transpose_b: bool) -> std::result::Result<Tensor, String> {
    let fmt = float_of(x)?;
    if x.dtype != wt.dtype || wt.shape.len() != 2 || x.shape.is_empty() {
        return Err(format!(
            "matmul of {}{:?} by {}{:?}",
            x.dtype, x.shape, wt.dtype, wt.shape
        ));
    }
    let k = *x.shape.last().unwrap_or(&0);
    let (wk, n) = if transpose_b {
        (wt.shape[1], wt.shape[0])
    } else {
        (wt.shape[0], wt.shape[1])
    };
    if wk != k {
        return Err(format!("matmul inner dims differ: {k} vs {wk}"));
    }
    let (xv, wv) = (f32s(x)?, f32s(wt)?);
    let rows = xv.len().checked_div(k).unwrap_or(0);
    let mut out = Vec::with_capacity(rows * n);
    for i in 0..rows {
        let xr = &xv[i * k..(i + 1) * k];
        for j in 0..n {
            let mut acc = 0.0f32;
            for (kk, &xa) in xr.iter().enumerate() {
                let wb = if transpose_b {
                    wv[j * k + kk]
                } else {
                    wv[kk * n + j]
                };
                acc += xa * wb;
            }
            out.push(fmt.round(acc));
        }
    }
    let mut shape = x.shape.clone();
    if let Some(l) = shape.last_mut() {
        *l = n;
    }
    Tensor::from_f32(x.dtype, shape, out).map_err(|e| e.to_string())
}

fn embedding(table: &Tensor, ids: &Tensor) -> std::result::Result<Tensor, String> {
    if table.shape.len() != 2 {
        return Err(format!(
            "embedding table must be [V, H], got {:?}",
            table.shape
        ));
    }
    let (vocab, h) = (table.shape[0], table.shape[1]);
    let tv = f32s(table)?;
    let idv = ids
        .i64s()
        .ok_or_else(|| format!("embedding ids must be i32 or i64, got {}", ids.dtype))?;
    let mut out = Vec::with_capacity(idv.len() * h);
    for &i in idv {
        let row = usize::try_from(i)
            .ok()
            .filter(|&r| r < vocab)
            .ok_or_else(|| format!("token id {i} out of range [0, {vocab})"))?;
        out.extend_from_slice(&tv[row * h..(row + 1) * h]);
    }
    let mut shape = ids.shape.clone();
    shape.push(h);
    Tensor::from_f32(table.dtype, shape, out).map_err(|e| e.to_string())
}

fn scalar_of(t: &Tensor, what: &str) -> std::result::Result<f32, String> {
    match t.f32s() {
        Some([v]) => Ok(*v),
        _ => Err(format!(
            "{what} must be a 1-element float tensor, got {}{:?}",
            t.dtype, t.shape
        )),
    }
}

/// The contract epilogue of an IR quant kind; `extra` is the scale / global
/// scale input when the kind has one.
fn epilogue_of(q: FusedQuant, extra: Option<&Tensor>) -> std::result::Result<Epilogue, String> {
    Ok(match q {
        FusedQuant::None => Epilogue::None,
        FusedQuant::Fp8Static => Epilogue::Fp8Static {
            scale: scalar_of(extra.ok_or("missing scale input")?, "scale")?,
        },
        FusedQuant::Fp8PerToken => Epilogue::Fp8PerToken,
        FusedQuant::Fp8PerTokenGroup {
            group_size,
            scale_layout,
        } => Epilogue::Fp8PerTokenGroup {
            group_size: usize::try_from(group_size)
                .map_err(|_| "group size too large".to_string())?,
            layout: scale_layout,
        },
        FusedQuant::Nvfp4 { scale_layout } => Epilogue::Nvfp4 {
            global_scale: scalar_of(extra.ok_or("missing global scale input")?, "global scale")?,
            layout: scale_layout,
        },
    })
}

/// Tensors (quant, optional scale) of an epilogue's output for an activation
/// of shape `x_shape` (`[..., H]`).
fn quant_tensors(
    q: QuantOut,
    x_shape: &[usize],
    epilogue: Epilogue,
) -> std::result::Result<(Tensor, Option<Tensor>), String> {
    let h = *x_shape.last().ok_or("quant of a scalar")?;
    let tokens = numel(x_shape).unwrap_or(0).checked_div(h).unwrap_or(0);
    let with_last = |last: usize| {
        let mut s = x_shape.to_vec();
        if let Some(l) = s.last_mut() {
            *l = last;
        }
        s
    };
    let err = |e: ReferenceError| e.to_string();
    Ok(match q {
        QuantOut::Fp8 { values } => (
            Tensor::from_f32(DType::Fp8E4m3, x_shape.to_vec(), values).map_err(err)?,
            None,
        ),
        QuantOut::Fp8PerToken { values, scales } => (
            Tensor::from_f32(DType::Fp8E4m3, x_shape.to_vec(), values).map_err(err)?,
            Some(Tensor::from_f32(DType::F32, with_last(1), scales).map_err(err)?),
        ),
        QuantOut::Fp8PerTokenGroup { values, scales } => {
            let qt = Tensor::from_f32(DType::Fp8E4m3, x_shape.to_vec(), values).map_err(err)?;
            let st = match scales {
                GroupScales::Fp32 { values, groups } => {
                    Tensor::from_f32(DType::F32, with_last(groups), values).map_err(err)?
                }
                GroupScales::PackedUe8m0 {
                    words,
                    padded_tokens,
                    packed_cols,
                } => {
                    let mut logical = Vec::with_capacity(tokens * packed_cols);
                    for t in 0..tokens {
                        for j in 0..packed_cols {
                            logical.push(i64::from(words[j * padded_tokens + t] as i32));
                        }
                    }
                    let mut t = Tensor::from_i64(DType::I32, with_last(packed_cols), logical)
                        .map_err(err)?;
                    t.storage = Storage::PackedUe8m0Scales;
                    t
                }
            };
            (qt, Some(st))
        }
        QuantOut::Nvfp4 { data, scales } => {
            let qt = Tensor::from_f32(
                DType::Fp4E2m1x2,
                with_last(h / 2),
                data.into_iter().map(f32::from).collect(),
            )
            .map_err(err)?;
            // Scales come back in their physical layout; keep them logical.
            let cols = h / 16;
            let Epilogue::Nvfp4 { layout, .. } = epilogue else {
                return Err("NVFP4 output from a non-NVFP4 epilogue".into());
            };
            let mut logical = Vec::with_capacity(tokens * cols);
            for t in 0..tokens {
                for c in 0..cols {
                    let off =
                        nvfp4_scale_offset(t as u64, c as u64, tokens as u64, h as u64, layout)
                            .map_err(err)?;
                    let b = *scales
                        .get(off as usize)
                        .ok_or("NVFP4 scale offset out of range")?;
                    logical.push(e4m3_to_f32(b));
                }
            }
            let mut st = Tensor::from_f32(DType::Fp8E4m3, with_last(cols), logical).map_err(err)?;
            st.storage = Storage::Nvfp4Scales(layout);
            (qt, Some(st))
        }
    })
}

fn quant_op(
    x: &Tensor,
    q: FusedQuant,
    extra: Option<&Tensor>,
) -> std::result::Result<Vec<Tensor>, String> {
    float_of(x)?;
    let h = *x.shape.last().ok_or("quant of a scalar")?;
    if h == 0 {
        return Err("quant of an empty hidden dim".into());
    }
    let tokens = x.numel() / h;
    let ep = epilogue_of(q, extra)?;
    let out = contract::apply_epilogue(f32s(x)?, tokens, h, ep)
        .map_err(|e| e.to_string())?
        .ok_or("no quant epilogue")?;
    let (qt, st) = quant_tensors(out, &x.shape, ep)?;
    Ok(std::iter::once(qt).chain(st).collect())
}

/// The fused node: clauses 1-4 of the contract; the all-reduce once, the rest per rank.
fn fused(n: &Node, f: &arfuse_ir::FusedAllReduceNorm, ins: &[&[Tensor]], w: usize) -> Result<Outs> {
    let id = n.id.as_str();
    let e = |m: String| eval_err(id, m);
    let x = ins.first().ok_or_else(|| e("missing input".into()))?;
    let fmt = float_format(x[0].dtype).ok_or_else(|| e(format!("fused node on {}", x[0].dtype)))?;
    let ranks: Vec<&[f32]> = x.iter().map(|t| t.f32s().unwrap_or(&[])).collect();
    let a = contract::all_reduce(&ranks, fmt).map_err(|er| e(er.to_string()))?;
    let wi = 1 + usize::from(f.residual);
    let mut outs: Outs = vec![Vec::with_capacity(w); f.outputs.len()];
    for r in 0..w {
        let res = if f.residual {
            let res = &ins[1][r];
            if res.shape != x[r].shape || res.dtype != x[r].dtype {
                return Err(e("residual differs from the input in shape or dtype".into()));
            }
            Some(f32s(res).map_err(e)?)
        } else {
            None
        };
        let (h, norm_in) = contract::residual_and_norm_input(&a, res, f.norm_input, fmt)
            .map_err(|er| e(er.to_string()))?;
        let gamma = f32s(&ins[wi][r]).map_err(e)?;
        let y =
            contract::rms_norm_with(&norm_in, gamma, f.eps, f.weight_bias, f.norm_rounding, fmt)
                .map_err(|er| e(er.to_string()))?;
        let wants_quant = f
            .outputs
            .iter()
            .any(|o| matches!(o, FusedOutput::Quant | FusedOutput::Scale));
        let (qt, st) = if wants_quant {
            let extra = ins.get(wi + 1).map(|v| &v[r]);
            let ep = epilogue_of(f.quant, extra).map_err(e)?;
            let hidden = gamma.len();
            let tokens = y.len() / hidden.max(1);
            let q = contract::apply_epilogue(&y, tokens, hidden, ep)
                .map_err(|er| e(er.to_string()))?
                .ok_or_else(|| e("quant output requested without an epilogue".into()))?;
            let (qt, st) = quant_tensors(q, &x[r].shape, ep).map_err(e)?;
            (Some(qt), st)
        } else {
            (None, None)
        };
        for (k, o) in f.outputs.iter().enumerate() {
            let t = match o {
                FusedOutput::Norm => like(&x[r], y.clone()).map_err(e)?,
                FusedOutput::Residual => like(&x[r], h.clone()).map_err(e)?,
                FusedOutput::Quant => qt.clone().ok_or_else(|| e("no quant output".into()))?,
                FusedOutput::Scale => st
                    .clone()
                    .ok_or_else(|| e("this epilogue has no scale output".into()))?,
            };
            outs[k].push(t);
        }
    }
    Ok(outs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::numerics::quant::Nvfp4ScaleLayout;

    fn graph(nodes: &str, outputs: &str, t_max: u64) -> Graph {
        let text = format!(
            r#"{{"format": "arfuse-graph", "version": 1, "symbols": {{"T": {{"min": 1, "max": {t_max}}}}},
               "nodes": [{nodes}], "outputs": [{outputs}]}}"#
        );
        Graph::from_json_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
    }

    fn f(dtype: DType, shape: &[usize], v: &[f32]) -> Tensor {
        Tensor::from_f32(dtype, shape.to_vec(), v.to_vec()).unwrap()
    }

    fn run(g: &Graph, w: u32, t: u64, inputs: Vec<(&str, Vec<Tensor>)>) -> Result<Evaluation> {
        let b = bind_tokens(g, t)?;
        let ins: RankInputs = inputs
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        evaluate(g, w, &b, &ins)
    }

    const X2: &str =
        r#"{"id": "x", "op": "input", "outputs": [{"dtype": "bf16", "shape": ["T", 2]}]}"#;

    #[test]
    fn all_reduce_sums_in_rank_order_and_rounds_once() {
        let g = graph(
            &format!(
                r#"{X2}, {{"id": "ar", "op": "all_reduce", "attrs": {{"group": "tp"}}, "inputs": ["x"],
                 "outputs": [{{"dtype": "bf16", "shape": ["T", 2]}}]}}"#
            ),
            r#""ar""#,
            4,
        );
        let e = 1.0 / 256.0;
        let ranks = vec![
            f(DType::Bf16, &[1, 2], &[1.0, 3.0]),
            f(DType::Bf16, &[1, 2], &[e, -1.0]),
            f(DType::Bf16, &[1, 2], &[e, 0.5]),
        ];
        let out = run(&g, 3, 1, vec![("x", ranks)]).unwrap();
        for r in 0..3 {
            // 1 + 2^-8 + 2^-8 = 1 + 2^-7 in f32 (pairwise bf16 additions would give 1.0).
            assert_eq!(out.outputs[0][r].f32s().unwrap(), &[1.0 + 1.0 / 128.0, 2.5]);
        }
    }

    #[test]
    fn broadcasting_add_and_mul() {
        let g = graph(
            r#"{"id": "a", "op": "input", "outputs": [{"dtype": "f32", "shape": ["T", 3]}]},
               {"id": "b", "op": "input", "attrs": {"kind": "parameter"}, "outputs": [{"dtype": "f32", "shape": [3]}]},
               {"id": "c", "op": "input", "outputs": [{"dtype": "f32", "shape": ["T", 1]}]},
               {"id": "s", "op": "add", "inputs": ["a", "b"], "outputs": [{"dtype": "f32", "shape": ["T", 3]}]},
               {"id": "p", "op": "mul", "inputs": ["s", "c"], "outputs": [{"dtype": "f32", "shape": ["T", 3]}]}"#,
            r#""s", "p""#,
            4,
        );
        let out = run(
            &g,
            1,
            2,
            vec![
                (
                    "a",
                    vec![f(DType::F32, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])],
                ),
                ("b", vec![f(DType::F32, &[3], &[10.0, 20.0, 30.0])]),
                ("c", vec![f(DType::F32, &[2, 1], &[2.0, -1.0])]),
            ],
        )
        .unwrap();
        assert_eq!(
            out.outputs[0][0].f32s().unwrap(),
            &[11.0, 22.0, 33.0, 14.0, 25.0, 36.0]
        );
        assert_eq!(
            out.outputs[1][0].f32s().unwrap(),
            &[22.0, 44.0, 66.0, -14.0, -25.0, -36.0]
        );
    }

    #[test]
    fn mean_pow_rsqrt_and_bf16_rounding() {
        let g = graph(
            r#"{"id": "x", "op": "input", "outputs": [{"dtype": "f32", "shape": ["T", 4]}]},
               {"id": "sq", "op": "pow", "attrs": {"exponent": 2.0}, "inputs": ["x"], "outputs": [{"dtype": "f32", "shape": ["T", 4]}]},
               {"id": "m", "op": "mean", "attrs": {"dims": [-1], "keepdim": true}, "inputs": ["sq"], "outputs": [{"dtype": "f32", "shape": ["T", 1]}]},
               {"id": "m0", "op": "mean", "attrs": {"dims": [0]}, "inputs": ["x"], "outputs": [{"dtype": "f32", "shape": [4]}]},
               {"id": "r", "op": "rsqrt", "inputs": ["m"], "outputs": [{"dtype": "f32", "shape": ["T", 1]}]},
               {"id": "b", "op": "to_dtype", "attrs": {"dtype": "bf16"}, "inputs": ["x"], "outputs": [{"dtype": "bf16", "shape": ["T", 4]}]}"#,
            r#""m", "m0", "r", "b""#,
            4,
        );
        let x = [
            1.0,
            2.0,
            3.0,
            4.0,
            1.0,
            1.0,
            1.0,
            1.0 + 1.0 / 256.0 + 1.0 / 65536.0,
        ];
        let out = run(&g, 1, 2, vec![("x", vec![f(DType::F32, &[2, 4], &x)])]).unwrap();
        let m = out.outputs[0][0].f32s().unwrap();
        assert_eq!(m[0], 7.5);
        assert_eq!(
            out.outputs[1][0].f32s().unwrap(),
            &[
                1.0,
                1.5,
                2.0,
                (4.0 + 1.0 + 1.0 / 256.0 + 1.0 / 65536.0) / 2.0
            ]
        );
        assert_eq!(out.outputs[2][0].f32s().unwrap()[0], 1.0 / 7.5f32.sqrt());
        // 1 + 2^-8 + 2^-16 is above the bf16 tie: rounds up to 1 + 2^-7.
        assert_eq!(out.outputs[3][0].f32s().unwrap()[7], 1.0078125);
    }

    #[test]
    fn matmul_both_layouts_round_once() {
        let g = graph(
            r#"{"id": "x", "op": "input", "outputs": [{"dtype": "bf16", "shape": ["T", 2]}]},
               {"id": "w", "op": "input", "attrs": {"kind": "parameter"}, "outputs": [{"dtype": "bf16", "shape": [2, 3]}]},
               {"id": "wt", "op": "input", "attrs": {"kind": "parameter"}, "outputs": [{"dtype": "bf16", "shape": [3, 2]}]},
               {"id": "y", "op": "matmul", "inputs": ["x", "w"], "outputs": [{"dtype": "bf16", "shape": ["T", 3]}]},
               {"id": "yt", "op": "matmul", "attrs": {"transpose_b": true}, "inputs": ["x", "wt"], "outputs": [{"dtype": "bf16", "shape": ["T", 3]}]}"#,
            r#""y", "yt""#,
            4,
        );
        let e = 1.0 / 256.0;
        // Row [1, 1] times column [1, e] = 1 + 2^-8 (a tie: bf16 gives 1); [1, 3e] -> 1 + 3*2^-8 -> 1 + 2^-6.
        let w = [1.0, 2.0, 1.0, e, 0.5, 3.0 * e];
        let wt = [1.0, e, 2.0, 0.5, 1.0, 3.0 * e];
        let out = run(
            &g,
            1,
            1,
            vec![
                ("x", vec![f(DType::Bf16, &[1, 2], &[1.0, 1.0])]),
                ("w", vec![f(DType::Bf16, &[2, 3], &w)]),
                ("wt", vec![f(DType::Bf16, &[3, 2], &wt)]),
            ],
        )
        .unwrap();
        assert_eq!(out.outputs[0][0].f32s().unwrap(), &[1.0, 2.5, 1.015625]);
        assert_eq!(out.outputs[1][0], out.outputs[0][0]);
    }

    #[test]
    fn embedding_and_out_of_range_ids() {
        let g = graph(
            r#"{"id": "tab", "op": "input", "attrs": {"kind": "parameter"}, "outputs": [{"dtype": "f32", "shape": [3, 2]}]},
               {"id": "ids", "op": "input", "outputs": [{"dtype": "i64", "shape": ["T"]}]},
               {"id": "emb", "op": "embedding", "inputs": ["tab", "ids"], "outputs": [{"dtype": "f32", "shape": ["T", 2]}]}"#,
            r#""emb""#,
            4,
        );
        let tab = f(DType::F32, &[3, 2], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let ids = Tensor::from_i64(DType::I64, vec![2], vec![2, 0]).unwrap();
        let out = run(
            &g,
            1,
            2,
            vec![("tab", vec![tab.clone()]), ("ids", vec![ids])],
        )
        .unwrap();
        assert_eq!(out.outputs[0][0].f32s().unwrap(), &[4.0, 5.0, 0.0, 1.0]);
        let bad = Tensor::from_i64(DType::I64, vec![1], vec![3]).unwrap();
        match run(&g, 1, 1, vec![("tab", vec![tab]), ("ids", vec![bad])]) {
            Err(ReferenceError::Eval { node, message }) => {
                assert_eq!(node, "emb");
                assert!(message.contains("token id 3"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn to_dtype_semantics() {
        let g = graph(
            r#"{"id": "x", "op": "input", "outputs": [{"dtype": "f32", "shape": ["T", 3]}]},
               {"id": "q", "op": "to_dtype", "attrs": {"dtype": "fp8_e4m3"}, "inputs": ["x"], "outputs": [{"dtype": "fp8_e4m3", "shape": ["T", 3]}]},
               {"id": "i", "op": "to_dtype", "attrs": {"dtype": "i32"}, "inputs": ["x"], "outputs": [{"dtype": "i32", "shape": ["T", 3]}]},
               {"id": "c", "op": "constant", "attrs": {"value": 1.00390625000001}, "outputs": [{"dtype": "bf16", "shape": []}]}"#,
            r#""q", "i", "c""#,
            4,
        );
        let out = run(
            &g,
            2,
            1,
            vec![("x", vec![f(DType::F32, &[1, 3], &[500.0, -1.5, 0.3]); 2])],
        )
        .unwrap();
        let q = out.outputs[0][1].f32s().unwrap();
        assert!(q[0].is_nan(), "PyTorch-style cast: no saturation");
        assert_eq!(&q[1..], &[-1.5, 0.3125]);
        assert_eq!(out.outputs[1][0].i64s().unwrap(), &[500, -1, 0]);
        // A constant just above a bf16 tie rounds up (one rounding from f64).
        assert_eq!(out.outputs[2][0].f32s().unwrap(), &[1.0078125]);
    }

    #[test]
    fn opaque_missing_and_mistyped_inputs_name_the_node() {
        let g = graph(
            &format!(
                r#"{X2}, {{"id": "attn", "op": "opaque", "attrs": {{"target": "aten.silu.default"}}, "inputs": ["x"],
                 "outputs": [{{"dtype": "bf16", "shape": ["T", 2]}}]}}"#
            ),
            r#""attn""#,
            4,
        );
        let x = || vec![f(DType::Bf16, &[1, 2], &[1.0, 2.0])];
        assert_eq!(
            run(&g, 1, 1, vec![("x", x())]),
            Err(ReferenceError::OpaqueOp {
                node: "attn".into(),
                op: "aten.silu.default".into()
            })
        );
        assert!(
            matches!(run(&g, 1, 1, vec![]), Err(ReferenceError::Eval { node, .. }) if node == "x")
        );
        assert!(
            matches!(run(&g, 1, 2, vec![("x", x())]), Err(ReferenceError::Eval { node, .. }) if node == "x")
        );
        assert!(
            matches!(run(&g, 2, 1, vec![("x", x())]), Err(ReferenceError::Eval { node, .. }) if node == "x")
        );
        assert!(matches!(
            run(&g, 0, 1, vec![("x", x())]),
            Err(ReferenceError::InvalidParameter(_))
        ));
        assert!(matches!(
            run(&g, 65, 1, vec![("x", x())]),
            Err(ReferenceError::InvalidParameter(_))
        ));
    }

    #[test]
    fn element_budget_is_enforced_before_allocation() {
        let g = graph(
            r#"{"id": "x", "op": "input", "outputs": [{"dtype": "bf16", "shape": ["T", 1048576]}]}"#,
            r#""x""#,
            1 << 20,
        );
        let b = bind_tokens(&g, 65).unwrap();
        match random_inputs(&g, 1, &b, 0) {
            Err(ReferenceError::TensorTooLarge {
                node,
                elements,
                budget,
            }) => {
                assert_eq!(node, "x");
                assert_eq!(elements, 65 << 20);
                assert_eq!(budget, MAX_TENSOR_ELEMENTS);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            evaluate(&g, 1, &b, &RankInputs::new()),
            Err(ReferenceError::TensorTooLarge { .. })
        ));
        // Under the per-tensor budget but over the live budget with 8 ranks.
        let b = bind_tokens(&g, 40).unwrap();
        assert!(matches!(
            evaluate(&g, 8, &b, &RankInputs::new()),
            Err(ReferenceError::TensorTooLarge {
                budget: MAX_LIVE_ELEMENTS,
                ..
            })
        ));
    }

    #[test]
    fn nvfp4_swizzled_scales_at_t128_are_unswizzled_correctly() {
        // T = 128, H = 64: the swizzled image (128 x 4 bytes) has exactly the
        // logical element count, so the layout must come from the attribute.
        let g = graph(
            r#"{"id": "x", "op": "input", "outputs": [{"dtype": "bf16", "shape": ["T", 64]}]},
               {"id": "gs", "op": "input", "attrs": {"kind": "parameter"}, "outputs": [{"dtype": "f32", "shape": [1]}]},
               {"id": "q", "op": "quant_nvfp4", "attrs": {"scale_layout": "swizzled_128x4"}, "inputs": ["x", "gs"],
                "outputs": [{"dtype": "fp4_e2m1x2", "shape": ["T", 32]}, {"dtype": "fp8_e4m3", "shape": ["T", 4]}]}"#,
            r#""q", "q:1""#,
            256,
        );
        let b = bind_tokens(&g, 128).unwrap();
        let ins = random_inputs(&g, 1, &b, 3).unwrap();
        let out = evaluate(&g, 1, &b, &ins).unwrap();
        let x = ins["x"][0].f32s().unwrap();
        let gs = ins["gs"][0].f32s().unwrap()[0];
        let direct =
            crate::numerics::quant::nvfp4_quant(x, 128, 64, gs, Nvfp4ScaleLayout::Swizzled128x4)
                .unwrap();
        let st = &out.outputs[1][0];
        assert_eq!(st.physical_bytes().unwrap(), direct.scales);
        // Logical [t, c] is the block scale of token t, block c.
        for t in [0usize, 1, 33, 127] {
            for c in 0..4 {
                let want = crate::numerics::quant::nvfp4_block_scale(
                    &x[t * 64 + c * 16..t * 64 + c * 16 + 16],
                    gs,
                );
                assert_eq!(
                    e4m3_from_f32(st.f32s().unwrap()[t * 4 + c], Saturation::SatFinite),
                    want
                );
            }
        }
        let data: Vec<u8> = out.outputs[0][0]
            .f32s()
            .unwrap()
            .iter()
            .map(|&v| v as u8)
            .collect();
        assert_eq!(data, direct.data);
    }

    #[test]
    fn token_binding_rules() {
        let t = graph(X2, r#""x""#, 16);
        assert_eq!(
            bind_tokens(&t, 5).unwrap(),
            Bindings::from([("T".to_string(), 5)])
        );
        assert!(bind_tokens(&t, 17).is_err());
        assert!(bind_tokens(&t, 0).is_err());
        let bs = Graph::from_json_str(
            r#"{"format": "arfuse-graph", "version": 1, "symbols": {"B": {"min": 1, "max": 4}, "S": {"min": 1, "max": 64}, "V": {"min": 8, "max": 8}},
                "nodes": [{"id": "x", "op": "input", "outputs": [{"dtype": "bf16", "shape": ["B", "S", "V"]}]}], "outputs": ["x"]}"#,
        )
        .unwrap();
        let b = bind_tokens(&bs, 7).unwrap();
        assert_eq!((b["B"], b["S"], b["V"]), (1, 7, 8));
        let odd = Graph::from_json_str(
            r#"{"format": "arfuse-graph", "version": 1, "symbols": {"N": {"min": 1, "max": 4}, "M": {"min": 1, "max": 4}},
                "nodes": [{"id": "x", "op": "input", "outputs": [{"dtype": "bf16", "shape": ["N", "M"]}]}], "outputs": ["x"]}"#,
        )
        .unwrap();
        assert!(matches!(
            bind_tokens(&odd, 2),
            Err(ReferenceError::InvalidParameter(_))
        ));
    }

    #[test]
    fn random_inputs_are_representable_shared_for_parameters_and_deterministic() {
        let g = graph(
            r#"{"id": "x", "op": "input", "outputs": [{"dtype": "bf16", "shape": ["T", 64]}]},
               {"id": "w", "op": "input", "attrs": {"kind": "parameter"}, "outputs": [{"dtype": "f16", "shape": [64]}]},
               {"id": "tab", "op": "input", "attrs": {"kind": "parameter"}, "outputs": [{"dtype": "bf16", "shape": [10, 64]}]},
               {"id": "ids", "op": "input", "outputs": [{"dtype": "i32", "shape": ["T"]}]},
               {"id": "e", "op": "embedding", "inputs": ["tab", "ids"], "outputs": [{"dtype": "bf16", "shape": ["T", 64]}]}"#,
            r#""e""#,
            64,
        );
        let b = bind_tokens(&g, 32).unwrap();
        let a = random_inputs(&g, 4, &b, 42).unwrap();
        assert_eq!(a, random_inputs(&g, 4, &b, 42).unwrap());
        assert_ne!(a, random_inputs(&g, 4, &b, 43).unwrap());
        let (x, w, ids) = (&a["x"], &a["w"], &a["ids"]);
        assert_eq!(x.len(), 4);
        assert_ne!(x[0], x[1], "activations differ per rank");
        assert!(w.iter().all(|t| *t == w[0]), "parameters are replicated");
        for t in x {
            assert!(t
                .f32s()
                .unwrap()
                .iter()
                .all(|&v| FloatFormat::Bf16.is_exact(v) && (-2.0..=2.0).contains(&v)));
        }
        assert!(w[0]
            .f32s()
            .unwrap()
            .iter()
            .all(|&v| FloatFormat::F16.is_exact(v)));
        for t in ids {
            assert!(t.i64s().unwrap().iter().all(|&i| (0..10).contains(&i)));
        }
        assert!(evaluate(&g, 4, &b, &a).is_ok());
    }
}
