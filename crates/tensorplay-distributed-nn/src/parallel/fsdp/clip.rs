//! Gradient clipping over fully sharded parameters: the norm of the whole gradient, from the
//! shards' norms summed across ranks (what PyTorch's `clip_grad_norm_` computes on DTensors).

use tensorplay_collectives::{self as dist, ProcessGroup, ReduceOp};
use tensorplay_core::nn::utils::{clip_grads_with_norm_, get_total_norm};
use tensorplay_core::{Error, Result, Tensor};

use super::setup;

/// [`tensorplay::nn::utils::clip_grad_norm_`](tensorplay_core::nn::utils::clip_grad_norm_)
/// for a model with fully sharded parameters (pass `&model.parameters()`): the total
/// `norm_type`-norm is that of the whole gradient, as if every rank's shards were put back
/// together (the shards' `|g|^p` sums added across the ranks that share them, or their
/// maxima for `f64::INFINITY`), and parameters that are not shards (replicated on every rank)
/// count once. Every rank gets the same total and scales its shards' gradients by the same
/// `max_norm / (total + 1e-6)` when that is below 1. A collective when shards are among
/// `parameters`: every rank calls it.
///
/// Errors: as `clip_grad_norm_` (a negative or NaN `max_norm`, a bad `norm_type`, a total
/// that is not finite with `error_if_nonfinite`); shards of groups over different ranks;
/// collective errors.
pub fn clip_grad_norm_(
    parameters: &[Tensor],
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
) -> Result<f64> {
    let mut group: Option<ProcessGroup> = None;
    let (mut sharded, mut replicated) = (Vec::new(), Vec::new());
    for p in parameters {
        let Some(g) = p.grad() else { continue };
        match setup::group_of_shard(p) {
            Some(pg) => {
                if let Some(other) = &group
                    && pg.ranks() != other.ranks()
                {
                    return Err(Error::InvalidArgument {
                        op: "clip_grad_norm_",
                        arg: "parameters",
                        expected: "shards of groups over the same ranks (clip each group's \
                                   parameters separately)"
                            .into(),
                        got: format!("groups over ranks {:?} and {:?}", pg.ranks(), other.ranks()),
                    });
                }
                group = Some(pg);
                sharded.push(g);
            }
            None => replicated.push(g),
        }
    }
    let local = get_total_norm(&sharded, norm_type)?;
    let rest = get_total_norm(&replicated, norm_type)?;
    let total = match &group {
        None => rest,
        Some(g) => {
            let _ng = tensorplay_core::no_grad();
            let inf = norm_type.is_infinite();
            let t = Tensor::from_vec(vec![if inf { local } else { local.powf(norm_type) }], &[1])?;
            let op = if inf { ReduceOp::Max } else { ReduceOp::Sum };
            dist::all_reduce(&t, op, Some(g))?;
            let across = t.item::<f64>()?;
            if inf {
                across.max(rest)
            } else {
                (across + rest.powf(norm_type)).powf(1.0 / norm_type)
            }
        }
    };
    if error_if_nonfinite && !total.is_finite() {
        return Err(Error::InvalidArgument {
            op: "clip_grad_norm_",
            arg: "parameters",
            expected: format!(
                "gradients with a finite total norm of order {norm_type} (error_if_nonfinite=true)"
            ),
            got: format!("a total norm of {total}"),
        });
    }
    clip_grads_with_norm_(parameters, max_norm, total)?;
    Ok(total)
}
