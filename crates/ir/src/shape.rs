//! Dimensions, shapes, symbol ranges and tensor types.
//!
//! A dimension is a monomial: a constant coefficient times a product of named
//! symbols (`4096`, `T`, `B*S`, `2*T`). That is enough for the activations of a
//! decoder (`[T, H]`, `[B, S, H]` and its view `[B*S, H]`) while keeping element
//! counts comparable exactly.

use crate::DType;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// The inclusive range of values a symbol (a dynamic dimension) can take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SymbolRange {
    /// Smallest value, inclusive.
    pub min: u64,
    /// Largest value, inclusive.
    pub max: u64,
}

/// Named symbols of a graph and their ranges (`T` for tokens, `B`, `S` for 3-D activations).
pub type Symbols = BTreeMap<String, SymbolRange>;

/// One dimension: `coeff * sym_1 * ... * sym_k` (symbols sorted, repeats allowed).
///
/// The symbols are shared, not copied, when a dimension is cloned (a clone of a type
/// allocates nothing for its dimensions): `None` for a constant, else a shared
/// non-empty list.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Dim {
    coeff: u64,
    syms: Option<Arc<[String]>>,
}

impl fmt::Debug for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dim")
            .field("coeff", &self.coeff)
            .field("syms", &self.symbols())
            .finish()
    }
}

/// The shared form of a sorted symbol list: `None` when empty.
fn shared(syms: Vec<String>) -> Option<Arc<[String]>> {
    (!syms.is_empty()).then(|| Arc::from(syms))
}

/// Why a dimension string does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid dimension {text:?}: {reason}")]
pub struct DimParseError {
    /// The text that failed.
    pub text: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl Dim {
    /// A constant dimension.
    pub fn constant(n: u64) -> Dim {
        Dim {
            coeff: n,
            syms: None,
        }
    }

    /// A dimension equal to one symbol.
    pub fn symbol(name: impl Into<String>) -> Dim {
        Dim {
            coeff: 1,
            syms: shared(vec![name.into()]),
        }
    }

    /// The value when the dimension has no symbols.
    pub fn as_const(&self) -> Option<u64> {
        self.syms.is_none().then_some(self.coeff)
    }

    /// The constant factor.
    pub fn coeff(&self) -> u64 {
        self.coeff
    }

    /// The symbols of the product, sorted.
    pub fn symbols(&self) -> &[String] {
        self.syms.as_deref().unwrap_or(&[])
    }

    /// `self * other`, or `None` when the constant factor overflows u64.
    pub fn checked_mul(&self, other: &Dim) -> Option<Dim> {
        let coeff = self.coeff.checked_mul(other.coeff)?;
        if coeff == 0 {
            return Some(Dim::constant(0));
        }
        let syms = match (&self.syms, &other.syms) {
            (None, s) | (s, None) => s.clone(),
            (Some(a), Some(b)) => {
                let mut syms: Vec<String> = a.iter().chain(b.iter()).cloned().collect();
                syms.sort();
                shared(syms)
            }
        };
        Some(Dim { coeff, syms })
    }

    /// The value of the dimension with every symbol set by `value_of`; `None` on
    /// overflow or when a symbol has no value.
    pub fn eval(&self, value_of: impl Fn(&str) -> Option<u64>) -> Option<u64> {
        let mut v = self.coeff;
        for s in self.symbols() {
            v = v.checked_mul(value_of(s)?)?;
        }
        Some(v)
    }

    /// The largest value the dimension can take under `symbols`; `None` on overflow
    /// or an undeclared symbol.
    pub fn max_value(&self, symbols: &Symbols) -> Option<u64> {
        self.eval(|s| symbols.get(s).map(|r| r.max))
    }

    /// Parses `4096`, `T`, `B*S`, `2*T`.
    pub fn parse(text: &str) -> Result<Dim, DimParseError> {
        let err = |reason| DimParseError {
            text: text.to_string(),
            reason,
        };
        if text.is_empty() {
            return Err(err("empty"));
        }
        // The product of the factors, left to right: the constant part checked for
        // overflow factor by factor, the symbols sorted at the end.
        let mut coeff: u64 = 1;
        let mut syms: Vec<String> = Vec::new();
        for factor in text.split('*') {
            let factor = factor.trim();
            if factor.is_empty() {
                return Err(err("empty factor"));
            }
            if factor.bytes().all(|b| b.is_ascii_digit()) {
                let n: u64 = factor.parse().map_err(|_| err("constant overflows u64"))?;
                coeff = coeff
                    .checked_mul(n)
                    .ok_or_else(|| err("constant overflows u64"))?;
            } else if is_symbol_name(factor) {
                syms.push(factor.to_owned());
            } else {
                return Err(err(
                    "a factor must be an integer or a symbol name [A-Za-z_][A-Za-z0-9_]*",
                ));
            }
        }
        if coeff == 0 {
            // As for `checked_mul`: a zero product has no symbols.
            return Ok(Dim::constant(0));
        }
        syms.sort();
        Ok(Dim {
            coeff,
            syms: shared(syms),
        })
    }
}

/// True when `s` is a valid symbol name: `[A-Za-z_][A-Za-z0-9_]*`, at most 64 bytes.
pub fn is_symbol_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    matches!(bytes.next(), Some(b) if b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && s.len() <= 64
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let syms = self.symbols();
        if syms.is_empty() {
            return write!(f, "{}", self.coeff);
        }
        if self.coeff != 1 {
            write!(f, "{}*", self.coeff)?;
        }
        f.write_str(&syms.join("*"))
    }
}

impl Serialize for Dim {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.as_const() {
            Some(n) => s.serialize_u64(n),
            None => s.collect_str(self),
        }
    }
}

impl<'de> Deserialize<'de> for Dim {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Dim;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a non-negative integer or a symbolic dimension such as \"T\" or \"B*S\"",
                )
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Dim, E> {
                Ok(Dim::constant(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Dim, E> {
                u64::try_from(v)
                    .map(Dim::constant)
                    .map_err(|_| E::custom(format!("negative dimension {v}")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Dim, E> {
                Dim::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A tensor shape: a list of dimensions, outermost first.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Shape(pub Vec<Dim>);

impl Shape {
    /// Builds a shape from dimensions.
    pub fn new(dims: Vec<Dim>) -> Shape {
        Shape(dims)
    }

    /// The number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// The dimensions.
    pub fn dims(&self) -> &[Dim] {
        &self.0
    }

    /// The last dimension (the hidden dim of an activation), if any.
    pub fn last(&self) -> Option<&Dim> {
        self.0.last()
    }

    /// The element count as one monomial; `None` on overflow of the constant factor.
    pub fn numel(&self) -> Option<Dim> {
        self.0
            .iter()
            .try_fold(Dim::constant(1), |acc, d| acc.checked_mul(d))
    }

    /// The product of every dimension but the last (tokens of an activation: T, or B*S).
    pub fn leading(&self) -> Option<Dim> {
        let n = self.0.len().saturating_sub(1);
        self.0[..n]
            .iter()
            .try_fold(Dim::constant(1), |acc, d| acc.checked_mul(d))
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// The type of one node output: element type and shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Shape,
}

impl TensorType {
    /// Builds a tensor type.
    pub fn new(dtype: DType, dims: Vec<Dim>) -> TensorType {
        TensorType {
            dtype,
            shape: Shape(dims),
        }
    }

    /// Largest size in bytes of the type's logical elements under the symbol ranges;
    /// `None` when it overflows u64 or a symbol is undeclared. Not the storage of a
    /// padded scale tensor: packed UE8M0 group scales and swizzled NVFP4 scales are
    /// typed by their logical shape and stored larger (`T + (ceil(G/4) - 1) *
    /// round_up(T, 4)` words; `round_up(T, 128) * round_up(H/16, 4)` bytes); size those
    /// with `arfuse_reference::numerics::quant::{group_scale_bytes,
    /// nvfp4_scale_bytes}`, as the runtime does. The IR uses this only to refuse types
    /// whose size overflows.
    pub fn max_bytes(&self, symbols: &Symbols) -> Option<u64> {
        let elements = match self.max_elements_any_order(symbols) {
            Some(elements) => elements?,
            None => self.shape.numel()?.max_value(symbols)?,
        };
        elements.checked_mul(self.dtype.size_bytes())
    }

    /// The largest element count under `symbols` (`Some(None)` on overflow), computed
    /// without building the element count's monomial, when that gives what
    /// `numel()?.max_value(symbols)` gives: every symbol declared with a non-zero
    /// maximum, so that the symbols' order (sorted, in `numel`) cannot decide whether
    /// a partial product overflows. `None` otherwise.
    fn max_elements_any_order(&self, symbols: &Symbols) -> Option<Option<u64>> {
        // The constant part, multiplied in `numel`'s order; once 0 it stays 0.
        let mut coeff: u64 = 1;
        for d in self.shape.dims() {
            match coeff.checked_mul(d.coeff) {
                Some(c) => coeff = c,
                None => return Some(None),
            }
        }
        if coeff == 0 {
            return Some(Some(0));
        }
        let mut value = Some(coeff);
        for s in self.shape.dims().iter().flat_map(|d| d.symbols().iter()) {
            let max = symbols.get(s)?.max;
            if max == 0 {
                return None;
            }
            value = value.and_then(|v| v.checked_mul(max));
        }
        Some(value)
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_monomials() {
        for (text, printed) in [("4096", "4096"), ("T", "T"), ("S*B", "B*S"), ("2*T", "2*T")] {
            assert_eq!(Dim::parse(text).unwrap().to_string(), printed);
        }
        assert!(Dim::parse("T+1").is_err());
        assert!(Dim::parse("").is_err());
        assert!(Dim::parse("99999999999999999999").is_err());
        assert!(Dim::parse("4294967296*4294967296").is_err());
    }

    #[test]
    fn numel_of_3d_view_matches_2d() {
        let a = Shape(vec![
            Dim::symbol("B"),
            Dim::symbol("S"),
            Dim::constant(4096),
        ]);
        let b = Shape(vec![Dim::parse("B*S").unwrap(), Dim::constant(4096)]);
        assert_eq!(a.numel(), b.numel());
        assert_eq!(a.leading().unwrap().to_string(), "B*S");
    }

    /// `Dim::parse` as the product of its factors by `checked_mul`, left to right.
    fn parse_by_products(text: &str) -> Option<Dim> {
        let mut dim = Dim::constant(1);
        for factor in text.split('*') {
            let factor = factor.trim();
            let d = if factor.bytes().all(|b| b.is_ascii_digit()) {
                Dim::constant(factor.parse().ok()?)
            } else {
                Dim::symbol(factor)
            };
            dim = dim.checked_mul(&d)?;
        }
        Some(dim)
    }

    #[test]
    fn parse_is_the_product_of_the_factors() {
        let big = "99999999999";
        for text in [
            "T",
            "4096",
            "2*T",
            "T*2",
            "S*B",
            "B*S*B",
            " 2 * T ",
            "0",
            "0*T",
            "T*0",
            "1*1*T",
            "B*0*99999999999*99999999999",
            &format!("{big}*{big}*0"),
            &format!("{big}*{big}"),
        ] {
            let parsed = Dim::parse(text).ok();
            assert_eq!(parsed, parse_by_products(text), "{text:?}");
        }
    }

    #[test]
    fn max_bytes_is_numel_at_the_maxima_in_every_case() {
        let mut syms = Symbols::new();
        syms.insert("T".into(), SymbolRange { min: 1, max: 8192 });
        syms.insert("Z".into(), SymbolRange { min: 0, max: 0 });
        syms.insert(
            "B".into(),
            SymbolRange {
                min: 1,
                max: 1 << 31,
            },
        );
        let dims = [
            Dim::constant(0),
            Dim::constant(1),
            Dim::constant(3),
            Dim::constant(u64::MAX / 2),
            Dim::symbol("T"),
            Dim::symbol("Z"),
            Dim::symbol("B"),
            Dim::symbol("Q"),
        ];
        let mut shapes = vec![vec![]];
        for _ in 0..3 {
            let longer: Vec<Vec<Dim>> = shapes
                .iter()
                .flat_map(|s| {
                    dims.iter().map(move |d| {
                        let mut s = s.clone();
                        s.push(d.clone());
                        s
                    })
                })
                .collect();
            shapes.extend(longer);
        }
        shapes.push(vec![Dim::symbol("B"); 5]);
        shapes.push([vec![Dim::symbol("B"); 4], vec![Dim::symbol("Z")]].concat());
        for dims in shapes {
            for dtype in [DType::Bf16, DType::F32] {
                let t = TensorType::new(dtype, dims.clone());
                let want = t
                    .shape
                    .numel()
                    .and_then(|n| n.max_value(&syms))
                    .and_then(|n| n.checked_mul(dtype.size_bytes()));
                assert_eq!(t.max_bytes(&syms), want, "{t}");
            }
        }
    }

    #[test]
    fn max_bytes_is_checked() {
        let mut syms = Symbols::new();
        syms.insert("T".into(), SymbolRange { min: 1, max: 8192 });
        let t = TensorType::new(DType::Bf16, vec![Dim::symbol("T"), Dim::constant(4096)]);
        assert_eq!(t.max_bytes(&syms), Some(8192 * 4096 * 2));
        let huge = TensorType::new(
            DType::F32,
            vec![Dim::constant(u64::MAX / 2), Dim::constant(3)],
        );
        assert_eq!(huge.max_bytes(&syms), None);
    }
}
