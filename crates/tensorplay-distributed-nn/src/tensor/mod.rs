//! `torch.distributed.tensor`: how a tensor is laid out over a
//! [`DeviceMesh`](tensorplay_collectives::device_mesh::DeviceMesh) — the [`Placement`] of each
//! of its pieces along each mesh dimension. Tensor parallelism
//! ([`crate::parallel::tensor`]) describes its layers' inputs and outputs with them; fully
//! sharded, pipeline and checkpoint work will build on them. (A distributed tensor type,
//! PyTorch's `DTensor`, is not here yet: the tensors stay local, and the placements say how
//! the local pieces make up the whole.)

mod placement;

pub use placement::Placement;
