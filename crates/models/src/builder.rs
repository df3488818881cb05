//! Graph construction: nodes, norms, all-reduces, GEMMs and quant ops, shared by the
//! decoder ([`crate::decoder`]) and the EAGLE-3 draft ([`crate::draft`]).

use crate::config::ModelSpec;
use crate::error::{BuildError, Result};
use crate::options::{BuildOptions, NormForm, THREE_D_MAX_BATCH};
use crate::quant::ActQuant;
use arfuse_ir::{
    DType, Dim, Graph, GroupScaleLayout, InputKind, Node, Nvfp4ScaleLayout, Op, SymbolRange,
    TensorType, Value,
};
use serde_json::json;

/// A GEMM operand: a bf16 activation, or its quantised form (data, scales).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Operand {
    Plain(Value),
    Quant { q: Value, s: Value, kind: ActQuant },
}

/// A norm output and its lazily created quant (one quant node per norm output, shared
/// by every quantised GEMM that reads it).
pub(crate) struct NormOut {
    pub y: Value,
    pub k: u64,
    pub id: String,
    pub module: String,
    pub quant: Option<Operand>,
}

pub(crate) struct Ctx<'a> {
    pub g: Graph,
    pub spec: &'a ModelSpec,
    pub opts: &'a BuildOptions,
    /// Leading (token) dims of activations: `[T]` or `[B, S]`.
    tokens: Vec<Dim>,
}

fn v(n: arfuse_ir::NodeId) -> Value {
    Value::new(n, 0)
}

impl<'a> Ctx<'a> {
    pub(crate) fn new(spec: &'a ModelSpec, opts: &'a BuildOptions) -> Ctx<'a> {
        let mut g = Graph::new();
        let tokens = if opts.three_d {
            g.set_symbol(
                "B",
                SymbolRange {
                    min: 1,
                    max: THREE_D_MAX_BATCH,
                },
            );
            g.set_symbol(
                "S",
                SymbolRange {
                    min: 1,
                    max: opts.max_tokens.div_ceil(THREE_D_MAX_BATCH),
                },
            );
            vec![Dim::symbol("B"), Dim::symbol("S")]
        } else {
            g.set_symbol(
                "T",
                SymbolRange {
                    min: 1,
                    max: opts.max_tokens,
                },
            );
            vec![Dim::symbol("T")]
        };
        Ctx {
            g,
            spec,
            opts,
            tokens,
        }
    }

    /// Full module path of `rel` (`layers.3.mlp` -> `model.layers.3.mlp`).
    pub(crate) fn module(&self, rel: &str) -> String {
        format!("{}.{rel}", self.spec.root())
    }

    pub(crate) fn tp(&self) -> u64 {
        u64::from(self.opts.tp)
    }

    /// `value / tp`, or an error naming `field`.
    pub(crate) fn shard(&self, field: &str, value: u64) -> Result<u64> {
        if value % self.tp() != 0 {
            return Err(BuildError::NotDivisible {
                field: field.into(),
                value,
                tp: self.opts.tp,
                reason: "must be a multiple of tp".into(),
            });
        }
        Ok(value / self.tp())
    }

    /// Heads per rank of a head count that may be smaller than tp (replicated then).
    pub(crate) fn shard_heads(&self, field: &str, heads: u64) -> Result<u64> {
        let tp = self.tp();
        if heads >= tp {
            self.shard(field, heads)
        } else if tp % heads == 0 {
            Ok(1)
        } else {
            Err(BuildError::NotDivisible {
                field: field.into(),
                value: heads,
                tp: self.opts.tp,
                reason: "tp must be a multiple of it to replicate".into(),
            })
        }
    }

    /// Activation type `[tokens..., last]` of `dtype`.
    pub(crate) fn ty(&self, dtype: DType, last: u64) -> TensorType {
        let mut d = self.tokens.clone();
        d.push(Dim::constant(last));
        TensorType::new(dtype, d)
    }

    pub(crate) fn act(&self, last: u64) -> TensorType {
        self.ty(self.spec.dtype, last)
    }

    pub(crate) fn node(
        &mut self,
        id: impl Into<String>,
        op: Op,
        inputs: Vec<Value>,
        outputs: Vec<TensorType>,
        module: Option<String>,
    ) -> Result<arfuse_ir::NodeId> {
        Ok(self.g.add_node(Node {
            id: id.into(),
            op,
            inputs,
            outputs,
            module,
        })?)
    }

    pub(crate) fn one(
        &mut self,
        id: impl Into<String>,
        op: Op,
        inputs: Vec<Value>,
        out: TensorType,
        module: &str,
    ) -> Result<Value> {
        Ok(v(self.node(
            id,
            op,
            inputs,
            vec![out],
            Some(module.to_string()),
        )?))
    }

    pub(crate) fn input(&mut self, id: &str, kind: InputKind, ty: TensorType) -> Result<Value> {
        Ok(v(self.node(
            id,
            Op::Input { kind },
            vec![],
            vec![ty],
            None,
        )?))
    }

    pub(crate) fn param(&mut self, id: &str, dtype: DType, dims: &[u64]) -> Result<Value> {
        let ty = TensorType::new(dtype, dims.iter().map(|d| Dim::constant(*d)).collect());
        self.input(id, InputKind::Parameter, ty)
    }

    fn constant(&mut self, id: &str, value: f64, dtype: DType, module: &str) -> Result<Value> {
        self.one(
            id,
            Op::Constant { value },
            vec![],
            TensorType::new(dtype, vec![]),
            module,
        )
    }

    /// The all-reduce of a per-rank partial `x` (`[tokens..., h]`); in 3-D mode on a
    /// `[B*S, h]` view between two reshapes. Returns the (unflattened) sum.
    pub(crate) fn all_reduce(&mut self, x: Value, h: u64, id: &str, module: &str) -> Result<Value> {
        let op = Op::AllReduce {
            group: self.opts.group.clone(),
            reduce: Default::default(),
        };
        if !self.opts.three_d {
            return self.one(id, op, vec![x], self.act(h), module);
        }
        let flat_ty = TensorType::new(
            self.spec.dtype,
            vec![
                Dim::parse("B*S").expect("constant dim text"),
                Dim::constant(h),
            ],
        );
        let flat = self.one(
            format!("{id}.flatten"),
            Op::Reshape,
            vec![x],
            flat_ty.clone(),
            module,
        )?;
        let ar = self.one(id, op, vec![flat], flat_ty, module)?;
        self.one(
            format!("{id}.unflatten"),
            Op::Reshape,
            vec![ar],
            self.act(h),
            module,
        )
    }

    /// The norm weight (a bf16 parameter `[h]`) as the norm reads it: Gemma's offset
    /// norms read `w.float()` (to_dtype f32, HF `1 + self.weight.float()`).
    fn norm_weight(&mut self, id: &str, h: u64, module: &str) -> Result<Value> {
        let w = self.param(&format!("{id}.weight"), self.spec.dtype, &[h])?;
        if self.spec.gemma() && self.opts.norm_form == NormForm::Explicit {
            return self.one(
                format!("{id}.weight_f32"),
                Op::ToDtype { dtype: DType::F32 },
                vec![w],
                TensorType::new(DType::F32, vec![Dim::constant(h)]),
                module,
            );
        }
        Ok(w)
    }

    fn weight_bias(&self) -> f64 {
        if self.spec.gemma() {
            1.0
        } else {
            0.0
        }
    }

    /// RMSNorm of `x` (`[tokens..., h]`) without a residual: node id `id` (the last
    /// node in the decomposed form), module `root.id`.
    pub(crate) fn rms_norm(&mut self, x: Value, id: &str, h: u64) -> Result<Value> {
        let module = self.module(id);
        match self.opts.norm_form {
            NormForm::Explicit => {
                let w = self.norm_weight(id, h, &module)?;
                let op = Op::RmsNorm {
                    eps: self.spec.eps,
                    weight_bias: self.weight_bias(),
                    norm_rounding: Default::default(),
                };
                self.one(id, op, vec![x, w], self.act(h), &module)
            }
            NormForm::Decomposed => self.decomposed(x, id, h, &module),
        }
    }

    /// `hs = residual + x`, then RMSNorm of `hs`. Returns (normed, hs). Explicit form:
    /// one `fused_add_rms_norm(x, residual, w)`; decomposed: `add(residual, x)` (id
    /// `add_id`, module `add_module`) then the decomposition.
    pub(crate) fn add_rms_norm(
        &mut self,
        x: Value,
        residual: Value,
        id: &str,
        h: u64,
        add_id: &str,
        add_module: &str,
    ) -> Result<(Value, Value)> {
        let module = self.module(id);
        match self.opts.norm_form {
            NormForm::Explicit => {
                let w = self.norm_weight(id, h, &module)?;
                let op = Op::FusedAddRmsNorm {
                    eps: self.spec.eps,
                    weight_bias: self.weight_bias(),
                    norm_rounding: Default::default(),
                    norm_input: Default::default(),
                };
                let n = self.node(
                    id,
                    op,
                    vec![x, residual, w],
                    vec![self.act(h), self.act(h)],
                    Some(module),
                )?;
                Ok((Value::new(n, 0), Value::new(n, 1)))
            }
            NormForm::Decomposed => {
                let hs = self.one(add_id, Op::Add, vec![residual, x], self.act(h), add_module)?;
                let y = self.decomposed(hs, id, h, &module)?;
                Ok((y, hs))
            }
        }
    }

    /// Normalises with the residual when there is one: `(normed, new residual)`. Without
    /// a residual (first layer) the new residual is `x` itself.
    pub(crate) fn norm_step(
        &mut self,
        x: Value,
        residual: Option<Value>,
        id: &str,
        h: u64,
        add_id: &str,
        add_module: &str,
    ) -> Result<(Value, Value)> {
        match residual {
            None => Ok((self.rms_norm(x, id, h)?, x)),
            Some(r) => self.add_rms_norm(x, r, id, h, add_id, add_module),
        }
    }

    /// The decomposition torch emits for the HF RMSNorm modules (domain.md section 2).
    fn decomposed(&mut self, x: Value, id: &str, h: u64, module: &str) -> Result<Value> {
        let act = self.spec.dtype;
        let f = |c: &Self, last| c.ty(DType::F32, last);
        let xf = self.one(
            format!("{id}.to_f32"),
            Op::ToDtype { dtype: DType::F32 },
            vec![x],
            f(self, h),
            module,
        )?;
        let sq = self.one(
            format!("{id}.pow"),
            Op::Pow { exponent: 2.0 },
            vec![xf],
            f(self, h),
            module,
        )?;
        let ms = self.one(
            format!("{id}.mean"),
            Op::Mean {
                dims: vec![-1],
                keepdim: true,
            },
            vec![sq],
            f(self, 1),
            module,
        )?;
        let eps = self.constant(&format!("{id}.eps"), self.spec.eps, DType::F32, module)?;
        let mse = self.one(
            format!("{id}.add_eps"),
            Op::Add,
            vec![ms, eps],
            f(self, 1),
            module,
        )?;
        let r = self.one(
            format!("{id}.rsqrt"),
            Op::Rsqrt,
            vec![mse],
            f(self, 1),
            module,
        )?;
        let n = self.one(
            format!("{id}.mul_rsqrt"),
            Op::Mul,
            vec![xf, r],
            f(self, h),
            module,
        )?;
        let w = self.norm_weight(id, h, module)?;
        if self.spec.gemma() {
            // HF Gemma: (x * rsqrt(...)) * (1.0 + w.float()), then type_as(x).
            let wf = self.one(
                format!("{id}.weight_f32"),
                Op::ToDtype { dtype: DType::F32 },
                vec![w],
                TensorType::new(DType::F32, vec![Dim::constant(h)]),
                module,
            )?;
            let one = self.constant(&format!("{id}.one"), 1.0, DType::F32, module)?;
            let w1 = self.one(
                format!("{id}.weight_plus_one"),
                Op::Add,
                vec![wf, one],
                TensorType::new(DType::F32, vec![Dim::constant(h)]),
                module,
            )?;
            let m = self.one(
                format!("{id}.mul_weight"),
                Op::Mul,
                vec![n, w1],
                f(self, h),
                module,
            )?;
            self.one(id, Op::ToDtype { dtype: act }, vec![m], self.act(h), module)
        } else {
            // HF Llama: weight * hidden_states.to(input_dtype).
            let nb = self.one(
                format!("{id}.to_act"),
                Op::ToDtype { dtype: act },
                vec![n],
                self.act(h),
                module,
            )?;
            self.one(id, Op::Mul, vec![w, nb], self.act(h), module)
        }
    }

    /// Quantises `x` (`[tokens..., k]`) for a GEMM: node `id`, plus an f32 `[1]`
    /// global-scale parameter `id.global_scale` for NVFP4.
    pub(crate) fn quantize(
        &mut self,
        x: Value,
        k: u64,
        kind: ActQuant,
        id: &str,
        module: &str,
    ) -> Result<Operand> {
        let (op, inputs, outs) = match kind {
            ActQuant::Fp8Group { group } => {
                if k % group != 0 {
                    return Err(BuildError::NotDivisible {
                        field: format!("GEMM input width of {module}"),
                        value: k,
                        tp: self.opts.tp,
                        reason: format!("block-FP8 activations need a multiple of {group}"),
                    });
                }
                (
                    Op::QuantFp8PerTokenGroup {
                        group_size: group,
                        scale_layout: GroupScaleLayout::PackedUe8m0,
                    },
                    vec![x],
                    vec![
                        self.ty(DType::Fp8E4m3, k),
                        self.ty(DType::I32, (k / group).div_ceil(4)),
                    ],
                )
            }
            ActQuant::Nvfp4 => {
                let b = arfuse_abi::NVFP4_BLOCK;
                if k % b != 0 {
                    return Err(BuildError::NotDivisible {
                        field: format!("GEMM input width of {module}"),
                        value: k,
                        tp: self.opts.tp,
                        reason: format!("NVFP4 activations need a multiple of {b}"),
                    });
                }
                let gs = self.param(&format!("{id}.global_scale"), DType::F32, &[1])?;
                (
                    Op::QuantNvfp4 {
                        scale_layout: Nvfp4ScaleLayout::Swizzled128x4,
                    },
                    vec![x, gs],
                    vec![
                        self.ty(DType::Fp4E2m1x2, k / 2),
                        self.ty(DType::Fp8E4m3, k / b),
                    ],
                )
            }
        };
        let n = self.node(id, op, inputs, outs, Some(module.to_string()))?;
        Ok(Operand::Quant {
            q: Value::new(n, 0),
            s: Value::new(n, 1),
            kind,
        })
    }

    /// The operand a GEMM with activation quantisation `quant` reads from a norm
    /// output: the norm output itself, or its (shared) quant `norm.quant`.
    pub(crate) fn operand_for(
        &mut self,
        no: &mut NormOut,
        quant: Option<ActQuant>,
    ) -> Result<Operand> {
        let Some(kind) = quant else {
            return Ok(Operand::Plain(no.y));
        };
        if let Some(op @ Operand::Quant { kind: k, .. }) = no.quant {
            if k == kind {
                return Ok(op);
            }
        }
        let id = format!("{}.quant", no.id);
        let module = no.module.clone();
        let op = self.quantize(no.y, no.k, kind, &id, &module)?;
        no.quant = Some(op);
        Ok(op)
    }

    /// A GEMM `[tokens..., k] x [n, k]^T -> [tokens..., n]` named `id` (module
    /// `root.id`). bf16: `matmul{transpose_b}` with a bf16 weight `id.weight`. Block
    /// FP8: opaque `fp8_block_gemm(q, scales, w fp8 [n, k], w_scale_inv f32 [n/128,
    /// k/128])`. NVFP4: opaque `nvfp4_gemm(q, scales, w fp4x2 [n, k/2], w_scale e4m3
    /// [n, k/16], alpha f32 [1])`. The output is the activation dtype.
    pub(crate) fn gemm(&mut self, input: Operand, k: u64, n: u64, id: &str) -> Result<Value> {
        let module = self.module(id);
        let act = self.spec.dtype;
        match input {
            Operand::Plain(x) => {
                let w = self.param(&format!("{id}.weight"), act, &[n, k])?;
                self.one(
                    id,
                    Op::Matmul { transpose_b: true },
                    vec![x, w],
                    self.act(n),
                    &module,
                )
            }
            Operand::Quant {
                q,
                s,
                kind: ActQuant::Fp8Group { group },
            } => {
                let w = self.param(&format!("{id}.weight"), DType::Fp8E4m3, &[n, k])?;
                let ws = self.param(
                    &format!("{id}.weight_scale_inv"),
                    DType::F32,
                    &[n.div_ceil(group), k.div_ceil(group)],
                )?;
                let op = Op::Opaque {
                    target: "fp8_block_gemm".into(),
                    attrs: json!({"n": n, "k": k, "block_size": [group, group], "transpose_b": true}),
                };
                self.one(id, op, vec![q, s, w, ws], self.act(n), &module)
            }
            Operand::Quant {
                q,
                s,
                kind: ActQuant::Nvfp4,
            } => {
                let b = arfuse_abi::NVFP4_BLOCK;
                let w = self.param(&format!("{id}.weight"), DType::Fp4E2m1x2, &[n, k / 2])?;
                let ws = self.param(&format!("{id}.weight_scale"), DType::Fp8E4m3, &[n, k / b])?;
                let alpha = self.param(&format!("{id}.alpha"), DType::F32, &[1])?;
                let op = Op::Opaque {
                    target: "nvfp4_gemm".into(),
                    attrs: json!({"n": n, "k": k, "block_size": b, "transpose_b": true}),
                };
                self.one(id, op, vec![q, s, w, ws, alpha], self.act(n), &module)
            }
        }
    }

    /// A GEMM on a non-norm activation `x`: quantised in front (node `id.input_quant`)
    /// when the config quantises `hf_module` (full path).
    pub(crate) fn linear(
        &mut self,
        x: Value,
        k: u64,
        n: u64,
        id: &str,
        hf_module: &str,
    ) -> Result<Value> {
        let quant = self.spec.quant.for_modules(&[hf_module.to_string()])?;
        let op = match quant {
            None => Operand::Plain(x),
            Some(kind) => {
                let module = self.module(id);
                self.quantize(x, k, kind, &format!("{id}.input_quant"), &module)?
            }
        };
        self.gemm(op, k, n, id)
    }

    /// Adds a bias `id.bias` (`[n]`) to `x`.
    pub(crate) fn bias(&mut self, x: Value, n: u64, id: &str) -> Result<Value> {
        let module = self.module(id);
        let b = self.param(&format!("{id}.bias"), self.spec.dtype, &[n])?;
        self.one(
            format!("{id}.bias_add"),
            Op::Add,
            vec![x, b],
            self.act(n),
            &module,
        )
    }

    /// Finishes: sets outputs and metadata, validates.
    pub(crate) fn finish(
        mut self,
        outputs: Vec<Value>,
        metadata: serde_json::Value,
    ) -> Result<Graph> {
        self.g.set_outputs(outputs)?;
        self.g.set_metadata(Some(metadata));
        self.g
            .validate()
            .map_err(|p| BuildError::Invalid(p.to_string()))?;
        Ok(self.g)
    }
}
