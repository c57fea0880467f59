//! The errors of data parallelism, in its own terms (rank, step, bucket, parameter).

/// What went wrong in [`DistributedDataParallel`](super::DistributedDataParallel). It reaches
/// callers as [`tensorplay::Error::External`](tensorplay_core::Error::External); get it back
/// with `err.downcast_ref::<DdpError>()`.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum DdpError {
    /// The ranks' models differ (found at construction, on every rank alike).
    #[error(
        "DistributedDataParallel on rank {rank}: the ranks' models differ: {detail}; every rank \
         must wrap the same model (same parameter names, shapes and dtypes, in the same order)"
    )]
    ModelMismatch {
        /// This rank (global).
        rank: usize,
        /// The first difference, naming the ranks.
        detail: String,
    },
    /// This rank used DDP out of its protocol (for example two training forwards before one
    /// backward); the other ranks get [`DdpError::PeerMisuse`] naming it.
    #[error("DistributedDataParallel on rank {rank} (step {step}): {detail}")]
    Misuse {
        /// This rank (global).
        rank: usize,
        /// The training step (0 is the first forward).
        step: u64,
        /// What it did and what to do instead.
        detail: String,
    },
    /// Another rank used DDP out of its protocol, or the ranks are not at the same step; every
    /// rank stopped at the same point.
    #[error("DistributedDataParallel on rank {rank} (step {step}): {detail}")]
    PeerMisuse {
        /// This rank (global).
        rank: usize,
        /// This rank's training step.
        step: u64,
        /// Which rank did what.
        detail: String,
    },
    /// A gradient all-reduce (or the communication hook) failed: a rank died, timed out, or
    /// called a different collective.
    #[error("DistributedDataParallel on rank {rank} (step {step}): {what} failed: {error}")]
    Communication {
        /// This rank (global).
        rank: usize,
        /// The training step.
        step: u64,
        /// What was being communicated ("reducing gradient bucket 2 of 4", "exchanging the
        /// used-parameter flags", ...).
        what: String,
        /// The collective's error.
        error: tensorplay_core::Error,
    },
}

impl From<DdpError> for tensorplay_core::Error {
    fn from(e: DdpError) -> Self {
        tensorplay_core::Error::external(e)
    }
}
