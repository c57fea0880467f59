//! Schedules as data: each schedule is, per rank, a list of [`Action`]s computed from the
//! pipeline's shape (ranks, stages per rank, micro-batches) by a pure function, checked by the
//! simulator ([`super::sim`]) and only then run by the executor.
//!
//! Stage `s` of `p * v` runs on rank `s % p` (rank `r` holds stages `r`, `r + p`, ...: the
//! looped placement of interleaved schedules; one stage per rank when `v = 1`).

mod action;
mod generate;
#[cfg(test)]
mod tests;

pub use action::{Action, ActionKind, ParseActionError, from_csv, to_csv};

use std::fmt;

/// The shape of a pipeline: `ranks` (`p`, the pipeline group's size), `stages_per_rank` (`v`,
/// virtual stages; 1 for GPipe and 1F1B) and `microbatches` (`m`, the batch's split).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PipelineShape {
    /// Ranks of the pipeline group (`p`).
    pub ranks: usize,
    /// Stages per rank (`v`).
    pub stages_per_rank: usize,
    /// Micro-batches per step (`m`).
    pub microbatches: usize,
}

impl PipelineShape {
    /// All stages: `p * v`.
    pub fn stages(&self) -> usize {
        self.ranks * self.stages_per_rank
    }

    /// The rank that runs stage `stage`: `stage % p`.
    pub fn rank_of(&self, stage: usize) -> usize {
        stage % self.ranks
    }

    /// The stages rank `rank` runs, in order: `rank, rank + p, ...`.
    pub fn stages_of(&self, rank: usize) -> Vec<usize> {
        (0..self.stages_per_rank)
            .map(|i| rank + i * self.ranks)
            .collect()
    }
}

/// The most (stage, micro-batch) pairs a schedule or the simulator takes per step.
pub const MAX_ACTIONS: usize = 1 << 22;

/// The schedules (PyTorch's classes of the same names build them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// Every forward, then every backward (`ScheduleGPipe`); one stage per rank; up to `m`
    /// micro-batches' activations held.
    GPipe,
    /// One forward, one backward (`Schedule1F1B`, PipeDream-flush); one stage per rank; at
    /// most `p - r` micro-batches in flight on rank `r`.
    OneFOneB,
    /// Megatron's interleaved 1F1B (`ScheduleInterleaved1F1B`): `v` stages per rank, the
    /// bubble divided by about `v`.
    Interleaved1F1B,
    /// Interleaved 1F1B with each backward split into input-gradient (`I`) and weight-gradient
    /// (`W`) actions, the `W`s moved into the bubbles (`ScheduleInterleavedZeroBubble`).
    InterleavedZeroBubble,
}

impl ScheduleKind {
    /// PyTorch's class name.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "ScheduleGPipe",
            ScheduleKind::OneFOneB => "Schedule1F1B",
            ScheduleKind::Interleaved1F1B => "ScheduleInterleaved1F1B",
            ScheduleKind::InterleavedZeroBubble => "ScheduleInterleavedZeroBubble",
        }
    }

    /// True for the schedules with several stages per rank.
    pub fn is_multi_stage(self) -> bool {
        matches!(
            self,
            ScheduleKind::Interleaved1F1B | ScheduleKind::InterleavedZeroBubble
        )
    }

    /// Checks that this schedule runs on `shape`: every size at least 1; one stage per rank
    /// for GPipe and 1F1B; at least as many micro-batches as ranks, and for the interleaved
    /// schedules a multiple of them (Megatron's groups of `p` micro-batches).
    ///
    /// # Errors
    /// [`ScheduleError::Shape`] naming the argument.
    pub fn check(self, shape: &PipelineShape) -> Result<(), ScheduleError> {
        let bad = |arg: &'static str, expected: String, got: usize| {
            Err(ScheduleError::Shape {
                schedule: self.name(),
                arg,
                expected,
                got,
            })
        };
        if shape.ranks == 0 {
            return bad("num_stages (ranks)", "at least 1".into(), 0);
        }
        // a step's actions are held in memory: at most MAX_ACTIONS compute actions
        let actions = shape
            .ranks
            .checked_mul(shape.stages_per_rank)
            .and_then(|s| s.checked_mul(shape.microbatches));
        if actions.is_none_or(|a| a > MAX_ACTIONS) {
            return bad(
                "n_microbatches x stages",
                format!("at most {MAX_ACTIONS} (stage, micro-batch) pairs per step"),
                shape.microbatches,
            );
        }
        if shape.stages_per_rank == 0 {
            return bad("stages per rank", "at least 1".into(), 0);
        }
        if !self.is_multi_stage() && shape.stages_per_rank != 1 {
            return bad(
                "stages per rank",
                "1 (use ScheduleInterleaved1F1B for several)".into(),
                shape.stages_per_rank,
            );
        }
        if shape.microbatches < shape.ranks {
            return bad(
                "n_microbatches",
                format!("at least the pipeline's {} ranks", shape.ranks),
                shape.microbatches,
            );
        }
        if self.is_multi_stage() && !shape.microbatches.is_multiple_of(shape.ranks) {
            return bad(
                "n_microbatches",
                format!("a multiple of the pipeline's {} ranks", shape.ranks),
                shape.microbatches,
            );
        }
        Ok(())
    }

    /// Every rank's action list for `shape`, sends and receives included (`lists[r]` is
    /// rank `r`'s).
    ///
    /// # Errors
    /// As [`ScheduleKind::check`].
    pub fn actions(self, shape: &PipelineShape) -> Result<Vec<Vec<Action>>, ScheduleError> {
        self.check(shape)?;
        Ok(generate::add_comms(
            shape,
            generate::compute_lists(self, shape),
        ))
    }

    /// The schedule's bubble in theory, the idle fraction of a step with a forward one unit
    /// and a backward two: `(p - 1) / (m + p - 1)` for GPipe and 1F1B, `(p - 1) / (v m + p -
    /// 1)` for interleaved 1F1B. For zero bubble this is interleaved 1F1B's bound, which it
    /// stays below: its own bubble is what the simulator measures (`simulate(..).bubble`).
    pub fn theoretical_bubble(self, shape: &PipelineShape) -> f64 {
        let (p, v, m) = (
            shape.ranks as f64,
            shape.stages_per_rank as f64,
            shape.microbatches as f64,
        );
        match self {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB => (p - 1.0) / (m + p - 1.0),
            ScheduleKind::Interleaved1F1B | ScheduleKind::InterleavedZeroBubble => {
                (p - 1.0) / (v * m + p - 1.0)
            }
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a schedule cannot run: found by [`ScheduleKind::check`] or by the simulator
/// ([`super::sim::simulate`]) before any rank runs it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// The shape does not fit the schedule.
    #[error("{schedule}: {arg} must be {expected}, got {got}")]
    Shape {
        /// The schedule's name.
        schedule: &'static str,
        /// The argument.
        arg: &'static str,
        /// What it must be.
        expected: String,
        /// What it was.
        got: usize,
    },
    /// A list has the wrong number of ranks, or an action names a stage, micro-batch or rank
    /// that does not fit the shape.
    #[error("rank {rank}: action {index} ({action}): {detail}")]
    Misplaced {
        /// The rank whose list holds it.
        rank: usize,
        /// Its position in the list.
        index: usize,
        /// The action (text form).
        action: String,
        /// What is wrong.
        detail: String,
    },
    /// An action that must appear is missing, or appears twice.
    #[error("{detail}")]
    Incomplete {
        /// Which action, on which rank.
        detail: String,
    },
    /// An action comes before what it needs on its rank.
    #[error("rank {rank}: action {index} ({action}) runs before {needs}")]
    Dependency {
        /// The rank.
        rank: usize,
        /// Its position.
        index: usize,
        /// The action.
        action: String,
        /// What it needs and where that is.
        needs: String,
    },
    /// Messages between two ranks would arrive in another order than they are received.
    #[error(
        "rank {dst} receives {recv} as message {nth} from rank {src}, which sends {sent} as its \
         message {nth} to rank {dst} (messages between two ranks arrive in order)"
    )]
    Order {
        /// The sender.
        src: usize,
        /// The receiver.
        dst: usize,
        /// The message's number on that link (0-based).
        nth: usize,
        /// The receive (text form).
        recv: String,
        /// The send it would get.
        sent: String,
    },
    /// No rank can go on: each waits for a message that is never sent.
    #[error("the schedule deadlocks: {waits}")]
    Deadlock {
        /// Each blocked rank's action and what it waits for.
        waits: String,
    },
}

impl From<ScheduleError> for tensorplay_core::Error {
    fn from(e: ScheduleError) -> Self {
        tensorplay_core::Error::external(e)
    }
}
