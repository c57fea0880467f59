//! `tensorplay-collectives`: `torch.distributed` for tensorplay — stores and rendezvous,
//! process groups, and collectives over a CPU (TCP) backend and an NCCL backend, plus `spawn`
//! for multi-process programs and tests.

pub mod backend;
mod error;
pub mod rendezvous;
pub mod spawn;
pub mod store;

pub use error::{Error, Result};
pub use rendezvous::{InitMethod, RendezvousInfo, rendezvous, rendezvous_barrier};
pub use spawn::{SpawnError, SpawnOptions, spawn, spawn_with};

/// A reduction operation (`torch.distributed.ReduceOp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Product,
    /// Minimum (NaN wins for floats).
    Min,
    /// Maximum (NaN wins for floats).
    Max,
    /// Mean over ranks (floating dtypes only).
    Avg,
    /// Bitwise and (int64 only).
    BAnd,
    /// Bitwise or (int64 only).
    BOr,
    /// Bitwise xor (int64 only).
    BXor,
}
