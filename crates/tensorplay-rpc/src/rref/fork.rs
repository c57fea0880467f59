//! Passing RRefs in messages: the forks an encoding makes, undone when the message was not
//! delivered, and what a receiving worker does (an owner resolves to its own value, a user
//! asks the owner to register its fork).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::user::{child_accepted, send_all};
use super::{GloballyUniqueId, RRef, new_id};
use crate::agent::{Agent, agent};
use crate::proto::message::{Message, Outgoing};
use crate::wire::{Decoder, Encoder, Wire};
use crate::{Error, Result};

/// A fork made while encoding a message, settled once the message was delivered.
pub(crate) struct PendingFork {
    child: GloballyUniqueId,
    rref_id: GloballyUniqueId,
    kind: ForkKind,
}

/// What encoding an RRef into a message did, to undo when the message does not arrive.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ForkKind {
    /// An owner sender registered the child fork early.
    Early,
    /// A user sender keeps its RRef alive until the child is accepted.
    KeptParent,
    /// An owner sent its own handle to itself (counted in transit).
    InTransit,
}

/// Whether a request that carried RRefs may have been decoded by its receiver, from how it
/// ended: it did unless the receiver refused it before decoding its arguments (an unknown
/// function or method, or another signature) or the worker was lost. A timed-out request
/// may have been decoded (the receiver may hold the RRefs and use them later), so its forks
/// are kept: undoing them could free a value the receiver still reads; keeping them leaks
/// the fork when the receiver never decoded it, until shutdown.
pub(crate) fn maybe_delivered<T>(r: &Result<T>) -> bool {
    match r {
        Ok(_) => true,
        Err(Error::Remote { kind, .. }) => !matches!(
            kind.as_str(),
            "UnknownFunction" | "UnknownMethod" | "Signature"
        ),
        Err(Error::WorkerUnreachable { .. }) => false,
        Err(_) => true,
    }
}

/// After a message carrying RRefs was sent: when it did not arrive (see [`maybe_delivered`]),
/// undo what encoding did (the parents kept alive for their children, the forks registered
/// early).
pub(crate) fn after_send(a: &Arc<Agent>, forks: Vec<PendingFork>, delivered: bool) {
    if delivered {
        return;
    }
    for f in forks {
        match f.kind {
            ForkKind::Early => {
                let released = a.rrefs.table().undo_fork(f.rref_id, f.child);
                drop(released);
            }
            ForkKind::InTransit => {
                let released = a.rrefs.table().arrived_from_self(f.rref_id);
                drop(released);
            }
            ForkKind::KeptParent => child_accepted(a, f.child),
        }
    }
}

impl<T: Send + 'static> Wire for RRef<T> {
    fn encode(&self, e: &mut Encoder) -> Result<()> {
        let a = self.agent("sending an RRef")?;
        // a creation that failed names its cause (a lost owner, a timeout) before the deletion
        // it led to
        self.check_created()?;
        if self.inner.deleted.load(Ordering::SeqCst) && !self.inner.is_owner {
            return Err(Error::invalid(
                "rpc",
                "rref",
                "a live RRef",
                format!("{self:?}, which has been deleted"),
            ));
        }
        let dest = e.dest.unwrap_or(a.me.id);
        let owner = self.inner.owner.id;
        let child = new_id(a.me.id);
        if dest != owner {
            if self.inner.is_owner {
                // early fork registration by the owner
                a.rrefs.table().add_fork(self.inner.rref_id, child);
                e.forks.push(PendingFork {
                    child,
                    rref_id: self.inner.rref_id,
                    kind: ForkKind::Early,
                });
            } else {
                a.rrefs.users().forked(self.inner.fork_id, child);
                e.forks.push(PendingFork {
                    child,
                    rref_id: self.inner.rref_id,
                    kind: ForkKind::KeptParent,
                });
            }
        } else if self.inner.is_owner {
            // from the owner to itself: counted in transit until decoded, so that the value
            // outlives this handle (a function returning `RRef::new(v)` to a self-call drops
            // its handle before the caller decodes the result)
            a.rrefs.table().sent_to_self(self.inner.rref_id);
            e.forks.push(PendingFork {
                child,
                rref_id: self.inner.rref_id,
                kind: ForkKind::InTransit,
            });
        } else {
            // to the owner: it resolves to its own value and accepts the child at once
            a.rrefs.users().forked(self.inner.fork_id, child);
            e.forks.push(PendingFork {
                child,
                rref_id: self.inner.rref_id,
                kind: ForkKind::KeptParent,
            });
        }
        (owner as u64).encode(e)?;
        (self.inner.rref_id.created_on as u64).encode(e)?;
        self.inner.rref_id.local_id.encode(e)?;
        (child.created_on as u64).encode(e)?;
        child.local_id.encode(e)?;
        (a.me.id as u64).encode(e)?;
        u8::from(self.inner.is_owner).encode(e)?;
        self.inner.type_name.to_string().encode(e)
    }

    fn decode(d: &mut Decoder) -> Result<Self> {
        let a = agent("receiving an RRef")?;
        let n = a.workers.len() as u64;
        let rank = |v: u64| -> Result<usize> {
            if v < n {
                Ok(v as usize)
            } else {
                Err(Error::Serialization(format!(
                    "RRef names worker {v} of {n}"
                )))
            }
        };
        let owner = rank(u64::decode(d)?)?;
        let rref_id = GloballyUniqueId {
            created_on: rank(u64::decode(d)?)?,
            local_id: u64::decode(d)?,
        };
        let child = GloballyUniqueId {
            created_on: rank(u64::decode(d)?)?,
            local_id: u64::decode(d)?,
        };
        let parent = rank(u64::decode(d)?)?;
        let parent_is_owner = bool::decode(d)?;
        let type_name = String::decode(d)?;
        if type_name != std::any::type_name::<T>() {
            return Err(Error::Serialization(format!(
                "an RRef of {type_name} where an RRef of {} was expected",
                std::any::type_name::<T>()
            )));
        }
        if owner == a.me.id {
            // we own it: a local handle; a user parent is told its child was accepted
            let r = RRef::owner_handle(&a, rref_id);
            if parent_is_owner && parent == a.me.id {
                // sent by this worker to itself: the handle in transit arrived
                let released = a.rrefs.table().arrived_from_self(rref_id);
                drop(released);
            }
            if !parent_is_owner && parent != a.me.id {
                send_all(
                    &a,
                    vec![Outgoing {
                        to: parent,
                        message: Message::ChildAccept {
                            child: child.into(),
                        },
                    }],
                );
            } else if !parent_is_owner {
                child_accepted(&a, child);
            }
            return Ok(r);
        }
        // a user: registered early when the owner sent it, else the owner is asked to
        // register the fork (the function it is an argument of waits for that)
        let r = RRef::user_handle(&a, owner, rref_id, child, parent_is_owner);
        if !parent_is_owner {
            d.unconfirmed.push(r.inner.clone());
        }
        let out = a
            .rrefs
            .users()
            .received(owner, rref_id, child, parent, parent_is_owner);
        send_all(&a, out);
        Ok(r)
    }
}
