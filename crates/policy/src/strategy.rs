//! Strategy rules (domain.md §4): one-shot vs two-shot selection, and PDL.
//!
//! These are the *preference* rules of the public sources. The planner
//! ([`crate::plan()`]) only follows a preference when the workspace holds the call;
//! see the crate docs.

use crate::backend::Backend;
use crate::bytes::{self, MIB};
use crate::error::Result;
use crate::limits;
use crate::target::{ActDtype, KernelLibrary};

/// How one call of T tokens is executed: the ABI's one definition, also the IR's.
pub use arfuse_abi::Strategy;

/// The answer of vLLM's one-shot selector (domain.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VllmSelection {
    /// No forced choice: the backend's own AUTO rule decides (mnnvl).
    BackendAuto,
    /// Force one-shot.
    OneShot,
    /// Force two-shot.
    TwoShot,
}

/// vLLM's one-shot selector, exactly as domain.md §4 states it: mnnvl -> no forced
/// choice; unknown SM (`None`) or a (SM, W) missing from
/// [`limits::TRTLLM_ONE_SHOT_TABLE`] -> one-shot; else one-shot iff
/// `input_bytes <= bound` (both per rank, bytes).
///
/// This is the preference only; it ignores the workspace (the seed failure came from
/// following it blindly for mnnvl).
pub fn vllm_one_shot_selector(
    backend: Backend,
    sm: Option<u32>,
    w: u32,
    input_bytes: u64,
) -> VllmSelection {
    if backend == Backend::Mnnvl {
        return VllmSelection::BackendAuto;
    }
    match sm.and_then(|sm| limits::trtllm_one_shot_bound(sm, w)) {
        None => VllmSelection::OneShot,
        Some(bound) if input_bytes <= bound => VllmSelection::OneShot,
        Some(_) => VllmSelection::TwoShot,
    }
}

/// FlashInfer's mnnvl AUTO threshold: one-shot iff `T*H*W*e <= 1 MiB` (domain.md §4).
pub const MNNVL_AUTO_ONE_SHOT_BYTES: u64 = MIB;

/// FlashInfer's mnnvl AUTO rule: one-shot iff `T*H*W*e <= 1 MiB` (domain.md §4).
/// H = 6144, W = 8, bf16 -> one-shot for T <= 10.
///
/// Errors: [`crate::PolicyError::Overflow`].
pub fn mnnvl_auto_one_shot(t: u64, hidden: u64, w: u32, dtype: ActDtype) -> Result<bool> {
    let bytes = bytes::product(
        &[t, hidden, u64::from(w), dtype.element_bytes()],
        "mnnvl AUTO bytes T*H*W*e",
    )?;
    Ok(bytes <= MNNVL_AUTO_ONE_SHOT_BYTES)
}

/// FlashInfer's trtllm AUTO bounds in MiB of `T*H*2*W*e`, by W (domain.md §4).
pub const FLASHINFER_TRTLLM_AUTO_MIB: [(u32, u64); 3] = [(2, 512), (4, 64), (8, 42)];

/// FlashInfer's own trtllm AUTO rule: one-shot iff `T*H*2*W*e <= bound(W) MiB`
/// (domain.md §4). `None` when W has no bound. arfuse's planner uses vLLM's table for
/// trtllm ([`vllm_one_shot_selector`]); this is here for comparison and reports.
///
/// Errors: [`crate::PolicyError::Overflow`].
pub fn flashinfer_trtllm_auto_one_shot(
    t: u64,
    hidden: u64,
    w: u32,
    dtype: ActDtype,
) -> Result<Option<bool>> {
    let Some(&(_, mib)) = FLASHINFER_TRTLLM_AUTO_MIB.iter().find(|(ww, _)| *ww == w) else {
        return Ok(None);
    };
    let lhs = bytes::product(
        &[t, hidden, 2, u64::from(w), dtype.element_bytes()],
        "trtllm AUTO bytes T*H*2*W*e",
    )?;
    Ok(Some(lhs <= bytes::mul(mib, MIB, "trtllm AUTO bound")?))
}

/// The strategy the rules prefer for a call of `t` tokens, before any workspace check.
///
/// - FlashInfer's kernels: vLLM's selector, deferring to FlashInfer's AUTO rule for
///   mnnvl (the fix of the seed failure; domain.md §5).
/// - arfuse's kernels: one-shot iff `T*H*W*e <= 1 MiB` on either backend. Both of
///   arfuse's strategies are Lamport kernels over the same peer pointers (the backend
///   only decides how those pointers are mapped), which is the pair FlashInfer's mnnvl
///   AUTO threshold was chosen for; vLLM's trtllm table was tuned for FlashInfer's
///   barrier-based trtllm kernels and does not apply.
///
/// Errors: [`crate::PolicyError::Overflow`].
pub fn preferred_strategy(
    kernels: KernelLibrary,
    backend: Backend,
    sm: u32,
    w: u32,
    hidden: u64,
    dtype: ActDtype,
    t: u64,
) -> Result<Strategy> {
    let lamport_rule = |t| -> Result<Strategy> {
        Ok(if mnnvl_auto_one_shot(t, hidden, w, dtype)? {
            Strategy::OneShot
        } else {
            Strategy::TwoShot
        })
    };
    if kernels == KernelLibrary::Arfuse {
        return lamport_rule(t);
    }
    let input = bytes::product(&[t, hidden, dtype.element_bytes()], "input bytes T*H*e")?;
    match vllm_one_shot_selector(backend, Some(sm), w, input) {
        VllmSelection::OneShot => Ok(Strategy::OneShot),
        VllmSelection::TwoShot => Ok(Strategy::TwoShot),
        VllmSelection::BackendAuto => lamport_rule(t),
    }
}

/// Largest T (tokens) for which [`preferred_strategy`] is one-shot; `u64::MAX` when it
/// is one-shot for every T (FlashInfer's trtllm with no table entry). The rule is
/// monotone in T.
///
/// Errors: [`crate::PolicyError::Overflow`].
pub(crate) fn preferred_one_shot_max(
    kernels: KernelLibrary,
    backend: Backend,
    sm: u32,
    w: u32,
    hidden: u64,
    dtype: ActDtype,
) -> Result<u64> {
    let row = limits::row_bytes(hidden, dtype)?;
    let lamport_max = || {
        bytes::floor_div(
            MNNVL_AUTO_ONE_SHOT_BYTES,
            bytes::mul(row, u64::from(w), "bytes per token H*W*e")?,
            "Lamport rule max tokens",
        )
    };
    match (kernels, backend) {
        (KernelLibrary::Arfuse, _) | (KernelLibrary::Flashinfer, Backend::Mnnvl) => lamport_max(),
        (KernelLibrary::Flashinfer, Backend::Trtllm) => {
            match limits::trtllm_one_shot_bound(sm, w) {
                None => Ok(u64::MAX),
                Some(bound) => bytes::floor_div(bound, row, "trtllm one-shot max tokens"),
            }
        }
    }
}

/// PDL_ADVANCE_LAUNCH_TOKENS: above this many tokens a kernel signals completion at
/// its end (domain.md §4).
pub const PDL_ADVANCE_LAUNCH_TOKENS: u64 = 16;

/// Whether the fused kernel must trigger programmatic-dependent-launch completion at
/// its end: `strategy == one-shot || T > 16` (domain.md §4). A one-shot kernel that
/// signalled early let the next kernel read an unwritten buffer (NaN at batch 1).
/// For [`Strategy::Unfused`] no fused kernel runs; `true` (the safe answer) is returned.
pub fn trigger_completion_at_end(strategy: Strategy, t: u64) -> bool {
    match strategy {
        Strategy::OneShot | Strategy::Unfused => true,
        Strategy::TwoShot => t > PDL_ADVANCE_LAUNCH_TOKENS,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FI: KernelLibrary = KernelLibrary::Flashinfer;
    const AR: KernelLibrary = KernelLibrary::Arfuse;

    #[test]
    fn vllm_selector_six_cases_of_domain_section_4() {
        use Backend::{Mnnvl, Trtllm};
        use VllmSelection::*;
        assert_eq!(
            vllm_one_shot_selector(Mnnvl, Some(103), 8, 2 * MIB),
            BackendAuto
        );
        assert_eq!(
            vllm_one_shot_selector(Trtllm, Some(103), 8, 2 * MIB),
            OneShot
        );
        assert_eq!(
            vllm_one_shot_selector(Trtllm, Some(103), 8, 2 * MIB + 1),
            TwoShot
        );
        assert_eq!(
            vllm_one_shot_selector(Trtllm, Some(100), 4, 4 * MIB),
            OneShot
        );
        assert_eq!(
            vllm_one_shot_selector(Trtllm, Some(100), 4, 4 * MIB + 1),
            TwoShot
        );
        assert_eq!(vllm_one_shot_selector(Trtllm, None, 8, 128 * MIB), OneShot);
    }

    #[test]
    fn mnnvl_auto_h6144_w8_bf16_is_one_shot_to_ten() {
        assert_eq!(mnnvl_auto_one_shot(10, 6144, 8, ActDtype::Bf16), Ok(true));
        assert_eq!(mnnvl_auto_one_shot(11, 6144, 8, ActDtype::Bf16), Ok(false));
        assert_eq!(
            preferred_one_shot_max(FI, Backend::Mnnvl, 90, 8, 6144, ActDtype::Bf16),
            Ok(10)
        );
        assert!(mnnvl_auto_one_shot(u64::MAX, 6144, 8, ActDtype::Bf16).is_err());
    }

    #[test]
    fn flashinfer_trtllm_auto_bounds() {
        // W=8, H=4096, bf16: T*4096*2*8*2 <= 42 MiB -> T <= 336.
        assert_eq!(
            flashinfer_trtllm_auto_one_shot(336, 4096, 8, ActDtype::Bf16),
            Ok(Some(true))
        );
        assert_eq!(
            flashinfer_trtllm_auto_one_shot(337, 4096, 8, ActDtype::Bf16),
            Ok(Some(false))
        );
        assert_eq!(
            flashinfer_trtllm_auto_one_shot(1, 4096, 16, ActDtype::Bf16),
            Ok(None)
        );
    }

    #[test]
    fn flashinfer_trtllm_preference_follows_vllm_table() {
        // SM90 W=8 bound 0.5 MiB: H=6144 bf16 -> one-shot up to T=42 (the seed's forced
        // one-shot at T=40).
        let p = |t| preferred_strategy(FI, Backend::Trtllm, 90, 8, 6144, ActDtype::Bf16, t);
        assert_eq!(p(40), Ok(Strategy::OneShot));
        assert_eq!(p(43), Ok(Strategy::TwoShot));
        assert_eq!(
            preferred_one_shot_max(FI, Backend::Trtllm, 90, 8, 6144, ActDtype::Bf16),
            Ok(42)
        );
        assert_eq!(
            preferred_one_shot_max(FI, Backend::Trtllm, 100, 16, 6144, ActDtype::Bf16),
            Ok(u64::MAX)
        );
        // mnnvl defers to the backend's own AUTO rule.
        let m = |t| preferred_strategy(FI, Backend::Mnnvl, 90, 8, 6144, ActDtype::Bf16, t);
        assert_eq!(m(10), Ok(Strategy::OneShot));
        assert_eq!(m(40), Ok(Strategy::TwoShot));
    }

    #[test]
    fn arfuse_kernels_use_the_lamport_rule_on_both_backends() {
        // H=6144, W=8, bf16: 10 * 6144 * 8 * 2 = 983,040 <= 1 MiB < 11 * 98,304.
        for backend in [Backend::Trtllm, Backend::Mnnvl] {
            let p = |t| preferred_strategy(AR, backend, 90, 8, 6144, ActDtype::Bf16, t);
            assert_eq!(p(10), Ok(Strategy::OneShot));
            assert_eq!(p(11), Ok(Strategy::TwoShot));
            assert_eq!(
                preferred_one_shot_max(AR, backend, 90, 8, 6144, ActDtype::Bf16),
                Ok(10)
            );
        }
        // No table entry changes nothing for arfuse's kernels (FlashInfer's trtllm
        // selector would say one-shot for every T).
        assert_eq!(
            preferred_one_shot_max(AR, Backend::Trtllm, 100, 16, 6144, ActDtype::Bf16),
            Ok(5)
        );
    }

    #[test]
    fn pdl_trigger_rule() {
        assert!(trigger_completion_at_end(Strategy::OneShot, 1));
        assert!(trigger_completion_at_end(Strategy::OneShot, 1000));
        assert!(!trigger_completion_at_end(Strategy::TwoShot, 16));
        assert!(trigger_completion_at_end(Strategy::TwoShot, 17));
        assert!(trigger_completion_at_end(Strategy::Unfused, 1));
    }
}
