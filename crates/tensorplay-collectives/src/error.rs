//! The error type of `tensorplay-collectives`.

use std::time::Duration;

use crate::{Detail, Part};

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
///
/// Ranks are typed fields in **global** numbering: `rank`, `peer`, and the ranks a
/// [`Detail`] names ([`Detail::ranks`]). A group's backend numbers its members `0..size`;
/// the group maps every rank field through its member list before the error reaches the
/// caller, and the message is generated from the fields, so it names global ranks too.
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
        /// What it was waiting for (for example "rank 2 never joined"); the ranks it names
        /// are in [`Detail::ranks`].
        detail: Detail,
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
        detail: Detail,
    },
    /// The ranks of a group called a collective with arguments that disagree (shapes, dtypes,
    /// counts, split sizes, ops, roots).
    #[error("{op}: ranks disagree: {detail}")]
    Mismatch {
        /// The collective.
        op: String,
        /// Which ranks passed which values (the ranks in [`Detail::ranks`]).
        detail: Detail,
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
        detail: Detail,
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
                detail: detail.join(note),
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
                detail: detail.join(note),
            },
            other => other,
        }
    }

    /// This error with every rank field (`rank`, `peer`, the ranks of a [`Detail`]) replaced
    /// by `f(rank)`; a rank not known yet (-1) stays -1. A group uses it to turn its
    /// backend's group ranks into global ranks.
    pub fn map_ranks(self, f: impl Fn(usize) -> usize) -> Self {
        let f = &f;
        let rank_i64 = |r: i64| usize::try_from(r).map_or(r, |r| f(r) as i64);
        match self {
            Error::Timeout {
                op,
                rank,
                timeout,
                detail,
            } => Error::Timeout {
                op,
                rank: rank_i64(rank),
                timeout,
                detail: detail.map_ranks(f),
            },
            Error::PeerFailed {
                rank,
                peer,
                op,
                detail,
            } => Error::PeerFailed {
                rank: f(rank),
                peer: f(peer),
                op,
                detail: detail.map_ranks(f),
            },
            Error::Mismatch { op, detail } => Error::Mismatch {
                op,
                detail: detail.map_ranks(f),
            },
            Error::Backend { backend, detail } => Error::Backend {
                backend,
                detail: detail.map_ranks(f),
            },
            Error::InvalidArgument {
                op,
                rank,
                arg,
                expected,
                got,
            } => Error::InvalidArgument {
                op,
                rank: rank_i64(rank),
                arg,
                expected,
                got,
            },
            // spawn's ranks are the job's (global) ranks: no group numbers them
            other @ (Error::Spawn { .. }
            | Error::Core(_)
            | Error::Store(_)
            | Error::NotInitialized { .. }
            | Error::Io(_)) => other,
        }
    }
}

impl Error {
    /// The message (what `Display` shows) as a [`Detail`] whose ranks are typed: how one
    /// error's text is quoted inside another's (a backend quoting the error that shut its
    /// group down) and still renumbered with it.
    pub fn message(&self) -> Detail {
        let on_rank = |rank: i64| match usize::try_from(rank) {
            Ok(r) => crate::detail!(" on rank ", Part::Rank(r)),
            Err(_) => Detail::default(),
        };
        match self {
            Error::Timeout {
                op,
                rank,
                timeout,
                detail,
            } => crate::detail!(format!("{op} timed out after {timeout:?}"))
                .join(on_rank(*rank))
                .join(": ")
                .join(detail.clone()),
            Error::PeerFailed {
                rank,
                peer,
                op,
                detail,
            } => crate::detail!(
                "rank ",
                Part::Rank(*rank),
                ": connection to rank ",
                Part::Rank(*peer),
                format!(" failed during {op}: ")
            )
            .join(detail.clone()),
            Error::Mismatch { op, detail } => {
                Detail::from(format!("{op}: ranks disagree: ")).join(detail.clone())
            }
            Error::InvalidArgument {
                op,
                rank,
                arg,
                expected,
                got,
            } => Detail::from(op.as_str()).join(on_rank(*rank)).join(format!(
                ": invalid argument `{arg}`: expected {expected}, got {got}"
            )),
            Error::Backend { backend, detail } => {
                Detail::from(format!("backend {backend}: ")).join(detail.clone())
            }
            Error::Spawn {
                rank,
                reason,
                output,
            } => crate::detail!(
                "spawn: rank ",
                Part::Rank(*rank),
                format!(" {reason}\n--- output of rank "),
                Part::Rank(*rank),
                format!(" ---\n{output}")
            ),
            other @ (Error::Core(_)
            | Error::Store(_)
            | Error::NotInitialized { .. }
            | Error::Io(_)) => Detail::from(other.to_string()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detail;

    /// `message()` shows what `Display` shows, for every variant that names ranks.
    #[test]
    fn the_message_with_typed_ranks_is_the_display_text() {
        let d = || detail!("rank ", Part::Rank(2), " never reached this call");
        let cases = [
            Error::Timeout {
                op: "all_reduce".into(),
                rank: 1,
                timeout: Duration::from_secs(3),
                detail: d(),
            },
            Error::Timeout {
                op: "store get".into(),
                rank: -1,
                timeout: Duration::from_millis(1500),
                detail: "key k".into(),
            },
            Error::PeerFailed {
                rank: 0,
                peer: 2,
                op: "barrier".into(),
                detail: d(),
            },
            Error::Mismatch {
                op: "broadcast".into(),
                detail: d(),
            },
            Error::invalid("send", 3, "dst", "a rank other than this one", 3),
            Error::invalid("rendezvous", -1, "RANK", "a rank", "\"-1\""),
            Error::Backend {
                backend: "cpu".into(),
                detail: d(),
            },
            Error::Spawn {
                rank: 1,
                reason: "failed (exit code 1)".into(),
                output: "boom".into(),
            },
            Error::Store("gone".into()),
            Error::NotInitialized {
                op: "barrier".into(),
            },
            Error::Io("closed".into()),
        ];
        for e in cases {
            assert_eq!(e.message().to_string(), e.to_string(), "{e:?}");
        }
        let e = Error::Timeout {
            op: "all_reduce".into(),
            rank: 1,
            timeout: Duration::from_secs(3),
            detail: d(),
        };
        assert_eq!(e.message().ranks(), [1, 2]);
        assert_eq!(
            e.message().map_ranks(&|r| r + 4).to_string(),
            "all_reduce timed out after 3s on rank 5: rank 6 never reached this call"
        );
    }
}
