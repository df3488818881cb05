//! Who reads each value of the input graph, as flat tables built once per lowering.
//!
//! Every step that asks "who reads this value" (the conversion's use counts, the
//! windows' halos, the site checks) reads these tables instead of walking petgraph's
//! edge lists, so each question costs a slice lookup.

use arfuse_ir::{Graph, Value};

/// The flat value numbering of a graph and the consumers of every value.
#[derive(Debug, Default)]
pub(crate) struct Uses {
    /// Flat index of each node's first value; one more entry at the end (the number
    /// of values).
    value_base: Vec<u32>,
    /// Consumers of flat value `i`: `user_list[user_start[i]..user_start[i + 1]]`,
    /// node indices in graph order, one entry per input that reads the value.
    user_start: Vec<u32>,
    user_list: Vec<u32>,
    /// Graph-output uses of each flat value.
    output_uses: Vec<u32>,
}

impl Uses {
    /// The tables of `g` (a valid graph: every input names an existing value).
    pub fn new(g: &Graph) -> Uses {
        // Numbering and counting pass (an input names a value of an earlier node, by
        // construction, so its number is known when it is read), then filling pass.
        let mut value_base: Vec<u32> = Vec::with_capacity(g.len() + 1);
        // The count of flat value `i`'s readers, at `i + 1`.
        let mut user_start: Vec<u32> = Vec::with_capacity(g.len() + 2);
        user_start.push(0);
        let mut n_values = 0u32;
        for (_, n) in g.nodes() {
            value_base.push(n_values);
            n_values += n.outputs.len() as u32;
            user_start.resize(n_values as usize + 1, 0);
            for v in &n.inputs {
                user_start[(value_base[v.node.index()] + v.output) as usize + 1] += 1;
            }
        }
        value_base.push(n_values);
        let flat = |v: &Value| (value_base[v.node.index()] + v.output) as usize;
        for i in 1..user_start.len() {
            user_start[i] += user_start[i - 1];
        }
        let mut fill = user_start.clone();
        let mut user_list = vec![0u32; user_start.last().copied().unwrap_or(0) as usize];
        for (id, n) in g.nodes() {
            for v in &n.inputs {
                let slot = &mut fill[flat(v)];
                user_list[*slot as usize] = id.index() as u32;
                *slot += 1;
            }
        }
        let mut output_uses = vec![0u32; n_values as usize];
        for v in g.outputs() {
            output_uses[flat(v)] += 1;
        }
        Uses {
            value_base,
            user_start,
            user_list,
            output_uses,
        }
    }

    /// Number of values of the graph (the flat numbering's size).
    pub fn values(&self) -> usize {
        self.output_uses.len()
    }

    /// The flat index of `v`, when it exists.
    pub fn flat(&self, v: Value) -> Option<usize> {
        let base = *self.value_base.get(v.node.index())?;
        let end = *self.value_base.get(v.node.index() + 1)?;
        (v.output < end - base).then_some((base + v.output) as usize)
    }

    /// Flat indices of node `n`'s values.
    pub fn values_of(&self, n: u32) -> std::ops::Range<usize> {
        match (
            self.value_base.get(n as usize),
            self.value_base.get(n as usize + 1),
        ) {
            (Some(&a), Some(&b)) => a as usize..b as usize,
            _ => 0..0,
        }
    }

    /// Consumers (node indices) of `v`, in graph order, one per input reading it.
    pub fn users_of(&self, v: Value) -> &[u32] {
        match self.flat(v) {
            Some(i) => self.users_of_flat(i),
            None => &[],
        }
    }

    /// Consumers of flat value `i`.
    fn users_of_flat(&self, i: usize) -> &[u32] {
        match (self.user_start.get(i), self.user_start.get(i + 1)) {
            (Some(&a), Some(&b)) => self.user_list.get(a as usize..b as usize).unwrap_or(&[]),
            _ => &[],
        }
    }

    /// Consumers of any value of node `n`, in order of its values.
    pub fn users_of_node(&self, n: u32) -> &[u32] {
        let r = self.values_of(n);
        match (self.user_start.get(r.start), self.user_start.get(r.end)) {
            (Some(&a), Some(&b)) => self.user_list.get(a as usize..b as usize).unwrap_or(&[]),
            _ => &[],
        }
    }

    /// How many graph outputs are `v`.
    pub fn output_uses(&self, v: Value) -> usize {
        self.flat(v)
            .and_then(|i| self.output_uses.get(i))
            .map_or(0, |&n| n as usize)
    }

    /// Whether `v` is a graph output.
    pub fn is_output(&self, v: Value) -> bool {
        self.output_uses(v) > 0
    }
}
