//! Windows: the pieces of a large graph the e-graph works on one at a time, so that the
//! e-graph's work and memory per site stay the same however many layers the model has.
//!
//! A graph of more than [`crate::LowerOptions::window_nodes`] nodes has its nodes (in
//! their topological order) cut into consecutive core ranges of a [`CORE_DIVISOR`]th
//! of that many nodes (at least one). A window decides the all-reduces of its core,
//! and holds, besides its core:
//! - the forward halo: every node the rules model that is at most [`FORWARD_HALO`]
//!   steps downstream of one of those all-reduces through modeled nodes, so that every
//!   chain an all-reduce of the core can start is inside, with its residual add, norm,
//!   quant and views;
//! - the backward halo: every modeled node at most [`BACKWARD_HALO`] steps upstream of
//!   a node of the window, so that the classes the rules look into below a matched op
//!   (a weight `1 + w.float()`, the all-reduce behind a wait or a view, the residual)
//!   are built as in the whole graph.
//!
//! Views and waits are no step ([`crate::convert::modeled_step`]): the rules see
//! through chains of any length of them, so a halo follows such a chain to its end.
//! Every other value a window's nodes read becomes an opaque leaf, as every value of
//! an op the rules do not model already is. A graph of at most `window_nodes` nodes is
//! one window holding every node: the e-graph of the whole graph.

use crate::convert::modeled_step;
use crate::uses::Uses;
use arfuse_ir::{Graph, NodeId};
use std::collections::VecDeque;

/// Steps downstream of an all-reduce that its window reaches past its core. The
/// longest chain a rule matches runs 10 modeled steps past its all-reduce (the residual
/// add, the eight ops of a decomposed norm, the quant; views and waits cost none), so
/// every op a rule can reach from an all-reduce of the core, and every op a site of it
/// replaces, is inside with a margin.
pub(crate) const FORWARD_HALO: u32 = 16;

/// A cut graph's cores hold `window_nodes / CORE_DIVISOR` nodes: a graph is kept whole
/// up to `window_nodes` nodes (one e-graph, as every graph of the bundled corpus), but
/// once cut, a smaller window keeps its e-graph in a core's cache. Measured on the
/// 4,096-layer decomposed stack (callgrind, a 2 MiB last-level cache, cores of 512 to
/// 4,096 nodes): cores of 1,024 nodes miss that cache 716 times per site against 1,047
/// for cores of 4,096, for 7% more instructions; cores of 512 add 18% instructions
/// and miss about as often (701). With the default `window_nodes` (3,072), cores of
/// 1,024 nodes.
pub(crate) const CORE_DIVISOR: usize = 3;

/// Steps upstream of a window's nodes that it reaches past its core. The rules look at
/// most six ops below a matched op (the decomposed norm's `rsqrt(mean(pow(xf)) + eps)`
/// and the cast giving `xf`); views and waits below it cost none.
pub(crate) const BACKWARD_HALO: u32 = 8;

/// Whether a graph of `nodes` nodes is one window under
/// [`crate::LowerOptions::window_nodes`] = `window_nodes` (0 counts as 1): at most that
/// many nodes.
pub(crate) fn is_whole(nodes: usize, window_nodes: usize) -> bool {
    nodes <= window_nodes.max(1)
}

/// One window: the nodes converted, and the all-reduces it decides.
#[derive(Debug, Default)]
pub(crate) struct Window {
    /// Node indices, ascending (a topological order).
    pub nodes: Vec<u32>,
    /// The all-reduces of its core, ascending.
    pub owned: Vec<u32>,
}

/// Cuts `g` into windows of `core` nodes and halos, one at a time ([`Windows::next`]),
/// reusing its buffers.
pub(crate) struct Windows<'a> {
    g: &'a Graph,
    uses: &'a Uses,
    /// The graph's all-reduces, ascending.
    instances: &'a [u32],
    /// [`crate::LowerOptions::window_nodes`] ([`is_whole`]).
    window_nodes: usize,
    /// Nodes per core range of a cut graph.
    core: usize,
    /// Start of the next core range.
    next_start: usize,
    /// Whether the first window was made.
    started: bool,
    /// Per node: the number of the window that holds it (0: none yet).
    member: Vec<u32>,
    /// The number of the window being built.
    window: u32,
    /// Per node: the number of the search that reached it last, and its distance then.
    seen: Vec<u32>,
    dist: Vec<u32>,
    /// The number of the current search.
    search: u32,
    queue: VecDeque<(u32, u32)>,
    /// Per node: [`modeled_step`] once computed ([`UNKNOWN`] before, [`NOT_MODELED`]
    /// for `None`): a halo search reaches most nodes many times.
    step: Vec<u8>,
    /// The sources of the backward search (the window's nodes when it starts).
    sources: Vec<u32>,
}

/// A window's core: the nodes `start..end` and, as positions in the graph's
/// all-reduces, the ones it decides.
struct Core {
    start: usize,
    end: usize,
    owned: std::ops::Range<usize>,
}

/// [`Windows::step`] of a node not looked at yet.
const UNKNOWN: u8 = u8::MAX;
/// [`Windows::step`] of a node the rules do not model.
const NOT_MODELED: u8 = u8::MAX - 1;

/// Which way a halo search goes.
#[derive(Clone, Copy, PartialEq)]
enum Way {
    /// To the users of a node.
    Down,
    /// To the producers of a node's inputs.
    Up,
}

impl<'a> Windows<'a> {
    /// Windows of `g`: one holding every node when `g` has at most `window_nodes`
    /// nodes (0 counts as 1, as `LowerOptions` says), else cores of
    /// `window_nodes / CORE_DIVISOR` nodes (at least 1).
    pub fn new(
        g: &'a Graph,
        uses: &'a Uses,
        instances: &'a [u32],
        window_nodes: usize,
    ) -> Windows<'a> {
        Windows {
            g,
            uses,
            instances,
            window_nodes,
            core: (window_nodes / CORE_DIVISOR).max(1),
            next_start: 0,
            started: false,
            member: Vec::new(),
            window: 0,
            seen: Vec::new(),
            dist: Vec::new(),
            search: 0,
            queue: VecDeque::new(),
            step: Vec::new(),
            sources: Vec::new(),
        }
    }

    /// Whether the graph is one window (its e-graph the whole graph's).
    pub fn whole(&self) -> bool {
        is_whole(self.g.len(), self.window_nodes)
    }

    /// The next window, written into `w`; false when none is left. Of a graph cut into
    /// several windows, a core range without an all-reduce decides nothing and is
    /// skipped; a graph that is one window is always converted (its report gives the
    /// e-graph of the whole graph).
    pub fn next(&mut self, w: &mut Window) -> bool {
        let Some(core) = self.next_core() else {
            return false;
        };
        w.owned.clear();
        w.nodes.clear();
        w.owned
            .extend_from_slice(&self.instances[core.owned.clone()]);
        if self.whole() {
            // The whole graph: no halo.
            w.nodes.extend(0..self.g.len() as u32);
        } else {
            self.build(core.start, core.end, w);
        }
        true
    }

    /// Passes over the next window without building it (another thread builds it,
    /// `crate::find`); false when none was left.
    pub fn skip(&mut self) -> bool {
        self.next_core().is_some()
    }

    /// The next window's core (the whole graph for a graph that is one window), past
    /// core ranges without an all-reduce; `None` when none is left.
    fn next_core(&mut self) -> Option<Core> {
        let n = self.g.len();
        loop {
            // The first window is always made (an empty graph is one empty window).
            if self.started && self.next_start >= n {
                return None;
            }
            self.started = true;
            if self.whole() {
                self.next_start = n;
                return Some(Core {
                    start: 0,
                    end: n,
                    owned: 0..self.instances.len(),
                });
            }
            let start = self.next_start;
            let end = start.saturating_add(self.core).min(n);
            self.next_start = end;
            let lo = self.instances.partition_point(|&i| (i as usize) < start);
            let hi = self.instances.partition_point(|&i| (i as usize) < end);
            if lo < hi {
                return Some(Core {
                    start,
                    end,
                    owned: lo..hi,
                });
            }
        }
    }

    /// The core `start..end` with its halos.
    fn build(&mut self, start: usize, end: usize, w: &mut Window) {
        let n = self.g.len();
        if self.member.len() != n {
            self.member = vec![0; n];
            self.seen = vec![0; n];
            self.dist = vec![0; n];
            self.step = vec![UNKNOWN; n];
        }
        self.window += 1;
        for m in &mut self.member[start..end] {
            *m = self.window;
        }
        w.nodes.extend(start as u32..end as u32);
        // Forward halo: from every owned all-reduce at once.
        let owned = std::mem::take(&mut w.owned);
        self.search(&owned, Way::Down, FORWARD_HALO, w);
        w.owned = owned;
        // Backward halo: from every node of the window at once.
        let mut sources = std::mem::take(&mut self.sources);
        sources.clear();
        sources.extend_from_slice(&w.nodes);
        self.search(&sources, Way::Up, BACKWARD_HALO, w);
        self.sources = sources;
        // The core is in order and every halo node lies before or after it: sort the
        // halo alone and put the part before the core in front.
        let core = end - start;
        w.nodes[core..].sort_unstable();
        let before = w.nodes[core..].partition_point(|&m| (m as usize) < start);
        w.nodes[..core + before].rotate_right(before);
    }

    /// A 0-1 breadth-first search from `sources` going `way` through modeled nodes, up
    /// to `limit` steps (views and waits cost none); every node it reaches joins `w`.
    fn search(&mut self, sources: &[u32], way: Way, limit: u32, w: &mut Window) {
        self.search += 1;
        self.queue.clear();
        for &s in sources {
            self.seen[s as usize] = self.search;
            self.dist[s as usize] = 0;
            self.queue.push_back((s, 0));
        }
        while let Some((node, d)) = self.queue.pop_front() {
            if d > self.dist[node as usize] {
                continue; // reached again nearer since
            }
            let (g, uses) = (self.g, self.uses);
            let (down, up): (&[u32], &[arfuse_ir::Value]) = match way {
                Way::Down => (uses.users_of_node(node), &[]),
                Way::Up => (&[], &g.node(NodeId::new(node as usize)).inputs),
            };
            let next = down
                .iter()
                .copied()
                .chain(up.iter().map(|v| v.node.index() as u32));
            for m in next {
                let i = m as usize;
                let step = match self.step[i] {
                    UNKNOWN => {
                        let s = modeled_step(g, NodeId::new(i)).map_or(NOT_MODELED, |s| s as u8);
                        self.step[i] = s;
                        s
                    }
                    s => s,
                };
                if step == NOT_MODELED {
                    continue;
                }
                let nd = d + u32::from(step);
                if nd > limit || (self.seen[i] == self.search && self.dist[i] <= nd) {
                    continue;
                }
                self.seen[i] = self.search;
                self.dist[i] = nd;
                if step == 0 {
                    self.queue.push_front((m, nd));
                } else {
                    self.queue.push_back((m, nd));
                }
                if self.member[i] != self.window {
                    self.member[i] = self.window;
                    w.nodes.push(m);
                }
            }
        }
    }
}
