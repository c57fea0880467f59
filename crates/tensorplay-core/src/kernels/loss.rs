//! Fused cross-entropy over rows of logits: the forward reads each row once for its
//! log-sum-exp (the row's maximum subtracted first) and its loss, and keeps only the
//! log-sum-exp; the backward writes `(softmax(x) - onehot(t)) * scale` in one pass per row from
//! it.

use num_traits::{Float, One, Zero};

use super::math::{Elem, Real};
use super::rows::{max_by, sum_by};

/// A row's `log(sum(e^x))`. The shift is the row's maximum when finite, else 0, so a row of
/// `-inf` gives `-inf` (and a NaN loss, as PyTorch) and a row with `+inf` gives `+inf`.
#[inline(always)]
pub(crate) fn logsumexp_row<E: Elem>(x: &[E]) -> E::Acc {
    let m = max_by(x, E::load);
    let shift = if m.is_finite() { m } else { E::Acc::zero() };
    let s = sum_by(x, |v| (v.load() - shift).exp_k());
    shift + s.ln()
}

/// Cross-entropy's backward for one row: `dx_j = (e^(x_j - lse) - [j == target]) * scale`.
#[inline(always)]
pub(crate) fn cross_entropy_backward_row<E: Elem>(
    x: &[E],
    target: usize,
    lse: E::Acc,
    scale: E::Acc,
    dx: &mut [E],
) {
    for (o, &v) in dx.iter_mut().zip(x) {
        *o = E::store((v.load() - lse).exp_k() * scale);
    }
    if let (Some(o), Some(&v)) = (dx.get_mut(target), x.get(target)) {
        *o = E::store(((v.load() - lse).exp_k() - E::Acc::one()) * scale);
    }
}
