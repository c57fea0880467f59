//! The true adjoints of the reduce ops (`Avg`, `Max`, `Min`, `Product`), shared by
//! `all_reduce`, `reduce` and `reduce_scatter`.
//!
//! Every function takes `g`, the upstream gradient already summed over the ranks it reaches
//! (by an `all_reduce`, a `broadcast` from dst, or an `all_gather`), and routes it to this
//! rank's input. The parts that depend on the gradient are built from differentiable
//! operations (so double backward works); the routing masks are constants.

use tensorplay_collectives::{self as coll, ReduceOp};
use tensorplay_core::{Result, Tensor};

use super::all_gather;
use super::group::Grp;
use super::tensors::fresh;

/// Whether the op's adjoint needs the forward's input and output.
pub(super) fn needs_values(op: ReduceOp) -> bool {
    matches!(op, ReduceOp::Max | ReduceOp::Min | ReduceOp::Product)
}

/// `Sum` and `Avg`: the summed gradient, divided by the group size for `Avg`.
pub(super) fn route_linear(gp: &Grp, op: ReduceOp, g: Tensor) -> Result<Tensor> {
    match op {
        ReduceOp::Sum => Ok(g),
        ReduceOp::Avg => g.div_scalar(gp.size as f64),
        other => Err(coll::Error::invalid(
            "backward",
            gp.global as i64,
            "op",
            "a differentiable reduce op (Sum, Avg, Max, Min, Product)",
            format!("{other:?}"),
        )
        .into()),
    }
}

/// `Max`/`Min` and `Product` for one reduced value: `g` is the summed gradient reaching
/// `y = op_k x_k`, `x` this rank's input.
pub(super) fn route(gp: &Grp, op: ReduceOp, g: &Tensor, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    match op {
        ReduceOp::Max | ReduceOp::Min => {
            let mask = holders(x, y)?;
            let count = fresh(&mask)?;
            coll::all_reduce(&count, ReduceOp::Sum, gp.pg())?;
            g.mul(&share(&mask, &count)?)
        }
        ReduceOp::Product => g.mul(&others_product(gp, x)?),
        other => route_linear(gp, other, g.clone()),
    }
}

/// `reduce_scatter`'s adjoint: `g[i]` is rank `i`'s upstream gradient, `xs` this rank's input
/// list, `y` this rank's output (`op_k xs_k[rank]`). Returns one gradient per list element.
pub(super) fn route_scattered(
    gp: &Grp,
    op: ReduceOp,
    g: &[Tensor],
    xs: &[Tensor],
    y: &Tensor,
) -> Result<Vec<Tensor>> {
    if y.numel() == 0 {
        // nothing to route (every rank has this shape); the core's `stack` of empty tensors
        // below would fail
        return g.iter().map(|gi| gi.mul_scalar(0.0)).collect();
    }
    match op {
        ReduceOp::Max | ReduceOp::Min => {
            // every rank needs every y_i for its masks, and the holder count of each element
            let ys = {
                let _ng = tensorplay_core::no_grad();
                all_gather(&y.detach(), gp.pg())?
            };
            let masks = xs
                .iter()
                .zip(&ys)
                .map(|(x, yi)| holders(x, yi))
                .collect::<Result<Vec<_>>>()?;
            let counts = Tensor::stack(&masks, 0)?;
            coll::all_reduce(&counts, ReduceOp::Sum, gp.pg())?;
            masks
                .iter()
                .enumerate()
                .map(|(i, m)| g[i].mul(&share(m, &counts.select(0, i as isize)?)?))
                .collect()
        }
        ReduceOp::Product => {
            // every rank's whole input list, differentiably: gathered[k][i] = xs_k[i]
            let gathered = all_gather(&Tensor::stack(xs, 0)?, gp.pg())?;
            (0..xs.len())
                .map(|i| {
                    let mut acc: Option<Tensor> = None;
                    for (k, gk) in gathered.iter().enumerate() {
                        if k == gp.rank {
                            continue;
                        }
                        let v = gk.select(0, i as isize)?;
                        acc = Some(match acc {
                            Some(a) => a.mul(&v)?,
                            None => v,
                        });
                    }
                    match acc {
                        Some(p) => g[i].mul(&p),
                        None => Ok(g[i].clone()),
                    }
                })
                .collect()
        }
        other => g
            .iter()
            .map(|gi| route_linear(gp, other, gi.clone()))
            .collect(),
    }
}

/// 1 where this rank holds the extremum `y` (NaN-aware: a NaN result is held by NaN inputs),
/// else 0; in `x`'s dtype, not differentiable.
fn holders(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let (x, y) = (x.detach(), y.detach());
    let dt = x.dtype();
    let equal = x.eq(&y)?.to_dtype(dt)?;
    let both_nan = x.ne(&x)?.to_dtype(dt)?.mul(&y.ne(&y)?.to_dtype(dt)?)?;
    equal.add(&both_nan)
}

/// `mask / count`, with the count at least 1 (every element has a holder; the guard only keeps
/// a malformed input from dividing by zero).
fn share(mask: &Tensor, count: &Tensor) -> Result<Tensor> {
    let one = count.ones_like()?;
    mask.div(&count.maximum(&one)?)
}

/// `Π_{k≠r} x_k` from the other ranks' inputs (exact and zero-safe; differentiable in every
/// rank's input through the all-gather).
fn others_product(gp: &Grp, x: &Tensor) -> Result<Tensor> {
    let gathered = all_gather(x, gp.pg())?;
    let mut acc: Option<Tensor> = None;
    for (k, xk) in gathered.into_iter().enumerate() {
        if k == gp.rank {
            continue;
        }
        acc = Some(match acc {
            Some(a) => a.mul(&xk)?,
            None => xk,
        });
    }
    match acc {
        Some(p) => Ok(p),
        None => x.detach().ones_like(),
    }
}
