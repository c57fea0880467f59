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
/// that is not finite with `error_if_nonfinite`), on every rank of the shards' group when any
/// rank refuses its arguments (that rank's error says why, the others name it), before any
/// gradient changes; shards of groups over different ranks; collective errors.
pub fn clip_grad_norm_(
    parameters: &[Tensor],
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
) -> Result<f64> {
    // the group comes from the shards whether or not they have a gradient this step, so that a
    // rank without gradients still takes part in the collective
    let mut group: Option<ProcessGroup> = None;
    let (mut sharded, mut replicated) = (Vec::new(), Vec::new());
    for p in parameters {
        let pg = setup::group_of_shard(p);
        if let Some(pg) = &pg {
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
            group = Some(pg.clone());
        }
        let Some(g) = p.grad() else { continue };
        if pg.is_some() {
            sharded.push(g);
        } else {
            replicated.push(g);
        }
    }
    // this rank's arguments are checked before the collective, and its verdict travels with
    // its norm: a rank that refuses its arguments makes every rank refuse, before any
    // gradient changes anywhere
    let mine = check_max_norm(max_norm).and_then(|()| {
        Ok((
            get_total_norm(&sharded, norm_type)?,
            get_total_norm(&replicated, norm_type)?,
        ))
    });
    let total = match &group {
        None => {
            let (local, rest) = mine?;
            if norm_type.is_infinite() {
                local.max(rest)
            } else {
                (local.powf(norm_type) + rest.powf(norm_type)).powf(1.0 / norm_type)
            }
        }
        Some(g) => {
            let _ng = tensorplay_core::no_grad();
            let world = g.ranks().len();
            let me = dist::get_rank(Some(g))?;
            let inf = norm_type.is_infinite();
            let (local, rest) = mine.as_ref().map_or((0.0, 0.0), |&(l, r)| (l, r));
            // [this rank's part of the norm, one refusal flag per rank]
            let mut v = vec![0.0; 1 + world];
            v[0] = if inf { local } else { local.powf(norm_type) };
            if mine.is_err() {
                v[1 + me] = 1.0;
            }
            let t = Tensor::from_vec(v, &[1 + world])?;
            let op = if inf { ReduceOp::Max } else { ReduceOp::Sum };
            dist::all_reduce(&t, op, Some(g))?;
            let got = t.to_vec::<f64>()?;
            mine?;
            let refused: Vec<usize> = (0..world)
                .filter(|&r| got[1 + r] > 0.0)
                .map(|r| g.ranks()[r])
                .collect();
            if !refused.is_empty() {
                return Err(Error::InvalidArgument {
                    op: "clip_grad_norm_",
                    arg: "max_norm",
                    expected: "arguments every rank accepts (no gradient was changed on any rank)"
                        .into(),
                    got: format!(
                        "rank(s) {refused:?} refused theirs (a bad max_norm, norm_type or \
                         gradient dtype: their errors say which)"
                    ),
                });
            }
            let across = got[0];
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

/// `max_norm` is a non-negative number (or infinity), as the core's clipping requires.
fn check_max_norm(max_norm: f64) -> Result<()> {
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(Error::InvalidArgument {
            op: "clip_grad_norm_",
            arg: "max_norm",
            expected: "a non-negative number (or f64::INFINITY)".into(),
            got: max_norm.to_string(),
        });
    }
    Ok(())
}
