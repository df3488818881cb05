//! The "done when" values of issue 3 (FlashInfer's kernels, whose formulas they are),
//! the same cases for arfuse's kernels (issue 13), one test each, plus the behaviours
//! around them.

use arfuse_policy::{
    plan, plan_with_workspace, preferred_strategy, resolve_backend, trtllm_lamport_max_tokens,
    verify, ActDtype, Backend, BackendDecision, DispatchRange, Interconnect, KernelLibrary,
    PolicyError, RequestedBackend, Strategy, Target, UnfusedAllReduce, Violation, Workspace,
    LAMPORT_MAX_COMM_BYTES, MIB,
};

fn preset(name: &str) -> Target {
    Target::preset(name).unwrap()
}

/// A preset planned for FlashInfer's kernels.
fn flashinfer(name: &str) -> Target {
    Target {
        kernels: KernelLibrary::Flashinfer,
        ..preset(name)
    }
}

/// (lo, hi, strategy) of every range, for compact assertions.
fn shape(ranges: &[DispatchRange]) -> Vec<(u64, u64, Strategy)> {
    ranges.iter().map(|r| (r.lo, r.hi, r.strategy)).collect()
}

#[test]
fn seed_h200_w8_h6144_plan_and_forced_one_shot_violation() {
    let target = flashinfer("h200-sxm-x8");
    let p = plan(&target, &[6144]).unwrap();
    assert_eq!(p.backend(), Some(Backend::Mnnvl));
    assert_eq!(p.max_token_num, 42);
    let ws = p.workspace.clone().unwrap();
    assert_eq!(ws.lamport_buffer_bytes, 1_179_648);
    assert_eq!(
        shape(p.dispatch()),
        vec![
            (1, 10, Strategy::OneShot),
            (11, 42, Strategy::TwoShot),
            (43, 8192, Strategy::Unfused),
        ]
    );
    // Every fused range fits ONE buffer.
    for r in p.dispatch().iter().filter(|r| r.strategy.is_fused()) {
        assert!(r.required_bytes_max <= ws.lamport_buffer_bytes, "{r}");
    }
    assert_eq!(p.dispatch()[0].required_bytes_max, 983_040);
    assert_eq!(p.dispatch()[1].required_bytes_max, 1_179_648);
    assert_eq!(p.strategy_for(40).unwrap(), Strategy::TwoShot);
    assert!(verify(&p, &ws).is_empty());

    // What the engine did: one-shot at the capture size T=40.
    let forced = p.with_strategy(40, 40, Strategy::OneShot).unwrap();
    let violations = verify(&forced, &ws);
    assert_eq!(
        violations,
        vec![Violation::Capacity {
            hidden: 6144,
            t_first: 40,
            t_last: 40,
            strategy: Strategy::OneShot,
            required_bytes: 3_932_160,
            required_bytes_max: 3_932_160,
            available_bytes: 1_179_648,
        }]
    );
    assert_eq!(
        violations[0].to_string(),
        "T=40 one-shot: required 3932160 bytes, buffer 1179648 bytes"
    );
    assert_eq!(ws.total_bytes_per_rank, 3_540_992);
    assert_eq!(p.flashinfer_workspace, None);
}

/// The seed case with arfuse's kernels: the same dispatch, in ONE buffer shared by both
/// strategies (983,040 bytes for one-shot at T=10, 1,179,648 for two-shot at T=42), so
/// 256 + 3 * 1,179,648 = 3,539,200 bytes per rank against FlashInfer's 3,540,992.
#[test]
fn seed_case_with_arfuse_kernels_allocates_what_it_dispatches() {
    let p = plan(&preset("h200-sxm-x8"), &[6144]).unwrap();
    assert_eq!(p.kernels, KernelLibrary::Arfuse);
    assert_eq!(p.max_token_num, 42);
    assert_eq!(
        shape(p.dispatch()),
        vec![
            (1, 10, Strategy::OneShot),
            (11, 42, Strategy::TwoShot),
            (43, 8192, Strategy::Unfused),
        ]
    );
    let ws = p.workspace.clone().unwrap();
    assert_eq!(ws.kernels, KernelLibrary::Arfuse);
    assert_eq!(ws.lamport_buffer_bytes, 1_179_648);
    assert_eq!(ws.total_bytes_per_rank, 3_539_200);
    let fi = p.flashinfer_workspace.clone().unwrap();
    assert_eq!(fi.total_bytes_per_rank, 3_540_992);
    // The forced one-shot at T=40 is refused by the same rule.
    let forced = p.with_strategy(40, 40, Strategy::OneShot).unwrap();
    assert_eq!(
        verify(&forced, &ws)[0].to_string(),
        "T=40 one-shot: required 3932160 bytes, buffer 1179648 bytes"
    );
    assert!(verify(&p, &ws).is_empty());
}

/// A decode-only engine (max 10 batched tokens) dispatches one-shot only: arfuse
/// allocates no two-shot room, while FlashInfer's formula sizes for two-shot at M.
#[test]
fn arfuse_allocates_only_what_the_plan_dispatches() {
    let mut t = preset("h200-sxm-x8");
    t.max_batched_tokens = 10;
    t.capture_sizes = vec![1, 2, 4, 8];
    let p = plan(&t, &[6144]).unwrap();
    assert_eq!(shape(p.dispatch()), vec![(1, 10, Strategy::OneShot)]);
    let ws = p.workspace.clone().unwrap();
    // One-shot at T=10: 10 * 6144 * 8 * 2.
    assert_eq!(ws.lamport_buffer_bytes, 983_040);
    assert_eq!(ws.total_bytes_per_rank, 256 + 3 * 983_040);
    // FlashInfer: max(10 * 98,304, 2 * ceil(10/8) * 8 * 12,288) = 983,040 too, plus its
    // 2,048-byte signal pad.
    let fi = p.flashinfer_workspace.unwrap();
    assert_eq!(fi.total_bytes_per_rank, 3 * 983_040 + 2048);
    // At T=3 only: 3 * 98,304 = 294,912 bytes, where FlashInfer sizes two-shot at M=3
    // (2 * 1 * 8 * 12,288 = 196,608) and one-shot (294,912): the same buffer.
    t.max_batched_tokens = 3;
    t.capture_sizes = vec![1, 2];
    let ws = plan(&t, &[6144]).unwrap().workspace.unwrap();
    assert_eq!(ws.lamport_buffer_bytes, 294_912);
}

#[test]
fn two_mib_allocation_buffer_698368_h7168() {
    let ws = Workspace::flashinfer_mnnvl_from_allocation(8, 7168, ActDtype::Bf16, 2 * MIB).unwrap();
    assert_eq!(ws.lamport_buffer_bytes, 698_368);
    assert_eq!(
        Workspace::flashinfer_mnnvl_from_buffer(8, 7168, ActDtype::Bf16, 698_368)
            .unwrap()
            .lamport_buffer_bytes,
        698_368
    );
    let target = flashinfer("h200-sxm-x8");
    let p = plan_with_workspace(&target, &[7168], &ws).unwrap();
    assert_eq!(p.max_token_num, 36);
    assert_eq!(
        shape(p.dispatch()),
        vec![
            (1, 6, Strategy::OneShot),
            (7, 7, Strategy::Unfused),
            (8, 24, Strategy::TwoShot),
            (25, 8192, Strategy::Unfused),
        ]
    );
    // The reasons say why T=7 and T > 24 are unfused, per sub-range.
    assert!(
        p.dispatch()[1].reason.contains("T >= W = 8"),
        "{}",
        p.dispatch()[1]
    );
    let tail = &p.dispatch()[3].reason;
    assert!(
        tail.contains("T=25..=36: ") && tail.contains("2*ceil(T/W)*W*H*e"),
        "{tail}"
    );
    assert!(tail.contains("T=37..=8192: T > max_token_num 36"), "{tail}");
    assert!(
        p.dispatch()[2].reason.contains("T=8..=9: "),
        "{}",
        p.dispatch()[2]
    );
    assert!(verify(&p, &ws).is_empty());

    // The automatic rule's choice at T=7 is one-shot; it does not fit.
    let auto = preferred_strategy(
        KernelLibrary::Flashinfer,
        Backend::Mnnvl,
        90,
        8,
        7168,
        ActDtype::Bf16,
        7,
    )
    .unwrap();
    assert_eq!(auto, Strategy::OneShot);
    let v = verify(&p.with_strategy(7, 7, auto).unwrap(), &ws);
    assert_eq!(v.len(), 1);
    assert_eq!(
        v[0].to_string(),
        "T=7 one-shot: required 802816 bytes, buffer 698368 bytes"
    );

    // Never "146 tokens" (whole allocation / bytes per token).
    let last_fused = p
        .dispatch()
        .iter()
        .filter(|r| r.strategy.is_fused())
        .map(|r| r.hi)
        .max();
    assert_eq!(last_fused, Some(24));
    assert_eq!(ws.capacity_tokens(Strategy::OneShot, 7168).unwrap(), 6);
    assert_ne!(ws.capacity_tokens(Strategy::TwoShot, 7168).unwrap(), 146);
}

fn trtllm_w2_f16_target() -> Target {
    Target::from_toml_str(
        r#"
        kernels = "flashinfer"
        sm = 90
        world_size = 2
        gpus_per_node = 8
        multicast_all_ranks = false
        interconnect = "nvswitch"
        dtype = "f16"
        max_batched_tokens = 200000
        max_bytes_override = 2147483648
        "#,
    )
    .unwrap()
}

#[test]
fn trtllm_h4096_fp16_w2_one_shot_up_to_130944_and_no_further() {
    assert_eq!(
        trtllm_lamport_max_tokens(2, 4096, ActDtype::F16).unwrap(),
        130_944
    );
    let p = plan(&trtllm_w2_f16_target(), &[4096]).unwrap();
    assert_eq!(p.backend(), Some(Backend::Trtllm));
    assert_eq!(p.max_token_num, 200_000);
    let ws = p.workspace.clone().unwrap();
    assert_eq!(ws.lamport_buffer_bytes, 2_145_386_496);
    assert!(p.notes.iter().any(|n| n.contains("clamped")));
    // vLLM's table (SM90 W=2: 32 MiB / 8192 bytes per token) prefers one-shot to 4096.
    assert_eq!(
        shape(p.dispatch()),
        vec![
            (1, 4096, Strategy::OneShot),
            (4097, 200_000, Strategy::TwoShot)
        ]
    );
    let ok = p.with_strategy(1, 130_944, Strategy::OneShot).unwrap();
    assert!(verify(&ok, &ws).is_empty());
    let too_far = p.with_strategy(1, 130_945, Strategy::OneShot).unwrap();
    let v = verify(&too_far, &ws);
    assert_eq!(v.len(), 1);
    match &v[0] {
        Violation::Capacity {
            t_first,
            required_bytes,
            available_bytes,
            ..
        } => {
            assert_eq!(*t_first, 130_945);
            assert_eq!(*required_bytes, 2 * 130_945 * 4096 * 2);
            assert_eq!(*available_bytes, 2_145_386_496);
        }
        other => panic!("unexpected {other}"),
    }
}

/// The same machine with arfuse's kernels: the Lamport rule prefers one-shot to T=64
/// (64 * 4096 * 2 * 2 = 1 MiB), two-shot then runs in the same buffer up to the largest
/// buffer the kernels allow: 2 * ceil(T/2) * 2 * 8192 <= 2,145,386,496 holds to
/// T = 130,944, the same limit, and everything above stays unfused.
#[test]
fn arfuse_kernels_on_trtllm_stop_two_shot_at_the_lamport_limit() {
    let mut t = trtllm_w2_f16_target();
    t.kernels = KernelLibrary::Arfuse;
    let p = plan(&t, &[4096]).unwrap();
    assert_eq!(p.backend(), Some(Backend::Trtllm));
    assert_eq!(
        shape(p.dispatch()),
        vec![
            (1, 64, Strategy::OneShot),
            (65, 130_944, Strategy::TwoShot),
            (130_945, 200_000, Strategy::Unfused),
        ]
    );
    let ws = p.workspace.clone().unwrap();
    assert_eq!(ws.lamport_buffer_bytes, LAMPORT_MAX_COMM_BYTES);
    assert_eq!(ws.comm_buffer_bytes, 0);
    assert!(
        p.dispatch()[2].reason.contains("2*ceil(T/W)*W*H*e"),
        "{}",
        p.dispatch()[2]
    );
    assert!(verify(&p, &ws).is_empty());
    // FlashInfer would allocate its comm buffer, flags and three clamped buffers.
    let fi = p.flashinfer_workspace.unwrap();
    assert_eq!(
        fi.total_bytes_per_rank,
        3_276_800_000 + 2 * 256 * 4 + 3 * LAMPORT_MAX_COMM_BYTES
    );
}

#[test]
fn h200_nvl_bridged_is_no_fusion_with_reason() {
    let p = plan(&preset("h200-nvl-x8"), &[8192]).unwrap();
    assert_eq!(p.backend(), None);
    assert!(p.decision.reason().contains("bridged NVLink"));
    assert!(p.workspace.is_none());
    assert_eq!(shape(p.dispatch()), vec![(1, 8192, Strategy::Unfused)]);
    assert!(p.dispatch()[0].reason.contains("bridged"));
    assert!(p.verify_own().is_empty());
}

#[test]
fn explicit_trtllm_on_two_nodes_is_an_error() {
    let mut t = preset("gb200-nvl72-2node-tp8");
    t.requested_backend = RequestedBackend::Trtllm;
    let err = plan(&t, &[7168]).unwrap_err();
    assert_eq!(err, PolicyError::TrtllmAcrossNodes { nodes: 2 });
    assert!(err.to_string().contains("mnnvl"));
}

#[test]
fn rtx_pro_6000_sm120_is_no_fusion_with_reason() {
    let p = plan(&preset("rtx-pro-6000-x4"), &[4096]).unwrap();
    assert_eq!(p.backend(), None);
    assert!(p.decision.reason().contains("SM 120"));
    assert_eq!(p.strategy_for(1).unwrap(), Strategy::Unfused);
}

fn gb300_w16() -> Target {
    Target::from_toml_str(
        r#"
        sm = 103
        world_size = 16
        group_nodes = 4
        gpus_per_node = 4
        multicast_all_ranks = true
        interconnect = "nvlink-fabric"
        max_batched_tokens = 8192
        "#,
    )
    .unwrap()
}

#[test]
fn sm103_w16_is_a_real_entry_not_a_skip() {
    let p = plan(&gb300_w16(), &[7168]).unwrap();
    assert_eq!(p.backend(), Some(Backend::Mnnvl));
    assert_eq!(p.max_bytes, Some(64 * MIB));
    assert_eq!(p.max_token_num, 4681);
    assert_eq!(p.strategy_for(1).unwrap(), Strategy::OneShot);
    assert_eq!(p.strategy_for(4681).unwrap(), Strategy::TwoShot);
    assert_eq!(p.strategy_for(4682).unwrap(), Strategy::Unfused);
    assert!(p.verify_own().is_empty());
}

#[test]
fn missing_table_entry_is_a_visible_reason() {
    let mut t = gb300_w16();
    t.sm = 107;
    let p = plan(&t, &[7168]).unwrap();
    assert_eq!(p.backend(), None);
    assert!(
        p.decision.reason().contains("no entry for SM 107 W=16"),
        "{}",
        p.decision
    );
    // The override supplies the missing value.
    t.max_bytes_override = Some(8 * MIB);
    let p = plan(&t, &[7168]).unwrap();
    assert_eq!(p.backend(), Some(Backend::Mnnvl));
    assert_eq!(p.max_token_num, 8 * MIB / (7168 * 2));
}

#[test]
fn deterministic_large_engine_plans_no_fusion_with_reason() {
    // FlashInfer's kernels: one-shot and two-shot reduce in different orders.
    let mut t = flashinfer("h200-sxm-x8");
    t.deterministic = true;
    let p = plan(&t, &[6144]).unwrap();
    assert_eq!(p.backend(), None);
    assert!(
        p.decision.reason().contains("deterministic"),
        "{}",
        p.decision
    );
}

#[test]
fn deterministic_decode_engine_is_one_shot_everywhere() {
    let mut t = flashinfer("h200-sxm-x8");
    t.deterministic = true;
    t.max_batched_tokens = 32;
    t.capture_sizes = vec![1, 2, 4, 8, 16, 24, 32];
    let p = plan(&t, &[6144, 4096]).unwrap();
    let ws = p.workspace.clone().unwrap();
    assert_eq!(ws.lamport_buffer_bytes, 32 * 6144 * 8 * 2);
    for site in &p.sites {
        assert_eq!(shape(&site.ranges), vec![(1, 32, Strategy::OneShot)]);
    }
    assert!(verify(&p, &ws).is_empty());
    assert!(p.batch_invariant);
    // A plan from outside that mixes orders is reported.
    let mixed = p.with_strategy(16, 32, Strategy::TwoShot).unwrap();
    assert!(verify(&mixed, &ws)
        .iter()
        .any(|v| matches!(v, Violation::MixedReductionOrders { .. })));
}

/// Issue 17: arfuse's kernels reduce in the contract's order on every strategy and on
/// arfuse-runtime's unfused path, so deterministic mode keeps the normal dispatch
/// (one-shot to T=16, two-shot to 64 at H=4096 on 8x H200) and says it is
/// batch-invariant; with the engine's all-reduce serving the unfused T it refuses,
/// naming the range and the fixes, unless the plan fuses every T.
#[test]
fn deterministic_arfuse_keeps_mixed_strategies_and_states_batch_invariance() {
    let mut t = preset("h200-sxm-x8");
    t.deterministic = true;
    let p = plan(&t, &[4096]).unwrap();
    assert_eq!(p.backend(), Some(Backend::Mnnvl));
    assert_eq!(
        shape(p.dispatch()),
        vec![
            (1, 16, Strategy::OneShot),
            (17, 64, Strategy::TwoShot),
            (65, 8192, Strategy::Unfused)
        ]
    );
    assert!(p.batch_invariant);
    assert!(
        p.notes
            .iter()
            .any(|n| n.starts_with("batch-invariant: one reduction order")),
        "{:?}",
        p.notes
    );
    assert!(p.verify_own().is_empty());
    // Not deterministic: the same dispatch, also batch-invariant.
    let mut nd = t.clone();
    nd.deterministic = false;
    let q = plan(&nd, &[4096]).unwrap();
    assert_eq!(q.sites, p.sites);
    assert!(q.batch_invariant);

    t.unfused_all_reduce = UnfusedAllReduce::Engine;
    let p = plan(&t, &[4096]).unwrap();
    assert_eq!(p.backend(), None);
    let why = p.decision.reason();
    assert!(
        why.contains("T=65..=8192 (H=4096) would run unfused through the engine's all-reduce")
            && why.contains("max_token_num 64")
            && why.contains("unfused_all_reduce = \"arfuse\""),
        "{why}"
    );
    // Bounded to the fused range, the engine's all-reduce never runs.
    t.max_batched_tokens = 64;
    t.capture_sizes.retain(|&c| c <= 64);
    let p = plan(&t, &[4096]).unwrap();
    assert!(p.batch_invariant && p.backend().is_some());
    assert_eq!(
        p.dispatch().last().map(|r| (r.hi, r.strategy)),
        Some((64, Strategy::TwoShot))
    );
    // Not deterministic with the engine's path: fused, but not batch-invariant.
    let mut nd = preset("h200-sxm-x8");
    nd.unfused_all_reduce = UnfusedAllReduce::Engine;
    let p = plan(&nd, &[4096]).unwrap();
    assert!(!p.batch_invariant && p.notes.iter().any(|n| n.starts_with("not batch-invariant")));
}

#[test]
fn deterministic_flashinfer_never_mixes_one_shot_and_two_shot() {
    for name in Target::preset_names() {
        for h in [2048u64, 4096, 6144, 7168, 8192, 16384] {
            for mbt in [8, 16, 64, 8192] {
                let mut t = flashinfer(name);
                t.deterministic = true;
                t.max_batched_tokens = mbt;
                t.capture_sizes.retain(|&c| c <= mbt);
                let p = plan(&t, &[h]).unwrap();
                let mut used: Vec<Strategy> = p
                    .sites
                    .iter()
                    .flat_map(|s| s.ranges.iter().map(|r| r.strategy))
                    .collect();
                used.sort();
                used.dedup();
                assert_eq!(used.len(), 1, "{name} H={h} mbt={mbt}: {used:?}");
            }
        }
    }
}

#[test]
fn absurd_inputs_are_errors() {
    let t = preset("h200-sxm-x8");
    assert!(matches!(
        plan(&t, &[1 << 40]),
        Err(PolicyError::InvalidHidden { hidden, .. }) if hidden == 1 << 40
    ));
    assert!(matches!(
        plan(&t, &[0]),
        Err(PolicyError::InvalidHidden { .. })
    ));
    assert!(matches!(
        plan(&t, &[]),
        Err(PolicyError::InvalidHidden { .. })
    ));
    let mut w0 = t.clone();
    w0.world_size = 0;
    assert!(matches!(
        plan(&w0, &[4096]),
        Err(PolicyError::InvalidField {
            field: "world_size",
            ..
        })
    ));
    let p = plan(&t, &[4096]).unwrap();
    assert!(matches!(
        p.strategy_for(0),
        Err(PolicyError::InvalidTokens { t: 0, .. })
    ));
    assert!(matches!(
        p.strategy_for(8193),
        Err(PolicyError::InvalidTokens { .. })
    ));
    assert!(p.with_strategy(0, 3, Strategy::OneShot).is_err());
    assert!(p.with_strategy(5, 3, Strategy::OneShot).is_err());
    // Enormous engine settings: an error or a sound plan, never a panic.
    let mut huge = t.clone();
    huge.max_batched_tokens = u64::MAX;
    huge.max_bytes_override = Some(u64::MAX);
    match plan(&huge, &[65_536]) {
        Ok(p) => assert!(p.verify_own().is_empty()),
        Err(e) => assert!(matches!(e, PolicyError::Overflow { .. }), "{e}"),
    }
}

#[test]
fn extra_points_are_checked_and_reported() {
    let mut t = preset("h200-sxm-x8");
    t.max_batched_tokens = 1024;
    t.num_speculative_tokens = 3;
    t.compile_range_boundaries = vec![42, 43, 4096];
    let p = plan(&t, &[6144]).unwrap();
    // 512 requests x (1 + 3) tokens = 2048 > 1024; the boundary 4096 as well.
    assert_eq!(p.max_planned_tokens, 4096);
    assert_eq!(p.dispatch().last().unwrap().hi, 4096);
    let spec = p.points.iter().find(|pt| pt.t == 2048).unwrap();
    assert!(spec.beyond_max_batched_tokens);
    assert_eq!(spec.strategy, Strategy::Unfused);
    assert!(p.notes.iter().any(|n| {
        n.contains(
        "T=2048 (speculative-decoding multiple of capture size 512) exceeds max_batched_tokens 1024"
    )
    }));
    let b42 = p.points.iter().find(|pt| pt.t == 42).unwrap();
    assert_eq!(b42.strategy, Strategy::TwoShot);
    let b43 = p.points.iter().find(|pt| pt.t == 43).unwrap();
    assert_eq!(b43.strategy, Strategy::Unfused);
    // Speculative multiples of small capture sizes: 2 requests -> 8 tokens.
    assert!(p.points.iter().any(|pt| pt.t == 8
        && pt.source == arfuse_policy::PointSource::SpeculativeDecode { capture_size: 2 }));
    assert!(p.verify_own().is_empty());
}

#[test]
fn shared_workspace_uses_the_widest_hidden_size() {
    let t = preset("h200-sxm-x8");
    // Target model H=4096 with a wider draft (H=6144): one workspace for both.
    let p = plan(&t, &[4096, 6144]).unwrap();
    assert_eq!(p.hidden(), 6144);
    assert_eq!(p.max_token_num, 42);
    assert_eq!(p.workspace.as_ref().unwrap().hidden, 6144);
    assert_eq!(p.sites.len(), 2);
    let narrow = p.dispatch_for_hidden(4096).unwrap();
    assert_eq!(narrow, p.sites[1].ranges);
    // At H=4096, one-shot reaches T <= 16 (16*4096*8*2 = 1 MiB).
    assert_eq!(narrow[0].hi, 16);
    assert_eq!(p.strategy_for_hidden(4096, 16).unwrap(), Strategy::OneShot);
    assert_eq!(p.strategy_for_hidden(4096, 17).unwrap(), Strategy::TwoShot);
    // A site not given at plan time but narrower is computed on demand.
    let r = p.dispatch_for_hidden(2048).unwrap();
    assert_eq!(r[0].strategy, Strategy::OneShot);
    assert_eq!(r.last().unwrap().hi, 8192);
    // A wider one must not share the workspace.
    assert!(matches!(
        p.dispatch_for_hidden(8192),
        Err(PolicyError::WorkspaceMismatch { .. })
    ));
    // A target-sized workspace given from outside is refused for the wider draft.
    let target_sized =
        Workspace::arfuse(Backend::Mnnvl, 8, 4096, ActDtype::Bf16, Some(42), 1_048_576).unwrap();
    assert!(matches!(
        plan_with_workspace(&t, &[4096, 6144], &target_sized),
        Err(PolicyError::WorkspaceMismatch { .. })
    ));
    // ...and verify() catches a plan checked against it.
    assert!(verify(&p, &target_sized)
        .iter()
        .any(|v| matches!(v, Violation::Workspace { .. })));
}

#[test]
fn verify_reports_malformed_outside_plans() {
    let p = plan(&preset("h200-sxm-x8"), &[6144]).unwrap();
    let ws = p.workspace.clone().unwrap();

    // Two-shot below W: FlashInfer's kernels cannot, arfuse's Lamport two-shot can.
    assert!(verify(&p.with_strategy(3, 12, Strategy::TwoShot).unwrap(), &ws).is_empty());
    let fi = plan(&flashinfer("h200-sxm-x8"), &[6144]).unwrap();
    let fi_ws = fi.workspace.clone().unwrap();
    let v = verify(&fi.with_strategy(3, 12, Strategy::TwoShot).unwrap(), &fi_ws);
    assert!(v.contains(&Violation::TwoShotBelowWorldSize {
        hidden: 6144,
        t_first: 3,
        t_last: 7,
        world_size: 8
    }));

    // Fused above max_token_num.
    let v = verify(&p.with_strategy(40, 50, Strategy::TwoShot).unwrap(), &ws);
    assert!(v.iter().any(|x| matches!(
        x,
        Violation::AboveMaxTokenNum {
            t_first: 43,
            t_last: 50,
            max_token_num: 42,
            ..
        }
    )));

    // A gap, an overlap and a wrong stated size.
    let mut bad = p.clone();
    bad.sites[0].ranges.remove(1);
    bad.sites[0].ranges[0].hi = 13;
    bad.sites[0].ranges[0].required_bytes_max = 5;
    let v = verify(&bad, &ws);
    assert_eq!(v.len(), 3, "{v:?}");
    assert!(v.contains(&Violation::NotCovered {
        hidden: 6144,
        t_first: 14,
        t_last: 42
    }));
    assert!(v.iter().any(|x| matches!(
        x,
        Violation::WrongRequiredBytes {
            stated_bytes: 5,
            actual_bytes: 1_277_952,
            ..
        }
    )));
    // One-shot holds 12 tokens of H=6144 in 1,179,648 bytes; T=13 needs 1,277,952.
    assert!(v.iter().any(|x| matches!(
        x,
        Violation::Capacity {
            t_first: 13,
            t_last: 13,
            required_bytes: 1_277_952,
            ..
        }
    )));
    let mut overlap = p.clone();
    overlap.sites[0].ranges[1].lo = 9;
    assert!(verify(&overlap, &ws).iter().any(|x| matches!(
        x,
        Violation::Overlap {
            t_first: 9,
            t_last: 10,
            ..
        }
    )));

    // A workspace of another backend, or of the other kernels.
    let other =
        Workspace::arfuse(Backend::Trtllm, 8, 6144, ActDtype::Bf16, None, 1_179_648).unwrap();
    assert!(verify(&p, &other)
        .iter()
        .any(|x| matches!(x, Violation::Workspace { .. })));
    let other = Workspace::flashinfer_mnnvl(8, 6144, ActDtype::Bf16, 42).unwrap();
    assert!(verify(&p, &other)
        .iter()
        .any(|x| matches!(x, Violation::Workspace { detail } if detail.contains("flashinfer"))));
}

#[test]
fn plan_survives_a_json_round_trip_and_is_re_verified() {
    let p = plan(&preset("b200-x8"), &[7168]).unwrap();
    let text = serde_json::to_string(&p).unwrap();
    let back: arfuse_policy::Plan = serde_json::from_str(&text).unwrap();
    assert_eq!(back, p);
    assert!(verify(&back, p.workspace.as_ref().unwrap()).is_empty());
    // DeepSeek H=7168 on SM100 W=8: max_token_num 73 (domain.md §4).
    assert_eq!(p.max_token_num, 73);
}

#[test]
fn gb200_two_node_plan_and_pdl() {
    let p = plan(&preset("gb200-nvl72-2node-tp8"), &[7168]).unwrap();
    assert!(matches!(
        p.decision,
        BackendDecision::Fuse {
            backend: Backend::Mnnvl,
            ..
        }
    ));
    // One-shot at T=1 signals at the end; two-shot at T=16 may signal early, at 17 not.
    assert!(p.trigger_completion_at_end(1).unwrap());
    assert_eq!(p.strategy_for(16).unwrap(), Strategy::TwoShot);
    assert!(!p.trigger_completion_at_end(16).unwrap());
    assert!(p.trigger_completion_at_end(17).unwrap());
}

#[test]
fn unsupported_small_hidden_is_unfused_with_reason_while_others_fuse() {
    let p = plan(&preset("h200-sxm-x8"), &[6144, 64]).unwrap();
    assert_eq!(p.backend(), Some(Backend::Mnnvl));
    let small = p.dispatch_for_hidden(64).unwrap();
    assert_eq!(shape(&small), vec![(1, 8192, Strategy::Unfused)]);
    assert!(
        small[0].reason.contains("under one warp"),
        "{}",
        small[0].reason
    );
}

#[test]
fn explicit_mnnvl_without_multicast_names_the_fix() {
    let mut t = preset("b200-x8");
    t.multicast_all_ranks = false;
    t.requested_backend = RequestedBackend::Mnnvl;
    let err = resolve_backend(&t).unwrap_err();
    assert!(
        err.to_string().contains("requested_backend = \"auto\""),
        "{err}"
    );
    t.interconnect = Interconnect::Pcie;
    t.requested_backend = RequestedBackend::Auto;
    assert_eq!(resolve_backend(&t).unwrap().backend(), None);
}

#[test]
fn seed_plan_summary_snapshot() {
    let p = plan(&preset("h200-sxm-x8"), &[6144]).unwrap();
    insta::assert_snapshot!(p.summary());
}
