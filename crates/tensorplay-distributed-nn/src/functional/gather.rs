//! All-to-one and all-to-all gathers: [`all_gather`] and [`gather`].

use tensorplay_collectives::{self as coll, ProcessGroup};
use tensorplay_core::autograd::{Context, Function, apply};
use tensorplay_core::{Result, Tensor};

use super::ReduceOp;
use super::agreement::{SHAPE_LEN, agree_dtype, agree_root, dtype_code, push_shape, read_shape};
use super::group::Grp;
use super::tensors::{check_tensor, zeros};
use super::{all_to_all, reduce_scatter, scatter};

/// Gathers every rank's `tensor` on every rank (differentiable `dist.all_gather`): returns
/// `W` new tensors, element `k` being rank `k`'s input (group-rank order). Ranks may pass
/// **different shapes** (typically a different first dimension); the dtypes must agree.
///
/// Backward: each rank receives the sum over ranks of the gradients of its own slice,
/// `dx_r = Σ_k g_k[r]`: a SUM [`reduce_scatter`] of the output gradients when all shapes are
/// equal, an [`all_to_all`] followed by a local sum otherwise.
///
/// # Errors
/// Ranks disagreeing on dtype (on every rank, naming them), more than [`MAX_DIMS`](super::MAX_DIMS) dimensions,
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
