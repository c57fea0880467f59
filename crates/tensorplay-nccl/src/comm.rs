//! One NCCL communicator on one GPU stream, with timeouts that hold: every call is enqueued,
//! an event is recorded behind it, and the caller polls the event (and the communicator's
//! asynchronous error) against the call's deadline. On expiry the communicator is aborted
//! (`ncclCommAbort`, which also releases the kernels stuck waiting for a peer), the call
//! returns [`Error::Timeout`] naming it, and every later call fails at once.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream};
use tensorplay_collectives::{Error, Result};

use crate::ffi::{self, IN_PROGRESS, Nccl, NcclResult, SUCCESS, UniqueId};

/// An NCCL error as the backend reports it.
pub(crate) fn nccl_error(n: &Nccl, call: &str, r: NcclResult) -> Error {
    Error::Backend {
        backend: "nccl".into(),
        detail: format!("{call} failed: {}", n.error_string(r)).into(),
    }
}

/// A communicator and the stream its work runs on.
pub(crate) struct Communicator {
    nccl: &'static Nccl,
    comm: ffi::Comm,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    rank: usize,
    /// Why the communicator is unusable (aborted after a timeout or an error), once it is.
    broken: Mutex<Option<String>>,
}

// SAFETY: an NCCL communicator may be used from any thread; the group's sequencer (and the
// `broken` lock for the abort) keep calls on it one at a time, as NCCL requires.
unsafe impl Send for Communicator {}
// SAFETY: as above.
unsafe impl Sync for Communicator {}

struct SendPtr(ffi::Comm);
// SAFETY: the new communicator is handed from the init thread to its one owner.
unsafe impl Send for SendPtr {}

impl Communicator {
    /// Joins communicator `id` as `rank` of `size` on `ctx`'s device, waiting at most
    /// `timeout` for every rank to join.
    pub(crate) fn init(
        nccl: &'static Nccl,
        ctx: Arc<CudaContext>,
        id: UniqueId,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<Communicator> {
        let stream = ctx.new_stream().map_err(|e| Error::Backend {
            backend: "nccl".into(),
            detail: format!("could not create a stream on cuda:{}: {e:?}", ctx.ordinal()).into(),
        })?;
        let (tx, rx) = crossbeam::channel::bounded(1);
        let c2 = ctx.clone();
        // ncclCommInitRank blocks until every rank has joined; it runs on its own thread so
        // that the wait honours the timeout (a rank that never joins leaves that thread
        // blocked, and the process exits with the error)
        std::thread::Builder::new()
            .name("tensorplay-nccl-init".into())
            .spawn(move || {
                let r = c2.bind_to_thread().map_err(|e| format!("{e:?}")).map(|()| {
                    let mut comm: ffi::Comm = std::ptr::null_mut();
                    // SAFETY: `comm` is a valid out-pointer; `id` is 128 bytes from
                    // ncclGetUniqueId on rank 0; rank < size was checked by the caller.
                    let r =
                        unsafe { (nccl.comm_init_rank)(&mut comm, size as i32, id, rank as i32) };
                    (r, SendPtr(comm))
                });
                let _ = tx.send(r);
            })
            .map_err(|e| Error::Io(format!("could not start the NCCL init thread: {e}")))?;
        let comm = match rx.recv_timeout(timeout) {
            Ok(Ok((SUCCESS, c))) => c.0,
            Ok(Ok((r, _))) => return Err(nccl_error(nccl, "ncclCommInitRank", r)),
            Ok(Err(e)) => {
                return Err(Error::Backend {
                    backend: "nccl".into(),
                    detail: format!("could not bind cuda:{}: {e}", ctx.ordinal()).into(),
                });
            }
            Err(_) => {
                return Err(Error::Timeout {
                    op: "init_process_group (ncclCommInitRank)".into(),
                    rank: rank as i64,
                    timeout,
                    detail: format!(
                        "not every one of the {size} ranks joined the NCCL communicator"
                    )
                    .into(),
                });
            }
        };
        Ok(Communicator {
            nccl,
            comm,
            ctx,
            stream,
            rank,
            broken: Mutex::new(None),
        })
    }

    /// The stream the communicator's work runs on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The loaded library.
    pub(crate) fn nccl(&self) -> &'static Nccl {
        self.nccl
    }

    /// The raw communicator, for the enqueue closures.
    pub(crate) fn raw(&self) -> ffi::Comm {
        self.comm
    }

    /// The raw stream, for the enqueue closures.
    pub(crate) fn raw_stream(&self) -> ffi::Stream {
        self.stream.cu_stream().cast()
    }

    /// Runs `enqueue` (which puts NCCL calls on the stream and returns the first non-success
    /// result), inside an NCCL group when `grouped`, and waits for the work to finish until
    /// `timeout` passes. `call` names the operation in errors.
    pub(crate) fn run(
        &self,
        call: &str,
        timeout: Duration,
        grouped: bool,
        enqueue: impl FnOnce(&Self) -> NcclResult,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        if let Some(why) = self.broken() {
            return Err(Error::Backend {
                backend: "nccl".into(),
                detail: format!(
                    "{call}: this group's communicator was aborted earlier ({why}); create a new group"
                )
                .into(),
            });
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.fail(call, format!("could not bind the device: {e:?}")))?;
        let n = self.nccl;
        if grouped {
            // SAFETY: a group bracket; NCCL calls between start and end are fused.
            let r = unsafe { (n.group_start)() };
            if r != SUCCESS {
                return Err(nccl_error(n, &format!("{call} (ncclGroupStart)"), r));
            }
        }
        let mut r = enqueue(self);
        if grouped {
            // SAFETY: closes the bracket opened above (also after a failed enqueue, as NCCL
            // requires).
            let e = unsafe { (n.group_end)() };
            if r == SUCCESS {
                r = e;
            }
        }
        if r != SUCCESS && r != IN_PROGRESS {
            let e = nccl_error(n, call, r);
            self.abort(format!("{call} failed to start"));
            return Err(e);
        }
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| self.fail(call, format!("could not record an event: {e:?}")))?;
        let mut pause = Duration::from_micros(20);
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.fail(call, format!("the GPU reported {e:?}"))),
            }
            let mut async_err: NcclResult = SUCCESS;
            // SAFETY: queries the communicator's asynchronous error into one int.
            let q = unsafe { (n.comm_get_async_error)(self.comm, &mut async_err) };
            if q == SUCCESS && async_err != SUCCESS && async_err != IN_PROGRESS {
                let e = nccl_error(n, call, async_err);
                self.abort(format!("{call} failed on the GPU"));
                return Err(e);
            }
            if Instant::now() >= deadline {
                self.abort(format!("{call} timed out after {timeout:?}"));
                return Err(Error::Timeout {
                    op: call.to_string(),
                    rank: self.rank as i64,
                    timeout,
                    detail: "the NCCL call did not finish (a peer did not take part, or died); \
                             the communicator was aborted and this group can no longer be used"
                        .into(),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    }

    fn broken(&self) -> Option<String> {
        self.broken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Marks the communicator broken and returns the error for `call`.
    fn fail(&self, call: &str, detail: String) -> Error {
        self.abort(format!("{call}: {detail}"));
        Error::Backend {
            backend: "nccl".into(),
            detail: format!("{call}: {detail}").into(),
        }
    }

    /// Aborts the communicator once (later calls fail at once with `why`).
    pub(crate) fn abort(&self, why: String) {
        let mut b = self.broken.lock().unwrap_or_else(|e| e.into_inner());
        if b.is_none() {
            // SAFETY: aborts a live communicator once (guarded by `broken`); it is never used
            // again, and Drop skips it.
            unsafe { (self.nccl.comm_abort)(self.comm) };
            *b = Some(why);
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if self.broken().is_none() {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: the communicator is live (not aborted) and dropped once; no call is in
            // flight (each call waits for its work before returning).
            unsafe { (self.nccl.comm_destroy)(self.comm) };
        }
    }
}

/// A fresh unique id (on the rank that creates the communicator).
pub(crate) fn unique_id(n: &Nccl) -> Result<UniqueId> {
    let mut id = UniqueId { internal: [0; 128] };
    // SAFETY: writes the 128-byte id.
    let r = unsafe { (n.get_unique_id)(&mut id) };
    if r != SUCCESS {
        return Err(nccl_error(n, "ncclGetUniqueId", r));
    }
    Ok(id)
}
