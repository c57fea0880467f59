//! The error type of the core (tensors, autograd, `nn`, `optim`).

use crate::{DType, Device};

/// Every fallible operation of the core returns this error, and every layer's error converts
/// into it.
///
/// Variants are structured so that callers can match on them; the `Display` text names the
/// operation, the offending argument and what was expected.
#[derive(Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Two shapes that had to agree (or broadcast) did not.
    #[error("{op}: shape mismatch: {lhs:?} vs {rhs:?}")]
    ShapeMismatch {
        /// Operation name.
        op: &'static str,
        /// Left-hand (or expected) shape.
        lhs: Vec<usize>,
        /// Right-hand (or received) shape.
        rhs: Vec<usize>,
    },
    /// A dimension index was outside `-ndim..ndim`.
    #[error("{op}: dimension {dim} out of range for a tensor with {ndim} dimension(s)")]
    DimOutOfRange {
        /// Operation name.
        op: &'static str,
        /// The dimension given.
        dim: isize,
        /// Number of dimensions of the tensor.
        ndim: usize,
    },
    /// An operation got a dtype it does not support.
    #[error("{op}: unsupported dtype {dtype} (expected {expected})")]
    UnsupportedDType {
        /// Operation name.
        op: &'static str,
        /// The dtype received.
        dtype: DType,
        /// What the operation accepts, in words.
        expected: &'static str,
    },
    /// Two tensors that had to share a dtype did not.
    #[error("{op}: dtype mismatch: {lhs} vs {rhs}")]
    DTypeMismatch {
        /// Operation name.
        op: &'static str,
        /// Left-hand dtype.
        lhs: DType,
        /// Right-hand dtype.
        rhs: DType,
    },
    /// Two tensors that had to live on one device did not.
    #[error("{op}: expected all tensors on one device, got {lhs} and {rhs}")]
    DeviceMismatch {
        /// Operation name.
        op: &'static str,
        /// Left-hand device.
        lhs: Device,
        /// Right-hand device.
        rhs: Device,
    },
    /// An argument had an invalid value.
    #[error("{op}: invalid argument `{arg}`: expected {expected}, got {got}")]
    InvalidArgument {
        /// Operation name.
        op: &'static str,
        /// The argument's name.
        arg: &'static str,
        /// What was expected, in words.
        expected: String,
        /// What was received.
        got: String,
    },
    /// An index was out of bounds.
    #[error("{op}: index {index} is out of bounds for dimension {dim} with size {size}")]
    IndexOutOfBounds {
        /// Operation name.
        op: &'static str,
        /// The offending index.
        index: i64,
        /// The dimension indexed.
        dim: usize,
        /// Size of that dimension.
        size: usize,
    },
    /// A device string could not be parsed.
    #[error("invalid device string {input:?}: expected \"cpu\", \"cuda\", \"cuda:N\" or \"meta\"")]
    InvalidDevice {
        /// The string given.
        input: String,
    },
    /// CUDA was asked for but cannot be used on this machine.
    #[error("CUDA unavailable: {reason}")]
    CudaUnavailable {
        /// What is missing (driver library, device, ...).
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA error in {op}: {message}")]
    Cuda {
        /// Operation name.
        op: &'static str,
        /// The driver's message.
        message: String,
    },
    /// The operation exists but not for this device or configuration yet, or a method is
    /// refused here (a `ModuleList`'s `forward`, a `RemoteModule`'s state-changing methods).
    #[error("{op} is not supported {detail}")]
    NotSupported {
        /// Operation or method name.
        op: &'static str,
        /// Where it is not supported (for example "on CUDA tensors yet"), or "here: " and
        /// what to do instead.
        detail: String,
    },
    /// An operation needed the elements of a tensor on the meta device, which has none (a
    /// shape and a dtype only): allocate it first with [`crate::nn::Module::to_empty`] (a
    /// module) or [`crate::Tensor::empty_like_on`] (a tensor), then initialise it.
    #[error(
        "{op}: the tensor is on the meta device (a shape and a dtype, no elements): allocate \
         it with Module::to_empty or Tensor::empty_like_on and initialise it first"
    )]
    MetaTensor {
        /// Operation name.
        op: &'static str,
    },
    /// A checkpoint file could not be written or read: an I/O error, a file that is not
    /// safetensors, a truncated or corrupt one, or one that does not hold what was asked for.
    #[error("checkpoint {path}: {problem}")]
    Checkpoint {
        /// The file.
        path: String,
        /// What is wrong with it, or the I/O error.
        problem: String,
    },
    /// An autograd error: backward through freed graph, a saved tensor modified in place,
    /// gradients of wrong shape, and the like.
    #[error("autograd: {0}")]
    Autograd(String),
    /// An error of a higher layer (collectives, RPC) carried whole, so that one error type
    /// serves the whole stack; [`Error::downcast_ref`] gets the original back.
    #[error("{0}")]
    External(std::sync::Arc<dyn std::error::Error + Send + Sync>),
    /// A user-supplied function (hook, custom `Function`) failed.
    #[error("{context}: {message}")]
    Custom {
        /// Where it happened.
        context: String,
        /// The message.
        message: String,
    },
}

/// `Result` with [`Error`] as the error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps an error of another layer (see [`Error::External`]).
    pub fn external(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Error::External(std::sync::Arc::new(e))
    }

    /// The variant's name (`"ShapeMismatch"`, `"InvalidArgument"`, `"External"`, ...), as RPC
    /// reports the kind of an error raised on another worker.
    pub fn variant_name(&self) -> &'static str {
        match self {
            Error::ShapeMismatch { .. } => "ShapeMismatch",
            Error::DimOutOfRange { .. } => "DimOutOfRange",
            Error::UnsupportedDType { .. } => "UnsupportedDType",
            Error::DTypeMismatch { .. } => "DTypeMismatch",
            Error::DeviceMismatch { .. } => "DeviceMismatch",
            Error::InvalidArgument { .. } => "InvalidArgument",
            Error::IndexOutOfBounds { .. } => "IndexOutOfBounds",
            Error::InvalidDevice { .. } => "InvalidDevice",
            Error::CudaUnavailable { .. } => "CudaUnavailable",
            Error::Cuda { .. } => "Cuda",
            Error::NotSupported { .. } => "NotSupported",
            Error::MetaTensor { .. } => "MetaTensor",
            Error::Checkpoint { .. } => "Checkpoint",
            Error::Autograd(_) => "Autograd",
            Error::External(_) => "External",
            Error::Custom { .. } => "Custom",
        }
    }

    /// The original error of a higher layer, when this is an [`Error::External`] of type `E`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            Error::External(e) => e.downcast_ref::<E>(),
            _ => None,
        }
    }

    pub(crate) fn invalid(
        op: &'static str,
        arg: &'static str,
        expected: impl Into<String>,
        got: impl std::fmt::Display,
    ) -> Self {
        Error::InvalidArgument {
            op,
            arg,
            expected: expected.into(),
            got: got.to_string(),
        }
    }
}

/// Writes `err`'s `Display` message, then each source in its chain that the text so far does
/// not already contain, one `caused by: ...` line each. The `Debug` form of the stack's errors
/// (this crate's [`Error`] and those of the distributed layers), so that `fn main() ->
/// Result<(), Error>` and `.unwrap()` print what went wrong instead of a dump of fields.
pub fn fmt_error_chain(
    err: &(dyn std::error::Error + 'static),
    f: &mut std::fmt::Formatter<'_>,
) -> std::fmt::Result {
    let mut seen = err.to_string();
    f.write_str(&seen)?;
    let mut src = err.source();
    // at most 16 sources: a user error whose chain loops must not make `{:?}` spin
    for _ in 0..16 {
        let Some(s) = src else { break };
        let m = s.to_string();
        if !seen.contains(&m) {
            write!(f, "\ncaused by: {m}")?;
            seen.push_str(&m);
        }
        src = s.source();
    }
    Ok(())
}

/// The `Display` message and its sources (see `fmt_error_chain`); match on the variants to
/// get at the fields.
impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fmt_error_chain(self, f)
    }
}
