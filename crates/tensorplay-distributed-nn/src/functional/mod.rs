//! Differentiable collectives (`torch.distributed.nn.functional`).
//!
//! Each function runs the blocking collective of `tensorplay::distributed` on a copy of its
//! input and returns **new** tensors (inputs are never written) that carry a `grad_fn` when an
//! input requires grad. The backward of each is the inverse collective, written with the same
//! public [`Function`](tensorplay_core::autograd::Function) trait a user would use, out of these
//! very functions — so gradients of gradients (double backward) work too.
//!
//! # The gradient convention
//!
//! **Every rank calls `backward` on its own loss, and the gradient a rank receives is that of
//! the sum of all ranks' losses**, `d(Σ_k loss_k)/dx_r` (PyTorch's convention). If every rank
//! computes the same loss value, gradients come out `W` times (`W` = group size) the gradient
//! of one loss: divide by `W` (or use `ReduceOp::Avg`) for the mean.
//!
//! | function | forward on rank `r` | gradient reaching `x_r` (`g_k` = upstream gradient on rank `k`) |
//! |---|---|---|
//! | [`broadcast`] | `y = x_src` | src: `Σ_k g_k`; others: zeros (a SUM [`reduce`] to src) |
//! | [`reduce`] | dst: `op_k x_k`; others: zeros | `g_dst` routed by the op (a [`broadcast`] from dst) |
//! | [`all_reduce`] | `op_k x_k` | `Σ_k g_k` routed by the op (an [`all_reduce`]) |
//! | [`gather`] | dst: `[x_0, …, x_{W-1}]`; others: `W` zero tensors | `g_dst[r]` (a [`scatter`] from dst) |
//! | [`scatter`] | `xs_src[r]` | src: `dxs[i] = g_i`; others: zeros (a [`gather`] to src) |
//! | [`all_gather`] | `[x_0, …, x_{W-1}]` | `Σ_k g_k[r]` (a [`reduce_scatter`], or [`all_to_all`] and a sum for uneven shapes) |
//! | [`reduce_scatter`] | `op_k xs_k[r]` | `dxs[i] = g_i` routed by the op (an [`all_gather`]) |
//! | [`all_to_all`] | `y[j] = x_j[r]` | `dx[j] = g_j[r]` (the same exchange) |
//! | [`all_to_all_single`] | rows `in_splits` of each rank | the exchange with the split lists swapped |
//!
//! Megatron-style tensor parallelism uses the other convention, every rank computing the *same*
//! loss: [`copy_to_group`] (identity forward, all-reduce backward) and [`reduce_from_group`]
//! (all-reduce forward, identity backward) give each shard exactly its slice of the
//! single-process gradient.
//!
//! # Reduce ops and their true adjoints
//!
//! PyTorch's `nn.functional` reuses the forward op in backward (right only for `Sum` and
//! `Avg`; see pytorch/pytorch#58005, #76527). Here, for [`all_reduce`], [`reduce`] and
//! [`reduce_scatter`] alike, with `G` the summed upstream gradient that reaches the reduced
//! value:
//! - `Sum`: `G`; `Avg`: `G / W`;
//! - `Max` / `Min`: `G` goes to the ranks holding the extremum, split evenly between tied
//!   holders; NaN-aware (a NaN result is held by the ranks whose input is NaN);
//! - `Product`: `G × Π_{k≠r} x_k`, computed from the other ranks' inputs directly (exact, and
//!   correct when inputs are zero);
//! - bitwise ops (`BAnd`, `BOr`, `BXor`): int64 only, never differentiable.
//!
//! # Ranks, groups, shapes
//!
//! `src` and `dst` are **global** ranks, as in PyTorch, and every function works on subgroups
//! whose ranks are renumbered (`new_group(&[1, 3], ..)`: global rank 3 is group rank 1).
//! `group: None` is the default group. Tensors may be strided or transposed views (also
//! upstream gradients, such as the stride-0 gradient of `sum`): values are taken in logical
//! (row-major) order. [`all_gather`], [`gather`] and [`all_to_all`] accept a different shape on
//! every rank; the ranks first agree on shapes, dtypes and split sizes, so a rank with bad
//! arguments makes every rank fail the call with an error naming it, instead of a hang or
//! corrupt data. World size 1 is the identity, forward and backward.
//!
//! **Every rank must run the same backward collectives in the same order**: a rank whose loss
//! ignores a collective's output (or whose input does not require grad) skips the backward
//! collective, and the other ranks fail with a timeout error naming it after the group's
//! timeout. The blocking collectives of `tensorplay::distributed` refuse tensors that require
//! grad (they are not differentiable); use these functions inside a graph.
//!
//! Dtypes: float32 and float64 are differentiable; int64 works forward only. Tensors have at
//! most 8 dimensions. CUDA tensors (NCCL groups) go through the collectives and their
//! adjoints (`Max`/`Min`/`Product`, uneven [`all_gather`]) on the device.
//!
//! ```no_run
//! use tensorplay::{self as tp, Tensor};
//! use tp::distributed::{self as dist, ReduceOp};
//! use tp::distributed::nn::functional as df;
//!
//! fn main() -> tp::Result<()> {
//!     dist::init_process_group("cpu", Default::default())?; // env:// (RANK, WORLD_SIZE, ...)
//!     let r = dist::get_rank(None)? as f64;
//!     let x = Tensor::full(&[2], r + 1.0, tp::DType::F64)?.requires_grad_(true);
//!     let y = df::all_reduce(&x, ReduceOp::Sum, None)?; // Σ_k (k + 1) on every rank
//!     y.mul_scalar(r + 1.0)?.sum()?.backward()?;       // loss_r = (r + 1) Σ y
//!     // d(Σ_k loss_k)/dx_r = Σ_k (k + 1) on every rank
//!     println!("{:?}", x.grad().unwrap().to_vec::<f64>()?);
//!     dist::destroy_process_group()?;
//!     Ok(())
//! }
//! ```

mod adjoints;
mod agreement;
mod all_to_all;
mod gather;
mod group;
mod reduce;
mod scatter;
mod tensor_parallel;
mod tensors;

/// The reduce op of [`all_reduce`], [`reduce`] and [`reduce_scatter`] (re-exported from the
/// collectives).
pub use tensorplay_collectives::ReduceOp;

pub use self::all_to_all::{all_to_all, all_to_all_single};
pub use self::gather::{all_gather, gather};
pub use self::reduce::{all_reduce, reduce, reduce_scatter};
pub use self::scatter::{broadcast, scatter};
pub use self::tensor_parallel::{copy_to_group, reduce_from_group};

/// Most dimensions a tensor passed to these functions may have.
pub const MAX_DIMS: usize = 8;
