//! The distributed-autograd context table of one worker: which contexts are open here, the
//! workers each one reached, and the cleanup fan-out when one is released.
//!
//! A context is created by one worker ([`ContextTable::create`]) and opened on every other
//! worker by the first request that carries it ([`ContextTable::received`]). Releasing it
//! (the creator's guard dropped, or a [`Cleanup`] arriving) closes it here and returns one
//! [`Cleanup`] per worker it was sent to, which do the same, so the release reaches every
//! worker the context reached.
//!
//! Messages between two workers are not ordered, so a request sent inside a context can
//! arrive *after* that context's cleanup. Such a request must not reopen the context: nothing
//! would ever release it again. The table therefore remembers the contexts it released, for
//! `horizon` (given by the shell: longer than any request can be in flight), and a late
//! request for one of them is served outside any context.
//!
//! The table holds no clock: the shell passes the current [`Instant`] to the transitions that
//! need it.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

/// A distributed autograd context id: `worker_id << 48 | counter`.
pub type ContextId = u64;

/// The counter bits of a [`ContextId`] or message id.
const COUNTER_BITS: u32 = 48;

/// A cleanup to send: `context` was released here and had reached worker `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Cleanup {
    pub(crate) to: usize,
    pub(crate) context: ContextId,
}

/// One open context: the workers it was sent to, and the shell's data for it.
struct Open<C> {
    known: BTreeSet<usize>,
    data: C,
}

/// The contexts of one worker. `C` is the shell's per-context data (send and recv functions,
/// gradients), handed out by clone (an `Arc` in the shell).
pub(crate) struct ContextTable<C> {
    me: usize,
    horizon: Duration,
    next_context: u64,
    next_message: u64,
    open: HashMap<ContextId, Open<C>>,
    /// Contexts released here, with when: a late request must not reopen them.
    released: HashSet<ContextId>,
    released_order: VecDeque<(Instant, ContextId)>,
}

impl<C: Clone + Default> ContextTable<C> {
    /// The table of worker `me`; released contexts are remembered for `horizon`.
    pub(crate) fn new(me: usize, horizon: Duration) -> ContextTable<C> {
        ContextTable {
            me,
            horizon,
            next_context: 0,
            next_message: 0,
            open: HashMap::new(),
            released: HashSet::new(),
            released_order: VecDeque::new(),
        }
    }

    /// Whether context `id` was created by this worker (its top bits are this worker's id).
    pub(crate) fn created_here(&self, id: ContextId) -> bool {
        id >> COUNTER_BITS == self.me as u64
    }

    /// Opens a new context created by this worker.
    pub(crate) fn create(&mut self) -> (ContextId, C) {
        let id = self.stamp(self.next_context);
        self.next_context += 1;
        (id, self.open_new(id))
    }

    /// An id of this worker: its rank in the top bits, `counter` below.
    fn stamp(&self, counter: u64) -> u64 {
        ((self.me as u64) << COUNTER_BITS) | (counter & ((1 << COUNTER_BITS) - 1))
    }

    /// Opens context `id` here with fresh data.
    fn open_new(&mut self, id: ContextId) -> C {
        let data = C::default();
        self.open.insert(
            id,
            Open {
                known: BTreeSet::new(),
                data: data.clone(),
            },
        );
        data
    }

    /// A new message id of this worker (the key of a send function).
    pub(crate) fn message_id(&mut self) -> u64 {
        let id = self.stamp(self.next_message);
        self.next_message += 1;
        id
    }

    /// The data of context `id` when it is open here.
    pub(crate) fn get(&self, id: ContextId) -> Option<C> {
        self.open.get(&id).map(|o| o.data.clone())
    }

    /// A message within `id` leaves for worker `to`: records `to` as reached. `None` when `id`
    /// is no longer open here (released meanwhile): the message then carries no context.
    pub(crate) fn sent(&mut self, id: ContextId, to: usize) -> Option<C> {
        let o = self.open.get_mut(&id)?;
        if to != self.me {
            o.known.insert(to);
        }
        Some(o.data.clone())
    }

    /// A message carrying context `id` arrived (`request`: a request, else a response). A
    /// request opens a context another worker created; a response, a request for a context
    /// created here, or a request for a context released here (a request that was overtaken
    /// by the cleanup) finds it closed and gets `None`.
    pub(crate) fn received(&mut self, id: ContextId, request: bool, now: Instant) -> Option<C> {
        self.forget_old(now);
        if let Some(o) = self.open.get(&id) {
            return Some(o.data.clone());
        }
        if !request || self.created_here(id) || self.released.contains(&id) {
            return None;
        }
        Some(self.open_new(id))
    }

    /// Releases context `id` here (its guard was dropped, or a cleanup for it arrived):
    /// returns the cleanups for the workers it reached (none when it was not open here). It is
    /// remembered so that a late request does not reopen it.
    pub(crate) fn release(&mut self, id: ContextId, now: Instant) -> Vec<Cleanup> {
        self.forget_old(now);
        if !self.created_here(id) && self.released.insert(id) {
            self.released_order.push_back((now, id));
        }
        let Some(o) = self.open.remove(&id) else {
            return Vec::new();
        };
        o.known
            .into_iter()
            .map(|to| Cleanup { to, context: id })
            .collect()
    }

    /// Forgets the released contexts older than the horizon.
    fn forget_old(&mut self, now: Instant) {
        while let Some(&(t, id)) = self.released_order.front() {
            if now.saturating_duration_since(t) <= self.horizon {
                break;
            }
            self.released_order.pop_front();
            self.released.remove(&id);
        }
    }

    /// The workers context `id` reached, ascending (empty when it is not open here).
    pub(crate) fn known(&self, id: ContextId) -> Vec<usize> {
        self.open
            .get(&id)
            .map(|o| o.known.iter().copied().collect())
            .unwrap_or_default()
    }

    /// The number of contexts open here.
    pub(crate) fn len(&self) -> usize {
        self.open.len()
    }

    /// The number of released contexts remembered.
    #[cfg(test)]
    pub(crate) fn remembered(&self) -> usize {
        self.released.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t0() -> Instant {
        Instant::now()
    }

    #[test]
    fn a_request_overtaken_by_its_cleanup_does_not_reopen_the_context() {
        let now = t0();
        let mut a: ContextTable<()> = ContextTable::new(0, Duration::from_secs(10));
        let mut b: ContextTable<()> = ContextTable::new(1, Duration::from_secs(10));
        let (id, ()) = a.create();
        assert!(a.sent(id, 1).is_some());
        let cleanups = a.release(id, now);
        assert_eq!(cleanups, vec![Cleanup { to: 1, context: id }]);
        // the cleanup arrives first, then the request
        assert!(b.release(id, now).is_empty());
        assert!(b.received(id, true, now).is_none());
        assert_eq!(b.len(), 0);
    }

    #[test]
    fn released_contexts_are_forgotten_after_the_horizon() {
        let now = t0();
        let mut b: ContextTable<()> = ContextTable::new(1, Duration::from_secs(10));
        b.release(5, now);
        assert_eq!(b.remembered(), 1);
        assert!(b.received(5, true, now + Duration::from_secs(5)).is_none());
        assert!(b.received(6, true, now + Duration::from_secs(11)).is_some());
        assert_eq!(b.remembered(), 0);
    }

    #[test]
    fn responses_and_own_contexts_are_never_reopened() {
        let now = t0();
        let mut a: ContextTable<()> = ContextTable::new(0, Duration::from_secs(10));
        let (id, ()) = a.create();
        a.release(id, now);
        assert!(a.received(id, true, now).is_none());
        assert!(a.received((1 << 48) | 3, false, now).is_none());
        assert_eq!(a.len(), 0);
    }
}
