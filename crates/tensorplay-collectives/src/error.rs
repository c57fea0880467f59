//! The error type of `tensorplay-collectives`.

use std::time::Duration;

/// " on rank N", or nothing when the rank is not known yet (-1): messages never say
/// "rank -1".
fn on_rank(rank: i64) -> String {
    if rank < 0 {
        String::new()
    } else {
        format!(" on rank {rank}")
    }
}

/// Every fallible operation of this crate returns this error. Variants name the rank(s),
/// the argument and what was expected.
#[derive(Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor-level error from the core.
    #[error(transparent)]
    Core(#[from] tensorplay_core::Error),
    /// A blocking call did not complete within its timeout.
    #[error("{op} timed out after {timeout:?}{}: {detail}", on_rank(*rank))]
    Timeout {
        /// The operation.
        op: String,
        /// This process's rank (global), or -1 when not known yet.
        rank: i64,
        /// The timeout that expired.
        timeout: Duration,
        /// What it was waiting for (for example "rank 2 never joined").
        detail: String,
    },
    /// A store operation failed (connection refused, protocol error, server gone).
    #[error("store: {0}")]
    Store(String),
    /// A peer closed its connection or could not be reached: usually a rank that died.
    #[error("rank {rank}: connection to rank {peer} failed during {op}: {detail}")]
    PeerFailed {
        /// This rank.
        rank: usize,
        /// The peer's rank.
        peer: usize,
        /// The operation.
        op: String,
        /// The I/O error or protocol message.
        detail: String,
    },
    /// The ranks of a group called a collective with arguments that disagree (shapes, dtypes,
    /// counts, split sizes, ops, roots).
    #[error("{op}: ranks disagree: {detail}")]
    Mismatch {
        /// The collective.
        op: String,
        /// Which ranks passed which values.
        detail: String,
    },
    /// An argument had an invalid value on this rank.
    #[error("{op}{}: invalid argument `{arg}`: expected {expected}, got {got}", on_rank(*rank))]
    InvalidArgument {
        /// The operation.
        op: String,
        /// This rank (global).
        rank: i64,
        /// The argument's name.
        arg: String,
        /// What was expected.
        expected: String,
        /// What was received.
        got: String,
    },
    /// No default process group: `init_process_group` was not called (or was destroyed).
    #[error("{op}: the default process group is not initialized; call init_process_group first")]
    NotInitialized {
        /// The operation attempted.
        op: String,
    },
    /// A backend cannot be used here (unknown name, missing library, wrong device).
    #[error("backend {backend}: {detail}")]
    Backend {
        /// The backend name.
        backend: String,
        /// What is wrong and what to do.
        detail: String,
    },
    /// `spawn` failed: a child process failed, or could not be started.
    #[error("spawn: rank {rank} {reason}\n--- output of rank {rank} ---\n{output}")]
    Spawn {
        /// The rank that failed first.
        rank: usize,
        /// How it failed (exit code, signal, error message).
        reason: String,
        /// Its captured output (stdout and stderr), possibly truncated.
        output: String,
    },
    /// An I/O error outside a peer connection.
    #[error("io: {0}")]
    Io(String),
}

/// Collectives errors travel through code written against the core's `Result` (custom
/// autograd functions, modules, the facade) as
/// [`tp::Error::External`](tensorplay_core::Error::External); core errors are unwrapped back to
/// themselves.
impl From<Error> for tensorplay_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Core(c) => c,
            other => tensorplay_core::Error::external(other),
        }
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`Error::InvalidArgument`].
    pub fn invalid(
        op: impl Into<String>,
        rank: i64,
        arg: impl Into<String>,
        expected: impl Into<String>,
        got: impl std::fmt::Display,
    ) -> Self {
        Error::InvalidArgument {
            op: op.into(),
            rank,
            arg: arg.into(),
            expected: expected.into(),
            got: got.to_string(),
        }
    }
}

impl Error {
    /// This error with `note` appended to the detail of a [`Error::Timeout`] or an
    /// [`Error::PeerFailed`] (what a failure report or a flight-recorder dump adds); other
    /// errors unchanged.
    pub(crate) fn with_note(self, note: &str) -> Self {
        match self {
            Error::Timeout {
                op,
                rank,
                timeout,
                detail,
            } => Error::Timeout {
                op,
                rank,
                timeout,
                detail: detail + note,
            },
            Error::PeerFailed {
                rank,
                peer,
                op,
                detail,
            } => Error::PeerFailed {
                rank,
                peer,
                op,
                detail: detail + note,
            },
            other => other,
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}

/// The `Display` message, then its sources (as for every error of the stack): `fn main() ->
/// Result<(), Error>` prints what went wrong, not a dump of fields; match on the variants to
/// get at the fields.
impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        tensorplay_core::fmt_error_chain(self, f)
    }
}
