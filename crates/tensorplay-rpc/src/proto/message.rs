//! The messages of the RPC protocol, typed: what a request asks for, which RRef and fork it
//! concerns, and the distributed-autograd header, as one rkyv-archived enum (the transport,
//! `crate::frame`, puts it in the header of every message and validates it before use).
//!
//! Every variant names its fields, so a message can neither carry ids in the wrong positions
//! nor a kind the receiver does not know: rkyv's validation refuses an unknown discriminant
//! as it refuses a bad length.

use rkyv::{Archive, Deserialize, Serialize};

use super::owner::GloballyUniqueId;

/// A [`GloballyUniqueId`] as it travels (the creating worker's id and its counter).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Id {
    pub(crate) created_on: u32,
    pub(crate) local_id: u64,
}

impl From<GloballyUniqueId> for Id {
    fn from(g: GloballyUniqueId) -> Id {
        Id {
            created_on: g.created_on as u32,
            local_id: g.local_id,
        }
    }
}

impl From<Id> for GloballyUniqueId {
    fn from(i: Id) -> GloballyUniqueId {
        GloballyUniqueId {
            created_on: i.created_on as usize,
            local_id: i.local_id,
        }
    }
}

/// One fork of one RRef: the owner's rank, the RRef's id and the fork's id (the RRef id
/// itself for the owner's handles).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ForkRef {
    pub(crate) owner: u32,
    pub(crate) rref: Id,
    pub(crate) fork: Id,
}

impl ForkRef {
    pub(crate) fn new(owner: usize, rref: GloballyUniqueId, fork: GloballyUniqueId) -> ForkRef {
        ForkRef {
            owner: owner as u32,
            rref: rref.into(),
            fork: fork.into(),
        }
    }

    /// The RRef's id.
    pub(crate) fn rref_id(&self) -> GloballyUniqueId {
        self.rref.into()
    }

    /// The fork's id.
    pub(crate) fn fork_id(&self) -> GloballyUniqueId {
        self.fork.into()
    }
}

/// A registered function or method by name, with the argument and result types the caller
/// used (checked by the callee against the registered ones).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    pub(crate) func: String,
    pub(crate) sig: String,
}

/// An error travelling back to the caller: the worker where it happened, a kind (the error
/// variant's name, `UnknownFunction`, `Signature`, `Panic`, ...) and its message.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub(crate) struct RemoteErr {
    pub(crate) worker: String,
    pub(crate) kind: String,
    pub(crate) message: String,
}

/// How long an owner may wait for a value on the caller's behalf: the caller's timeout in
/// milliseconds (at least 1), 0 for none.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WaitLimit {
    pub(crate) millis: u64,
}

impl WaitLimit {
    pub(crate) fn new(t: Option<std::time::Duration>) -> WaitLimit {
        WaitLimit {
            millis: t.map_or(0, |t| {
                u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1)
            }),
        }
    }

    /// The limit, `None` for none.
    pub(crate) fn get(self) -> Option<std::time::Duration> {
        (self.millis > 0).then(|| std::time::Duration::from_millis(self.millis))
    }
}

/// What one message is.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub(crate) enum Message {
    /// Call a registered function; the response carries its result.
    Call(Target),
    /// Call a function and keep its result on the callee as the value of `rref.rref`, whose
    /// first user fork `rref.fork` is the sender's (`rpc.remote`).
    Remote { call: Target, rref: ForkRef },
    /// Run a registered method on the value of `rref` on its owner, waiting for the value (its
    /// creation may not have arrived yet) at most the caller's timeout.
    Method {
        call: Target,
        rref: ForkRef,
        timeout: WaitLimit,
    },
    /// Fetch the value of `rref` (`to_here`), waiting for it at most the caller's timeout.
    Fetch { rref: ForkRef, timeout: WaitLimit },
    /// User fork `rref.fork` was dropped: the owner forgets it. `requests`: how many value
    /// requests (fetches, methods) the fork sent; the deletion may overtake some of them
    /// (messages are not ordered), and the owner answers those at once instead of waiting for
    /// a value that is gone.
    UserDelete { rref: ForkRef, requests: u64 },
    /// A user that received an RRef from another user (`parent`) asks the owner to register
    /// its fork `rref.fork`; the response confirms it.
    ForkRequest { rref: ForkRef, parent: u32 },
    /// Child fork `child` was confirmed by its owner: its parent may let go of its own fork.
    ChildAccept { child: Id },
    /// The response to a request: `None` when it succeeded (the payload and tensors are its
    /// result), else the error.
    Response(Option<RemoteErr>),
}

impl Message {
    /// Whether the message runs code (or reads a value) on the receiver within the sender's
    /// distributed-autograd context, and so carries its header: calls, `remote`s, methods
    /// and fetches, never the RRef control messages.
    pub(crate) fn runs_in_context(&self) -> bool {
        matches!(
            self,
            Message::Call(_)
                | Message::Remote { .. }
                | Message::Method { .. }
                | Message::Fetch { .. }
        )
    }

    /// The message's name, for errors.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Message::Call(_) => "call",
            Message::Remote { .. } => "remote",
            Message::Method { .. } => "method",
            Message::Fetch { .. } => "fetch",
            Message::UserDelete { .. } => "user delete",
            Message::ForkRequest { .. } => "fork request",
            Message::ChildAccept { .. } => "child accept",
            Message::Response(_) => "response",
        }
    }
}

/// The distributed-autograd header of a message sent within a context: the context, the
/// sender's message id (the key of its send function) and the indices of the message's
/// tensors that require grad (they become outputs of a receive function on the receiver).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub(crate) struct AutogradHeader {
    pub(crate) context: u64,
    pub(crate) message: u64,
    pub(crate) requires_grad: Vec<u32>,
}

/// A message the protocol core asks the shell to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Outgoing {
    /// The receiving worker's rank.
    pub(crate) to: usize,
    pub(crate) message: Message,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_round_trips_through_rkyv() {
        let g = |c, l| GloballyUniqueId {
            created_on: c,
            local_id: l,
        };
        let r = ForkRef::new(2, g(1, 7), g(3, 9));
        assert_eq!((r.rref_id(), r.fork_id()), (g(1, 7), g(3, 9)));
        let t = Target {
            func: "f".into(),
            sig: "(f32) -> ()".into(),
        };
        let all = vec![
            Message::Call(t.clone()),
            Message::Remote {
                call: t.clone(),
                rref: r,
            },
            Message::Method {
                call: t,
                rref: r,
                timeout: WaitLimit::new(Some(std::time::Duration::from_micros(10))),
            },
            Message::Fetch {
                rref: r,
                timeout: WaitLimit::new(None),
            },
            Message::UserDelete {
                rref: r,
                requests: 3,
            },
            Message::ForkRequest { rref: r, parent: 4 },
            Message::ChildAccept {
                child: g(5, 6).into(),
            },
            Message::Response(None),
            Message::Response(Some(RemoteErr {
                worker: "w".into(),
                kind: "Panic".into(),
                message: "boom".into(),
            })),
        ];
        for m in all {
            let b = rkyv::to_bytes::<rkyv::rancor::Error>(&m).unwrap();
            let back = rkyv::from_bytes::<Message, rkyv::rancor::Error>(&b).unwrap();
            assert_eq!(back, m, "{}", m.name());
        }
    }
}
