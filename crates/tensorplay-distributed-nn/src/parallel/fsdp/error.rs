//! The errors of fully sharded data parallelism, in its own terms (rank, group, phase).

use tensorplay_collectives::Error as DistError;

/// A collective of a `fully_shard` group failed (a rank died, timed out, or did something
/// else). It reaches callers as [`tensorplay::Error::External`](tensorplay_core::Error::External);
/// get it back with `err.downcast_ref::<FsdpError>()`. The collective's own error, which
/// names the rank it waited for or lost, is the source.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum FsdpError {
    /// An all-gather or reduce-scatter of a group failed.
    #[error("fully_shard on rank {rank}: group {group}: {phase} failed: {source}")]
    Collective {
        /// This rank (global).
        rank: usize,
        /// The group: the module's path under the root (`"h.0"`, `"the root"`) once the root
        /// is sharded, else the call's number, with its first parameter's name.
        group: String,
        /// What it was doing: `"the all-gather before forward or backward"` or `"the
        /// reduce-scatter of the gradients"`.
        phase: &'static str,
        /// The collective's error.
        source: DistError,
    },
}
