//! `remote()`: calling a function whose result stays on the callee as an RRef's value.

use std::time::Duration;

use super::user::settle;
use super::{RRef, new_id};
use crate::agent::{Agent, CallCtx, agent, run_blocking, signature};
use crate::proto::message::{ForkRef, Message, Target};
use crate::wire::{Wire, encode_value};
use crate::{Error, Result, To};

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
            let released = a2.rrefs.table().release_if_unused(rref_id);
            drop(released);
            Ok(())
        });
        return Ok(rref);
    }
    let fork_id = new_id(a.me.id);
    let rref = RRef::<R>::user_handle(&a, to, rref_id, fork_id, false);
    a.rrefs.users().created(to, rref_id, fork_id);
    let call = Target {
        func: func.to_string(),
        sig: reg_sig,
    };
    let reply = a.send_request(
        to,
        Message::Remote {
            call,
            rref: ForkRef::new(to, rref_id, fork_id),
        },
        enc,
        t,
        "remote".into(),
    );
    let a2 = a.clone();
    a.spawn_call(async move {
        match reply.await {
            Ok(_) => settle(&a2, fork_id, true, None),
            // An error from the owner: it registered the fork (holding the error), which
            // this RRef deletes when dropped. After a timeout the owner may still register it:
            // the deletion is sent all the same (the owner drops a deletion that arrives
            // first together with the late registration, and refuses the fetches it
            // overtook). Only a lost worker has nothing to delete.
            Err(e) => {
                let registered = !matches!(e, Error::WorkerUnreachable { .. });
                settle(&a2, fork_id, registered, Some(e));
            }
        }
        Ok(())
    });
    Ok(rref)
}

pub(super) fn named(a: &Agent, e: Error) -> Error {
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
