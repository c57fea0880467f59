//! Serving the RRef messages on the owner: creations, fetches, deletions, fork requests,
//! methods.

use std::sync::Arc;

use tensorplay_core::Tensor;

use super::method::METHODS;
use super::*;
use crate::agent::{Agent, CallCtx, run_blocking};
use crate::frame::{Envelope, kind};
use crate::wire::Encoder;
use crate::{Error, Result};

pub(crate) async fn dispatch(
    a: &Arc<Agent>,
    peer: usize,
    env: Envelope,
    tensors: Vec<Tensor>,
) -> Result<Encoder> {
    let (owner, rref_id, fork_id, _parent) = parse_ids(&env.ids)?;
    if owner != a.me.id {
        return Err(Error::Serialization(format!(
            "RRef message for owner {owner} delivered to worker {}",
            a.me.id
        )));
    }
    let timeout = crate::get_rpc_timeout().ok().filter(|t| !t.is_zero());
    match env.kind {
        kind::REMOTE => {
            // The fork is registered whatever happens: a failed creation keeps its error as
            // the value, for the fetches that may already be on their way (messages are not
            // ordered), until the creator deletes its RRef like any other.
            a.rrefs.table().add_fork(rref_id, fork_id);
            let r = match crate::agent::lookup(&env.func, &env.sig) {
                Ok(reg) => {
                    let payload = env.payload;
                    match crate::autograd::incoming(&env.autograd, peer, tensors, true) {
                        Ok((ctx, tensors)) => {
                            run_blocking(move || {
                                crate::autograd::with_context(ctx, || {
                                    (reg.remote)(&CallCtx { caller: peer }, &payload, tensors)
                                })
                            })
                            .await
                        }
                        Err(e) => Err(e),
                    }
                }
                Err(e) => Err(e),
            };
            match r {
                Ok(v) => {
                    a.rrefs.set_value(rref_id, Ok(v));
                    // the creator may have deleted it meanwhile (a timed-out `remote`)
                    a.rrefs.table().release_if_unused(rref_id);
                    Ok(Encoder::default())
                }
                Err(e) => {
                    let e = named(a, e);
                    a.rrefs.set_value(rref_id, Err(e.clone()));
                    a.rrefs.table().release_if_unused(rref_id);
                    Err(e)
                }
            }
        }
        kind::FETCH => {
            let (ctx, _) = crate::autograd::incoming(&env.autograd, peer, vec![], true)?;
            let v = a.rrefs.value(rref_id, timeout).await?;
            let mut enc = (v.encode)(&*v.value, peer)?;
            enc.autograd = crate::autograd::outgoing(ctx, &enc.tensors, a.me.id, peer);
            Ok(enc)
        }
        kind::USER_DELETE => {
            a.rrefs.table().remove_fork(rref_id, fork_id);
            Ok(Encoder::default())
        }
        kind::FORK_REQUEST => {
            a.rrefs.table().add_fork(rref_id, fork_id);
            Ok(Encoder::default())
        }
        kind::CHILD_ACCEPT => Ok(Encoder::default()),
        kind::METHOD => {
            let h = {
                let methods = METHODS.read().unwrap_or_else(|e| e.into_inner());
                let by_type = methods.get(&env.func).ok_or_else(|| Error::Remote {
                    worker: a.me.name.clone(),
                    kind: "UnknownMethod".into(),
                    message: format!(
                        "no method named {:?} is registered on this worker",
                        env.func
                    ),
                })?;
                match by_type.values().find(|(sig, _)| *sig == env.sig) {
                    Some((_, h)) => h.clone(),
                    None => {
                        let mut sigs: Vec<&str> =
                            by_type.values().map(|(sig, _)| sig.as_str()).collect();
                        sigs.sort_unstable();
                        return Err(Error::Remote {
                            worker: a.me.name.clone(),
                            kind: "Signature".into(),
                            message: format!(
                                "method {:?} is registered as {} but was called as {}",
                                env.func,
                                sigs.join(" and as "),
                                env.sig
                            ),
                        });
                    }
                }
            };
            let v = a.rrefs.value(rref_id, timeout).await?;
            let payload = env.payload;
            let (ctx, tensors) = crate::autograd::incoming(&env.autograd, peer, tensors, true)?;
            let me = a.me.id;
            run_blocking(move || {
                crate::autograd::respond(ctx, me, peer, || h(&*v.value, &payload, tensors, peer))
            })
            .await
        }
        k => Err(Error::Serialization(format!("unknown message kind {k}"))),
    }
}

/// Handles a child's acceptance on the parent (outside the owner check of [`dispatch`]).
pub(crate) fn child_accepted(a: &Agent, env: &Envelope) -> Result<()> {
    let (_, _, child, _) = parse_ids(&env.ids)?;
    a.rrefs
        .pending_children
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&child);
    Ok(())
}
