//! Stopping RPC ([`shutdown`]): the graceful protocol (calls drained, barriers, RRef deletions
//! delivered, rank 0 last) and closing the agent.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::init::{stop_runtime, store_barrier};
use super::server::IN_FUNCTION;
use super::{AGENT, Agent, agent};
use crate::shm;
use crate::{Error, Result};

/// Stops RPC in this process (`torch.distributed.rpc.shutdown`). Graceful: waits until this
/// worker's outgoing calls finished, until every worker reached shutdown, and until the RRef
/// deletions it owes were delivered (so every owner's table is empty afterwards), then closes
/// the endpoint; worker 0, which serves the job's store, returns last. Not graceful: closes at
/// once. Either way `init_rpc` may be called again: the store stays open in this process for
/// it (under a new prefix).
///
/// A graceful shutdown cannot be called by a remote function (it would wait for the call
/// that runs it); a non-graceful one can.
///
/// # Errors
/// [`Error::NotInitialized`]; [`Error::Timeout`] when other workers do not reach shutdown
/// within the RPC timeout (the agent is still closed); [`Error::InvalidArgument`] for a
/// graceful shutdown inside a remote function (RPC stays initialised).
pub fn shutdown(graceful: bool) -> Result<()> {
    let a = agent("shutdown")?;
    if graceful && IN_FUNCTION.get() {
        return Err(Error::invalid(
            "shutdown",
            "graceful",
            "shutdown(true) outside remote functions (it waits for every call in flight, the one running it included), or shutdown(false)",
            "shutdown(true) called by a remote function",
        ));
    }
    let res = if graceful { a.graceful() } else { Ok(()) };
    AGENT.write().unwrap_or_else(|e| e.into_inner()).take();
    a.close();
    crate::optim::reset();
    res
}

impl Agent {
    fn graceful(self: &Arc<Self>) -> Result<()> {
        let limit = self
            .timeout_or_default(None)
            .unwrap_or(Duration::from_secs(3600));
        let n = self.workers.len();
        let k = self.shutdowns.fetch_add(1, Ordering::SeqCst);
        // 1. our own calls are answered
        let start = Instant::now();
        while self.inflight.load(Ordering::SeqCst) > 0 && start.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(2));
        }
        // 2. everyone stopped issuing work
        store_barrier(
            &*self.store,
            &format!("shutdown{k}/a"),
            self.me.id,
            n,
            limit,
            "shutdown",
            &self.workers,
        )?;
        // 3. RRef deletions delivered to their owners (acknowledged)
        self.rrefs.flush(self, limit)?;
        // 4. every worker delivered its deletions and served its last call
        store_barrier(
            &*self.store,
            &format!("shutdown{k}/b"),
            self.me.id,
            n,
            limit,
            "shutdown",
            &self.workers,
        )?;
        let start = Instant::now();
        while self.serving.load(Ordering::SeqCst) > 0 && start.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(2));
        }
        store_barrier(
            &*self.store,
            &format!("shutdown{k}/c"),
            self.me.id,
            n,
            limit,
            "shutdown",
            &self.workers,
        )?;
        // 5. rank 0 serves the store: it leaves last, once the others are done with it (its
        //    process may exit right after). The last one out tells it; the reply to that may
        //    be lost when rank 0 is already gone, which is fine. So may the reply to an
        //    earlier worker's count: its store thread may apply the add, then lose the race
        //    with the last worker's, whose "done" lets rank 0 exit before the reply is
        //    written. Every barrier above has passed, so a count whose reply never came is
        //    not an error (a rank 0 that failed here would be the one to report it).
        let left = format!("shutdown{k}/left");
        if self.me.id != 0 {
            if let Ok(count) = self.store.add(&left, 1)
                && count >= n as i64 - 1
            {
                let _ = self.store.set(&format!("{left}/done"), b"1");
            }
        } else if n > 1 {
            let done = format!("{left}/done");
            self.store.wait(&[&done], limit).map_err(|e| match e {
                tensorplay_collectives::Error::Timeout { .. } => Error::Timeout {
                    op: "shutdown (waiting for the other workers to leave)".into(),
                    worker: "the job".into(),
                    timeout: limit,
                },
                other => Error::Collectives(other),
            })?;
        }
        Ok(())
    }

    pub(super) fn close(&self) {
        self.endpoint.close(0u32.into(), b"shutdown");
        if let Some(d) = &self.shm {
            d.close();
        }
        shm::forget_peer_mappings();
        self.rrefs.clear();
        if let Some(rt) = self
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            stop_runtime(rt);
        }
    }
}
