//! Symbolic sizes: torch writes a dynamic dimension as a sympy expression, either in
//! `srepr` form (`Mul(Integer(4), Symbol('s70', positive=True, integer=True))`, schema
//! 8.x from torch 2.6 on) or in `str` form (`4*s70`, older exporters). Both parse into
//! [`Expr`]; a product of non-negative integers and symbols becomes an IR [`Dim`], and
//! anything else gets bounds by interval arithmetic so that it can stand as a fresh
//! symbol.

use arfuse_ir::{Dim, SymbolRange, Symbols};

/// Longest expression text accepted.
pub const MAX_EXPR_LEN: usize = 4096;
/// Deepest nesting accepted (bounds the recursion of the parser).
pub const MAX_EXPR_DEPTH: usize = 64;

/// A parsed integer expression.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// An integer literal.
    Int(i128),
    /// A named symbol.
    Sym(String),
    /// A sum.
    Add(Vec<Expr>),
    /// A product.
    Mul(Vec<Expr>),
    /// A call of a sympy function (`FloorDiv`, `Max`, `Min`, `Mod`, `Pow`, ...).
    Call(String, Vec<Expr>),
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Int(i128),
    Ident(String),
    Str(String),
    Punct(&'static str),
}

fn lex(s: &str) -> Result<Vec<Tok>, String> {
    let b = s.as_bytes();
    let mut i = 0;
    let mut out = Vec::new();
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c.is_ascii_digit() {
            let st = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            let n: i128 = s[st..i]
                .parse()
                .map_err(|_| format!("integer {} is too large", &s[st..i]))?;
            out.push(Tok::Int(n));
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let st = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(Tok::Ident(s[st..i].to_string()));
        } else if c == b'\'' || c == b'"' {
            let st = i + 1;
            i += 1;
            while i < b.len() && b[i] != c {
                i += 1;
            }
            if i >= b.len() {
                return Err("unterminated string".into());
            }
            out.push(Tok::Str(s[st..i].to_string()));
            i += 1;
        } else {
            let two = b.get(i..i + 2);
            let p: &'static str = match two {
                Some(b"//") => "//",
                Some(b"**") => "**",
                _ => match c {
                    b'(' => "(",
                    b')' => ")",
                    b',' => ",",
                    b'=' => "=",
                    b'+' => "+",
                    b'-' => "-",
                    b'*' => "*",
                    _ => {
                        let ch = s[i..].chars().next().unwrap_or('?');
                        return Err(format!("unexpected character {ch:?}"));
                    }
                },
            };
            i += p.len();
            out.push(Tok::Punct(p));
        }
    }
    Ok(out)
}

struct Parser {
    toks: Vec<Tok>,
    pos: usize,
    depth: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }

    fn eat(&mut self, p: &str) -> bool {
        if matches!(self.peek(), Some(Tok::Punct(q)) if *q == p) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn enter(&mut self) -> Result<(), String> {
        self.depth += 1;
        if self.depth > MAX_EXPR_DEPTH {
            return Err(format!("nested deeper than {MAX_EXPR_DEPTH} levels"));
        }
        Ok(())
    }

    fn sum(&mut self) -> Result<Expr, String> {
        self.enter()?;
        let mut terms = vec![self.product()?];
        loop {
            if self.eat("+") {
                terms.push(self.product()?);
            } else if self.eat("-") {
                let t = self.product()?;
                terms.push(Expr::Mul(vec![Expr::Int(-1), t]));
            } else {
                break;
            }
        }
        self.depth -= 1;
        Ok(if terms.len() == 1 {
            terms.pop().unwrap_or(Expr::Int(0))
        } else {
            Expr::Add(terms)
        })
    }

    fn product(&mut self) -> Result<Expr, String> {
        let mut acc = self.unary()?;
        loop {
            if self.eat("*") {
                let r = self.unary()?;
                acc = Expr::Mul(vec![acc, r]);
            } else if self.eat("//") {
                let r = self.unary()?;
                acc = Expr::Call("FloorDiv".into(), vec![acc, r]);
            } else {
                return Ok(acc);
            }
        }
    }

    fn unary(&mut self) -> Result<Expr, String> {
        if self.eat("-") {
            self.enter()?;
            let e = self.unary()?;
            self.depth -= 1;
            return Ok(Expr::Mul(vec![Expr::Int(-1), e]));
        }
        let base = self.atom()?;
        if self.eat("**") {
            self.enter()?;
            let e = self.unary()?;
            self.depth -= 1;
            return Ok(Expr::Call("Pow".into(), vec![base, e]));
        }
        Ok(base)
    }

    fn atom(&mut self) -> Result<Expr, String> {
        match self.peek().cloned() {
            Some(Tok::Int(n)) => {
                self.pos += 1;
                Ok(Expr::Int(n))
            }
            Some(Tok::Punct("(")) => {
                self.pos += 1;
                let e = self.sum()?;
                if !self.eat(")") {
                    return Err("missing ')'".into());
                }
                Ok(e)
            }
            Some(Tok::Ident(name)) => {
                self.pos += 1;
                if !self.eat("(") {
                    return Ok(Expr::Sym(name));
                }
                self.enter()?;
                let mut args = Vec::new();
                let mut first_str = None;
                if !self.eat(")") {
                    loop {
                        // Keyword arguments (`positive=True`) are assumptions: skipped.
                        let is_kw = matches!(self.peek(), Some(Tok::Ident(_)))
                            && matches!(self.toks.get(self.pos + 1), Some(Tok::Punct("=")));
                        if is_kw {
                            self.pos += 2;
                            self.sum()?;
                        } else if let Some(Tok::Str(s)) = self.peek().cloned() {
                            self.pos += 1;
                            first_str.get_or_insert(s);
                        } else {
                            args.push(self.sum()?);
                        }
                        if self.eat(")") {
                            break;
                        }
                        if !self.eat(",") {
                            return Err("expected ',' or ')' in an argument list".into());
                        }
                    }
                }
                self.depth -= 1;
                match name.as_str() {
                    "Symbol" => first_str
                        .map(Expr::Sym)
                        .ok_or_else(|| "Symbol(...) without a name".to_string()),
                    "Integer" => match args.as_slice() {
                        [Expr::Int(n)] => Ok(Expr::Int(*n)),
                        [Expr::Mul(v)] if v.len() == 2 => match (&v[0], &v[1]) {
                            (Expr::Int(-1), Expr::Int(n)) => Ok(Expr::Int(-n)),
                            _ => Err("Integer(...) of a non-literal".into()),
                        },
                        _ => Err("Integer(...) of a non-literal".into()),
                    },
                    "Add" => Ok(Expr::Add(args)),
                    "Mul" => Ok(Expr::Mul(args)),
                    _ => Ok(Expr::Call(name, args)),
                }
            }
            Some(t) => Err(format!("unexpected token {t:?}")),
            None => Err("unexpected end of expression".into()),
        }
    }
}

/// Parses a sympy expression in `srepr` or `str` form.
pub fn parse(text: &str) -> Result<Expr, String> {
    if text.len() > MAX_EXPR_LEN {
        return Err(format!("expression longer than {MAX_EXPR_LEN} bytes"));
    }
    let toks = lex(text)?;
    let mut p = Parser {
        toks,
        pos: 0,
        depth: 0,
    };
    let e = p.sum()?;
    if p.pos != p.toks.len() {
        return Err("trailing text after the expression".into());
    }
    Ok(e)
}

/// The expression as a monomial `c * s1 * ... * sk` with `c >= 0`, if it is one.
pub fn as_monomial(e: &Expr) -> Option<Dim> {
    match e {
        Expr::Int(n) => u64::try_from(*n).ok().map(Dim::constant),
        Expr::Sym(s) => arfuse_ir::is_symbol_name(s).then(|| Dim::symbol(s.clone())),
        Expr::Mul(v) => v
            .iter()
            .try_fold(Dim::constant(1), |acc, f| acc.checked_mul(&as_monomial(f)?)),
        Expr::Call(name, args) if name == "Pow" && args.len() == 2 => {
            let base = as_monomial(&args[0])?;
            let Expr::Int(k) = args[1] else { return None };
            if !(0..=8).contains(&k) {
                return None;
            }
            (0..k).try_fold(Dim::constant(1), |acc, _| acc.checked_mul(&base))
        }
        _ => None,
    }
}

/// Inclusive integer bounds of `e` when every symbol ranges over `symbols`, by interval
/// arithmetic; `None` for an unknown symbol or function, a division by a range that
/// contains 0, or overflow.
pub fn bounds(e: &Expr, symbols: &Symbols) -> Option<(i128, i128)> {
    match e {
        Expr::Int(n) => Some((*n, *n)),
        Expr::Sym(s) => symbols
            .get(s)
            .map(|r: &SymbolRange| (r.min as i128, r.max as i128)),
        Expr::Add(v) => v.iter().try_fold((0i128, 0i128), |(lo, hi), t| {
            let (a, b) = bounds(t, symbols)?;
            Some((lo.checked_add(a)?, hi.checked_add(b)?))
        }),
        Expr::Mul(v) => v.iter().try_fold((1i128, 1i128), |(lo, hi), t| {
            let (a, b) = bounds(t, symbols)?;
            let c = [
                lo.checked_mul(a)?,
                lo.checked_mul(b)?,
                hi.checked_mul(a)?,
                hi.checked_mul(b)?,
            ];
            Some((*c.iter().min()?, *c.iter().max()?))
        }),
        Expr::Call(name, args) => {
            let b: Option<Vec<(i128, i128)>> = args.iter().map(|a| bounds(a, symbols)).collect();
            let b = b?;
            match (name.as_str(), b.as_slice()) {
                ("Max", [_, ..]) => {
                    Some((b.iter().map(|x| x.0).max()?, b.iter().map(|x| x.1).max()?))
                }
                ("Min", [_, ..]) => {
                    Some((b.iter().map(|x| x.0).min()?, b.iter().map(|x| x.1).min()?))
                }
                ("FloorDiv" | "CeilDiv" | "CleanDiv", [(alo, ahi), (blo, bhi)]) => {
                    if *blo <= 0 || *alo < 0 {
                        return None;
                    }
                    let up = name == "CeilDiv";
                    let div = |a: i128, b: i128| if up { (a + b - 1) / b } else { a / b };
                    Some((div(*alo, *bhi), div(*ahi, *blo)))
                }
                ("Mod" | "PythonMod", [(alo, _), (blo, bhi)]) => {
                    if *blo <= 0 || *alo < 0 {
                        return None;
                    }
                    Some((0, bhi - 1))
                }
                ("Pow", [(alo, ahi), (k, k2)]) if k == k2 && (0..=8).contains(k) && *alo >= 0 => {
                    let p = |x: i128| (0..*k).try_fold(1i128, |acc, _| acc.checked_mul(x));
                    Some((p(*alo)?, p(*ahi)?))
                }
                _ => None,
            }
        }
    }
}

/// The expression rendered compactly (`4*s70`, `FloorDiv(s0, 2)`), for notes and attrs.
pub fn render(e: &Expr) -> String {
    if let Some(d) = as_monomial(e) {
        return d.to_string();
    }
    match e {
        Expr::Int(n) => n.to_string(),
        Expr::Sym(s) => s.clone(),
        Expr::Add(v) => format!("({})", v.iter().map(render).collect::<Vec<_>>().join(" + ")),
        Expr::Mul(v) => v.iter().map(render).collect::<Vec<_>>().join("*"),
        Expr::Call(n, a) => format!(
            "{n}({})",
            a.iter().map(render).collect::<Vec<_>>().join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_forms() {
        let a = parse("Mul(Integer(4), Symbol('s70', positive=True, integer=True))").unwrap();
        assert_eq!(as_monomial(&a).unwrap().to_string(), "4*s70");
        let b = parse("4*s70").unwrap();
        assert_eq!(as_monomial(&b), as_monomial(&a));
        let c = parse("Symbol('s0', positive=True, integer=True)").unwrap();
        assert_eq!(as_monomial(&c).unwrap().to_string(), "s0");
        assert_eq!(
            as_monomial(&parse("s0*s1").unwrap()).unwrap().to_string(),
            "s0*s1"
        );
        assert_eq!(
            as_monomial(&parse("s0**2").unwrap()).unwrap().to_string(),
            "s0*s0"
        );
    }

    #[test]
    fn non_monomials_get_bounds() {
        let mut syms = Symbols::new();
        syms.insert("s0".into(), SymbolRange { min: 2, max: 100 });
        let e = parse("Add(Symbol('s0', integer=True), Integer(-1))").unwrap();
        assert!(as_monomial(&e).is_none());
        assert_eq!(bounds(&e, &syms), Some((1, 99)));
        let f = parse("s0//2 + 1").unwrap();
        assert_eq!(bounds(&f, &syms), Some((2, 51)));
        assert_eq!(bounds(&parse("Max(1, s0)").unwrap(), &syms), Some((2, 100)));
        assert_eq!(bounds(&parse("Foo(s0)").unwrap(), &syms), None);
        assert_eq!(bounds(&parse("s9").unwrap(), &syms), None);
    }

    #[test]
    fn rejects_garbage_without_panicking() {
        for s in [
            "",
            "(",
            "Mul(",
            "s0 +",
            "'abc",
            "4 $ 5",
            "*\u{20ac}",
            "s0\u{e9}",
            "/\u{20ac}",
            "99999999999999999999999999999999999999999",
            ")",
        ] {
            assert!(parse(s).is_err(), "{s}");
        }
        let deep = "(".repeat(1000) + "1" + &")".repeat(1000);
        assert!(parse(&deep).is_err());
    }
}
