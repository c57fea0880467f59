//! [`Placement`]: how a tensor's local pieces along one mesh dimension make up the whole
//! (`torch.distributed.tensor.placement_types`).

use std::fmt;

/// How a logical tensor is held by the ranks of one mesh dimension
/// (`torch.distributed.tensor.{Replicate, Shard, Partial}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Every rank holds the whole tensor (`Replicate()`).
    Replicate,
    /// Rank `r` of `W` holds the `r`-th of `W` equal chunks along dimension `d` (`Shard(d)`):
    /// `d` counts from the front; [`Placement::shard_last`] names the last dimension whatever
    /// the rank of the tensor (PyTorch's `Shard(-1)`).
    Shard(isize),
    /// Every rank holds a tensor of the full shape, and the whole is their element-wise sum
    /// (`Partial()`, reduce op sum): a row-parallel layer's output before its all-reduce.
    Partial,
}

impl Placement {
    /// `Shard(-1)`: sharded along the last dimension.
    pub const fn shard_last() -> Placement {
        Placement::Shard(-1)
    }

    /// The dimension a `Shard` splits, resolved against a tensor of `ndim` dimensions
    /// (negative counts from the end); `None` for `Replicate` and `Partial`, or when the
    /// dimension is outside `-ndim..ndim`.
    pub fn shard_dim(&self, ndim: usize) -> Option<usize> {
        match *self {
            Placement::Shard(d) => {
                let n = ndim as isize;
                let d = if d < 0 { d + n } else { d };
                (0..n).contains(&d).then_some(d as usize)
            }
            Placement::Replicate | Placement::Partial => None,
        }
    }

    /// Whether this is a `Shard` (of any dimension).
    pub fn is_shard(&self) -> bool {
        matches!(self, Placement::Shard(_))
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Replicate => write!(f, "Replicate()"),
            Placement::Shard(d) => write!(f, "Shard({d})"),
            Placement::Partial => write!(f, "Partial()"),
        }
    }
}
