//! Property: a random stack of fusion sites written as the unfused chain
//! (all_reduce -> add / fused_add_rms_norm -> rms_norm -> quant op) and the
//! same stack written with `fused_allreduce_norm` nodes are bit-exact under
//! the arfuse rounding contract v1, for every token count issue 5 names, on
//! every rank; and both forms have the same number of collectives.

mod common;

use arfuse_ir::{DType, FusedOutput, FusedQuant};
use arfuse_reference::{check_equivalent, equivalence_token_counts};
use common::{build_stack, count_collectives, quant_kinds, Site, Stack};
use proptest::prelude::*;

fn site_strategy() -> impl Strategy<Value = Site> {
    (
        any::<bool>(),
        0..quant_kinds().len(),
        any::<bool>(),
        any::<bool>(),
        proptest::collection::vec(any::<bool>(), 4),
        prop_oneof![Just(1e-5), Just(1e-6)],
    )
        .prop_map(|(residual, qi, gemma, use_fused_add, live_bits, eps)| {
            let quant = quant_kinds()[qi];
            // Gemma (f32 weight, weight_bias 1) is fused without a quant (domain.md section 2).
            let gemma = gemma && quant == FusedQuant::None;
            let mut live: Vec<FusedOutput> = [
                FusedOutput::Norm,
                FusedOutput::Residual,
                FusedOutput::Quant,
                FusedOutput::Scale,
            ]
            .into_iter()
            .zip(live_bits)
            .filter(|&(o, on)| {
                on && match o {
                    FusedOutput::Quant => quant != FusedQuant::None,
                    FusedOutput::Scale => {
                        !matches!(quant, FusedQuant::None | FusedQuant::Fp8Static)
                    }
                    _ => true,
                }
            })
            .map(|(o, _)| o)
            .collect();
            if live.is_empty() {
                live.push(if quant == FusedQuant::None {
                    FusedOutput::Norm
                } else {
                    FusedOutput::Quant
                });
            }
            Site {
                residual,
                quant,
                gemma,
                use_fused_add,
                live,
                eps,
            }
        })
}

fn stack_strategy() -> impl Strategy<Value = Stack> {
    (
        prop_oneof![Just(DType::Bf16), Just(DType::F16), Just(DType::F32)],
        prop_oneof![Just(256u64), Just(384), Just(512), Just(1024)],
        proptest::collection::vec(site_strategy(), 1..4),
    )
        .prop_map(|(dtype, hidden, sites)| Stack {
            dtype,
            hidden,
            sites,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    #[test]
    fn fused_node_matches_the_unfused_chain_bit_exactly(
        stack in stack_strategy(),
        w in prop_oneof![Just(2u32), Just(4), Just(8)],
        max_fused in 3u64..20,
        seed in any::<u64>(),
    ) {
        let tokens = equivalence_token_counts(w, max_fused).unwrap();
        let t_max = *tokens.iter().max().unwrap();
        let chain = build_stack(&stack, t_max, false);
        let fused = build_stack(&stack, t_max, true);
        prop_assert_eq!(count_collectives(&chain), count_collectives(&fused));
        prop_assert_eq!(count_collectives(&fused), stack.sites.len());
        let report = check_equivalent(&chain, &fused, w, &tokens, seed).unwrap();
        prop_assert!(report.is_equivalent(), "{}", report);
        prop_assert!(report.is_bit_exact(), "{}", report);
        for t in &report.per_tokens {
            for o in &t.outputs {
                prop_assert!(o.passed);
                prop_assert!(o.elements > 0);
            }
        }
    }
}

#[test]
fn token_counts_cover_the_issue_cases() {
    // W = 4, largest fused T = 73 (DeepSeek H = 7168 on SM100 W = 8 in domain.md uses 73).
    assert_eq!(
        equivalence_token_counts(4, 73).unwrap(),
        vec![1, 3, 4, 72, 73, 74]
    );
    assert_eq!(
        equivalence_token_counts(8, 32).unwrap(),
        vec![1, 7, 8, 24, 32, 33]
    );
    assert_eq!(equivalence_token_counts(2, 1).unwrap(), vec![1, 2]);
    assert!(equivalence_token_counts(0, 8).is_err());
    assert!(equivalence_token_counts(2, u64::MAX).is_err());
}
