//! `Work`: the handle of an asynchronous collective, and the per-group sequencer that keeps
//! operations on one group in issue order.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, Sender, bounded, unbounded};

use crate::{Error, Part, Result, detail};

type Job = Box<dyn FnOnce() -> Result<()> + Send>;
type Queued = (u64, Job, Sender<Done>, String, Duration);

/// What a finished operation reports to its [`Work`]: its result and when it ran.
#[derive(Debug, Clone)]
pub(crate) struct Done {
    result: Result<()>,
    /// When the operation started running (after earlier operations of the group); `None`
    /// when it never ran (it timed out waiting for its turn).
    started: Option<Instant>,
    finished: Instant,
}

impl Done {
    /// An operation that started at `started` and finished now with `result`.
    pub(crate) fn now(result: Result<()>, started: Option<Instant>) -> Done {
        Done {
            result,
            started,
            finished: Instant::now(),
        }
    }
}

/// Runs the operations of one group strictly in the order they were issued, whether they are
/// blocking (run on the caller's thread) or asynchronous (run on the group's worker thread).
pub(crate) struct Sequencer {
    /// This process's global rank and the group's global ranks, for errors.
    rank: i64,
    ranks: Vec<usize>,
    state: Mutex<SeqState>,
    turn: Condvar,
    worker: Mutex<Option<Sender<Queued>>>,
}

struct SeqState {
    next_ticket: u64,
    now_serving: u64,
    /// Tickets whose owners gave up waiting: skipped when their turn comes.
    abandoned: std::collections::BTreeSet<u64>,
}

impl Sequencer {
    /// The sequencer of the group of global `ranks` on global rank `rank`.
    pub(crate) fn new(rank: usize, ranks: Vec<usize>) -> Arc<Sequencer> {
        Arc::new(Sequencer {
            rank: rank as i64,
            ranks,
            state: Mutex::new(SeqState {
                next_ticket: 0,
                now_serving: 0,
                abandoned: Default::default(),
            }),
            turn: Condvar::new(),
            worker: Mutex::new(None),
        })
    }

    fn ticket(&self) -> u64 {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let t = s.next_ticket;
        s.next_ticket += 1;
        t
    }

    /// Waits for `ticket`'s turn (up to `timeout`), runs `f`, and passes the turn on even when
    /// `f` fails.
    fn run_turn<R>(
        &self,
        ticket: u64,
        timeout: Duration,
        op: &str,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let deadline = Instant::now() + timeout;
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while s.now_serving != ticket {
            let now = Instant::now();
            if now >= deadline {
                // give up our turn without blocking the ones after us
                drop(s);
                self.skip(ticket);
                return Err(Error::Timeout {
                    op: op.to_string(),
                    rank: self.rank,
                    timeout,
                    detail: detail!(
                        "an earlier operation on this group (ranks ",
                        Part::Ranks(self.ranks.clone()),
                        ") did not finish"
                    ),
                });
            }
            s = self
                .turn
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(s);
        // a panic inside the operation (a backend's bug) becomes its error, and the turn still
        // passes on: the group's later calls are not left waiting for a turn that never ends
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string panic".into());
            Err(Error::Backend {
                backend: "(the group's backend)".into(),
                detail: match usize::try_from(self.rank) {
                    Ok(r) => detail!(
                        format!("{op} panicked on rank "),
                        Part::Rank(r),
                        format!(": {msg}")
                    ),
                    Err(_) => format!("{op} panicked on rank {}: {msg}", self.rank).into(),
                },
            })
        });
        self.advance();
        r
    }

    fn advance(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.now_serving += 1;
        loop {
            let next = s.now_serving;
            if !s.abandoned.remove(&next) {
                break;
            }
            s.now_serving += 1;
        }
        drop(s);
        self.turn.notify_all();
    }

    /// Gives up `ticket`: it is skipped when its turn comes (or now, if it has come).
    fn skip(&self, ticket: u64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.now_serving == ticket {
            drop(s);
            self.advance();
        } else {
            s.abandoned.insert(ticket);
        }
    }

    /// Runs `f` on this thread in issue order.
    pub(crate) fn run_blocking<R>(
        &self,
        timeout: Duration,
        op: &str,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let t = self.ticket();
        self.run_turn(t, timeout, op, f)
    }

    /// Queues `f` on the group's worker thread in issue order; returns its handle.
    pub(crate) fn submit(self: &Arc<Self>, timeout: Duration, op: &str, f: Job) -> Result<Work> {
        let t = self.ticket();
        let (tx, rx) = bounded(1);
        let mut w = self.worker.lock().unwrap_or_else(|e| e.into_inner());
        if w.is_none() {
            let (jtx, jrx) = unbounded::<Queued>();
            let me = Arc::downgrade(self);
            std::thread::Builder::new()
                .name("tensorplay-collectives".into())
                .spawn(move || {
                    while let Ok((ticket, job, done, op_name, timeout)) = jrx.recv() {
                        let Some(seq) = me.upgrade() else { break };
                        let mut started = None;
                        let r = seq.run_turn(ticket, timeout, &op_name, || {
                            started = Some(Instant::now());
                            job()
                        });
                        let _ = done.send(Done::now(r, started));
                    }
                })
                .map_err(|e| {
                    Error::Io(format!(
                        "could not start the collectives worker thread: {e}"
                    ))
                })?;
            *w = Some(jtx);
        }
        let sender = w
            .as_ref()
            .map(|s| s.send((t, f, tx, op.to_string(), timeout)));
        if !matches!(sender, Some(Ok(()))) {
            return Err(Error::Io(
                "the collectives worker thread has stopped".into(),
            ));
        }
        Ok(Work {
            op: op.to_string(),
            rank: self.rank,
            ranks: self.ranks.clone(),
            rx,
            result: Mutex::new(None),
        })
    }
}

/// The handle of an asynchronous operation (`torch.distributed.Work`): `wait` blocks until it
/// finishes and returns its result; [`Work::timing`] says when it ran.
#[derive(Debug)]
pub struct Work {
    op: String,
    /// This process's global rank and the group's ranks, for errors.
    rank: i64,
    ranks: Vec<usize>,
    rx: Receiver<Done>,
    result: Mutex<Option<Done>>,
}

impl Work {
    /// Waits for completion, up to `timeout` (`None`: the operation's own timeout bounds it).
    /// Returns the operation's error, or [`Error::Timeout`] if it did not finish in time; a
    /// later `wait` may still succeed after a timeout.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        let mut r = self.result.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(done) = r.as_ref() {
            return done.result.clone();
        }
        let got = match timeout {
            Some(t) => self.rx.recv_timeout(t).map_err(|e| match e {
                crossbeam::channel::RecvTimeoutError::Disconnected => Error::Io(format!(
                    "{}: the collectives worker thread stopped",
                    self.op
                )),
                crossbeam::channel::RecvTimeoutError::Timeout => Error::Timeout {
                    op: format!("Work::wait on {}", self.op),
                    rank: self.rank,
                    timeout: t,
                    detail: detail!(
                        "the operation has not finished: one of the group's ranks ",
                        Part::Ranks(self.ranks.clone()),
                        " has not taken part yet, or an earlier operation of the group still \
                         runs (a later wait may still succeed; the operation itself fails at \
                         the group's timeout naming the rank it waits for)"
                    ),
                },
            })?,
            None => self.rx.recv().unwrap_or_else(|_| {
                Done::now(
                    Err(Error::Io("the collectives worker thread stopped".into())),
                    None,
                )
            }),
        };
        let res = got.result.clone();
        *r = Some(got);
        res
    }

    /// When the finished operation started running (after the group's earlier operations) and
    /// when it finished, as [`Instant`]s; `None` while it has not finished, or when it never
    /// started (it timed out waiting for its turn). Data parallelism measures from these how
    /// much of its communication the backward pass hid.
    pub fn timing(&self) -> Option<(Instant, Instant)> {
        if !self.is_completed() {
            return None;
        }
        let r = self.result.lock().unwrap_or_else(|e| e.into_inner());
        r.as_ref().and_then(|d| d.started.map(|s| (s, d.finished)))
    }

    /// Whether the operation has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        let mut r = self.result.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_some() {
            return true;
        }
        if let Ok(v) = self.rx.try_recv() {
            *r = Some(v);
            return true;
        }
        false
    }
}

impl Work {
    /// A pending `Work` and the sender that completes it.
    pub(crate) fn pending(op: &str, rank: usize, ranks: &[usize]) -> (Sender<Done>, Work) {
        let (tx, rx) = bounded(1);
        (
            tx,
            Work {
                op: op.to_string(),
                rank: rank as i64,
                ranks: ranks.to_vec(),
                rx,
                result: Mutex::new(None),
            },
        )
    }
}
