//! Steps 1 to 3 of the pass (convert, run the rules, choose sites), window by window
//! ([`crate::window`]), on the calling thread and, for a graph cut into several
//! windows, on helper threads too ([`crate::LowerOptions::threads`]).
//!
//! With `t` threads, window `j` (in graph order) is converted, saturated and its sites
//! chosen by thread `j % t`, thread 0 being the calling one, which takes every window's
//! answer in window order; a helper's window that the helper has not started when the
//! calling thread needs it is claimed and run by the calling thread instead
//! ([`Claims`]), so a helper that starts late or loses its core for a while holds up
//! only the windows it has claimed, not the ones after. (The helpers are scoped
//! threads: the step still ends only once each has started, found nothing left to
//! claim, and stopped.) The result is the one-thread result, by construction:
//! - a window's e-graph is a function of its nodes, the graph's facts and the rules.
//!   Each thread interns shapes into its own copy of the graph's shape table, so a
//!   shape derived by a rule may get another id on another thread; ids are compared
//!   only within one e-graph, and none leaves it (sites carry IR types);
//! - the e-node limit counts the e-nodes of every window before, which a helper does
//!   not know yet: it saturates its window under the whole limit and records the most
//!   e-nodes any limit check saw ([`rules::Ran::peak`]). When the calling thread takes
//!   the window, a run whose peak fits what the windows before left is the run under
//!   that budget, step for step; otherwise (or when the helper's runner stopped at a
//!   limit) the calling thread runs the window again under the exact budget, which
//!   stops where the one-thread pass stops, with its error;
//! - a helper chooses its window's sites knowing only the claims of that window's own
//!   sites, logging every node its checks tested against the claims. Claims are the
//!   only thing step 3 reads from the windows before, so when none of those nodes was
//!   claimed by an earlier window, every test came out as it would have on the calling
//!   thread and the helper's sites, refusals and notes are taken as they are; otherwise
//!   the calling thread chooses that window's sites again, on the helper's e-graph.
//!
//! A helper works at most two windows ahead of the calling thread (two buffers each),
//! so the e-graphs alive at once are bounded by the thread count, not the model.

use crate::analysis::{Facts, FxAnalysis, FxGraph, Shapes};
use crate::convert::{self, Classes};
use crate::report::{RunnerLimits, RunnerReport};
use crate::rules::{self, Ran, Rule, Stop};
use crate::site;
use crate::window::{Window, Windows};
use crate::{LowerError, LowerOptions};
use arfuse_ir::Graph;
use arfuse_policy::Target;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::OnceLock;

/// Most threads one lowering uses, whatever [`LowerOptions::threads`] or the machine
/// say. The steps after the windows (plan, emit, report) run on the calling thread
/// alone and so do its takes of every window, so more threads would mostly wait.
pub(crate) const MAX_THREADS: usize = 8;

/// What steps 1 to 3 found over every window.
pub(crate) struct Found {
    /// The input graph's uses (for the emit step).
    pub uses: crate::uses::Uses,
    pub choice: site::Choice,
    pub rule_refusals: BTreeMap<u32, Vec<String>>,
    pub runner: RunnerReport,
}

/// Steps 1 to 3 over every window of `graph` (its `facts` and their shape table from
/// [`convert::facts`]): each window's e-graph decides the all-reduces of its core and
/// is dropped once its sites are chosen.
///
/// Errors: [`LowerError::NotSaturated`] when a window's runner stops at a limit (the
/// e-node limit counts every window's e-nodes), [`LowerError::Internal`] when a rule
/// does not parse or a helper thread stopped.
pub(crate) fn find_sites(
    graph: &Graph,
    target: &Target,
    options: &LowerOptions,
    facts: Facts,
    shapes: Shapes,
    instances: &[u32],
) -> Result<Found, LowerError> {
    let rules = rules::all().map_err(LowerError::Internal)?;
    let windows = Windows::new(graph, &facts.uses, instances, options.window_nodes);
    let threads = if windows.whole() {
        1
    } else {
        thread_count(options.threads)
    };
    let mut chooser = Chooser::new(graph, target, options, windows.whole());
    let work = Work {
        graph,
        target,
        facts: &facts,
        rules,
        instances,
        options,
    };
    if threads == 1 {
        work.one_thread(windows, shapes, &mut chooser)?;
    } else {
        work.threads(threads, windows, shapes, &mut chooser)?;
    }
    Ok(Found {
        uses: facts.uses,
        choice: chooser.choice,
        rule_refusals: chooser.rule_refusals,
        runner: chooser.runner,
    })
}

/// The threads to use: `requested`, 0 meaning what the machine offers
/// (`std::thread::available_parallelism`, 1 when unknown), at most [`MAX_THREADS`].
pub(crate) fn thread_count(requested: usize) -> usize {
    let n = match requested {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    n.min(MAX_THREADS)
}

/// The thread whose share window `j` of a lowering on `threads` threads is in: round
/// robin, 0 being the calling thread (a helper's window runs on the calling thread
/// when that claims it first, [`Claims`]). The calling thread also chooses
/// every window's sites, but a helper saturates more slowly: on the 4,096-layer
/// decomposed stack on 2 threads (this repository's 2-core VM), the calling thread's
/// half of the windows took 85-90 ms and the helper's half 115-120 ms, so an even
/// share keeps both busy (giving the helper two windows in three measured no better).
fn owner(j: usize, threads: usize) -> usize {
    j % threads
}

/// Which thread runs each helper's windows: for helper `h` (1-based), the first window
/// of its share (`h`, `h + t`, `h + 2t`, ... on `t` threads) that no thread has claimed
/// yet. The helper claims its next window before it starts it, and the calling thread
/// claims a helper's window when it needs its answer; whichever claims first runs it
/// (one compare-and-swap from `j` to `j + t`), so each window runs once.
struct Claims(Vec<AtomicUsize>);

impl Claims {
    /// No window claimed, for `helpers` helpers.
    fn new(helpers: usize) -> Claims {
        Claims((1..=helpers).map(AtomicUsize::new).collect())
    }

    /// The first window of helper `h`'s share not claimed yet.
    fn next(&self, h: usize) -> usize {
        self.0[h - 1].load(Ordering::Acquire)
    }

    /// Claims window `j` of helper `h`'s share on `threads` threads; false when another
    /// thread claimed it first (or `j` is not the share's next window).
    fn claim(&self, h: usize, j: usize, threads: usize) -> bool {
        self.0[h - 1]
            .compare_exchange(j, j + threads, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

/// What converting and saturating a window needs, shared by every thread.
#[derive(Clone, Copy)]
struct Work<'a> {
    graph: &'a Graph,
    target: &'a Target,
    facts: &'a Facts,
    rules: &'static [Rule],
    instances: &'a [u32],
    options: &'a LowerOptions,
}

/// A window's saturated e-graph, or where its runner stopped.
type Saturated<'a> = Result<(FxGraph<'a>, Ran), (Stop, Ran)>;

/// The calling thread's ends of the channels to one helper.
struct Helper<'a> {
    /// The helper's windows, saturated, in order.
    done: Receiver<Done<'a>>,
    /// Buffers going back to it.
    back: Sender<Buffers<'a>>,
}

/// A window a helper saturated, handed to the calling thread with the buffers it used
/// (which go back to the helper).
struct Done<'a> {
    buffers: Buffers<'a>,
    result: Saturated<'a>,
    /// Step 3 as the helper ran it, when its runner saturated.
    ahead: Option<Ahead>,
}

/// Step 3 of one window, run by the helper that saturated it, knowing only the claims
/// of that window's own sites. It is the calling thread's answer unless a site of an
/// earlier window claimed a node it tested ([`Chooser::merge`]).
struct Ahead {
    choice: site::Choice,
    rule_refusals: BTreeMap<u32, Vec<String>>,
    /// Every node the checks tested against the claims.
    tested: Vec<u32>,
}

/// The buffers of one window in flight: its nodes, the classes of its values, the
/// shape table its e-graph interns into (each buffer its own copy of the graph's), and
/// on the way back, the e-graph the calling thread is done with: the helper that
/// allocated it frees it (freeing on the thread that allocates is what a
/// thread-caching allocator is fast at).
struct Buffers<'a> {
    window: Window,
    classes: Classes,
    shapes: Shapes,
    spent: Option<FxGraph<'a>>,
}

impl<'a> Work<'a> {
    /// Steps 1 and 2 for window `w` under an e-node `budget`: converted (its values'
    /// classes into `classes`) and saturated. The shape table moves from `shapes` into
    /// the e-graph's analysis (the sites are made with it; [`Chooser::take`] gives it
    /// back).
    fn saturate(
        &self,
        w: &Window,
        shapes: &mut Shapes,
        classes: &mut Classes,
        budget: usize,
    ) -> Saturated<'a> {
        let analysis = FxAnalysis::new(self.facts, std::mem::take(shapes));
        let eg = convert::convert(self.graph, &w.nodes, analysis, classes);
        rules::saturate(eg, self.rules, self.options.iter_limit, budget)
    }

    /// Every window on the calling thread, in order.
    fn one_thread(
        &self,
        mut windows: Windows<'a>,
        mut shapes: Shapes,
        chooser: &mut Chooser,
    ) -> Result<(), LowerError> {
        let mut classes = Classes::new(self.facts.uses.values());
        let mut w = Window::default();
        while windows.next(&mut w) {
            self.own_window(&w, &mut shapes, &mut classes, chooser)?;
        }
        Ok(())
    }

    /// Steps 1 to 3 for window `w` on the calling thread, under the e-node budget the
    /// windows before left.
    fn own_window(
        &self,
        w: &Window,
        shapes: &mut Shapes,
        classes: &mut Classes,
        chooser: &mut Chooser,
    ) -> Result<(), LowerError> {
        let budget = chooser.budget();
        let saturated = self.saturate(w, shapes, classes, budget);
        let (mut eg, ran) = saturated.map_err(|(stop, ran)| chooser.not_saturated(stop, ran))?;
        *shapes = chooser.take(w, &mut eg, ran, classes);
        Ok(())
    }

    /// Every window on `threads` threads (see the module doc): the helpers convert,
    /// saturate and choose ahead the windows `j` with `j % threads` their number; the
    /// calling thread does the rest and takes every window's answer, in order.
    fn threads(
        &self,
        threads: usize,
        mut windows: Windows<'a>,
        mut shapes: Shapes,
        chooser: &mut Chooser,
    ) -> Result<(), LowerError> {
        // The thread count the helpers work with: the one asked for, or fewer when the
        // system would not start as many threads.
        let count = OnceLock::new();
        let claims = Claims::new(threads - 1);
        std::thread::scope(|s| {
            let helpers = self.spawn_helpers(s, threads, &count, &claims);
            let threads = helpers.len() + 1;
            let _ = count.set(threads);
            for helper in &helpers {
                for _ in 0..2 {
                    // A closed channel only means the helper already stopped.
                    let _ = helper.back.send(Buffers {
                        window: Window::default(),
                        classes: Classes::new(self.facts.uses.values()),
                        shapes: shapes.clone(),
                        spent: None,
                    });
                }
            }
            let mut own = Window::default();
            let mut classes = Classes::new(self.facts.uses.values());
            for j in 0usize.. {
                let h = owner(j, threads);
                // The calling thread's own window, or a helper's it has not started.
                if h == 0 || claims.claim(h, j, threads) {
                    if !windows.next(&mut own) {
                        return Ok(());
                    }
                    self.own_window(&own, &mut shapes, &mut classes, chooser)?;
                } else if windows.skip() {
                    self.take_from(&helpers[h - 1], j, &mut shapes, chooser)?;
                } else {
                    return Ok(());
                }
            }
            unreachable!("the loop over windows returns")
        })
    }

    /// Starts helpers 1 to `wanted - 1`, or as many of them as the system starts (the
    /// result does not depend on the count: the calling thread does the rest). Each
    /// waits for its first buffers, then reads the thread count from `count`, and runs
    /// the windows of its share it claims in `claims`.
    fn spawn_helpers<'s>(
        &self,
        s: &'s std::thread::Scope<'s, '_>,
        wanted: usize,
        count: &'s OnceLock<usize>,
        claims: &'s Claims,
    ) -> Vec<Helper<'a>>
    where
        'a: 's,
    {
        let mut helpers = Vec::with_capacity(wanted.saturating_sub(1));
        for h in 1..wanted {
            let (done_tx, done) = sync_channel(1);
            let (back, back_rx) = channel();
            let (g, uses) = (self.graph, &self.facts.uses);
            let windows = Windows::new(g, uses, self.instances, self.options.window_nodes);
            let work = *self;
            let started = std::thread::Builder::new()
                .name(format!("arfuse-windows-{h}"))
                .spawn_scoped(s, move || {
                    // A panic (a bug) stops the helper here: its channel closes, and the
                    // calling thread, waiting for a window it claimed, returns
                    // `LowerError::Internal` (or runs its unclaimed windows itself)
                    // instead of the scope panicking. The panic hook has printed it.
                    let run = || work.helper(h, count, claims, windows, back_rx, done_tx);
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
                });
            if started.is_err() {
                break;
            }
            helpers.push(Helper { done, back });
        }
        helpers
    }

    /// Takes window `j` from its helper. Its runner's result holds when its peak fits
    /// the e-nodes the windows before left; else the lowering fails as the one-thread
    /// pass does ([`Work::rerun`]). Its sites are the helper's when no node they tested
    /// was claimed by an earlier window; else they are chosen again here. Sends the
    /// buffers back.
    fn take_from(
        &self,
        helper: &Helper<'a>,
        j: usize,
        shapes: &mut Shapes,
        chooser: &mut Chooser,
    ) -> Result<(), LowerError> {
        let Ok(Done {
            mut buffers,
            result,
            ahead,
        }) = helper.done.recv()
        else {
            return Err(LowerError::Internal(format!(
                "the helper thread saturating window {j} stopped"
            )));
        };
        let budget = chooser.budget();
        let (mut eg, ran) = match result {
            Ok((eg, ran)) if ran.peak <= budget => (eg, ran),
            _ => return Err(self.rerun(j, &mut buffers, shapes, chooser, budget)),
        };
        let merged = match ahead {
            Some(ahead) => chooser.merge(ran, ahead),
            None => false,
        };
        buffers.shapes = if merged {
            std::mem::take(&mut eg.analysis.shapes)
        } else {
            chooser.take(&buffers.window, &mut eg, ran, &buffers.classes)
        };
        buffers.spent = Some(eg);
        // A closed channel only means the helper already stopped.
        let _ = helper.back.send(buffers);
        Ok(())
    }

    /// The error of window `j`, whose helper's runner went past the e-node `budget` the
    /// windows before left (its peak) or stopped at a limit: the window is run again
    /// here under that budget (with `shapes`, the calling thread's table, which goes
    /// with the dropped e-graph), which stops where the one-thread pass stops, with its
    /// error. The run under the smaller budget is the helper's run step for step up to
    /// the first limit check over it, and the helper's run had one (its peak) or
    /// stopped at a limit itself, so it cannot saturate; if it did, that is
    /// [`LowerError::Internal`].
    fn rerun(
        &self,
        j: usize,
        buffers: &mut Buffers<'a>,
        shapes: &mut Shapes,
        chooser: &Chooser,
        budget: usize,
    ) -> LowerError {
        let (w, classes) = (&buffers.window, &mut buffers.classes);
        match self.saturate(w, shapes, classes, budget) {
            Err((stop, ran)) => chooser.not_saturated(stop, ran),
            Ok(_) => LowerError::Internal(format!(
                "window {j} saturated under an e-node budget of {budget} after its run \
                 under the whole limit went past it"
            )),
        }
    }

    /// Helper `h` of `t` threads (`count`, read when its first buffers arrive):
    /// saturates the windows of its share `h`, `h + t`, ... that it claims first in
    /// `claims` (the calling thread runs the others) under the whole e-node limit and
    /// chooses their sites ahead ([`Ahead`]), in buffers from `back` (two, which the
    /// calling thread sends back once it took their window), each sent on `done`.
    /// Stops after the last of them, after a runner that stopped at a limit (the
    /// lowering then fails), or when the calling thread stopped listening.
    fn helper(
        self,
        h: usize,
        count: &OnceLock<usize>,
        claims: &Claims,
        mut windows: Windows<'a>,
        back: Receiver<Buffers<'a>>,
        done: SyncSender<Done<'a>>,
    ) {
        // Allocated for the first window claimed: a helper that finds none left (the
        // calling thread took them) stops without it.
        let mut claimed: Option<site::Claimed> = None;
        let mut j = 0;
        let mut threads = None;
        loop {
            let Ok(mut buffers) = back.recv() else {
                return;
            };
            // Set before the first buffers were sent.
            let Some(&threads) = *threads.get_or_insert_with(|| count.get()) else {
                return;
            };
            drop(buffers.spent.take());
            // The next window of the share no thread has claimed, claimed here.
            loop {
                let next = claims.next(h);
                while j < next {
                    if !windows.skip() {
                        return;
                    }
                    j += 1;
                }
                if claims.claim(h, j, threads) {
                    break;
                }
            }
            if !windows.next(&mut buffers.window) {
                return;
            }
            j += 1;
            let limit = self.options.node_limit;
            let Buffers {
                window,
                classes,
                shapes,
                ..
            } = &mut buffers;
            let result = self.saturate(window, shapes, classes, limit);
            let ahead = match &result {
                Ok((eg, _)) => {
                    let claimed =
                        claimed.get_or_insert_with(|| site::Claimed::logging(self.graph.len()));
                    Some(self.choose_ahead(window, eg, classes, claimed))
                }
                Err(_) => None,
            };
            let stopped = result.is_err();
            let done_ = Done {
                buffers,
                result,
                ahead,
            };
            if done.send(done_).is_err() || stopped {
                return;
            }
        }
    }

    /// Step 3 of window `w`, saturated into `eg`, against the claims of its own sites
    /// only (`claimed`, logging, released after).
    fn choose_ahead(
        &self,
        w: &Window,
        eg: &FxGraph<'a>,
        classes: &Classes,
        claimed: &mut site::Claimed,
    ) -> Ahead {
        let mut choice = site::Choice::default();
        let mut rule_refusals = BTreeMap::new();
        let index = site::Index::new(self.graph, eg, classes);
        site::choose(&index, &w.owned, self.target, claimed, &mut choice);
        index.rule_refusals(&w.owned, &mut rule_refusals);
        let tested = claimed.release(&choice.chosen);
        Ahead {
            choice,
            rule_refusals,
            tested,
        }
    }
}

/// Step 3 (or a helper's answer to it) and the runner's totals, on the calling thread,
/// window by window in order.
struct Chooser<'g, 'o> {
    graph: &'g Graph,
    target: &'o Target,
    options: &'o LowerOptions,
    claimed: site::Claimed,
    choice: site::Choice,
    rule_refusals: BTreeMap<u32, Vec<String>>,
    runner: RunnerReport,
}

impl<'g, 'o> Chooser<'g, 'o> {
    fn new(graph: &'g Graph, target: &'o Target, options: &'o LowerOptions, whole: bool) -> Self {
        Chooser {
            graph,
            target,
            options,
            claimed: site::Claimed::new(graph.len()),
            choice: site::Choice::default(),
            rule_refusals: BTreeMap::new(),
            runner: RunnerReport {
                stop_reason: "saturated".into(),
                iterations: 0,
                egraph_nodes: 0,
                egraph_classes: 0,
                windows: 0,
                whole_graph: whole,
                limits: RunnerLimits {
                    iterations: options.iter_limit,
                    egraph_nodes: options.node_limit,
                },
            },
        }
    }

    /// The e-nodes the next window may reach: the limit less every window's so far.
    fn budget(&self) -> usize {
        self.options
            .node_limit
            .saturating_sub(self.runner.egraph_nodes)
    }

    /// Step 3 for window `w`, saturated into `eg` (its runner having run to `ran`, its
    /// values' classes in `classes`). Returns the e-graph's shape table.
    fn take(&mut self, w: &Window, eg: &mut FxGraph<'_>, ran: Ran, classes: &Classes) -> Shapes {
        self.count(ran);
        let index = site::Index::new(self.graph, eg, classes);
        site::choose(
            &index,
            &w.owned,
            self.target,
            &mut self.claimed,
            &mut self.choice,
        );
        index.rule_refusals(&w.owned, &mut self.rule_refusals);
        drop(index);
        std::mem::take(&mut eg.analysis.shapes)
    }

    /// Takes a window's sites as a helper chose them ahead (its runner having run to
    /// `ran`), unless a site of an earlier window claimed a node their checks tested:
    /// then nothing is taken and false returned (the window's step 3 must run here).
    /// Otherwise every claims test came out as it would have here, so the sites,
    /// refusals and notes are this thread's.
    fn merge(&mut self, ran: Ran, ahead: Ahead) -> bool {
        if ahead.tested.iter().any(|&n| self.claimed.contains(n)) {
            return false;
        }
        self.count(ran);
        for (inst, s) in ahead.choice.chosen {
            self.claimed.claim(&s.region);
            self.choice.chosen.insert(inst, s);
        }
        let choice = &mut self.choice;
        for (to, from) in [
            (&mut choice.why_not, ahead.choice.why_not),
            (&mut choice.notes, ahead.choice.notes),
            (&mut self.rule_refusals, ahead.rule_refusals),
        ] {
            for (inst, list) in from {
                to.entry(inst).or_default().extend(list);
            }
        }
        true
    }

    /// Adds a window's runner (`ran`) to the totals.
    fn count(&mut self, ran: Ran) {
        self.runner.iterations = self.runner.iterations.max(ran.iterations);
        self.runner.egraph_nodes += ran.nodes;
        self.runner.egraph_classes += ran.classes;
        self.runner.windows += 1;
    }

    /// The error of a window's runner that stopped at a limit (`stop`, after `ran`),
    /// the earlier windows' e-nodes counted too.
    fn not_saturated(&self, stop: Stop, ran: Ran) -> LowerError {
        let so_far = self.runner.egraph_nodes;
        let reason = match stop {
            Stop::NodeLimit(n) => format!(
                "e-node limit {} (the e-graph had {} e-nodes when it stopped)",
                self.options.node_limit,
                so_far + n
            ),
            Stop::IterationLimit(n) => format!("iteration limit {n}"),
        };
        LowerError::NotSaturated {
            reason,
            iterations: ran.iterations,
            nodes: so_far + ran.nodes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Ahead, Chooser, Claims};
    use crate::rules::Ran;
    use crate::LowerOptions;
    use arfuse_ir::{DType, Dim, Graph, InputKind, Node, Op, TensorType};
    use arfuse_policy::Target;
    use std::collections::{BTreeMap, BTreeSet};

    /// Each window of a helper's share is claimed once, by the helper or by the
    /// calling thread, in the share's order.
    #[test]
    fn each_window_of_a_share_is_claimed_once_in_order() {
        // Three threads: helper 1's share is windows 1, 4, 7, ...; helper 2's 2, 5, ...
        let claims = Claims::new(2);
        assert_eq!((claims.next(1), claims.next(2)), (1, 2));
        // Helper 1 claims window 1; the calling thread, needing it, cannot.
        assert!(claims.claim(1, 1, 3));
        assert!(!claims.claim(1, 1, 3));
        // The calling thread claims window 2 before helper 2 starts it; the helper
        // then finds its next window is 5.
        assert!(claims.claim(2, 2, 3));
        assert!(!claims.claim(2, 2, 3));
        assert_eq!(claims.next(2), 5);
        // Not the share's next window: no claim.
        assert!(!claims.claim(1, 7, 3));
        assert!(claims.claim(1, 4, 3));
        assert_eq!((claims.next(1), claims.next(2)), (7, 5));
    }

    /// The sites a helper chose ahead are taken only when no node its checks tested
    /// was claimed by an earlier window. (No graph of the corpus or the builders makes
    /// two candidate regions share a node, so this path is tested here.)
    #[test]
    fn a_window_chosen_ahead_is_taken_only_when_no_tested_node_was_claimed() {
        let mut g = Graph::new();
        for i in 0..6 {
            g.add_node(Node {
                id: format!("n{i}"),
                op: Op::Input {
                    kind: InputKind::Activation,
                },
                inputs: vec![],
                outputs: vec![TensorType::new(DType::Bf16, vec![Dim::constant(8)])],
                module: None,
            })
            .unwrap();
        }
        let target = Target::preset("h200-sxm-x8").unwrap();
        let options = LowerOptions::default();
        let mut chooser = Chooser::new(&g, &target, &options, false);
        chooser.claimed.claim(&BTreeSet::from([3]));
        let ran = Ran {
            iterations: 2,
            nodes: 40,
            classes: 30,
            peak: 40,
        };
        let ahead = |tested: Vec<u32>| {
            let mut a = Ahead {
                choice: Default::default(),
                rule_refusals: BTreeMap::from([(5, vec!["a rule said no".to_string()])]),
                tested,
            };
            a.choice
                .why_not
                .insert(5, vec!["not the pattern".to_string()]);
            a
        };
        // Node 3 was claimed before: nothing is taken.
        assert!(!chooser.merge(ran, ahead(vec![4, 3])));
        assert!(chooser.choice.why_not.is_empty());
        assert!(chooser.rule_refusals.is_empty());
        assert_eq!(chooser.runner.windows, 0);
        assert_eq!(chooser.runner.egraph_nodes, 0);
        // Nodes 4 and 5 were not: the window's answer and runner are taken.
        assert!(chooser.merge(ran, ahead(vec![4, 5])));
        assert_eq!(chooser.choice.why_not[&5], ["not the pattern"]);
        assert_eq!(chooser.rule_refusals[&5], ["a rule said no"]);
        assert_eq!(chooser.runner.windows, 1);
        assert_eq!(chooser.runner.egraph_nodes, 40);
        assert_eq!(chooser.runner.egraph_classes, 30);
        assert_eq!(chooser.runner.iterations, 2);
    }
}
