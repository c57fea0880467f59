//! The user side in the shell: sends what the user table decides (fork requests, child
//! acceptances, deletions), wakes a handle's waiters when its owner answers, and deletes the
//! remaining forks at a graceful shutdown.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::{GloballyUniqueId, Inner, RRefContext, lock};
use crate::agent::Agent;
use crate::proto::message::{Message, Outgoing};
use crate::wire::Encoder;
use crate::{Error, Result};

/// How long one control message may take.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(60);
/// How long one try of a deletion may take (deletions are tried three times: the owner's
/// handling is idempotent).
const DELETE_TIMEOUT: Duration = Duration::from_secs(20);

/// Sends the messages a transition of the user table returned, each in the background.
pub(super) fn send_all(a: &Arc<Agent>, out: Vec<Outgoing>) {
    for o in out {
        send_control(a, o);
    }
}

/// Sends one control message in the background, counted until it is acknowledged; the
/// owner's answer to a fork request settles the fork.
fn send_control(a: &Arc<Agent>, o: Outgoing) {
    let a2 = a.clone();
    let outstanding = a.rrefs.outstanding.clone();
    outstanding.fetch_add(1, Ordering::SeqCst);
    a.handle.spawn(async move {
        let Outgoing { to, message } = o;
        match message {
            Message::ForkRequest { rref, .. } => {
                let fork = rref.fork_id();
                let r = a2
                    .send_request(
                        to,
                        message,
                        Encoder::default(),
                        Some(CONTROL_TIMEOUT),
                        "rref fork".into(),
                    )
                    .await;
                let error = r.err().map(|_| Error::Remote {
                    worker: a2.workers[to].name.clone(),
                    kind: "RRef".into(),
                    message: "the owner did not register this RRef's fork".into(),
                });
                settle(&a2, fork, error.is_none(), error);
            }
            Message::UserDelete { .. } => {
                for _ in 0..3 {
                    let r = a2
                        .send_request(
                            to,
                            message.clone(),
                            Encoder::default(),
                            Some(DELETE_TIMEOUT),
                            "rref delete".into(),
                        )
                        .await;
                    if !matches!(r, Err(Error::Timeout { .. })) {
                        break;
                    }
                }
            }
            other => {
                let _ = a2
                    .send_request(
                        to,
                        other,
                        Encoder::default(),
                        Some(CONTROL_TIMEOUT),
                        "rref control".into(),
                    )
                    .await;
            }
        }
        outstanding.fetch_sub(1, Ordering::SeqCst);
    });
}

/// The owner answered for user fork `fork`: wakes its handle's waiters (with `error`, the
/// creation's or the fork request's, if any) and sends what the user table decides: the
/// parent's acceptance, the deletion of a fork dropped meanwhile. `registered`: whether the
/// owner holds the fork (and so must be told when it is dropped).
pub(super) fn settle(
    a: &Arc<Agent>,
    fork: GloballyUniqueId,
    registered: bool,
    error: Option<Error>,
) {
    let h = lock(&a.rrefs.handles).get(&fork).and_then(Weak::upgrade);
    if let Some(h) = &h {
        if let Some(e) = error {
            *lock(&h.creation_error) = Some(e);
        }
        if !registered {
            h.deleted.store(true, Ordering::SeqCst);
        }
        h.confirmed.send_replace(true);
    }
    let out = a.rrefs.users().confirmed(fork, registered);
    send_all(a, out);
    drop(h);
}

/// Child fork `child` was accepted (or its message was not delivered): its parent is no
/// longer kept for it.
pub(crate) fn child_accepted(a: &Arc<Agent>, child: GloballyUniqueId) {
    let out = a.rrefs.users().child_accepted(child);
    send_all(a, out);
}

/// Every handle of user fork `fork` was dropped.
pub(super) fn dropped(a: &Arc<Agent>, fork: GloballyUniqueId) {
    lock(&a.rrefs.handles).remove(&fork);
    let out = a.rrefs.users().dropped(fork);
    send_all(a, out);
}

impl RRefContext {
    /// A handle of user fork `fork` sends a value request (a fetch, a method) to its owner
    /// (nothing for an owner's handle: not in the user table).
    pub(super) fn value_request(&self, fork: GloballyUniqueId) {
        self.users().value_request(fork);
    }

    /// Registers a live user handle, whose waiters are woken when its owner answers.
    pub(super) fn add_handle(&self, inner: &Arc<Inner>) {
        lock(&self.handles).insert(inner.fork_id, Arc::downgrade(inner));
    }

    /// Deletes the remaining user forks and waits until every deletion and fork message was
    /// acknowledged.
    pub(crate) fn flush(&self, agent: &Arc<Agent>, limit: Duration) -> Result<()> {
        // collected first: a handle dropped here must find the lock free
        let live: Vec<Arc<Inner>> = lock(&self.handles)
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for h in &live {
            h.deleted.store(true, Ordering::SeqCst);
        }
        drop(live);
        let out = self.users().drop_all();
        send_all(agent, out);
        let start = Instant::now();
        loop {
            let settled = self.users().is_empty();
            if self.outstanding.load(Ordering::SeqCst) == 0 && settled {
                return Ok(());
            }
            if start.elapsed() > limit {
                let (forks, children) = self.users().held();
                return Err(Error::Timeout {
                    op: format!(
                        "shutdown: RRef messages still unacknowledged ({forks} user forks not deleted yet, {children} pending children)"
                    ),
                    worker: agent.me.name.clone(),
                    timeout: limit,
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Forgets everything (after shutdown).
    pub(crate) fn clear(&self) {
        let released = self.table().clear();
        drop(released);
        self.users().clear();
        let live: Vec<Weak<Inner>> = lock(&self.handles).drain().map(|(_, h)| h).collect();
        for h in live.iter().filter_map(Weak::upgrade) {
            h.deleted.store(true, Ordering::SeqCst);
        }
    }
}
