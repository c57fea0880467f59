//! Differentiable collectives (`torch.distributed.nn.functional`).
//!
//! Each function runs the blocking collective of `tensorplay::distributed` on a copy of its
//! input and returns **new** tensors (inputs are never written) that carry a `grad_fn` when an
//! input requires grad. The backward of each is the inverse collective, written with the same
//! public [`Function`] trait a user would use, out of these
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
mod tensor_parallel;

use tensorplay_collectives::{self as coll, Part, ProcessGroup};
use tensorplay_core::autograd::{Context, Function, apply, is_grad_enabled};
use tensorplay_core::{DType, Device, Result, Tensor, TensorOptions};

/// The reduce op of [`all_reduce`], [`reduce`] and [`reduce_scatter`] (re-exported from the
/// collectives).
pub use coll::ReduceOp;
pub use tensor_parallel::{copy_to_group, reduce_from_group};

/// Most dimensions a tensor passed to these functions may have.
pub const MAX_DIMS: usize = 8;

// ---------------------------------------------------------------------------------------------
// helpers

/// The group of a call and this process's place in it.
#[derive(Clone)]
struct Grp {
    g: ProcessGroup,
    /// Group rank of this process.
    rank: usize,
    /// Group size.
    size: usize,
    /// Global rank of this process.
    global: usize,
}

impl Grp {
    fn new(group: Option<&ProcessGroup>, op: &'static str) -> Result<Grp> {
        let g = match group {
            Some(g) => g.clone(),
            None => coll::default_group(op)?,
        };
        let global = g.my_global_rank();
        let rank = g.rank().ok_or_else(|| {
            coll::Error::invalid(
                op,
                global as i64,
                "group",
                format!("a group this rank belongs to (members: {:?})", g.ranks()),
                format!("group {:?} without rank {global}", g.ranks()),
            )
        })?;
        let size = g.size();
        Ok(Grp {
            g,
            rank,
            size,
            global,
        })
    }

    fn pg(&self) -> Option<&ProcessGroup> {
        Some(&self.g)
    }

    /// An invalid-argument error for this rank.
    fn err(
        &self,
        op: &str,
        arg: &str,
        expected: impl Into<String>,
        got: impl std::fmt::Display,
    ) -> coll::Error {
        coll::Error::invalid(op, self.global as i64, arg, expected, got)
    }

    /// The group rank of global rank `root` (for `src`/`dst`).
    fn root(&self, op: &str, arg: &str, root: usize) -> coll::Result<usize> {
        self.g
            .ranks()
            .iter()
            .position(|&r| r == root)
            .ok_or_else(|| {
                self.err(
                    op,
                    arg,
                    format!("a global rank in the group {:?}", self.g.ranks()),
                    root,
                )
            })
    }

    /// All-gathers `desc` (or, when this rank's own checks failed, a placeholder of `len`
    /// values and the error): every rank fails together when one rank's arguments are bad.
    fn exchange(
        &self,
        op: &'static str,
        desc: coll::Result<Vec<i64>>,
        len: usize,
    ) -> Result<Vec<Vec<i64>>> {
        let (d, local) = match desc {
            Ok(d) => {
                debug_assert_eq!(d.len(), len);
                (d, Ok(()))
            }
            Err(e) => (vec![0; len], Err(e)),
        };
        Ok(coll::all_gather_metadata(op, &d, local, self.pg())?)
    }
}

fn dtype_code(d: DType) -> i64 {
    i64::from(d.code())
}

fn dtype_of(code: i64) -> DType {
    u8::try_from(code)
        .ok()
        .and_then(DType::from_code)
        .unwrap_or(DType::Bool)
}

/// Length of a shape descriptor: `[ndim, d_0 .. d_7]`.
const SHAPE_LEN: usize = 1 + MAX_DIMS;

fn push_shape(v: &mut Vec<i64>, shape: &[usize]) {
    v.push(shape.len() as i64);
    for i in 0..MAX_DIMS {
        v.push(shape.get(i).map_or(-1, |&d| d as i64));
    }
}

fn read_shape(v: &[i64]) -> Vec<usize> {
    let nd = v[0].clamp(0, MAX_DIMS as i64) as usize;
    // dims above i64::MAX (possible next to a zero dim) travel as negative numbers
    v[1..=nd].iter().map(|&d| d as u64 as usize).collect()
}

/// Checks a tensor argument: a dtype the collectives move and at most [`MAX_DIMS`] dims.
fn check_tensor(gp: &Grp, op: &str, arg: &str, t: &Tensor) -> coll::Result<()> {
    if !matches!(t.dtype(), DType::F32 | DType::F64 | DType::I64) {
        return Err(gp.err(op, arg, "a float32, float64 or int64 tensor", t.dtype()));
    }
    if t.ndim() > MAX_DIMS {
        return Err(gp.err(
            op,
            arg,
            format!("a tensor of at most {MAX_DIMS} dimensions"),
            format!("shape {:?}", t.shape()),
        ));
    }
    Ok(())
}

/// This rank's own work before a blocking collective that has no exchange of its own here
/// failed (`r` is an error: a bad argument, a tensor too big to copy): `run` joins that
/// collective with a tensor it refuses, so that its cross-rank check fails the call on every
/// rank (the others naming this one) and the ranks stay in step. Returns `r`.
fn joined<T>(r: Result<T>, run: impl FnOnce(&Tensor) -> coll::Result<()>) -> Result<T> {
    if r.is_err() {
        let _ng = tensorplay_core::no_grad();
        if let Ok(refused) = Tensor::zeros(&[0], DType::Bool) {
            let _ = run(&refused);
        }
    }
    r
}

/// [`joined`] for this rank's own argument error `e`.
fn fail_together(e: coll::Error, run: impl FnOnce(&Tensor) -> coll::Result<()>) -> Result<Tensor> {
    joined(Err(e.into()), run)
}

/// A row-major copy with its own storage (logical order, whatever `t`'s strides).
fn fresh(t: &Tensor) -> Result<Tensor> {
    if t.device().is_cuda() || t.is_contiguous() {
        // on a device the copy is one kernel, and an allocation too large fails as an error
        t.detach().deep_clone()
    } else {
        // an expanded view may stand for more elements than fit in memory: allocate the copy
        // first, which fails with an error (the core's strided copy would abort the process)
        let y = zeros(t.shape(), t.dtype(), t.device())?;
        y.copy_(&t.detach())?;
        Ok(y)
    }
}

fn zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    Tensor::zeros(shape, TensorOptions { dtype, device })
}

fn fmt_shape(s: &[usize]) -> String {
    format!("{s:?}")
}

// ---------------------------------------------------------------------------------------------
// broadcast

/// Broadcasts global rank `src`'s `tensor` to every rank of the group (differentiable
/// `dist.broadcast`); returns a new tensor of `tensor`'s shape and dtype on every rank.
///
/// Backward: a SUM [`reduce`] of the upstream gradients to `src`, so `src` receives
/// `Σ_k g_k` and the other ranks zeros. Every rank passes a tensor of the same shape and dtype
/// (its values are ignored off `src`); `src`'s layout need not match the others'.
///
/// # Errors
/// `src` not in the group, a dtype other than float32, float64 or int64 or more than
/// [`MAX_DIMS`] dimensions, ranks disagreeing on shape, dtype or `src` (on every rank, naming
/// them), timeouts and peer failures of the collectives.
pub fn broadcast(tensor: &Tensor, src: usize, group: Option<&ProcessGroup>) -> Result<Tensor> {
    let gp = Grp::new(group, "broadcast")?;
    if let Err(e) = check_tensor(&gp, "broadcast", "tensor", tensor) {
        return fail_together(e, |t| coll::broadcast(t, src, gp.pg()));
    }
    Ok(apply(Broadcast { gp, src }, &[tensor])?.remove(0))
}

struct Broadcast {
    gp: Grp,
    src: usize,
}

impl Function for Broadcast {
    fn name(&self) -> &str {
        "BroadcastBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let y = joined(fresh(inputs[0]), |t| {
            coll::broadcast(t, self.src, self.gp.pg())
        })?;
        coll::broadcast(&y, self.src, self.gp.pg())?;
        Ok(vec![y])
    }
    fn backward(&self, _ctx: &Context, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        coll::with_phase("backward", || {
            Ok(vec![Some(reduce(
                &grads[0],
                self.src,
                ReduceOp::Sum,
                self.gp.pg(),
            )?)])
        })
    }
}

// ---------------------------------------------------------------------------------------------
// reduce

/// Reduces every rank's `tensor` with `op` into global rank `dst` (differentiable
/// `dist.reduce`). Returns a new tensor: on `dst` the reduction, on the other ranks **zeros**
/// of the same shape (PyTorch leaves backend-dependent partial results there,
/// pytorch/pytorch#76527; zeros are the value whose gradient is consistent: it does not depend
/// on the input).
///
/// Backward: a [`broadcast`] of `dst`'s upstream gradient, routed by the op's true adjoint
/// (see the module docs): `Sum` gives `g_dst` to every rank, `Avg` `g_dst / W`, `Max`/`Min`
/// `g_dst` to the holders of the extremum (split between ties), `Product`
/// `g_dst × Π_{k≠r} x_k`. The gradients of the other ranks' (zero) outputs are ignored.
///
/// # Errors
/// `dst` not in the group; a dtype other than float32, float64 or int64 or more than
/// [`MAX_DIMS`] dimensions; `Avg` on int64 or a bitwise op on floats; ranks disagreeing on
/// shape, dtype, `dst` or op; timeouts and peer failures.
pub fn reduce(
    tensor: &Tensor,
    dst: usize,
    op: ReduceOp,
    group: Option<&ProcessGroup>,
) -> Result<Tensor> {
    let gp = Grp::new(group, "reduce")?;
    if let Err(e) = check_tensor(&gp, "reduce", "tensor", tensor) {
        return fail_together(e, |t| coll::reduce(t, dst, op, gp.pg()));
    }
    Ok(apply(Reduce { gp, dst, op }, &[tensor])?.remove(0))
}

struct Reduce {
    gp: Grp,
    dst: usize,
    op: ReduceOp,
}

impl Function for Reduce {
    fn name(&self) -> &str {
        "ReduceBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let x = inputs[0];
        let y = joined(fresh(x), |t| {
            coll::reduce(t, self.dst, self.op, self.gp.pg())
        })?;
        coll::reduce(&y, self.dst, self.op, self.gp.pg())?;
        let y = if self.gp.global == self.dst {
            y
        } else {
            y.zeros_like()?
        };
        if adjoints::needs_values(self.op) {
            ctx.save_for_backward(&[x, &y]);
        }
        Ok(vec![y])
    }
    fn backward(&self, ctx: &Context, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        coll::with_phase("backward", || {
            let g = broadcast(&grads[0], self.dst, self.gp.pg())?;
            let dx = if adjoints::needs_values(self.op) {
                let saved = ctx.saved_tensors()?;
                // the reduced value lives on dst only: every rank needs it for the routing mask
                let y = {
                    let _ng = tensorplay_core::no_grad();
                    let y = fresh(&saved[1])?;
                    coll::broadcast(&y, self.dst, self.gp.pg())?;
                    y
                };
                adjoints::route(&self.gp, self.op, &g, &saved[0], &y)?
            } else {
                adjoints::route_linear(&self.gp, self.op, g)?
            };
            Ok(vec![Some(dx)])
        })
    }
}

// ---------------------------------------------------------------------------------------------
// all_reduce

/// Reduces every rank's `tensor` with `op` and returns the result on every rank
/// (differentiable `dist.all_reduce`), as a new contiguous tensor of `tensor`'s shape.
///
/// Backward: the upstream gradients are summed over ranks ([`all_reduce`] with `Sum`) and
/// routed by the op's true adjoint: `Sum` → `Σ_k g_k`; `Avg` → `Σ_k g_k / W`; `Max`/`Min` →
/// to the holders of the extremum, split evenly between ties, NaN-aware; `Product` →
/// `Σ_k g_k × Π_{k≠r} x_k` (zero-safe). PyTorch re-applies the forward op to the gradients,
/// which is wrong for `Max`, `Min` and `Product` (its `functional.py`, `_AllReduce`).
///
/// # Errors
/// A dtype other than float32, float64 or int64 or more than [`MAX_DIMS`] dimensions; `Avg` on
/// int64 or a bitwise op on floats; ranks disagreeing on shape, dtype or op (on every rank); timeouts and peer failures.
pub fn all_reduce(tensor: &Tensor, op: ReduceOp, group: Option<&ProcessGroup>) -> Result<Tensor> {
    let gp = Grp::new(group, "all_reduce")?;
    if let Err(e) = check_tensor(&gp, "all_reduce", "tensor", tensor) {
        return fail_together(e, |t| coll::all_reduce(t, op, gp.pg()));
    }
    Ok(apply(AllReduce { gp, op }, &[tensor])?.remove(0))
}

struct AllReduce {
    gp: Grp,
    op: ReduceOp,
}

impl Function for AllReduce {
    fn name(&self) -> &str {
        "AllReduceBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let x = inputs[0];
        let y = joined(fresh(x), |t| coll::all_reduce(t, self.op, self.gp.pg()))?;
        coll::all_reduce(&y, self.op, self.gp.pg())?;
        if adjoints::needs_values(self.op) {
            ctx.save_for_backward(&[x, &y]);
        }
        Ok(vec![y])
    }
    fn backward(&self, ctx: &Context, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        coll::with_phase("backward", || {
            let dx = if adjoints::needs_values(self.op) {
                let g = all_reduce(&grads[0], ReduceOp::Sum, self.gp.pg())?;
                let saved = ctx.saved_tensors()?;
                adjoints::route(&self.gp, self.op, &g, &saved[0], &saved[1])?
            } else {
                // Sum and Avg are their own adjoints
                all_reduce(&grads[0], self.op, self.gp.pg())?
            };
            Ok(vec![Some(dx)])
        })
    }
}

// ---------------------------------------------------------------------------------------------
// all_gather

/// Gathers every rank's `tensor` on every rank (differentiable `dist.all_gather`): returns
/// `W` new tensors, element `k` being rank `k`'s input (group-rank order). Ranks may pass
/// **different shapes** (typically a different first dimension); the dtypes must agree.
///
/// Backward: each rank receives the sum over ranks of the gradients of its own slice,
/// `dx_r = Σ_k g_k[r]`: a SUM [`reduce_scatter`] of the output gradients when all shapes are
/// equal, an [`all_to_all`] followed by a local sum otherwise.
///
/// # Errors
/// Ranks disagreeing on dtype (on every rank, naming them), more than [`MAX_DIMS`] dimensions,
/// timeouts and peer failures.
pub fn all_gather(tensor: &Tensor, group: Option<&ProcessGroup>) -> Result<Vec<Tensor>> {
    const OP: &str = "all_gather";
    let gp = Grp::new(group, OP)?;
    let desc = check_tensor(&gp, OP, "tensor", tensor).map(|_| {
        let mut d = vec![dtype_code(tensor.dtype())];
        push_shape(&mut d, tensor.shape());
        d
    });
    let all = gp.exchange("the shape exchange of all_gather", desc, 1 + SHAPE_LEN)?;
    agree_dtype(&gp, OP, &all, |d| d[0])?;
    let shapes: Vec<Vec<usize>> = all.iter().map(|d| read_shape(&d[1..])).collect();
    apply(AllGather { gp, shapes }, &[tensor])
}

/// Every rank's dtype code (taken from its descriptor by `code`) must be the same.
fn agree_dtype(
    gp: &Grp,
    op: &str,
    all: &[Vec<i64>],
    code: impl Fn(&[i64]) -> i64,
) -> coll::Result<()> {
    let first = code(&all[0]);
    if all.iter().all(|d| code(d) == first) {
        return Ok(());
    }
    let mut detail = coll::Detail::from("dtypes differ (");
    for (k, d) in all.iter().enumerate() {
        let sep = if k == 0 { "rank " } else { ", rank " };
        detail = detail.join(coll::detail!(
            sep,
            Part::Rank(gp.g.ranks()[k]),
            format!(": {}", dtype_of(code(d)))
        ));
    }
    Err(coll::Error::Mismatch {
        op: op.to_string(),
        detail: detail.join(")"),
    })
}

struct AllGather {
    gp: Grp,
    /// Every rank's input shape, by group rank.
    shapes: Vec<Vec<usize>>,
}

impl Function for AllGather {
    fn name(&self) -> &str {
        "AllGatherBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let x = inputs[0];
        let outs = self
            .shapes
            .iter()
            .map(|s| zeros(s, x.dtype(), x.device()))
            .collect::<Result<Vec<_>>>()?;
        coll::all_gather(&outs, x, self.gp.pg())?;
        Ok(outs)
    }
    fn backward(&self, _ctx: &Context, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        coll::with_phase("backward", || {
            let even = self.shapes.iter().all(|s| *s == self.shapes[0]);
            let dx = if even {
                reduce_scatter(grads, ReduceOp::Sum, self.gp.pg())?
            } else {
                let parts = all_to_all(grads, self.gp.pg())?;
                sum_all(&parts)?
            };
            Ok(vec![Some(dx)])
        })
    }
}

/// `Σ_i parts[i]` (differentiable), in index order.
fn sum_all(parts: &[Tensor]) -> Result<Tensor> {
    let mut acc = parts[0].clone();
    for p in &parts[1..] {
        acc = acc.add(p)?;
    }
    if parts.len() == 1 {
        // a new tensor, not the input handle
        acc = acc.mul_scalar(1.0)?;
    }
    Ok(acc)
}

// ---------------------------------------------------------------------------------------------
// reduce_scatter

/// Reduces `input_list[i]` over ranks with `op` and returns the result for this rank's index
/// (differentiable `dist.reduce_scatter`): on rank `r`, `op_k input_list_k[r]`, as a new
/// tensor. `input_list` has one tensor per rank of the group, all of one shape and dtype, the
/// same on every rank.
///
/// Backward: an [`all_gather`] of the upstream gradients, routed by the op's true adjoint:
/// element `i` of the list receives rank `i`'s gradient (`Sum`), divided by `W` (`Avg`), only
/// where this rank holds the extremum, split between ties (`Max`/`Min`), or times the product
/// of the other ranks' element `i` (`Product`).
///
/// # Errors
/// A list whose length is not the group size or whose tensors differ in shape or dtype; an op
/// not valid for the dtype; ranks disagreeing; timeouts and peer failures.
pub fn reduce_scatter(
    input_list: &[Tensor],
    op: ReduceOp,
    group: Option<&ProcessGroup>,
) -> Result<Tensor> {
    const OP: &str = "reduce_scatter";
    let gp = Grp::new(group, OP)?;
    let local = (|| {
        if input_list.len() != gp.size {
            return Err(gp.err(
                OP,
                "input_list",
                format!("{} tensors (one per rank of the group)", gp.size),
                input_list.len(),
            ));
        }
        let first = &input_list[0];
        for (i, t) in input_list.iter().enumerate() {
            let arg = format!("input_list[{i}]");
            check_tensor(&gp, OP, &arg, t)?;
            if t.shape() != first.shape() || t.dtype() != first.dtype() {
                return Err(gp.err(
                    OP,
                    &arg,
                    format!(
                        "the shape and dtype of input_list[0] ({} {})",
                        fmt_shape(first.shape()),
                        first.dtype()
                    ),
                    format!("{} {}", fmt_shape(t.shape()), t.dtype()),
                ));
            }
        }
        Ok(())
    })();
    if let Err(e) = local {
        // let the blocking collective's cross-rank check fail the call on every rank; this
        // rank's own error is what it reports
        return fail_together(e, |t| coll::reduce_scatter(t, &[], op, gp.pg()));
    }
    let refs: Vec<&Tensor> = input_list.iter().collect();
    Ok(apply(ReduceScatter { gp, op }, &refs)?.remove(0))
}

struct ReduceScatter {
    gp: Grp,
    op: ReduceOp,
}

impl Function for ReduceScatter {
    fn name(&self) -> &str {
        "ReduceScatterBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let first = inputs[0];
        let (out, list) = joined(
            (|| {
                let out = zeros(first.shape(), first.dtype(), first.device())?;
                let list = inputs
                    .iter()
                    .map(|t| fresh(t))
                    .collect::<Result<Vec<_>>>()?;
                Ok((out, list))
            })(),
            |t| coll::reduce_scatter(t, &[], self.op, self.gp.pg()),
        )?;
        coll::reduce_scatter(&out, &list, self.op, self.gp.pg())?;
        if adjoints::needs_values(self.op) {
            let mut keep: Vec<&Tensor> = inputs.to_vec();
            keep.push(&out);
            ctx.save_for_backward(&keep);
        }
        Ok(vec![out])
    }
    fn backward(&self, ctx: &Context, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        coll::with_phase("backward", || {
            let g = all_gather(&grads[0], self.gp.pg())?;
            let dxs = if adjoints::needs_values(self.op) {
                let saved = ctx.saved_tensors()?;
                let (xs, y) = saved.split_at(self.gp.size);
                adjoints::route_scattered(&self.gp, self.op, &g, xs, &y[0])?
            } else {
                g.into_iter()
                    .map(|gi| adjoints::route_linear(&self.gp, self.op, gi))
                    .collect::<Result<Vec<_>>>()?
            };
            Ok(dxs.into_iter().map(Some).collect())
        })
    }
}

// ---------------------------------------------------------------------------------------------
// gather

/// Gathers every rank's `tensor` into global rank `dst` (differentiable `dist.gather`):
/// returns `W` new tensors (group-rank order) — on `dst` the inputs of every rank, on the
/// other ranks zeros of those shapes (they keep the rank in the backward pass, which is a
/// collective). Ranks may pass different shapes; the dtypes must agree.
///
/// Backward: a [`scatter`] from `dst` of `dst`'s upstream gradients: `dx_r = g_dst[r]`; the
/// gradients arriving at the other ranks' zero outputs are ignored.
///
/// # Errors
/// `dst` not in the group, ranks disagreeing on dtype or `dst`, timeouts and peer failures.
pub fn gather(tensor: &Tensor, dst: usize, group: Option<&ProcessGroup>) -> Result<Vec<Tensor>> {
    const OP: &str = "gather";
    let gp = Grp::new(group, OP)?;
    let desc = gp
        .root(OP, "dst", dst)
        .and_then(|_| check_tensor(&gp, OP, "tensor", tensor))
        .map(|_| {
            let mut d = vec![dtype_code(tensor.dtype()), dst as i64];
            push_shape(&mut d, tensor.shape());
            d
        });
    let all = gp.exchange("the shape exchange of gather", desc, 2 + SHAPE_LEN)?;
    agree_dtype(&gp, OP, &all, |d| d[0])?;
    agree_root(&gp, OP, "dst", &all, |d| d[1])?;
    let shapes: Vec<Vec<usize>> = all.iter().map(|d| read_shape(&d[2..])).collect();
    apply(Gather { gp, dst, shapes }, &[tensor])
}

/// Every rank must name the same root.
fn agree_root(
    gp: &Grp,
    op: &str,
    arg: &str,
    all: &[Vec<i64>],
    root: impl Fn(&[i64]) -> i64,
) -> coll::Result<()> {
    let first = root(&all[0]);
    if all.iter().all(|d| root(d) == first) {
        return Ok(());
    }
    let mut detail = coll::Detail::from(format!("{arg} differs ("));
    for (k, d) in all.iter().enumerate() {
        let sep = if k == 0 { "rank " } else { ", rank " };
        detail = detail.join(coll::detail!(
            sep,
            Part::Rank(gp.g.ranks()[k]),
            format!(": {arg} {}", root(d))
        ));
    }
    Err(coll::Error::Mismatch {
        op: op.to_string(),
        detail: detail.join(")"),
    })
}

struct Gather {
    gp: Grp,
    dst: usize,
    shapes: Vec<Vec<usize>>,
}

impl Function for Gather {
    fn name(&self) -> &str {
        "GatherBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let x = inputs[0];
        let outs = self
            .shapes
            .iter()
            .map(|s| zeros(s, x.dtype(), x.device()))
            .collect::<Result<Vec<_>>>()?;
        let list = (self.gp.global == self.dst).then_some(&outs[..]);
        coll::gather(x, list, self.dst, self.gp.pg())?;
        Ok(outs)
    }
    fn backward(&self, _ctx: &Context, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        coll::with_phase("backward", || {
            // off dst the gradients go in as placeholders (ignored, zero gradients): with
            // create_graph they keep this rank's double backward connected to its outputs, so that
            // it runs this node's collectives again as dst does
            Ok(vec![Some(scatter(Some(grads), self.dst, self.gp.pg())?)])
        })
    }
}

// ---------------------------------------------------------------------------------------------
// scatter

/// Scatters global rank `src`'s `tensors` (one per rank of the group, group-rank order):
/// rank `r` receives a new tensor equal to `tensors[r]` (differentiable `dist.scatter`).
///
/// On `src`, `tensors` is required (`W` tensors of one dtype; their shapes may differ). The
/// other ranks pass `None` — or placeholders, which are ignored and receive zero gradients —
/// and learn the shape and dtype from `src`. Whether the result takes part in autograd is
/// decided by `src` (whether its tensors require grad), so that every rank runs the backward
/// collective or none does.
///
/// Backward: a [`gather`] of the upstream gradients to `src`: on `src`
/// `d tensors[i] = g_i`; elsewhere zeros.
///
/// # Errors
/// `src` not in the group; on `src`, a missing list, a length other than the group size, or
/// mixed dtypes; ranks disagreeing on `src`; timeouts and peer failures.
pub fn scatter(
    tensors: Option<&[Tensor]>,
    src: usize,
    group: Option<&ProcessGroup>,
) -> Result<Tensor> {
    const OP: &str = "scatter";
    let gp = Grp::new(group, OP)?;
    let len = 3 + gp.size * SHAPE_LEN;
    let is_src = gp.global == src;
    let desc = gp.root(OP, "src", src).and_then(|_| {
        let mut d = vec![src as i64, 0, 0];
        if !is_src {
            d.resize(len, 0);
            return Ok(d);
        }
        let list = tensors.ok_or_else(|| {
            gp.err(
                OP,
                "tensors",
                format!("{} tensors on the source rank", gp.size),
                "None",
            )
        })?;
        if list.len() != gp.size {
            return Err(gp.err(
                OP,
                "tensors",
                format!("{} tensors (one per rank of the group)", gp.size),
                list.len(),
            ));
        }
        for (i, t) in list.iter().enumerate() {
            let arg = format!("tensors[{i}]");
            check_tensor(&gp, OP, &arg, t)?;
            if t.dtype() != list[0].dtype() {
                return Err(gp.err(OP, &arg, format!("dtype {}", list[0].dtype()), t.dtype()));
            }
        }
        let rg = is_grad_enabled() && list.iter().any(Tensor::requires_grad);
        d[1] = i64::from(rg);
        d[2] = dtype_code(list[0].dtype());
        for t in list {
            push_shape(&mut d, t.shape());
        }
        Ok(d)
    });
    let all = gp.exchange("the shape exchange of scatter", desc, len)?;
    agree_root(&gp, OP, "src", &all, |d| d[0])?;
    let root = gp.root(OP, "src", src)?;
    let meta = &all[root];
    let src_rg = meta[1] != 0;
    let dtype = dtype_of(meta[2]);
    let shape = read_shape(&meta[3 + gp.rank * SHAPE_LEN..]);
    let device = tensors
        .and_then(|l| l.first())
        .map_or(Device::Cpu, Tensor::device);
    let mut f = Scatter {
        gp: gp.clone(),
        src,
        shape,
        dtype,
        device,
        placeholders: vec![],
    };
    if is_src {
        let list = tensors.unwrap_or_default();
        let refs: Vec<&Tensor> = list.iter().collect();
        return Ok(apply(f, &refs)?.remove(0));
    }
    let mut refs: Vec<&Tensor> = tensors.map(|l| l.iter().collect()).unwrap_or_default();
    if src_rg && is_grad_enabled() {
        // record a node even without placeholders that require grad: this rank must run the
        // backward gather with src
        let anchor = Tensor::zeros(&[0], dtype)?.requires_grad_(true);
        refs.push(&anchor);
        f.placeholders = refs
            .iter()
            .map(|t| (t.shape().to_vec(), t.dtype(), t.device()))
            .collect();
        Ok(apply(f, &refs)?.remove(0))
    } else {
        let _ng = tensorplay_core::no_grad();
        Ok(apply(f, &refs)?.remove(0))
    }
}

struct Scatter {
    gp: Grp,
    src: usize,
    shape: Vec<usize>,
    dtype: DType,
    device: Device,
    /// Shape, dtype and device of each input on a receiving rank (placeholders, anchor).
    placeholders: Vec<(Vec<usize>, DType, Device)>,
}

impl Function for Scatter {
    fn name(&self) -> &str {
        "ScatterBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let out = zeros(&self.shape, self.dtype, self.device)?;
        if self.gp.global == self.src {
            let list = inputs
                .iter()
                .map(|t| fresh(t))
                .collect::<Result<Vec<_>>>()?;
            coll::scatter(&out, Some(&list), self.src, self.gp.pg())?;
        } else {
            coll::scatter(&out, None, self.src, self.gp.pg())?;
        }
        Ok(vec![out])
    }
    fn backward(&self, ctx: &Context, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        coll::with_phase("backward", || {
            let gathered = gather(&grads[0], self.src, self.gp.pg())?;
            if self.gp.global == self.src {
                return Ok(gathered.into_iter().map(Some).collect());
            }
            // placeholders (and the anchor) get zeros of their own shapes
            let _ = ctx;
            self.placeholders
                .iter()
                .map(|(shape, dt, dev)| Ok(Some(zeros(shape, *dt, *dev)?)))
                .collect()
        })
    }
}

// ---------------------------------------------------------------------------------------------
// all_to_all

/// Rank `r` sends `inputs[j]` to rank `j` and returns the `W` tensors it received, element `j`
/// coming from rank `j` (differentiable `dist.all_to_all`): `y_r[j] = x_j[r]`. Shapes may
/// differ for every (sender, receiver) pair; dtypes must agree.
///
/// Backward: the same exchange of the upstream gradients, `dx_r[j] = g_j[r]`.
///
/// # Errors
/// A list whose length is not the group size, mixed dtypes, ranks disagreeing, timeouts and
/// peer failures.
pub fn all_to_all(inputs: &[Tensor], group: Option<&ProcessGroup>) -> Result<Vec<Tensor>> {
    const OP: &str = "all_to_all";
    let gp = Grp::new(group, OP)?;
    let len = 1 + gp.size * SHAPE_LEN;
    let desc = (|| {
        if inputs.len() != gp.size {
            return Err(gp.err(
                OP,
                "inputs",
                format!("{} tensors (one per rank of the group)", gp.size),
                inputs.len(),
            ));
        }
        let mut d = vec![dtype_code(inputs[0].dtype())];
        for (i, t) in inputs.iter().enumerate() {
            let arg = format!("inputs[{i}]");
            check_tensor(&gp, OP, &arg, t)?;
            if t.dtype() != inputs[0].dtype() {
                return Err(gp.err(OP, &arg, format!("dtype {}", inputs[0].dtype()), t.dtype()));
            }
            push_shape(&mut d, t.shape());
        }
        Ok(d)
    })();
    let all = gp.exchange("the size exchange of all_to_all", desc, len)?;
    agree_dtype(&gp, OP, &all, |d| d[0])?;
    // what rank j sends to this rank: its inputs[rank]
    let shapes: Vec<Vec<usize>> = all
        .iter()
        .map(|d| read_shape(&d[1 + gp.rank * SHAPE_LEN..]))
        .collect();
    let refs: Vec<&Tensor> = inputs.iter().collect();
    apply(AllToAll { gp, shapes }, &refs)
}

struct AllToAll {
    gp: Grp,
    /// Shape of the tensor received from each rank.
    shapes: Vec<Vec<usize>>,
}

impl Function for AllToAll {
    fn name(&self) -> &str {
        "AllToAllBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (dt, dev) = (inputs[0].dtype(), inputs[0].device());
        let outs = self
            .shapes
            .iter()
            .map(|s| zeros(s, dt, dev))
            .collect::<Result<Vec<_>>>()?;
        let list = inputs
            .iter()
            .map(|t| fresh(t))
            .collect::<Result<Vec<_>>>()?;
        coll::all_to_all(&outs, &list, self.gp.pg())?;
        Ok(outs)
    }
    fn backward(&self, _ctx: &Context, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        coll::with_phase("backward", || {
            Ok(all_to_all(grads, self.gp.pg())?
                .into_iter()
                .map(Some)
                .collect())
        })
    }
}

// ---------------------------------------------------------------------------------------------
// all_to_all_single

/// Splits `input` along its first dimension into `W` blocks of `input_split_sizes` rows
/// (`None`: equal blocks), sends block `j` to rank `j`, and returns the blocks received,
/// concatenated in rank order (differentiable `dist.all_to_all_single`). Uneven and zero-size
/// splits are allowed.
///
/// `output_split_sizes` (rows received from each rank) is optional: `None` takes what the
/// senders send; when given, it must match them (`output_split_sizes[j]` on rank `r` equals
/// `input_split_sizes[r]` on rank `j`), and a mismatch is an error on every rank naming the
/// pair — PyTorch hangs (NCCL) or leaves stale memory (gloo) there (pytorch/pytorch#117486).
/// The trailing dimensions and the dtype must agree across ranks.
///
/// Backward: the same exchange with the split lists swapped.
///
/// # Errors
/// A 0-d input, split lists whose length is not the group size or whose sum is not the
/// input's first dimension, a first dimension not divisible by `W` with `None` splits, ranks
/// disagreeing on splits, trailing shape or dtype; timeouts and peer failures.
pub fn all_to_all_single(
    input: &Tensor,
    output_split_sizes: Option<&[usize]>,
    input_split_sizes: Option<&[usize]>,
    group: Option<&ProcessGroup>,
) -> Result<Tensor> {
    const OP: &str = "all_to_all_single";
    let gp = Grp::new(group, OP)?;
    let w = gp.size;
    // [dtype, in_splits (W), out_given, out_splits (W), trailing shape]
    let len = 2 + 2 * w + SHAPE_LEN;
    let desc = (|| {
        check_tensor(&gp, OP, "input", input)?;
        if input.ndim() == 0 {
            return Err(gp.err(
                OP,
                "input",
                "a tensor with at least one dimension",
                "a 0-d tensor",
            ));
        }
        let rows = input.shape()[0];
        let ins: Vec<usize> = match input_split_sizes {
            Some(s) if !s.is_empty() => {
                if s.len() != w {
                    return Err(gp.err(
                        OP,
                        "input_split_sizes",
                        format!("{w} sizes (one per rank of the group)"),
                        format!("{} sizes {s:?}", s.len()),
                    ));
                }
                let total = s.iter().try_fold(0usize, |a, &v| a.checked_add(v));
                if total != Some(rows) {
                    return Err(gp.err(
                        OP,
                        "input_split_sizes",
                        format!("sizes summing to the input's first dimension ({rows})"),
                        match total {
                            Some(t) => format!("{s:?} (sum {t})"),
                            None => format!("{s:?} (the sum overflows)"),
                        },
                    ));
                }
                s.to_vec()
            }
            _ => {
                if !rows.is_multiple_of(w) {
                    return Err(gp.err(
                        OP,
                        "input",
                        format!("a first dimension divisible by the group size {w} (input_split_sizes is None)"),
                        format!("first dimension {rows}"),
                    ));
                }
                vec![rows / w; w]
            }
        };
        let outs = match output_split_sizes {
            Some(s) if !s.is_empty() => {
                if s.len() != w {
                    return Err(gp.err(
                        OP,
                        "output_split_sizes",
                        format!("{w} sizes (one per rank of the group)"),
                        format!("{} sizes {s:?}", s.len()),
                    ));
                }
                if s.iter()
                    .try_fold(0usize, |a, &v| a.checked_add(v))
                    .is_none()
                {
                    return Err(gp.err(
                        OP,
                        "output_split_sizes",
                        "sizes whose sum fits in usize",
                        format!("{s:?} (the sum overflows)"),
                    ));
                }
                Some(s)
            }
            _ => None,
        };
        let mut d = vec![dtype_code(input.dtype())];
        d.extend(ins.iter().map(|&v| v as i64));
        d.push(i64::from(outs.is_some()));
        match outs {
            Some(s) => d.extend(s.iter().map(|&v| v as i64)),
            None => d.extend(std::iter::repeat_n(-1, w)),
        }
        push_shape(&mut d, &input.shape()[1..]);
        Ok(d)
    })();
    let all = gp.exchange("the size exchange of all_to_all_single", desc, len)?;
    agree_dtype(&gp, OP, &all, |d| d[0])?;
    let trailing: Vec<Vec<usize>> = all.iter().map(|d| read_shape(&d[2 + 2 * w..])).collect();
    if let Some(k) = trailing.iter().position(|t| *t != trailing[0]) {
        return Err(coll::Error::Mismatch {
            op: OP.into(),
            detail: coll::detail!(
                "the rows' shapes differ: rank ",
                Part::Rank(gp.g.ranks()[0]),
                format!(" has rows of shape {:?}, rank ", trailing[0]),
                Part::Rank(gp.g.ranks()[k]),
                format!(" of {:?}", trailing[k])
            ),
        }
        .into());
    }
    // send[j][r]: rows rank j sends to rank r
    let sends: Vec<Vec<usize>> = all
        .iter()
        .map(|d| d[1..=w].iter().map(|&v| v as usize).collect())
        .collect();
    for (r, d) in all.iter().enumerate() {
        if d[1 + w] == 0 {
            continue;
        }
        for (j, send) in sends.iter().enumerate() {
            let expect = d[2 + w + j];
            if expect != send[r] as i64 {
                return Err(coll::Error::Mismatch {
                    op: OP.into(),
                    detail: coll::detail!(
                        "rank ",
                        Part::Rank(gp.g.ranks()[j]),
                        format!(" sends {} row(s) to rank ", send[r]),
                        Part::Rank(gp.g.ranks()[r]),
                        // sizes above i64::MAX travel as negative numbers
                        format!(
                            ", which expects {} (its output_split_sizes[{j}])",
                            expect as u64
                        )
                    ),
                }
                .into());
            }
        }
    }
    // what each rank receives must fit in usize (zero-size rows can be that many)
    for r in 0..w {
        let rows: Vec<usize> = sends.iter().map(|s| s[r]).collect();
        if rows
            .iter()
            .try_fold(0usize, |a, &v| a.checked_add(v))
            .is_none()
        {
            return Err(coll::Error::Mismatch {
                op: OP.into(),
                detail: coll::detail!(
                    "rank ",
                    Part::Rank(gp.g.ranks()[r]),
                    format!(" would receive {rows:?} rows from the ranks "),
                    Part::Ranks(gp.g.ranks().to_vec()),
                    ", more than fit in usize"
                ),
            }
            .into());
        }
    }
    let in_splits = sends[gp.rank].clone();
    let out_splits: Vec<usize> = sends.iter().map(|s| s[gp.rank]).collect();
    let f = AllToAllSingle {
        gp,
        in_splits,
        out_splits,
        trailing: trailing[0].clone(),
    };
    Ok(apply(f, &[input])?.remove(0))
}

struct AllToAllSingle {
    gp: Grp,
    in_splits: Vec<usize>,
    out_splits: Vec<usize>,
    trailing: Vec<usize>,
}

impl Function for AllToAllSingle {
    fn name(&self) -> &str {
        "AllToAllSingleBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let x = inputs[0];
        let mut shape = vec![self.out_splits.iter().sum::<usize>()];
        shape.extend_from_slice(&self.trailing);
        let out = zeros(&shape, x.dtype(), x.device())?;
        let inp = fresh(x)?;
        coll::all_to_all_single(
            &out,
            &inp,
            Some(&self.out_splits),
            Some(&self.in_splits),
            self.gp.pg(),
        )?;
        Ok(vec![out])
    }
    fn backward(&self, _ctx: &Context, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        coll::with_phase("backward", || {
            Ok(vec![Some(all_to_all_single(
                &grads[0],
                Some(&self.in_splits),
                Some(&self.out_splits),
                self.gp.pg(),
            )?)])
        })
    }
}
