//! Remote references (`torch.distributed.rpc.RRef`) and their ownership protocol.
//!
//! A value created by [`remote`] lives on its **owner**; every other worker holding an
//! [`RRef`] to it is a **user** with its own fork id. The owner keeps the value while any fork
//! is registered or a local handle lives, following PyTorch's protocol:
//! - `remote()` (A → B): A allocates the RRef id and its fork id; B runs the function, stores
//!   the value and registers the fork, then acknowledges (A's RRef is then confirmed). When
//!   the function fails, B stores the error as the value (fetches see it) until A deletes.
//! - Passing an RRef in an argument or result: the sender allocates a child fork id. An owner
//!   sender registers the child at once ("early fork registration"); a user sender keeps its
//!   own RRef alive until the child says it was accepted. A receiving user asks the owner to
//!   register its fork (`FORK_REQUEST`) and then tells the parent (`CHILD_ACCEPT`); a
//!   receiving owner resolves to its own value and tells a user parent at once. As in
//!   PyTorch, a function (or method) runs only once the RRefs among its arguments are
//!   confirmed by their owners.
//! - Dropping a user RRef sends `USER_DELETE` to the owner once its fork is confirmed; the
//!   owner drops the value when no fork and no local handle remains.
//! - Messages between two workers are not ordered (one QUIC stream each): an owner that is
//!   asked for a value before the creating call arrived waits for it (within the timeout).
//!
//! A graceful [`shutdown`](crate::shutdown) deletes the user RRefs still alive, waits until
//! every deletion was acknowledged, and then every owner table is empty ([`debug_info`]).

use std::any::Any;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::agent::{Agent, CallCtx, agent, run_blocking, signature};
use crate::frame::{Envelope, kind};
use crate::wire::{Encoder, Wire, decode_value, encode_value};
use crate::{Error, Result, RpcFuture, To, WorkerInfo};

mod fork;
mod method;
mod serve;

pub(crate) use fork::{PendingFork, after_send};
use method::method_signature;
pub use method::register_method;
pub(crate) use serve::{child_accepted, dispatch};

pub use crate::proto::owner::GloballyUniqueId;
use crate::proto::owner::OwnerTable;

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

fn new_id(me: usize) -> GloballyUniqueId {
    GloballyUniqueId {
        created_on: me,
        local_id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
    }
}

/// A value stored on its owner: type-erased, with the function that encodes it for a fetch.
#[derive(Clone)]
pub(crate) struct Stored {
    value: Arc<dyn Any + Send + Sync>,
    encode: EncodeFn,
}

/// Encodes a stored value for a worker.
type EncodeFn = Arc<dyn Fn(&(dyn Any + Send + Sync), usize) -> Result<Encoder> + Send + Sync>;

impl Stored {
    pub(crate) fn new<T: Wire + Clone + Sync>(v: T) -> Stored {
        Stored {
            value: Arc::new(v),
            encode: Arc::new(|v: &(dyn Any + Send + Sync), dest| {
                let v = v
                    .downcast_ref::<T>()
                    .ok_or_else(|| Error::Serialization("RRef value of another type".into()))?;
                encode_value(v, dest)
            }),
        }
    }
}

/// The shell's slot for one owned value: the value, or the creation's error, once known;
/// fetches wait on it.
type Slot = watch::Sender<Option<std::result::Result<Stored, Error>>>;

/// Per-agent RRef state.
#[derive(Default)]
pub(crate) struct RRefContext {
    /// The owned values and what keeps them alive (the protocol core).
    owners: Mutex<OwnerTable<Slot>>,
    /// Parents kept alive until their child fork is accepted.
    pending_children: Mutex<HashMap<GloballyUniqueId, Arc<Inner>>>,
    /// Live user RRefs (deleted at graceful shutdown).
    users: Mutex<Vec<Weak<Inner>>>,
    /// Deletions and requests in flight.
    outstanding: Arc<std::sync::atomic::AtomicUsize>,
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
/// [`Error::NotInitialized`].
pub fn debug_info() -> Result<RRefDebugInfo> {
    let a = agent("debug_info")?;
    Ok(a.rrefs.info())
}

impl RRefContext {
    fn info(&self) -> RRefDebugInfo {
        let (num_owner_rrefs, num_forks) = self.table().counts();
        let users = self.users.lock().unwrap_or_else(|e| e.into_inner());
        RRefDebugInfo {
            num_owner_rrefs,
            num_forks,
            num_pending_users: users
                .iter()
                .filter_map(Weak::upgrade)
                .filter(|u| !*u.confirmed.borrow())
                .count(),
            num_pending_children: self
                .pending_children
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .len(),
        }
    }

    /// The owner table, locked.
    pub(crate) fn table(&self) -> std::sync::MutexGuard<'_, OwnerTable<Slot>> {
        self.owners.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_value(&self, id: GloballyUniqueId, v: std::result::Result<Stored, Error>) {
        self.table().slot(id).send_replace(Some(v));
    }

    /// Waits for the value of `id` (its creation may not have arrived yet).
    async fn value(&self, id: GloballyUniqueId, timeout: Option<Duration>) -> Result<Stored> {
        let mut rx = self.table().slot(id).subscribe();
        let wait = async {
            loop {
                if let Some(v) = rx.borrow_and_update().clone() {
                    return v;
                }
                if rx.changed().await.is_err() {
                    return Err(Error::Remote {
                        worker: String::new(),
                        kind: "RRef".into(),
                        message: format!("RRef {id} was deleted"),
                    });
                }
            }
        };
        let r = match timeout {
            Some(t) => tokio::time::timeout(t, wait).await.unwrap_or_else(|_| {
                Err(Error::Timeout {
                    op: format!("waiting for the value of RRef {id} on its owner"),
                    worker: String::new(),
                    timeout: t,
                })
            }),
            None => wait.await,
        };
        // an entry made by this wait alone (an RRef deleted or never created) is not kept
        self.table().release_if_unused(id);
        r
    }

    /// Deletes the remaining user RRefs and waits until every deletion and fork message was
    /// acknowledged.
    pub(crate) fn flush(&self, agent: &Arc<Agent>, limit: Duration) -> Result<()> {
        let users: Vec<Arc<Inner>> = self
            .users
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for u in users {
            u.delete_now(agent);
        }
        let start = Instant::now();
        loop {
            let children = self
                .pending_children
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .len();
            if self.outstanding.load(Ordering::SeqCst) == 0 && children == 0 {
                return Ok(());
            }
            if start.elapsed() > limit {
                return Err(Error::Timeout {
                    op: format!(
                        "shutdown: RRef messages still unacknowledged ({children} pending children)"
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
        self.table().clear();
        self.pending_children
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        for u in self
            .users
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            if let Some(u) = u.upgrade() {
                u.deleted.store(true, Ordering::SeqCst);
            }
        }
    }
}

/// The shared state of an RRef handle.
pub(crate) struct Inner {
    owner: WorkerInfo,
    rref_id: GloballyUniqueId,
    /// The fork id (a user's own; the RRef id for the owner's handles).
    fork_id: GloballyUniqueId,
    is_owner: bool,
    /// Confirmed by the owner (always true for owner handles).
    confirmed: watch::Sender<bool>,
    /// Set when the creating call failed (to_here then returns it).
    creation_error: Mutex<Option<Error>>,
    /// The deletion was sent (or the agent is gone).
    deleted: AtomicBool,
    /// The agent this handle belongs to.
    agent: Weak<Agent>,
    type_name: &'static str,
}

impl Inner {
    /// Sends the user's deletion to the owner once confirmed (at most once).
    fn delete_now(&self, agent: &Arc<Agent>) {
        if self.is_owner || self.deleted.swap(true, Ordering::SeqCst) {
            return;
        }
        let mut confirmed = self.confirmed.subscribe();
        let (owner, rref_id, fork_id) = (self.owner.id, self.rref_id, self.fork_id);
        let a = agent.clone();
        let outstanding = agent.rrefs.outstanding.clone();
        outstanding.fetch_add(1, Ordering::SeqCst);
        agent.handle.spawn(async move {
            // a fork the owner has not registered yet must not be deleted before it is
            let _ = tokio::time::timeout(Duration::from_secs(60), async {
                while !*confirmed.borrow_and_update() {
                    if confirmed.changed().await.is_err() {
                        break;
                    }
                }
            })
            .await;
            let env = Envelope {
                kind: kind::USER_DELETE,
                ids: ids(owner, rref_id, fork_id, 0),
                ..Envelope::default()
            };
            // control messages are retried: the owner's handling is idempotent
            for _ in 0..3 {
                let r = a
                    .clone()
                    .request(
                        owner,
                        env.clone(),
                        vec![],
                        Some(Duration::from_secs(20)),
                        "rref delete".into(),
                    )
                    .await;
                if !matches!(r, Err(Error::Timeout { .. })) {
                    break;
                }
            }
            outstanding.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let Some(agent) = self.agent.upgrade() else {
            return;
        };
        if self.is_owner {
            agent.rrefs.table().drop_local(self.rref_id);
            return;
        }
        self.delete_now(&agent);
    }
}

/// Blocks (on a blocking thread of the runtime) until each of `users` is confirmed by its
/// owner, within the default timeout; the error of a fork the owner did not register.
pub(crate) fn wait_confirmed(users: &[Arc<Inner>]) -> Result<()> {
    if users.is_empty() {
        return Ok(());
    }
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return Ok(());
    };
    let limit = crate::get_rpc_timeout()
        .ok()
        .filter(|t| !t.is_zero())
        .unwrap_or(Duration::from_secs(3600));
    for u in users {
        let mut rx = u.confirmed.subscribe();
        let confirmed = handle
            .block_on(async { tokio::time::timeout(limit, rx.wait_for(|c| *c)).await })
            .is_ok_and(|r| r.is_ok());
        if !confirmed {
            return Err(Error::Timeout {
                op: "waiting for the owner to confirm an RRef argument".into(),
                worker: u.owner.name.clone(),
                timeout: limit,
            });
        }
        if let Some(e) = &*u.creation_error.lock().unwrap_or_else(|e| e.into_inner()) {
            return Err(e.clone());
        }
    }
    Ok(())
}

fn ids(owner: usize, rref: GloballyUniqueId, fork: GloballyUniqueId, parent: usize) -> Vec<u64> {
    vec![
        owner as u64,
        rref.created_on as u64,
        rref.local_id,
        fork.created_on as u64,
        fork.local_id,
        parent as u64,
    ]
}

fn parse_ids(v: &[u64]) -> Result<(usize, GloballyUniqueId, GloballyUniqueId, usize)> {
    if v.len() != 6 {
        return Err(Error::Serialization(format!(
            "RRef message with {} ids",
            v.len()
        )));
    }
    let gid = |c: u64, l: u64| GloballyUniqueId {
        created_on: c as usize,
        local_id: l,
    };
    Ok((
        v[0] as usize,
        gid(v[1], v[2]),
        gid(v[3], v[4]),
        v[5] as usize,
    ))
}

/// A reference to a value that lives on its owner (`torch.distributed.rpc.RRef`).
///
/// Cloning the handle shares it (one fork). `to_here` fetches a copy of the value, `rpc_sync`
/// and `rpc_async` run a registered method on it on the owner, and the RRef can be passed in
/// the arguments and results of RPCs to any worker.
pub struct RRef<T> {
    inner: Arc<Inner>,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for RRef<T> {
    fn clone(&self) -> Self {
        RRef {
            inner: self.inner.clone(),
            _t: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for RRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.inner.is_owner {
            write!(f, "OwnerRRef({})", self.inner.rref_id)
        } else {
            write!(
                f,
                "UserRRef(RRefId = {}, ForkId = {})",
                self.inner.rref_id, self.inner.fork_id
            )
        }
    }
}

impl<T: Wire + Clone + Sync> RRef<T> {
    /// An RRef owned by this worker holding `value` (`RRef(value)`).
    ///
    /// # Errors
    /// [`Error::NotInitialized`].
    pub fn new(value: T) -> Result<RRef<T>> {
        let a = agent("RRef::new")?;
        let id = new_id(a.me.id);
        a.rrefs.set_value(id, Ok(Stored::new(value)));
        Ok(RRef::owner_handle(&a, id))
    }
}

impl<T> RRef<T> {
    fn owner_handle(a: &Arc<Agent>, id: GloballyUniqueId) -> RRef<T> {
        a.rrefs.table().add_local(id);
        RRef {
            inner: Arc::new(Inner {
                owner: a.me.clone(),
                rref_id: id,
                fork_id: id,
                is_owner: true,
                confirmed: watch::channel(true).0,
                creation_error: Mutex::new(None),
                deleted: AtomicBool::new(false),
                agent: Arc::downgrade(a),
                type_name: std::any::type_name::<T>(),
            }),
            _t: PhantomData,
        }
    }

    fn user_handle(
        a: &Arc<Agent>,
        owner: usize,
        rref_id: GloballyUniqueId,
        fork_id: GloballyUniqueId,
        confirmed: bool,
    ) -> RRef<T> {
        let inner = Arc::new(Inner {
            owner: a.workers[owner].clone(),
            rref_id,
            fork_id,
            is_owner: false,
            confirmed: watch::channel(confirmed).0,
            creation_error: Mutex::new(None),
            deleted: AtomicBool::new(false),
            agent: Arc::downgrade(a),
            type_name: std::any::type_name::<T>(),
        });
        a.rrefs
            .users
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::downgrade(&inner));
        RRef {
            inner,
            _t: PhantomData,
        }
    }

    /// Whether this worker owns the value.
    pub fn is_owner(&self) -> bool {
        self.inner.is_owner
    }

    /// The owner.
    pub fn owner(&self) -> WorkerInfo {
        self.inner.owner.clone()
    }

    /// The owner's name.
    pub fn owner_name(&self) -> String {
        self.inner.owner.name.clone()
    }

    /// Whether the owner has acknowledged this reference (always true on the owner).
    pub fn confirmed_by_owner(&self) -> bool {
        *self.inner.confirmed.borrow()
    }

    /// The RRef's id.
    pub fn rref_id(&self) -> GloballyUniqueId {
        self.inner.rref_id
    }

    /// This handle's fork id (the RRef id on the owner).
    pub fn fork_id(&self) -> GloballyUniqueId {
        self.inner.fork_id
    }

    fn agent(&self, op: &str) -> Result<Arc<Agent>> {
        let a = agent(op)?;
        match self.inner.agent.upgrade() {
            Some(b) if Arc::ptr_eq(&a, &b) => Ok(a),
            _ => Err(Error::invalid(
                op,
                "rref",
                "an RRef of the current RPC session",
                format!("{self:?}, created before the last shutdown (it has been deleted)"),
            )),
        }
    }

    fn check_created(&self) -> Result<()> {
        match &*self
            .inner
            .creation_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
        {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

impl<T: Wire + Clone + Sync> RRef<T> {
    /// The value, on the owner only (`local_value`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on a user, naming this worker and the owner; the creation's
    /// error; [`Error::Timeout`] after the default timeout when the value never arrives.
    pub fn local_value(&self) -> Result<T> {
        let a = self.agent("local_value")?;
        if !self.inner.is_owner {
            return Err(Error::invalid(
                "local_value",
                "rref",
                format!(
                    "to be called on the owner {} (call to_here() on users)",
                    self.inner.owner
                ),
                format!("{self:?} on user {}", a.me),
            ));
        }
        let id = self.inner.rref_id;
        let a2 = a.clone();
        let timeout = crate::get_rpc_timeout().ok().filter(|t| !t.is_zero());
        let s = block_on(&a, async move { Ok(a2.rrefs.value(id, timeout).await) })?;
        self.owned_value(&a, s, "local_value")
    }

    /// The value of this owner RRef from its stored entry; a timeout names this worker.
    fn owned_value(&self, a: &Agent, s: Result<Stored>, op: &str) -> Result<T> {
        let s = s.map_err(|e| match e {
            Error::Timeout {
                timeout, worker, ..
            } if worker.is_empty() => Error::Timeout {
                op: format!("{op} of {self:?}: its value is not computed yet"),
                worker: a.me.name.clone(),
                timeout,
            },
            other => other,
        })?;
        s.value.downcast_ref::<T>().cloned().ok_or_else(|| {
            Error::Serialization(format!("the RRef does not hold a {}", self.inner.type_name))
        })
    }

    /// A copy of the value, fetched from the owner (`to_here`); on the owner, the value itself.
    /// `timeout`: `None` for the default, `Some(ZERO)` for none.
    ///
    /// # Errors
    /// The creating call's error ([`Error::Remote`]); [`Error::Timeout`];
    /// [`Error::WorkerUnreachable`]; [`Error::NotInitialized`].
    pub fn to_here(&self, timeout: Option<Duration>) -> Result<T> {
        self.to_here_async(timeout)?.wait()
    }

    /// [`RRef::to_here`] as a future.
    ///
    /// # Errors
    /// As [`RRef::to_here`].
    pub fn to_here_async(&self, timeout: Option<Duration>) -> Result<RpcFuture<T>> {
        let a = self.agent("to_here")?;
        self.check_created()?;
        let t = timeout
            .or_else(|| crate::get_rpc_timeout().ok())
            .filter(|t| !t.is_zero());
        if self.inner.is_owner {
            // the value may still be being computed here: wait for it off the caller's thread
            let (a2, keep) = (a.clone(), self.clone());
            return Ok(a.spawn_call(async move {
                let s = a2.rrefs.value(keep.inner.rref_id, t).await;
                keep.owned_value(&a2, s, "to_here")
            }));
        }
        let owner = self.inner.owner.id;
        let env = Envelope {
            kind: kind::FETCH,
            ids: ids(owner, self.inner.rref_id, self.inner.fork_id, 0),
            autograd: crate::autograd::request_header(&[], a.me.id, owner),
            ..Envelope::default()
        };
        let a2 = a.clone();
        let keep = self.clone();
        let mut confirmed = self.inner.confirmed.subscribe();
        Ok(a.spawn_call(async move {
            let fetch = a2.clone().request(owner, env, vec![], t, "to_here".into());
            // a creation that fails (its own timeout) ends the wait for the value at once
            let failed = async {
                loop {
                    if *confirmed.borrow_and_update() && keep.check_created().is_err() {
                        return;
                    }
                    if confirmed.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
            };
            let (resp, tensors) = tokio::select! {
                r = fetch => r?,
                () = failed => {
                    return Err(keep.check_created().err().unwrap_or_else(|| {
                        Error::Transport("the RRef's creation failed".into())
                    }));
                }
            };
            let (_, tensors) = crate::autograd::incoming(&resp.autograd, owner, tensors, false)?;
            let v = decode_value::<T>(&resp.payload, tensors, owner, "RRef value");
            // a creation that failed (timed out) while the fetch was waiting for the value
            keep.check_created()?;
            drop(keep);
            v
        }))
    }

    /// Runs the registered method `method` (see [`register_method`]) on the value on its owner
    /// and returns the result (the proxy `rref.rpc_sync().method(args)`).
    ///
    /// # Errors
    /// As [`rpc_sync`](crate::rpc_sync).
    pub fn rpc_sync<A: Wire, R: Wire>(
        &self,
        method: &str,
        args: A,
        timeout: Option<Duration>,
    ) -> Result<R> {
        self.rpc_async(method, args, timeout)?.wait()
    }

    /// [`RRef::rpc_sync`] returning a future (the proxy `rref.rpc_async()`).
    ///
    /// # Errors
    /// As [`rpc_async`](crate::rpc_async).
    pub fn rpc_async<A: Wire, R: Wire>(
        &self,
        method: &str,
        args: A,
        timeout: Option<Duration>,
    ) -> Result<RpcFuture<R>> {
        let a = self.agent("rref.rpc_async")?;
        self.check_created()?;
        let owner = self.inner.owner.id;
        let enc = encode_value(&args, owner)?;
        let env = Envelope {
            kind: kind::METHOD,
            func: method.to_string(),
            sig: method_signature::<T, A, R>(),
            ids: ids(owner, self.inner.rref_id, self.inner.fork_id, 0),
            autograd: crate::autograd::request_header(&enc.tensors, a.me.id, owner),
            payload: enc.bytes,
            ..Envelope::default()
        };
        let t = timeout
            .or_else(|| crate::get_rpc_timeout().ok())
            .filter(|t| !t.is_zero());
        let a2 = a.clone();
        let keep = self.clone();
        let forks = enc.forks;
        let what = format!("result of method {method}");
        Ok(a.spawn_call(async move {
            let r = a2
                .clone()
                .request(owner, env, enc.tensors, t, what.clone())
                .await;
            after_send(&a2, forks, r.is_ok());
            let (resp, tensors) = r?;
            drop(keep);
            let (_, tensors) = crate::autograd::incoming(&resp.autograd, owner, tensors, false)?;
            decode_value::<R>(&resp.payload, tensors, owner, &what)
        }))
    }
}

fn block_on<T: Send + 'static>(
    a: &Arc<Agent>,
    fut: impl Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    a.spawn_call(fut).wait()
}

/// Calls the registered function `func` on worker `to` and keeps its result there: returns
/// at once with an [`RRef`] to it, owned by `to` (`rpc.remote`). Errors of the function show
/// when the value is used (`to_here`, methods). `to` may be this worker (the RRef is then an
/// owner RRef).
///
/// # Errors
/// [`Error::UnknownWorker`], [`Error::NotInitialized`], arguments that cannot be encoded.
pub fn remote<A: Wire, R: Wire + Clone + Sync>(
    to: impl Into<To>,
    func: &str,
    args: A,
    timeout: Option<Duration>,
) -> Result<RRef<R>> {
    let a = agent("remote")?;
    let to = a.resolve(&to.into())?;
    let reg_sig = signature::<A, R>();
    let rref_id = new_id(a.me.id);
    let t = timeout
        .or_else(|| crate::get_rpc_timeout().ok())
        .filter(|t| !t.is_zero());
    // arguments that cannot travel fail before any handle exists (a user handle would wait
    // for a confirmation that never comes)
    let enc = encode_value(&args, to)?;
    if to == a.me.id {
        // the owner is this worker: run the function here, off the caller's thread
        let rref = RRef::<R>::owner_handle(&a, rref_id);
        let reg = crate::agent::lookup(func, &reg_sig);
        let a2 = a.clone();
        let me = a.me.id;
        a.spawn_call(async move {
            let r = match reg {
                Ok(reg) => {
                    let payload = enc.bytes;
                    let tensors = enc.tensors;
                    run_blocking(move || (reg.remote)(&CallCtx { caller: me }, &payload, tensors))
                        .await
                }
                Err(e) => Err(e),
            };
            a2.rrefs.set_value(rref_id, r.map_err(|e| named(&a2, e)));
            // every handle may have been dropped meanwhile
            a2.rrefs.table().release_if_unused(rref_id);
            Ok(())
        });
        return Ok(rref);
    }
    let fork_id = new_id(a.me.id);
    let rref = RRef::<R>::user_handle(&a, to, rref_id, fork_id, false);
    let env = Envelope {
        kind: kind::REMOTE,
        func: func.to_string(),
        sig: reg_sig,
        ids: ids(to, rref_id, fork_id, a.me.id),
        autograd: crate::autograd::request_header(&enc.tensors, a.me.id, to),
        payload: enc.bytes,
        ..Envelope::default()
    };
    let a2 = a.clone();
    let inner = rref.inner.clone();
    let forks = enc.forks;
    a.spawn_call(async move {
        let r = a2
            .clone()
            .request(to, env, enc.tensors, t, "remote".into())
            .await;
        after_send(&a2, forks, r.is_ok());
        match r {
            Ok(_) => {
                inner.confirmed.send_replace(true);
            }
            Err(e) => {
                // an error from the owner: it registered the fork (holding the error), which
                // this RRef deletes when dropped. After a timeout the owner may still register
                // it: the deletion is sent all the same (the owner drops a deletion that
                // arrives first together with the late registration). Only a lost worker has
                // nothing to delete.
                if matches!(e, Error::WorkerUnreachable { .. }) {
                    inner.deleted.store(true, Ordering::SeqCst);
                }
                *inner
                    .creation_error
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(e);
                inner.confirmed.send_replace(true);
            }
        }
        Ok(())
    });
    Ok(rref)
}

fn named(a: &Agent, e: Error) -> Error {
    match e {
        Error::Remote {
            worker,
            kind,
            message,
        } if worker.is_empty() => Error::Remote {
            worker: a.me.name.clone(),
            kind,
            message,
        },
        Error::Remote { .. } => e,
        other => Error::Remote {
            worker: a.me.name.clone(),
            kind: other.kind(),
            message: other.to_string(),
        },
    }
}
