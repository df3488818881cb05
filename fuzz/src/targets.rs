//! The bodies of the arfuse fuzz targets, shared by two callers:
//!
//! - the libFuzzer harnesses in `fuzz/fuzz_targets/` (through `fuzz/src/lib.rs`);
//! - the CI smoke test `tests/hostile.rs`, which includes this file with
//!   `#[path = "../fuzz/src/targets.rs"]` and runs the bodies on the seed corpus and on
//!   deterministic pseudo-random mutations, without libFuzzer.
//!
//! The includer provides `crate::af`, a module (or a re-export of the `arfuse` facade)
//! with `ir`, `policy`, `import`, `lower`, `lower_with` and `LowerError`. Every body
//! accepts any input; an `Ok` or an `Err` from the library is fine, a panic (including
//! a failed invariant below), a hang or an unbounded allocation is a bug.
//!
//! See `docs/fuzzing.md`.

use crate::af;
use af::ir::op::{GroupScaleLayout, Nvfp4ScaleLayout};
use af::ir::{DType, Dim, Graph, InputKind, Node, NodeId, Op, SymbolRange, TensorType, Value};
use af::policy::{
    ActDtype, Backend, Interconnect, KernelLibrary, RequestedBackend, Strategy, Target,
};
use af::LowerError;

/// Presets every graph of `fuzz_bytes` is lowered for: an SM 90 trtllm machine and an
/// SM 100 mnnvl machine (which also fuses the NVFP4 epilogue).
pub const LOWER_PRESETS: [&str; 2] = ["h200-sxm-x8", "b200-x8"];

/// Hidden sizes a target parsed from the input is planned for.
pub const PLAN_HIDDENS: [u64; 3] = [4096, 7168, 2880];

// ---------------------------------------------------------------------------------
// fuzz_bytes: arbitrary bytes through load -> validate -> lower -> verify.
// ---------------------------------------------------------------------------------

/// Feeds `data` to the loader (`import::load_any`: arfuse JSON, torch.export JSON or
/// `.pt2`); a graph that loads is written and reloaded, and lowered for each of
/// [`LOWER_PRESETS`] with the invariants of [`check_lowered`]. When `data` is UTF-8 it
/// is also parsed as a target TOML, and a target that parses is planned and verified.
pub fn fuzz_bytes(data: &[u8]) {
    if let Ok(imported) = af::import::load_any(data) {
        let g = &imported.graph;
        check_round_trip(g);
        for name in LOWER_PRESETS {
            let target = Target::preset(name).expect("preset exists");
            if let Ok(lowered) = af::lower(g, &target) {
                check_lowered(g, &target, &lowered);
            }
        }
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(target) = Target::from_toml_str(text) {
            check_plan(&target, &PLAN_HIDDENS);
        }
    }
}

/// A loaded graph written as JSON loads again to the same graph.
pub fn check_round_trip(g: &Graph) {
    let json = g.to_json_string();
    let back = Graph::from_json_str(&json)
        .unwrap_or_else(|e| panic!("a loaded graph does not reload: {e}\n{json}"));
    assert_eq!(
        back.canonical_text(),
        g.canonical_text(),
        "write + reload changed the graph"
    );
    assert_eq!(back.outputs().len(), g.outputs().len());
}

/// Plans `target` for `hiddens`; a plan that is returned verifies clean against its
/// own workspace and answers every token count it covers.
pub fn check_plan(target: &Target, hiddens: &[u64]) {
    let Ok(p) = af::policy::plan(target, hiddens) else {
        return;
    };
    if let Some(ws) = &p.workspace {
        let v = af::policy::verify(&p, ws);
        assert!(v.is_empty(), "plan fails its own verification: {v:?}");
    }
    assert!(p.verify_own().is_empty());
    assert!(p.max_planned_tokens >= 1);
    for t in [1, p.max_token_num.max(1), p.max_planned_tokens] {
        p.strategy_for(t)
            .unwrap_or_else(|e| panic!("no strategy for T={t} inside the plan: {e}"));
    }
    for site in &p.sites {
        let mut prev_hi: Option<u64> = None;
        for r in &site.ranges {
            let want = prev_hi.map_or(Some(1), |h| h.checked_add(1));
            assert_eq!(
                Some(r.lo),
                want,
                "ranges of H={} are not contiguous from 1",
                site.hidden
            );
            assert!(r.lo <= r.hi);
            prev_hi = Some(r.hi);
        }
        assert_eq!(prev_hi, Some(p.max_planned_tokens), "H={}", site.hidden);
    }
    let _ = p.summary();
}

// ---------------------------------------------------------------------------------
// Invariants of a lowering.
// ---------------------------------------------------------------------------------

fn count_ops(g: &Graph) -> (usize, usize) {
    let mut ar = 0;
    let mut fused = 0;
    for (_, n) in g.nodes() {
        match n.op {
            Op::AllReduce { .. } => ar += 1,
            Op::FusedAllreduceNorm(_) => fused += 1,
            _ => {}
        }
    }
    (ar, fused)
}

/// Checks what [`af::lower`] returned for `input` and `target`:
///
/// - the output validates, and writes + reloads to itself;
/// - collectives are kept: all-reduces in = all-reduces out + new fused nodes, and the
///   report's counts agree with the graph;
/// - lowering is deterministic (the same input gives the same graph and report) and
///   idempotent (lowering the output again gives it back);
/// - every fused node's plan covers `1..=max` without gaps, and every fused range's
///   byte count is the policy's `required_bytes`, recomputed here with checked u64
///   arithmetic, and fits one Lamport buffer where the strategy uses one.
pub fn check_lowered(input: &Graph, target: &Target, lowered: &af::Lowered) {
    let out = &lowered.graph;
    if let Err(p) = out.validate() {
        panic!("the lowered graph does not validate: {p}\n{out}");
    }
    check_round_trip(out);

    let (ar_in, fused_in) = count_ops(input);
    let (ar_out, fused_out) = count_ops(out);
    assert_eq!(
        ar_in + fused_in,
        ar_out + fused_out,
        "collectives were dropped or duplicated\n--- in\n{input}\n--- out\n{out}"
    );
    let r = &lowered.report;
    assert_eq!(r.all_reduces_seen, ar_in, "report: all-reduces seen");
    assert_eq!(r.already_fused, fused_in, "report: already fused");
    assert_eq!(r.all_reduces_fused, fused_out - fused_in, "report: fused");
    assert_eq!(r.sites.len(), ar_in, "report: one site per all-reduce");
    assert_eq!(
        r.sites.iter().filter(|s| s.fused).count(),
        r.all_reduces_fused,
        "report: fused sites"
    );

    let again = af::lower(input, target).expect("lowering the same input twice");
    assert_eq!(
        again.graph.canonical_text(),
        out.canonical_text(),
        "lowering is not deterministic"
    );
    assert_eq!(
        again.report.sites, r.sites,
        "the report is not deterministic"
    );

    // With default options: the group inferred from the output (fused nodes count for
    // their group) is the one the first run used (ir-fixtures/hostile/
    // lower_twice_group_tie.json).
    match af::lower(out, target) {
        Ok(twice) => {
            assert_eq!(
                twice.report.group, r.group,
                "lowering again chose another group"
            );
            assert_eq!(
                twice.graph.canonical_text(),
                out.canonical_text(),
                "lowering a lowered graph changed it\n--- once\n{out}"
            );
            assert_eq!(twice.report.all_reduces_fused, 0);
        }
        Err(e) => panic!("lowering a lowered graph failed: {e}\n{out}"),
    }

    for (_, n) in out.nodes() {
        let Op::FusedAllreduceNorm(f) = &n.op else {
            continue;
        };
        // Fused nodes of the input are carried verbatim: the IR checks their plans on
        // load (ir-fixtures/hostile/fused_plan_*.json), but they may be for another
        // target. Only the plans this lowering wrote are checked against `target`.
        if input
            .find(&n.id)
            .is_some_and(|i| matches!(input.node(i).op, Op::FusedAllreduceNorm(_)))
        {
            continue;
        }
        let Some(plan) = &f.plan else { continue };
        let Some(x) = out.value_type(n.inputs[0]) else {
            panic!("fused node {} has no input type", n.id)
        };
        let h = x.shape.last().and_then(Dim::as_const).unwrap_or(0);
        let dtype = x.dtype.activation();
        let ws = &plan.workspace;
        let (kernels, backend) = (ws.kernels, ws.backend);
        assert_eq!(
            kernels, target.kernels,
            "{}: the plan is for other kernels",
            n.id
        );
        assert!(!plan.dispatch.is_empty(), "{}: empty dispatch", n.id);
        assert!(
            ws.problems().is_empty(),
            "{}: the workspace has problems: {:?}",
            n.id,
            ws.problems()
        );
        let mut next = 1u64;
        for d in &plan.dispatch {
            assert_eq!(d.min_tokens, next, "{}: dispatch gap or overlap", n.id);
            assert!(d.min_tokens <= d.max_tokens, "{}: empty range", n.id);
            next = d.max_tokens.saturating_add(1);
            let strategy = d.strategy;
            if !strategy.is_fused() {
                continue;
            }
            assert!(
                d.max_tokens <= plan.max_token_num,
                "{}: fused range up to T={} beyond max_token_num {}",
                n.id,
                d.max_tokens,
                plan.max_token_num
            );
            // FlashInfer's two-shot needs T >= W (arfuse's Lamport two-shot does not).
            if strategy == Strategy::TwoShot && kernels == KernelLibrary::Flashinfer {
                assert!(
                    d.min_tokens >= u64::from(target.world_size),
                    "{}: two-shot below T = W",
                    n.id
                );
            }
            let dtype = dtype.unwrap_or_else(|| panic!("{}: fused a {} activation", n.id, x.dtype));
            let need = af::policy::required_bytes(
                kernels,
                backend,
                strategy,
                d.max_tokens,
                h,
                target.world_size,
                dtype,
            )
            .unwrap_or_else(|e| panic!("{}: a planned range has no byte count: {e}", n.id));
            let expect = recompute_bytes(
                kernels,
                backend,
                strategy,
                d.max_tokens,
                h,
                target.world_size,
                dtype,
            )
            .unwrap_or_else(|| panic!("{}: bytes of a planned range overflow u64", n.id));
            assert_eq!(need, expect, "{}: required_bytes disagrees", n.id);
            // Every range (also one clipped to the graph's token counts) states the
            // bytes of its own last T.
            assert_eq!(
                d.required_bytes, need,
                "{}: T={} needs {need} bytes, the plan says {}",
                n.id, d.max_tokens, d.required_bytes
            );
            let in_lamport = strategy == Strategy::OneShot
                || backend == Backend::Mnnvl
                || kernels == KernelLibrary::Arfuse;
            if in_lamport {
                assert!(
                    d.required_bytes <= ws.lamport_buffer_bytes,
                    "{}: T={} needs {need} bytes, one Lamport buffer has {}",
                    n.id,
                    d.max_tokens,
                    ws.lamport_buffer_bytes
                );
            }
        }
    }
}

/// domain.md §5 byte counts, recomputed independently: one-shot and FlashInfer trtllm
/// two-shot `T*H*W*e`, every other two-shot (arfuse's kernels, FlashInfer mnnvl)
/// `2*ceil(T/W)*W*H*e`; `None` on overflow.
pub fn recompute_bytes(
    kernels: KernelLibrary,
    backend: Backend,
    strategy: Strategy,
    t: u64,
    h: u64,
    w: u32,
    dtype: ActDtype,
) -> Option<u64> {
    let w = u64::from(w);
    let row = h.checked_mul(w)?.checked_mul(dtype.element_bytes())?;
    match (kernels, backend, strategy) {
        (_, _, Strategy::Unfused) => Some(0),
        (_, _, Strategy::OneShot)
        | (KernelLibrary::Flashinfer, Backend::Trtllm, Strategy::TwoShot) => t.checked_mul(row),
        (_, _, Strategy::TwoShot) => 2u64.checked_mul(t.div_ceil(w))?.checked_mul(row),
    }
}

// ---------------------------------------------------------------------------------
// fuzz_structured: well-formed graphs and arbitrary targets from the input bytes.
// ---------------------------------------------------------------------------------

/// Reads choices from the fuzz input; past its end every read is 0, so every input,
/// the empty one included, describes a graph and a target.
pub struct Src<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Src<'a> {
    /// A reader over `data`.
    pub fn new(data: &'a [u8]) -> Src<'a> {
        Src { data, pos: 0 }
    }

    /// The next byte (0 past the end).
    pub fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }

    /// A little-endian u64 of the next 8 bytes.
    pub fn u64(&mut self) -> u64 {
        (0..8).fold(0u64, |acc, i| acc | (u64::from(self.byte()) << (8 * i)))
    }

    /// A value in `0..n` (`n >= 1`).
    pub fn below(&mut self, n: usize) -> usize {
        if n <= 256 {
            usize::from(self.byte()) % n
        } else {
            (self.u64() % n as u64) as usize
        }
    }

    /// True with probability about `num / 256`; false past the end of the input, so
    /// a short input describes a small graph.
    pub fn chance(&mut self, num: u8) -> bool {
        self.byte() > 255 - num
    }

    /// One of `xs`.
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
}

/// Interesting token counts: 0 and 1, real engine sizes, powers of two, near-overflow.
const TOKENS: [u64; 12] = [
    0,
    1,
    7,
    64,
    512,
    8192,
    16384,
    1 << 20,
    1 << 32,
    1 << 62,
    u64::MAX - 1,
    u64::MAX,
];

fn token_count(s: &mut Src) -> u64 {
    if s.chance(32) {
        s.u64()
    } else {
        s.pick(&TOKENS)
    }
}

/// A target: a preset with some fields changed, or every field arbitrary. Many are
/// invalid (W = 0, SM 0, group_nodes > W, ...); the pass must refuse those with an
/// error.
pub fn gen_target(s: &mut Src) -> Target {
    let mut t = Target::preset(s.pick(Target::preset_names())).expect("preset exists");
    let all = s.chance(64);
    let changes = if all { 16 } else { s.below(4) };
    for _ in 0..changes {
        match s.below(13) {
            0 => t.sm = s.pick(&[0, 80, 89, 90, 100, 103, 110, 120, u32::MAX]),
            1 => t.world_size = s.pick(&[0, 1, 2, 3, 4, 6, 8, 16, 36, 72, 73, u32::MAX]),
            2 => t.group_nodes = s.pick(&[0, 1, 2, 4, 9, u32::MAX]),
            3 => t.gpus_per_node = s.pick(&[0, 1, 4, 8, 72, u32::MAX]),
            4 => t.multicast_all_ranks = s.chance(128),
            5 => {
                t.interconnect = s.pick(&[
                    Interconnect::Nvswitch,
                    Interconnect::BridgedNvlink,
                    Interconnect::Pcie,
                    Interconnect::NvlinkFabric,
                    Interconnect::Infiniband,
                ])
            }
            6 => t.dtype = s.pick(&[ActDtype::Bf16, ActDtype::F16, ActDtype::F32]),
            7 => t.max_batched_tokens = token_count(s),
            8 => {
                let n = s.below(4);
                t.capture_sizes = (0..n).map(|_| token_count(s)).collect();
                let n = s.below(3);
                t.compile_range_boundaries = (0..n).map(|_| token_count(s)).collect();
            }
            9 => t.num_speculative_tokens = s.pick(&[0, 1, 3, 7, u64::MAX]),
            11 => t.kernels = s.pick(&[KernelLibrary::Arfuse, KernelLibrary::Flashinfer]),
            10 => {
                t.deterministic = s.chance(128);
                t.requested_backend = s.pick(&[
                    RequestedBackend::Auto,
                    RequestedBackend::Trtllm,
                    RequestedBackend::Mnnvl,
                    RequestedBackend::Off,
                ]);
            }
            _ => {
                t.max_bytes_override = match s.below(6) {
                    0 => None,
                    1 => Some(0),
                    2 => Some(1),
                    3 => Some(1 << 20),
                    4 => Some(u64::MAX),
                    _ => Some(s.u64()),
                }
            }
        }
    }
    t
}

/// Builds a graph node by node through the IR API ([`Graph::add_node`]).
struct Builder {
    g: Graph,
    next: usize,
}

impl Builder {
    fn add(
        &mut self,
        op: Op,
        inputs: Vec<Value>,
        outputs: Vec<TensorType>,
        module: Option<String>,
    ) -> NodeId {
        let id = format!("n{}", self.next);
        self.next += 1;
        self.g
            .add_node(Node {
                id,
                op,
                inputs,
                outputs,
                module,
            })
            .expect("the generator only reads existing values")
    }

    fn input(&mut self, kind: InputKind, ty: TensorType) -> Value {
        Value::new(self.add(Op::Input { kind }, vec![], vec![ty], None), 0)
    }

    fn ty(&self, v: Value) -> TensorType {
        self.g.value_type(v).expect("value exists").clone()
    }
}

fn with_last(t: &TensorType, last: u64, dtype: DType) -> TensorType {
    let mut dims = t.shape.dims().to_vec();
    if let Some(l) = dims.last_mut() {
        *l = Dim::constant(last);
    }
    TensorType::new(dtype, dims)
}

fn retyped(t: &TensorType, dtype: DType) -> TensorType {
    TensorType::new(dtype, t.shape.dims().to_vec())
}

const HIDDEN: [u64; 16] = [
    16,
    48,
    64,
    1000,
    2048,
    2880,
    4096,
    5120,
    6144,
    7168,
    8192,
    12288,
    16384,
    1 << 20,
    1 << 40,
    u64::MAX / 2,
];

/// A random decoder-like layer stack: per layer a producer, an all-reduce over a
/// group, then one of the norm spellings (fused add+RMSNorm, add then RMSNorm,
/// decomposed RMSNorm, RMSNorm without residual, nothing), an optional quant epilogue,
/// optional views and extra readers of the intermediates (liveness), and a random set
/// of graph outputs. Types are what the ops produce, so most graphs validate; the
/// rest (a quant block that does not divide H, a byte count that overflows) must be
/// refused by validation.
pub fn gen_graph(s: &mut Src) -> Graph {
    let mut b = Builder {
        g: Graph::new(),
        next: 0,
    };
    let three_d = s.chance(48);
    let t_max = if s.chance(200) {
        s.pick(&[1, 16, 8192, 16384, 1 << 20])
    } else {
        // The IR's largest bound (valid; byte counts of a few symbols times H stay in
        // u64) twice as often as bounds beyond it (refused).
        let most = af::ir::MAX_SYMBOL_VALUE;
        s.pick(&[most, most, 1 << 40, u64::MAX])
    };
    let t_min = if s.chance(16) { s.pick(&[0, t_max]) } else { 1 };
    let h = if s.chance(24) {
        s.u64() % (1 << 20) + 1
    } else {
        s.pick(&HIDDEN)
    };
    let act = s.pick(&[DType::Bf16, DType::Bf16, DType::F16, DType::F32]);
    let lead: Vec<Dim> = if three_d {
        b.g.set_symbol("B", SymbolRange { min: 1, max: 64 });
        b.g.set_symbol(
            "S",
            SymbolRange {
                min: t_min,
                max: t_max,
            },
        );
        vec![Dim::symbol("B"), Dim::symbol("S")]
    } else {
        b.g.set_symbol(
            "T",
            SymbolRange {
                min: t_min,
                max: t_max,
            },
        );
        vec![Dim::symbol("T")]
    };
    let act_ty = |h: u64, d: DType| {
        let mut dims = lead.clone();
        dims.push(Dim::constant(h));
        TensorType::new(d, dims)
    };
    let flat_ty = |h: u64, d: DType| {
        let lead = if three_d {
            Dim::parse("B*S").expect("valid dim")
        } else {
            Dim::symbol("T")
        };
        TensorType::new(d, vec![lead, Dim::constant(h)])
    };

    let x0 = b.input(InputKind::Activation, act_ty(h, act));
    let mut residual = if s.chance(200) {
        Some(b.input(InputKind::Activation, act_ty(h, act)))
    } else {
        None
    };
    let mut prev = x0;
    let mut live: Vec<Value> = Vec::new();
    let layers = if s.chance(8) {
        16 + s.below(48)
    } else {
        s.below(7)
    };
    for l in 0..layers {
        let m = |part: &str| Some(format!("model.layers.{l}.{part}"));
        // Producer of the partial sum.
        let px = match s.below(3) {
            0 => {
                let w = b.input(
                    InputKind::Parameter,
                    TensorType::new(act, vec![Dim::constant(h), Dim::constant(h)]),
                );
                let pty = b.ty(prev);
                let op_ty = act_ty(h, act);
                if pty.dtype == act && pty.shape.last().and_then(Dim::as_const) == Some(h) {
                    Value::new(
                        b.add(
                            Op::Matmul { transpose_b: true },
                            vec![prev, w],
                            vec![op_ty],
                            m("mlp.down_proj"),
                        ),
                        0,
                    )
                } else {
                    Value::new(
                        b.add(
                            Op::Opaque {
                                target: "aten.scaled_mm".into(),
                                attrs: serde_json::Value::Null,
                            },
                            vec![prev],
                            vec![op_ty],
                            m("mlp"),
                        ),
                        0,
                    )
                }
            }
            _ => Value::new(
                b.add(
                    Op::Opaque {
                        target: "attention".into(),
                        attrs: serde_json::json!({"layer": l}),
                    },
                    vec![prev],
                    vec![act_ty(h, act)],
                    m("self_attn"),
                ),
                0,
            ),
        };
        // Optional view around the all-reduce (3-D activations are flattened).
        let view = three_d && s.chance(160);
        let ar_in = if view {
            Value::new(b.add(Op::Reshape, vec![px], vec![flat_ty(h, act)], None), 0)
        } else {
            px
        };
        let group = match s.below(16) {
            0 => "dp",
            1 => "ep",
            _ => "tp",
        };
        let ar_ty = b.ty(ar_in);
        let mut ar = Value::new(
            b.add(
                Op::AllReduce {
                    group: group.into(),
                    reduce: Default::default(),
                },
                vec![ar_in],
                vec![ar_ty],
                m("mlp"),
            ),
            0,
        );
        if view {
            ar = Value::new(b.add(Op::Reshape, vec![ar], vec![act_ty(h, act)], None), 0);
        }
        if s.chance(24) {
            live.push(ar);
        }
        // Norm.
        let eps = s.pick(&[1e-5, 1e-6, 1e-12, 0.5, 1e30, f64::MIN_POSITIVE]);
        let gemma = s.chance(32);
        let (w_ty, weight_bias) = if gemma {
            (TensorType::new(DType::F32, vec![Dim::constant(h)]), 1.0)
        } else {
            (TensorType::new(act, vec![Dim::constant(h)]), 0.0)
        };
        let w = b.input(InputKind::Parameter, w_ty);
        let norm_module = m("post_attention_layernorm");
        let kind = s.below(6);
        let res_val = residual.unwrap_or(x0);
        let (norm, new_res) = match kind {
            0 | 1 => {
                let n = b.add(
                    Op::FusedAddRmsNorm {
                        eps,
                        weight_bias,
                        norm_rounding: Default::default(),
                        norm_input: Default::default(),
                    },
                    vec![ar, res_val, w],
                    vec![act_ty(h, act), act_ty(h, act)],
                    norm_module,
                );
                (Value::new(n, 0), Some(Value::new(n, 1)))
            }
            2 => {
                let (a, c) = if s.chance(128) {
                    (ar, res_val)
                } else {
                    (res_val, ar)
                };
                let hs = Value::new(b.add(Op::Add, vec![a, c], vec![act_ty(h, act)], None), 0);
                let n = b.add(
                    Op::RmsNorm {
                        eps,
                        weight_bias,
                        norm_rounding: Default::default(),
                    },
                    vec![hs, w],
                    vec![act_ty(h, act)],
                    norm_module,
                );
                (Value::new(n, 0), Some(hs))
            }
            3 => {
                let hs = Value::new(
                    b.add(Op::Add, vec![res_val, ar], vec![act_ty(h, act)], None),
                    0,
                );
                let n = decomposed_norm(&mut b, s, hs, w, eps, act, &act_ty(h, act), norm_module);
                (n, Some(hs))
            }
            4 => {
                let n = b.add(
                    Op::RmsNorm {
                        eps,
                        weight_bias,
                        norm_rounding: Default::default(),
                    },
                    vec![ar, w],
                    vec![act_ty(h, act)],
                    norm_module,
                );
                (Value::new(n, 0), None)
            }
            _ => (ar, None),
        };
        if let Some(r) = new_res {
            residual = Some(r);
            if s.chance(24) {
                live.push(r);
            }
        }
        // Quant epilogue.
        let norm_ty = b.ty(norm);
        prev = match s.below(8) {
            0 => {
                let sc = b.input(
                    InputKind::Parameter,
                    TensorType::new(DType::F32, vec![Dim::constant(1)]),
                );
                let q = b.add(
                    Op::QuantFp8Static,
                    vec![norm, sc],
                    vec![retyped(&norm_ty, DType::Fp8E4m3)],
                    m("mlp"),
                );
                Value::new(q, 0)
            }
            1 => {
                let q = b.add(
                    Op::QuantFp8PerToken,
                    vec![norm],
                    vec![
                        retyped(&norm_ty, DType::Fp8E4m3),
                        with_last(&norm_ty, 1, DType::F32),
                    ],
                    m("mlp"),
                );
                live.push(Value::new(q, 1));
                Value::new(q, 0)
            }
            2 => {
                let gs = s.pick(&[16, 64, 128, 7, h]);
                let layout = s.pick(&GroupScaleLayout::ALL);
                let groups = h / gs;
                let scale = if layout.f32_storage() {
                    with_last(&norm_ty, groups, DType::F32)
                } else {
                    with_last(&norm_ty, groups.div_ceil(4), DType::I32)
                };
                let q = b.add(
                    Op::QuantFp8PerTokenGroup {
                        group_size: gs,
                        scale_layout: layout,
                    },
                    vec![norm],
                    vec![retyped(&norm_ty, DType::Fp8E4m3), scale],
                    m("mlp"),
                );
                live.push(Value::new(q, 1));
                Value::new(q, 0)
            }
            3 => {
                let gsc = b.input(InputKind::Parameter, TensorType::new(DType::F32, vec![]));
                let layout = s.pick(&[Nvfp4ScaleLayout::Swizzled128x4, Nvfp4ScaleLayout::Linear]);
                let q = b.add(
                    Op::QuantNvfp4 {
                        scale_layout: layout,
                    },
                    vec![norm, gsc],
                    vec![
                        with_last(&norm_ty, h / 2, DType::Fp4E2m1x2),
                        with_last(&norm_ty, h / 16, DType::Fp8E4m3),
                    ],
                    m("mlp"),
                );
                live.push(Value::new(q, 1));
                Value::new(q, 0)
            }
            _ => norm,
        };
        if s.chance(40) {
            live.push(norm);
        }
        // Extra readers of an intermediate value.
        if !live.is_empty() && s.chance(48) {
            let v = live[s.below(live.len())];
            let readers = if s.chance(16) { 64 } else { 1 + s.below(3) };
            for _ in 0..readers {
                let ty = b.ty(v);
                b.add(
                    Op::Opaque {
                        target: "aten.clone".into(),
                        attrs: serde_json::Value::Null,
                    },
                    vec![v],
                    vec![ty],
                    None,
                );
            }
        }
    }
    // Graph outputs: the last value, the residual, and some intermediates.
    let mut outs = vec![prev];
    if let Some(r) = residual {
        if s.chance(200) {
            outs.push(r);
        }
    }
    for v in live {
        if s.chance(64) {
            outs.push(v);
        }
    }
    if s.chance(16) {
        outs.push(outs[0]);
    }
    b.g.set_outputs(outs).expect("outputs exist");
    b.g
}

/// The decomposed RMSNorm of `hs` as Llama writes it in eager mode: to f32, square,
/// mean over the last dim, add eps, rsqrt, multiply, back to the activation dtype,
/// times the weight.
#[allow(clippy::too_many_arguments)]
fn decomposed_norm(
    b: &mut Builder,
    s: &mut Src,
    hs: Value,
    w: Value,
    eps: f64,
    act: DType,
    ty: &TensorType,
    module: Option<String>,
) -> Value {
    let f = retyped(ty, DType::F32);
    let one = with_last(ty, 1, DType::F32);
    let hf = Value::new(
        b.add(
            Op::ToDtype { dtype: DType::F32 },
            vec![hs],
            vec![f.clone()],
            None,
        ),
        0,
    );
    let sq = Value::new(
        b.add(Op::Pow { exponent: 2.0 }, vec![hf], vec![f.clone()], None),
        0,
    );
    let ms = Value::new(
        b.add(
            Op::Mean {
                dims: vec![-1],
                keepdim: true,
            },
            vec![sq],
            vec![one.clone()],
            None,
        ),
        0,
    );
    let e = Value::new(
        b.add(
            Op::Constant { value: eps },
            vec![],
            vec![TensorType::new(DType::F32, vec![])],
            None,
        ),
        0,
    );
    let mse = Value::new(b.add(Op::Add, vec![ms, e], vec![one.clone()], None), 0);
    let r = Value::new(b.add(Op::Rsqrt, vec![mse], vec![one], None), 0);
    let n = Value::new(b.add(Op::Mul, vec![hf, r], vec![f], None), 0);
    let nb = Value::new(
        b.add(
            Op::ToDtype { dtype: act },
            vec![n],
            vec![retyped(ty, act)],
            None,
        ),
        0,
    );
    let (a, c) = if s.chance(128) { (w, nb) } else { (nb, w) };
    Value::new(
        b.add(Op::Mul, vec![a, c], vec![retyped(ty, act)], module),
        0,
    )
}

/// Outcome counters of [`fuzz_structured`], for the smoke test's coverage check.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StructuredOutcome {
    /// The generated graph validated.
    pub valid_graph: bool,
    /// The generated target validated.
    pub valid_target: bool,
    /// `lower` returned a graph.
    pub lowered: bool,
    /// Fused nodes the lowering created.
    pub fused: usize,
}

/// Builds a graph and a target from `data`, lowers, plans and checks every invariant
/// of [`check_lowered`]. Errors are fine when they are the right ones: an invalid graph
/// gives `InvalidGraph`, and a graph that validates is never refused as invalid; a
/// small graph always saturates; `Internal` is always a bug.
pub fn fuzz_structured(data: &[u8]) -> StructuredOutcome {
    let mut s = Src::new(data);
    let target = gen_target(&mut s);
    let graph = gen_graph(&mut s);
    let mut outcome = StructuredOutcome {
        valid_graph: graph.validate().is_ok(),
        valid_target: target.validate().is_ok(),
        ..Default::default()
    };
    check_round_trip_if_valid(&graph, outcome.valid_graph);
    match af::lower(&graph, &target) {
        Ok(lowered) => {
            assert!(outcome.valid_graph, "an invalid graph was lowered\n{graph}");
            assert!(
                outcome.valid_target,
                "lowered for an invalid target {target:?}"
            );
            check_lowered(&graph, &target, &lowered);
            outcome.lowered = true;
            outcome.fused = lowered.report.all_reduces_fused;
        }
        Err(LowerError::InvalidGraph(p)) => {
            assert!(
                !outcome.valid_graph,
                "a valid graph was refused: {p}\n{graph}"
            );
        }
        Err(e @ LowerError::NotSaturated { .. }) => {
            panic!(
                "a {}-node graph did not saturate: {e}\n{graph}",
                graph.len()
            )
        }
        Err(LowerError::Internal(m)) => {
            panic!("internal error: {m}\ntarget {target:?}\n{graph}")
        }
        Err(_) => {
            assert!(outcome.valid_graph);
        }
    }
    if outcome.valid_target {
        let hidden = graph
            .nodes()
            .filter_map(|(_, n)| n.outputs.first())
            .filter_map(|t| t.shape.last().and_then(Dim::as_const))
            .max()
            .unwrap_or(4096);
        check_plan(&target, &[hidden, 4096]);
    }
    outcome
}

fn check_round_trip_if_valid(g: &Graph, valid: bool) {
    if valid {
        check_round_trip(g);
    }
}

// ---------------------------------------------------------------------------------
// Deterministic mutations, for the smoke test (libFuzzer has its own).
// ---------------------------------------------------------------------------------

/// A xorshift64* generator: the same seed gives the same mutations on every machine.
pub struct Rng(pub u64);

impl Rng {
    /// The next value.
    pub fn next(&mut self) -> u64 {
        let mut x = self.0.max(1);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A value in `0..n` (`n >= 1`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Tokens a mutation may splice in: values at the edges of every limit.
pub const DICTIONARY: &[&str] = &[
    "0",
    "-1",
    "1e400",
    "NaN",
    "\"NaN\"",
    "18446744073709551615",
    "18446744073709551616",
    "4294967296",
    "null",
    "[]",
    "{}",
    "\"T\"",
    "\"T*T*T*T\"",
    "\"x:1\"",
    "\"x:4294967296\"",
    "\"all_reduce\"",
    "\"fused_allreduce_norm\"",
    "\"opaque\"",
    "\"quant_nvfp4\"",
    "\"group\"",
    "\"eps\"",
    "\"inputs\"",
    "\"outputs\"",
    "\"symbols\"",
    "\"dispatch\"",
    "{\"min\": 5, \"max\": 1}",
    "[[[[[[[[[[[[[[[[",
    "\u{feff}",
    "\u{ff}",
    "world_size = 0",
    "max_batched_tokens = 18446744073709551615",
    "capture_sizes = [0]",
];

/// One mutation of `input`: flip, insert, delete, duplicate or splice, as libFuzzer's
/// default mutators do.
pub fn mutate(rng: &mut Rng, input: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    let rounds = 1 + rng.below(4);
    for _ in 0..rounds {
        let len = v.len();
        match rng.below(7) {
            0 if len > 0 => {
                let i = rng.below(len);
                v[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                v[i] = rng.next() as u8;
            }
            2 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below(16.min(len - i));
                v.drain(i..i + n);
            }
            3 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below(64.min(len - i));
                let chunk: Vec<u8> = v[i..i + n].to_vec();
                let at = rng.below(len + 1);
                v.splice(at..at, chunk);
            }
            4 if len > 0 => {
                // Replace a run of digits (a number) by a dictionary token.
                let i = rng.below(len);
                let start = (0..=i)
                    .rev()
                    .find(|&k| !v[k].is_ascii_digit())
                    .map_or(0, |k| k + 1);
                let end = (i..len).find(|&k| !v[k].is_ascii_digit()).unwrap_or(len);
                let tok = DICTIONARY[rng.below(DICTIONARY.len())].as_bytes();
                v.splice(start.min(end)..end, tok.iter().copied());
            }
            5 => {
                let tok = DICTIONARY[rng.below(DICTIONARY.len())].as_bytes();
                let at = rng.below(len + 1);
                v.splice(at..at, tok.iter().copied());
            }
            _ if len > 0 => {
                let at = rng.below(len + 1);
                v.truncate(at);
            }
            _ => v.push(rng.next() as u8),
        }
    }
    v
}
