//! The host model of the one-shot and two-shot protocols against arfuse-reference's
//! rounding contract (clause 1: fp32 sum in rank order from +0.0, one rounding to T).

use arfuse_reference::contract;
use arfuse_reference::numerics::FloatFormat;
use arfuse_runtime::protocol::model_allreduce;
use arfuse_runtime::variants::Strategy;
use half::bf16;

/// Deterministic bf16 inputs with the edge values the protocols must survive:
/// -0.0 (the empty sentinel), negative subnormals (a float compare under FTZ would
/// take them for the sentinel), and ordinary values of mixed sign.
fn inputs(world: usize, tokens: usize, hidden: usize, seed: u64) -> Vec<Vec<bf16>> {
    let mut s = seed | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    (0..world)
        .map(|_| {
            (0..tokens * hidden)
                .map(|_| match next() % 8 {
                    0 => bf16::from_bits(0x8000),                             // -0.0
                    1 => bf16::from_bits(0x8000 | (next() % 127 + 1) as u16), // negative subnormal
                    _ => bf16::from_f32(((next() % 2001) as f32 - 1000.0) / 64.0),
                })
                .collect()
        })
        .collect()
}

#[test]
fn protocol_model_matches_the_contract_bit_for_bit() {
    let hidden = 256;
    for world in [2usize, 4, 8] {
        for tokens in [1usize, 7, 16, 40] {
            let x = inputs(world, tokens, hidden, (world * 1000 + tokens) as u64);
            let wide: Vec<Vec<f32>> = x
                .iter()
                .map(|r| r.iter().map(|v| v.to_f32()).collect())
                .collect();
            let refs: Vec<&[f32]> = wide.iter().map(Vec::as_slice).collect();
            let want = contract::all_reduce(&refs, FloatFormat::Bf16).unwrap();
            for strategy in [Strategy::OneShot, Strategy::TwoShot] {
                let got = model_allreduce(strategy, hidden, &x).unwrap();
                assert_eq!(got.len(), want.len());
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        bf16::from_f32(*w).to_bits(),
                        "W={world} T={tokens} {strategy:?} element {i}: model {g}, contract {w}"
                    );
                }
            }
        }
    }
}

#[test]
fn all_negative_zero_inputs_reduce_to_positive_zero_in_both() {
    let x = vec![vec![bf16::from_bits(0x8000); 256]; 4];
    let got = model_allreduce(Strategy::OneShot, 256, &x).unwrap();
    let z = vec![-0.0f32; 256];
    let want = contract::all_reduce(&[&z, &z, &z, &z], FloatFormat::Bf16).unwrap();
    assert!(got.iter().all(|v| v.to_bits() == 0x0000));
    assert!(want.iter().all(|v| v.to_bits() == 0));
}
