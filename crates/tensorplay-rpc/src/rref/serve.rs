//! Serving the RRef messages on the owner: creations, fetches, deletions, fork requests,
//! methods. The request's distributed-autograd context was opened by the server pipeline
//! (`crate::agent`), which also attaches the response's header.

use std::sync::Arc;
use std::time::Duration;

use tensorplay_core::Tensor;

use super::method::METHODS;
use super::remote::named;
use super::{GloballyUniqueId, Stored};
use crate::agent::{Agent, CallCtx, run_blocking};
use crate::autograd::{ContextId, with_context};
use crate::proto::message::{ForkRef, Message, Target};
use crate::wire::Encoder;
use crate::{Error, Result};

/// Serves one RRef request on this worker, the owner, within the request's context `ctx`.
pub(crate) async fn serve(
    a: &Arc<Agent>,
    peer: usize,
    message: Message,
    payload: Vec<u8>,
    tensors: Vec<Tensor>,
    ctx: Option<ContextId>,
) -> Result<Encoder> {
    let check = |r: &ForkRef| {
        if r.owner as usize == a.me.id {
            Ok((r.rref_id(), r.fork_id()))
        } else {
            Err(Error::Serialization(format!(
                "RRef message for owner {} delivered to worker {}",
                r.owner, a.me.id
            )))
        }
    };
    match message {
        Message::Remote { call, rref } => {
            let (rref_id, fork_id) = check(&rref)?;
            // The fork is registered whatever happens: a failed creation keeps its error as
            // the value, for the fetches that may already be on their way (messages are not
            // ordered), until the creator deletes its RRef like any other.
            a.rrefs.table().add_fork(rref_id, fork_id);
            let r = match crate::agent::lookup(&call.func, &call.sig) {
                Ok(reg) => {
                    run_blocking(move || {
                        with_context(ctx, || {
                            (reg.remote)(&CallCtx { caller: peer }, &payload, tensors)
                        })
                    })
                    .await
                }
                Err(e) => Err(e),
            };
            let r = r.map_err(|e| named(a, e));
            a.rrefs.set_value(rref_id, r.clone());
            // the creator may have deleted it meanwhile (a timed-out `remote`)
            let released = a.rrefs.table().release_if_unused(rref_id);
            drop(released);
            r.map(|_| Encoder::default())
        }
        Message::Fetch { rref, timeout } => {
            let (rref_id, fork_id) = check(&rref)?;
            requested(a, rref_id, fork_id)?;
            let v = value(a, rref_id, timeout.get()).await?;
            (v.encode)(&*v.value, peer)
        }
        Message::UserDelete { rref, requests } => {
            let (rref_id, fork_id) = check(&rref)?;
            let released = a.rrefs.table().remove_fork(rref_id, fork_id, requests);
            drop(released);
            Ok(Encoder::default())
        }
        Message::ForkRequest { rref, .. } => {
            let (rref_id, fork_id) = check(&rref)?;
            if !a.rrefs.table().request_fork(rref_id, fork_id, a.me.id) {
                return Err(Error::Remote {
                    worker: a.me.name.clone(),
                    kind: "RRef".into(),
                    message: format!(
                        "a fork of RRef {rref_id} was requested, but this worker does not own it (it was deleted, or never existed)"
                    ),
                });
            }
            Ok(Encoder::default())
        }
        Message::Method {
            call,
            rref,
            timeout,
        } => {
            let (rref_id, fork_id) = check(&rref)?;
            // counted before anything can fail: the fork's deletion counts it
            requested(a, rref_id, fork_id)?;
            let h = method(a, &call)?;
            let v = value(a, rref_id, timeout.get()).await?;
            run_blocking(move || with_context(ctx, || h(&*v.value, &payload, tensors, peer))).await
        }
        other => Err(Error::Serialization(format!(
            "a {} message is not an RRef request",
            other.name()
        ))),
    }
}

/// Counts a value request (a fetch, a method) of user fork `fork` of `id`, and refuses one
/// that its fork's deletion overtook: its sender gave up on it, and the value may be gone for
/// good (waiting for it would keep an empty entry until the request's timeout).
fn requested(a: &Agent, id: GloballyUniqueId, fork: GloballyUniqueId) -> Result<()> {
    if a.rrefs.table().value_request(id, fork) {
        return Ok(());
    }
    Err(Error::Remote {
        worker: a.me.name.clone(),
        kind: "RRef".into(),
        message: format!(
            "RRef {id} was deleted: its fork {fork} was deleted before this request arrived"
        ),
    })
}

/// The value of `id` for a caller that waits at most `timeout`; a timeout names this worker.
async fn value(a: &Agent, id: GloballyUniqueId, timeout: Option<Duration>) -> Result<Stored> {
    a.rrefs.value(id, timeout).await.map_err(|e| match e {
        Error::Timeout {
            op,
            worker,
            timeout,
        } if worker.is_empty() => Error::Timeout {
            op,
            worker: a.me.name.clone(),
            timeout,
        },
        other => other,
    })
}

/// The registered method `call.func` for the caller's signature.
fn method(a: &Agent, call: &Target) -> Result<super::method::MethodHandler> {
    let methods = METHODS.read().unwrap_or_else(|e| e.into_inner());
    let by_type = methods.get(&call.func).ok_or_else(|| Error::Remote {
        worker: a.me.name.clone(),
        kind: "UnknownMethod".into(),
        message: format!(
            "no method named {:?} is registered on this worker",
            call.func
        ),
    })?;
    match by_type.values().find(|(sig, _)| *sig == call.sig) {
        Some((_, h)) => Ok(h.clone()),
        None => {
            let mut sigs: Vec<&str> = by_type.values().map(|(sig, _)| sig.as_str()).collect();
            sigs.sort_unstable();
            Err(Error::Remote {
                worker: a.me.name.clone(),
                kind: "Signature".into(),
                message: format!(
                    "method {:?} is registered as {} but was called as {}",
                    call.func,
                    sigs.join(" and as "),
                    call.sig
                ),
            })
        }
    }
}
