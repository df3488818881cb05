//! Done-when properties on generated layer stacks.

mod common;

use common::builder::{NormForm, Quant, Stack};
use common::{h200, lowered};

#[test]
fn one_layer_smoke() {
    let g = Stack::default().build();
    let l = lowered(&g, &h200());
    println!("{}", g.canonical_text());
    println!("{}", l.graph.canonical_text());
    println!("{}", l.report);
    assert_eq!(l.report.all_reduces_fused, 3);
}
