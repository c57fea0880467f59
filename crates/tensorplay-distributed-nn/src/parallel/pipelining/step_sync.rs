//! What the ranks of a pipeline group tell each other about a step, through the group's
//! store, so that they never disagree on whether it happened:
//!
//! - **begin** (a barrier before any message): each rank says it began, in which mode
//!   (`step` or `eval`) and whether its arguments were good. The last to arrive writes the
//!   verdict; a bad argument or mixed modes fail the step on every rank before a message is
//!   sent, so the next step runs clean.
//! - **failure**: a rank whose action fails posts it; ranks waiting for a message look there
//!   and stop instead of waiting.
//! - **finish**: each rank says it ended the step; a step returns `Ok` on a rank only once
//!   every rank of the group ended it without failing.
//!
//! Each verdict (`ready` at the start, `end` at the end) is written once, by compare-and-set:
//! by the last rank to arrive ("ok", ...) or by a rank whose wait ran past the group's timeout
//! ("late|ranks seen"); whichever is first stands and every rank returns it, so a rank that
//! arrives after the others gave up on it fails too.
//!
//! The store, not a collective: a collective of the `"cpu"` backend waits behind every
//! point-to-point transfer in flight on the group, and after a failure a receive may stay
//! pending until the group's timeout. Keys are per schedule (schedules are numbered in the
//! order a process builds them) and step; the last rank to end a step deletes the previous
//! step's. Ranks are bits of a counter, so a pipeline group has at most [`MAX_RANKS`] ranks.

use std::time::{Duration, Instant};

use tensorplay_collectives::ProcessGroup;
use tensorplay_core::Result;

use super::error::PipelineError;

/// How often a rank waiting for the others looks for a failure.
pub(crate) const POLL: Duration = Duration::from_millis(50);

/// The largest pipeline group (each rank is one bit of an `i64` counter).
pub(crate) const MAX_RANKS: usize = 62;

/// A step's mode; the ranks must agree on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `step` (forward and backward).
    Train,
    /// `eval` (forward only).
    Eval,
}

/// A failure posted for a step: the failed stage, its rank, its error.
pub(crate) struct Failure {
    pub(crate) stage: usize,
    pub(crate) rank: usize,
    pub(crate) message: String,
}

impl Failure {
    /// As seen by stage `stage` on rank `rank`, stopped at `action`.
    pub(crate) fn seen_by(self, stage: usize, rank: usize, action: String) -> PipelineError {
        PipelineError::PeerFailed {
            stage,
            rank,
            action,
            failed_stage: self.stage,
            failed_rank: self.rank,
            message: self.message,
        }
    }
}

/// A step refused at its start: the error, and whether it is clean (refused before any rank
/// sent a message: the next step runs as if this one had not been called).
pub(crate) struct Refused {
    pub(crate) error: tensorplay_core::Error,
    pub(crate) clean: bool,
}

/// The store's keys of one step of one schedule on one pipeline group.
#[derive(Clone)]
pub(crate) struct StepSync {
    group: ProcessGroup,
    schedule: u64,
    step: u64,
}

impl StepSync {
    /// Step `step` of the process's `schedule`-th schedule, on `group`.
    pub(crate) fn new(group: ProcessGroup, schedule: u64, step: u64) -> StepSync {
        StepSync {
            group,
            schedule,
            step,
        }
    }

    /// The pipeline group.
    pub(crate) fn group(&self) -> &ProcessGroup {
        &self.group
    }

    fn key(&self, what: &str, step: u64) -> String {
        format!("pipelining/{}/{what}/{step}", self.schedule)
    }

    fn me(&self) -> usize {
        self.group.my_global_rank()
    }

    /// All ranks' bits.
    fn full(&self) -> i64 {
        (1i64 << self.group.size()) - 1
    }

    /// This rank's bit.
    fn bit(&self) -> i64 {
        1i64 << self.group.rank().unwrap_or(0)
    }

    /// The group ranks whose bit is missing from `seen`, as (stage, global rank).
    fn missing(&self, seen: i64) -> Vec<(usize, usize)> {
        (0..self.group.size())
            .filter(|r| seen & (1 << r) == 0)
            .map(|r| (r, self.group.ranks()[r]))
            .collect()
    }

    fn lost_store(
        &self,
        stage: usize,
        at: &str,
        e: tensorplay_collectives::Error,
    ) -> tensorplay_core::Error {
        PipelineError::Action {
            stage,
            rank: self.me(),
            microbatch: 0,
            action: at.into(),
            message: format!(
                "the group's store (served by its first rank) did not answer at the {at} {}: \
                 {e}",
                self.step
            ),
            source: None,
        }
        .into()
    }

    /// Tells the other ranks that stage `stage` on rank `rank` failed in this step, unless a
    /// failure was posted first (the first one is the cause). False when the store did not
    /// answer (best effort: a rank that cannot reach it still returns its error).
    pub(crate) fn post_failure(&self, stage: usize, rank: usize, message: &str) -> bool {
        let msg = format!("{stage}|{rank}|{message}");
        self.group
            .store()
            .compare_set(&self.key("failed", self.step), b"", msg.as_bytes())
            .is_ok()
    }

    /// The failure posted for this step, if any (none when the store does not answer).
    pub(crate) fn posted_failure(&self) -> Option<Failure> {
        let store = self.group.store();
        let key = self.key("failed", self.step);
        if !store.check(&[key.as_str()]).ok()? {
            return None;
        }
        let v = String::from_utf8_lossy(&store.get(&key).ok()?).into_owned();
        let mut it = v.splitn(3, '|');
        Some(Failure {
            stage: it.next()?.parse().ok()?,
            rank: it.next()?.parse().ok()?,
            message: it.next().unwrap_or("").to_string(),
        })
    }

    /// Waits for `key` until the group's timeout; `Ok(false)` on the timeout. With `failures`,
    /// a failure posted meanwhile ends the wait as an error.
    fn wait_for(&self, key: &str, stage: usize, at: &str, failures: bool) -> Result<bool> {
        let store = self.group.store();
        let deadline = Instant::now() + self.group.timeout();
        loop {
            match store.wait(&[key], POLL) {
                Ok(()) => return Ok(true),
                Err(tensorplay_collectives::Error::Timeout { .. }) => {}
                Err(e) => return Err(self.lost_store(stage, at, e)),
            }
            if failures && let Some(f) = self.posted_failure() {
                return Err(f.seen_by(stage, self.me(), at.into()).into());
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
        }
    }

    /// The error of ranks that did not reach `at` within the group's timeout: the first
    /// missing one named as the failed stage.
    fn late(&self, stage: usize, at: &str, seen: i64) -> tensorplay_core::Error {
        let missing = self.missing(seen);
        let (s, r) = missing.first().copied().unwrap_or((0, 0));
        PipelineError::PeerFailed {
            stage,
            rank: self.me(),
            action: at.into(),
            failed_stage: s,
            failed_rank: r,
            message: format!(
                "did not reach the {at} {} within the group's timeout ({:?}): lost or stuck \
                 (ranks not there: {:?})",
                self.step,
                self.group.timeout(),
                missing.iter().map(|m| m.1).collect::<Vec<_>>()
            ),
        }
        .into()
    }

    /// The barrier at the start of a step, before any message: this rank began in `mode`,
    /// with `args` (its own argument check; on an error it is posted and returned at once).
    /// Returns `args` when every rank began the same way with good arguments.
    ///
    /// # Errors (clean unless said)
    /// This rank's argument error; another rank's ([`PipelineError::PeerFailed`]); ranks in
    /// different modes ([`PipelineError::Mismatch`] on every rank); not clean: ranks that do
    /// not begin within the group's timeout (named), a store that does not answer.
    pub(crate) fn begin<T>(
        &self,
        mode: Mode,
        stage: usize,
        args: Result<T>,
    ) -> std::result::Result<T, Refused> {
        let clean = |error| Refused { error, clean: true };
        let broken = |error| Refused {
            error,
            clean: false,
        };
        let store = self.group.store();
        let at = "start of step";
        if let Err(e) = &args {
            self.post_failure(stage, self.me(), &e.to_string());
        }
        if mode == Mode::Eval {
            store
                .add(&self.key("evals", self.step), 1)
                .map_err(|e| broken(self.lost_store(stage, at, e)))?;
        }
        let seen = store
            .add(&self.key("began", self.step), self.bit())
            .map_err(|e| broken(self.lost_store(stage, at, e)))?;
        let ready = self.key("ready", self.step);
        if seen == self.full() {
            // the last to begin: the verdict, for everyone
            let evals = store.add(&self.key("evals", self.step), 0).unwrap_or(0);
            let failed = store
                .check(&[self.key("failed", self.step).as_str()])
                .unwrap_or(false);
            let verdict = if failed {
                "failed".to_string()
            } else if evals > 0 && evals < self.group.size() as i64 {
                format!("mixed|{evals}")
            } else {
                "ok".to_string()
            };
            // unless the others already gave up on a late rank (then their verdict stands)
            store
                .compare_set(&ready, b"", verdict.as_bytes())
                .map_err(|e| broken(self.lost_store(stage, at, e)))?;
        }
        // this rank's own argument error: posted, nothing sent
        let args = args.map_err(clean)?;
        let verdict = if self.wait_for(&ready, stage, at, false).map_err(broken)? {
            store.get(&ready)
        } else {
            // past the timeout: ranks are late, unless the verdict was written meanwhile
            let seen = store.add(&self.key("began", self.step), 0).unwrap_or(seen);
            store.compare_set(&ready, b"", format!("late|{seen}").as_bytes())
        };
        let verdict = verdict.map_err(|e| broken(self.lost_store(stage, at, e)))?;
        let verdict = String::from_utf8_lossy(&verdict).into_owned();
        if let Some(seen) = verdict.strip_prefix("late|") {
            let seen = seen.parse().unwrap_or(0);
            return Err(broken(self.late(stage, at, seen)));
        }
        if verdict == "failed" {
            let f = self.posted_failure().ok_or_else(|| {
                broken(self.lost_store(
                    stage,
                    at,
                    tensorplay_collectives::Error::Backend {
                        backend: "store".into(),
                        detail: "the posted failure could not be read".into(),
                    },
                ))
            })?;
            return Err(clean(f.seen_by(stage, self.me(), at.into()).into()));
        }
        if let Some(evals) = verdict.strip_prefix("mixed|") {
            let p = self.group.size();
            let evals: usize = evals.parse().unwrap_or(0);
            return Err(clean(
                PipelineError::Mismatch {
                    rank: self.me(),
                    detail: format!(
                        "in step {}, {} rank(s) of the pipeline group called step and {evals} \
                         called eval: every rank must call the same",
                        self.step,
                        p - evals
                    ),
                }
                .into(),
            ));
        }
        Ok(args)
    }

    /// At the end of a step whose actions succeeded here (on stage `stage`): waits until
    /// every rank of the group ended it, and returns `Ok` only then.
    ///
    /// # Errors
    /// [`PipelineError::PeerFailed`] naming the first rank that failed in this step, or the
    /// first that did not end it within the group's timeout; a store that does not answer.
    pub(crate) fn finish(&self, stage: usize) -> Result<()> {
        let store = self.group.store();
        let at = "end of step";
        let lost = |e| self.lost_store(stage, at, e);
        let seen = store
            .add(&self.key("done", self.step), self.bit())
            .map_err(lost)?;
        let end = self.key("end", self.step);
        if seen == self.full() {
            // unless the others already gave up on this (late) rank: their verdict stands
            store.compare_set(&end, b"", b"ok").map_err(lost)?;
            // every rank has begun this step, so none reads the previous one's keys
            if let Some(prev) = self.step.checked_sub(1) {
                for what in ["began", "evals", "ready", "failed", "done", "end"] {
                    let _ = store.delete_key(&self.key(what, prev));
                }
            }
        }
        let verdict = if self.wait_for(&end, stage, at, true)? {
            store.get(&end)
        } else {
            // past the timeout: ranks are late, unless the last one ended the step meanwhile
            let seen = store.add(&self.key("done", self.step), 0).unwrap_or(seen);
            store.compare_set(&end, b"", format!("late|{seen}").as_bytes())
        };
        let verdict = String::from_utf8_lossy(&verdict.map_err(lost)?).into_owned();
        match verdict.strip_prefix("late|") {
            Some(seen) => Err(self.late(stage, at, seen.parse().unwrap_or(0))),
            None => Ok(()),
        }
    }
}
