//! [`RpcFuture`]: the result of an asynchronous call, usable from threads (`wait`) and from
//! async Rust (`.await`).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::{Error, Result};

type Callback<T> = Box<dyn FnOnce(Result<T>) + Send>;

struct State<T> {
    value: Option<Result<T>>,
    done: bool,
    waker: Option<Waker>,
    callback: Option<Callback<T>>,
}

struct Inner<T> {
    state: Mutex<State<T>>,
    cv: Condvar,
}

/// The pending result of [`rpc_async`](crate::rpc_async) (`torch.futures.Future`).
///
/// The call's own timeout bounds it: it always completes, with the result or an error. Wait
/// with [`RpcFuture::wait`] from a thread, or `.await` it from async code; chain work with
/// [`RpcFuture::then`].
pub struct RpcFuture<T> {
    inner: Arc<Inner<T>>,
}

/// The completing side of an [`RpcFuture`].
pub(crate) struct Promise<T> {
    inner: Arc<Inner<T>>,
}

impl<T: Send + 'static> RpcFuture<T> {
    /// A future and the promise that completes it.
    pub(crate) fn pending() -> (RpcFuture<T>, Promise<T>) {
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                value: None,
                done: false,
                waker: None,
                callback: None,
            }),
            cv: Condvar::new(),
        });
        (
            RpcFuture {
                inner: inner.clone(),
            },
            Promise { inner },
        )
    }

    /// A future that is already complete.
    pub fn ready(value: Result<T>) -> RpcFuture<T> {
        let (f, p) = RpcFuture::pending();
        p.complete(value);
        f
    }

    /// Whether the result is available.
    pub fn done(&self) -> bool {
        self.lock().done
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<T>> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks until the call completes and returns its result (the remote function's value,
    /// or its error, a timeout, an unreachable worker).
    ///
    /// # Errors
    /// The call's error.
    pub fn wait(self) -> Result<T> {
        let mut g = self.lock();
        loop {
            if let Some(v) = g.value.take() {
                return v;
            }
            if g.done {
                return Err(Error::Serialization(
                    "the future's value was already taken (by a `then` callback)".into(),
                ));
            }
            g = self.inner.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Like [`RpcFuture::wait`] but gives up after `timeout`, returning the future back.
    ///
    /// # Errors
    /// `Err(self)` when the call has not completed within `timeout`.
    pub fn wait_timeout(self, timeout: Duration) -> std::result::Result<Result<T>, RpcFuture<T>> {
        // a timeout too long to be an instant (`Duration::MAX`) is no timeout
        let Some(deadline) = std::time::Instant::now().checked_add(timeout) else {
            return Ok(self.wait());
        };
        {
            let mut g = self.lock();
            while !g.done {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    drop(g);
                    return Err(self);
                }
                g = self
                    .inner
                    .cv
                    .wait_timeout(g, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        Ok(self.wait())
    }

    /// A future of `f` applied to this one's result, run when it completes (at once when
    /// already complete; otherwise on the thread that completes it, or on the runtime's
    /// blocking pool when that is a transport thread, so `f` may itself wait for RPCs). When
    /// `f` runs later and panics, the returned future completes with an [`Error::Remote`] of
    /// kind `Panic` naming this worker.
    pub fn then<U: Send + 'static>(
        self,
        f: impl FnOnce(Result<T>) -> Result<U> + Send + 'static,
    ) -> RpcFuture<U> {
        let (next, promise) = RpcFuture::pending();
        let mut g = self.lock();
        if g.done {
            let v = g.value.take().unwrap_or_else(|| {
                Err(Error::Serialization(
                    "the future's value was already taken".into(),
                ))
            });
            drop(g);
            promise.complete(f(v));
        } else {
            // a panicking `f` completes the next future with an error of kind `Panic` (not as
            // if RPC had shut down)
            let f = move |v| {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(v))).unwrap_or_else(
                    |p| {
                        Err(Error::Remote {
                            worker: crate::current_worker().map(|w| w.name).unwrap_or_default(),
                            kind: "Panic".into(),
                            message: format!(
                                "a `then` callback panicked: {}",
                                crate::agent::panic_message(&*p)
                            ),
                        })
                    },
                )
            };
            g.callback = Some(Box::new(move |v| {
                // `f` may block (wait for another RPC): never on a thread of the transport's
                // runtime, whose tasks (the RPC it waits for, possibly queued behind it on this
                // very thread) would then never run.
                match tokio::runtime::Handle::try_current() {
                    Ok(h) => {
                        h.spawn_blocking(move || promise.complete(f(v)));
                    }
                    Err(_) => promise.complete(f(v)),
                }
            }));
        }
        next
    }
}

impl<T> Promise<T> {
    /// Sets the result (the first call wins) and wakes every waiter.
    pub(crate) fn complete(self, value: Result<T>) {
        let (cb, waker) = {
            let mut g = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
            if g.done {
                return;
            }
            g.done = true;
            match g.callback.take() {
                Some(cb) => (Some((cb, value)), g.waker.take()),
                None => {
                    g.value = Some(value);
                    (None, g.waker.take())
                }
            }
        };
        self.inner.cv.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
        if let Some((cb, v)) = cb {
            cb(v);
        }
    }
}

/// A promise dropped without a result (its task was cancelled when RPC shut down) completes
/// its future with an error, so that nobody waits forever.
impl<T> Drop for Promise<T> {
    fn drop(&mut self) {
        let pending = !self
            .inner
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .done;
        if pending {
            let p = Promise {
                inner: self.inner.clone(),
            };
            p.complete(Err(Error::NotInitialized {
                op: "waiting for a call: RPC was shut down before it completed".into(),
            }));
        }
    }
}

impl<T: Send + 'static> Future for RpcFuture<T> {
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let mut g = self.lock();
        if let Some(v) = g.value.take() {
            return Poll::Ready(v);
        }
        if g.done {
            return Poll::Ready(Err(Error::Serialization(
                "the future's value was already taken".into(),
            )));
        }
        g.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

/// Waits for every future and returns their results in order, or the first error
/// (`torch.futures.wait_all`).
///
/// # Errors
/// The first failing future's error (all futures are still waited for).
pub fn wait_all<T: Send + 'static>(futures: Vec<RpcFuture<T>>) -> Result<Vec<T>> {
    let results: Vec<Result<T>> = futures.into_iter().map(RpcFuture::wait).collect();
    results.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn then_chains_and_wait_returns() {
        let (f, p) = RpcFuture::<i32>::pending();
        let g = f.then(|v| v.map(|x| x * 2));
        assert!(!g.done());
        std::thread::spawn(move || p.complete(Ok(21)));
        assert_eq!(g.wait().unwrap(), 42);
        let r = RpcFuture::ready(Ok(1)).then(|v| v.map(|x| x + 1));
        assert_eq!(r.wait().unwrap(), 2);
    }

    #[test]
    fn wait_timeout_gives_the_future_back() {
        let (f, p) = RpcFuture::<u8>::pending();
        let f = f.wait_timeout(Duration::from_millis(10)).unwrap_err();
        p.complete(Ok(7));
        assert_eq!(
            f.wait_timeout(Duration::from_secs(1))
                .ok()
                .unwrap()
                .unwrap(),
            7
        );
    }

    #[test]
    fn wait_all_reports_the_first_error() {
        let a = RpcFuture::ready(Ok(1));
        let b = RpcFuture::ready(Err(Error::Serialization("x".into())));
        assert!(wait_all(vec![a, b]).is_err());
    }
}
