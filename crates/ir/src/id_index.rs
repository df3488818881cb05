//! Nodes by their string ids: a hash table of node indices, each hashed and compared
//! by the id of the node it names (the id is stored once, in the node). SipHash with a
//! random key, as `std::collections::HashMap`, so that hostile ids cannot make it slow.
//!
//! Shared by [`crate::Graph`] (ids of its nodes) and the JSON loader (ids of the file's
//! nodes by position), which hands its table to the graph it builds: the hashes are
//! those of the same strings, so the table is kept and only its indices are renamed.

use crate::graph::NodeId;
use std::hash::{BuildHasher, RandomState};

/// A table of node indices keyed by their ids; `id_of` arguments give the id of an
/// index (`None` for an index that names nothing).
#[derive(Clone, Debug, Default)]
pub(crate) struct IdIndex {
    table: hashbrown::HashTable<NodeId>,
    hasher: RandomState,
}

impl IdIndex {
    /// An empty table with room for `n` ids.
    pub(crate) fn with_capacity(n: usize) -> IdIndex {
        IdIndex {
            table: hashbrown::HashTable::with_capacity(n),
            hasher: RandomState::new(),
        }
    }

    /// The hash of an id.
    pub(crate) fn hash(&self, id: &str) -> u64 {
        self.hasher.hash_one(id)
    }

    /// The index whose id is `id` (`hash` its hash).
    pub(crate) fn find<'s>(
        &self,
        hash: u64,
        id: &str,
        id_of: impl Fn(NodeId) -> Option<&'s str>,
    ) -> Option<NodeId> {
        self.table.find(hash, |n| id_of(*n) == Some(id)).copied()
    }

    /// Adds `n`, whose id (hashing to `hash`) is not in the table yet.
    pub(crate) fn insert_new<'s>(
        &mut self,
        hash: u64,
        n: NodeId,
        id_of: impl Fn(NodeId) -> Option<&'s str>,
    ) {
        let hasher = &self.hasher;
        let rehash = |m: &NodeId| hasher.hash_one(id_of(*m).unwrap_or(""));
        self.table.insert_unique(hash, n, rehash);
    }

    /// Adds `n` with id `id` (hashing to `hash`); when the id is there already, `n`
    /// replaces the index it had (as a map insert does) and the answer is false.
    pub(crate) fn insert_or_replace<'s>(
        &mut self,
        hash: u64,
        id: &str,
        n: NodeId,
        id_of: impl Fn(NodeId) -> Option<&'s str> + Copy,
    ) -> bool {
        let hasher = &self.hasher;
        let rehash = |m: &NodeId| hasher.hash_one(id_of(*m).unwrap_or(""));
        match self.table.entry(hash, |m| id_of(*m) == Some(id), rehash) {
            hashbrown::hash_table::Entry::Occupied(mut old) => {
                *old.get_mut() = n;
                false
            }
            hashbrown::hash_table::Entry::Vacant(slot) => {
                slot.insert(n);
                true
            }
        }
    }

    /// Makes room for `more` ids.
    pub(crate) fn reserve<'s>(&mut self, more: usize, id_of: impl Fn(NodeId) -> Option<&'s str>) {
        let hasher = &self.hasher;
        self.table
            .reserve(more, |m| hasher.hash_one(id_of(*m).unwrap_or("")));
    }

    /// Renames every index `n` to `rename(n)`, which must name a node with the same id.
    pub(crate) fn rename(&mut self, rename: impl Fn(NodeId) -> NodeId) {
        for n in self.table.iter_mut() {
            *n = rename(*n);
        }
    }
}
