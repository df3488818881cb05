//! Type checking: arity, dtypes, shapes, attributes and byte-count overflow.

use crate::error::{Problem, ProblemKind, Problems};
use crate::graph::{MAX_RANK, MAX_SYMBOL_VALUE, WORLD_SIZE_KEYS};
use crate::op::{FusedOutput, FusedQuant, GroupScaleLayout};
use crate::{DType, Dim, Graph, Node, NodeId, Op, Shape, TensorType};

/// NVFP4 block size in elements (domain.md section 1).
pub use arfuse_abi::NVFP4_BLOCK;

/// True for an RMSNorm epsilon the IR accepts: finite, in (0, 1), and non-zero as the
/// f32 the kernels and the reference compute with (real models use 1e-5 or 1e-6; 1 or
/// more would swamp mean(x^2) of any normalised activation; below about 7e-46 the f32
/// is 0).
pub fn valid_eps(eps: f64) -> bool {
    eps.is_finite() && eps < 1.0 && (eps as f32) > 0.0
}

impl Graph {
    /// Checks every node's arity, element types, shapes and attributes, every symbol
    /// and every output's largest byte count. Returns all problems found, each naming
    /// its node.
    pub fn validate(&self) -> Result<(), Problems> {
        validate(self)
    }

    /// [`Graph::validate`] for the nodes `nodes` only (and every symbol): for a graph
    /// made from a valid one by adding or rewiring those nodes, whose other nodes read
    /// values of unchanged types, this finds every problem `validate` would. An index
    /// that names no node of the graph is skipped.
    pub fn validate_nodes(&self, nodes: impl IntoIterator<Item = NodeId>) -> Result<(), Problems> {
        let mut p = Problems::new();
        check_symbols(self, &mut p);
        check_metadata(self, &mut p);
        let mut last = None;
        for id in nodes {
            if let Some(n) = self.get(id) {
                check_node(self, n, &mut p, &mut last);
            }
        }
        p.into_result()
    }
}

pub(crate) fn validate(g: &Graph) -> Result<(), Problems> {
    let mut p = Problems::new();
    check_symbols(g, &mut p);
    check_metadata(g, &mut p);
    let mut last = None;
    for (_, n) in g.nodes() {
        check_node(g, n, &mut p, &mut last);
    }
    p.into_result()
}

/// Checks node `n` of `g` into `p`. `last` is the last output type found well formed
/// (by [`Checker::outputs_well_formed`], under `g`'s symbols): an output of the same
/// type is well formed without its checks again (most values of a layer share one).
fn check_node<'g>(g: &'g Graph, n: &'g Node, p: &mut Problems, last: &mut Option<&'g TensorType>) {
    let mut c = Checker { g, n, p };
    c.outputs_well_formed(&n.outputs, last);
    c.op();
}

fn check_symbols(g: &Graph, p: &mut Problems) {
    for (name, r) in g.symbols() {
        if r.min > r.max {
            p.push(Problem::new(
                format!("symbols.{name}"),
                ProblemKind::Symbol,
                format!("empty range: min {} > max {}", r.min, r.max),
            ));
        } else if r.max > MAX_SYMBOL_VALUE {
            p.push(Problem::new(
                format!("symbols.{name}"),
                ProblemKind::Limit,
                format!(
                    "max {} is above the limit of {MAX_SYMBOL_VALUE} (MAX_SYMBOL_VALUE, 2^31 - 1); \
                     give the largest value the engine runs with (e.g. its max batched tokens)",
                    r.max
                ),
            ));
        }
    }
}

/// The metadata keys recording the tensor-parallel size ([`WORLD_SIZE_KEYS`]): each one
/// present in an object is an integer from 1 to `u32::MAX` (a world size, as a target's
/// `world_size`), and when both are, they are equal. Other metadata is free-form.
fn check_metadata(g: &Graph, p: &mut Problems) {
    let Some(serde_json::Value::Object(m)) = g.metadata() else {
        return;
    };
    let mut sizes = Vec::new();
    for key in WORLD_SIZE_KEYS {
        let Some(v) = m.get(key) else { continue };
        match v.as_u64().filter(|&w| w >= 1 && w <= u64::from(u32::MAX)) {
            Some(w) => sizes.push((key, w)),
            None => p.push(Problem::new(
                format!("metadata.{key}"),
                ProblemKind::Attribute,
                format!(
                    "is {}; it records the tensor-parallel size the graph was built for, an \
                     integer from 1 to {} (remove the key if the graph has none)",
                    describe_json(v),
                    u32::MAX
                ),
            )),
        }
    }
    if let [(a, wa), (b, wb)] = sizes[..] {
        if wa != wb {
            p.push(Problem::new(
                "metadata",
                ProblemKind::Attribute,
                format!("{a} = {wa} and {b} = {wb} disagree: a graph has one tensor-parallel size"),
            ));
        }
    }
}

/// A JSON value in a few words, whatever its size: a number as written, a string
/// quoted (its first 32 characters), else its kind.
fn describe_json(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Number(n) => n.to_string(),
        serde_json::Value::String(s) if s.chars().count() <= 32 => format!("{s:?}"),
        serde_json::Value::String(s) => {
            format!("{:?}... (a string)", s.chars().take(32).collect::<String>())
        }
        serde_json::Value::Null => "null".into(),
        serde_json::Value::Bool(b) => b.to_string(),
        serde_json::Value::Array(_) => "an array".into(),
        serde_json::Value::Object(_) => "an object".into(),
    }
}

struct Checker<'a> {
    g: &'a Graph,
    n: &'a Node,
    p: &'a mut Problems,
}

fn dim(n: u64) -> Dim {
    Dim::constant(n)
}

impl<'a> Checker<'a> {
    fn err(&mut self, kind: ProblemKind, msg: impl Into<String>) {
        self.p.push(Problem::new(&self.n.id, kind, msg));
    }

    /// Input `i`, a residual added to the input `x`, has `x`'s type: a different
    /// element type is a [`ProblemKind::DType`] problem, else a different shape a
    /// [`ProblemKind::Shape`] one.
    fn residual_matches(&mut self, i: usize, x: &TensorType) {
        let r = self.input(i);
        if r == x {
            return;
        }
        let kind = if r.dtype != x.dtype {
            ProblemKind::DType
        } else {
            ProblemKind::Shape
        };
        self.err(kind, format!("residual {r} differs from the input {x}"));
    }

    fn input(&self, i: usize) -> &'a TensorType {
        // Inputs are valid values by construction of `Graph`.
        self.g
            .value_type(self.n.inputs[i])
            .expect("graph invariant: inputs name existing outputs")
    }

    /// Checks the rank, symbols and largest byte count of every output in `outputs`
    /// (the node's). An output whose type is `last` (found well formed before, under
    /// the same symbols) is well formed without them; `last` becomes the last output
    /// found well formed.
    fn outputs_well_formed<'o>(
        &mut self,
        outputs: &'o [TensorType],
        last: &mut Option<&'o TensorType>,
    ) {
        for (k, t) in outputs.iter().enumerate() {
            if *last == Some(t) {
                continue;
            }
            if t.shape.rank() > MAX_RANK {
                self.err(
                    ProblemKind::Limit,
                    format!("output {k} has rank {} (limit {MAX_RANK})", t.shape.rank()),
                );
                continue;
            }
            let mut ok = true;
            for d in t.shape.dims() {
                for s in d.symbols() {
                    match self.g.symbols().get(s) {
                        None => {
                            self.err(
                                ProblemKind::Symbol,
                                format!("output {k} uses symbol {s:?}, which is not declared in \"symbols\""),
                            );
                            ok = false;
                        }
                        // Refused once at the symbol; its byte counts are not checked.
                        Some(r) if r.max > MAX_SYMBOL_VALUE => ok = false,
                        Some(_) => {}
                    }
                }
            }
            if !ok {
                continue;
            }
            if t.max_bytes(self.g.symbols()).is_none() {
                self.err(
                    ProblemKind::Overflow,
                    format!(
                        "output {k} ({t}) has a largest byte count that overflows u64 at the symbols' maxima"
                    ),
                );
                continue;
            }
            *last = Some(t);
        }
    }

    fn arity(&mut self, inputs: &[usize], outputs: usize) -> bool {
        let ni = self.n.inputs.len();
        let no = self.n.outputs.len();
        let mut ok = true;
        if !inputs.contains(&ni) {
            self.err(
                ProblemKind::Arity,
                format!(
                    "{} takes {} input(s), got {ni}",
                    self.n.op.name(),
                    fmt_counts(inputs)
                ),
            );
            ok = false;
        }
        if no != outputs {
            self.err(
                ProblemKind::Arity,
                format!(
                    "{} has {outputs} output(s), {no} declared",
                    self.n.op.name()
                ),
            );
            ok = false;
        }
        ok
    }

    fn expect_output(&mut self, k: usize, want: &TensorType) {
        self.expect_output_of(k, want.dtype, &want.shape);
    }

    /// Output `k` must be of `dtype` and `shape` (no type to build for the check).
    fn expect_output_of(&mut self, k: usize, dtype: DType, shape: &Shape) {
        let got = &self.n.outputs[k];
        if got.dtype != dtype {
            self.err(
                ProblemKind::DType,
                format!(
                    "output {k} is declared {}, the op produces {dtype}",
                    got.dtype
                ),
            );
        }
        if got.shape != *shape {
            self.err(
                ProblemKind::Shape,
                format!(
                    "output {k} is declared {}, the op produces {shape}",
                    got.shape
                ),
            );
        }
    }

    fn float_input(&mut self, i: usize) -> bool {
        let t = self.input(i).dtype;
        if !t.is_float() {
            self.err(
                ProblemKind::DType,
                format!("input {i} is {t}; bf16, f16 or f32 expected"),
            );
            return false;
        }
        true
    }

    fn finite_attr(&mut self, name: &str, v: f64) {
        if !v.is_finite() {
            self.err(
                ProblemKind::Attribute,
                format!("{name} must be finite, got {v}"),
            );
        }
    }

    fn eps(&mut self, eps: f64, weight_bias: f64) {
        // Real epsilons are 1e-5 or 1e-6; 1 or more would swamp mean(x^2) for any
        // normalised activation.
        if !valid_eps(eps) {
            self.err(
                ProblemKind::Attribute,
                format!(
                    "eps must be finite and in (0, 1), non-zero in f32 (models use 1e-5 or \
                     1e-6), got {eps}"
                ),
            );
        }
        self.finite_attr("weight_bias", weight_bias);
    }

    /// The hidden size of input `i` (its last dim, constant), with a problem if absent.
    fn hidden(&mut self, i: usize) -> Option<u64> {
        let t = self.input(i);
        match t.shape.last().and_then(Dim::as_const) {
            Some(h) if h > 0 => Some(h),
            _ => {
                self.err(
                    ProblemKind::Shape,
                    format!("input {i} ({t}) needs a constant, non-zero last (hidden) dim"),
                );
                None
            }
        }
    }

    fn weight(&mut self, i: usize, h: u64, x_dtype: DType, weight_bias: f64) {
        let w = self.input(i);
        if w.shape.dims() != [dim(h)] {
            self.err(
                ProblemKind::Shape,
                format!("weight (input {i}) is {}, expected [{h}]", w.shape),
            );
        }
        if !w.dtype.is_float() {
            self.err(
                ProblemKind::DType,
                format!("weight (input {i}) is {}", w.dtype),
            );
        } else if w.dtype != x_dtype && weight_bias == 0.0 && w.dtype != DType::F32 {
            self.err(
                ProblemKind::DType,
                format!(
                    "weight (input {i}) is {}, the activation is {x_dtype}",
                    w.dtype
                ),
            );
        }
    }

    fn scalar_f32(&mut self, i: usize, what: &str) {
        let t = self.input(i);
        let ok_shape = t.shape.rank() == 0 || t.shape.dims() == [dim(1)];
        if t.dtype != DType::F32 || !ok_shape {
            self.err(
                ProblemKind::Shape,
                format!("{what} (input {i}) is {t}, expected f32[1] or f32[]"),
            );
        }
    }

    /// Shape with the last dim replaced.
    fn with_last(s: &Shape, last: u64) -> Shape {
        let mut d = s.0.clone();
        if let Some(l) = d.last_mut() {
            *l = dim(last);
        }
        Shape(d)
    }

    /// Output types of a quant epilogue on an activation `x` of hidden size `h`.
    fn quant_outputs(
        &mut self,
        x: &TensorType,
        h: u64,
        q: FusedQuant,
    ) -> Option<(TensorType, Option<TensorType>)> {
        let fp8 = |s: Shape| TensorType {
            dtype: DType::Fp8E4m3,
            shape: s,
        };
        match q {
            FusedQuant::None => None,
            FusedQuant::Fp8Static => Some((fp8(x.shape.clone()), None)),
            FusedQuant::Fp8PerToken => Some((
                fp8(x.shape.clone()),
                Some(TensorType {
                    dtype: DType::F32,
                    shape: Self::with_last(&x.shape, 1),
                }),
            )),
            FusedQuant::Fp8PerTokenGroup {
                group_size,
                scale_layout,
            } => {
                if group_size == 0 || h % group_size != 0 {
                    self.err(
                        ProblemKind::Attribute,
                        format!("group_size {group_size} does not divide the hidden size {h}"),
                    );
                    return None;
                }
                let groups = h / group_size;
                let scale = match scale_layout {
                    GroupScaleLayout::F32RowMajor | GroupScaleLayout::F32RowMajorUe8m0 => {
                        TensorType {
                            dtype: DType::F32,
                            shape: Self::with_last(&x.shape, groups),
                        }
                    }
                    GroupScaleLayout::PackedUe8m0 => TensorType {
                        dtype: DType::I32,
                        shape: Self::with_last(&x.shape, groups.div_ceil(4)),
                    },
                };
                Some((fp8(x.shape.clone()), Some(scale)))
            }
            FusedQuant::Nvfp4 { .. } => {
                if h % NVFP4_BLOCK != 0 {
                    self.err(
                        ProblemKind::Attribute,
                        format!(
                            "hidden size {h} is not a multiple of the NVFP4 block ({NVFP4_BLOCK})"
                        ),
                    );
                    return None;
                }
                Some((
                    TensorType {
                        dtype: DType::Fp4E2m1x2,
                        shape: Self::with_last(&x.shape, h / 2),
                    },
                    Some(TensorType {
                        dtype: DType::Fp8E4m3,
                        shape: Self::with_last(&x.shape, h / NVFP4_BLOCK),
                    }),
                ))
            }
        }
    }

    fn op(&mut self) {
        let n = self.n;
        match &n.op {
            Op::Input { .. } => {
                self.arity(&[0], 1);
            }
            Op::Constant { value } => {
                if self.arity(&[0], 1) {
                    self.finite_attr("value", *value);
                    let t = &n.outputs[0];
                    if t.shape.rank() != 0 || !t.dtype.is_float() {
                        self.err(
                            ProblemKind::Shape,
                            format!("a constant is a float scalar ([]), declared {t}"),
                        );
                    }
                }
            }
            Op::AllReduce { group, .. } => {
                if group.trim().is_empty() {
                    self.err(
                        ProblemKind::Attribute,
                        "all_reduce needs a non-empty process group",
                    );
                }
                if self.arity(&[1], 1) {
                    self.float_input(0);
                    let want = self.input(0);
                    self.expect_output(0, want);
                }
            }
            Op::Add | Op::Mul => {
                if self.arity(&[2], 1) {
                    let (a, b) = (self.input(0), self.input(1));
                    if a.dtype != b.dtype {
                        self.err(
                            ProblemKind::DType,
                            format!(
                                "{} of {} and {}: operands must have one dtype (insert to_dtype)",
                                n.op.name(),
                                a.dtype,
                                b.dtype
                            ),
                        );
                        return;
                    }
                    let got = &n.outputs[0];
                    if got.dtype == a.dtype && broadcasts_to(&a.shape, &b.shape, &got.shape) {
                        return;
                    }
                    match broadcast(&a.shape, &b.shape) {
                        Some(s) => self.expect_output(
                            0,
                            &TensorType {
                                dtype: a.dtype,
                                shape: s,
                            },
                        ),
                        None => self.err(
                            ProblemKind::Shape,
                            format!(
                                "{} of {} and {}: shapes do not broadcast",
                                n.op.name(),
                                a.shape,
                                b.shape
                            ),
                        ),
                    }
                }
            }
            Op::ToDtype { dtype } => {
                if self.arity(&[1], 1) {
                    let x = self.input(0);
                    self.expect_output_of(0, *dtype, &x.shape);
                }
            }
            Op::Pow { exponent } => {
                self.finite_attr("exponent", *exponent);
                if self.arity(&[1], 1) && self.float_input(0) {
                    let want = self.input(0);
                    self.expect_output(0, want);
                }
            }
            Op::Rsqrt => {
                if self.arity(&[1], 1) && self.float_input(0) {
                    let want = self.input(0);
                    self.expect_output(0, want);
                }
            }
            Op::Mean { dims, keepdim } => {
                if self.arity(&[1], 1) && self.float_input(0) {
                    let x = self.input(0);
                    let rank = x.shape.rank() as i64;
                    let mut reduced = vec![false; x.shape.rank()];
                    for &d in dims {
                        let k = if d < 0 { d + rank } else { d };
                        if k < 0 || k >= rank {
                            self.err(
                                ProblemKind::Attribute,
                                format!("mean dim {d} is out of range for rank {rank}"),
                            );
                            return;
                        }
                        reduced[k as usize] = true;
                    }
                    // The expected dims, compared in place (built only for a message).
                    let one = dim(1);
                    let want = x.shape.dims().iter().enumerate().filter_map(|(i, d)| {
                        if !reduced[i] {
                            Some(d)
                        } else {
                            keepdim.then_some(&one)
                        }
                    });
                    let got = &n.outputs[0];
                    if got.dtype != x.dtype || !want.clone().eq(got.shape.dims().iter()) {
                        let shape = Shape(want.cloned().collect());
                        self.expect_output_of(0, x.dtype, &shape);
                    }
                }
            }
            Op::Reshape => {
                if self.arity(&[1], 1) {
                    let x = self.input(0);
                    let y = &n.outputs[0];
                    if x.dtype != y.dtype {
                        self.err(
                            ProblemKind::DType,
                            format!(
                                "reshape keeps the dtype: input {}, output {}",
                                x.dtype, y.dtype
                            ),
                        );
                    }
                    if x.shape.numel() != y.shape.numel() {
                        self.err(
                            ProblemKind::Shape,
                            format!(
                                "reshape from {} to {} changes the element count",
                                x.shape, y.shape
                            ),
                        );
                    }
                }
            }
            Op::RmsNorm {
                eps, weight_bias, ..
            } => {
                self.eps(*eps, *weight_bias);
                if self.arity(&[2], 1) && self.float_input(0) {
                    let x = self.input(0);
                    if let Some(h) = self.hidden(0) {
                        self.weight(1, h, x.dtype, *weight_bias);
                    }
                    self.expect_output(0, x);
                }
            }
            Op::FusedAddRmsNorm {
                eps, weight_bias, ..
            } => {
                self.eps(*eps, *weight_bias);
                if self.arity(&[3], 2) && self.float_input(0) {
                    let x = self.input(0);
                    self.residual_matches(1, x);
                    if let Some(h) = self.hidden(0) {
                        self.weight(2, h, x.dtype, *weight_bias);
                    }
                    self.expect_output(0, x);
                    self.expect_output(1, x);
                }
            }
            Op::QuantFp8Static => self.quant_op(&[2], FusedQuant::Fp8Static),
            Op::QuantFp8PerToken => self.quant_op(&[1], FusedQuant::Fp8PerToken),
            Op::QuantFp8PerTokenGroup {
                group_size,
                scale_layout,
            } => self.quant_op(
                &[1],
                FusedQuant::Fp8PerTokenGroup {
                    group_size: *group_size,
                    scale_layout: *scale_layout,
                },
            ),
            Op::QuantNvfp4 { scale_layout } => self.quant_op(
                &[2],
                FusedQuant::Nvfp4 {
                    scale_layout: *scale_layout,
                },
            ),
            Op::Matmul { transpose_b } => {
                if self.arity(&[2], 1) && self.float_input(0) {
                    let (x, w) = (self.input(0), self.input(1));
                    if w.shape.rank() != 2 || x.shape.rank() == 0 {
                        self.err(
                            ProblemKind::Shape,
                            format!(
                                "matmul of {} by {}: x needs rank >= 1, w rank 2",
                                x.shape, w.shape
                            ),
                        );
                        return;
                    }
                    let (k, nn) = if *transpose_b {
                        (&w.shape.0[1], &w.shape.0[0])
                    } else {
                        (&w.shape.0[0], &w.shape.0[1])
                    };
                    if x.shape.last() != Some(k) {
                        self.err(
                            ProblemKind::Shape,
                            format!("matmul of {} by {}: inner dims differ", x.shape, w.shape),
                        );
                        return;
                    }
                    if x.dtype != w.dtype {
                        self.err(
                            ProblemKind::DType,
                            format!("matmul of {} by {}", x.dtype, w.dtype),
                        );
                    }
                    let mut s = x.shape.0.clone();
                    if let Some(l) = s.last_mut() {
                        *l = nn.clone();
                    }
                    self.expect_output(
                        0,
                        &TensorType {
                            dtype: x.dtype,
                            shape: Shape(s),
                        },
                    );
                }
            }
            Op::Embedding => {
                if self.arity(&[2], 1) {
                    let (t, ids) = (self.input(0), self.input(1));
                    if t.shape.rank() != 2 || !t.dtype.is_float() {
                        self.err(
                            ProblemKind::Shape,
                            format!("embedding table must be a float [V, H], got {t}"),
                        );
                        return;
                    }
                    if !ids.dtype.is_index() {
                        self.err(
                            ProblemKind::DType,
                            format!("embedding ids must be i32 or i64, got {}", ids.dtype),
                        );
                    }
                    let mut s = ids.shape.0.clone();
                    s.push(t.shape.0[1].clone());
                    self.expect_output(
                        0,
                        &TensorType {
                            dtype: t.dtype,
                            shape: Shape(s),
                        },
                    );
                }
            }
            Op::Opaque { target, .. } => {
                if target.is_empty() {
                    self.err(
                        ProblemKind::Attribute,
                        "opaque op needs its original name in \"target\"",
                    );
                }
            }
            Op::FusedAllreduceNorm(f) => self.fused(f),
        }
    }

    fn quant_op(&mut self, inputs: &[usize], q: FusedQuant) {
        let outs = if matches!(q, FusedQuant::Fp8Static) {
            1
        } else {
            2
        };
        if !self.arity(inputs, outs) || !self.float_input(0) {
            return;
        }
        let x = self.input(0);
        if inputs[0] == 2 {
            self.scalar_f32(1, "scale");
        }
        let Some(h) = self.hidden(0) else { return };
        if let Some((q, s)) = self.quant_outputs(x, h, q) {
            self.expect_output(0, &q);
            if let Some(s) = s {
                self.expect_output(1, &s);
            }
        }
    }

    fn fused(&mut self, f: &crate::op::FusedAllReduceNorm) {
        if f.group.trim().is_empty() {
            self.err(
                ProblemKind::Attribute,
                "fused_allreduce_norm needs a non-empty process group",
            );
        }
        self.eps(f.eps, f.weight_bias);
        if f.norm_input == crate::op::NormInput::F32Sum && !f.residual {
            self.err(
                ProblemKind::Attribute,
                "norm_input = f32_sum normalises the sum of the all-reduce output and the \
                 residual; it needs residual = true",
            );
        }
        let mut seen = std::collections::BTreeSet::new();
        for o in &f.outputs {
            if !seen.insert(*o) {
                self.err(
                    ProblemKind::Attribute,
                    format!("output {o:?} is listed twice"),
                );
            }
        }
        let has_quant = !matches!(f.quant, FusedQuant::None);
        for o in &f.outputs {
            let bad = match o {
                FusedOutput::Residual => false,
                FusedOutput::Quant => !has_quant,
                FusedOutput::Scale => !has_quant || matches!(f.quant, FusedQuant::Fp8Static),
                FusedOutput::Norm => false,
            };
            if bad {
                self.err(
                    ProblemKind::Attribute,
                    format!("output {o:?} does not exist for quant {:?}", f.quant),
                );
            }
        }
        if f.outputs.is_empty() {
            self.err(
                ProblemKind::Attribute,
                "a fused node must write at least one output",
            );
        }
        let extra = usize::from(matches!(
            f.quant,
            FusedQuant::Fp8Static | FusedQuant::Nvfp4 { .. }
        ));
        let n_in = 2 + usize::from(f.residual) + extra;
        if !self.arity(&[n_in], f.outputs.len()) || !self.float_input(0) {
            return;
        }
        let x = self.input(0);
        if f.residual {
            self.residual_matches(1, x);
        }
        let w = 1 + usize::from(f.residual);
        let Some(h) = self.hidden(0) else { return };
        self.weight(w, h, x.dtype, f.weight_bias);
        if extra == 1 {
            self.scalar_f32(w + 1, "scale");
        }
        if let Some(plan) = &f.plan {
            self.plan(plan, h, x.dtype);
        }
        let quant = self.quant_outputs(x, h, f.quant);
        for (k, o) in f.outputs.iter().enumerate() {
            let want = match o {
                FusedOutput::Norm | FusedOutput::Residual => Some(x),
                FusedOutput::Quant => quant.as_ref().map(|q| &q.0),
                FusedOutput::Scale => quant.as_ref().and_then(|q| q.1.as_ref()),
            };
            if let Some(want) = want {
                self.expect_output(k, want);
            }
        }
    }
}

impl<'a> Checker<'a> {
    /// A plan carried by a fused node is never trusted as written: its workspace must
    /// be sound and belong to the node (dtype, a hidden size at least the node's, the
    /// graph's recorded world size), its dispatch must cover 1..=N without gaps or
    /// overlaps, and every fused range must stay within `max_token_num`, run where the
    /// workspace's capacity rule ([`arfuse_policy::Workspace::misfit`], the one the
    /// planner and the runtime use) admits it at both ends, and state exactly the bytes
    /// its largest T needs.
    fn plan(&mut self, plan: &crate::op::FusedPlan, h: u64, dtype: DType) {
        let ws = &plan.workspace;
        self.plan_workspace(ws, h, dtype);
        let mut next = 1u64;
        if plan.dispatch.is_empty() {
            self.err(ProblemKind::Attribute, "plan: the dispatch is empty");
        }
        for (k, r) in plan.dispatch.iter().enumerate() {
            let at = || {
                format!(
                    "plan: dispatch[{k}] (T={}..={})",
                    r.min_tokens, r.max_tokens
                )
            };
            if r.min_tokens != next || r.max_tokens < r.min_tokens {
                self.err(
                    ProblemKind::Attribute,
                    format!("{}: ranges must be ordered and cover every T from 1 without gaps; expected a range starting at T={next}", at()),
                );
                return;
            }
            next = match r.max_tokens.checked_add(1) {
                Some(n) => n,
                None => return,
            };
            if r.strategy != crate::op::Strategy::Unfused {
                self.plan_fused_range(plan, r, &at, h);
            }
        }
    }

    fn plan_workspace(&mut self, ws: &arfuse_policy::Workspace, h: u64, dtype: DType) {
        for problem in ws.problems() {
            self.err(
                ProblemKind::Attribute,
                format!("plan: workspace: {problem}"),
            );
        }
        if dtype.activation() != Some(ws.dtype) {
            self.err(
                ProblemKind::Attribute,
                format!(
                    "plan: the workspace is for {} activations, the node's are {dtype}",
                    ws.dtype
                ),
            );
        }
        if ws.hidden < h {
            self.err(
                ProblemKind::Attribute,
                format!(
                    "plan: the workspace is sized for H={}, the node has H={h}",
                    ws.hidden
                ),
            );
        }
        if let Some(w) = self.g.recorded_world_size() {
            if w != u64::from(ws.world_size) {
                self.err(
                    ProblemKind::Attribute,
                    format!(
                        "plan: the workspace is for W={} but the graph records world size {w}",
                        ws.world_size
                    ),
                );
            }
        }
    }

    fn plan_fused_range(
        &mut self,
        plan: &crate::op::FusedPlan,
        r: &crate::op::DispatchRange,
        at: &dyn Fn() -> String,
        h: u64,
    ) {
        let ws = &plan.workspace;
        let s = r.strategy;
        if r.max_tokens > plan.max_token_num {
            self.err(
                ProblemKind::Attribute,
                format!("{}: fused above max_token_num {}", at(), plan.max_token_num),
            );
        }
        // The rule is monotone in T: T >= W is decided at the first T of the range,
        // the bytes at its last.
        for t in [r.min_tokens, r.max_tokens] {
            match ws.misfit(s, t, h) {
                Ok(None) => {}
                Ok(Some(arfuse_policy::Misfit::BelowWorldSize { world_size })) => self.err(
                    ProblemKind::Attribute,
                    format!("{}: {s} needs T >= W = {world_size}, T={t}", at()),
                ),
                Ok(Some(arfuse_policy::Misfit::TooLarge {
                    required_bytes,
                    available_bytes,
                })) => self.err(
                    ProblemKind::Attribute,
                    format!(
                        "{}: {s} at T={t} needs {required_bytes} bytes, its buffer holds {available_bytes}",
                        at()
                    ),
                ),
                Err(e) => self.err(ProblemKind::Overflow, format!("{}: {e}", at())),
            }
        }
        match ws.required_bytes(s, r.max_tokens, h) {
            Ok(need) if need == r.required_bytes => {}
            Ok(need) => self.err(
                ProblemKind::Attribute,
                format!(
                    "{}: states {} bytes, but {s} at T={} needs {need}",
                    at(),
                    r.required_bytes,
                    r.max_tokens
                ),
            ),
            Err(e) => self.err(ProblemKind::Overflow, format!("{}: {e}", at())),
        }
    }
}

fn fmt_counts(c: &[usize]) -> String {
    c.iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join(" or ")
}

/// NumPy-style broadcast of two shapes: dims align from the right and must be equal
/// or a constant 1.
pub fn broadcast(a: &Shape, b: &Shape) -> Option<Shape> {
    let n = a.rank().max(b.rank());
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        out.push(broadcast_dim(a, b, n, i)?.clone());
    }
    Some(Shape(out))
}

/// Whether [`broadcast`] of `a` and `b` is `out`, without building it.
pub fn broadcasts_to(a: &Shape, b: &Shape, out: &Shape) -> bool {
    let n = a.rank().max(b.rank());
    out.rank() == n && (0..n).all(|i| broadcast_dim(a, b, n, i) == Some(&out.0[i]))
}

/// Dim `i` of the broadcast of `a` and `b` (rank `n`), or `None` when they do not
/// broadcast there.
fn broadcast_dim<'s>(a: &'s Shape, b: &'s Shape, n: usize, i: usize) -> Option<&'s Dim> {
    let da = (i + a.rank()).checked_sub(n).map(|k| &a.0[k]);
    let db = (i + b.rank()).checked_sub(n).map(|k| &b.0[k]);
    match (da, db) {
        (Some(x), None) | (None, Some(x)) => Some(x),
        (Some(x), Some(y)) if x == y => Some(x),
        (Some(x), Some(y)) if x.as_const() == Some(1) => Some(y),
        (Some(x), Some(y)) if y.as_const() == Some(1) => Some(x),
        _ => None,
    }
}
