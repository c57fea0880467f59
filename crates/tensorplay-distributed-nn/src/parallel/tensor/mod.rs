//! Tensor parallelism (`torch.distributed.tensor.parallel`): a plan names the layers to split
//! and how, [`parallelize_module`] applies it.
//!
//! Megatron's layout (Shoeybi et al. 2019) for a pair of Linears: the first column-wise
//! ([`ColwiseParallel`]: each rank computes its share of the hidden features from the
//! replicated input), the second row-wise ([`RowwiseParallel`]: each rank multiplies its
//! share of the features, and the partial sums are added across the ranks), so one pair costs
//! one all-reduce forward and one backward. The styles shard the parameters in place (the
//! names stay, each parameter holds its rank's shard) and move activations between layouts
//! with forward pre-hooks and hooks; a [`DeviceMesh`](tensorplay_collectives::device_mesh::DeviceMesh)
//! says which ranks share the work. Layouts are [`Placement`](crate::tensor::Placement)s.
//!
//! Convention: every rank computes the whole loss and calls `backward` on it; each shard's
//! gradient is then its slice of the single-process gradient, and replicated parameters get
//! the whole gradient on every rank. `docs/tensor-parallel.md` has a worked example.

mod colwise;
mod plan;
mod rowwise;
mod shard;
mod style;
#[cfg(test)]
mod tests;

pub use colwise::ColwiseParallel;
pub use plan::parallelize_module;
pub use rowwise::RowwiseParallel;
pub use style::ParallelStyle;
pub(crate) use style::tp_placement;
