//! Graph builders shared by the integration tests: layer stacks written in
//! both forms (the unfused chain and the fused node written directly) and a
//! small real-shaped tensor-parallel decoder.

#![allow(dead_code)]

use arfuse_ir::{
    DType, Dim, FusedAllReduceNorm, FusedOutput, FusedQuant, Graph, GroupScaleLayout, InputKind,
    Node, Nvfp4ScaleLayout, Op, SymbolRange, TensorType, Value,
};

/// A thin builder over `Graph` that names values by string.
pub struct Builder {
    pub g: Graph,
}

/// `[T, n]` or `[n]` dims.
pub fn tdims(n: u64) -> Vec<Dim> {
    vec![Dim::symbol("T"), Dim::constant(n)]
}

pub fn tt(dtype: DType, dims: Vec<Dim>) -> TensorType {
    TensorType::new(dtype, dims)
}

impl Builder {
    pub fn new(t_max: u64) -> Builder {
        let mut g = Graph::new();
        g.set_symbol("T", SymbolRange { min: 1, max: t_max });
        Builder { g }
    }

    pub fn v(&self, id: &str) -> Value {
        self.vk(id, 0)
    }

    pub fn vk(&self, id: &str, k: u32) -> Value {
        let n = self.g.find(id).unwrap_or_else(|| panic!("no node {id}"));
        Value::new(n, k)
    }

    pub fn ty(&self, v: Value) -> TensorType {
        self.g.value_type(v).expect("value").clone()
    }

    pub fn input(&mut self, id: &str, kind: InputKind, t: TensorType) -> Value {
        self.node(id, Op::Input { kind }, vec![], vec![t])
    }

    pub fn node(
        &mut self,
        id: &str,
        op: Op,
        inputs: Vec<Value>,
        outputs: Vec<TensorType>,
    ) -> Value {
        let n = self
            .g
            .add_node(Node {
                id: id.to_string(),
                op,
                inputs,
                outputs,
                module: None,
            })
            .unwrap_or_else(|e| panic!("{e}"));
        Value::new(n, 0)
    }

    pub fn all_reduce(&mut self, id: &str, x: Value) -> Value {
        let t = self.ty(x);
        self.node(
            id,
            Op::AllReduce {
                group: "tp".into(),
                reduce: Default::default(),
            },
            vec![x],
            vec![t],
        )
    }

    pub fn add(&mut self, id: &str, a: Value, b: Value) -> Value {
        let t = self.ty(a);
        self.node(id, Op::Add, vec![a, b], vec![t])
    }

    pub fn mul(&mut self, id: &str, a: Value, b: Value) -> Value {
        let t = self.ty(a);
        self.node(id, Op::Mul, vec![a, b], vec![t])
    }

    pub fn cast(&mut self, id: &str, x: Value, dtype: DType) -> Value {
        let mut t = self.ty(x);
        t.dtype = dtype;
        self.node(id, Op::ToDtype { dtype }, vec![x], vec![t])
    }

    pub fn matmul(&mut self, id: &str, x: Value, w: Value, n: u64) -> Value {
        let mut t = self.ty(x);
        *t.shape.0.last_mut().expect("rank") = Dim::constant(n);
        self.node(id, Op::Matmul { transpose_b: false }, vec![x, w], vec![t])
    }

    pub fn rms_norm(&mut self, id: &str, x: Value, w: Value, eps: f64, weight_bias: f64) -> Value {
        let t = self.ty(x);
        self.node(
            id,
            Op::RmsNorm {
                eps,
                weight_bias,
                norm_rounding: Default::default(),
            },
            vec![x, w],
            vec![t],
        )
    }

    pub fn set_outputs(&mut self, outs: Vec<Value>) {
        self.g.set_outputs(outs).unwrap_or_else(|e| panic!("{e}"));
    }

    pub fn finish(self) -> Graph {
        if let Err(p) = self.g.validate() {
            panic!("test graph invalid: {p}");
        }
        self.g
    }
}

/// Output types of a quant epilogue on `x`.
pub fn quant_types(x: &TensorType, q: FusedQuant) -> Option<(TensorType, Option<TensorType>)> {
    let h = x.shape.last()?.as_const()?;
    let with_last = |n: u64| {
        let mut s = x.shape.clone();
        *s.0.last_mut().expect("rank") = Dim::constant(n);
        s
    };
    let fp8 = TensorType {
        dtype: DType::Fp8E4m3,
        shape: x.shape.clone(),
    };
    match q {
        FusedQuant::None => None,
        FusedQuant::Fp8Static => Some((fp8, None)),
        FusedQuant::Fp8PerToken => Some((
            fp8,
            Some(TensorType {
                dtype: DType::F32,
                shape: with_last(1),
            }),
        )),
        FusedQuant::Fp8PerTokenGroup {
            group_size,
            scale_layout,
        } => {
            let g = h / group_size;
            let s = match scale_layout {
                GroupScaleLayout::F32RowMajor | GroupScaleLayout::F32RowMajorUe8m0 => TensorType {
                    dtype: DType::F32,
                    shape: with_last(g),
                },
                GroupScaleLayout::PackedUe8m0 => TensorType {
                    dtype: DType::I32,
                    shape: with_last(g.div_ceil(4)),
                },
            };
            Some((fp8, Some(s)))
        }
        FusedQuant::Nvfp4 { .. } => Some((
            TensorType {
                dtype: DType::Fp4E2m1x2,
                shape: with_last(h / 2),
            },
            Some(TensorType {
                dtype: DType::Fp8E4m3,
                shape: with_last(h / 16),
            }),
        )),
    }
}

/// The standalone quant op of an epilogue.
pub fn quant_op(q: FusedQuant) -> Option<Op> {
    Some(match q {
        FusedQuant::None => return None,
        FusedQuant::Fp8Static => Op::QuantFp8Static,
        FusedQuant::Fp8PerToken => Op::QuantFp8PerToken,
        FusedQuant::Fp8PerTokenGroup {
            group_size,
            scale_layout,
        } => Op::QuantFp8PerTokenGroup {
            group_size,
            scale_layout,
        },
        FusedQuant::Nvfp4 { scale_layout } => Op::QuantNvfp4 { scale_layout },
    })
}

/// Whether the quant kind takes an extra scalar input (static scale / global scale).
pub fn has_extra(q: FusedQuant) -> bool {
    matches!(q, FusedQuant::Fp8Static | FusedQuant::Nvfp4 { .. })
}

/// One fusion site of a layer stack.
#[derive(Debug, Clone)]
pub struct Site {
    /// Whether a residual is added (false: a first layer after the embedding).
    pub residual: bool,
    /// The quant epilogue.
    pub quant: FusedQuant,
    /// Gemma-style f32 weight with weight_bias 1.
    pub gemma: bool,
    /// Unfused form uses `fused_add_rms_norm` instead of `add` + `rms_norm`.
    pub use_fused_add: bool,
    /// Graph outputs of the site, a subset of norm / residual / quant / scale in that order.
    pub live: Vec<FusedOutput>,
    pub eps: f64,
}

/// A stack of fusion sites over one activation dtype and hidden size.
#[derive(Debug, Clone)]
pub struct Stack {
    pub dtype: DType,
    pub hidden: u64,
    pub sites: Vec<Site>,
}

/// Builds a stack in its unfused form (`fused = false`: all_reduce, add,
/// rms_norm, quant op) or with the fused node written directly. Site `i`
/// all-reduces the fresh per-rank input `x{i}`; its residual is site
/// `i - 1`'s residual output (site 0: the input `res0`, or none when
/// `residual` is false; a later site without residual starts a new chain).
/// Graph outputs: each site's `live` outputs in order.
pub fn build_stack(s: &Stack, t_max: u64, fused: bool) -> Graph {
    let mut b = Builder::new(t_max);
    let act = tt(s.dtype, tdims(s.hidden));
    let mut outs = Vec::new();
    let mut prev_res: Option<Value> = None;
    for (i, site) in s.sites.iter().enumerate() {
        let x = b.input(&format!("x{i}"), InputKind::Activation, act.clone());
        let wdt = if site.gemma { DType::F32 } else { s.dtype };
        let w = b.input(
            &format!("w{i}"),
            InputKind::Parameter,
            tt(wdt, vec![Dim::constant(s.hidden)]),
        );
        let extra = has_extra(site.quant).then(|| {
            b.input(
                &format!("s{i}"),
                InputKind::Parameter,
                tt(DType::F32, vec![Dim::constant(1)]),
            )
        });
        let res = if site.residual {
            Some(match prev_res {
                Some(r) => r,
                None => b.input(&format!("res{i}"), InputKind::Activation, act.clone()),
            })
        } else {
            None
        };
        let wb = if site.gemma { 1.0 } else { 0.0 };
        // The residual output is needed when live or when the next site chains on it.
        let next_uses_res = s.sites.get(i + 1).is_some_and(|n| n.residual);
        let (norm, resid, quant, scale): (Option<Value>, Value, Option<Value>, Option<Value>);
        if fused {
            let mut list: Vec<FusedOutput> = Vec::new();
            for o in [
                FusedOutput::Norm,
                FusedOutput::Residual,
                FusedOutput::Quant,
                FusedOutput::Scale,
            ] {
                if site.live.contains(&o) || (o == FusedOutput::Residual && next_uses_res) {
                    list.push(o);
                }
            }
            let qt = quant_types(&act, site.quant);
            let types = list
                .iter()
                .map(|o| match o {
                    FusedOutput::Norm | FusedOutput::Residual => act.clone(),
                    FusedOutput::Quant => qt.clone().expect("quant").0,
                    FusedOutput::Scale => qt.clone().and_then(|q| q.1).expect("scale"),
                })
                .collect();
            let mut ins = vec![x];
            ins.extend(res);
            ins.push(w);
            ins.extend(extra);
            let f = b.node(
                &format!("fused{i}"),
                Op::FusedAllreduceNorm(Box::new(FusedAllReduceNorm {
                    group: "tp".into(),
                    eps: site.eps,
                    weight_bias: wb,
                    norm_rounding: arfuse_ir::NormRounding::Once,
                    norm_input: arfuse_ir::NormInput::Residual,
                    residual: site.residual,
                    quant: site.quant,
                    outputs: list.clone(),
                    plan: None,
                })),
                ins,
                types,
            );
            let at = |o: FusedOutput| {
                list.iter()
                    .position(|&p| p == o)
                    .map(|k| Value::new(f.node, k as u32))
            };
            norm = at(FusedOutput::Norm);
            resid = at(FusedOutput::Residual).unwrap_or(f);
            quant = at(FusedOutput::Quant);
            scale = at(FusedOutput::Scale);
        } else {
            let a = b.all_reduce(&format!("ar{i}"), x);
            let (y, h) = match res {
                Some(r) if site.use_fused_add => {
                    let f = b.node(
                        &format!("fan{i}"),
                        Op::FusedAddRmsNorm {
                            eps: site.eps,
                            weight_bias: wb,
                            norm_rounding: Default::default(),
                            norm_input: Default::default(),
                        },
                        vec![a, r, w],
                        vec![act.clone(), act.clone()],
                    );
                    (f, Value::new(f.node, 1))
                }
                Some(r) => {
                    let h = b.add(&format!("add{i}"), a, r);
                    (b.rms_norm(&format!("norm{i}"), h, w, site.eps, wb), h)
                }
                None => (b.rms_norm(&format!("norm{i}"), a, w, site.eps, wb), a),
            };
            norm = Some(y);
            resid = h;
            match quant_op(site.quant) {
                Some(op) => {
                    let (qt, st) = quant_types(&act, site.quant).expect("types");
                    let mut ins = vec![y];
                    ins.extend(extra);
                    let q = b.node(
                        &format!("q{i}"),
                        op,
                        ins,
                        std::iter::once(qt).chain(st.clone()).collect(),
                    );
                    quant = Some(q);
                    scale = st.map(|_| Value::new(q.node, 1));
                }
                None => {
                    quant = None;
                    scale = None;
                }
            }
        }
        for o in &site.live {
            let v = match o {
                FusedOutput::Norm => norm,
                FusedOutput::Residual => Some(resid),
                FusedOutput::Quant => quant,
                FusedOutput::Scale => scale,
            };
            outs.push(v.expect("live output exists"));
        }
        prev_res = if next_uses_res { Some(resid) } else { None };
    }
    b.set_outputs(outs);
    b.finish()
}

/// Number of nodes whose op is a collective (all_reduce or the fused node).
pub fn count_collectives(g: &Graph) -> usize {
    g.nodes().filter(|(_, n)| n.op.is_collective()).count()
}

/// The quant epilogues the stacks draw from.
pub fn quant_kinds() -> Vec<FusedQuant> {
    let groups =
        GroupScaleLayout::ALL
            .into_iter()
            .map(|scale_layout| FusedQuant::Fp8PerTokenGroup {
                group_size: 128,
                scale_layout,
            });
    let mut kinds = vec![
        FusedQuant::None,
        FusedQuant::Fp8Static,
        FusedQuant::Fp8PerToken,
    ];
    kinds.extend(groups);
    kinds.extend([
        FusedQuant::Nvfp4 {
            scale_layout: Nvfp4ScaleLayout::Swizzled128x4,
        },
        FusedQuant::Nvfp4 {
            scale_layout: Nvfp4ScaleLayout::Linear,
        },
    ]);
    kinds
}

/// Configuration of the small real-shaped decoder of the model test.
#[derive(Debug, Clone)]
pub struct ModelCfg {
    pub dtype: DType,
    pub hidden: u64,
    pub layers: usize,
    pub vocab: u64,
    /// Per-rank width of the attention stand-in (q/k/v heads of this rank).
    pub attn: u64,
    /// Per-rank MLP intermediate size.
    pub inter: u64,
    /// Static FP8 quant after every input / post-attention norm (the GEMM
    /// inputs), dequantised to the activation dtype before the matmul.
    pub fp8: bool,
    pub eps: f64,
}

/// A tensor-parallel decoder with `layers` layers:
/// embedding -> all-reduce -> input norm; per layer an attention stand-in
/// (qkv matmul, o_proj matmul) -> all-reduce -> add -> post-attention norm ->
/// MLP (gate and up matmuls, their product, down_proj) -> all-reduce -> add ->
/// next input norm (the final norm after the last layer, residual dead) ->
/// lm_head matmul. Outputs: `[logits, final_norm]`.
///
/// Column- and row-parallel weights (qkv, o_proj, gate, up, down, lm_head)
/// are declared as ACTIVATION inputs: the reference samples those per rank,
/// which models each rank holding a different shard (so the all-reduces sum
/// genuinely different partial results). Norm weights, the embedding table
/// and the FP8 scales are replicated parameters. The token ids are per-rank
/// activations, a stand-in for the vocab-parallel split of the embedding.
///
/// `lowered = false`: the unfused graph (all_reduce, add, rms_norm,
/// quant_fp8_static). `lowered = true`: every all-reduce site written as a
/// `fused_allreduce_norm` node (2L + 1 of them), outputs chosen as a pass
/// would: norm (or quant) plus residual, only norm for the final norm.
pub fn build_model(cfg: &ModelCfg, t_max: u64, lowered: bool) -> Graph {
    let mut b = Builder::new(t_max);
    let h = cfg.hidden;
    let dt = cfg.dtype;
    let act = tt(dt, tdims(h));
    let param = |b: &mut Builder, id: &str, dims: Vec<u64>| {
        b.input(
            id,
            InputKind::Parameter,
            tt(dt, dims.into_iter().map(Dim::constant).collect()),
        )
    };
    let shard = |b: &mut Builder, id: &str, k: u64, n: u64| {
        b.input(
            id,
            InputKind::Activation,
            tt(dt, vec![Dim::constant(k), Dim::constant(n)]),
        )
    };
    let ids = b.input(
        "ids",
        InputKind::Activation,
        tt(DType::I64, vec![Dim::symbol("T")]),
    );
    let table = param(&mut b, "embed_w", vec![cfg.vocab, h]);
    let emb = b.node("embed", Op::Embedding, vec![table, ids], vec![act.clone()]);

    // One fusion site: returns (activation fed to the next GEMM, residual out).
    // `ar_in` is the per-rank all-reduce input; `residual` the incoming residual.
    let site = |b: &mut Builder,
                name: &str,
                ar_in: Value,
                residual: Option<Value>,
                last: bool|
     -> (Value, Option<Value>) {
        let w = param(b, &format!("{name}_w"), vec![h]);
        let quant = if cfg.fp8 && !last {
            FusedQuant::Fp8Static
        } else {
            FusedQuant::None
        };
        let scale = (quant == FusedQuant::Fp8Static).then(|| {
            b.input(
                &format!("{name}_scale"),
                InputKind::Parameter,
                tt(DType::F32, vec![Dim::constant(1)]),
            )
        });
        let (gemm_in, res_out);
        if lowered {
            let mut outs = vec![if quant == FusedQuant::None {
                FusedOutput::Norm
            } else {
                FusedOutput::Quant
            }];
            if !last {
                outs.push(FusedOutput::Residual);
            }
            let qt = quant_types(&act, quant).map(|q| q.0);
            let types = outs
                .iter()
                .map(|o| {
                    if *o == FusedOutput::Quant {
                        qt.clone().expect("fp8")
                    } else {
                        act.clone()
                    }
                })
                .collect();
            let mut ins = vec![ar_in];
            ins.extend(residual);
            ins.push(w);
            ins.extend(scale);
            let f = b.node(
                &format!("{name}_fused"),
                Op::FusedAllreduceNorm(Box::new(FusedAllReduceNorm {
                    group: "tp".into(),
                    eps: cfg.eps,
                    weight_bias: 0.0,
                    norm_rounding: arfuse_ir::NormRounding::Once,
                    norm_input: arfuse_ir::NormInput::Residual,
                    residual: residual.is_some(),
                    quant,
                    outputs: outs,
                    plan: None,
                })),
                ins,
                types,
            );
            gemm_in = f;
            res_out = (!last).then(|| Value::new(f.node, 1));
        } else {
            let a = b.all_reduce(&format!("{name}_ar"), ar_in);
            let hh = match residual {
                Some(r) => b.add(&format!("{name}_add"), a, r),
                None => a,
            };
            let y = b.rms_norm(&format!("{name}_norm"), hh, w, cfg.eps, 0.0);
            gemm_in = match scale {
                Some(s) => {
                    let qt = quant_types(&act, quant).expect("fp8").0;
                    b.node(
                        &format!("{name}_quant"),
                        Op::QuantFp8Static,
                        vec![y, s],
                        vec![qt],
                    )
                }
                None => y,
            };
            res_out = (!last).then_some(hh);
        }
        // Dequantise for the bf16 GEMM stand-in.
        let x = match scale {
            Some(s) => {
                let qv = b.cast(&format!("{name}_dq"), gemm_in, dt);
                let sv = b.cast(&format!("{name}_dqs"), s, dt);
                b.mul(&format!("{name}_dqm"), qv, sv)
            }
            None => gemm_in,
        };
        (x, res_out)
    };

    let (mut x, mut resid) = site(&mut b, "l0_in", emb, None, false);
    let mut final_norm = x;
    for l in 0..cfg.layers {
        let wqkv = shard(&mut b, &format!("l{l}_wqkv"), h, cfg.attn);
        let wo = shard(&mut b, &format!("l{l}_wo"), cfg.attn, h);
        let qkv = b.matmul(&format!("l{l}_qkv"), x, wqkv, cfg.attn);
        let o = b.matmul(&format!("l{l}_o_proj"), qkv, wo, h);
        let (xm, r1) = site(&mut b, &format!("l{l}_post"), o, resid, false);
        let wg = shard(&mut b, &format!("l{l}_wgate"), h, cfg.inter);
        let wu = shard(&mut b, &format!("l{l}_wup"), h, cfg.inter);
        let wd = shard(&mut b, &format!("l{l}_wdown"), cfg.inter, h);
        let g = b.matmul(&format!("l{l}_gate"), xm, wg, cfg.inter);
        let u = b.matmul(&format!("l{l}_up"), xm, wu, cfg.inter);
        let gu = b.mul(&format!("l{l}_act"), g, u);
        let d = b.matmul(&format!("l{l}_down_proj"), gu, wd, h);
        let last = l + 1 == cfg.layers;
        let name = if last {
            "final".to_string()
        } else {
            format!("l{}_in", l + 1)
        };
        let (nx, nr) = site(&mut b, &name, d, r1, last);
        x = nx;
        resid = nr;
        final_norm = nx;
    }
    let lm = shard(&mut b, "lm_head", h, cfg.vocab);
    let logits = b.matmul("logits", final_norm, lm, cfg.vocab);
    b.set_outputs(vec![logits, final_norm]);
    b.finish()
}

/// (all_reduce nodes, fused nodes) of a graph.
pub fn count_sites(g: &Graph) -> (usize, usize) {
    let ar = g
        .nodes()
        .filter(|(_, n)| matches!(n.op, Op::AllReduce { .. }))
        .count();
    let fused = g
        .nodes()
        .filter(|(_, n)| matches!(n.op, Op::FusedAllreduceNorm(_)))
        .count();
    (ar, fused)
}
