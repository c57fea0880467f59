//! bfloat16 and float16 reductions where they cross TCP (groups not all on one host's shared
//! memory): all_reduce, reduce and reduce_scatter.
//!
//! Two ways, chosen per process by `TENSORPLAY_RING_16BIT` (an internal switch, for
//! measuring; every rank of a group must agree, or the message lengths disagree and the call
//! fails):
//!
//! * `f32` (the default): the buffer is widened to float32 (exact), reduced by the float32
//!   algorithms (partial sums travel in float32: twice the bytes of the 16-bit data), divided
//!   for `Avg`, and rounded once. The result is the float32 sum rounded once: within half an
//!   ulp of the 16-bit type of the exact sum, up to float32's own error (about `(n - 1)` units
//!   of 2^-24 relative to the sum of magnitudes, far below a bfloat16 or float16 ulp).
//! * `hop`: the 16-bit buffer travels as is and each hop adds in float32 and rounds (the ring
//!   rounds `n - 1` times per element; `Avg` divides after, rounding once more). Its error is
//!   bounded by `(n - 1) * u * sum |x_i|` (`u`: the unit roundoff, 2^-8 for bfloat16, 2^-11 for
//!   float16), `n` the group size: the classical bound of recursive summation.
//!
//! docs/collectives.md has both measured (error against the float64 sum, and time).

use std::sync::OnceLock;

use super::algo::Ctx;
use super::buf::Scratch;
use super::route::{self, Route};
use crate::backend::wide::{narrow, widen};
use crate::backend::{BufMut, BufRef};
use crate::{ReduceOp, Result};

/// How 16-bit partial sums cross TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// In float32, rounding once at the end.
    F32,
    /// In the 16-bit type, rounding at every hop.
    Hop,
}

/// The mode from `TENSORPLAY_RING_16BIT` (`f32`, the default, or `hop`), read once.
pub(super) fn mode() -> Mode {
    static MODE: OnceLock<Mode> = OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("TENSORPLAY_RING_16BIT").as_deref() {
        Ok("hop") => Mode::Hop,
        _ => Mode::F32,
    })
}

/// `Avg` reduces as `Sum` below; the division comes before the one rounding.
fn sum_for(op: ReduceOp) -> ReduceOp {
    if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    }
}

fn avg(op: ReduceOp, n: usize) -> Option<usize> {
    (op == ReduceOp::Avg).then_some(n)
}

/// Divides a 16-bit buffer in float32, rounding once (the `hop` mode's `Avg`).
fn divide(data: &mut BufMut<'_>, op: ReduceOp, n: usize) {
    if op == ReduceOp::Avg {
        let w = widen(data.as_ref());
        narrow(&w, data, Some(n));
    }
}

/// In-place all-reduce of a 16-bit buffer (`Avg` divided here).
pub(super) fn all_reduce(
    route: &Route,
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    mut data: BufMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    let n = cx.size;
    if mode() == Mode::Hop {
        route::all_reduce(route, cx, sc, data.reborrow(), sum_for(op))?;
        divide(&mut data, op, n);
        return Ok(());
    }
    let mut w = widen(data.as_ref());
    route::all_reduce(route, cx, sc, BufMut::F32(&mut w), sum_for(op))?;
    narrow(&w, &mut data, avg(op, n));
    Ok(())
}

/// Reduce of a 16-bit buffer to `root` (`Avg` divided there); other ranks' data unchanged.
pub(super) fn reduce(
    route: &Route,
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    mut data: BufMut<'_>,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let n = cx.size;
    if mode() == Mode::Hop {
        route::reduce(route, cx, sc, data.reborrow(), sum_for(op), root)?;
        if cx.rank == root {
            divide(&mut data, op, n);
        }
        return Ok(());
    }
    let mut w = widen(data.as_ref());
    route::reduce(route, cx, sc, BufMut::F32(&mut w), sum_for(op), root)?;
    if cx.rank == root {
        narrow(&w, &mut data, avg(op, n));
    }
    Ok(())
}

/// Reduce-scatter of a 16-bit buffer (`Avg` divided here).
pub(super) fn reduce_scatter(
    route: &Route,
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    input: BufRef<'_>,
    mut output: BufMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    let n = cx.size;
    if mode() == Mode::Hop {
        route::reduce_scatter(route, cx, sc, input, output.reborrow(), sum_for(op))?;
        divide(&mut output, op, n);
        return Ok(());
    }
    let wi = widen(input);
    let mut wo = widen(output.as_ref());
    route::reduce_scatter(
        route,
        cx,
        sc,
        BufRef::F32(&wi),
        BufMut::F32(&mut wo),
        sum_for(op),
    )?;
    narrow(&wo, &mut output, avg(op, n));
    Ok(())
}
