//! Property test of the whole pass against the CPU oracle: random stacks of layers
//! (random H from the allowed set, random pattern family, random liveness of outputs)
//! -> `arfuse::lower` -> `arfuse::advanced::reference::check_equivalent` holds bit-exactly, and
//! the count of all-reduces is preserved (each fused node holds exactly one).

use arfuse::advanced::ir::{
    DType, Dim, GroupScaleLayout, InputKind, Node, Nvfp4ScaleLayout, Op, SymbolRange, TensorType,
    Value,
};
use arfuse::{Graph, Target};
use proptest::prelude::*;

#[derive(Clone, Copy, Debug)]
enum Quant {
    None,
    Fp8Static,
    Fp8PerToken,
    GroupPacked,
    GroupF32,
    Nvfp4,
}

#[derive(Clone, Debug)]
struct Site {
    /// `add(ar, residual)` when true, `add(residual, ar)` when false.
    ar_first: bool,
    /// `fused_add_rms_norm` instead of `add` + `rms_norm`.
    fused_add_op: bool,
    quant: Quant,
    /// Whether the norm output is read besides the quant.
    norm_live: bool,
}

#[derive(Clone, Debug)]
struct Spec {
    hidden: u64,
    dtype: DType,
    gemma: bool,
    sites: Vec<Site>,
    final_residual_live: bool,
}

struct B {
    g: Graph,
    n: usize,
    outputs: Vec<Value>,
}

impl B {
    fn add(
        &mut self,
        op: Op,
        inputs: Vec<Value>,
        outputs: Vec<TensorType>,
    ) -> arfuse::advanced::ir::NodeId {
        self.n += 1;
        let id = format!("n{}", self.n);
        self.g
            .add_node(Node {
                id,
                op,
                inputs,
                outputs,
                module: None,
            })
            .unwrap()
    }
    fn input(&mut self, kind: InputKind, t: TensorType) -> Value {
        Value::new(self.add(Op::Input { kind }, vec![], vec![t]), 0)
    }
}

fn act(dtype: DType, h: u64) -> TensorType {
    TensorType::new(dtype, vec![Dim::symbol("T"), Dim::constant(h)])
}

fn build(spec: &Spec) -> Graph {
    let h = spec.hidden;
    let x_t = act(spec.dtype, h);
    let mut b = B {
        g: Graph::new(),
        n: 0,
        outputs: vec![],
    };
    b.g.set_symbol("T", SymbolRange { min: 1, max: 4096 });
    let eps = 1e-6;
    let weight_bias = if spec.gemma { 1.0 } else { 0.0 };
    let w_dtype = if spec.gemma { DType::F32 } else { spec.dtype };
    let mut residual: Option<Value> = None;
    for s in &spec.sites {
        let x = b.input(InputKind::Activation, x_t.clone());
        let ar = Value::new(
            b.add(
                Op::AllReduce {
                    group: "tp".into(),
                    reduce: Default::default(),
                },
                vec![x],
                vec![x_t.clone()],
            ),
            0,
        );
        let w = b.input(
            InputKind::Parameter,
            TensorType::new(w_dtype, vec![Dim::constant(h)]),
        );
        let (norm, h_val) = match residual {
            None => {
                let n = b.add(
                    Op::RmsNorm {
                        eps,
                        weight_bias,
                        norm_rounding: Default::default(),
                    },
                    vec![ar, w],
                    vec![x_t.clone()],
                );
                (Value::new(n, 0), ar)
            }
            Some(r) if s.fused_add_op => {
                let (a, c) = if s.ar_first { (ar, r) } else { (r, ar) };
                let n = b.add(
                    Op::FusedAddRmsNorm {
                        eps,
                        weight_bias,
                        norm_rounding: Default::default(),
                        norm_input: Default::default(),
                    },
                    vec![a, c, w],
                    vec![x_t.clone(), x_t.clone()],
                );
                (Value::new(n, 0), Value::new(n, 1))
            }
            Some(r) => {
                let (a, c) = if s.ar_first { (ar, r) } else { (r, ar) };
                let sum = Value::new(b.add(Op::Add, vec![a, c], vec![x_t.clone()]), 0);
                let n = b.add(
                    Op::RmsNorm {
                        eps,
                        weight_bias,
                        norm_rounding: Default::default(),
                    },
                    vec![sum, w],
                    vec![x_t.clone()],
                );
                (Value::new(n, 0), sum)
            }
        };
        residual = Some(h_val);
        let fp8 =
            |d: u64| TensorType::new(DType::Fp8E4m3, vec![Dim::symbol("T"), Dim::constant(d)]);
        let f32s = |d: u64| TensorType::new(DType::F32, vec![Dim::symbol("T"), Dim::constant(d)]);
        let scalar = TensorType::new(DType::F32, vec![Dim::constant(1)]);
        let quant = match s.quant {
            Quant::None => None,
            Quant::Fp8Static => {
                let sc = b.input(InputKind::Parameter, scalar.clone());
                Some((b.add(Op::QuantFp8Static, vec![norm, sc], vec![fp8(h)]), 1))
            }
            Quant::Fp8PerToken => Some((
                b.add(Op::QuantFp8PerToken, vec![norm], vec![fp8(h), f32s(1)]),
                2,
            )),
            Quant::GroupPacked => Some((
                b.add(
                    Op::QuantFp8PerTokenGroup {
                        group_size: 128,
                        scale_layout: GroupScaleLayout::PackedUe8m0,
                    },
                    vec![norm],
                    vec![
                        fp8(h),
                        TensorType::new(
                            DType::I32,
                            vec![Dim::symbol("T"), Dim::constant((h / 128).div_ceil(4))],
                        ),
                    ],
                ),
                2,
            )),
            Quant::GroupF32 => Some((
                b.add(
                    Op::QuantFp8PerTokenGroup {
                        group_size: 128,
                        scale_layout: GroupScaleLayout::F32RowMajor,
                    },
                    vec![norm],
                    vec![fp8(h), f32s(h / 128)],
                ),
                2,
            )),
            Quant::Nvfp4 => {
                let gs = b.input(InputKind::Parameter, scalar.clone());
                Some((
                    b.add(
                        Op::QuantNvfp4 {
                            scale_layout: Nvfp4ScaleLayout::Swizzled128x4,
                        },
                        vec![norm, gs],
                        vec![
                            TensorType::new(
                                DType::Fp4E2m1x2,
                                vec![Dim::symbol("T"), Dim::constant(h / 2)],
                            ),
                            TensorType::new(
                                DType::Fp8E4m3,
                                vec![Dim::symbol("T"), Dim::constant(h / 16)],
                            ),
                        ],
                    ),
                    2,
                ))
            }
        };
        match quant {
            Some((q, outs)) => {
                for o in 0..outs {
                    b.outputs.push(Value::new(q, o));
                }
                if s.norm_live {
                    b.outputs.push(norm);
                }
            }
            None => b.outputs.push(norm),
        }
    }
    if spec.final_residual_live {
        b.outputs.push(residual.unwrap());
    }
    let outs = b.outputs.clone();
    b.g.set_outputs(outs).unwrap();
    b.g.validate().unwrap();
    b.g
}

fn spec_strategy() -> impl Strategy<Value = Spec> {
    let site = (any::<bool>(), any::<bool>(), 0usize..6, any::<bool>()).prop_map(
        |(ar_first, fused_add_op, q, norm_live)| Site {
            ar_first,
            fused_add_op,
            quant: [
                Quant::None,
                Quant::Fp8Static,
                Quant::Fp8PerToken,
                Quant::GroupPacked,
                Quant::GroupF32,
                Quant::Nvfp4,
            ][q],
            norm_live,
        },
    );
    (
        prop::sample::select(vec![256u64, 384, 512, 1024, 2048]),
        prop::sample::select(vec![DType::Bf16, DType::F16]),
        any::<bool>(),
        prop::collection::vec(site, 1..4),
        any::<bool>(),
    )
        .prop_map(|(hidden, dtype, gemma, mut sites, final_residual_live)| {
            if gemma {
                // The Gemma form fuses no quant (domain.md section 2).
                for s in &mut sites {
                    s.quant = Quant::None;
                }
            }
            Spec {
                hidden,
                dtype,
                gemma,
                sites,
                final_residual_live,
            }
        })
}

/// B200, W = 4 (SM100: NVFP4 allowed), engine sized small so the oracle stays fast.
fn target() -> Target {
    let mut t = Target::preset("b200-x8").unwrap();
    t.world_size = 4;
    t.max_batched_tokens = 96;
    t.capture_sizes.retain(|&c| c <= 96);
    t.compile_range_boundaries.retain(|&c| c <= 96);
    t.validate().unwrap();
    t
}

fn count(g: &Graph, pred: impl Fn(&Op) -> bool) -> usize {
    g.nodes().filter(|(_, n)| pred(&n.op)).count()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn lowering_preserves_meaning_and_collectives(spec in spec_strategy(), seed in any::<u64>()) {
        let g = build(&spec);
        let t = target();
        let lowered = arfuse::lower(&g, &t).unwrap();
        let l = &lowered.graph;
        let ars_before = count(&g, |op| matches!(op, Op::AllReduce { .. }));
        let ars_after = count(l, |op| matches!(op, Op::AllReduce { .. }));
        let fused = count(l, |op| matches!(op, Op::FusedAllreduceNorm(_)));
        prop_assert_eq!(ars_before, ars_after + fused);
        prop_assert_eq!(fused, spec.sites.len(), "every site of this family fuses:\n{}", lowered.report);
        let max_fused = l
            .nodes()
            .filter_map(|(_, n)| match &n.op {
                Op::FusedAllreduceNorm(a) => a.plan.as_ref(),
                _ => None,
            })
            .flat_map(|p| p.dispatch.iter())
            .filter(|r| r.strategy != arfuse::advanced::ir::Strategy::Unfused)
            .map(|r| r.max_tokens)
            .max()
            .unwrap();
        let tokens = arfuse::advanced::reference::equivalence_token_counts(t.world_size, max_fused).unwrap();
        let eq = arfuse::advanced::reference::check_equivalent(&g, l, t.world_size, &tokens, seed).unwrap();
        prop_assert!(eq.is_bit_exact(), "{}\n{}", eq, l.canonical_text());
        // The per-site check agrees, site by site, at the same token counts.
        let by_site = arfuse::advanced::reference::check_sites(
            &g,
            l,
            &lowered.sites,
            t.world_size,
            arfuse::advanced::reference::SiteTokens::Given(&tokens),
            seed,
        )
        .unwrap();
        prop_assert!(by_site.is_equivalent(), "{}\n{}", by_site, l.canonical_text());
        prop_assert_eq!(by_site.sites.len(), spec.sites.len());
        // Windows (a boundary inside every chain at the smallest) change nothing but
        // the e-graph totals.
        for window_nodes in [1, 1 + (seed % 13) as usize] {
            let options = arfuse::LowerOptions::default().with_window_nodes(window_nodes);
            let cut = arfuse::lower_with(&g, &t, &options).unwrap();
            prop_assert_eq!(l.canonical_text(), cut.graph.canonical_text());
            prop_assert_eq!(&lowered.sites, &cut.sites);
            let mut report = cut.report.clone();
            report.runner = lowered.report.runner.clone();
            prop_assert_eq!(&lowered.report, &report);
        }
    }
}
