//! Operations and their attributes.
//!
//! In JSON a node names its op (`"op": "rms_norm"`) and gives the attributes in an
//! `"attrs"` object. Attributes with a default may be left out; unknown attributes are
//! an error (a matcher that silently ignores a new argument is a known failure class,
//! domain.md section 2).
//!
//! Input and output conventions (`x` is an activation `[..., H]`, leading dims are tokens):
//!
//! | op | inputs | outputs |
//! |---|---|---|
//! | `input` | - | 1 (declared) |
//! | `constant` | - | 1 scalar `[]` float |
//! | `all_reduce` | x | x's type |
//! | `add`, `mul` | a, b (same dtype, broadcast) | broadcast type |
//! | `to_dtype` | x | x's shape, `dtype` |
//! | `pow`, `rsqrt` | x (float) | x's type |
//! | `mean` | x (float) | x with `dims` reduced (kept as 1 when `keepdim`) |
//! | `reshape` | x | declared shape, same element count and dtype |
//! | `rms_norm` | x, weight `[H]` | x's type |
//! | `fused_add_rms_norm` | x, residual, weight `[H]` | normed, residual_out (x's type) |
//! | `quant_fp8_static` | x, scale f32 `[1]` or `[]` | fp8_e4m3 `[..., H]` |
//! | `quant_fp8_per_token` | x | fp8_e4m3 `[..., H]`, f32 scales `[..., 1]` |
//! | `quant_fp8_per_token_group` | x | fp8_e4m3 `[..., H]`, scales (see [`GroupScaleLayout`]) |
//! | `quant_nvfp4` | x, global_scale f32 `[1]` or `[]` | fp4_e2m1x2 `[..., H/2]`, fp8_e4m3 scales `[..., H/16]` |
//! | `matmul` | x `[..., K]`, w `[K, N]` (`[N, K]` when `transpose_b`) | x's dtype `[..., N]` |
//! | `embedding` | table `[V, H]`, ids (i32/i64) `[...]` | table dtype `[..., H]` |
//! | `opaque` | any | any (declared) |
//! | `fused_allreduce_norm` | see [`FusedAllReduceNorm`] | see [`FusedAllReduceNorm`] |
//!
//! Scale outputs are typed by their logical shape; the physical layout (padding,
//! swizzling) follows the layout attribute and is computed by `arfuse-reference`. A
//! buffer sized from the type alone (elements x dtype bytes) is too small for packed
//! UE8M0 and swizzled NVFP4 scales (at T = 1, H = 14336 swizzled NVFP4 needs 114,688
//! bytes, the type says 896: domain.md section 1); every allocation in arfuse sizes
//! scales with `arfuse_reference::numerics::quant` (`group_scale_bytes`,
//! `nvfp4_scale_bytes`).

use crate::DType;
use serde::{Deserialize, Serialize};

/// What a graph input holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputKind {
    /// Per-call data that differs across ranks (token ids, hidden states).
    #[default]
    Activation,
    /// Weights, identical on every rank of the group unless sharded.
    Parameter,
    /// Persistent non-trainable state.
    Buffer,
}

/// The reduction of a collective. Only `sum` exists today; the field keeps the format
/// honest when others arrive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReduceOp {
    /// Element-wise sum over the ranks of the group.
    #[default]
    Sum,
}

/// Scale form of per-token-group FP8 quantisation (domain.md section 1): the ABI's one
/// definition (`arfuse_abi::GroupScaleLayout`), which the reference, the rewrite and the
/// runtime all use.
pub use arfuse_abi::GroupScaleLayout;

/// Scale layout of NVFP4 quantisation (domain.md section 1): the ABI's one definition.
pub use arfuse_abi::Nvfp4ScaleLayout;

/// The quantisation epilogue of a fused node, as the graph spells it: the kernels'
/// epilogue ([`arfuse_abi::Quant`], [`FusedQuant::kernel_quant`]) plus the graph's own
/// group size, which the kernels run only when it is theirs. The derived order
/// (declaration order, then the fields) is the rewrite's tie-break between quant kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FusedQuant {
    /// No quantisation.
    None,
    /// Static per-tensor FP8 (extra input: the fp32 dequant scale).
    Fp8Static,
    /// Dynamic per-token FP8 (extra output: fp32 scales `[..., 1]`).
    Fp8PerToken,
    /// Per-token-group FP8 (extra output: scales in `scale_layout`).
    Fp8PerTokenGroup {
        /// Elements per group (128 for DeepSeek-style block quant).
        group_size: u64,
        /// Scale layout.
        scale_layout: GroupScaleLayout,
    },
    /// NVFP4 (extra input: fp32 global scale; extra output: e4m3 block scales).
    Nvfp4 {
        /// Scale layout.
        scale_layout: Nvfp4ScaleLayout,
    },
}

impl FusedQuant {
    /// Whether the quant op takes a second input (static FP8 scale, NVFP4 global scale).
    pub const fn takes_scale_input(self) -> bool {
        matches!(self, FusedQuant::Fp8Static | FusedQuant::Nvfp4 { .. })
    }

    /// Whether the quant op writes a scales output.
    pub const fn writes_scales(self) -> bool {
        !matches!(self, FusedQuant::None | FusedQuant::Fp8Static)
    }

    /// Short name for reports and fused-node names (`none`, `fp8_static`,
    /// `fp8_per_token`, `fp8_per_token_group`, `nvfp4`).
    pub const fn name(self) -> &'static str {
        match self {
            FusedQuant::None => "none",
            FusedQuant::Fp8Static => "fp8_static",
            FusedQuant::Fp8PerToken => "fp8_per_token",
            FusedQuant::Fp8PerTokenGroup { .. } => "fp8_per_token_group",
            FusedQuant::Nvfp4 { .. } => "nvfp4",
        }
    }

    /// The kernels' epilogue for this quant, or why they have none: a per-token-group
    /// group size other than [`arfuse_abi::FP8_GROUP_SIZE`].
    pub fn kernel_quant(self) -> Result<arfuse_abi::Quant, String> {
        use arfuse_abi::Quant;
        Ok(match self {
            FusedQuant::None => Quant::None,
            FusedQuant::Fp8Static => Quant::Fp8Static,
            FusedQuant::Fp8PerToken => Quant::Fp8PerToken,
            FusedQuant::Fp8PerTokenGroup {
                group_size,
                scale_layout,
            } => {
                if group_size != arfuse_abi::FP8_GROUP_SIZE {
                    return Err(format!(
                        "the fused kernels quantise groups of {} elements, not {group_size}",
                        arfuse_abi::FP8_GROUP_SIZE
                    ));
                }
                Quant::Fp8Group(scale_layout)
            }
            FusedQuant::Nvfp4 { scale_layout } => Quant::Nvfp4(scale_layout),
        })
    }
}

impl From<arfuse_abi::Quant> for FusedQuant {
    /// The graph's spelling of a kernel epilogue (group forms with the kernels' group
    /// size).
    fn from(q: arfuse_abi::Quant) -> FusedQuant {
        use arfuse_abi::Quant;
        match q {
            Quant::None => FusedQuant::None,
            Quant::Fp8Static => FusedQuant::Fp8Static,
            Quant::Fp8PerToken => FusedQuant::Fp8PerToken,
            Quant::Fp8Group(scale_layout) => FusedQuant::Fp8PerTokenGroup {
                group_size: arfuse_abi::FP8_GROUP_SIZE,
                scale_layout,
            },
            Quant::Nvfp4(scale_layout) => FusedQuant::Nvfp4 { scale_layout },
        }
    }
}

/// Where a fused node's RMSNorm rounds to the activation dtype T (domain.md section 1:
/// the sources differ, and the graph a node replaces fixes which one it must follow).
///
/// With `h` the residual sum, `r = rsqrt(mean(h^2) + eps)` and `g` the weight (all in
/// f32):
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum NormRounding {
    /// `y = round_T((h * r) * (g + weight_bias))`: the weight applied in f32, one
    /// rounding (Gemma's `(x * (1 + w.float())).type_as(x)`, gpt-oss' and
    /// Nemotron-H's `(w * x_f32).to(T)`, FlashInfer's fused kernel).
    #[default]
    Once,
    /// `y = round_T(round_T(h * r) * (g + weight_bias))`: the normalised value rounded
    /// to T before the weight multiply (Hugging Face's Llama form
    /// `w * x_normed.to(T)`).
    Twice,
}

impl NormRounding {
    /// True for the default, [`NormRounding::Once`] (not written in JSON).
    pub fn is_once(&self) -> bool {
        *self == NormRounding::Once
    }

    /// The name as written in JSON and reports (`once`, `twice`).
    pub fn name(self) -> &'static str {
        match self {
            NormRounding::Once => "once",
            NormRounding::Twice => "twice",
        }
    }
}

/// What a fused node's RMSNorm normalises when it adds a residual (the sources differ:
/// the rewrite keeps the one its graph spells).
///
/// With `a` the all-reduce output (rounded to T) and `r` the residual, the new residual
/// `residual_out = round_T(f32(a) + f32(r))` either way.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum NormInput {
    /// The rounded residual `h = residual_out` (arfuse's contract clause 2, vLLM's CUDA
    /// `fused_add_rms_norm`, FlashInfer's fused kernel).
    #[default]
    Residual,
    /// The unrounded f32 sum `f32(a) + f32(r)` (vLLM's native `fused_add_rms_norm`,
    /// `vllm/ir/ops/layernorm.py`: `x = x.to(f32) + x_residual.to(f32)`, the residual
    /// rounded only for the output).
    F32Sum,
}

impl NormInput {
    /// True for the default, [`NormInput::Residual`] (not written in JSON).
    pub fn is_residual(&self) -> bool {
        *self == NormInput::Residual
    }

    /// The name as written in JSON and reports (`residual`, `f32_sum`).
    pub fn name(self) -> &'static str {
        match self {
            NormInput::Residual => "residual",
            NormInput::F32Sum => "f32_sum",
        }
    }
}

/// Op names (`opaque` targets) of the wait that follows a functional collective.
const WAIT_TARGETS: &[&str] = &["wait_tensor", "wait_tensor.default"];

/// Whether an `opaque` op target is the wait that follows a functional collective
/// (`wait_tensor`, matched by suffix so `torch.ops._c10d_functional.wait_tensor.default`
/// counts too). [`crate::Graph::is_forwarding_wait`] says when such a node forwards its
/// input.
pub fn is_wait_target(target: &str) -> bool {
    WAIT_TARGETS.iter().any(|w| {
        target == *w
            || target
                .strip_suffix(w)
                .is_some_and(|rest| rest.ends_with('.'))
    })
}

/// Whether an op target (as torch names it, with or without `torch.ops.`) looks like a
/// collective: any op of the `c10d`, `_c10d_functional` or `c10d_functional`
/// namespaces, or an op of another namespace whose name contains `all_reduce`,
/// `allreduce`, `all_gather`, `allgather`, `reduce_scatter`, `reducescatter`,
/// `all_to_all`, `alltoall`, `broadcast`, `collective` or `nccl` (case-insensitive).
/// `aten` and `prims` ops never do (`aten.broadcast_tensors` is not a collective).
///
/// Used to warn when such an op is kept opaque: the all-reduce sites it stands for are
/// then not seen.
pub fn looks_like_collective(target: &str) -> bool {
    let t = target.strip_prefix("torch.ops.").unwrap_or(target);
    // Without a copy for the common answers: no namespace, or aten / prims.
    let Some((namespace, _)) = t.split_once('.') else {
        return false;
    };
    let is = |name: &str| namespace.eq_ignore_ascii_case(name);
    if is("aten") || is("prims") {
        return false;
    }
    if is("c10d") || is("_c10d_functional") || is("c10d_functional") {
        return true;
    }
    let lower = t.to_ascii_lowercase();
    const FRAGMENTS: &[&str] = &[
        "all_reduce",
        "allreduce",
        "all_gather",
        "allgather",
        "reduce_scatter",
        "reducescatter",
        "all_to_all",
        "alltoall",
        "broadcast",
        "collective",
        "nccl",
    ];
    let rest = &lower[namespace.len()..];
    FRAGMENTS.iter().any(|f| rest.contains(f))
}

/// One output a fused node can write (domain.md section 1: write only live outputs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FusedOutput {
    /// The RMSNorm output, activation dtype.
    Norm,
    /// The new residual (all-reduce output plus residual), activation dtype.
    Residual,
    /// The quantised norm output.
    Quant,
    /// The quantisation scales.
    Scale,
}

/// Device algorithm of a fused node (domain.md section 3): the ABI's one definition.
pub use arfuse_abi::Backend;

/// How a given token count runs (domain.md section 4): the ABI's one definition,
/// serialized as `one_shot`, `two_shot` or `unfused`.
pub use arfuse_abi::Strategy;

/// Tokens `min_tokens..=max_tokens` run with `strategy`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DispatchRange {
    /// First token count, inclusive.
    pub min_tokens: u64,
    /// Last token count, inclusive.
    pub max_tokens: u64,
    /// The strategy.
    pub strategy: Strategy,
    /// Bytes of the buffer its strategy uses that the largest T of the range needs
    /// (one Lamport buffer; FlashInfer trtllm's two-shot: its comm buffer); 0 when
    /// unfused. Checked on load against the workspace's rule.
    #[serde(default)]
    pub required_bytes: u64,
}

impl From<&arfuse_policy::DispatchRange> for DispatchRange {
    /// The graph's form of a policy range (the one conversion): its tokens, strategy
    /// and the bytes its largest call needs; the reason and the buffer's size stay in
    /// the plan and the report.
    fn from(r: &arfuse_policy::DispatchRange) -> DispatchRange {
        DispatchRange {
            min_tokens: r.lo,
            max_tokens: r.hi,
            strategy: r.strategy,
            required_bytes: r.required_bytes_max,
        }
    }
}

/// The plan a fused node carries, written by the pass from `arfuse-policy`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FusedPlan {
    /// FlashInfer's pattern code for the fused kernel (domain.md section 1).
    pub pattern_code: u32,
    /// Largest token count that may be fused (M, tokens).
    pub max_token_num: u64,
    /// The workspace the dispatch was proven against, exactly as the kernels the plan
    /// names allocate it (kernels, backend, W, dtype, hidden size, buffer bytes per
    /// rank): the policy's [`arfuse_policy::Workspace`]. Shared by every fused node of
    /// the same group and dtype.
    pub workspace: arfuse_policy::Workspace,
    /// Strategy by token range, covering 1..=max batched tokens.
    pub dispatch: Vec<DispatchRange>,
}

impl FusedPlan {
    /// The device algorithm (the workspace's backend).
    pub fn backend(&self) -> Backend {
        self.workspace.backend
    }

    /// The kernels the plan is for.
    pub fn kernels(&self) -> arfuse_policy::KernelLibrary {
        self.workspace.kernels
    }
}

/// Attributes of the fused all-reduce + (residual add) + RMSNorm (+ quant) node.
///
/// Inputs, in order: `x` (the per-rank all-reduce input, `[..., H]`), `residual` (when
/// `residual` is true), `weight` (`[H]`, activation dtype, or f32 when `weight_bias` is 1),
/// then `scale` (f32 `[1]`) for static FP8 or `global_scale` (f32 `[1]`) for NVFP4.
///
/// Outputs: one per entry of `outputs`, in that order. `norm` and `residual` have x's
/// type; `quant` and `scale` have the types of the matching quant op's outputs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FusedAllReduceNorm {
    /// Process group of the all-reduce.
    pub group: String,
    /// RMSNorm epsilon (> 0).
    pub eps: f64,
    /// Added to the weight before scaling: 0, or 1 for Gemma-style offset weights.
    #[serde(default)]
    pub weight_bias: f64,
    /// Where the RMSNorm rounds to the activation dtype (default `once`, omitted from
    /// JSON when it is).
    #[serde(default, skip_serializing_if = "NormRounding::is_once")]
    pub norm_rounding: NormRounding,
    /// What the RMSNorm normalises when a residual is added (default `residual`, the
    /// rounded sum, omitted from JSON when it is); `f32_sum` needs `residual`.
    #[serde(default, skip_serializing_if = "NormInput::is_residual")]
    pub norm_input: NormInput,
    /// Whether a residual input is added after the all-reduce.
    pub residual: bool,
    /// Quantisation epilogue.
    pub quant: FusedQuant,
    /// The outputs written, in output order (no duplicates).
    pub outputs: Vec<FusedOutput>,
    /// The plan, when the pass has one.
    #[serde(default)]
    pub plan: Option<FusedPlan>,
}

/// An operation. See the module documentation for inputs and outputs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Op {
    /// A graph input: activation, parameter or buffer.
    Input {
        /// What it holds.
        #[serde(default)]
        kind: InputKind,
    },
    /// A scalar constant (`[]`), e.g. an RMSNorm eps in a decomposed norm.
    Constant {
        /// The value (finite).
        value: f64,
    },
    /// Sum over the ranks of `group`.
    AllReduce {
        /// Process-group name (non-empty).
        group: String,
        /// Reduction.
        #[serde(default)]
        reduce: ReduceOp,
    },
    /// Element-wise sum with broadcasting.
    Add,
    /// Element-wise product with broadcasting.
    Mul,
    /// Cast to `dtype`.
    ToDtype {
        /// Target element type.
        dtype: DType,
    },
    /// `x ^ exponent`.
    Pow {
        /// The exponent.
        exponent: f64,
    },
    /// Mean over `dims` (negative counts from the end).
    Mean {
        /// Reduced dimensions.
        dims: Vec<i64>,
        /// Keep reduced dims as size 1.
        #[serde(default)]
        keepdim: bool,
    },
    /// `1 / sqrt(x)`.
    Rsqrt,
    /// Reshape or view to the declared output shape.
    Reshape,
    /// RMSNorm over the last dim: `x * rsqrt(mean(x^2) + eps) * (weight + weight_bias)`,
    /// rounded to the activation dtype as `norm_rounding` says (default `once`).
    RmsNorm {
        /// Epsilon (> 0).
        eps: f64,
        /// 0, or 1 for offset (Gemma-style) weights.
        #[serde(default)]
        weight_bias: f64,
        /// Where the norm rounds to the activation dtype (omitted from JSON when `once`).
        #[serde(default, skip_serializing_if = "NormRounding::is_once")]
        norm_rounding: NormRounding,
    },
    /// `h = round(x + residual); (rms_norm(h), h)`: the norm of `h`, or of the unrounded
    /// f32 sum with `norm_input = f32_sum` (vLLM's native `fused_add_rms_norm`).
    FusedAddRmsNorm {
        /// Epsilon (> 0).
        eps: f64,
        /// 0, or 1 for offset weights.
        #[serde(default)]
        weight_bias: f64,
        /// Where the norm rounds to the activation dtype (omitted from JSON when `once`).
        #[serde(default, skip_serializing_if = "NormRounding::is_once")]
        norm_rounding: NormRounding,
        /// What the norm normalises (omitted from JSON when `residual`).
        #[serde(default, skip_serializing_if = "NormInput::is_residual")]
        norm_input: NormInput,
    },
    /// Static per-tensor FP8 quantisation.
    QuantFp8Static,
    /// Dynamic per-token FP8 quantisation.
    QuantFp8PerToken,
    /// Per-token-group FP8 quantisation.
    QuantFp8PerTokenGroup {
        /// Elements per group (must divide H).
        group_size: u64,
        /// Scale layout.
        scale_layout: GroupScaleLayout,
    },
    /// NVFP4 quantisation (blocks of 16).
    QuantNvfp4 {
        /// Scale layout.
        #[serde(default = "default_nvfp4_layout")]
        scale_layout: Nvfp4ScaleLayout,
    },
    /// Matrix product.
    Matmul {
        /// Whether `w` is stored `[N, K]` (a torch `linear` weight).
        #[serde(default)]
        transpose_b: bool,
    },
    /// Row lookup.
    Embedding,
    /// Any op arfuse does not model, kept with its original name and attributes.
    Opaque {
        /// The original op name (e.g. `aten.silu.default`).
        target: String,
        /// The original attributes, verbatim.
        #[serde(default)]
        attrs: serde_json::Value,
    },
    /// The fused all-reduce + residual add + RMSNorm (+ quant) node. Boxed: its plan
    /// is several times the size of every other op, and every node of a graph holds
    /// an `Op` (a pass over a graph's nodes reads half the bytes).
    FusedAllreduceNorm(Box<FusedAllReduceNorm>),
}

fn default_nvfp4_layout() -> Nvfp4ScaleLayout {
    Nvfp4ScaleLayout::Swizzled128x4
}

impl Op {
    /// The op's name as written in JSON (`"all_reduce"`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Constant { .. } => "constant",
            Op::AllReduce { .. } => "all_reduce",
            Op::Add => "add",
            Op::Mul => "mul",
            Op::ToDtype { .. } => "to_dtype",
            Op::Pow { .. } => "pow",
            Op::Mean { .. } => "mean",
            Op::Rsqrt => "rsqrt",
            Op::Reshape => "reshape",
            Op::RmsNorm { .. } => "rms_norm",
            Op::FusedAddRmsNorm { .. } => "fused_add_rms_norm",
            Op::QuantFp8Static => "quant_fp8_static",
            Op::QuantFp8PerToken => "quant_fp8_per_token",
            Op::QuantFp8PerTokenGroup { .. } => "quant_fp8_per_token_group",
            Op::QuantNvfp4 { .. } => "quant_nvfp4",
            Op::Matmul { .. } => "matmul",
            Op::Embedding => "embedding",
            Op::Opaque { .. } => "opaque",
            Op::FusedAllreduceNorm(_) => "fused_allreduce_norm",
        }
    }

    /// The attributes as a JSON object (empty for ops without attributes).
    pub fn attrs_json(&self) -> serde_json::Map<String, serde_json::Value> {
        // Serializing our own enum to a Value cannot fail: every field is a plain
        // number, string, bool, enum or nested struct (f64 NaN becomes null).
        match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(mut m)) => {
                m.remove("op");
                m
            }
            _ => serde_json::Map::new(),
        }
    }

    /// Parses an op from its name and attribute object. Unknown attributes, a
    /// missing required attribute or a wrong type give an error message.
    pub fn from_name_attrs(
        name: &str,
        attrs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Op, String> {
        Op::from_name_attrs_owned(name, attrs.clone())
    }

    /// As [`Op::from_name_attrs`], taking the attribute object by value.
    pub fn from_name_attrs_owned(
        name: &str,
        attrs: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Op, String> {
        if attrs.contains_key("op") {
            return Err("attribute named \"op\" is not allowed".into());
        }
        let keys: Vec<String> = attrs.keys().cloned().collect();
        let op = parse_op(name, attrs.clone()).map_err(|msg| attr_error(name, &attrs, msg))?;
        if keys.is_empty() {
            return Ok(op);
        }
        // Ops without attributes ignore extra keys while parsing (serde refuses unknown
        // keys of the others, and attr_error names them): every key is unknown there.
        // Ops with attributes are not compared with what they write back, which leaves
        // out defaults (an explicit `"norm_rounding": "once"` is valid).
        let known = op.attrs_json();
        if !known.is_empty() {
            return Ok(op);
        }
        let unknown: Vec<&str> = keys
            .iter()
            .filter(|k| !known.contains_key(*k))
            .map(String::as_str)
            .collect();
        if !unknown.is_empty() {
            let expected: Vec<&str> = known.keys().map(String::as_str).collect();
            return Err(unknown_attrs_message(name, &unknown, &expected));
        }
        Ok(op)
    }
    /// True for collectives (their identity matters: never merged or duplicated).
    pub fn is_collective(&self) -> bool {
        matches!(self, Op::AllReduce { .. } | Op::FusedAllreduceNorm(_))
    }
}

/// Parses `name` with `attrs`, giving serde's message on failure.
fn parse_op(name: &str, attrs: serde_json::Map<String, serde_json::Value>) -> Result<Op, String> {
    let mut obj = attrs;
    obj.insert("op".into(), serde_json::Value::String(name.to_string()));
    serde_json::from_value(serde_json::Value::Object(obj)).map_err(|e| e.to_string())
}

/// `unknown attribute(s) "epss" for op "rms_norm"; its attributes are eps, weight_bias,
/// norm_rounding`.
fn unknown_attrs_message(name: &str, unknown: &[&str], expected: &[&str]) -> String {
    let quoted: Vec<String> = unknown.iter().map(|k| format!("{k:?}")).collect();
    let known = if expected.is_empty() {
        "it takes none".to_string()
    } else {
        format!("its attributes are {}", expected.join(", "))
    };
    format!(
        "unknown attribute{} {} for op {name:?}; {known}",
        if unknown.len() == 1 { "" } else { "s" },
        quoted.join(", ")
    )
}

/// The attribute names in serde's "expected `a`, `b`" / "expected one of `a`, `b`" tail.
fn backticked(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// serde's message for a failed op parse, rewritten to name the op, the attribute and
/// (for an unknown one) every attribute the op takes.
fn attr_error(
    name: &str,
    attrs: &serde_json::Map<String, serde_json::Value>,
    msg: String,
) -> String {
    // Only an unknown op name is "unknown op"; an unknown attribute value (a misspelt
    // scale layout) keeps serde's message, which names it.
    if msg.starts_with(&format!("unknown variant `{name}`")) {
        return format!(
            "unknown op {name:?}; use \"opaque\" with a \"target\" for ops arfuse does not model"
        );
    }
    if let Some(rest) = msg.strip_prefix("unknown field `") {
        // "unknown field `epss`, expected `eps` or `weight_bias`": serde names the first
        // unknown key; every key the op does not take is listed.
        let expected = match rest.split_once(", expected ") {
            Some((_, tail)) => backticked(tail),
            None => Vec::new(), // "there are no fields"
        };
        let unknown: Vec<&str> = attrs
            .keys()
            .map(String::as_str)
            .filter(|k| !expected.contains(k))
            .collect();
        return unknown_attrs_message(name, &unknown, &expected);
    }
    if let Some(field) = msg.strip_prefix("missing field ") {
        return format!("op {name:?} needs attribute {field}");
    }
    // A value of the wrong type or out of range: serde does not say which attribute;
    // it is the one whose removal changes the error.
    let culprit = attrs.keys().find(|k| {
        let mut without = attrs.clone();
        without.remove(*k);
        parse_op(name, without).err().as_deref() != Some(msg.as_str())
    });
    match culprit {
        Some(k) => format!("attribute {k:?} of op {name:?}: {msg}"),
        None => msg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn attribute_errors_name_the_attribute_and_the_expected_ones() {
        let err =
            |name: &str, v: serde_json::Value| Op::from_name_attrs(name, &obj(v)).unwrap_err();
        assert_eq!(
            err("rms_norm", json!({"epss": 1e-6})),
            "unknown attribute \"epss\" for op \"rms_norm\"; its attributes are eps, weight_bias, \
             norm_rounding"
        );
        assert_eq!(
            err("rms_norm", json!({"eps": 1e-6, "foo": 1, "bar": 2})),
            "unknown attributes \"bar\", \"foo\" for op \"rms_norm\"; its attributes are eps, \
             weight_bias, norm_rounding"
        );
        assert_eq!(
            err("add", json!({"alpha": 1})),
            "unknown attribute \"alpha\" for op \"add\"; it takes none"
        );
        assert_eq!(
            err(
                "quant_fp8_per_token_group",
                json!({"group_size": 1.5, "scale_layout": "f32_row_major"})
            ),
            "attribute \"group_size\" of op \"quant_fp8_per_token_group\": invalid type: \
             floating point `1.5`, expected u64"
        );
        assert_eq!(
            err("rms_norm", json!({"eps": "small"})),
            "attribute \"eps\" of op \"rms_norm\": invalid type: string \"small\", expected f64"
        );
    }

    fn obj(v: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn parses_with_defaults_and_rejects_unknown_attrs() {
        let op = Op::from_name_attrs("rms_norm", &obj(json!({"eps": 1e-6}))).unwrap();
        assert_eq!(
            op,
            Op::RmsNorm {
                eps: 1e-6,
                weight_bias: 0.0,
                norm_rounding: Default::default(),
            }
        );
        let err =
            Op::from_name_attrs("rms_norm", &obj(json!({"eps": 1e-6, "foo": 1}))).unwrap_err();
        assert!(err.contains("foo"), "{err}");
        let err = Op::from_name_attrs("all_reduce", &obj(json!({}))).unwrap_err();
        assert!(err.contains("group"), "{err}");
        let err = Op::from_name_attrs("frobnicate", &obj(json!({}))).unwrap_err();
        assert!(err.contains("opaque"), "{err}");
        assert_eq!(
            Op::from_name_attrs("add", &obj(json!({}))).unwrap(),
            Op::Add
        );
    }

    #[test]
    fn collective_names() {
        for yes in [
            "c10d.allreduce_.default",
            "torch.ops._c10d_functional.all_gather_into_tensor.default",
            "vllm.all_reduce.default",
            "sglang.custom_allreduce",
            "trtllm.allreduce.default",
            "my_ext.nccl_allgather",
            "_c10d_functional.wait_tensor.default",
        ] {
            assert!(looks_like_collective(yes), "{yes}");
        }
        for no in [
            "aten.broadcast_tensors.default",
            "prims.broadcast_in_dim.default",
            "aten.add.Tensor",
            "vllm.rms_norm.default",
            "all_reduce",
        ] {
            assert!(!looks_like_collective(no), "{no}");
        }
    }

    #[test]
    fn norm_rounding_defaults_to_once_and_is_omitted() {
        let attrs = json!({"group": "tp", "eps": 1e-6, "residual": true,
                           "quant": {"kind": "none"}, "outputs": ["norm"]});
        let op = Op::from_name_attrs("fused_allreduce_norm", &obj(attrs.clone())).unwrap();
        let Op::FusedAllreduceNorm(f) = &op else {
            panic!("{op:?}")
        };
        assert_eq!(f.norm_rounding, NormRounding::Once);
        assert!(!op.attrs_json().contains_key("norm_rounding"));
        // Written out, the default is accepted too.
        let mut once = attrs.clone();
        once["norm_rounding"] = json!("once");
        let explicit = Op::from_name_attrs("fused_allreduce_norm", &obj(once)).unwrap();
        assert_eq!(explicit, op);
        let mut twice = attrs;
        twice["norm_rounding"] = json!("twice");
        let op = Op::from_name_attrs("fused_allreduce_norm", &obj(twice)).unwrap();
        assert_eq!(op.attrs_json()["norm_rounding"], "twice");
    }

    #[test]
    fn attrs_round_trip() {
        for scale_layout in GroupScaleLayout::ALL {
            let op = Op::QuantFp8PerTokenGroup {
                group_size: 128,
                scale_layout,
            };
            let json = op.attrs_json();
            assert_eq!(json["scale_layout"], scale_layout.name(), "{json:?}");
            let back = Op::from_name_attrs(op.name(), &json).unwrap();
            assert_eq!(op, back);
        }
        let err = Op::from_name_attrs(
            "quant_fp8_per_token_group",
            &obj(json!({"group_size": 128, "scale_layout": "f32_ue8m0"})),
        )
        .unwrap_err();
        assert!(err.contains("f32_ue8m0"), "{err}");
    }

    #[test]
    fn group_scale_forms() {
        use GroupScaleLayout::*;
        assert!(!F32RowMajor.power_of_two_scales() && F32RowMajor.f32_storage());
        assert!(PackedUe8m0.power_of_two_scales() && !PackedUe8m0.f32_storage());
        assert!(F32RowMajorUe8m0.power_of_two_scales() && F32RowMajorUe8m0.f32_storage());
        assert!(F32RowMajor < PackedUe8m0 && PackedUe8m0 < F32RowMajorUe8m0);
    }
}
