//! A small real-shaped tensor-parallel model (2 layers, H = 256, W = 4, the builder of
//! `crates/reference/tests/common`) lowered by the pass (`arfuse::lower`, not a
//! hand-built fused graph) runs end to end on the reference evaluator with outputs
//! bit-identical to the original, in bf16, f16 and an FP8 (static quant) variant.

#[path = "../crates/reference/tests/common/mod.rs"]
mod common;

use arfuse::advanced::ir::{DType, Op, Strategy};
use arfuse::advanced::reference::{check_equivalent, equivalence_token_counts};
use arfuse::Target;
use common::{build_model, count_sites, ModelCfg};

const W: u32 = 4;
/// The graph's largest T.
const T_MAX: u64 = 64;

fn cfg(dtype: DType, fp8: bool) -> ModelCfg {
    ModelCfg {
        dtype,
        hidden: 256,
        layers: 2,
        vocab: 512,
        attn: 64,
        inter: 128,
        fp8,
        eps: 1e-6,
    }
}

/// B200 at W = 4, engine sized to the graph so the evaluator stays fast.
fn target() -> Target {
    let mut t = Target::preset("b200-x8").unwrap();
    t.world_size = W;
    t.max_batched_tokens = 96;
    t.capture_sizes.retain(|&c| c <= 96);
    t.compile_range_boundaries.retain(|&c| c <= 96);
    t.validate().unwrap();
    t
}

fn run(dtype: DType, fp8: bool) {
    let c = cfg(dtype, fp8);
    let original = build_model(&c, T_MAX, false);
    let lowered = arfuse::lower(&original, &target()).unwrap();
    let l = &lowered.graph;
    // 2L + 1 fusion sites; the pass turned every all-reduce into one fused node, with
    // the same outputs the hand-fused form of the reference's own test writes.
    assert_eq!(count_sites(&original), (5, 0));
    assert_eq!(count_sites(l), (0, 5), "{}", lowered.report);
    let by_hand = build_model(&c, T_MAX, true);
    let outputs = |g: &arfuse::Graph| -> Vec<Vec<arfuse::advanced::ir::op::FusedOutput>> {
        g.nodes()
            .filter_map(|(_, n)| match &n.op {
                Op::FusedAllreduceNorm(a) => {
                    let mut o = a.outputs.clone();
                    o.sort();
                    Some(o)
                }
                _ => None,
            })
            .collect()
    };
    assert_eq!(outputs(l), outputs(&by_hand));

    // Token counts around every fused range of the plan the pass chose.
    let max_fused = l
        .nodes()
        .filter_map(|(_, n)| match &n.op {
            Op::FusedAllreduceNorm(a) => a.plan.as_ref(),
            _ => None,
        })
        .flat_map(|p| p.dispatch.iter())
        .filter(|r| r.strategy != Strategy::Unfused)
        .map(|r| r.max_tokens)
        .max()
        .unwrap();
    // The counts around the plan's largest fused T (one above it included), within the
    // graph's T <= 64.
    let mut tokens = equivalence_token_counts(W, max_fused.min(T_MAX - 1)).unwrap();
    if !tokens.contains(&T_MAX) {
        tokens.push(T_MAX);
    }
    let report = check_equivalent(&original, l, W, &tokens, 0x5EED).unwrap();
    assert!(report.is_bit_exact(), "{report}");
    assert_eq!(report.per_tokens.len(), tokens.len());
    for t in &report.per_tokens {
        assert_eq!(t.outputs.len(), 2);
        assert_eq!(t.outputs[0].shape, vec![t.tokens as usize, 512]);
        assert_eq!(t.outputs[1].shape, vec![t.tokens as usize, 256]);
        for o in &t.outputs {
            assert!(o.passed);
            assert_eq!((o.bit_mismatches, o.max_ulp), (0, 0));
        }
    }
}

#[test]
fn bf16_model_original_and_lowered_are_bit_identical() {
    run(DType::Bf16, false);
}

#[test]
fn fp8_model_original_and_lowered_are_bit_identical() {
    run(DType::Bf16, true);
}

#[test]
fn f16_model_original_and_lowered_are_bit_identical() {
    run(DType::F16, false);
}
