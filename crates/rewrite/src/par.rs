//! Two independent steps of one lowering at once: one on a scoped helper thread, the
//! other on the calling thread.
//!
//! Steps 1 to 3 of a graph cut into windows run on every thread
//! ([`crate::LowerOptions::threads`]), but the steps around them read or write the
//! whole graph on the calling thread alone, while the helpers wait. Some pairs of them
//! do not depend on each other: validating the input and gathering the facts the steps
//! read (its uses, every value's type, the all-reduces and the layer group); at the
//! end, building the report and emitting and checking the output graph (the report
//! needs the emitted nodes' ids only, filled in after); within emit, copying the kept
//! nodes of the input and adding the sites' nodes (`crate::emit::emit_sites`); and,
//! within the checks, the two halves of the emitted nodes to validate
//! (`crate::emit::check`). For such a graph, with more than one thread, each pair runs
//! on two threads.
//!
//! A graph that is one window keeps every step on the calling thread. On this
//! repository's 2-core VM a scoped helper started 80 to 750 us after its spawn and was
//! joined up to 3 ms after its step ended, while the steps of a pair take 0.2 to 0.7 ms
//! each on the 128-layer decomposed stack (one window under the default `window_nodes`
//! of 4,096 then): with pairs that stack lowered at 18.1 us per site against 18.3
//! without, and at 25.0 against 20.8 when step 3 was split in halves as well
//! (interleaved runs, fastest of 8 to 10). On the 4,096-layer
//! stack the pairs overlap 11 to 24 ms of validation with 14 to 19 ms of facts, and
//! 19 to 24 ms of report with 46 to 75 ms of emit and checks, per lowering. There,
//! with mimalloc, the first helper of a lowering that follows another in the same
//! process started 6 to 11 ms after its spawn (with glibc's malloc, 0.1 to 0.6 ms):
//! the new thread's first allocation reclaims the memory the earlier lowering's ended
//! helpers had allocated and its output had freed since (`MIMALLOC_MAX_SEGMENT_RECLAIM`
//! set to 0 removed the delay). The work does not go away: keeping the helpers alive
//! in a rayon pool between lowerings, which removed the delay, measured no faster per
//! lowering, in alternating runs at 256, 1,024 and 4,096 layers.
//!
//! Both steps of a pair always run to the end, so the result is the one-thread result:
//! the caller looks at the two results in the one-thread order (the validation error
//! before any error of the facts, an error of emit or its checks instead of the
//! report), or, for the checks in halves, checks again on one thread when a half
//! failed (`crate::emit::check`).

use std::sync::{Mutex, PoisonError};

/// Runs `a` and `b` and returns both results: `a` on a scoped helper thread while `b`
/// runs on the calling thread when `parallel`; else (or when the system starts no
/// thread) `b` then `a`, both on the calling thread. When `b` is done before the helper
/// has started `a` (a helper can start milliseconds late, or not get a core for a
/// while on a loaded machine), the calling thread runs `a` itself rather than wait for
/// the helper to run it; the call still returns only once the helper thread has
/// started, found `a` gone and ended (it is a scoped thread). A panic of `a` on the
/// helper resumes on the calling thread once `b` is done.
pub(crate) fn both<A, B>(
    parallel: bool,
    a: impl FnOnce() -> A + Send,
    b: impl FnOnce() -> B,
) -> (A, B)
where
    A: Send,
{
    if !parallel {
        let rb = b();
        return (a(), rb);
    }
    // The helper takes `a` from here, so that `a` is still at hand when the system
    // does not start the helper.
    let slot = Mutex::new(Some(a));
    let take = || slot.lock().unwrap_or_else(PoisonError::into_inner).take();
    std::thread::scope(|s| {
        let helper = std::thread::Builder::new()
            .name("arfuse-pair".into())
            .spawn_scoped(s, || take().map(|a| a()));
        let rb = b();
        // Still in its slot: the helper has not started (or the system did not start
        // it), and the calling thread is free.
        if let Some(a) = take() {
            return (a(), rb);
        }
        match helper.map(|h| h.join()) {
            Ok(Ok(Some(ra))) => (ra, rb),
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Ok(Ok(None)) | Err(_) => {
                unreachable!("`a` is taken once, by the helper, which then returns its result")
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::both;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    #[test]
    fn both_return_their_results_on_one_thread_and_on_two() {
        let caller = std::thread::current().id();
        let on_helper = || std::thread::current().id() != caller;
        let (a, b) = both(false, || (on_helper(), 6 * 7), || 2 + 2);
        assert_eq!((a, b), ((false, 42), 4));
        // `b` lasts until the helper has run `a` (or 10 s), so the calling thread never
        // finds `a` unstarted.
        let ran = AtomicBool::new(false);
        let (a, b) = both(
            true,
            || {
                let here = on_helper();
                ran.store(true, Ordering::SeqCst);
                (here, 6 * 7)
            },
            || {
                let start = Instant::now();
                while !ran.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(10) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                2 + 2
            },
        );
        assert_eq!((a, b), ((true, 42), 4));
    }

    #[test]
    fn a_step_its_helper_has_not_started_runs_on_the_calling_thread() {
        // With an empty `b`, the calling thread is free microseconds after the spawn,
        // nearly always before the new thread has started, and then runs `a` itself;
        // otherwise the helper runs it. Either way the pair returns both results.
        let caller = std::thread::current().id();
        let mut on_caller = 0;
        for i in 0..200u64 {
            let ((here, a), b) = both(
                true,
                || (std::thread::current().id() == caller, i * 3),
                || i + 1,
            );
            assert_eq!((a, b), (i * 3, i + 1));
            on_caller += usize::from(here);
        }
        assert!(
            on_caller > 0,
            "the calling thread never ran `a` in 200 pairs"
        );
    }

    #[test]
    fn a_panic_of_the_helper_reaches_the_caller_after_its_own_step() {
        let ran_b = std::sync::atomic::AtomicBool::new(false);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            both(
                true,
                || panic!("the helper's step failed"),
                || ran_b.store(true, std::sync::atomic::Ordering::SeqCst),
            )
        }));
        assert!(caught.is_err());
        assert!(ran_b.load(std::sync::atomic::Ordering::SeqCst));
    }
}
