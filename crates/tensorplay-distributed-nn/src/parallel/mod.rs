//! The parallelisms, one folder each (PyTorch's map):
//!
//! - [`ddp`]: data parallelism, [`DistributedDataParallel`] (`torch.nn.parallel`; the
//!   façade re-exports it as `tensorplay::nn::parallel`).
//! - [`tensor`]: tensor parallelism, the plan API of `torch.distributed.tensor.parallel`
//!   ([`ColwiseParallel`](tensor::ColwiseParallel), [`RowwiseParallel`](tensor::RowwiseParallel),
//!   [`parallelize_module`](tensor::parallelize_module)); the façade re-exports it as
//!   `tensorplay::distributed::tensor::parallel`.
//! - [`fsdp`]: fully sharded data parallelism, [`fully_shard`](fsdp::fully_shard)
//!   (`torch.distributed.fsdp`; the façade re-exports it as `tensorplay::distributed::fsdp`).
//! - [`pipelining`]: pipeline parallelism (`torch.distributed.pipelining`): stages,
//!   micro-batches and schedules checked by a simulator before they run.

pub mod ddp;
pub mod fsdp;
pub mod pipelining;
pub mod tensor;

pub use ddp::{
    CommFuture, CommHook, DdpError, DdpOptions, DistributedDataParallel, GradBucket, NoSync,
    StepStats, default_hooks,
};
