//! Fused row kernels over contiguous rows: softmax and log-softmax, LayerNorm and tanh-GELU,
//! forward and backward, each one pass (or two) over a row with no temporaries.
//!
//! Sums run in [`LANES`] interleaved accumulators combined in a fixed order, so the compiler
//! vectorises them and every [`CpuCapability`](super::CpuCapability) level gives the same bits
//! (no fused multiply-add is used either).

use num_traits::{Float, One};

use super::math::{Elem, Real};

/// Interleaved accumulators of a row sum.
pub(crate) const LANES: usize = 16;

/// `sum(f(x_i))` over the row in [`LANES`] interleaved partial sums added in a fixed order.
#[inline(always)]
pub(crate) fn lane_sum<A: Real>(n: usize, f: impl Fn(usize) -> A) -> A {
    let mut acc = [A::zero(); LANES];
    let whole = n / LANES * LANES;
    let mut i = 0;
    while i < whole {
        for (l, a) in acc.iter_mut().enumerate() {
            *a = *a + f(i + l);
        }
        i += LANES;
    }
    // a fixed pairwise tree over the lanes
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] = acc[l] + acc[l + width];
        }
    }
    let mut s = acc[0];
    for j in whole..n {
        s = s + f(j);
    }
    s
}

/// The row's maximum, ignoring NaN (`-inf` for an empty row). A NaN in a row makes its softmax
/// NaN through the sum of exponentials, whatever the maximum.
#[inline(always)]
pub(crate) fn lane_max<A: Real>(n: usize, f: impl Fn(usize) -> A) -> A {
    let mut acc = [A::neg_infinity(); LANES];
    let whole = n / LANES * LANES;
    let mut i = 0;
    while i < whole {
        for (l, a) in acc.iter_mut().enumerate() {
            let v = f(i + l);
            *a = if v > *a { v } else { *a };
        }
        i += LANES;
    }
    let mut m = A::neg_infinity();
    for a in acc {
        m = if a > m { a } else { m };
    }
    for j in whole..n {
        let v = f(j);
        m = if v > m { v } else { m };
    }
    m
}

/// Softmax of one row: `y = exp(x - max) / sum(exp(x - max))`.
#[inline(always)]
pub(crate) fn softmax_row<E: Elem>(x: &[E], y: &mut [E]) {
    let n = x.len();
    let m = lane_max(n, |i| x[i].load());
    for (o, &v) in y.iter_mut().zip(x) {
        *o = E::store((v.load() - m).exp_k());
    }
    let s = lane_sum(n, |i| y[i].load());
    let inv = E::Acc::one() / s;
    for o in y.iter_mut() {
        *o = E::store(o.load() * inv);
    }
}

/// Log-softmax of one row: `y = x - max - log(sum(exp(x - max)))`.
#[inline(always)]
pub(crate) fn log_softmax_row<E: Elem>(x: &[E], y: &mut [E]) {
    let n = x.len();
    let m = lane_max(n, |i| x[i].load());
    let s = lane_sum(n, |i| (x[i].load() - m).exp_k());
    let shift = m + s.ln();
    for (o, &v) in y.iter_mut().zip(x) {
        *o = E::store(v.load() - shift);
    }
}

/// Softmax's backward for one row: `dx = y * (g - sum(g * y))`.
#[inline(always)]
pub(crate) fn softmax_backward_row<E: Elem>(y: &[E], g: &[E], dx: &mut [E]) {
    let dot = lane_sum(y.len(), |i| y[i].load() * g[i].load());
    for ((o, &yv), &gv) in dx.iter_mut().zip(y).zip(g) {
        *o = E::store(yv.load() * (gv.load() - dot));
    }
}

/// Log-softmax's backward for one row: `dx = g - exp(y) * sum(g)`.
#[inline(always)]
pub(crate) fn log_softmax_backward_row<E: Elem>(y: &[E], g: &[E], dx: &mut [E]) {
    let s = lane_sum(g.len(), |i| g[i].load());
    for ((o, &yv), &gv) in dx.iter_mut().zip(y).zip(g) {
        *o = E::store(gv.load() - yv.load().exp_k() * s);
    }
}

/// LayerNorm of one row (two passes for the statistics): writes `y` and returns
/// `(mean, rstd)` with `rstd = 1 / sqrt(var + eps)` (biased variance).
#[inline(always)]
pub(crate) fn layer_norm_row<E: Elem>(
    x: &[E],
    w: Option<&[E]>,
    b: Option<&[E]>,
    eps: E::Acc,
    y: &mut [E],
) -> (E::Acc, E::Acc) {
    let n = x.len();
    let inv_n = E::Acc::one() / E::Acc::c(n as f64);
    let mean = lane_sum(n, |i| x[i].load()) * inv_n;
    let var = lane_sum(n, |i| {
        let d = x[i].load() - mean;
        d * d
    }) * inv_n;
    let rstd = E::Acc::one() / (var + eps).sqrt();
    match (w, b) {
        (Some(w), Some(b)) => {
            for i in 0..n {
                y[i] = E::store((x[i].load() - mean) * rstd * w[i].load() + b[i].load());
            }
        }
        (Some(w), None) => {
            for i in 0..n {
                y[i] = E::store((x[i].load() - mean) * rstd * w[i].load());
            }
        }
        (None, Some(b)) => {
            for i in 0..n {
                y[i] = E::store((x[i].load() - mean) * rstd + b[i].load());
            }
        }
        (None, None) => {
            for i in 0..n {
                y[i] = E::store((x[i].load() - mean) * rstd);
            }
        }
    }
    (mean, rstd)
}

/// LayerNorm's backward for one row: writes `dx` and adds the row's contributions to the
/// weight's and bias's gradients (`dw += g * xhat`, `db += g`, in the computing type).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm_backward_row<E: Elem>(
    x: &[E],
    g: &[E],
    w: Option<&[E]>,
    mean: E::Acc,
    rstd: E::Acc,
    dx: &mut [E],
    dw: &mut [E::Acc],
    db: &mut [E::Acc],
) {
    let n = x.len();
    let inv_n = E::Acc::one() / E::Acc::c(n as f64);
    let wv = |i: usize| w.map_or_else(E::Acc::one, |w| w[i].load());
    let xhat = |i: usize| (x[i].load() - mean) * rstd;
    let a = lane_sum(n, |i| g[i].load() * wv(i)) * inv_n;
    let c = lane_sum(n, |i| g[i].load() * wv(i) * xhat(i)) * inv_n;
    for i in 0..n {
        let gi = g[i].load();
        let xh = xhat(i);
        dx[i] = E::store(rstd * (gi * wv(i) - a - xh * c));
        dw[i] = dw[i] + gi * xh;
        db[i] = db[i] + gi;
    }
}

/// `sqrt(2 / pi)`.
const GELU_K: f64 = 0.797_884_560_802_865_4;
/// GELU's cubic coefficient.
const GELU_C: f64 = 0.044_715;

/// `sigmoid(2u)` with `u = sqrt(2/pi) (x + 0.044715 x^3)`: tanh-GELU is `x` times it, since
/// `0.5 (1 + tanh(u)) = 1 / (1 + e^(-2u))`. One `exp`, no cancellation for negative `x`.
#[inline(always)]
fn gelu_gate<A: Real>(x: A) -> A {
    let u = A::c(GELU_K) * (x + A::c(GELU_C) * x * x * x);
    A::one() / (A::one() + (-(u + u)).exp_k())
}

/// tanh-GELU of the elements.
#[inline(always)]
pub(crate) fn gelu_tanh<E: Elem>(x: &[E], y: &mut [E]) {
    for (o, &v) in y.iter_mut().zip(x) {
        let v = v.load();
        *o = E::store(v * gelu_gate(v));
    }
}

/// tanh-GELU's backward: `dx = g * (s + x s (1 - s) 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2))`
/// with `s` the gate.
#[inline(always)]
pub(crate) fn gelu_tanh_backward<E: Elem>(x: &[E], g: &[E], dx: &mut [E]) {
    let k2 = E::Acc::c(2.0 * GELU_K);
    let c3 = E::Acc::c(3.0 * GELU_C);
    for ((o, &v), &gv) in dx.iter_mut().zip(x).zip(g) {
        let v = v.load();
        let s = gelu_gate(v);
        let d = s + v * s * (E::Acc::one() - s) * k2 * (E::Acc::one() + c3 * v * v);
        *o = E::store(gv.load() * d);
    }
}

/// `e^x` of the elements.
#[inline(always)]
pub(crate) fn exp<E: Elem>(x: &[E], y: &mut [E]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o = E::store(v.load().exp_k());
    }
}

/// `tanh(x)` of the elements.
#[inline(always)]
pub(crate) fn tanh<E: Elem>(x: &[E], y: &mut [E]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o = E::store(v.load().tanh_k());
    }
}

/// `1 / (1 + e^-x)` of the elements.
#[inline(always)]
pub(crate) fn sigmoid<E: Elem>(x: &[E], y: &mut [E]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o = E::store(E::Acc::one() / (E::Acc::one() + (-v.load()).exp_k()));
    }
}
