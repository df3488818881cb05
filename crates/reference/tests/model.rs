//! A small real-shaped tensor-parallel model (2 layers, H = 256, W = 4) runs end to
//! end on the evaluator in its unfused form and in a fused form written by hand (the
//! builder places the fused nodes; no rewrite runs here: the reference does not depend
//! on it) with bit-identical outputs, in bf16, f16 and an FP8 (static quant) variant.
//! The same model lowered by the pass is checked in the root `tests/reference_model.rs`.

mod common;

use arfuse_ir::DType;
use arfuse_reference::{
    bind_tokens, check_equivalent, equivalence_token_counts, evaluate, random_inputs,
};
use common::{build_model, count_sites, ModelCfg};

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

const W: u32 = 4;
/// Largest fused T of the test (a plan would compute it; domain.md section 4).
const MAX_FUSED: u64 = 16;

fn run(dtype: DType, fp8: bool) {
    let c = cfg(dtype, fp8);
    let tokens = equivalence_token_counts(W, MAX_FUSED).unwrap();
    assert_eq!(tokens, vec![1, 3, 4, 8, 16, 17]);
    let original = build_model(&c, 64, false);
    let fused = build_model(&c, 64, true);
    // 2L + 1 fusion sites; every all-reduce became one fused node.
    assert_eq!(count_sites(&original), (5, 0));
    assert_eq!(count_sites(&fused), (0, 5));

    let report = check_equivalent(&original, &fused, W, &tokens, 0x5EED).unwrap();
    assert!(report.is_equivalent(), "{report}");
    assert!(report.is_bit_exact(), "{report}");
    assert_eq!(report.per_tokens.len(), tokens.len());
    for t in &report.per_tokens {
        assert_eq!(t.outputs.len(), 2);
        assert_eq!(t.outputs[0].shape, vec![t.tokens as usize, 512]);
        assert_eq!(t.outputs[1].shape, vec![t.tokens as usize, 256]);
        assert_eq!(t.outputs[0].elements, t.tokens * 512 * u64::from(W));
        for o in &t.outputs {
            assert!(o.passed);
            assert_eq!((o.bit_mismatches, o.max_ulp), (0, 0));
        }
    }

    // The values are real: finite, not all zero; the final norm is replicated
    // across ranks (it follows the all-reduces) while the logits of the
    // vocab-parallel lm_head shards differ.
    let b = bind_tokens(&original, 8).unwrap();
    let inputs = random_inputs(&original, W, &b, 7).unwrap();
    let e = evaluate(&original, W, &b, &inputs).unwrap();
    let logits = &e.outputs[0];
    let norm = &e.outputs[1];
    for r in 0..W as usize {
        let l = logits[r].f32s().unwrap();
        assert!(l.iter().all(|v| v.is_finite()));
        assert!(l.iter().any(|&v| v != 0.0));
        assert_eq!(norm[r], norm[0], "final norm identical on every rank");
        let n = norm[r].f32s().unwrap();
        // RMSNorm output with weights in [-2, 2): mean square of y / w is ~1.
        assert!(n.iter().all(|v| v.is_finite() && v.abs() < 64.0));
    }
    assert_ne!(logits[0], logits[1]);
    let l2 = evaluate(&build_model(&c, 64, true), W, &b, &inputs).unwrap();
    assert_eq!(l2.outputs, e.outputs);
}

#[test]
fn bf16_model_original_and_hand_fused_forms_are_bit_identical() {
    run(DType::Bf16, false);
}

#[test]
fn fp8_model_original_and_hand_fused_forms_are_bit_identical() {
    run(DType::Bf16, true);
}

#[test]
fn f16_model_original_and_hand_fused_forms_are_bit_identical() {
    run(DType::F16, false);
}
