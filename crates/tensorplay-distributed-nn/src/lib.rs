//! `tensorplay-distributed-nn`: the distributed layers that take part in autograd
//! (`torch.distributed.nn`).
//!
//! - [`functional`]: the collectives as differentiable functions — broadcast, reduce, gather,
//!   scatter, all_reduce, all_gather, reduce_scatter, all_to_all, all_to_all_single — whose
//!   backward is the inverse collective, with the exact adjoint of every reduce op.
//!
//! The facade re-exports this crate as `tensorplay::distributed::nn`.

pub mod functional;
