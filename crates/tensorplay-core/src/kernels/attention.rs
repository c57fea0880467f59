//! Fused scaled-dot-product attention on the CPU (FlashAttention's algorithm): each query
//! block walks the key blocks with an online softmax (a running maximum and sum per row), so
//! the `[L, S]` score matrix is never stored; blocks above the causal diagonal are skipped; the
//! backward recomputes the scores block by block from the saved log-sum-exp of each row.
//!
//! Operands are read in place through their strides (the last dimension contiguous), so heads
//! split out of a fused projection need no copy. Work is split over (batch x heads) and query
//! blocks in the forward, over (batch x heads) in the backward; each piece is computed whole by
//! one thread, so the thread count does not change a bit.

use num_traits::{Float, One, Zero};

use super::isa::dispatch;
use super::math::{Elem, Real};
use super::parallel::{map_chunks, map_tasks};
use super::rows::{max_by, sum_by};
use crate::storage::StorageElement;
use crate::storage::pool::take;

/// Query rows per block.
const BQ: usize = 32;
/// Key rows per block.
const BK: usize = 64;

/// One operand: for each (batch x heads) matrix the offset of its first row, and the stride
/// between its rows (elements within a row are contiguous).
#[derive(Debug)]
pub(crate) struct Mat<'a, E> {
    pub(crate) data: &'a [E],
    pub(crate) offsets: Vec<usize>,
    pub(crate) row: usize,
}

impl<E: Elem> Mat<'_, E> {
    #[inline(always)]
    fn row(&self, m: usize, i: usize, len: usize) -> &[E] {
        let o = self.offsets[m] + i * self.row;
        &self.data[o..o + len]
    }
}

/// A mask broadcast over `[.., L, S]`: for each matrix the offset of its first element and the
/// strides along queries and keys (0 where broadcast).
#[derive(Debug)]
pub(crate) struct MaskMat<'a, T> {
    pub(crate) data: &'a [T],
    pub(crate) offsets: Vec<usize>,
    pub(crate) row: usize,
    pub(crate) col: usize,
}

/// Which keys a query sees.
#[derive(Debug)]
pub(crate) enum Mask<'a, E> {
    /// Every key.
    None,
    /// Keys `0..=i` for query `i`.
    Causal,
    /// The keys whose element is true.
    Bool(MaskMat<'a, bool>),
    /// Every key, with the element added to its score.
    Add(MaskMat<'a, E>),
}

/// The problem's sizes: `bh` matrices of `l` queries and `s` keys, `e` features per query and
/// key, `ev` per value.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub(crate) bh: usize,
    pub(crate) l: usize,
    pub(crate) s: usize,
    pub(crate) e: usize,
    pub(crate) ev: usize,
}

/// The keys query `i` may see in the key block starting at `j0` (`0..` this many), under a
/// causal mask.
#[inline(always)]
fn visible(mask_causal: bool, i: usize, j0: usize, bk: usize) -> usize {
    if mask_causal {
        (i + 1).saturating_sub(j0).min(bk)
    } else {
        bk
    }
}

/// How many columns to compute for `n` visible keys in a block of `bk`: `n` rounded up to a
/// whole vector (the extra scores are masked), so the loops have no scalar tails.
#[inline(always)]
fn padded(n: usize, bk: usize) -> usize {
    n.div_ceil(16).saturating_mul(16).min(bk).max(n)
}

/// The scores of query row `qi` against the packed key block `kt` (`[e][BK]`, already scaled),
/// with the mask applied, into `s[..padded(n, bk)]` (the columns from `n` are `-inf`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn scores<E: Elem>(
    qi: &[E],
    kt: &[E::Acc],
    n: usize,
    mask: &Mask<'_, E>,
    m: usize,
    i: usize,
    j0: usize,
    s: &mut [E::Acc],
    bk: usize,
) {
    let nv = padded(n, bk);
    let s = &mut s[..nv];
    if nv == BK {
        // a whole block: the accumulators are a fixed array the compiler keeps in registers
        let mut acc = [E::Acc::zero(); BK];
        for (e, &q) in qi.iter().enumerate() {
            let q = q.load();
            if let Ok(krow) = <&[E::Acc; BK]>::try_from(&kt[e * BK..(e + 1) * BK]) {
                for j in 0..BK {
                    acc[j] = acc[j] + q * krow[j];
                }
            }
        }
        s.copy_from_slice(&acc);
    } else {
        s.fill(E::Acc::zero());
        for (e, &q) in qi.iter().enumerate() {
            let q = q.load();
            let krow = &kt[e * BK..e * BK + nv];
            for (o, &k) in s.iter_mut().zip(krow) {
                *o = *o + q * k;
            }
        }
    }
    for o in &mut s[n..] {
        *o = E::Acc::neg_infinity();
    }
    let s = &mut s[..n];
    apply_mask(mask, m, i, j0, s);
}

/// Applies a bool or additive mask to the scores `s` of query `i` (matrix `m`) against the
/// keys from `j0`; causal masks and none are applied by the callers' visible counts.
#[inline(always)]
fn apply_mask<E: Elem>(mask: &Mask<'_, E>, m: usize, i: usize, j0: usize, s: &mut [E::Acc]) {
    match mask {
        Mask::None | Mask::Causal => {}
        Mask::Bool(b) => {
            let base = b.offsets[m] + i * b.row + j0 * b.col;
            for (j, o) in s.iter_mut().enumerate() {
                if !b.data[base + j * b.col] {
                    *o = E::Acc::neg_infinity();
                }
            }
        }
        Mask::Add(a) => {
            let base = a.offsets[m] + i * a.row + j0 * a.col;
            for (j, o) in s.iter_mut().enumerate() {
                *o = *o + a.data[base + j * a.col].load();
            }
        }
    }
}

/// Packs rows `j0..j0 + n` of `k` (matrix `m`) transposed into `kt[e][BK]`, times `scale`.
#[inline(always)]
fn pack_t<E: Elem>(
    k: &Mat<'_, E>,
    m: usize,
    j0: usize,
    n: usize,
    e: usize,
    scale: E::Acc,
    kt: &mut [E::Acc],
) {
    for j in 0..n {
        let row = k.row(m, j0 + j, e);
        for (f, &v) in row.iter().enumerate() {
            kt[f * BK + j] = v.load() * scale;
        }
    }
}

/// Query rows computed together: their scores share each loaded key, and their outputs each
/// loaded value row.
const TR: usize = 4;

/// The scores of the `tr` query rows from `i` against the packed key block `kt`, the first
/// `nv` columns of each of `st` (columns of a row from its visible count `ns[t]` are `-inf`),
/// with the mask applied.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn score_tile<E: Elem>(
    q: &Mat<'_, E>,
    kt: &[E::Acc],
    mask: &Mask<'_, E>,
    d: Dims,
    m: usize,
    i: usize,
    j0: usize,
    tr: usize,
    ns: &[usize; TR],
    nv: usize,
    st: &mut [[E::Acc; BK]; TR],
) {
    let rows: [&[E]; TR] = std::array::from_fn(|t| q.row(m, i + t.min(tr - 1), d.e));
    for row in st.iter_mut() {
        row.fill(E::Acc::zero());
    }
    for f in 0..d.e {
        let qv: [E::Acc; TR] = std::array::from_fn(|t| rows[t][f].load());
        let krow = &kt[f * BK..f * BK + nv];
        for (t, row) in st.iter_mut().enumerate() {
            let qf = qv[t];
            for (o, &k) in row[..nv].iter_mut().zip(krow) {
                *o = *o + qf * k;
            }
        }
    }
    for t in 0..tr {
        let row = &mut st[t][..nv];
        for o in &mut row[ns[t]..] {
            *o = E::Acc::neg_infinity();
        }
        apply_mask(mask, m, i + t, j0, &mut row[..ns[t]]);
    }
}

/// The forward of one query block of matrix `m`: the output rows (`[rows][ev]`) and each row's
/// log-sum-exp of the scores.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn forward_block<E: Elem>(
    q: &Mat<'_, E>,
    k: &Mat<'_, E>,
    v: &Mat<'_, E>,
    mask: &Mask<'_, E>,
    d: Dims,
    scale: E::Acc,
    m: usize,
    i0: usize,
) -> (Vec<E::Acc>, Vec<E::Acc>) {
    let rows = BQ.min(d.l - i0);
    let causal = matches!(mask, Mask::Causal);
    let mut acc = vec![E::Acc::zero(); rows * d.ev];
    let mut mx = vec![E::Acc::neg_infinity(); rows];
    let mut sum = vec![E::Acc::zero(); rows];
    let mut kt = vec![E::Acc::zero(); d.e * BK];
    let mut st = [[E::Acc::zero(); BK]; TR];
    let last_key = if causal { (i0 + rows).min(d.s) } else { d.s };
    let mut j0 = 0;
    while j0 < last_key {
        let bk = BK.min(d.s - j0);
        pack_t(k, m, j0, bk, d.e, scale, &mut kt);
        let mut r0 = 0;
        while r0 < rows {
            let tr = TR.min(rows - r0);
            let ns: [usize; TR] = std::array::from_fn(|t| {
                if t < tr {
                    visible(causal, i0 + r0 + t, j0, bk)
                } else {
                    0
                }
            });
            let nmax = ns.iter().copied().max().unwrap_or(0);
            if nmax == 0 {
                r0 += TR;
                continue;
            }
            let nv = padded(nmax, bk);
            score_tile(q, &kt, mask, d, m, i0 + r0, j0, tr, &ns, nv, &mut st);
            let mut active = [false; TR];
            let mut corr = [E::Acc::zero(); TR];
            for t in 0..tr {
                let r = r0 + t;
                let row = &mut st[t][..nv];
                let bmax = max_by(row, |x| x);
                let new_max = if bmax > mx[r] { bmax } else { mx[r] };
                if ns[t] == 0 || new_max == E::Acc::neg_infinity() {
                    // every key so far is masked: nothing to add
                    row.fill(E::Acc::zero());
                    corr[t] = E::Acc::one();
                    continue;
                }
                active[t] = true;
                corr[t] = (mx[r] - new_max).exp_k();
                for x in row.iter_mut() {
                    *x = (*x - new_max).exp_k();
                }
                sum[r] = sum[r] * corr[t] + sum_by(row, |x| x);
                mx[r] = new_max;
                for o in &mut acc[r * d.ev..(r + 1) * d.ev] {
                    *o = *o * corr[t];
                }
            }
            if active.iter().any(|&a| a) {
                let out = &mut acc[r0 * d.ev..(r0 + tr) * d.ev];
                // j indexes both the value rows and every tile row's weights
                #[allow(clippy::needless_range_loop)]
                for j in 0..nmax {
                    let vr = v.row(m, j0 + j, d.ev);
                    for (t, orow) in out.chunks_exact_mut(d.ev.max(1)).enumerate() {
                        let p = st[t][j];
                        for (o, &x) in orow.iter_mut().zip(vr) {
                            *o = *o + p * x.load();
                        }
                    }
                }
            }
            r0 += TR;
        }
        j0 += BK;
    }
    for r in 0..rows {
        // a row with every key masked is 0 / 0 = NaN, as the composed softmax gives
        let inv = E::Acc::one() / sum[r];
        for o in &mut acc[r * d.ev..(r + 1) * d.ev] {
            *o = *o * inv;
        }
        mx[r] = mx[r] + sum[r].ln();
    }
    (acc, mx)
}

/// The forward: the output written at `out_offsets[m] + i * out_row` (elements of a row
/// contiguous) in a buffer of `out_len` elements, and the log-sum-exp of every row
/// (`[bh][l]`), which the backward needs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<E: Elem + StorageElement>(
    q: &Mat<'_, E>,
    k: &Mat<'_, E>,
    v: &Mat<'_, E>,
    mask: &Mask<'_, E>,
    d: Dims,
    scale: f64,
    out_offsets: &[usize],
    out_row: usize,
    out_len: usize,
) -> (Vec<E>, Vec<E::Acc>) {
    let scale = E::Acc::c(scale);
    let qblocks = d.l.div_ceil(BQ);
    let work = d.bh * d.l * d.s * (d.e + d.ev);
    let blocks = map_tasks(d.bh * qblocks, work, |t| {
        let (m, b) = (t / qblocks, t % qblocks);
        dispatch(
            #[inline(always)]
            || forward_block(q, k, v, mask, d, scale, m, b * BQ),
        )
    });
    let mut out = take::<E>(out_len);
    let mut lse = vec![E::Acc::zero(); d.bh * d.l];
    for (t, (acc, l)) in blocks.into_iter().enumerate() {
        let (m, i0) = (t / qblocks, t % qblocks * BQ);
        for (r, row) in acc.chunks_exact(d.ev.max(1)).enumerate().take(l.len()) {
            let o = out_offsets[m] + (i0 + r) * out_row;
            for (dst, &x) in out[o..o + d.ev].iter_mut().zip(row) {
                *dst = E::store(x);
            }
        }
        lse[m * d.l + i0..m * d.l + i0 + l.len()].copy_from_slice(&l);
    }
    (out, lse)
}

/// The gradients of one matrix: `dq` (`[l][e]`), `dk` (`[s][e]`) and `dv` (`[s][ev]`) from the
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
    out: &mut [E],
) {
    let causal = matches!(mask, Mask::Causal);
    let (dq, rest) = out.split_at_mut(d.l * d.e);
    let (dk, dv) = rest.split_at_mut(d.s * d.e);
    let mut dq_acc = vec![E::Acc::zero(); d.l * d.e];
    let mut dk_acc = vec![E::Acc::zero(); d.s * d.e];
    let mut dv_acc = vec![E::Acc::zero(); d.s * d.ev];
    // D_i = g_i . o_i
    let delta: Vec<E::Acc> = (0..d.l)
        .map(|i| {
            let (gi, oi) = (g.row(m, i, d.ev), o.row(m, i, d.ev));
            gi.iter()
                .zip(oi)
                .fold(E::Acc::zero(), |a, (&x, &y)| a + x.load() * y.load())
        })
        .collect();
    let mut kt = vec![E::Acc::zero(); d.e * BK];
    let mut vt = vec![E::Acc::zero(); d.ev * BK];
    let mut p = [E::Acc::zero(); BK];
    let mut dp = [E::Acc::zero(); BK];
    let mut j0 = 0;
    while j0 < d.s {
        let bk = BK.min(d.s - j0);
        pack_t(k, m, j0, bk, d.e, scale, &mut kt);
        pack_t(v, m, j0, bk, d.ev, E::Acc::one(), &mut vt);
        let first_query = if causal { j0 } else { 0 };
        for i in first_query..d.l {
            let n = visible(causal, i, j0, bk);
            if n == 0 {
                continue;
            }
            let qi = q.row(m, i, d.e);
            let gi = g.row(m, i, d.ev);
            scores(qi, &kt, n, mask, m, i, j0, &mut p, bk);
            let nv = padded(n, bk);
            let li = lse[i];
            for x in &mut p[..nv] {
                *x = (*x - li).exp_k();
            }
            // dp_j = g_i . v_j
            let dpn = &mut dp[..nv];
            dpn.fill(E::Acc::zero());
            for (f, &gv) in gi.iter().enumerate() {
                let gv = gv.load();
                for (o, &x) in dpn.iter_mut().zip(&vt[f * BK..f * BK + nv]) {
                    *o = *o + gv * x;
                }
            }
            let dqi = &mut dq_acc[i * d.e..(i + 1) * d.e];
            for j in 0..n {
                let pj = p[j];
                // dv_j += p_ij g_i
                for (o, &x) in dv_acc[(j0 + j) * d.ev..(j0 + j + 1) * d.ev]
                    .iter_mut()
                    .zip(gi)
                {
                    *o = *o + pj * x.load();
                }
                let ds = pj * (dp[j] - delta[i]) * scale;
                // dq_i += ds k_j ; dk_j += ds q_i
                for (o, &x) in dqi.iter_mut().zip(k.row(m, j0 + j, d.e)) {
                    *o = *o + ds * x.load();
                }
                for (o, &x) in dk_acc[(j0 + j) * d.e..(j0 + j + 1) * d.e]
                    .iter_mut()
                    .zip(qi)
                {
                    *o = *o + ds * x.load();
                }
            }
        }
        j0 += BK;
    }
    for (dst, src) in [(dq, &dq_acc), (dk, &dk_acc), (dv, &dv_acc)] {
        for (o, &x) in dst.iter_mut().zip(src.iter()) {
            *o = E::store(x);
        }
    }
}

/// The backward: one buffer holding, for each matrix in turn, `dq` (`[l][e]`), `dk`
/// (`[s][e]`) and `dv` (`[s][ev]`), contiguous.
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
) -> Vec<E> {
    let scale = E::Acc::c(scale);
    let per = d.l * d.e + d.s * d.e + d.s * d.ev;
    let mut out = take::<E>(d.bh * per);
    if per == 0 {
        return out;
    }
    let work = d.bh * d.l * d.s * (d.e + d.ev) * 2;
    map_chunks(&mut out, per, work, |m, chunk| {
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
                    chunk,
                )
            },
        )
    });
    out
}
