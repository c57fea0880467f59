//! `tensorplay-distributed-nn`: the distributed layers that take part in autograd
//! (`torch.distributed.nn`).
//!
//! - [`functional`]: the collectives as differentiable functions — broadcast, reduce, gather,
//!   scatter, all_reduce, all_gather, reduce_scatter, all_to_all, all_to_all_single — whose
//!   backward is the inverse collective, with the exact adjoint of every reduce op.
//! - [`parallel`]: the parallelisms, one folder each: [`parallel::ddp`]
//!   (`DistributedDataParallel`) and [`parallel::tensor`] (tensor parallelism's plan API,
//!   `torch.distributed.tensor.parallel`).
//! - [`tensor`]: placements (`torch.distributed.tensor`): `Replicate`, `Shard(dim)`, `Partial`.
//! - [`checkpoint`] and [`data`]: sharded checkpoints and `DistributedSampler`.
//!
//! `RemoteModule` lives in its own crate (`tensorplay-remote-module`), so that this one does
//! not depend on the RPC transport. The facade re-exports both under
//! `tensorplay::distributed::nn`.

pub mod checkpoint;
pub mod data;
pub mod functional;
pub mod parallel;
pub mod tensor;
