//! The user side of the RRef protocol, as a state machine: the user forks this worker holds,
//! whether their owner has confirmed each, and the parents kept alive for their children.
//!
//! - A fork is **pending** until its owner answers: the owner's acknowledgement of the
//!   `remote()` that made it, or of the [`Message::ForkRequest`] a user sends when it received
//!   the RRef from another user. A fork registered early by its owner (sent by the owner) is
//!   confirmed at once.
//! - A user that sends its RRef in a message makes a **child** fork and keeps its own fork
//!   until the child is accepted ([`Message::ChildAccept`] from the child's worker once the
//!   owner confirmed it, or from the owner when the child is the owner's own handle), so the
//!   owner never drops the value between the parent's deletion and the child's registration.
//! - A dropped fork sends its [`Message::UserDelete`] only once it is confirmed and has no
//!   child pending; a fork the owner never registered (its worker was lost, or the fork
//!   request failed) is forgotten without one.
//! - Every value request a fork sends (a fetch, a method) is counted, and the count travels in
//!   its deletion: the deletion may overtake them, and the owner must not wait for (and keep
//!   an entry for) a value the deleted fork can no longer be given.
//!
//! Every transition returns the messages to send; the table holds no sockets, clocks or
//! handles (the shell keeps its handles and notifies their waiters).

use std::collections::HashMap;

use super::message::{ForkRef, Message, Outgoing};
use super::owner::GloballyUniqueId;

type Gid = GloballyUniqueId;

/// Whether the owner has registered a fork.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Registration {
    /// Not known yet.
    Pending,
    /// Registered: it must be deleted when dropped.
    Confirmed,
    /// Never registered (the owner was lost, or refused the fork request): nothing to delete.
    Lost,
}

/// One user fork held by this worker.
#[derive(Debug)]
struct Fork {
    owner: usize,
    rref: Gid,
    registration: Registration,
    /// The user that sent it, told once it is confirmed (`None`: made here by `remote()`, or
    /// sent by the owner).
    parent: Option<usize>,
    /// Children not accepted yet.
    children: usize,
    /// Every handle of it was dropped (or shutdown deletes it).
    dropped: bool,
    /// Value requests (fetches, methods) sent naming it.
    requests: u64,
}

/// The user forks of one worker.
#[derive(Debug)]
pub(crate) struct UserTable {
    me: usize,
    forks: HashMap<Gid, Fork>,
    /// Children not accepted yet, with the parent fork each keeps.
    children: HashMap<Gid, Gid>,
}

impl UserTable {
    /// The table of worker `me`.
    pub(crate) fn new(me: usize) -> UserTable {
        UserTable {
            me,
            forks: HashMap::new(),
            children: HashMap::new(),
        }
    }

    /// `remote()` made fork `fork` of `rref` on `owner`; pending until the owner answers.
    pub(crate) fn created(&mut self, owner: usize, rref: Gid, fork: Gid) {
        self.insert(owner, rref, fork, Registration::Pending, None);
    }

    /// Fork `fork` of `rref` arrived in a message from `parent` (a user, or the owner when
    /// `parent_is_owner`: it registered the fork before sending). From a user, the owner is
    /// asked to register it.
    pub(crate) fn received(
        &mut self,
        owner: usize,
        rref: Gid,
        fork: Gid,
        parent: usize,
        parent_is_owner: bool,
    ) -> Vec<Outgoing> {
        if parent_is_owner {
            self.insert(owner, rref, fork, Registration::Confirmed, None);
            return Vec::new();
        }
        self.insert(owner, rref, fork, Registration::Pending, Some(parent));
        vec![Outgoing {
            to: owner,
            message: Message::ForkRequest {
                rref: ForkRef::new(owner, rref, fork),
                parent: parent as u32,
            },
        }]
    }

    fn insert(
        &mut self,
        owner: usize,
        rref: Gid,
        fork: Gid,
        registration: Registration,
        parent: Option<usize>,
    ) {
        self.forks.insert(
            fork,
            Fork {
                owner,
                rref,
                registration,
                parent,
                children: 0,
                dropped: false,
                requests: 0,
            },
        );
    }

    /// The owner answered for `fork`: `registered` when it holds the fork (a successful
    /// `remote` or fork request, also a `remote` whose function failed: the owner keeps the
    /// error as the value), `false` when it never will. Tells the parent its child was
    /// accepted either way, and sends the deletion of a fork dropped meanwhile.
    pub(crate) fn confirmed(&mut self, fork: Gid, registered: bool) -> Vec<Outgoing> {
        let Some(f) = self.forks.get_mut(&fork) else {
            return Vec::new();
        };
        if f.registration != Registration::Pending {
            return Vec::new();
        }
        f.registration = if registered {
            Registration::Confirmed
        } else {
            Registration::Lost
        };
        let mut out = Vec::new();
        match f.parent {
            Some(p) if p == self.me => out.extend(self.child_accepted(fork)),
            Some(p) => out.push(Outgoing {
                to: p,
                message: Message::ChildAccept { child: fork.into() },
            }),
            None => {}
        }
        out.extend(self.settle(fork));
        out
    }

    /// This worker sends a request that reads the value of `fork` on its owner (a fetch or a
    /// method call): counted, the count goes in the fork's deletion.
    pub(crate) fn value_request(&mut self, fork: Gid) {
        if let Some(f) = self.forks.get_mut(&fork) {
            f.requests += 1;
        }
    }

    /// This worker sends its fork `parent` in a message as child fork `child`: the parent is
    /// kept until the child is accepted.
    pub(crate) fn forked(&mut self, parent: Gid, child: Gid) {
        if let Some(f) = self.forks.get_mut(&parent) {
            f.children += 1;
            self.children.insert(child, parent);
        }
    }

    /// Child `child` was accepted (or its message was not delivered): its parent is no longer
    /// kept for it.
    pub(crate) fn child_accepted(&mut self, child: Gid) -> Vec<Outgoing> {
        let Some(parent) = self.children.remove(&child) else {
            return Vec::new();
        };
        if let Some(f) = self.forks.get_mut(&parent) {
            f.children = f.children.saturating_sub(1);
        }
        self.settle(parent)
    }

    /// Every handle of `fork` was dropped: its deletion is sent once nothing holds it back.
    /// Dropping an unknown or already dropped fork does nothing.
    pub(crate) fn dropped(&mut self, fork: Gid) -> Vec<Outgoing> {
        match self.forks.get_mut(&fork) {
            Some(f) if !f.dropped => {
                f.dropped = true;
                self.settle(fork)
            }
            _ => Vec::new(),
        }
    }

    /// Deletes every fork (a graceful shutdown): the deletions possible now; the others follow
    /// as their forks are confirmed and their children accepted.
    pub(crate) fn drop_all(&mut self) -> Vec<Outgoing> {
        let forks: Vec<Gid> = self.forks.keys().copied().collect();
        forks.into_iter().flat_map(|f| self.dropped(f)).collect()
    }

    /// Removes a dropped fork once it is settled, with its deletion when the owner holds it.
    fn settle(&mut self, fork: Gid) -> Vec<Outgoing> {
        let Some(f) = self.forks.get(&fork) else {
            return Vec::new();
        };
        if !f.dropped || f.children > 0 || f.registration == Registration::Pending {
            return Vec::new();
        }
        let (owner, rref, registration, requests) = (f.owner, f.rref, f.registration, f.requests);
        self.forks.remove(&fork);
        if registration == Registration::Lost {
            return Vec::new();
        }
        vec![Outgoing {
            to: owner,
            message: Message::UserDelete {
                rref: ForkRef::new(owner, rref, fork),
                requests,
            },
        }]
    }

    /// Whether `fork` is held here and confirmed by its owner.
    #[cfg(test)]
    pub(crate) fn is_confirmed(&self, fork: Gid) -> bool {
        self.forks
            .get(&fork)
            .is_some_and(|f| f.registration == Registration::Confirmed)
    }

    /// `(live forks not confirmed yet, children not accepted yet)`.
    pub(crate) fn counts(&self) -> (usize, usize) {
        (
            self.forks
                .values()
                .filter(|f| !f.dropped && f.registration == Registration::Pending)
                .count(),
            self.children.len(),
        )
    }

    /// `(user forks held, children not accepted yet)`, dropped forks waiting included.
    pub(crate) fn held(&self) -> (usize, usize) {
        (self.forks.len(), self.children.len())
    }

    /// Whether nothing is held: every fork deleted and every child accepted.
    pub(crate) fn is_empty(&self) -> bool {
        self.forks.is_empty() && self.children.is_empty()
    }

    /// Forgets everything (after shutdown).
    pub(crate) fn clear(&mut self) {
        self.forks.clear();
        self.children.clear();
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

    #[test]
    fn a_dropped_fork_is_deleted_once_confirmed_and_its_children_accepted_with_its_request_count() {
        let (rref, a, child) = (g(0, 1), g(1, 2), g(1, 3));
        let mut t = UserTable::new(1);
        t.created(0, rref, a);
        t.value_request(a);
        t.value_request(a);
        t.forked(a, child);
        assert!(t.dropped(a).is_empty(), "pending: no deletion yet");
        assert!(t.confirmed(a, true).is_empty(), "a child still pending");
        let out = t.child_accepted(child);
        assert_eq!(
            out,
            vec![Outgoing {
                to: 0,
                message: Message::UserDelete {
                    rref: ForkRef::new(0, rref, a),
                    requests: 2,
                },
            }]
        );
        assert!(t.is_empty());
        assert!(t.dropped(a).is_empty(), "a second drop sends nothing");
    }

    #[test]
    fn a_fork_from_a_user_is_requested_and_accepted() {
        let (rref, child) = (g(0, 1), g(2, 5));
        let mut t = UserTable::new(1);
        let out = t.received(0, rref, child, 2, false);
        assert_eq!(out[0].to, 0);
        assert!(matches!(
            out[0].message,
            Message::ForkRequest { parent: 2, .. }
        ));
        assert_eq!(t.counts(), (1, 0));
        let out = t.confirmed(child, true);
        assert_eq!(
            out,
            vec![Outgoing {
                to: 2,
                message: Message::ChildAccept {
                    child: child.into()
                },
            }]
        );
        assert!(t.is_confirmed(child));
        // lost forks are forgotten without a deletion
        let other = g(2, 6);
        t.received(0, rref, other, 2, false);
        t.dropped(other);
        let out = t.confirmed(other, false);
        assert!(
            out.iter()
                .all(|o| !matches!(o.message, Message::UserDelete { .. }))
        );
        assert_eq!(t.counts(), (0, 0));
    }
}
