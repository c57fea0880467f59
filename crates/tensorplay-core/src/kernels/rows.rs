//! Fused row kernels over contiguous rows: softmax and log-softmax, LayerNorm, tanh-GELU and
//! erf-GELU, forward and backward, each one pass (or two) over a row with no temporaries.
//!
//! Sums run in [`LANES`] interleaved accumulators combined in a fixed order, so the compiler
//! vectorises them and every [`CpuCapability`](super::CpuCapability) level gives the same bits
//! (the only fused multiply-adds are `f32::mul_add` calls, rounded once at every level).

use num_traits::{Float, One, Zero};

use super::math::{Elem, Real};

/// Interleaved accumulators of a row sum.
pub(crate) const LANES: usize = 16;

/// The lanes added in a fixed pairwise tree.
#[inline(always)]
fn fold_lanes<A: Real>(mut acc: [A; LANES]) -> A {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] = acc[l] + acc[l + width];
        }
    }
    acc[0]
}

/// `sum(f(x_i))` in [`LANES`] interleaved partial sums added in a fixed order, then the tail.
#[inline(always)]
pub(crate) fn sum_by<A: Real, P: Copy>(x: &[P], f: impl Fn(P) -> A) -> A {
    let mut acc = [A::zero(); LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        if let Ok(c) = <&[P; LANES]>::try_from(c) {
            for l in 0..LANES {
                acc[l] = acc[l] + f(c[l]);
            }
        }
    }
    let mut s = fold_lanes(acc);
    for &v in tail {
        s = s + f(v);
    }
    s
}

/// `sum(f(x_i, y_i))` over two rows of one length, as [`sum_by`].
#[inline(always)]
pub(crate) fn sum_by2<A: Real, P: Copy, Q: Copy>(x: &[P], y: &[Q], f: impl Fn(P, Q) -> A) -> A {
    let n = x.len().min(y.len());
    let (x, y) = (&x[..n], &y[..n]);
    let mut acc = [A::zero(); LANES];
    let (cx, cy) = (x.chunks_exact(LANES), y.chunks_exact(LANES));
    let (tx, ty) = (cx.remainder(), cy.remainder());
    for (a, b) in cx.zip(cy) {
        if let (Ok(a), Ok(b)) = (<&[P; LANES]>::try_from(a), <&[Q; LANES]>::try_from(b)) {
            for l in 0..LANES {
                acc[l] = acc[l] + f(a[l], b[l]);
            }
        }
    }
    let mut s = fold_lanes(acc);
    for (&a, &b) in tx.iter().zip(ty) {
        s = s + f(a, b);
    }
    s
}

/// Writes `y_i = f(x_i)` and returns `sum(y_i)` (as stored), in one pass, adding in the order
/// of [`sum_by`] (so the sum has the bits `sum_by(y, ..)` would give).
#[inline(always)]
pub(crate) fn map_sum<E: Elem>(x: &[E], y: &mut [E], f: impl Fn(E::Acc) -> E::Acc) -> E::Acc {
    let n = x.len().min(y.len());
    let (x, y) = (&x[..n], &mut y[..n]);
    let mut acc = [E::Acc::zero(); LANES];
    let (cx, mut cy) = (x.chunks_exact(LANES), y.chunks_exact_mut(LANES));
    let tx = cx.remainder();
    for (a, b) in cx.zip(&mut cy) {
        if let (Ok(a), Ok(b)) = (<&[E; LANES]>::try_from(a), <&mut [E; LANES]>::try_from(b)) {
            for l in 0..LANES {
                b[l] = E::store(f(a[l].load()));
                acc[l] = acc[l] + b[l].load();
            }
        }
    }
    let mut s = fold_lanes(acc);
    for (o, &v) in cy.into_remainder().iter_mut().zip(tx) {
        *o = E::store(f(v.load()));
        s = s + o.load();
    }
    s
}

/// The row's maximum of `f(x_i)`, ignoring NaN (`-inf` for an empty row). A NaN in a row makes
/// its softmax NaN through the sum of exponentials, whatever the maximum.
#[inline(always)]
pub(crate) fn max_by<A: Real, P: Copy>(x: &[P], f: impl Fn(P) -> A) -> A {
    let mut acc = [A::neg_infinity(); LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        if let Ok(c) = <&[P; LANES]>::try_from(c) {
            for l in 0..LANES {
                let v = f(c[l]);
                acc[l] = if v > acc[l] { v } else { acc[l] };
            }
        }
    }
    let mut m = A::neg_infinity();
    for a in acc {
        m = if a > m { a } else { m };
    }
    for &v in tail {
        let v = f(v);
        m = if v > m { v } else { m };
    }
    m
}

/// Softmax of one row: `y = exp(x - max) / sum(exp(x - max))`.
#[inline(always)]
pub(crate) fn softmax_row<E: Elem>(x: &[E], y: &mut [E]) {
    let m = max_by(x, E::load);
    let inv = E::Acc::one() / map_sum(x, y, |v| (v - m).exp_k());
    for o in y.iter_mut() {
        *o = E::store(o.load() * inv);
    }
}

/// Log-softmax of one row: `y = x - max - log(sum(exp(x - max)))`.
#[inline(always)]
pub(crate) fn log_softmax_row<E: Elem>(x: &[E], y: &mut [E]) {
    let m = max_by(x, E::load);
    let s = sum_by(x, |v| (v.load() - m).exp_k());
    let shift = m + s.ln();
    for (o, &v) in y.iter_mut().zip(x) {
        *o = E::store(v.load() - shift);
    }
}

/// Softmax's backward for one row: `dx = y * (g - sum(g * y))`.
#[inline(always)]
pub(crate) fn softmax_backward_row<E: Elem>(y: &[E], g: &[E], dx: &mut [E]) {
    let dot = sum_by2(y, g, |a, b| a.load() * b.load());
    for ((o, &yv), &gv) in dx.iter_mut().zip(y).zip(g) {
        *o = E::store(yv.load() * (gv.load() - dot));
    }
}

/// Log-softmax's backward for one row: `dx = g - exp(y) * sum(g)`.
#[inline(always)]
pub(crate) fn log_softmax_backward_row<E: Elem>(y: &[E], g: &[E], dx: &mut [E]) {
    let s = sum_by(g, E::load);
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
    let mean = sum_by(x, E::load) * inv_n;
    let var = sum_by(x, |v| {
        let d = v.load() - mean;
        d * d
    }) * inv_n;
    let rstd = E::Acc::one() / (var + eps).sqrt();
    let y = &mut y[..n];
    match (w, b) {
        (Some(w), Some(b)) => {
            for (((o, &v), &wv), &bv) in y.iter_mut().zip(x).zip(&w[..n]).zip(&b[..n]) {
                *o = E::store((v.load() - mean) * rstd * wv.load() + bv.load());
            }
        }
        (Some(w), None) => {
            for ((o, &v), &wv) in y.iter_mut().zip(x).zip(&w[..n]) {
                *o = E::store((v.load() - mean) * rstd * wv.load());
            }
        }
        (None, Some(b)) => {
            for ((o, &v), &bv) in y.iter_mut().zip(x).zip(&b[..n]) {
                *o = E::store((v.load() - mean) * rstd + bv.load());
            }
        }
        (None, None) => {
            for (o, &v) in y.iter_mut().zip(x) {
                *o = E::store((v.load() - mean) * rstd);
            }
        }
    }
    (mean, rstd)
}

/// LayerNorm's backward for one row: writes `dx` and adds the row's contributions to the
/// weight's and bias's gradients (`dw += g * xhat`, `db += g`, in the computing type). `gw` is
/// scratch of the row's length.
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
    gw: &mut [E::Acc],
) {
    let n = x.len();
    let (g, dx, dw, db, gw) = (
        &g[..n],
        &mut dx[..n],
        &mut dw[..n],
        &mut db[..n],
        &mut gw[..n],
    );
    match w {
        Some(w) => {
            for ((o, &gv), &wv) in gw.iter_mut().zip(g).zip(&w[..n]) {
                *o = gv.load() * wv.load();
            }
        }
        None => {
            for (o, &gv) in gw.iter_mut().zip(g) {
                *o = gv.load();
            }
        }
    }
    let inv_n = E::Acc::one() / E::Acc::c(n as f64);
    let a = sum_by(gw, |v| v) * inv_n;
    let c = sum_by2(gw, x, |d, v| d * ((v.load() - mean) * rstd)) * inv_n;
    for ((o, &d), &v) in dx.iter_mut().zip(gw.iter()).zip(x) {
        let xh = (v.load() - mean) * rstd;
        *o = E::store(rstd * (d - a - xh * c));
    }
    for (((dwv, dbv), &gv), &v) in dw.iter_mut().zip(db.iter_mut()).zip(g).zip(x) {
        let gv = gv.load();
        *dwv = *dwv + gv * ((v.load() - mean) * rstd);
        *dbv = *dbv + gv;
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

/// `1 / sqrt(2)`.
const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
/// `1 / sqrt(2 pi)`, the standard normal density at 0.
const NORMAL_PDF_0: f64 = 0.398_942_280_401_432_7;

/// Exact GELU of the elements: `x Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))`.
#[inline(always)]
pub(crate) fn gelu_erf<E: Elem>(x: &[E], y: &mut [E]) {
    let (half, k) = (E::Acc::c(0.5), E::Acc::c(FRAC_1_SQRT_2));
    for (o, &v) in y.iter_mut().zip(x) {
        let v = v.load();
        *o = E::store(half * v * (E::Acc::one() + (v * k).erf_k()));
    }
}

/// Exact GELU's backward: `dx = g (Phi(x) + x phi(x))` with `phi(x) = e^(-x^2/2) / sqrt(2 pi)`.
#[inline(always)]
pub(crate) fn gelu_erf_backward<E: Elem>(x: &[E], g: &[E], dx: &mut [E]) {
    let (half, k, p0) = (
        E::Acc::c(0.5),
        E::Acc::c(FRAC_1_SQRT_2),
        E::Acc::c(NORMAL_PDF_0),
    );
    for ((o, &v), &gv) in dx.iter_mut().zip(x).zip(g) {
        let v = v.load();
        let cdf = half * (E::Acc::one() + (v * k).erf_k());
        let pdf = p0 * (-(half * v * v)).exp_k();
        *o = E::store(gv.load() * (cdf + v * pdf));
    }
}

/// `e^x` of the elements.
#[inline(always)]
pub(crate) fn exp<E: Elem>(x: &[E], y: &mut [E]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o = E::store(v.load().exp_k());
    }
}

/// `ln(x)` of the elements.
#[inline(always)]
pub(crate) fn log<E: Elem>(x: &[E], y: &mut [E]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o = E::store(v.load().ln_k());
    }
}

/// `erf(x)` of the elements.
#[inline(always)]
pub(crate) fn erf<E: Elem>(x: &[E], y: &mut [E]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o = E::store(v.load().erf_k());
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
