//! The serving side: accepting connections from the job's workers, reading each request,
//! running the function it names (see [`run_blocking`]) and writing the response.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tensorplay_core::Tensor;

use super::Agent;
use super::registry::{CallCtx, lookup};
use crate::frame::{Envelope, read_frame, write_frame};
use crate::proto::message::{Message, RemoteErr, Target};
use crate::rref::PendingFork;
use crate::tls;
use crate::wire::Encoder;
use crate::{Error, Result};

pub(super) async fn accept_loop(agent: Arc<Agent>, endpoint: quinn::Endpoint) {
    while let Some(incoming) = endpoint.accept().await {
        let agent = agent.clone();
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else {
                // a refused handshake (a foreign certificate) or a lost peer
                return;
            };
            let Some(peer) = peer_rank(&agent, &conn) else {
                conn.close(1u32.into(), b"unknown certificate");
                return;
            };
            while let Ok((send, recv)) = conn.accept_bi().await {
                let agent = agent.clone();
                tokio::spawn(serve_stream(agent, peer, send, recv));
            }
        });
    }
}

/// The rank whose certificate the peer presented.
fn peer_rank(agent: &Agent, conn: &quinn::Connection) -> Option<usize> {
    let id = conn.peer_identity()?;
    let certs = id
        .downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
        .ok()?;
    let fp = tls::fingerprint(certs.first()?);
    agent.fingerprints.iter().position(|f| *f == fp)
}

async fn serve_stream(
    agent: Arc<Agent>,
    peer: usize,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    agent.serving.fetch_add(1, Ordering::SeqCst);
    let (mut resp, tensors, forks) = match read_frame(&mut recv, agent.shm_from(peer)).await {
        Ok((env, ts)) if env.sender as usize == peer => dispatch(&agent, peer, env, ts).await,
        Ok((env, _)) => (
            error_env(
                &agent,
                &Error::Serialization(format!(
                    "message claims to come from rank {} but the connection is rank {peer}'s",
                    env.sender
                )),
            ),
            vec![],
            vec![],
        ),
        // malformed input: answer with the error if the stream still works, never panic
        Err(e) => (error_env(&agent, &e), vec![], vec![]),
    };
    resp.sender = agent.me.id as u32;
    let written = write_frame(&mut send, &mut resp, &tensors, agent.shm_to(peer)).await;
    // RRefs in a response that could not be written (the caller timed out and stopped
    // reading, or left) never reach it: undo their forks
    crate::rref::after_send(&agent, forks, written.is_ok());
    if let Ok(n) = &written {
        agent.bytes.fetch_add(*n, Ordering::Relaxed);
    }
    if let Err(e) = written {
        // a response that cannot be encoded becomes an error response
        let mut env = error_env(&agent, &e);
        let _ = write_frame(&mut send, &mut env, &[], None).await;
    }
    let _ = send.finish();
    agent.serving.fetch_sub(1, Ordering::SeqCst);
}

pub(crate) fn error_env(agent: &Agent, e: &Error) -> Envelope {
    let me = || agent.me.name.clone();
    let (worker, kind, message) = match e {
        // an error of a nested call still names the worker where it happened
        Error::Remote {
            worker,
            kind,
            message,
        } => (
            if worker.is_empty() {
                me()
            } else {
                worker.clone()
            },
            kind.clone(),
            message.clone(),
        ),
        Error::Autograd { worker, message } => (worker.clone(), "Autograd".into(), message.clone()),
        Error::Core(c) => (me(), crate::error::core_kind(c), c.to_string()),
        other => (me(), other.kind(), other.to_string()),
    };
    Envelope::new(Message::Response(Some(RemoteErr {
        worker,
        kind,
        message,
    })))
}

/// Runs a user function (which may block, sleep or make RPCs itself), catching panics.
///
/// On the agent's multi-threaded runtime the function runs right here, on the I/O thread that
/// read the request, through `block_in_place`: the runtime first hands this thread's queue of
/// tasks to another thread, so the transport keeps running while the function blocks, and
/// nested calls cannot deadlock. Compared with `spawn_blocking`, a cheap function saves two
/// thread hand-offs (to the pool and back) on the critical path of every call. Elsewhere (a
/// current-thread runtime) it falls back to tokio's blocking pool.
pub(crate) async fn run_blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let guarded = move || {
        let was = IN_FUNCTION.replace(true);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        IN_FUNCTION.set(was);
        r
    };
    let r = match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(guarded),
        _ => tokio::task::spawn_blocking(guarded)
            .await
            .map_err(|e| Error::Transport(format!("worker task failed: {e}")))?,
    };
    r.unwrap_or_else(|p| {
        Err(Error::Remote {
            worker: String::new(),
            kind: "Panic".into(),
            message: panic_message(&*p),
        })
    })
}

/// The message of a caught panic.
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

thread_local! {
    /// Set while this thread runs a remote function (see [`run_blocking`]).
    pub(super) static IN_FUNCTION: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The server pipeline of one request: opens its distributed-autograd context (receiving its
/// tensors into it), serves the message, and attaches the response's autograd header, in one
/// place for every kind of request. Returns the response, its tensors and the RRef forks its
/// encoding made (settled once it was written).
async fn dispatch(
    agent: &Arc<Agent>,
    peer: usize,
    env: Envelope,
    tensors: Vec<Tensor>,
) -> (Envelope, Vec<Tensor>, Vec<PendingFork>) {
    let Envelope {
        message,
        payload,
        autograd,
        ..
    } = env;
    let r = async {
        let (ctx, tensors) = crate::autograd::incoming(autograd.as_ref(), peer, tensors, true)?;
        let mut enc = match message {
            Message::Call(call) => call_function(peer, call, payload, tensors, ctx).await?,
            Message::ChildAccept { child } => {
                crate::rref::child_accepted(agent, child.into());
                Encoder::default()
            }
            Message::Response(_) => {
                return Err(Error::Serialization(
                    "a response arrived where a request was expected".into(),
                ));
            }
            other => crate::rref::serve(agent, peer, other, payload, tensors, ctx).await?,
        };
        enc.autograd = crate::autograd::outgoing(ctx, &enc.tensors, agent.me.id, peer);
        Ok(enc)
    };
    match r.await {
        Ok(enc) => {
            let mut env = Envelope::new(Message::Response(None));
            env.payload = enc.bytes;
            env.autograd = enc.autograd;
            (env, enc.tensors, enc.forks)
        }
        Err(e) => (error_env(agent, &e), vec![], vec![]),
    }
}

/// Runs the registered function `call` within the request's context `ctx`.
async fn call_function(
    peer: usize,
    call: Target,
    payload: Vec<u8>,
    tensors: Vec<Tensor>,
    ctx: Option<crate::autograd::ContextId>,
) -> Result<Encoder> {
    let reg = lookup(&call.func, &call.sig)?;
    run_blocking(move || {
        crate::autograd::with_context(ctx, || {
            (reg.handler)(&CallCtx { caller: peer }, &payload, tensors)
        })
    })
    .await
}
