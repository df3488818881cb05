//! Property tests: every planned T fits its buffer, the range representation agrees
//! with the per-T rule, arfuse's workspace is exactly what its dispatch uses, and absurd
//! inputs give errors instead of panics.
//!
//! The expected strategy of every T is computed here from domain.md §4-§5 (the tables
//! and formulas restated below), not with the planner's own functions.

use arfuse_policy::{
    plan, required_bytes, resolve_backend, ActDtype, Backend, Interconnect, KernelLibrary,
    RequestedBackend, Strategy, Target, Workspace,
};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

/// vLLM's trtllm one-shot bounds (domain.md §4), MiB of per-rank input, x2 to stay
/// integral: (SM, W, 2 * MiB).
const TRTLLM_ONE_SHOT_HALF_MIB: [(u32, u32, u64); 12] = [
    (90, 2, 64),
    (90, 4, 4),
    (90, 8, 1),
    (100, 2, 64),
    (100, 4, 8),
    (100, 8, 2),
    (103, 2, 64),
    (103, 4, 8),
    (103, 8, 4),
    (107, 2, 64),
    (107, 4, 8),
    (107, 8, 4),
];

/// The preferred strategy of domain.md §4: arfuse's kernels and FlashInfer's mnnvl use
/// the Lamport rule (one-shot iff T*H*W*e <= 1 MiB); FlashInfer's trtllm uses vLLM's
/// table (one-shot iff T*H*e <= bound; no entry: one-shot).
fn expected_preference(
    k: KernelLibrary,
    b: Backend,
    sm: u32,
    w: u32,
    h: u64,
    e: u64,
    t: u64,
) -> Strategy {
    let one = |yes: bool| {
        if yes {
            Strategy::OneShot
        } else {
            Strategy::TwoShot
        }
    };
    match (k, b) {
        (KernelLibrary::Flashinfer, Backend::Trtllm) => {
            match TRTLLM_ONE_SHOT_HALF_MIB
                .iter()
                .find(|x| x.0 == sm && x.1 == w)
            {
                Some(&(_, _, half_mib)) => one(2 * t * h * e <= half_mib * MIB),
                None => Strategy::OneShot,
            }
        }
        _ => one(t * h * u64::from(w) * e <= MIB),
    }
}

/// Bytes of one call (domain.md §5): one-shot T*H*W*e; two-shot 2*ceil(T/W)*W*H*e in a
/// Lamport buffer, W*T*H*e in FlashInfer trtllm's comm buffer.
fn expected_bytes(
    k: KernelLibrary,
    b: Backend,
    s: Strategy,
    w: u32,
    h: u64,
    e: u64,
    t: u64,
) -> u64 {
    let w = u64::from(w);
    match (k, b, s) {
        (_, _, Strategy::OneShot) => t * h * w * e,
        (KernelLibrary::Flashinfer, Backend::Trtllm, Strategy::TwoShot) => w * t * h * e,
        (_, _, Strategy::TwoShot) => 2 * t.div_ceil(w) * w * h * e,
        (_, _, Strategy::Unfused) => 0,
    }
}

fn target(sm: u32, w: u32, multicast: bool, dtype: ActDtype, mbt: u64) -> Target {
    Target {
        sm,
        world_size: w,
        group_nodes: 1,
        gpus_per_node: w,
        multicast_all_ranks: multicast,
        interconnect: Interconnect::Nvswitch,
        dtype,
        max_batched_tokens: mbt,
        capture_sizes: vec![1, 2, 4, 8, 16, 24, 32, 40, 48, 512],
        compile_range_boundaries: vec![],
        num_speculative_tokens: 0,
        deterministic: false,
        unfused_all_reduce: arfuse_policy::UnfusedAllReduce::Arfuse,
        requested_backend: RequestedBackend::Auto,
        kernels: KernelLibrary::Arfuse,
        max_bytes_override: None,
    }
}

fn other(s: Strategy) -> Strategy {
    if s == Strategy::OneShot {
        Strategy::TwoShot
    } else {
        Strategy::OneShot
    }
}

fn dtype_strategy() -> impl proptest::strategy::Strategy<Value = ActDtype> {
    prop_oneof![
        Just(ActDtype::Bf16),
        Just(ActDtype::F16),
        Just(ActDtype::F32)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// SM in {90,100,103,107}, W in {2,4,8,16}, H = 256..=16384 step 128, both kernel
    /// libraries, every T up to max_token_num (and beyond, to the end of the plan).
    #[test]
    fn every_planned_t_fits_its_buffer(
        sm in prop::sample::select(vec![90u32, 100, 103, 107]),
        w in prop::sample::select(vec![2u32, 4, 8, 16]),
        k in 0u64..=126,
        multicast in any::<bool>(),
        dtype in dtype_strategy(),
        mbt in prop::sample::select(vec![1u64, 7, 64, 8192, 100_000]),
        kernels in prop::sample::select(vec![KernelLibrary::Arfuse, KernelLibrary::Flashinfer]),
    ) {
        let h = 256 + 128 * k;
        let e = dtype.element_bytes();
        let mut t = target(sm, w, multicast, dtype, mbt);
        t.kernels = kernels;
        let p = plan(&t, &[h]).unwrap();
        prop_assert!(p.verify_own().is_empty(), "{:?}", p.verify_own());
        let Some(backend) = p.backend() else {
            // Only a missing table entry (SM 90 / 107 at W=16) stops fusion here.
            prop_assert!(w == 16 && (sm == 90 || sm == 107), "{}", p.decision);
            prop_assert!(p.decision.reason().contains("no entry"));
            return Ok(());
        };
        prop_assert_eq!(Some(backend), resolve_backend(&t).unwrap().backend());
        let ws = p.workspace.clone().unwrap();
        prop_assert_eq!(ws.kernels, kernels);
        let m = p.max_token_num;
        prop_assert!(m >= 1 && m <= mbt);
        let available = |s: Strategy| match (kernels, backend, s) {
            (KernelLibrary::Flashinfer, Backend::Trtllm, Strategy::TwoShot) => ws.comm_buffer_bytes,
            _ => ws.lamport_buffer_bytes,
        };
        let mut largest_call = 0u64;
        for tok in 1..=p.max_planned_tokens.min(m + 64) {
            let s = p.strategy_for(tok).unwrap();
            let expected = if tok > m {
                Strategy::Unfused
            } else {
                let fits = |s: Strategy| {
                    // FlashInfer's two-shot needs T >= W; arfuse's runs any T.
                    let below_w = s == Strategy::TwoShot && tok < u64::from(w);
                    !(below_w && kernels == KernelLibrary::Flashinfer)
                        && expected_bytes(kernels, backend, s, w, h, e, tok) <= available(s)
                };
                let pref = expected_preference(kernels, backend, sm, w, h, e, tok);
                if fits(pref) {
                    pref
                } else if fits(other(pref)) {
                    other(pref)
                } else {
                    Strategy::Unfused
                }
            };
            prop_assert_eq!(s, expected, "T={}", tok);
            if s.is_fused() {
                largest_call = largest_call.max(expected_bytes(kernels, backend, s, w, h, e, tok));
            }
        }
        prop_assert!(largest_call > 0);
        match kernels {
            // arfuse allocates exactly what it dispatches: one buffer, the largest
            // call rounded up to 128 bytes, and every T up to M is fused (a one-shot
            // call of M tokens is at most 64 MiB * 16 ranks, far under the buffer limit).
            KernelLibrary::Arfuse => {
                prop_assert_eq!(ws.lamport_buffer_bytes, largest_call.div_ceil(128) * 128);
                prop_assert_eq!(ws.total_bytes_per_rank, 256 + 3 * ws.lamport_buffer_bytes);
                for tok in 1..=m {
                    prop_assert!(p.strategy_for(tok).unwrap().is_fused(), "T={}", tok);
                }
                // Never more than FlashInfer's sizing for the same M: both hold the same
                // largest call (FlashInfer's buffer reserves one-shot to the AUTO
                // threshold and two-shot to M; arfuse's only what the rule picks), and
                // arfuse's 256-byte state plus rounding to 128 stays under FlashInfer's
                // 2,048-byte signal pad plus rounding to 32.
                let fi = p.flashinfer_workspace.clone().unwrap();
                let fi_plan = plan(&Target { kernels: KernelLibrary::Flashinfer, ..t.clone() }, &[h])
                    .unwrap();
                prop_assert_eq!(fi_plan.workspace.as_ref(), Some(&fi));
                prop_assert!(ws.total_bytes_per_rank <= fi.total_bytes_per_rank,
                    "arfuse {} > FlashInfer {}", ws, fi);
            }
            // FlashInfer's sizing fuses every T up to M, except T < W beyond what one
            // buffer holds for one-shot (two-shot cannot run there; the formula only
            // reserves one-shot room up to the AUTO threshold).
            KernelLibrary::Flashinfer => {
                prop_assert_eq!(ws.lamport_buffer_bytes % 32, 0);
                let one_shot_cap = ws.lamport_buffer_bytes / (h * u64::from(w) * e);
                for tok in 1..=m {
                    let gap = tok < u64::from(w) && tok > one_shot_cap;
                    prop_assert_eq!(p.strategy_for(tok).unwrap().is_fused(), !gap, "T={}", tok);
                }
            }
        }
    }

    #[test]
    fn deterministic_plans_use_one_strategy(
        sm in prop::sample::select(vec![90u32, 100, 103, 107]),
        w in prop::sample::select(vec![2u32, 4, 8, 16]),
        k in 0u64..=126,
        multicast in any::<bool>(),
        mbt in 1u64..=256,
    ) {
        let mut t = target(sm, w, multicast, ActDtype::Bf16, mbt);
        t.capture_sizes.retain(|&c| c <= mbt);
        t.deterministic = true;
        // FlashInfer's kernels: one strategy for every T, or no fusion.
        t.kernels = KernelLibrary::Flashinfer;
        let p = plan(&t, &[256 + 128 * k, 256]).unwrap();
        let mut used: Vec<Strategy> =
            p.sites.iter().flat_map(|s| s.ranges.iter().map(|r| r.strategy)).collect();
        used.sort();
        used.dedup();
        prop_assert_eq!(used.len(), 1);
        prop_assert!(p.verify_own().is_empty());
        // arfuse's kernels: the non-deterministic dispatch, batch-invariant whenever
        // it fuses.
        t.kernels = KernelLibrary::Arfuse;
        let d = plan(&t, &[256 + 128 * k, 256]).unwrap();
        t.deterministic = false;
        let n = plan(&t, &[256 + 128 * k, 256]).unwrap();
        prop_assert_eq!(&d.sites, &n.sites);
        prop_assert_eq!(d.batch_invariant, d.backend().is_some());
        prop_assert!(d.verify_own().is_empty());
    }

    /// Arbitrary (absurd) numbers: errors or sound plans, never a panic or overflow.
    #[test]
    fn absurd_inputs_never_panic(
        sm in prop::sample::select(vec![0u32, 90, 100, 103, 120, u32::MAX]),
        w in prop::sample::select(vec![0u32, 1, 2, 8, 16, 64, 65, u32::MAX]),
        h in prop::sample::select(vec![0u64, 1, 8, 256, 4096, 65_536, 1 << 40, u64::MAX]),
        mbt in prop::sample::select(vec![0u64, 1, 8192, u64::MAX / 3, u64::MAX]),
        cap in prop::option::of(prop::sample::select(vec![0u64, 1, 1 << 30, u64::MAX])),
        capture in prop::sample::select(vec![0u64, 1, 1 << 62, u64::MAX]),
        spec in prop::sample::select(vec![0u64, 3, u64::MAX]),
        t in any::<u64>(),
        multicast in any::<bool>(),
    ) {
        let mut target = target(sm, w, multicast, ActDtype::Bf16, mbt);
        target.gpus_per_node = w.max(1);
        target.capture_sizes = vec![capture];
        target.num_speculative_tokens = spec;
        target.max_bytes_override = cap;
        if let Ok(p) = plan(&target, &[h]) {
            prop_assert!(p.verify_own().is_empty());
            let _ = p.strategy_for(t);
            let _ = p.dispatch_for_hidden(h / 2);
        }
        if w == 0 || h == 0 || h == 1 << 40 || h == u64::MAX {
            prop_assert!(plan(&target, &[h]).is_err());
        }
        for s in [Strategy::OneShot, Strategy::TwoShot, Strategy::Unfused] {
            for b in [Backend::Mnnvl, Backend::Trtllm] {
                for k in [KernelLibrary::Arfuse, KernelLibrary::Flashinfer] {
                    let r = required_bytes(k, b, s, t, h, w, ActDtype::F32);
                    if t == 0 || w == 0 || h == 0 {
                        prop_assert!(r.is_err());
                    }
                }
            }
        }
        let _ = Workspace::flashinfer_mnnvl(w, h, ActDtype::F32, t);
        let _ = Workspace::flashinfer_trtllm(w, h, ActDtype::F32, t);
        let _ = Workspace::flashinfer_mnnvl_from_allocation(w, h, ActDtype::Bf16, t);
        if let Ok(ws) = Workspace::arfuse(Backend::Mnnvl, w, h, ActDtype::F32, None, t) {
            prop_assert!(ws.problems().is_empty());
            let _ = ws.capacity_tokens(Strategy::TwoShot, h);
        }
    }
}
