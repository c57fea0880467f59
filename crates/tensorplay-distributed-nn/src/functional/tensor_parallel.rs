//! The two conjugate operators of Megatron-style tensor parallelism (Shoeybi et al. 2019,
//! "Megatron-LM", section 3: the `f` and `g` of its figure 3), as differentiable functions.
//!
//! A column-parallel layer (its weight split by output features) needs the *full* gradient of
//! its replicated input: [`copy_to_group`] is the identity forward and sums the ranks' partial
//! input gradients backward. A row-parallel layer (split by input features) produces partial
//! outputs: [`reduce_from_group`] sums them forward, and passes the gradient through unchanged
//! backward, because every rank then holds the same output and computes the same loss.
//!
//! With them, **every rank computes the full loss and calls `backward` on it, and every
//! parameter shard receives exactly its slice of the single-process gradient** (replicated
//! parameters, such as a LayerNorm before the block, receive the full gradient on every rank).
//! This is the convention Megatron uses, and it differs from [`all_reduce`]'s, whose backward
//! is itself an all-reduce (the true adjoint when ranks compute *different* losses).

use super::all_reduce;
use super::group::Grp;
use super::tensors::{check_tensor, fail_together, fresh, joined};
use tensorplay_collectives as coll;
use tensorplay_collectives::{ProcessGroup, ReduceOp};
use tensorplay_core::autograd::{Context, Function, apply};
use tensorplay_core::{Result, Tensor};

/// Megatron's `f`, "copy to the tensor-parallel region": returns a copy of `tensor` (the
/// identity forward, no communication); backward, the upstream gradients of the group's ranks
/// are summed (an all-reduce `Sum`) and every rank receives the sum.
///
/// Put it where a replicated activation enters column-parallel layers. Float32 or float64, any
/// shape; the ranks of `group` (`None`: the default group) must all call it, and all call
/// backward through it.
///
/// # Errors
/// As [`all_reduce`]: a bad dtype or more than 8 dimensions (the backward's all-reduce fails on
/// every rank then), timeouts and peer failures in backward.
///
/// ```no_run
/// use tensorplay::{self as tp, distributed::nn::functional as dnf, nn::functional::linear};
/// // on each of 2 ranks: w1 holds this rank's half of the rows of a [64, 16] weight
/// # let (x, w1) = (tp::randn(&[8, 16])?, tp::randn(&[32, 16])?);
/// let h = linear(&dnf::copy_to_group(&x, None)?, &w1, None)?; // [8, 32], this rank's columns
/// # Ok::<(), tp::Error>(())
/// ```
pub fn copy_to_group(tensor: &Tensor, group: Option<&ProcessGroup>) -> Result<Tensor> {
    let gp = Grp::new(group, "copy_to_group")?;
    Ok(apply(CopyToGroup { gp }, &[tensor])?.remove(0))
}

/// Megatron's `g`, "reduce from the tensor-parallel region": sums `tensor` over the ranks of
/// `group` (an all-reduce `Sum`) and returns the sum on every rank; backward passes the
/// gradient through unchanged (no communication).
///
/// Put it after row-parallel layers, whose outputs are partial sums; add a replicated bias
/// after it, once. Float32 or float64, any shape, the same on every rank.
///
/// # Errors
/// As [`all_reduce`]: a bad dtype or shape, ranks disagreeing on shape or dtype (on every rank,
/// naming the rank), timeouts and peer failures.
///
/// ```no_run
/// use tensorplay::{self as tp, distributed::nn::functional as dnf, nn::functional::linear};
/// // on each of 2 ranks: w2 holds this rank's half of the columns of a [16, 64] weight
/// # let (h, w2, b2) = (tp::randn(&[8, 32])?, tp::randn(&[16, 32])?, tp::randn(&[16])?);
/// let y = dnf::reduce_from_group(&linear(&h, &w2, None)?, None)?.add(&b2)?; // [8, 16]
/// # Ok::<(), tp::Error>(())
/// ```
pub fn reduce_from_group(tensor: &Tensor, group: Option<&ProcessGroup>) -> Result<Tensor> {
    let gp = Grp::new(group, "reduce_from_group")?;
    if let Err(e) = check_tensor(&gp, "reduce_from_group", "tensor", tensor) {
        return fail_together(e, |t| coll::all_reduce(t, ReduceOp::Sum, gp.pg()));
    }
    Ok(apply(ReduceFromGroup { gp }, &[tensor])?.remove(0))
}

struct CopyToGroup {
    gp: Grp,
}

impl Function for CopyToGroup {
    fn name(&self) -> &str {
        "CopyToGroupBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![fresh(inputs[0])?])
    }
    fn backward(&self, _ctx: &Context, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        coll::with_phase("backward", || {
            Ok(vec![Some(all_reduce(
                &grads[0],
                ReduceOp::Sum,
                self.gp.pg(),
            )?)])
        })
    }
}

struct ReduceFromGroup {
    gp: Grp,
}

impl Function for ReduceFromGroup {
    fn name(&self) -> &str {
        "ReduceFromGroupBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let y = joined(fresh(inputs[0]), |t| {
            coll::all_reduce(t, ReduceOp::Sum, self.gp.pg())
        })?;
        coll::all_reduce(&y, ReduceOp::Sum, self.gp.pg())?;
        Ok(vec![y])
    }
    fn backward(&self, _ctx: &Context, grads: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(grads[0].clone())])
    }
}
