//! The e-graph language: the IR ops the rules look into, plus leaves.
//!
//! Every IR value the rules do not model (inputs, constants, matmuls, attention,
//! already fused nodes, ...) becomes an opaque [`Leaf::Value`] keyed by the IR value
//! itself, so two unrelated values never merge. Attributes (dtypes, shapes, eps, quant
//! kinds, output ports) are leaves too, so that hash-consing compares them.
//!
//! Collectives carry an instance leaf ([`Leaf::Inst`], the IR node index of the
//! all-reduce): two all-reduces of the same value are different e-nodes, and the fused
//! node of an all-reduce names the same instance, so the check after emission can
//! confirm that every original all-reduce appears exactly once.
//!
//! Multi-output ops are tuple-valued nodes read through `get` projections:
//! `(get @0 (fused_add_rms_norm ...))`. The fused node's ports are fixed
//! ([`PORT_NORM`], [`PORT_RESIDUAL`], [`PORT_QUANT`], [`PORT_SCALE`]); which of them
//! the emitted IR node writes is decided from liveness when converting back.

use arfuse_ir::op::FusedQuant;
use arfuse_ir::DType;
use egg::{define_language, Id};
use std::fmt;
use std::str::FromStr;

/// Port of the fused tuple holding the RMSNorm output.
pub const PORT_NORM: u8 = 0;
/// Port of the fused tuple holding the new residual.
pub const PORT_RESIDUAL: u8 = 1;
/// Port of the fused tuple holding the quantised output.
pub const PORT_QUANT: u8 = 2;
/// Port of the fused tuple holding the quant scales.
pub const PORT_SCALE: u8 = 3;

define_language! {
    /// The language of the fusion e-graph. Children in brackets; `tuple` marks
    /// tuple-valued nodes read through `get`.
    pub enum Fx {
        // `[inst, x]`: sum over the ranks of the instance's group.
        "all_reduce" = AllReduce([Id; 2]),
        // `x`: the `wait_tensor` after a functional collective (identity on values).
        "wait" = Wait(Id),
        // `[a, b]`: element-wise sum.
        "add" = Add([Id; 2]),
        // `[a, b]`: element-wise product.
        "mul" = Mul([Id; 2]),
        // `[dtype, x]`: cast.
        "to_dtype" = ToDtype([Id; 2]),
        // `[exponent, x]`.
        "pow" = Pow([Id; 2]),
        // `[mean, x]`: mean over the last dim, keepdim.
        "mean" = Mean([Id; 2]),
        // `x`: `1 / sqrt(x)`.
        "rsqrt" = Rsqrt(Id),
        // `[shape, x]`: reshape or view.
        "reshape" = Reshape([Id; 2]),
        // `[norm, x, w]`: RMSNorm, one rounding.
        "rms_norm" = RmsNorm([Id; 3]),
        // `[norm, x, r, w]`, tuple: `@0` normed, `@1` residual out.
        "fused_add_rms_norm" = FusedAddRmsNorm([Id; 4]),
        // `[quant, x, scale | none]`, tuple: `@0` quantised, `@1` scales.
        "quant" = Quant([Id; 3]),
        // `[fused, inst, x, residual | none, w, scale | none]`, tuple with the ports
        // `@0` norm, `@1` residual, `@2` quant, `@3` scale.
        "fused" = Fused([Id; 6]),
        // `[port, tuple]`: one output of a tuple.
        "get" = Get([Id; 2]),
        Leaf(Leaf),
    }
}

/// Attributes of a fused tuple node (the group comes from the instance).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FKind {
    /// A residual input is added after the all-reduce.
    pub residual: bool,
    /// The quant epilogue.
    pub quant: FusedQuant,
    /// RMSNorm eps, as f64 bits.
    pub eps: u64,
    /// Weight bias (0 or 1), as f64 bits.
    pub bias: u64,
    /// The RMSNorm rounds the normalised value to T before the weight multiply
    /// (`NormRounding::Twice`, Hugging Face's Llama order).
    pub twice: bool,
    /// The RMSNorm normalises the unrounded f32 sum of the all-reduce output and the
    /// residual (`NormInput::F32Sum`, vLLM's native `fused_add_rms_norm`).
    pub f32_sum: bool,
}

/// RMSNorm attributes: eps and weight_bias as f64 bits, and whether it rounds twice
/// (the Llama order; see `arfuse_ir::NormRounding`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NormAttrs {
    /// eps bits.
    pub eps: u64,
    /// weight_bias bits.
    pub bias: u64,
    /// Rounds to T before the weight multiply.
    pub twice: bool,
    /// Normalises the unrounded f32 sum of its input's two operands: the input class
    /// holds `add(a, b)` of two T values, and the norm reads `f32(a) + f32(b)`, not its
    /// rounding (`arfuse_ir::NormInput::F32Sum`).
    pub f32_sum: bool,
}

/// A leaf: an opaque IR value or an attribute. Attributes wider than 32 bits are
/// numbers in the e-graph's attribute table ([`Attrs`]), so that every e-node is 28
/// bytes (the `fused` node's six children) instead of 40: egg keeps each e-node in
/// its node list, its class and its hash-consing table (callgrind, one lowering of
/// the 128-layer decomposed stack: 3% fewer instructions, 11% fewer misses of a
/// simulated 2 MiB last-level cache). Two attribute leaves of one e-graph are the same
/// leaf exactly when their attributes are equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Leaf {
    /// An IR value the rules do not look into: (node index, output index).
    Value(u32, u32),
    /// The instance of an all-reduce: its IR node index.
    Inst(u32),
    /// An element type.
    DType(DType),
    /// An interned shape (index into [`crate::analysis::FxAnalysis`]'s shape table).
    Shape(u32),
    /// RMSNorm attributes ([`NormAttrs`], by their number in [`Attrs`]).
    Norm(u32),
    /// A `pow` exponent (f64 bits, by their number in [`Attrs`]).
    Exp(u32),
    /// `mean` over the last dim with keepdim (the only mean the rules model).
    MeanLast,
    /// A quant op's kind ([`FusedQuant`], by its number in [`Attrs`]).
    Quant(u32),
    /// A fused node's kind ([`FKind`], by its number in [`Attrs`]).
    Fused(u32),
    /// An output port of a tuple.
    Port(u8),
    /// An absent optional child.
    None,
}

/// One e-graph's attributes that [`Leaf`] holds by number: each kind numbered from 0
/// in the order first met.
#[derive(Debug, Default)]
pub struct Attrs {
    norms: Interner<NormAttrs>,
    exps: Interner<u64>,
    quants: Interner<FusedQuant>,
    kinds: Interner<FKind>,
}

impl Attrs {
    /// The leaf of RMSNorm attributes `a`.
    pub fn norm_leaf(&mut self, a: NormAttrs) -> Leaf {
        Leaf::Norm(self.norms.intern(a))
    }

    /// The leaf of the `pow` exponent with f64 bits `bits`.
    pub fn exp_leaf(&mut self, bits: u64) -> Leaf {
        Leaf::Exp(self.exps.intern(bits))
    }

    /// The leaf of quant kind `q`.
    pub fn quant_leaf(&mut self, q: FusedQuant) -> Leaf {
        Leaf::Quant(self.quants.intern(q))
    }

    /// The leaf of fused kind `k`.
    pub fn fused_leaf(&mut self, k: FKind) -> Leaf {
        Leaf::Fused(self.kinds.intern(k))
    }

    /// The RMSNorm attributes of leaf `l`, when it is one.
    pub fn norm(&self, l: Leaf) -> Option<NormAttrs> {
        match l {
            Leaf::Norm(i) => self.norms.get(i),
            _ => None,
        }
    }

    /// The exponent of leaf `l` (f64 bits), when it is one.
    pub fn exp(&self, l: Leaf) -> Option<u64> {
        match l {
            Leaf::Exp(i) => self.exps.get(i),
            _ => None,
        }
    }

    /// The quant kind of leaf `l`, when it is one.
    pub fn quant(&self, l: Leaf) -> Option<FusedQuant> {
        match l {
            Leaf::Quant(i) => self.quants.get(i),
            _ => None,
        }
    }

    /// The fused kind of leaf `l`, when it is one.
    pub fn fused(&self, l: Leaf) -> Option<FKind> {
        match l {
            Leaf::Fused(i) => self.kinds.get(i),
            _ => None,
        }
    }
}

/// Values numbered from 0 in the order first met.
#[derive(Debug)]
struct Interner<T> {
    list: Vec<T>,
    ids: rustc_hash::FxHashMap<T, u32>,
}

impl<T> Default for Interner<T> {
    fn default() -> Self {
        Interner {
            list: Vec::new(),
            ids: Default::default(),
        }
    }
}

impl<T: Copy + Eq + std::hash::Hash> Interner<T> {
    /// The number of `v`. Every number is a distinct leaf, an e-class of its own, and
    /// egg numbers e-classes in 32 bits, so the numbers fit.
    fn intern(&mut self, v: T) -> u32 {
        let next = self.list.len() as u32;
        let id = *self.ids.entry(v).or_insert(next);
        if id == next {
            self.list.push(v);
        }
        id
    }

    fn get(&self, id: u32) -> Option<T> {
        self.list.get(id as usize).copied()
    }
}

impl fmt::Display for Leaf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Leaf::Value(n, k) => write!(f, "%{n}.{k}"),
            Leaf::Inst(n) => write!(f, "inst{n}"),
            Leaf::DType(d) => write!(f, "{d}"),
            Leaf::Shape(s) => write!(f, "shape{s}"),
            Leaf::Norm(i) => write!(f, "norm{i}"),
            Leaf::Exp(i) => write!(f, "exp{i}"),
            Leaf::MeanLast => f.write_str("mean_last"),
            Leaf::Quant(i) => write!(f, "quant{i}"),
            Leaf::Fused(i) => write!(f, "kind{i}"),
            Leaf::Port(p) => write!(f, "@{p}"),
            Leaf::None => f.write_str("none"),
        }
    }
}

/// Why a leaf does not parse.
#[derive(Debug)]
pub struct LeafParseError(#[allow(dead_code)] pub String);

impl FromStr for Leaf {
    type Err = LeafParseError;

    /// Parses the leaves rules write literally: `@0`..`@3`, `none`, `mean_last`.
    fn from_str(s: &str) -> Result<Leaf, LeafParseError> {
        match s {
            "none" => Ok(Leaf::None),
            "mean_last" => Ok(Leaf::MeanLast),
            _ => match s.strip_prefix('@').and_then(|p| p.parse::<u8>().ok()) {
                Some(p) => Ok(Leaf::Port(p)),
                None => Err(LeafParseError(s.to_string())),
            },
        }
    }
}
