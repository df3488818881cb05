//! Batch invariance of arfuse's kernels (issue 17), on the host device (the real kernel
//! sources compiled for the CPU, every rank its own launch stream):
//!
//! - one-shot, two-shot and the unfused path (virtual all-reduce + local kernel) write
//!   the same bits for the same inputs, for every pattern, dtype and W in {2, 4, 8};
//! - a token's outputs do not depend on the batch around it: row i of a call with
//!   T = 42 tokens equals the same row computed alone (T = 1) and at another position of
//!   a call with T' = 7, on every strategy;
//! - the bits do not depend on how the W ranks' launches interleave (three seeded
//!   skews with stalls at stores and fences).
//!
//! The contract's reduction order makes this hold by construction (rank order from
//! +0.0 for the all-reduce on every path; the RMSNorm sum in the kernels' block tree,
//! a function of H only; quant maxima are exact); these tests check that the kernels
//! really do it.

mod common;

use arfuse_runtime::check::{self, Case, Inputs, Liveness, RankOutputs};
use arfuse_runtime::host::cases::{self, CaseIo};
use arfuse_runtime::host::{Build, Compiler, HostKernel, HostWorkspace, LaunchOptions};
use arfuse_runtime::variants::{self, ActDtype, Epilogue, Quant, Strategy, Variant};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

const HIDDEN: u32 = 256;
const T_BATCH: u32 = 42;
const T_OTHER: u32 = 7;
/// Rows of the T = 42 call checked alone and inside the T' = 7 call.
const ROWS: [u32; 2] = [17, 41];
const MAX_CTAS: u32 = 4;

fn compiler() -> &'static Compiler {
    static C: OnceLock<Compiler> = OnceLock::new();
    C.get_or_init(common::new_compiler)
}

fn case(world: u32, dtype: ActDtype, epilogue: Epilogue, strategy: Strategy, tokens: u32) -> Case {
    common::weight_form_case(world, dtype, epilogue, strategy, tokens, HIDDEN)
}

/// Rows `rows` of `inputs` (a `[T, H]` case) as the inputs of a `rows.len()`-token call.
fn rows_of(c: &Case, inputs: &Inputs, rows: &[u32]) -> Inputs {
    let row = c.hidden as usize * (c.dtype.element_bytes() as usize);
    let pick = |t: &Vec<u8>| -> Vec<u8> {
        rows.iter()
            .flat_map(|&i| t[i as usize * row..(i as usize + 1) * row].iter().copied())
            .collect()
    };
    Inputs {
        x: inputs.x.iter().map(pick).collect(),
        residual: inputs.residual.iter().map(pick).collect(),
        gamma: inputs.gamma.clone(),
        scale_in: inputs.scale_in,
    }
}

/// Bytes of token `i` of every per-token output of one rank: `out`, `residual_out`,
/// quant data, and the scales of the row-major scale layouts (the packed UE8M0 and
/// swizzled NVFP4 layouts interleave tokens; they are compared with the contract
/// exactly by host_kernels, and the contract computes each token on its own).
fn token_bytes(c: &Case, o: &RankOutputs, i: u32) -> Vec<u8> {
    let t = c.tokens as usize;
    let i = i as usize;
    let mut out = Vec::new();
    for buf in [&o.out, &o.residual_out, &o.quant] {
        if !buf.is_empty() {
            let per = buf.len() / t;
            out.extend_from_slice(&buf[i * per..(i + 1) * per]);
        }
    }
    let row_major_scales = match c.epilogue.quant {
        Quant::Fp8PerToken | Quant::Nvfp4(arfuse_runtime::variants::Nvfp4ScaleLayout::Linear) => {
            true
        }
        Quant::Fp8Group(layout) => layout != arfuse_ir::GroupScaleLayout::PackedUe8m0,
        _ => false,
    };
    if row_major_scales && !o.scale.is_empty() {
        let per = o.scale.len() / t;
        out.extend_from_slice(&o.scale[i * per..(i + 1) * per]);
    }
    out
}

struct Kernels(HashMap<Variant, Arc<HostKernel>>);

impl Kernels {
    fn fused(&self, c: &Case) -> &HostKernel {
        &self.0[&c.variant()]
    }
    fn unfused(&self, c: &Case) -> (&HostKernel, Option<&HostKernel>) {
        let ar = &self.0[&variants::virtual_allreduce(c.world, c.dtype)];
        let local = cases::local_variant(c).map(|v| &*self.0[&v]);
        (ar, local)
    }
}

fn run(
    k: &Kernels,
    ws: &mut HostWorkspace,
    c: &Case,
    inputs: &Inputs,
    unfused: bool,
    seed: u64,
) -> Vec<RankOutputs> {
    let mut io = CaseIo::new(c, inputs).expect("buffers");
    let opts = LaunchOptions::skewed(seed, Duration::from_micros(200)).with_chaos(5);
    if unfused {
        let (ar, local) = k.unfused(c);
        cases::run_unfused(ar, local, &mut io, MAX_CTAS, &opts).expect("unfused path")
    } else {
        let live = Liveness::all(c).expect("liveness");
        cases::run_fused(k.fused(c), ws, &mut io, live, MAX_CTAS, &opts)
            .unwrap_or_else(|e| panic!("{}: {e}", c.label()))
    }
}

/// Every check of this file for one (W, dtype, epilogue); returns what failed.
fn check_one(k: &Kernels, world: u32, dtype: ActDtype, e: Epilogue) -> Vec<String> {
    let mut bad = Vec::new();
    let mut ws =
        HostWorkspace::create(&check::workspace_for(world, dtype, HIDDEN, T_BATCH).unwrap())
            .expect("workspace");
    let one = case(world, dtype, e, Strategy::OneShot, T_BATCH);
    let two = Case {
        strategy: Strategy::TwoShot,
        ..one
    };
    let inputs = check::make_inputs(&one, 0xbad5eed ^ u64::from(world)).expect("inputs");
    let reference = run(k, &mut ws, &one, &inputs, false, 1);
    let label = one.label().replace("oneshot ", "");
    // The three paths, and one-shot under two more launch interleavings.
    for (what, c, unfused, seed) in [
        ("two-shot", two, false, 2),
        ("unfused path", one, true, 3),
        ("one-shot, another skew", one, false, 4),
        ("two-shot, another skew", two, false, 5),
    ] {
        if run(k, &mut ws, &c, &inputs, unfused, seed) != reference {
            bad.push(format!("{label}: {what} differs from one-shot"));
        }
    }
    // Batch invariance: each checked row alone, and first in a call of T' rows.
    for &i in &ROWS {
        let others: Vec<u32> = std::iter::once(i)
            .chain((1..T_OTHER).map(|d| (i + 5 * d) % T_BATCH))
            .collect();
        for (rows, strategy) in [
            (vec![i], Strategy::OneShot),
            (vec![i], Strategy::TwoShot),
            (others.clone(), Strategy::OneShot),
            (others, Strategy::TwoShot),
        ] {
            let c = case(world, dtype, e, strategy, rows.len() as u32);
            let got = run(
                k,
                &mut ws,
                &c,
                &rows_of(&one, &inputs, &rows),
                false,
                6 + u64::from(i),
            );
            for r in 0..world as usize {
                if token_bytes(&c, &got[r], 0) != token_bytes(&one, &reference[r], i) {
                    bad.push(format!(
                        "{label}: row {i} at T={} ({}) differs from the T={T_BATCH} call, rank {r}",
                        rows.len(),
                        strategy.name()
                    ));
                }
            }
        }
    }
    bad
}

#[test]
fn every_path_and_every_batch_gives_a_row_the_same_bits() {
    let t0 = Instant::now();
    let mut combos = Vec::new();
    for world in [2u32, 4, 8] {
        for dtype in ActDtype::ALL {
            for e in variants::all_epilogues() {
                if case(world, dtype, e, Strategy::OneShot, T_BATCH)
                    .validate()
                    .is_ok()
                {
                    combos.push((world, dtype, e));
                }
            }
        }
    }
    let mut vs: Vec<Variant> = Vec::new();
    for &(world, dtype, e) in &combos {
        let one = case(world, dtype, e, Strategy::OneShot, T_BATCH);
        vs.push(one.variant());
        vs.push(
            Case {
                strategy: Strategy::TwoShot,
                ..one
            }
            .variant(),
        );
        vs.push(variants::virtual_allreduce(world, dtype));
        vs.extend(cases::local_variant(&one));
    }
    vs.sort();
    vs.dedup();
    let built = compiler()
        .kernels(&vs, Build::Plain, 2)
        .unwrap_or_else(|e| panic!("host build failed: {e}"));
    let k = Kernels(vs.iter().copied().zip(built).collect());
    let mut bad = Vec::new();
    for &(world, dtype, e) in &combos {
        bad.extend(check_one(&k, world, dtype, e));
    }
    println!(
        "{} (W, dtype, epilogue) combinations, {} variants, in {:.1} s",
        combos.len(),
        vs.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        bad.is_empty(),
        "{} failures:\n{}",
        bad.len(),
        bad.join("\n")
    );
    assert!(combos.len() >= 3 * (15 + 15 + 13) - 6, "{}", combos.len());
}
