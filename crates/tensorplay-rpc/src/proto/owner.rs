//! The owner side of the RRef protocol, as a state machine: which values this worker owns and
//! what keeps each alive: the user forks registered with it, its own live handles, and its own
//! handles in a message to itself. An entry goes when none of these is left.
//!
//! Messages between two workers are not ordered, so a fork's deletion can arrive before its
//! registration (the creator of a timed-out `remote` deletes at once); the table then
//! remembers the deletion, and the late registration is skipped.
//!
//! The table holds no sockets, clocks or handles: `V` is the shell's value slot (a watch
//! channel in the agent, a plain value in the simulator), created empty with an entry. Every
//! transition that may remove an entry returns its value instead of dropping it: a value can
//! hold RRefs owned by this same worker, whose drop comes back to this table, so the shell
//! drops it after unlocking.

use std::collections::{HashMap, HashSet};

/// A globally unique id: the worker that created it and a per-process counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GloballyUniqueId {
    /// The creating worker's id.
    pub created_on: usize,
    /// The creating process's counter value.
    pub local_id: u64,
}

impl std::fmt::Display for GloballyUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GloballyUniqueId(created_on={}, local_id={})",
            self.created_on, self.local_id
        )
    }
}

type Gid = GloballyUniqueId;

/// One owned value and what keeps it alive.
struct Owned<V> {
    value: V,
    forks: HashSet<Gid>,
    local: usize,
    in_transit: usize,
}

/// The values one worker owns.
pub(crate) struct OwnerTable<V> {
    owners: HashMap<Gid, Owned<V>>,
    early_deletes: HashSet<(Gid, Gid)>,
}

impl<V: Default> Default for OwnerTable<V> {
    fn default() -> Self {
        OwnerTable {
            owners: HashMap::new(),
            early_deletes: HashSet::new(),
        }
    }
}

impl<V: Default> OwnerTable<V> {
    fn entry(&mut self, id: Gid) -> &mut Owned<V> {
        self.owners.entry(id).or_insert_with(|| Owned {
            value: V::default(),
            forks: HashSet::new(),
            local: 0,
            in_transit: 0,
        })
    }

    /// The value slot of `id`, made (empty) when `id` has no entry yet: a fetch may arrive
    /// before the creation. Call [`OwnerTable::release_if_unused`] when done with it.
    pub(crate) fn slot(&mut self, id: Gid) -> &mut V {
        &mut self.entry(id).value
    }

    /// The value slot of `id` when it has an entry.
    #[cfg(test)]
    pub(crate) fn get(&self, id: Gid) -> Option<&V> {
        self.owners.get(&id).map(|o| &o.value)
    }

    /// A live owner handle of `id` was made here.
    pub(crate) fn add_local(&mut self, id: Gid) {
        self.entry(id).local += 1;
    }

    /// An owner handle of `id` was dropped.
    #[must_use = "drop a released value only after unlocking the table: it may hold RRefs whose drop locks it again"]
    pub(crate) fn drop_local(&mut self, id: Gid) -> Option<V> {
        if let Some(o) = self.owners.get_mut(&id) {
            o.local = o.local.saturating_sub(1);
        }
        self.release_if_unused(id)
    }

    /// Registers user `fork` of `id` (a `remote`'s creator, a fork request, or an owner's
    /// early registration), unless its deletion arrived first.
    pub(crate) fn add_fork(&mut self, id: Gid, fork: Gid) {
        if !self.early_deletes.remove(&(id, fork)) {
            self.entry(id).forks.insert(fork);
        }
    }

    /// A user asks to register its `fork` of `id` (it received the RRef from another user).
    /// The request may overtake the `remote()` creating `id` (messages are not ordered), so an
    /// unknown id gets an empty entry, like a fetch, unless `id` was created by this worker
    /// itself (`me`): such a value had its entry from its creation on, so a missing entry means
    /// it was deleted (or never existed), and the request is refused (`false`) instead of
    /// leaving an entry no value will ever fill.
    pub(crate) fn request_fork(&mut self, id: Gid, fork: Gid, me: usize) -> bool {
        if id.created_on == me && !self.owners.contains_key(&id) {
            return false;
        }
        self.add_fork(id, fork);
        true
    }

    /// User `fork` of `id` was deleted: removes it (remembering it when not registered yet)
    /// and the entry when nothing keeps it any more.
    #[must_use = "drop a released value only after unlocking the table: it may hold RRefs whose drop locks it again"]
    pub(crate) fn remove_fork(&mut self, id: Gid, fork: Gid) -> Option<V> {
        let known = self
            .owners
            .get_mut(&id)
            .is_some_and(|o| o.forks.remove(&fork));
        if !known {
            self.early_deletes.insert((id, fork));
        }
        self.release_if_unused(id)
    }

    /// Undoes an early registration whose message was not delivered.
    #[must_use = "drop a released value only after unlocking the table: it may hold RRefs whose drop locks it again"]
    pub(crate) fn undo_fork(&mut self, id: Gid, fork: Gid) -> Option<V> {
        if let Some(o) = self.owners.get_mut(&id) {
            o.forks.remove(&fork);
        }
        self.release_if_unused(id)
    }

    /// An owner handle of `id` leaves in a message from this worker to itself (a self-call's
    /// argument or result): the value must outlive the sending handle until it is decoded.
    pub(crate) fn sent_to_self(&mut self, id: Gid) {
        self.entry(id).in_transit += 1;
    }

    /// A handle sent to itself arrived ([`OwnerTable::add_local`] first, for the handle it
    /// becomes), or its message was not delivered.
    #[must_use = "drop a released value only after unlocking the table: it may hold RRefs whose drop locks it again"]
    pub(crate) fn arrived_from_self(&mut self, id: Gid) -> Option<V> {
        if let Some(o) = self.owners.get_mut(&id) {
            o.in_transit = o.in_transit.saturating_sub(1);
        }
        self.release_if_unused(id)
    }

    /// Removes the entry of `id` when no fork, local handle or handle in transit keeps it,
    /// returning its value.
    #[must_use = "drop a released value only after unlocking the table: it may hold RRefs whose drop locks it again"]
    pub(crate) fn release_if_unused(&mut self, id: Gid) -> Option<V> {
        if self
            .owners
            .get(&id)
            .is_some_and(|o| o.forks.is_empty() && o.local == 0 && o.in_transit == 0)
        {
            return self.owners.remove(&id).map(|o| o.value);
        }
        None
    }

    /// `(values owned, forks registered)`.
    pub(crate) fn counts(&self) -> (usize, usize) {
        (
            self.owners.len(),
            self.owners.values().map(|o| o.forks.len()).sum(),
        )
    }

    /// Forgets everything (after shutdown), returning the values.
    #[must_use = "drop a released value only after unlocking the table: it may hold RRefs whose drop locks it again"]
    pub(crate) fn clear(&mut self) -> Vec<V> {
        self.early_deletes.clear();
        self.owners.drain().map(|(_, o)| o.value).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(c: usize, l: u64) -> Gid {
        Gid {
            created_on: c,
            local_id: l,
        }
    }

    /// A fork request for a value this worker created and already dropped is refused (it left
    /// an entry no value would ever fill); one for another worker's `remote` that has not
    /// arrived yet is registered and waits for the creation.
    #[test]
    fn fork_requests_for_dropped_values_are_refused() {
        let mut t: OwnerTable<Option<u64>> = OwnerTable::default();
        let own = g(0, 1);
        *t.slot(own) = Some(1);
        t.add_local(own);
        assert_eq!(t.drop_local(own), Some(Some(1)), "the value is handed back");
        assert!(!t.request_fork(own, g(2, 9), 0));
        assert_eq!(t.counts(), (0, 0));
        let theirs = g(1, 4);
        assert!(t.request_fork(theirs, g(2, 10), 0));
        assert_eq!(t.counts(), (1, 1));
        assert_eq!(t.remove_fork(theirs, g(2, 10)), Some(None));
        assert_eq!(t.counts(), (0, 0));
    }
}
