//! Steps 1 to 3 of the pass (convert, run the rules, choose sites), window by window
//! ([`crate::window`]), on the calling thread and, for a graph cut into several
//! windows, on helper threads too ([`crate::LowerOptions::threads`]).
//!
//! With `t` threads, window `j` (in graph order) is converted and saturated by thread
//! `j % t`, thread 0 being the calling one, which also chooses the sites of every
//! window, in window order. The result is the one-thread result, by construction:
//! - a window's e-graph is a function of its nodes, the graph's facts and the rules.
//!   Each thread interns shapes into its own copy of the graph's shape table, so a
//!   shape derived by a rule may get another id on another thread; ids are compared
//!   only within one e-graph, and none leaves it (sites carry IR types);
//! - the sites are chosen on one thread, in window order, against the nodes the
//!   sites of the windows before claimed, as with one thread;
//! - the e-node limit counts the e-nodes of every window before, which a helper does
//!   not know yet: it saturates its window under the whole limit and records the most
//!   e-nodes any limit check saw ([`rules::Ran::peak`]). When the calling thread takes
//!   the window, a run whose peak fits what the windows before left is the run under
//!   that budget, step for step; otherwise (or when the helper's runner stopped at a
//!   limit) the calling thread runs the window again under the exact budget, which
//!   stops where the one-thread pass stops, with its error.
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
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};

/// Most threads one lowering uses, whatever [`LowerOptions::threads`] or the machine
/// say: the calling thread chooses every window's sites, about a fifth of a window's
/// work, so past about five threads more would wait on it.
pub(crate) const MAX_THREADS: usize = 8;

/// What steps 1 to 3 found over every window.
pub(crate) struct Found {
    /// The input graph's uses (for the emit step).
    pub uses: crate::uses::Uses,
    pub choice: site::Choice,
    pub rule_refusals: BTreeMap<u32, Vec<String>>,
    pub runner: RunnerReport,
}

/// Steps 1 to 3 over every window of `graph`: each window's e-graph decides the
/// all-reduces of its core and is dropped once its sites are chosen.
///
/// Errors: [`LowerError::NotSaturated`] when a window's runner stops at a limit (the
/// e-node limit counts every window's e-nodes), [`LowerError::Internal`] when a rule
/// does not parse or a helper thread stopped.
pub(crate) fn find_sites(
    graph: &Graph,
    target: &Target,
    options: &LowerOptions,
    group: &str,
    instances: &[u32],
) -> Result<Found, LowerError> {
    let (facts, shapes) = convert::facts(graph, group, crate::uses::Uses::new(graph));
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
fn thread_count(requested: usize) -> usize {
    let n = match requested {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    n.min(MAX_THREADS)
}

/// What converting and saturating a window needs, shared by every thread.
#[derive(Clone, Copy)]
struct Work<'a> {
    graph: &'a Graph,
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
            let budget = chooser.budget();
            let saturated = self.saturate(&w, &mut shapes, &mut classes, budget);
            let (mut eg, ran) =
                saturated.map_err(|(stop, ran)| chooser.not_saturated(stop, ran))?;
            shapes = chooser.take(&w, &mut eg, ran, &classes);
        }
        Ok(())
    }

    /// Every window on `threads` threads (see the module doc): helpers saturate the
    /// windows `j` with `j % threads` their number; the calling thread saturates the
    /// rest and chooses every window's sites, in order.
    fn threads(
        &self,
        threads: usize,
        mut windows: Windows<'a>,
        mut shapes: Shapes,
        chooser: &mut Chooser,
    ) -> Result<(), LowerError> {
        std::thread::scope(|s| {
            let helpers: Vec<Helper<'a>> = (1..threads)
                .map(|h| {
                    let (done_tx, done) = sync_channel(1);
                    let (back, back_rx) = channel();
                    for _ in 0..2 {
                        // A closed channel only means the helper already stopped.
                        let _ = back.send(Buffers {
                            window: Window::default(),
                            classes: Classes::new(self.facts.uses.values()),
                            shapes: shapes.clone(),
                            spent: None,
                        });
                    }
                    let (g, uses) = (self.graph, &self.facts.uses);
                    let windows = Windows::new(g, uses, self.instances, self.options.window_nodes);
                    let work = *self;
                    s.spawn(move || work.helper(h, threads, windows, back_rx, done_tx));
                    Helper { done, back }
                })
                .collect();
            let mut own = Window::default();
            let mut classes = Classes::new(self.facts.uses.values());
            for j in 0usize.. {
                let h = j % threads;
                if h == 0 {
                    if !windows.next(&mut own) {
                        return Ok(());
                    }
                    let budget = chooser.budget();
                    let saturated = self.saturate(&own, &mut shapes, &mut classes, budget);
                    let (mut eg, ran) =
                        saturated.map_err(|(stop, ran)| chooser.not_saturated(stop, ran))?;
                    shapes = chooser.take(&own, &mut eg, ran, &classes);
                } else if windows.skip(1) {
                    self.take_from(&helpers[h - 1], j, &mut shapes, chooser)?;
                } else {
                    return Ok(());
                }
            }
            unreachable!("the loop over windows returns")
        })
    }

    /// Takes window `j` from its helper: step 3 on the helper's e-graph when its
    /// runner's peak fits the e-nodes the windows before left, else the window run
    /// again here under that budget (with `shapes`, the calling thread's table), which
    /// stops at a limit as the one-thread pass does. Sends the buffers back.
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
        }) = helper.done.recv()
        else {
            return Err(LowerError::Internal(format!(
                "the helper thread saturating window {j} stopped"
            )));
        };
        let budget = chooser.budget();
        let (result, rerun) = match result {
            Ok((eg, ran)) if ran.peak <= budget => (Ok((eg, ran)), false),
            _ => {
                let (w, classes) = (&buffers.window, &mut buffers.classes);
                (self.saturate(w, shapes, classes, budget), true)
            }
        };
        let (mut eg, ran) = result.map_err(|(stop, ran)| chooser.not_saturated(stop, ran))?;
        let table = chooser.take(&buffers.window, &mut eg, ran, &buffers.classes);
        buffers.spent = Some(eg);
        if rerun {
            // The rerun borrowed the calling thread's table (and the helper's went with
            // its e-graph; any table holding the graph's shapes will do for it).
            buffers.shapes = table.clone();
            *shapes = table;
        } else {
            buffers.shapes = table;
        }
        // A closed channel only means the helper already stopped.
        let _ = helper.back.send(buffers);
        Ok(())
    }

    /// Helper `h` of `threads`: saturates windows `h`, `h + threads`, ... under the
    /// whole e-node limit, in buffers from `back` (two, which the calling thread sends
    /// back once it took their window), each sent on `done`. Stops after
    /// the last of them, after a runner that stopped at a limit (the lowering then
    /// fails), or when the calling thread stopped listening.
    fn helper(
        self,
        h: usize,
        threads: usize,
        mut windows: Windows<'a>,
        back: Receiver<Buffers<'a>>,
        done: SyncSender<Done<'a>>,
    ) {
        let mut ahead = h;
        loop {
            let Ok(mut buffers) = back.recv() else {
                return;
            };
            drop(buffers.spent.take());
            if !windows.skip(ahead) || !windows.next(&mut buffers.window) {
                return;
            }
            ahead = threads - 1;
            let limit = self.options.node_limit;
            let Buffers {
                window,
                classes,
                shapes,
                ..
            } = &mut buffers;
            let result = self.saturate(window, shapes, classes, limit);
            let stopped = result.is_err();
            if done.send(Done { buffers, result }).is_err() || stopped {
                return;
            }
        }
    }
}

/// Step 3 and the runner's totals, on the calling thread, window by window in order.
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
        self.runner.iterations = self.runner.iterations.max(ran.iterations);
        self.runner.egraph_nodes += ran.nodes;
        self.runner.egraph_classes += ran.classes;
        self.runner.windows += 1;
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
