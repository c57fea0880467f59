//! The [`RRef`] handle: its shared state (one per fork on this worker), the owner's local
//! value, fetching it (`to_here`) and calling methods on it.

use std::marker::PhantomData;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::watch;

use super::method::method_signature;
use super::{GloballyUniqueId, Stored, new_id};
use crate::agent::{Agent, agent};
use crate::proto::message::{ForkRef, Message, Target, WaitLimit};
use crate::wire::{Encoder, Wire, decode_value, encode_value};
use crate::{Error, Result, RpcFuture, WorkerInfo};

/// The shared state of an RRef handle.
pub(crate) struct Inner {
    pub(super) owner: WorkerInfo,
    pub(super) rref_id: GloballyUniqueId,
    /// The fork id (a user's own; the RRef id for the owner's handles).
    pub(super) fork_id: GloballyUniqueId,
    pub(super) is_owner: bool,
    /// Confirmed by the owner (always true for owner handles).
    pub(super) confirmed: watch::Sender<bool>,
    /// Set when the creating call failed (to_here then returns it).
    pub(super) creation_error: Mutex<Option<Error>>,
    /// The handle may no longer be sent: its fork is deleted (at shutdown) or was never
    /// registered by the owner.
    pub(super) deleted: AtomicBool,
    /// The agent this handle belongs to.
    pub(super) agent: Weak<Agent>,
    pub(super) type_name: &'static str,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let Some(agent) = self.agent.upgrade() else {
            return;
        };
        if self.is_owner {
            // the value goes after the table is unlocked: it may hold RRefs owned here, whose
            // drop locks the table again
            let released = agent.rrefs.table().drop_local(self.rref_id);
            drop(released);
        } else {
            super::user::dropped(&agent, self.fork_id);
        }
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

/// A reference to a value that lives on its owner (`torch.distributed.rpc.RRef`).
///
/// Cloning the handle shares it (one fork). `to_here` fetches a copy of the value, `rpc_sync`
/// and `rpc_async` run a registered method on it on the owner, and the RRef can be passed in
/// the arguments and results of RPCs to any worker.
pub struct RRef<T> {
    pub(super) inner: Arc<Inner>,
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
    pub(super) fn owner_handle(a: &Arc<Agent>, id: GloballyUniqueId) -> RRef<T> {
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

    pub(super) fn user_handle(
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
        a.rrefs.add_handle(&inner);
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

    /// This handle's fork as messages name it.
    fn fork_ref(&self) -> ForkRef {
        ForkRef::new(self.inner.owner.id, self.inner.rref_id, self.inner.fork_id)
    }

    pub(super) fn agent(&self, op: &str) -> Result<Arc<Agent>> {
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

    pub(super) fn check_created(&self) -> Result<()> {
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
    /// Returns the core's (the facade's) `Result`, `tp::Result<T>`, as RemoteModule's methods
    /// do, so that it composes with the rest of a program inside closures as well as with `?`:
    /// `rrefs.iter().map(|r| r.to_here(None)).collect::<tp::Result<Vec<_>>>()`,
    /// `x.and_then(|_| r.to_here(None))`. The RPC error is carried whole in
    /// [`tp::Error::External`](tensorplay_core::Error::External): `downcast_ref` gets it back,
    /// and `?` into this crate's [`Result`] unwraps it to itself.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use tensorplay_rpc::{self as rpc, RRef};
    /// # fn f(r: RRef<f32>) {
    /// match r.to_here(Some(Duration::from_secs(5))) {
    ///     Ok(v) => println!("{v}"),
    ///     Err(e) => match e.downcast_ref::<rpc::Error>() {
    ///         Some(rpc::Error::Timeout { worker, .. }) => println!("{worker} is slow"),
    ///         Some(rpc::Error::WorkerUnreachable { worker, .. }) => println!("{worker} is gone"),
    ///         _ => println!("failed: {e}"),
    ///     },
    /// }
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`tp::Error::External`](tensorplay_core::Error::External) holding this crate's
    /// [`Error`]: the creating call's error ([`Error::Remote`]); [`Error::Timeout`];
    /// [`Error::WorkerUnreachable`]; [`Error::NotInitialized`]. [`RRef::to_here_async`] returns
    /// the same errors unwrapped.
    pub fn to_here(&self, timeout: Option<Duration>) -> tensorplay_core::Result<T> {
        self.to_here_async(timeout)
            .and_then(|f| f.wait())
            .map_err(tensorplay_core::Error::from)
    }

    /// [`RRef::to_here`] as a future; its errors are this crate's [`Error`].
    ///
    /// # Errors
    /// The creating call's error ([`Error::Remote`]); [`Error::Timeout`];
    /// [`Error::WorkerUnreachable`]; [`Error::NotInitialized`] (from the future's `wait`, or at
    /// once when RPC is not initialised or the creation already failed).
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
        // counted in the fork's deletion, which may overtake it on the way to the owner
        a.rrefs.value_request(self.inner.fork_id);
        let fetch = a.send_request(
            owner,
            Message::Fetch {
                rref: self.fork_ref(),
                timeout: WaitLimit::new(t),
            },
            Encoder::default(),
            t,
            "to_here".into(),
        );
        let keep = self.clone();
        let mut confirmed = self.inner.confirmed.subscribe();
        let a2 = a.clone();
        Ok(a.spawn_call(async move {
            let mut fetch = Box::pin(fetch);
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
            let (payload, tensors) = tokio::select! {
                r = &mut fetch => r?,
                () = failed => {
                    // the fetch is sent all the same (the owner expects it: the fork's
                    // deletion counts it) and its answer ignored
                    a2.handle.spawn(fetch);
                    return Err(keep.check_created().err().unwrap_or_else(|| {
                        Error::Transport("the RRef's creation failed".into())
                    }));
                }
            };
            let v = decode_value::<T>(&payload, tensors, owner, "RRef value");
            // a creation that failed (timed out) while the fetch was waiting for the value
            keep.check_created()?;
            drop(keep);
            v
        }))
    }

    /// Runs the registered method `method` (see [`register_method`](crate::register_method)) on the value on its owner
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
        let t = timeout
            .or_else(|| crate::get_rpc_timeout().ok())
            .filter(|t| !t.is_zero());
        let what = format!("result of method {method}");
        // counted in the fork's deletion, which may overtake it on the way to the owner
        a.rrefs.value_request(self.inner.fork_id);
        let call = Target {
            func: method.to_string(),
            sig: method_signature::<T, A, R>(),
        };
        let reply = a.send_request(
            owner,
            Message::Method {
                call,
                rref: self.fork_ref(),
                timeout: WaitLimit::new(t),
            },
            enc,
            t,
            what.clone(),
        );
        let keep = self.clone();
        Ok(a.spawn_call(async move {
            let (payload, tensors) = reply.await?;
            drop(keep);
            decode_value::<R>(&payload, tensors, owner, &what)
        }))
    }
}

pub(super) fn block_on<T: Send + 'static>(
    a: &Arc<Agent>,
    fut: impl Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    a.spawn_call(fut).wait()
}
