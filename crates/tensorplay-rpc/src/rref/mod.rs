//! Remote references (`torch.distributed.rpc.RRef`) and their ownership protocol: the shell
//! around the protocol core's owner and user tables (`crate::proto::owner`,
//! `crate::proto::user`).
//!
//! A value created by [`remote`] lives on its **owner**; every other worker holding an
//! [`RRef`] to it is a **user** with its own fork id. The owner keeps the value while any fork
//! is registered or a local handle lives, following PyTorch's protocol:
//! - `remote()` (A → B): A allocates the RRef id and its fork id; B runs the function, stores
//!   the value and registers the fork, then acknowledges (A's RRef is then confirmed). When
//!   the function fails, B stores the error as the value (fetches see it) until A deletes.
//! - Passing an RRef in an argument or result: the sender allocates a child fork id. An owner
//!   sender registers the child at once ("early fork registration"); a user sender keeps its
//!   own fork until the child is accepted. A receiving user asks the owner to register its
//!   fork (`ForkRequest`) and then tells the parent (`ChildAccept`); a receiving owner
//!   resolves to its own value and tells a user parent at once. As in PyTorch, a function (or
//!   method) runs only once the RRefs among its arguments are confirmed by their owners.
//! - Dropping a user RRef sends `UserDelete` to the owner once its fork is confirmed and its
//!   children accepted; the owner drops the value when no fork and no local handle remains.
//!   The deletion carries how many fetches and methods the fork sent: the owner refuses at
//!   once those the deletion overtook instead of waiting for a value that is gone.
//! - Messages between two workers are not ordered (one QUIC stream each): an owner that is
//!   asked for a value before the creating call arrived waits for it (within the timeout).
//!
//! Files: `handle` (the [`RRef`] handle and its calls), `owner` (the values kept here),
//! `user` (sending what the user table decides, waking the handles' waiters), `fork` (RRefs
//! in messages), `remote` ([`remote`]), `serve` (the owner's side of the messages), `method`
//! ([`register_method`]).
//!
//! A graceful [`shutdown`](crate::shutdown) deletes the user RRefs still alive, waits until
//! every deletion was acknowledged, and then every owner table is empty ([`debug_info`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::Result;
use crate::agent::agent;
use crate::proto::owner::OwnerTable;
use crate::proto::user::UserTable;

mod fork;
mod handle;
mod method;
mod owner;
mod remote;
mod serve;
mod user;

pub(crate) use fork::{PendingFork, after_send, maybe_delivered};
pub use handle::RRef;
pub(crate) use handle::{Inner, wait_confirmed};
pub use method::register_method;
use owner::Slot;
pub(crate) use owner::Stored;
pub use remote::remote;
pub(crate) use serve::serve;
pub(crate) use user::child_accepted;

pub use crate::proto::owner::GloballyUniqueId;

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

fn new_id(me: usize) -> GloballyUniqueId {
    GloballyUniqueId {
        created_on: me,
        local_id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
    }
}

/// Per-agent RRef state.
pub(crate) struct RRefContext {
    /// The owned values and what keeps them alive (the protocol core).
    owners: Mutex<OwnerTable<Slot>>,
    /// The user forks held here (the protocol core).
    users: Mutex<UserTable>,
    /// The live user handles by fork id, to wake their waiters when the owner answers.
    handles: Mutex<HashMap<GloballyUniqueId, Weak<Inner>>>,
    /// Control messages (fork requests, acceptances, deletions) in flight.
    outstanding: Arc<AtomicUsize>,
}

/// Counts of the RRef tables (`_rref_context_get_debug_info`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RRefDebugInfo {
    /// Values this worker owns (with forks or local handles).
    pub num_owner_rrefs: usize,
    /// User forks registered on this worker's owned values.
    pub num_forks: usize,
    /// User RRefs on this worker not yet confirmed by their owner.
    pub num_pending_users: usize,
    /// Parents kept alive until their children are accepted.
    pub num_pending_children: usize,
}

/// The RRef tables of this worker.
///
/// # Errors
/// [`Error::NotInitialized`](crate::Error::NotInitialized).
pub fn debug_info() -> Result<RRefDebugInfo> {
    let a = agent("debug_info")?;
    Ok(a.rrefs.info())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl RRefContext {
    /// The RRef state of worker `me`.
    pub(crate) fn new(me: usize) -> RRefContext {
        RRefContext {
            owners: Mutex::new(OwnerTable::default()),
            users: Mutex::new(UserTable::new(me)),
            handles: Mutex::new(HashMap::new()),
            outstanding: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn info(&self) -> RRefDebugInfo {
        let (num_owner_rrefs, num_forks) = self.table().counts();
        let (num_pending_users, num_pending_children) = self.users().counts();
        RRefDebugInfo {
            num_owner_rrefs,
            num_forks,
            num_pending_users,
            num_pending_children,
        }
    }

    /// The owner table, locked.
    pub(crate) fn table(&self) -> MutexGuard<'_, OwnerTable<Slot>> {
        lock(&self.owners)
    }

    /// The user table, locked.
    fn users(&self) -> MutexGuard<'_, UserTable> {
        lock(&self.users)
    }
}
