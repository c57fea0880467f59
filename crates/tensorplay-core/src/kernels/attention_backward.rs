//! The backward of the fused attention ([`super::attention`]), as PyTorch's
//! `FlashAttentionKernel.cpp`: for each (batch x heads) matrix, each query block walks its key
//! blocks (up to the causal diagonal), recomputes the probabilities `P = exp(scale Q K^T - lse)`
//! from the forward's log-sum-exp, and accumulates with `gemm` products `dV += P^T dO`,
//! `dP = dO V^T`, `dS = P (dP - rowsum(dO O))`, `dQ += scale dS K` and `dK += scale dS^T Q`.
//! Each matrix is one piece, computed whole by one thread.

use num_traits::{One, Zero};

use super::attention::{BK, BQ, Dims, Mask, Mat, exp_floor, exp_normal, live_columns, mm, rows_of};
use super::isa::dispatch;
use super::math::{Elem, Real};
use super::parallel::for_each_piece;
use super::rows::{LANES, sum_by2};
use crate::storage::StorageElement;
use crate::storage::pool::take;

/// The gradients of one matrix, `dq` (`[l][e]`), `dk` (`[s][e]`) and `dv` (`[s][ev]`), from the
/// output's gradient `g` and the output `o` (both read through their strides).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn backward_matrix<E: Elem>(
    q: &Mat<'_, E>,
    k: &Mat<'_, E>,
    v: &Mat<'_, E>,
    o: &Mat<'_, E>,
    g: &Mat<'_, E>,
    mask: &Mask<'_, E>,
    lse: &[E::Acc],
    d: Dims,
    scale: E::Acc,
    m: usize,
    (dq, dk, dv): Grads<'_, E>,
) {
    let zero = E::Acc::zero();
    let (e, ev) = (d.e, d.ev);
    let causal = matches!(mask, Mask::Causal);
    // the matrix's operands in the computing type, and their row strides
    let mut bufs: [Vec<E::Acc>; 4] = Default::default();
    let [qbuf, kbuf, vbuf, gbuf] = &mut bufs;
    let (qa, qrs) = rows_of(q, m, 0, d.l, e, qbuf);
    let (ka, krs) = rows_of(k, m, 0, d.s, e, kbuf);
    let (va, vrs) = rows_of(v, m, 0, d.s, ev, vbuf);
    let (ga, grs) = rows_of(g, m, 0, d.l, ev, gbuf);
    // D_i = g_i . o_i
    let delta: Vec<E::Acc> = (0..d.l)
        .map(|i| {
            sum_by2(&ga[i * grs..i * grs + ev], o.row(m, i, ev), |x, y| {
                x * y.load()
            })
        })
        .collect();
    let mut dq_acc = vec![zero; d.l * e];
    let mut dk_acc = vec![zero; d.s * e];
    let mut dv_acc = vec![zero; d.s * ev];
    let bk = BK.min(d.s);
    let block = BQ.min(d.l) * bk.next_multiple_of(LANES);
    let mut p_buf = vec![zero; block];
    let mut ds_buf = vec![zero; block];
    let lo = exp_floor::<E::Acc>();
    let mut i0 = 0;
    while i0 < d.l {
        let rows = BQ.min(d.l - i0);
        let last_key = if causal { (i0 + rows).min(d.s) } else { d.s };
        let qb = &qa[i0 * qrs..];
        let gb = &ga[i0 * grs..];
        let mut j0 = 0;
        while j0 < last_key {
            let n = bk.min(last_key - j0);
            // rows of the blocks are whole vectors; the live columns of each row
            let w = n.next_multiple_of(LANES);
            let mut live = [0; BQ];
            let kb = &ka[j0 * krs..];
            let vb = &va[j0 * vrs..];
            let (p, ds) = (&mut p_buf[..rows * w], &mut ds_buf[..rows * w]);
            // P = exp(scale Q K^T - lse)
            mm(
                (rows, n, e),
                p,
                w,
                false,
                (qb, (qrs, 1)),
                (kb, (1, krs)),
                scale,
            );
            for (r, row) in p.chunks_exact_mut(w).enumerate() {
                let (lv, dead) = live_columns(mask, m, i0 + r, j0, n, row);
                dead.fill(zero);
                live[r] = lv.len();
                let li = lse[i0 + r];
                for x in lv.iter_mut() {
                    *x = exp_normal(*x - li, lo);
                }
            }
            // dV += P^T dO
            let dvb = &mut dv_acc[j0 * ev..(j0 + n) * ev];
            mm(
                (n, ev, rows),
                dvb,
                ev,
                true,
                (p, (1, w)),
                (gb, (grs, 1)),
                E::Acc::one(),
            );
            // dP = dO V^T, then dS = P (dP - D) in its place (0 where P is)
            mm(
                (rows, n, ev),
                ds,
                w,
                false,
                (gb, (grs, 1)),
                (vb, (1, vrs)),
                E::Acc::one(),
            );
            for (r, (dr, pr)) in ds.chunks_exact_mut(w).zip(p.chunks_exact(w)).enumerate() {
                let di = delta[i0 + r];
                let (dl, dead) = dr.split_at_mut(live[r]);
                for (x, &pv) in dl.iter_mut().zip(pr) {
                    *x = pv * (*x - di);
                }
                dead.fill(zero);
            }
            // dQ += scale dS K ; dK += scale dS^T Q
            let dqb = &mut dq_acc[i0 * e..(i0 + rows) * e];
            mm(
                (rows, e, n),
                dqb,
                e,
                true,
                (ds, (w, 1)),
                (kb, (krs, 1)),
                scale,
            );
            let dkb = &mut dk_acc[j0 * e..(j0 + n) * e];
            mm(
                (n, e, rows),
                dkb,
                e,
                true,
                (ds, (1, w)),
                (qb, (qrs, 1)),
                scale,
            );
            j0 += bk;
        }
        i0 += BQ;
    }
    for (dst, src) in [(dq, &dq_acc), (dk, &dk_acc), (dv, &dv_acc)] {
        for (o, &x) in dst.iter_mut().zip(src.iter()) {
            *o = E::store(x);
        }
    }
}

/// One matrix's `dq`, `dk` and `dv`.
type Grads<'a, E> = (&'a mut [E], &'a mut [E], &'a mut [E]);

/// The backward: `dq` (`[bh][l][e]`), `dk` (`[bh][s][e]`) and `dv` (`[bh][s][ev]`),
/// contiguous.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<E: Elem + StorageElement>(
    q: &Mat<'_, E>,
    k: &Mat<'_, E>,
    v: &Mat<'_, E>,
    o: &Mat<'_, E>,
    g: &Mat<'_, E>,
    mask: &Mask<'_, E>,
    lse: &[E::Acc],
    d: Dims,
    scale: f64,
) -> (Vec<E>, Vec<E>, Vec<E>) {
    let scale = E::Acc::c(scale);
    let mut dq = take::<E>(d.bh * d.l * d.e);
    let mut dk = take::<E>(d.bh * d.s * d.e);
    let mut dv = take::<E>(d.bh * d.s * d.ev);
    let mut pieces = Vec::with_capacity(d.bh);
    let (mut rq, mut rk, mut rv) = (&mut dq[..], &mut dk[..], &mut dv[..]);
    for _ in 0..d.bh {
        let (q1, q2) = std::mem::take(&mut rq).split_at_mut(d.l * d.e);
        let (k1, k2) = std::mem::take(&mut rk).split_at_mut(d.s * d.e);
        let (v1, v2) = std::mem::take(&mut rv).split_at_mut(d.s * d.ev);
        pieces.push((q1, k1, v1));
        (rq, rk, rv) = (q2, k2, v2);
    }
    let work = d.bh * d.l * d.s * (d.e + d.ev) * 2;
    for_each_piece(pieces, work, |m, grads| {
        dispatch(
            #[inline(always)]
            || {
                backward_matrix(
                    q,
                    k,
                    v,
                    o,
                    g,
                    mask,
                    &lse[m * d.l..(m + 1) * d.l],
                    d,
                    scale,
                    m,
                    grads,
                )
            },
        )
    });
    (dq, dk, dv)
}
