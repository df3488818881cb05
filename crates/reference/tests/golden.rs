//! The quant clause of the rounding contract against golden vectors computed
//! from the engines' own formulas (vLLM's and FlashInfer's quant kernels, torch
//! casts) by `tools/golden/golden.py`, bit for bit.
//!
//! The golden file is committed (tests/golden/quant_engines.bin, format in the
//! script's doc); this test needs no torch. Every case is compared in full and
//! the mismatches are counted per form before anything is asserted, so a failure
//! prints the whole table.

use arfuse_reference::numerics::fp4::e2m1_from_f32;
use arfuse_reference::numerics::fp8::e4m3_satfinite;
use arfuse_reference::numerics::quant::{
    dynamic_per_token_fp8_quant, nvfp4_quant, per_token_group_fp8_quant, static_fp8_quant,
    GroupScaleLayout, GroupScales, Nvfp4ScaleLayout,
};
use arfuse_reference::numerics::FloatFormat;
use std::collections::BTreeMap;

const GOLDEN: &[u8] = include_bytes!("golden/quant_engines.bin");

/// One input matrix of the golden file, widened to f32.
struct Set {
    name: String,
    dtype: u8,
    tokens: usize,
    hidden: usize,
    values: Vec<f32>,
}

/// One golden case: a form applied to a set.
struct Case {
    form: u8,
    set: usize,
    param: f32,
    quant: Vec<u8>,
    scales: Vec<u8>,
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> &'a [u8] {
        let end = self.pos.checked_add(n).expect("golden file offset");
        assert!(
            end <= self.data.len(),
            "golden file truncated at {}",
            self.pos
        );
        let s = &self.data[self.pos..end];
        self.pos = end;
        s
    }
    fn u8(&mut self) -> u8 {
        self.take(1)[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take(2).try_into().unwrap())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().unwrap())
    }
    fn bytes(&mut self) -> Vec<u8> {
        let n = self.u32() as usize;
        self.take(n).to_vec()
    }
}

fn widen(dtype: u8, raw: &[u8]) -> Vec<f32> {
    match dtype {
        0 => raw
            .chunks_exact(2)
            .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
            .collect(),
        1 => raw
            .chunks_exact(2)
            .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        2 => raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        other => panic!("golden file: unknown dtype {other}"),
    }
}

fn parse() -> (Vec<Set>, Vec<Case>) {
    let mut r = Reader {
        data: GOLDEN,
        pos: 0,
    };
    assert_eq!(r.take(8), b"ARFGOLD1", "golden file magic");
    let n_sets = r.u32();
    let mut sets = Vec::new();
    for _ in 0..n_sets {
        let dtype = r.u8();
        r.u8();
        let name_len = r.u16() as usize;
        let name = String::from_utf8(r.take(name_len).to_vec()).unwrap();
        let tokens = r.u32() as usize;
        let hidden = r.u32() as usize;
        let eb = if dtype == 2 { 4 } else { 2 };
        let values = widen(dtype, r.take(tokens * hidden * eb));
        sets.push(Set {
            name,
            dtype,
            tokens,
            hidden,
            values,
        });
    }
    let n_cases = r.u32();
    let mut cases = Vec::new();
    for _ in 0..n_cases {
        let form = r.u8();
        r.u8();
        r.u16();
        let set = r.u32() as usize;
        let param = f32::from_bits(r.u32());
        let quant = r.bytes();
        let scales = r.bytes();
        assert!(set < sets.len(), "case refers to set {set}");
        cases.push(Case {
            form,
            set,
            param,
            quant,
            scales,
        });
    }
    assert_eq!(r.pos, GOLDEN.len(), "trailing bytes in the golden file");
    (sets, cases)
}

fn form_name(form: u8) -> &'static str {
    match form {
        1 => "fp8 static",
        2 => "fp8 per-token",
        3 => "fp8 group packed ue8m0",
        4 => "fp8 group f32",
        5 => "nvfp4 swizzled",
        6 => "nvfp4 linear",
        7 => "fp8 group f32 ue8m0",
        16 => "convert e4m3",
        17 => "convert e2m1",
        18 => "convert bf16",
        19 => "convert f16",
        _ => "unknown",
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn group_scale_bytes(s: GroupScales) -> Vec<u8> {
    match s {
        GroupScales::PackedUe8m0 { words, .. } => {
            words.iter().flat_map(|w| w.to_le_bytes()).collect()
        }
        GroupScales::Fp32 { values, .. } => f32_bytes(&values),
    }
}

/// The reference's (quant bytes, scale bytes) for a case, in the golden layouts.
fn reference(case: &Case, set: &Set) -> (Vec<u8>, Vec<u8>) {
    let (y, t, h) = (&set.values, set.tokens, set.hidden);
    let group = |layout| {
        let g = per_token_group_fp8_quant(y, t, h, 128, layout).unwrap();
        (g.data, group_scale_bytes(g.scales))
    };
    match case.form {
        1 => (static_fp8_quant(y, case.param).unwrap(), Vec::new()),
        2 => {
            let (q, s) = dynamic_per_token_fp8_quant(y, t, h).unwrap();
            (q, f32_bytes(&s))
        }
        3 => group(GroupScaleLayout::PackedUe8m0),
        4 => group(GroupScaleLayout::F32RowMajor),
        7 => group(GroupScaleLayout::F32RowMajorUe8m0),
        5 | 6 => {
            let layout = if case.form == 5 {
                Nvfp4ScaleLayout::Swizzled128x4
            } else {
                Nvfp4ScaleLayout::Linear
            };
            let q = nvfp4_quant(y, t, h, case.param, layout).unwrap();
            (q.data, q.scales)
        }
        16 => (y.iter().map(|&x| e4m3_satfinite(x)).collect(), Vec::new()),
        17 => (y.iter().map(|&x| e2m1_from_f32(x)).collect(), Vec::new()),
        18 | 19 => {
            let f = if case.form == 18 {
                FloatFormat::Bf16
            } else {
                FloatFormat::F16
            };
            let bits = y.iter().flat_map(|&x| (f.to_bits(x) as u16).to_le_bytes());
            (bits.collect(), Vec::new())
        }
        other => panic!("golden file: unknown form {other}"),
    }
}

/// Mismatching units (`unit` bytes each) between two buffers; a length
/// difference counts every missing or extra unit.
fn mismatches(got: &[u8], want: &[u8], unit: usize) -> usize {
    let common = got.len().min(want.len()) / unit;
    let differ = (0..common)
        .filter(|&i| got[i * unit..(i + 1) * unit] != want[i * unit..(i + 1) * unit])
        .count();
    differ + got.len().abs_diff(want.len()).div_ceil(unit)
}

fn scale_unit(form: u8) -> usize {
    match form {
        2 | 3 | 4 | 7 => 4,
        _ => 1,
    }
}

fn quant_unit(form: u8) -> usize {
    if form == 18 || form == 19 {
        2
    } else {
        1
    }
}

#[derive(Default)]
struct Tally {
    cases: usize,
    quant: usize,
    quant_bad: usize,
    scale: usize,
    scale_bad: usize,
}

#[test]
fn quant_clause_matches_the_engine_formulas_bit_for_bit() {
    let (sets, cases) = parse();
    let mut tally: BTreeMap<(u8, &str), Tally> = BTreeMap::new();
    let mut first_bad: Vec<String> = Vec::new();
    for case in &cases {
        let set = &sets[case.set];
        let (q, s) = reference(case, set);
        let t = tally.entry((case.form, form_name(case.form))).or_default();
        let (qu, su) = (quant_unit(case.form), scale_unit(case.form));
        let (qb, sb) = (
            mismatches(&q, &case.quant, qu),
            mismatches(&s, &case.scales, su),
        );
        t.cases += 1;
        t.quant += case.quant.len() / qu;
        t.scale += case.scales.len() / su;
        t.quant_bad += qb;
        t.scale_bad += sb;
        if (qb > 0 || sb > 0) && first_bad.len() < 12 {
            first_bad.push(format!(
                "{} on {:?} ({}, dtype {}, param {:e}): {qb} quant, {sb} scale mismatches",
                form_name(case.form),
                set.name,
                set.tokens * set.hidden,
                set.dtype,
                case.param
            ));
        }
    }
    let mut report = String::from("form | cases | quant mismatches | scale mismatches\n");
    for ((_, name), t) in &tally {
        report += &format!(
            "{name} | {} | {} / {} | {} / {}\n",
            t.cases, t.quant_bad, t.quant, t.scale_bad, t.scale
        );
    }
    println!("{report}");
    for line in &first_bad {
        println!("  {line}");
    }
    assert!(
        tally.values().all(|t| t.quant_bad == 0 && t.scale_bad == 0),
        "the reference differs from the engine formulas:\n{report}{}",
        first_bad.join("\n")
    );
    // Every form of the file was exercised.
    assert_eq!(tally.len(), 11, "{report}");
}
