//! The owner side of the RRef protocol, as a state machine: which values this worker owns and
//! what keeps each alive: the user forks registered with it, its own live handles, and its own
//! handles in a message to itself. An entry goes when none of these is left.
//!
//! Messages between two workers are not ordered, so a fork's deletion can arrive before
//! other messages of that fork, which the table then remembers (a tombstone) until they came:
//! - its registration (the creator of a timed-out `remote` deletes at once): the late
//!   registration is skipped;
//! - its value requests (fetches, methods) sent before the deletion, e.g. by a user that gave
//!   up on a fetch when the creation failed. The deletion says how many the fork sent, the
//!   table counts those it received; one that arrives after the deletion is refused at once
//!   ([`OwnerTable::value_request`]) instead of making an empty entry that no value fills and
//!   no deletion removes any more (it stayed until the request's own timeout, or for ever
//!   without one).
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

/// What a user fork's deletion that overtook other messages of the fork still waits for.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Tombstone {
    /// The fork's registration (a `remote`'s creation, a fork request).
    registration: bool,
    /// Value requests (fetches, methods) the fork sent before its deletion.
    requests: u64,
}

/// The values one worker owns.
pub(crate) struct OwnerTable<V> {
    owners: HashMap<Gid, Owned<V>>,
    /// Value requests received per `(id, user fork)`, until the fork's deletion.
    requests: HashMap<(Gid, Gid), u64>,
    /// Deletions of user forks `(id, fork)` that arrived before other messages of the fork.
    deleted: HashMap<(Gid, Gid), Tombstone>,
}

impl<V: Default> Default for OwnerTable<V> {
    fn default() -> Self {
        OwnerTable {
            owners: HashMap::new(),
            requests: HashMap::new(),
            deleted: HashMap::new(),
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
        if let Some(t) = self.deleted.get_mut(&(id, fork))
            && t.registration
        {
            t.registration = false;
            self.forget_if_done(id, fork);
            return;
        }
        self.entry(id).forks.insert(fork);
    }

    /// A value request (a fetch or a method call) from user `fork` of `id` arrived. `false`:
    /// the fork's deletion overtook it (its sender gave up on it), so the value may be gone
    /// for good: answer at once, without an entry. Otherwise it is counted, and the caller may
    /// wait for the value in [`OwnerTable::slot`] (the creation may not have arrived yet).
    pub(crate) fn value_request(&mut self, id: Gid, fork: Gid) -> bool {
        if fork == id {
            // the owner's own handle: no user fork, never deleted
            return true;
        }
        if let Some(t) = self.deleted.get_mut(&(id, fork))
            && t.requests > 0
        {
            t.requests -= 1;
            self.forget_if_done(id, fork);
            return false;
        }
        *self.requests.entry((id, fork)).or_default() += 1;
        true
    }

    /// Forgets the tombstone of `(id, fork)` once nothing more of the fork is to come.
    fn forget_if_done(&mut self, id: Gid, fork: Gid) {
        if self
            .deleted
            .get(&(id, fork))
            .is_some_and(|t| !t.registration && t.requests == 0)
        {
            self.deleted.remove(&(id, fork));
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

    /// User `fork` of `id` was deleted after sending `requests` value requests: removes it,
    /// and the entry when nothing keeps it any more, remembering what of the fork is still to
    /// come (its registration, value requests the deletion overtook).
    #[must_use = "drop a released value only after unlocking the table: it may hold RRefs whose drop locks it again"]
    pub(crate) fn remove_fork(&mut self, id: Gid, fork: Gid, requests: u64) -> Option<V> {
        let received = self.requests.remove(&(id, fork)).unwrap_or(0);
        let registered = self
            .owners
            .get_mut(&id)
            .is_some_and(|o| o.forks.remove(&fork));
        let t = Tombstone {
            registration: !registered,
            requests: requests.saturating_sub(received),
        };
        if t != Tombstone::default() {
            // a repeated deletion (its first try timed out) keeps the first one's tombstone
            self.deleted.entry((id, fork)).or_insert(t);
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

    /// `(tombstones, forks with value requests counted)`: what the table remembers besides
    /// its entries.
    #[cfg(test)]
    pub(crate) fn remembered(&self) -> (usize, usize) {
        (self.deleted.len(), self.requests.len())
    }

    /// Forgets everything (after shutdown), returning the values.
    #[must_use = "drop a released value only after unlocking the table: it may hold RRefs whose drop locks it again"]
    pub(crate) fn clear(&mut self) -> Vec<V> {
        self.deleted.clear();
        self.requests.clear();
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
        assert_eq!(t.remove_fork(theirs, g(2, 10), 0), Some(None));
        assert_eq!(t.counts(), (0, 0));
    }

    /// A deletion that overtakes value requests of its fork (its user gave up on a fetch)
    /// makes them refused when they arrive, without an entry left waiting, whether it came
    /// before or after the fork's registration; nothing is remembered once all arrived.
    #[test]
    fn value_requests_overtaken_by_their_forks_deletion_are_refused() {
        let mut t: OwnerTable<Option<u64>> = OwnerTable::default();
        // created, one of three fetches received, deleted
        let (id, fork) = (g(0, 1), g(0, 2));
        t.add_fork(id, fork);
        *t.slot(id) = Some(7);
        assert!(t.value_request(id, fork));
        assert_eq!(t.remove_fork(id, fork, 3), Some(Some(7)));
        assert_eq!(t.remembered(), (1, 0));
        assert!(!t.value_request(id, fork));
        assert!(!t.value_request(id, fork));
        assert_eq!(t.counts(), (0, 0));
        assert_eq!(t.remembered(), (0, 0));
        // deleted before its creation and its fetch
        let (id, fork) = (g(0, 3), g(0, 4));
        assert_eq!(t.remove_fork(id, fork, 1), None);
        t.add_fork(id, fork);
        *t.slot(id) = Some(8);
        assert_eq!(t.release_if_unused(id), Some(Some(8)));
        assert!(!t.value_request(id, fork));
        assert_eq!(t.counts(), (0, 0));
        assert_eq!(t.remembered(), (0, 0));
        // the owner's own handles are neither counted nor refused
        assert!(t.value_request(id, id));
        assert_eq!(t.remembered(), (0, 0));
    }
}
