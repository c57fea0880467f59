//! The error type of `tensorplay-rpc`.

use std::time::Duration;

/// Every fallible operation of this crate returns this error. Remote failures keep their kind
/// and message and name the worker they happened on; transport failures say which worker could
/// not be reached, so a dead worker is told apart from a slow one ([`Error::Timeout`]).
#[derive(Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The function (or RRef operation) failed on the worker that ran it.
    #[error("on worker {worker}: {kind}: {message}")]
    Remote {
        /// Name of the worker where it failed.
        worker: String,
        /// The error's kind: the variant of tensorplay's error (`InvalidArgument`, ...), or
        /// `UnknownFunction`, `Panic`, `RRef`, ...
        kind: String,
        /// The error's message.
        message: String,
    },
    /// A distributed backward pass failed; `worker` is where it happened (every participant
    /// of the pass returns this).
    #[error("Error on worker {worker}: {message}")]
    Autograd {
        /// Name of the worker where the pass failed.
        worker: String,
        /// What failed there.
        message: String,
    },
    /// The call did not complete within its timeout; the worker was still reachable.
    #[error("{op} to worker {worker} ran for more than its timeout ({timeout:?})")]
    Timeout {
        /// The operation: `rpc <function>` for `rpc_sync`/`rpc_async`, `remote`, `to_here`,
        /// `result of method <name>` for RRef proxies, `shutdown ...`.
        op: String,
        /// The worker called.
        worker: String,
        /// The timeout that expired.
        timeout: Duration,
    },
    /// The worker could not be reached or its connection was lost (it probably exited).
    #[error("worker {worker} is unreachable during {op}: {detail}")]
    WorkerUnreachable {
        /// The worker.
        worker: String,
        /// The operation.
        op: String,
        /// The transport's message.
        detail: String,
    },
    /// No worker of that name or rank.
    #[error("unknown worker {name}: the workers are {known}")]
    UnknownWorker {
        /// The name (or rank) asked for.
        name: String,
        /// The known workers.
        known: String,
    },
    /// RPC is not initialised in this process (`init_rpc` not called, or after `shutdown`).
    #[error("{op}: RPC is not initialized; call tensorplay::distributed::rpc::init_rpc first")]
    NotInitialized {
        /// The operation attempted.
        op: String,
    },
    /// A value could not be encoded or decoded (wrong argument or result types, malformed
    /// message).
    #[error("serialization: {0}")]
    Serialization(String),
    /// An argument was invalid.
    #[error("{op}: invalid argument `{arg}`: expected {expected}, got {got}")]
    InvalidArgument {
        /// The operation.
        op: String,
        /// The argument's name.
        arg: String,
        /// What was expected.
        expected: String,
        /// What was received.
        got: String,
    },
    /// A store, rendezvous or process-group error during `init_rpc`/`shutdown`.
    #[error(transparent)]
    Collectives(#[from] tensorplay_collectives::Error),
    /// A tensor-level error. Converting a core error gives this, except for an RPC error
    /// carried in [`tp::Error::External`](tensorplay_core::Error::External) (as
    /// [`RRef::to_here`](crate::RRef::to_here) returns it), which comes back as itself.
    #[error(transparent)]
    Core(tensorplay_core::Error),
    /// The transport failed locally (socket, TLS configuration).
    #[error("transport: {0}")]
    Transport(String),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`Error::InvalidArgument`].
    pub fn invalid(
        op: impl Into<String>,
        arg: impl Into<String>,
        expected: impl Into<String>,
        got: impl std::fmt::Display,
    ) -> Self {
        Error::InvalidArgument {
            op: op.into(),
            arg: arg.into(),
            expected: expected.into(),
            got: got.to_string(),
        }
    }

    /// The kind name sent to a caller when this error happens in a remote function.
    pub(crate) fn kind(&self) -> String {
        match self {
            Error::Remote { kind, .. } => kind.clone(),
            Error::Core(c) => core_kind(c),
            Error::Autograd { .. } => "Autograd".into(),
            Error::Timeout { .. } => "Timeout".into(),
            Error::WorkerUnreachable { .. } => "WorkerUnreachable".into(),
            Error::UnknownWorker { .. } => "UnknownWorker".into(),
            Error::NotInitialized { .. } => "NotInitialized".into(),
            Error::Serialization(_) => "Serialization".into(),
            Error::InvalidArgument { .. } => "InvalidArgument".into(),
            Error::Collectives(_) => "Collectives".into(),
            Error::Transport(_) => "Transport".into(),
        }
    }
}

/// The variant name of a core error (`InvalidArgument`, `ShapeMismatch`, ...).
pub(crate) fn core_kind(e: &tensorplay_core::Error) -> String {
    e.variant_name().to_string()
}

/// RPC errors travel through code written against the core's `Result` (remote functions,
/// modules, the facade) as [`tp::Error::External`](tensorplay_core::Error::External); core
/// errors are unwrapped back to themselves.
impl From<Error> for tensorplay_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Core(c) => c,
            other => tensorplay_core::Error::external(other),
        }
    }
}

/// A core error as an RPC error: an RPC error carried in
/// [`tp::Error::External`](tensorplay_core::Error::External) (by the conversion above, e.g. an
/// [`RRef::to_here`](crate::RRef::to_here) error) is unwrapped back to itself, so `?` round-trips
/// it (`Timeout` stays `Timeout`, not `Core(External(Timeout))`); every other core error is
/// [`Error::Core`].
impl From<tensorplay_core::Error> for Error {
    fn from(e: tensorplay_core::Error) -> Self {
        match e.downcast_ref::<Error>() {
            Some(rpc) => rpc.clone(),
            None => Error::Core(e),
        }
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
