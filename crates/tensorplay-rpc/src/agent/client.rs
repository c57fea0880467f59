//! The calling side: connections to peers, one request per stream with its timeout, and the
//! public calls ([`rpc_sync`], [`rpc_async`], worker information, the default timeout).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tensorplay_core::Tensor;

#[cfg(doc)]
use super::options::RpcBackendOptions;
use super::options::{To, WorkerInfo};
use super::registry::signature;
use super::{Agent, agent};
use crate::frame::{Envelope, read_frame, write_frame};
use crate::future::{Promise, RpcFuture};
use crate::proto::message::{Message, Target};
use crate::shm::ShmDir;
use crate::tls;
use crate::wire::{Encoder, Wire, decode_value, encode_value};
use crate::{Error, Result};

impl Agent {
    pub(super) fn timeout_or_default(&self, t: Option<Duration>) -> Option<Duration> {
        let t = t.unwrap_or_else(|| {
            *self
                .default_timeout
                .lock()
                .unwrap_or_else(|e| e.into_inner())
        });
        (!t.is_zero()).then_some(t)
    }

    /// This worker's shared-memory directory when `rank` can read it.
    pub(super) fn shm_to(&self, rank: usize) -> Option<&ShmDir> {
        self.shm.as_ref().filter(|_| self.shm_send[rank])
    }

    /// `rank`'s shared-memory directory when this worker can read it.
    pub(super) fn shm_from(&self, rank: usize) -> Option<&Path> {
        self.shm_peers[rank].as_deref()
    }

    /// The rank of `to`.
    pub(crate) fn resolve(&self, to: &To) -> Result<usize> {
        let known = || {
            self.workers
                .iter()
                .map(|w| format!("{}={}", w.id, w.name))
                .collect::<Vec<_>>()
                .join(", ")
        };
        match to {
            To::Rank(r) if *r < self.workers.len() => Ok(*r),
            To::Rank(r) => Err(Error::UnknownWorker {
                name: format!("rank {r}"),
                known: known(),
            }),
            To::Name(n) => self
                .workers
                .iter()
                .find(|w| &w.name == n)
                .map(|w| w.id)
                .ok_or_else(|| Error::UnknownWorker {
                    name: format!("{n:?}"),
                    known: known(),
                }),
        }
    }

    /// The connection to `rank`, connecting on first use.
    async fn conn(&self, rank: usize) -> Result<quinn::Connection> {
        let cell = {
            let mut m = self.conns.lock().unwrap_or_else(|e| e.into_inner());
            m.entry(rank)
                .or_insert_with(|| Arc::new(tokio::sync::OnceCell::new()))
                .clone()
        };
        let unreachable = |detail: String| Error::WorkerUnreachable {
            worker: self.workers[rank].name.clone(),
            op: "connect".into(),
            detail,
        };
        let c = cell
            .get_or_try_init(|| async {
                let connecting = self
                    .endpoint
                    .connect(self.addrs[rank], tls::SERVER_NAME)
                    .map_err(|e| unreachable(e.to_string()))?;
                connecting.await.map_err(|e| unreachable(e.to_string()))
            })
            .await?
            .clone();
        if let Some(reason) = c.close_reason() {
            // the connection died: forget it so the next call reconnects (and fails fast if the
            // worker is gone)
            self.conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&rank);
            return Err(unreachable(reason.to_string()));
        }
        Ok(c)
    }

    /// Sends one request to `to` and returns the response (its error turned into
    /// [`Error::Remote`]).
    pub(crate) async fn request(
        self: Arc<Self>,
        to: usize,
        mut env: Envelope,
        tensors: Vec<Tensor>,
        timeout: Option<Duration>,
        op: String,
    ) -> Result<(Envelope, Vec<Tensor>)> {
        let worker = self.workers[to].name.clone();
        let t0 = Instant::now();
        // quiet unless a subscriber enables DEBUG for this crate
        let span = tracing::debug_span!(
            "rpc",
            worker = %worker,
            function = %op,
            bytes_sent = tracing::field::Empty,
            bytes_received = tracing::field::Empty,
            latency_us = tracing::field::Empty,
        );
        let fut = {
            let this = self.clone();
            let op = op.clone();
            let worker = worker.clone();
            async move {
                let c = this.conn(to).await?;
                let lost = |e: &dyn std::fmt::Display| Error::WorkerUnreachable {
                    worker: worker.clone(),
                    op: op.clone(),
                    detail: e.to_string(),
                };
                let (mut send, mut recv) = c.open_bi().await.map_err(|e| lost(&e))?;
                env.sender = this.me.id as u32;
                let sent = write_frame(&mut send, &mut env, &tensors, this.shm_to(to))
                    .await
                    .map_err(|e| match c.close_reason() {
                        Some(r) => lost(&r),
                        None => e,
                    })?;
                let _ = send.finish();
                let resp = read_frame(&mut recv, this.shm_from(to))
                    .await
                    .map_err(|e| match c.close_reason() {
                        Some(r) => lost(&r),
                        None => match e {
                            Error::Transport(m) => lost(&m),
                            other => other,
                        },
                    })?;
                this.bytes.fetch_add(sent, Ordering::Relaxed);
                let span = tracing::Span::current();
                span.record("bytes_sent", sent);
                span.record("bytes_received", received_bytes(&resp));
                Ok::<_, Error>((resp, c))
            }
        };
        let fut = tracing::Instrument::instrument(fut, span.clone());
        let res = match timeout {
            Some(t) => match tokio::time::timeout(t, fut).await {
                Ok(r) => r,
                Err(_) => {
                    // tell a dead worker from a slow one
                    let dead = self
                        .conns
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get(&to)
                        .and_then(|c| c.get().and_then(quinn::Connection::close_reason));
                    return Err(match dead {
                        Some(r) => Error::WorkerUnreachable {
                            worker,
                            op,
                            detail: r.to_string(),
                        },
                        None => Error::Timeout {
                            op,
                            worker,
                            timeout: t,
                        },
                    });
                }
            },
            None => fut.await,
        };
        let ((resp, tensors), _c) = match res {
            Ok(((env, ts), c)) => ((env, ts), c),
            Err(e) => return Err(e),
        };
        span.record("latency_us", t0.elapsed().as_micros() as u64);
        span.in_scope(|| {
            tracing::debug!(
                ok = matches!(resp.message, Message::Response(None)),
                "rpc done"
            )
        });
        // the caller's timeout, when the reply came after it
        let expired = timeout.filter(|t| t0.elapsed() >= *t);
        match resp.message {
            Message::Response(None) => Ok((resp, tensors)),
            Message::Response(Some(e)) => Err(match expired {
                // the callee's own wait for this request (a fetch waits as long as the caller
                // does) expired first, a tie: it is this call's timeout, reported as when the
                // caller's timer wins (a test saw either error at random)
                Some(t) if e.kind == "Timeout" => Error::Timeout {
                    op,
                    worker,
                    timeout: t,
                },
                _ => Error::Remote {
                    worker: e.worker,
                    kind: e.kind,
                    message: e.message,
                },
            }),
            other => Err(Error::Serialization(format!(
                "{} answered a request with a {} message instead of a response",
                self.workers[to].name,
                other.name()
            ))),
        }
    }

    /// Starts a request to `to`, the one way every request leaves this worker: attaches this
    /// thread's distributed-autograd header when the message runs code in a context (a call,
    /// `remote`, a method, a fetch), sends it with the encoded value `enc`, undoes the RRef
    /// forks the encoding made when it was not delivered, and receives the response's tensors
    /// into the context. The future yields the response's payload and tensors.
    ///
    /// The header is taken here, on the calling thread (the current context is per thread),
    /// before the future first runs.
    pub(crate) fn send_request(
        self: &Arc<Self>,
        to: usize,
        message: Message,
        enc: Encoder,
        timeout: Option<Duration>,
        op: String,
    ) -> impl Future<Output = Result<(Vec<u8>, Vec<Tensor>)>> + Send + 'static {
        let mut env = Envelope::new(message);
        if env.message.runs_in_context() {
            env.autograd = crate::autograd::request_header(&enc.tensors, self.me.id, to);
        }
        env.payload = enc.bytes;
        let (tensors, forks) = (enc.tensors, enc.forks);
        let this = self.clone();
        async move {
            let r = this.clone().request(to, env, tensors, timeout, op).await;
            crate::rref::after_send(&this, forks, crate::rref::maybe_delivered(&r));
            let (resp, tensors) = r?;
            let (_, tensors) =
                crate::autograd::incoming(resp.autograd.as_ref(), to, tensors, false)?;
            Ok((resp.payload, tensors))
        }
    }

    /// Runs `fut` on the runtime, completing a future with its result; counts it in flight.
    pub(crate) fn spawn_call<T: Send + 'static>(
        self: &Arc<Self>,
        fut: impl Future<Output = Result<T>> + Send + 'static,
    ) -> RpcFuture<T> {
        let (f, p): (RpcFuture<T>, Promise<T>) = RpcFuture::pending();
        self.inflight.fetch_add(1, Ordering::SeqCst);
        let this = self.clone();
        self.handle.spawn(async move {
            let r = fut.await;
            this.inflight.fetch_sub(1, Ordering::SeqCst);
            p.complete(r);
        });
        f
    }
}

/// The bytes of a received message: its payload and its tensors' data.
fn received_bytes(m: &(Envelope, Vec<Tensor>)) -> u64 {
    let tensors: usize =
        m.1.iter()
            .map(|t| t.numel() * t.dtype().size_in_bytes())
            .sum();
    (m.0.payload.len() + tensors) as u64
}

/// Calls the registered function `func` on worker `to` with `args` and blocks for its result
/// (`rpc_sync`). `timeout`: `None` uses the default (see
/// [`RpcBackendOptions`](crate::RpcBackendOptions)), `Some(ZERO)` waits forever. Calls to this
/// worker itself work; `func` may itself make RPCs.
///
/// Do not call it from async code running on a runtime (use [`rpc_async`](crate::rpc_async)
/// and `.await`).
///
/// # Errors
/// [`Error::Remote`] with the worker's name, a `kind` and a message: the variant name of the
/// function's error (`InvalidArgument`, `ShapeMismatch`, `Custom`, ...), or `UnknownFunction`
/// (not registered there), `Signature` (the argument or result types differ from the
/// registered ones; the message names both), `Panic` (the function panicked);
/// [`Error::Timeout`]; [`Error::WorkerUnreachable`] when the worker died or cannot be reached;
/// [`Error::UnknownWorker`]; [`Error::NotInitialized`]; [`Error::Serialization`] when a value
/// cannot be encoded or a reply cannot be decoded.
pub fn rpc_sync<A: Wire, R: Wire>(
    to: impl Into<To>,
    func: &str,
    args: A,
    timeout: Option<Duration>,
) -> Result<R> {
    rpc_async(to, func, args, timeout)?.wait()
}

/// Like [`rpc_sync`](crate::rpc_sync) but returns at once with an [`RpcFuture`] of the result
/// (`rpc_async`).
///
/// # Errors
/// As [`rpc_sync`](crate::rpc_sync); arguments that cannot be encoded and unknown workers are
/// reported here, everything else through the future.
pub fn rpc_async<A: Wire, R: Wire>(
    to: impl Into<To>,
    func: &str,
    args: A,
    timeout: Option<Duration>,
) -> Result<RpcFuture<R>> {
    let a = agent("rpc_async")?;
    let to = a.resolve(&to.into())?;
    let enc = encode_value(&args, to)?;
    let call = Target {
        func: func.to_string(),
        sig: signature::<A, R>(),
    };
    let timeout = a.timeout_or_default(timeout);
    let what = format!("result of {func}");
    let reply = a.send_request(to, Message::Call(call), enc, timeout, format!("rpc {func}"));
    Ok(a.spawn_call(async move {
        let (payload, tensors) = reply.await?;
        decode_value::<R>(&payload, tensors, to, &what)
    }))
}

/// The UDP address this worker's QUIC endpoint listens on (for tests that play a foreign
/// peer).
///
/// # Errors
/// [`Error::NotInitialized`]; [`Error::Transport`] when the socket has no address.
#[doc(hidden)]
pub fn local_addr() -> Result<SocketAddr> {
    agent("local_addr")?
        .endpoint
        .local_addr()
        .map_err(|e| Error::Transport(e.to_string()))
}

/// Bytes this worker has sent since `init_rpc`: its requests and its responses, message
/// headers and tensor data (also the data that went through shared memory).
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn bytes_sent() -> Result<u64> {
    Ok(agent("bytes_sent")?.bytes.load(Ordering::Relaxed))
}

/// This worker's [`WorkerInfo`] (`get_worker_info()`).
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn current_worker() -> Result<WorkerInfo> {
    Ok(agent("get_worker_info")?.me.clone())
}

/// The [`WorkerInfo`] of a worker by name or rank (`get_worker_info(name)`).
///
/// # Errors
/// [`Error::UnknownWorker`], [`Error::NotInitialized`].
pub fn get_worker_info(to: impl Into<To>) -> Result<WorkerInfo> {
    let a = agent("get_worker_info")?;
    let r = a.resolve(&to.into())?;
    Ok(a.workers[r].clone())
}

/// Every worker of the job, by id.
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn get_worker_infos() -> Result<Vec<WorkerInfo>> {
    Ok(agent("get_worker_infos")?.workers.clone())
}

/// The default timeout of calls issued from now on (`rpc.get_rpc_timeout`).
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn get_rpc_timeout() -> Result<Duration> {
    Ok(*agent("get_rpc_timeout")?
        .default_timeout
        .lock()
        .unwrap_or_else(|e| e.into_inner()))
}

/// Changes the default timeout of calls issued from now on (`rpc._set_rpc_timeout`); calls in
/// flight keep theirs. `Duration::ZERO` means no timeout.
///
/// # Errors
/// [`Error::NotInitialized`].
pub fn set_rpc_timeout(timeout: Duration) -> Result<()> {
    *agent("set_rpc_timeout")?
        .default_timeout
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = timeout;
    Ok(())
}
