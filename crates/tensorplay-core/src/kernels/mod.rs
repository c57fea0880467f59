//! The CPU kernels: vectorised math ([`math`]), fused row kernels ([`rows`]), fused
//! cross-entropy ([`loss`]), fused attention ([`attention`]), 16-bit matrix products ([`gemm16`]), with the instruction set chosen at run time ([`isa`]) and the intra-op
//! thread pool ([`parallel`]). The operations in `ops/` and `nn/` call the entry points below
//! on contiguous slices; each entry point cuts the work into fixed pieces, runs them on the
//! pool, and compiles each piece for the processor's [`CpuCapability`].
//!
//! Everything here is written over [`math::Elem`], an element type loaded into the type the
//! kernel computes in, so the 16-bit float types reuse the kernels by loading into `float32`.

pub(crate) mod attention;
mod attention_backward;
pub(crate) mod gemm16;
pub mod half_convert;
mod isa;
pub(crate) mod loss;
pub(crate) mod math;
mod parallel;
pub(crate) mod reduce;
pub(crate) mod rows;

pub use isa::{CpuCapability, cpu_capability, set_cpu_capability, with_cpu_capability};
pub use parallel::{get_num_threads, set_num_threads};

use num_traits::{ToPrimitive, Zero};

use crate::storage::StorageElement;
use crate::storage::pool::take;

pub(crate) use isa::dispatch;
use math::Elem;
use parallel::map_chunks;
pub(crate) use parallel::{for_each_chunk, with_pool};

/// Reports a setting we cannot honour (an environment variable set to a value we cannot use,
/// autocast for an absent device), once per process and `key`, on standard error as well as
/// through `tracing` (which prints nothing unless the program installed a subscriber, and a
/// mistyped setting must not go unnoticed).
pub(crate) fn warn_once(key: &str, message: &str) {
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if seen.iter().any(|v| v == key) {
        return;
    }
    seen.push(key.to_string());
    tracing::warn!("{message}");
    eprintln!("tensorplay: warning: {message}");
}

/// Elements per piece of an elementwise kernel.
pub(crate) const ELEMENTWISE_CHUNK: usize = 1 << 14;

/// `out[i] = f(x[i])` in pieces on the intra-op threads (above the size threshold); the
/// generic elementwise maps of `ops/` run through it.
pub(crate) fn par_map<T: Copy + Sync, R: Send>(
    x: &[T],
    out: &mut [R],
    f: impl Fn(T) -> R + Sync + Send,
) {
    let n = out.len().min(x.len());
    for_each_chunk(&mut out[..n], ELEMENTWISE_CHUNK, n, |i, o| {
        let xs = &x[i * ELEMENTWISE_CHUNK..i * ELEMENTWISE_CHUNK + o.len()];
        dispatch(
            #[inline(always)]
            || {
                for (o, &v) in o.iter_mut().zip(xs) {
                    *o = f(v);
                }
            },
        )
    });
}

/// `out[i] = f(a[i], b[i])` as [`par_map`].
pub(crate) fn par_zip<T: Copy + Sync, R: Send>(
    a: &[T],
    b: &[T],
    out: &mut [R],
    f: impl Fn(T, T) -> R + Sync + Send,
) {
    let n = out.len().min(a.len()).min(b.len());
    for_each_chunk(&mut out[..n], ELEMENTWISE_CHUNK, n, |i, o| {
        let r = i * ELEMENTWISE_CHUNK..i * ELEMENTWISE_CHUNK + o.len();
        let (a, b) = (&a[r.clone()], &b[r]);
        dispatch(
            #[inline(always)]
            || {
                for (o, (&x, &y)) in o.iter_mut().zip(a.iter().zip(b)) {
                    *o = f(x, y);
                }
            },
        )
    });
}

/// Rows per piece of a row kernel over rows of `n` elements (about 8K elements a piece).
fn rows_per_piece(n: usize) -> usize {
    (8192 / n.max(1)).max(1)
}

/// The elementwise functions with a vectorised kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Map {
    Exp,
    Log,
    Erf,
    Tanh,
    Sigmoid,
    GeluTanh,
    GeluErf,
}

/// `f(x)` of contiguous elements.
pub(crate) fn map<E: Elem + StorageElement>(f: Map, x: &[E]) -> Vec<E> {
    let mut y = take::<E>(x.len());
    for_each_chunk(&mut y, ELEMENTWISE_CHUNK, x.len(), |i, out| {
        let xs = &x[i * ELEMENTWISE_CHUNK..i * ELEMENTWISE_CHUNK + out.len()];
        dispatch(
            #[inline(always)]
            || match f {
                Map::Exp => rows::exp(xs, out),
                Map::Log => rows::log(xs, out),
                Map::Erf => rows::erf(xs, out),
                Map::Tanh => rows::tanh(xs, out),
                Map::Sigmoid => rows::sigmoid(xs, out),
                Map::GeluTanh => rows::gelu_tanh(xs, out),
                Map::GeluErf => rows::gelu_erf(xs, out),
            },
        )
    });
    y
}

/// The elementwise functions of two operands with a vectorised kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Zip {
    GeluTanhBackward,
    GeluErfBackward,
}

/// `f(x, g)` of contiguous elements of one length.
fn zip<E: Elem + StorageElement>(f: Zip, x: &[E], g: &[E]) -> Vec<E> {
    let mut dx = take::<E>(x.len());
    for_each_chunk(&mut dx, ELEMENTWISE_CHUNK, x.len(), |i, out| {
        let r = i * ELEMENTWISE_CHUNK..i * ELEMENTWISE_CHUNK + out.len();
        let (xs, gs) = (&x[r.clone()], &g[r]);
        dispatch(
            #[inline(always)]
            || match f {
                Zip::GeluTanhBackward => rows::gelu_tanh_backward(xs, gs, out),
                Zip::GeluErfBackward => rows::gelu_erf_backward(xs, gs, out),
            },
        )
    });
    dx
}

/// tanh-GELU's input gradient `g * gelu_tanh'(x)` of contiguous elements.
pub(crate) fn gelu_tanh_backward<E: Elem + StorageElement>(x: &[E], g: &[E]) -> Vec<E> {
    zip(Zip::GeluTanhBackward, x, g)
}

/// Exact GELU's input gradient `g * gelu'(x)` of contiguous elements.
pub(crate) fn gelu_erf_backward<E: Elem + StorageElement>(x: &[E], g: &[E]) -> Vec<E> {
    zip(Zip::GeluErfBackward, x, g)
}

/// Softmax (or log-softmax with `log`) over each contiguous row of `n` elements of `x`.
pub(crate) fn softmax<E: Elem + StorageElement>(x: &[E], n: usize, log: bool) -> Vec<E> {
    let mut y = take::<E>(x.len());
    if n == 0 {
        return y;
    }
    let piece = rows_per_piece(n) * n;
    for_each_chunk(&mut y, piece, x.len(), |i, out| {
        let xs = &x[i * piece..i * piece + out.len()];
        dispatch(
            #[inline(always)]
            || {
                for (xr, yr) in xs.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
                    if log {
                        rows::log_softmax_row(xr, yr);
                    } else {
                        rows::softmax_row(xr, yr);
                    }
                }
            },
        )
    });
    y
}

/// Softmax's (or log-softmax's) input gradient from the output `y` and its gradient `g`, rows
/// of `n` contiguous elements.
pub(crate) fn softmax_backward<E: Elem + StorageElement>(
    y: &[E],
    g: &[E],
    n: usize,
    log: bool,
) -> Vec<E> {
    let mut dx = take::<E>(y.len());
    if n == 0 {
        return dx;
    }
    let piece = rows_per_piece(n) * n;
    for_each_chunk(&mut dx, piece, y.len(), |i, out| {
        let r = i * piece..i * piece + out.len();
        let (ys, gs) = (&y[r.clone()], &g[r]);
        dispatch(
            #[inline(always)]
            || {
                for ((yr, gr), dr) in ys
                    .chunks_exact(n)
                    .zip(gs.chunks_exact(n))
                    .zip(out.chunks_exact_mut(n))
                {
                    if log {
                        rows::log_softmax_backward_row(yr, gr, dr);
                    } else {
                        rows::softmax_backward_row(yr, gr, dr);
                    }
                }
            },
        )
    });
    dx
}

/// Cross-entropy of contiguous rows of `c` logits against class indices (each in `0..c`, the
/// caller checks): each row's log-sum-exp, and the sum over rows of `lse - x[target]` (in
/// float64, over fixed pieces of rows added in order).
pub(crate) fn cross_entropy<E: Elem + StorageElement>(
    x: &[E],
    target: &[i64],
    c: usize,
) -> (Vec<E::Acc>, f64) {
    let n = target.len();
    let mut lse = vec![E::Acc::zero(); n];
    if n == 0 || c == 0 {
        return (lse, 0.0);
    }
    let per = rows_per_piece(c);
    let sums = map_chunks(&mut lse, per, n * c, |i, out| {
        dispatch(
            #[inline(always)]
            || {
                let mut total = 0.0f64;
                for (r, l) in out.iter_mut().enumerate() {
                    let row = i * per + r;
                    let xr = &x[row * c..(row + 1) * c];
                    *l = loss::logsumexp_row(xr);
                    let xt = xr[target[row] as usize].load();
                    total += (*l - xt).to_f64().unwrap_or(f64::NAN);
                }
                total
            },
        )
    });
    (lse, sums.into_iter().sum())
}

/// Cross-entropy's input gradient `(softmax(x) - onehot(target)) * scale` from contiguous rows
/// of `c` logits and the forward's log-sum-exps.
pub(crate) fn cross_entropy_backward<E: Elem + StorageElement>(
    x: &[E],
    target: &[i64],
    lse: &[E::Acc],
    c: usize,
    scale: E::Acc,
) -> Vec<E> {
    let mut dx = take::<E>(x.len());
    if c == 0 {
        return dx;
    }
    let per = rows_per_piece(c);
    for_each_chunk(&mut dx, per * c, x.len(), |i, out| {
        dispatch(
            #[inline(always)]
            || {
                for (r, dr) in out.chunks_exact_mut(c).enumerate() {
                    let row = i * per + r;
                    let xr = &x[row * c..(row + 1) * c];
                    let t = target[row] as usize;
                    loss::cross_entropy_backward_row(xr, t, lse[row], scale, dr);
                }
            },
        )
    });
    dx
}

/// The result of [`layer_norm`]: the normalised rows, and each row's mean and `1 / std`.
pub(crate) type LayerNormOut<E> = (Vec<E>, Vec<<E as Elem>::Acc>, Vec<<E as Elem>::Acc>);

/// LayerNorm over each row of `n` elements of `x` (rows at `row_offsets`, contiguous within),
/// with an optional weight and bias of `n` elements.
pub(crate) fn layer_norm<E: Elem + StorageElement>(
    x: &[E],
    row_offsets: &[usize],
    n: usize,
    w: Option<&[E]>,
    b: Option<&[E]>,
    eps: f64,
) -> LayerNormOut<E> {
    let rows = row_offsets.len();
    let mut y = take::<E>(rows * n);
    if n == 0 {
        return (y, vec![E::Acc::zero(); rows], vec![E::Acc::zero(); rows]);
    }
    let per = rows_per_piece(n);
    let eps = <E::Acc as math::Real>::c(eps);
    let stats = map_chunks(&mut y, per * n, rows * n, |i, out| {
        dispatch(
            #[inline(always)]
            || {
                let mut stats = Vec::with_capacity(out.len() / n);
                for (r, yr) in out.chunks_exact_mut(n).enumerate() {
                    let o = row_offsets[i * per + r];
                    stats.push(rows::layer_norm_row(&x[o..o + n], w, b, eps, yr));
                }
                stats
            },
        )
    });
    let (mean, rstd) = stats.into_iter().flatten().unzip();
    (y, mean, rstd)
}

/// The result of [`layer_norm_backward`]: the input's gradient, and the weight's and bias's.
pub(crate) type LayerNormGrads<E> = (Vec<E>, Vec<<E as Elem>::Acc>, Vec<<E as Elem>::Acc>);

/// LayerNorm's gradients from contiguous rows `x` and `g` of `n` elements and the forward's
/// statistics. The weight's and bias's gradients are summed over fixed pieces of rows and the
/// pieces added in order.
pub(crate) fn layer_norm_backward<E: Elem + StorageElement>(
    x: &[E],
    g: &[E],
    w: Option<&[E]>,
    mean: &[E::Acc],
    rstd: &[E::Acc],
    n: usize,
) -> LayerNormGrads<E> {
    let zero = E::Acc::zero();
    let mut dx = take::<E>(x.len());
    if n == 0 {
        return (dx, vec![], vec![]);
    }
    let per = rows_per_piece(n);
    let partials = map_chunks(&mut dx, per * n, x.len(), |i, out| {
        let mut dw = vec![zero; n];
        let mut db = vec![zero; n];
        let mut gw = vec![zero; n];
        dispatch(
            #[inline(always)]
            || {
                for (r, dr) in out.chunks_exact_mut(n).enumerate() {
                    let row = i * per + r;
                    let span = row * n..(row + 1) * n;
                    rows::layer_norm_backward_row(
                        &x[span.clone()],
                        &g[span],
                        w,
                        mean[row],
                        rstd[row],
                        dr,
                        &mut dw,
                        &mut db,
                        &mut gw,
                    );
                }
            },
        );
        (dw, db)
    });
    let mut dw = vec![zero; n];
    let mut db = vec![zero; n];
    for (pw, pb) in partials {
        for (a, b) in dw.iter_mut().zip(pw) {
            *a = *a + b;
        }
        for (a, b) in db.iter_mut().zip(pb) {
            *a = *a + b;
        }
    }
    (dx, dw, db)
}
