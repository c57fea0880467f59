//! What every rank of a pipeline group says about a step, through the group's store: a
//! failure (so that the others stop instead of waiting for the failed rank's messages), the
//! step's mode at its start (training or evaluation), and its end. A step returns `Ok` on a
//! rank only when every rank of the group ended it without failing, in the same mode — so
//! the ranks never disagree on whether a step happened.
//!
//! The store, not a collective: a collective of the `"cpu"` backend waits behind every
//! point-to-point transfer in flight on the group, and after a failure a receive may stay
//! pending until the group's timeout. Per step and rank it costs four store round trips
//! (begin: one; end: three), measured in docs/benchmarks.md.

use std::time::{Duration, Instant};

use tensorplay_collectives::ProcessGroup;
use tensorplay_core::Result;

use super::error::PipelineError;

/// How often a rank waiting for the others looks for a failure.
pub(crate) const POLL: Duration = Duration::from_millis(50);

/// A step's mode; the ranks must agree on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `step` (forward and backward).
    Train,
    /// `eval` (forward only).
    Eval,
}

impl Mode {
    /// What this mode adds to the step's mode counter: training ranks count in the low 32
    /// bits, evaluating ranks in the high ones.
    fn unit(self) -> i64 {
        match self {
            Mode::Train => 1,
            Mode::Eval => 1 << 32,
        }
    }
}

/// The step's modes counted so far: (training ranks, evaluating ranks).
fn modes(counter: i64) -> (i64, i64) {
    (counter & 0xffff_ffff, counter >> 32)
}

fn key(what: &str, step: u64) -> String {
    format!("pipelining/{what}/{step}")
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

/// Tells the other ranks of `group` that stage `stage` on rank `rank` failed in step `step`,
/// unless a failure was posted first (the first one is the cause). False when the store did
/// not answer (best effort: a rank that cannot reach it still returns its error).
pub(crate) fn post_failure(
    group: &ProcessGroup,
    step: u64,
    stage: usize,
    rank: usize,
    message: &str,
) -> bool {
    let msg = format!("{stage}|{rank}|{message}");
    group
        .store()
        .compare_set(&key("failed", step), b"", msg.as_bytes())
        .is_ok()
}

/// The failure posted for `step`, if any (none when the store does not answer).
pub(crate) fn posted_failure(group: &ProcessGroup, step: u64) -> Option<Failure> {
    let store = group.store();
    let key = key("failed", step);
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

/// At the start of `step`: counts this rank's mode (best effort: a store that does not answer
/// fails the step at its end).
pub(crate) fn begin(group: &ProcessGroup, step: u64, mode: Mode) {
    let _ = group.store().add(&key("mode", step), mode.unit());
}

/// A mode mismatch as an error of this rank.
fn mismatch(group: &ProcessGroup, step: u64, counter: i64) -> PipelineError {
    let (train, eval) = modes(counter);
    PipelineError::Mismatch {
        rank: group.my_global_rank(),
        detail: format!(
            "in step {step}, {train} rank(s) of the pipeline group called step and {eval} \
             called eval: every rank must call the same"
        ),
    }
}

/// Whether some ranks called `step` and others `eval` for `step` (those that have begun it):
/// the error, posted as a failure so that every waiting rank stops. None when the store does
/// not answer.
pub(crate) fn mixed_modes(group: &ProcessGroup, step: u64, stage: usize) -> Option<PipelineError> {
    let counter = group.store().add(&key("mode", step), 0).ok()?;
    let (train, eval) = modes(counter);
    if train == 0 || eval == 0 {
        return None;
    }
    let e = mismatch(group, step, counter);
    post_failure(group, step, stage, group.my_global_rank(), &e.to_string());
    Some(e)
}

/// At the end of `step`, after this rank's actions succeeded on stage `stage`: waits until
/// every rank of the group ended the step too, and returns `Ok` only if they all did, in
/// the same mode.
///
/// # Errors
/// [`PipelineError::PeerFailed`] naming the first rank that failed in this step;
/// [`PipelineError::Mismatch`] when some ranks called `step` and others `eval` (posted as a
/// failure, so that a rank waiting for a message that will not come stops too); a store that
/// does not answer, or ranks that do not end the step within the group's timeout.
pub(crate) fn finish(group: &ProcessGroup, step: u64, mode: Mode, stage: usize) -> Result<()> {
    let store = group.store();
    let me = group.my_global_rank();
    let p = group.size() as i64;
    let lost_store = |e: tensorplay_collectives::Error| -> tensorplay_core::Error {
        PipelineError::Action {
            stage,
            rank: me,
            microbatch: 0,
            action: "end of step".into(),
            message: format!(
                "the group's store (served by its first rank) did not answer at the end of \
                 step {step}: {e}"
            ),
            source: None,
        }
        .into()
    };
    let arrived = store.add(&key("done", step), 1).map_err(lost_store)?;
    let all = key("all", step);
    if arrived == p {
        // the last to arrive; every rank has read step - 1's keys
        store.set(&all, b"").map_err(lost_store)?;
        if let Some(prev) = step.checked_sub(1) {
            for what in ["mode", "done", "all"] {
                let _ = store.delete_key(&key(what, prev));
            }
        }
    }
    let deadline = Instant::now() + group.timeout();
    loop {
        match store.wait(&[all.as_str()], POLL) {
            Ok(()) => break,
            Err(tensorplay_collectives::Error::Timeout { .. }) => {}
            Err(e) => return Err(lost_store(e)),
        }
        if let Some(f) = posted_failure(group, step) {
            return Err(f.seen_by(stage, me, "end of step".into()).into());
        }
        if let Some(e) = mixed_modes(group, step, stage) {
            return Err(e.into());
        }
        if Instant::now() >= deadline {
            let n = store.add(&key("done", step), 0).unwrap_or(arrived);
            return Err(PipelineError::Action {
                stage,
                rank: me,
                microbatch: 0,
                action: "end of step".into(),
                message: format!(
                    "{n} of the group's {p} ranks ended step {step} within the group's \
                     timeout ({:?}); the others neither ended it nor reported a failure",
                    group.timeout()
                ),
                source: None,
            }
            .into());
        }
    }
    let counter = store.add(&key("mode", step), 0).map_err(lost_store)?;
    let (train, eval) = modes(counter);
    let ours = match mode {
        Mode::Train => eval,
        Mode::Eval => train,
    };
    if ours > 0 {
        return Err(mismatch(group, step, counter).into());
    }
    Ok(())
}
