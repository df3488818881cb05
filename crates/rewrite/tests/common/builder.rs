//! A small builder of tensor-parallel decoder graphs over `arfuse_ir::Graph`, for the
//! tests and the benchmark: dense layer stacks with the norm written as `rms_norm`,
//! `fused_add_rms_norm` or decomposed, 3-D activations with views around the
//! all-reduces, quant epilogues, Gemma-style norms and a live or dead final residual.

#![allow(dead_code)]

use arfuse_ir::op::{GroupScaleLayout, Nvfp4ScaleLayout};
use arfuse_ir::{DType, Dim, Graph, InputKind, Node, Op, SymbolRange, TensorType, Value};

/// How a norm is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormForm {
    /// `add` then `rms_norm`.
    RmsNorm,
    /// `fused_add_rms_norm` (the first layer's input norm stays `rms_norm`).
    FusedAdd,
    /// The decomposition torch emits (HF Llama order: cast, pow, mean, add eps, rsqrt,
    /// mul, cast back, weight multiply).
    Decomposed,
}

/// A quant after every norm but the final one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quant {
    Fp8Static,
    Fp8PerToken,
    Fp8Group,
    /// Per-token-group FP8 with f32 power-of-two scales (vLLM's `use_ue8m0=True`).
    Fp8GroupF32Ue8m0,
    Nvfp4,
}

/// What to build.
#[derive(Clone, Debug)]
pub struct Stack {
    pub layers: usize,
    pub hidden: u64,
    pub dtype: DType,
    pub norm: NormForm,
    /// Activations `[B, S, H]`, the all-reduces on `[B*S, H]` with reshapes around.
    pub view_3d: bool,
    pub quant: Option<Quant>,
    /// The norm output is also read (besides the quant).
    pub norm_live_with_quant: bool,
    /// The final residual is a graph output too.
    pub final_residual_live: bool,
    /// Gemma-style norms: f32 weights, weight_bias 1.
    pub gemma: bool,
    pub group: String,
    pub eps: f64,
    /// Largest token count (T, or B*S with B = 1... S).
    pub max_tokens: u64,
}

impl Default for Stack {
    fn default() -> Self {
        Stack {
            layers: 1,
            hidden: 4096,
            dtype: DType::Bf16,
            norm: NormForm::RmsNorm,
            view_3d: false,
            quant: None,
            norm_live_with_quant: false,
            final_residual_live: false,
            gemma: false,
            group: "tp".into(),
            eps: 1e-5,
            max_tokens: 8192,
        }
    }
}

/// A graph under construction.
pub struct B {
    pub g: Graph,
}

pub fn ty(dtype: DType, dims: &[Dim]) -> TensorType {
    TensorType::new(dtype, dims.to_vec())
}

pub fn c(n: u64) -> Dim {
    Dim::constant(n)
}

pub fn s(name: &str) -> Dim {
    Dim::symbol(name)
}

impl B {
    pub fn new() -> B {
        B { g: Graph::new() }
    }

    pub fn sym(&mut self, name: &str, max: u64) {
        self.g.set_symbol(name, SymbolRange { min: 1, max });
    }

    pub fn node(
        &mut self,
        id: &str,
        op: Op,
        inputs: &[Value],
        outputs: Vec<TensorType>,
        module: Option<&str>,
    ) -> Value {
        let n = self
            .g
            .add_node(Node {
                id: id.to_string(),
                op,
                inputs: inputs.to_vec(),
                outputs,
                module: module.map(str::to_string),
            })
            .expect("builder: add_node");
        Value::new(n, 0)
    }

    pub fn out(&self, v: Value, k: u32) -> Value {
        Value::new(v.node, k)
    }

    pub fn ty(&self, v: Value) -> TensorType {
        self.g.value_type(v).expect("builder: value").clone()
    }

    pub fn input(&mut self, id: &str, t: TensorType, kind: InputKind) -> Value {
        self.node(id, Op::Input { kind }, &[], vec![t], None)
    }

    pub fn param(&mut self, id: &str, t: TensorType) -> Value {
        self.input(id, t, InputKind::Parameter)
    }

    pub fn all_reduce(&mut self, id: &str, x: Value, group: &str, module: Option<&str>) -> Value {
        let t = self.ty(x);
        self.node(
            id,
            Op::AllReduce {
                group: group.into(),
                reduce: Default::default(),
            },
            &[x],
            vec![t],
            module,
        )
    }

    pub fn add(&mut self, id: &str, a: Value, b: Value, module: Option<&str>) -> Value {
        let t = self.ty(a);
        self.node(id, Op::Add, &[a, b], vec![t], module)
    }

    pub fn reshape(&mut self, id: &str, x: Value, dims: &[Dim], module: Option<&str>) -> Value {
        let t = ty(self.ty(x).dtype, dims);
        self.node(id, Op::Reshape, &[x], vec![t], module)
    }

    pub fn rms_norm(
        &mut self,
        id: &str,
        x: Value,
        w: Value,
        eps: f64,
        bias: f64,
        module: Option<&str>,
    ) -> Value {
        let t = self.ty(x);
        self.node(
            id,
            Op::RmsNorm {
                eps,
                weight_bias: bias,
                norm_rounding: Default::default(),
            },
            &[x, w],
            vec![t],
            module,
        )
    }

    /// (normed, residual out) of `x + r` normed with weight `w` and `(eps, weight_bias)`.
    pub fn fused_add_rms_norm(
        &mut self,
        id: &str,
        [x, r, w]: [Value; 3],
        (eps, bias): (f64, f64),
        module: Option<&str>,
    ) -> (Value, Value) {
        let t = self.ty(x);
        let v = self.node(
            id,
            Op::FusedAddRmsNorm {
                eps,
                weight_bias: bias,
                norm_rounding: Default::default(),
                norm_input: Default::default(),
            },
            &[x, r, w],
            vec![t.clone(), t],
            module,
        );
        (v, self.out(v, 1))
    }

    /// HF Llama's decomposed RMSNorm of `x` (two roundings).
    pub fn decomposed_norm(
        &mut self,
        id: &str,
        x: Value,
        w: Value,
        eps: f64,
        module: Option<&str>,
    ) -> Value {
        let t = self.ty(x);
        let mut f32t = t.clone();
        f32t.dtype = DType::F32;
        let mut red = f32t.clone();
        if let Some(l) = red.shape.0.last_mut() {
            *l = c(1);
        }
        let xf = self.node(
            &format!("{id}.xf"),
            Op::ToDtype { dtype: DType::F32 },
            &[x],
            vec![f32t.clone()],
            module,
        );
        let sq = self.node(
            &format!("{id}.pow"),
            Op::Pow { exponent: 2.0 },
            &[xf],
            vec![f32t.clone()],
            module,
        );
        let ms = self.node(
            &format!("{id}.mean"),
            Op::Mean {
                dims: vec![-1],
                keepdim: true,
            },
            &[sq],
            vec![red.clone()],
            module,
        );
        let e = self.node(
            &format!("{id}.eps"),
            Op::Constant { value: eps },
            &[],
            vec![ty(DType::F32, &[])],
            module,
        );
        let var = self.node(
            &format!("{id}.var"),
            Op::Add,
            &[ms, e],
            vec![red.clone()],
            module,
        );
        let inv = self.node(&format!("{id}.rsqrt"), Op::Rsqrt, &[var], vec![red], module);
        let nf = self.node(&format!("{id}.nf"), Op::Mul, &[xf, inv], vec![f32t], module);
        let cast = self.node(
            &format!("{id}.cast"),
            Op::ToDtype { dtype: t.dtype },
            &[nf],
            vec![t.clone()],
            module,
        );
        self.node(id, Op::Mul, &[w, cast], vec![t], module)
    }

    /// A quant of `x`; returns the values it writes (quantised, then scales).
    pub fn quant(&mut self, id: &str, x: Value, q: Quant, module: Option<&str>) -> Vec<Value> {
        let t = self.ty(x);
        let h = t.shape.last().and_then(|d| d.as_const()).unwrap_or(0);
        let with_last = |dtype: DType, last: u64| {
            let mut tt = t.clone();
            tt.dtype = dtype;
            if let Some(l) = tt.shape.0.last_mut() {
                *l = c(last);
            }
            tt
        };
        let (op, ins, outs) = match q {
            Quant::Fp8Static => {
                let sc = self.param(&format!("{id}.scale"), ty(DType::F32, &[c(1)]));
                (
                    Op::QuantFp8Static,
                    vec![x, sc],
                    vec![with_last(DType::Fp8E4m3, h)],
                )
            }
            Quant::Fp8PerToken => (
                Op::QuantFp8PerToken,
                vec![x],
                vec![with_last(DType::Fp8E4m3, h), with_last(DType::F32, 1)],
            ),
            Quant::Fp8Group => (
                Op::QuantFp8PerTokenGroup {
                    group_size: 128,
                    scale_layout: GroupScaleLayout::PackedUe8m0,
                },
                vec![x],
                vec![
                    with_last(DType::Fp8E4m3, h),
                    with_last(DType::I32, (h / 128).div_ceil(4)),
                ],
            ),
            Quant::Fp8GroupF32Ue8m0 => (
                Op::QuantFp8PerTokenGroup {
                    group_size: 128,
                    scale_layout: GroupScaleLayout::F32RowMajorUe8m0,
                },
                vec![x],
                vec![with_last(DType::Fp8E4m3, h), with_last(DType::F32, h / 128)],
            ),
            Quant::Nvfp4 => {
                let gs = self.param(&format!("{id}.global_scale"), ty(DType::F32, &[c(1)]));
                (
                    Op::QuantNvfp4 {
                        scale_layout: Nvfp4ScaleLayout::Swizzled128x4,
                    },
                    vec![x, gs],
                    vec![
                        with_last(DType::Fp4E2m1x2, h / 2),
                        with_last(DType::Fp8E4m3, h / 16),
                    ],
                )
            }
        };
        let n = outs.len();
        let v = self.node(id, op, &ins, outs, module);
        (0..n as u32).map(|k| self.out(v, k)).collect()
    }

    pub fn opaque(
        &mut self,
        id: &str,
        target: &str,
        inputs: &[Value],
        out: TensorType,
        module: Option<&str>,
    ) -> Value {
        self.node(
            id,
            Op::Opaque {
                target: target.into(),
                attrs: serde_json::Value::Null,
            },
            inputs,
            vec![out],
            module,
        )
    }

    pub fn finish(mut self, outputs: Vec<Value>) -> Graph {
        self.g.set_outputs(outputs).expect("builder: outputs");
        self.g.validate().expect("builder: valid graph");
        self.g
    }
}

impl Stack {
    fn act_dims(&self) -> Vec<Dim> {
        if self.view_3d {
            vec![s("B"), s("S"), c(self.hidden)]
        } else {
            vec![s("T"), c(self.hidden)]
        }
    }

    fn flat_dims(&self) -> Vec<Dim> {
        if self.view_3d {
            vec![s("B").checked_mul(&s("S")).unwrap(), c(self.hidden)]
        } else {
            vec![s("T"), c(self.hidden)]
        }
    }

    /// A weight of the norm.
    fn norm_weight(&self, b: &mut B, id: &str) -> Value {
        let dtype = if self.gemma { DType::F32 } else { self.dtype };
        b.param(id, ty(dtype, &[c(self.hidden)]))
    }

    /// An all-reduce of `x` (activation shape), with the 3-D views around it.
    fn reduce(&self, b: &mut B, id: &str, x: Value, module: &str) -> Value {
        if !self.view_3d {
            return b.all_reduce(id, x, &self.group, Some(module));
        }
        let flat = b.reshape(&format!("{id}.flat"), x, &self.flat_dims(), Some(module));
        let ar = b.all_reduce(id, flat, &self.group, Some(module));
        b.reshape(&format!("{id}.view"), ar, &self.act_dims(), Some(module))
    }

    /// The norm of `x` (no residual).
    fn norm(&self, b: &mut B, id: &str, x: Value, w: Value, module: &str) -> Value {
        let bias = if self.gemma { 1.0 } else { 0.0 };
        match self.norm {
            NormForm::Decomposed if !self.gemma => {
                b.decomposed_norm(id, x, w, self.eps, Some(module))
            }
            _ => b.rms_norm(id, x, w, self.eps, bias, Some(module)),
        }
    }

    /// `h = a + r; (norm(h), h)`.
    fn add_norm(
        &self,
        b: &mut B,
        id: &str,
        a: Value,
        r: Value,
        w: Value,
        module: &str,
    ) -> (Value, Value) {
        let bias = if self.gemma { 1.0 } else { 0.0 };
        if self.norm == NormForm::FusedAdd {
            return b.fused_add_rms_norm(id, [a, r, w], (self.eps, bias), Some(module));
        }
        let h = b.add(&format!("{id}.add"), a, r, Some(module));
        (self.norm(b, id, h, w, module), h)
    }

    /// Quant after a norm; the value the next block reads.
    fn epilogue(
        &self,
        b: &mut B,
        id: &str,
        n: Value,
        module: &str,
        live: &mut Vec<Value>,
    ) -> Value {
        match self.quant {
            None => n,
            Some(q) => {
                let outs = b.quant(id, n, q, Some(module));
                if self.norm_live_with_quant {
                    live.push(n);
                }
                live.extend(outs.iter().skip(1).copied());
                outs[0]
            }
        }
    }

    /// The graph: embedding + all-reduce, L layers (attention, MLP), final norm.
    pub fn build(&self) -> Graph {
        let mut b = B::new();
        let h = self.hidden;
        if self.view_3d {
            b.sym("B", 64);
            b.sym("S", self.max_tokens.max(1).div_ceil(64));
        } else {
            b.sym("T", self.max_tokens);
        }
        let lead: Vec<Dim> = self.act_dims()[..self.act_dims().len() - 1].to_vec();
        let ids = b.input("ids", ty(DType::I64, &lead), InputKind::Activation);
        let table = b.param("embed.w", ty(self.dtype, &[c(32000 / 8), c(h)]));
        let mut emb_t = lead.clone();
        emb_t.push(c(h));
        let emb = b.node(
            "embed",
            Op::Embedding,
            &[table, ids],
            vec![ty(self.dtype, &emb_t)],
            Some("model.embed_tokens"),
        );
        let emb_ar = self.reduce(&mut b, "embed.ar", emb, "model.embed_tokens");
        let mut live: Vec<Value> = Vec::new();
        let w0 = self.norm_weight(&mut b, "layers.0.ln_in.w");
        let n0 = self.norm(
            &mut b,
            "layers.0.ln_in",
            emb_ar,
            w0,
            "model.layers.0.input_layernorm",
        );
        let mut x = self.epilogue(
            &mut b,
            "layers.0.ln_in.q",
            n0,
            "model.layers.0.self_attn",
            &mut live,
        );
        let mut res = emb_ar;
        let act = ty(self.dtype, &emb_t);
        let mut final_out = None;
        for l in 0..self.layers {
            let p = format!("layers.{l}");
            let m = format!("model.layers.{l}");
            let attn = b.opaque(
                &format!("{p}.attn"),
                "attention",
                &[x],
                act.clone(),
                Some(&format!("{m}.self_attn")),
            );
            let o_w = b.param(&format!("{p}.o.w"), ty(self.dtype, &[c(h), c(h)]));
            let o = b.node(
                &format!("{p}.o_proj"),
                Op::Matmul { transpose_b: true },
                &[attn, o_w],
                vec![act.clone()],
                Some(&format!("{m}.self_attn.o_proj")),
            );
            let o_ar = self.reduce(&mut b, &format!("{p}.o.ar"), o, &format!("{m}.self_attn"));
            let w1 = self.norm_weight(&mut b, &format!("{p}.ln_post.w"));
            let (n1, h1) = self.add_norm(
                &mut b,
                &format!("{p}.ln_post"),
                o_ar,
                res,
                w1,
                &format!("{m}.post_attention_layernorm"),
            );
            let x1 = self.epilogue(
                &mut b,
                &format!("{p}.ln_post.q"),
                n1,
                &format!("{m}.mlp"),
                &mut live,
            );
            let mlp = b.opaque(
                &format!("{p}.mlp"),
                "mlp",
                &[x1],
                act.clone(),
                Some(&format!("{m}.mlp")),
            );
            let d_w = b.param(&format!("{p}.down.w"), ty(self.dtype, &[c(h), c(h)]));
            let d = b.node(
                &format!("{p}.down_proj"),
                Op::Matmul { transpose_b: true },
                &[mlp, d_w],
                vec![act.clone()],
                Some(&format!("{m}.mlp.down_proj")),
            );
            let d_ar = self.reduce(&mut b, &format!("{p}.down.ar"), d, &format!("{m}.mlp"));
            let last = l + 1 == self.layers;
            let (nid, nm) = if last {
                ("final_norm".to_string(), "model.norm".to_string())
            } else {
                (
                    format!("layers.{}.ln_in", l + 1),
                    format!("model.layers.{}.input_layernorm", l + 1),
                )
            };
            let w2 = self.norm_weight(&mut b, &format!("{nid}.w"));
            let (n2, h2) = self.add_norm(&mut b, &nid, d_ar, h1, w2, &nm);
            res = h2;
            if last {
                final_out = Some(n2);
            } else {
                x = self.epilogue(
                    &mut b,
                    &format!("{nid}.q"),
                    n2,
                    &format!("model.layers.{}.self_attn", l + 1),
                    &mut live,
                );
            }
        }
        let mut outputs = vec![final_out.unwrap_or(x)];
        if self.final_residual_live {
            outputs.push(res);
        }
        outputs.extend(live);
        b.finish(outputs)
    }
}
