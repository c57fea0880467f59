//! Reductions: [`reduce`], [`all_reduce`] and [`reduce_scatter`].

use tensorplay_collectives::{self as coll, ProcessGroup};
use tensorplay_core::autograd::{Context, Function, apply};
use tensorplay_core::{Result, Tensor};

use super::group::Grp;
use super::tensors::{check_tensor, fail_together, fmt_shape, fresh, joined, zeros};
use super::{ReduceOp, adjoints};
use super::{all_gather, broadcast};

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
/// `dst` not in the group; a dtype other than float32, float64, bfloat16, float16 or int64 or more than
/// [`MAX_DIMS`](super::MAX_DIMS) dimensions; `Avg` on int64 or a bitwise op on floats; ranks disagreeing on
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
/// A dtype other than float32, float64, bfloat16, float16 or int64 or more than [`MAX_DIMS`](super::MAX_DIMS) dimensions; `Avg` on
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
