//! The errors of pipeline parallelism, in its terms (stage, rank, micro-batch, action).

use std::sync::Arc;

/// A pipeline step failed. It reaches callers as
/// [`tensorplay::Error::External`](tensorplay_core::Error::External); get it back with
/// `err.downcast_ref::<PipelineError>()`.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// An action of this rank failed: a stage's forward or backward raised, the loss failed,
    /// or a send or receive failed (a lost or killed peer, a timeout).
    #[error(
        "pipeline stage {stage} (rank {rank}), micro-batch {microbatch}, action {action}: {message}"
    )]
    Action {
        /// The stage (global index).
        stage: usize,
        /// This rank (global).
        rank: usize,
        /// The micro-batch.
        microbatch: usize,
        /// The action (text form, `"1F3"`).
        action: String,
        /// What failed, with the underlying error.
        message: String,
        /// The underlying error.
        #[source]
        source: Option<Arc<tensorplay_core::Error>>,
    },
    /// Another stage failed during this step; this rank stopped instead of waiting for it.
    #[error(
        "pipeline stage {stage} (rank {rank}) stopped at action {action}: stage {failed_stage} \
         (rank {failed_rank}) failed: {message}"
    )]
    PeerFailed {
        /// This rank's stage at the action where it stopped.
        stage: usize,
        /// This rank.
        rank: usize,
        /// The action it was at.
        action: String,
        /// The stage that failed.
        failed_stage: usize,
        /// Its rank.
        failed_rank: usize,
        /// Its error.
        message: String,
    },
    /// The ranks of the pipeline group disagree on the schedule (its kind, the number of
    /// micro-batches or stages, or which stages a rank holds); found at the first step.
    #[error("pipeline schedule mismatch on rank {rank}: {detail}")]
    Mismatch {
        /// This rank.
        rank: usize,
        /// What differs and on which rank.
        detail: String,
    },
    /// A call that does not fit the schedule (the wrong `step` for the stage, a batch that
    /// does not split, an argument outside its range).
    #[error("{op} on rank {rank}: {arg} must be {expected}, got {got}")]
    Invalid {
        /// The call.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The argument.
        arg: String,
        /// What it must be.
        expected: String,
        /// What it was.
        got: String,
    },
}

impl From<PipelineError> for tensorplay_core::Error {
    fn from(e: PipelineError) -> Self {
        tensorplay_core::Error::external(e)
    }
}

/// An [`Error::InvalidArgument`](tensorplay_core::Error::InvalidArgument) of the core's kind
/// (a stage's or a loss function's misuse, not the pipeline's).
pub(crate) fn core_invalid(
    op: &'static str,
    arg: &'static str,
    expected: impl Into<String>,
    got: impl std::fmt::Display,
) -> tensorplay_core::Error {
    tensorplay_core::Error::InvalidArgument {
        op,
        arg,
        expected: expected.into(),
        got: got.to_string(),
    }
}
