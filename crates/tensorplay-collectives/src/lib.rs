//! `tensorplay-collectives`: `torch.distributed` for tensorplay — stores and rendezvous,
//! process groups, the backend contract every backend implements (`backend`), the built-in
//! `"cpu"` backend (shared memory and TCP), and `spawn` for multi-process programs and tests.
//! The NCCL backend is the crate `tensorplay-nccl`, registered through
//! [`register_backend`]; this crate never links CUDA.

pub mod backend;
mod detail;
pub mod device_mesh;
mod error;
mod group;
pub mod launch_env;
pub mod launcher;
mod object;
mod ops;
pub mod recorder;
pub mod rendezvous;
pub mod shm_host;
pub mod spawn;
pub mod store;
mod work;

pub use backend::{register_backend, registered_backends};
pub use detail::{Detail, Part};
pub use error::{Error, Result};
pub use group::{
    DEFAULT_TIMEOUT, InitOptions, ProcessGroup, default_group, destroy_process_group, get_backend,
    get_rank, get_world_size, init_process_group, is_initialized, new_group, world_store,
};
pub use object::{all_gather_object, broadcast_object_list};
pub use ops::{
    P2POp, all_gather, all_gather_into_tensor, all_gather_into_tensor_async, all_gather_metadata,
    all_reduce, all_reduce_async, all_to_all, all_to_all_single, all_to_all_single_async, barrier,
    batch_isend_irecv, broadcast, broadcast_async, gather, irecv, isend, recv, reduce,
    reduce_scatter, reduce_scatter_tensor, reduce_scatter_tensor_async, scatter, send, with_phase,
};
pub use recorder::dump_flight_recorder;
pub use rendezvous::{
    InitMethod, RendezvousInfo, rendezvous, rendezvous_barrier, rendezvous_scoped,
};
pub use spawn::{SpawnError, SpawnOptions, spawn, spawn_with};
pub use work::Work;

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
