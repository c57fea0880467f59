//! Fused scaled-dot-product attention on the CPU (FlashAttention's algorithm, as PyTorch's
//! `FlashAttentionKernel.cpp`): each query block walks the key blocks with an online softmax (a
//! running maximum and sum per row), so the `[L, S]` score matrix is never stored; keys past the
//! causal diagonal are skipped; the backward ([`backward`], in `attention_backward.rs`)
//! recomputes the scores block by block from the saved log-sum-exp of each row.
//!
//! The block products (`Q K^T`, `P V`) are single-threaded matrix products of the `gemm`
//! crate; the softmax work between them runs over rows of a block. Operands are read in place
//! through their strides (the last dimension contiguous; loaded into the computing type only
//! where it is not the element type), so heads split out of a fused projection need no copy. Work is split over (batch x heads) and query blocks in the
//! forward, over (batch x heads) in the backward; each piece is computed whole by one thread
//! (the products single-threaded), so the thread count does not change a bit.

use num_traits::{Float, One, Zero};

pub(crate) use super::attention_backward::backward;
use super::isa::dispatch;
use super::math::{Elem, Real};
use super::parallel::map_tasks;
use super::rows::{LANES, sum_by};
use crate::storage::StorageElement;
use crate::storage::pool::take;

/// Query rows per block.
pub(super) const BQ: usize = 32;
/// Key rows per block (PyTorch's `kvSplitSize` for short sequences): a causal query block
/// reads only the keys up to its last row's.
pub(super) const BK: usize = 512;

/// One operand: for each (batch x heads) matrix the offset of its first row, and the stride
/// between its rows (elements within a row are contiguous).
#[derive(Debug)]
pub(crate) struct Mat<'a, E> {
    pub(crate) data: &'a [E],
    pub(crate) offsets: Vec<usize>,
    pub(crate) row: usize,
}

impl<E: Elem> Mat<'_, E> {
    /// Row `i` (its first `len` elements) of matrix `m`.
    #[inline(always)]
    pub(super) fn row(&self, m: usize, i: usize, len: usize) -> &[E] {
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

/// The least `x` whose `e^x` [`exp_normal`] computes: `ln` of the least normal number, plus a
/// margin.
#[inline(always)]
pub(super) fn exp_floor<A: Real>() -> A {
    A::min_positive_value().ln() + A::c(0.5)
}

/// `e^x`, or 0 below `lo` ([`exp_floor`]), so that no subnormal number is made: making one
/// (a masked score's `e^-inf`) costs the processor a microcode assist of about a hundred cycles.
/// NaN stays NaN.
#[inline(always)]
pub(super) fn exp_normal<A: Real>(x: A, lo: A) -> A {
    let e = (if x < lo { lo } else { x }).exp_k();
    if x < lo { A::zero() } else { e }
}

/// Masks the scores `s` of query `i` (matrix `m`) against the keys from `j0` (a bool mask's
/// false elements to `-inf`, an additive mask's elements added) and returns how many of them
/// the query may see: under a causal mask the keys from there on are hidden, and left as they
/// are for the caller.
#[inline(always)]
fn mask_row<E: Elem>(mask: &Mask<'_, E>, m: usize, i: usize, j0: usize, s: &mut [E::Acc]) -> usize {
    match mask {
        Mask::None => {}
        Mask::Causal => return (i + 1).saturating_sub(j0).min(s.len()),
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
    s.len()
}

/// A row of a score block whose first `n` columns hold scores (and whose length is a whole
/// number of [`LANES`]): masks them and splits the row into the columns whose probabilities
/// are computed, a whole number of vectors from the first (the columns past the keys the query
/// sees there set to `-inf`), and the rest, whose probabilities are 0.
#[inline(always)]
pub(super) fn live_columns<'a, E: Elem>(
    mask: &Mask<'_, E>,
    m: usize,
    i: usize,
    j0: usize,
    n: usize,
    row: &'a mut [E::Acc],
) -> (&'a mut [E::Acc], &'a mut [E::Acc]) {
    let visible = mask_row(mask, m, i, j0, &mut row[..n]);
    let live = visible.next_multiple_of(LANES).min(row.len());
    row[visible..live].fill(E::Acc::neg_infinity());
    row.split_at_mut(live)
}

/// The maximum of a row of whole vectors of [`LANES`] (NaN ignored, `-inf` when empty), the
/// lanes combined in a tree.
#[inline(always)]
fn row_max<A: Real>(x: &[A]) -> A {
    let mut acc = [A::neg_infinity(); LANES];
    for c in x.chunks_exact(LANES) {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] = if acc[l + width] > acc[l] {
                acc[l + width]
            } else {
                acc[l]
            };
        }
    }
    acc[0]
}

/// Rows `i0..i0 + n` of matrix `m` of `x` (their first `len` elements) into `out[..n * len]`,
/// loaded into the computing type.
#[inline(always)]
pub(super) fn pack<E: Elem>(
    x: &Mat<'_, E>,
    m: usize,
    i0: usize,
    n: usize,
    len: usize,
    out: &mut [E::Acc],
) {
    if len == 0 {
        return;
    }
    for (r, o) in out[..n * len].chunks_exact_mut(len).enumerate() {
        for (dst, &src) in o.iter_mut().zip(x.row(m, i0 + r, len)) {
            *dst = src.load();
        }
    }
}

/// Rows `i0..i0 + n` of matrix `m` of `x` (their first `len` elements) as an operand of [`mm`]
/// in the computing type, and the stride between its rows: read in place where the element
/// type is the computing type, else loaded into `buf` (by [`pack`]).
#[inline(always)]
pub(super) fn rows_of<'a, E: Elem>(
    x: &'a Mat<'a, E>,
    m: usize,
    i0: usize,
    n: usize,
    len: usize,
    buf: &'a mut Vec<E::Acc>,
) -> (&'a [E::Acc], usize) {
    match E::as_acc(x.data) {
        Some(data) if n > 0 && len > 0 => (&data[x.offsets[m] + i0 * x.row..], x.row),
        _ => {
            buf.resize(n * len, E::Acc::zero());
            pack(x, m, i0, n, len, buf);
            (&buf[..n * len], len)
        }
    }
}

/// The sizes `(m, n, k)` of a product of an `m x k` and a `k x n` matrix.
pub(super) type Sizes = (usize, usize, usize);

/// An operand of [`mm`]: its elements and the strides `(rows, columns)` that place element
/// `(i, j)` at `i * rows + j * columns`.
pub(super) type Operand<'a, A> = (&'a [A], (usize, usize));

/// `dst = beta * lhs rhs` (or `dst += beta * lhs rhs` with `add`) by one single-threaded `gemm`
/// call, for an `m x k` `lhs` and a `k x n` `rhs`; `dst` holds rows of `n` contiguous elements
/// `drs` apart. Panics when an operand's extent passes the end of its slice.
pub(super) fn mm<A: Real>(
    (m, n, k): Sizes,
    dst: &mut [A],
    drs: usize,
    add: bool,
    (lhs, (lrs, lcs)): Operand<'_, A>,
    (rhs, (rrs, rcs)): Operand<'_, A>,
    beta: A,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(drs >= n && (m - 1) * drs + n <= dst.len(), "mm: dst");
    if k == 0 {
        if !add {
            for r in 0..m {
                dst[r * drs..r * drs + n].fill(A::zero());
            }
        }
        return;
    }
    assert!((m - 1) * lrs + (k - 1) * lcs < lhs.len(), "mm: lhs");
    assert!((k - 1) * rrs + (n - 1) * rcs < rhs.len(), "mm: rhs");
    // SAFETY: the asserts above keep every element gemm reads or writes inside the slices
    // (strides are non-negative, so the extremes are the last row and column); `dst`'s rows do
    // not overlap (`drs >= n`), and `dst` is borrowed mutably, so it aliases neither operand.
    // `A` is f32 or f64, types gemm supports.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            drs as isize,
            add,
            lhs.as_ptr(),
            lcs as isize,
            lrs as isize,
            rhs.as_ptr(),
            rcs as isize,
            rrs as isize,
            A::one(),
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// The forward of one query block of matrix `m` (rows from `i0`): the output rows
/// (`[rows][ev]`) and each row's log-sum-exp of the scores.
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
    let zero = E::Acc::zero();
    let rows = BQ.min(d.l - i0);
    let bk = BK.min(d.s);
    let last_key = if matches!(mask, Mask::Causal) {
        (i0 + rows).min(d.s)
    } else {
        d.s
    };
    // the blocks of q, k and v where they must be loaded, and a score block whose rows are
    // whole vectors
    let (mut qbuf, mut kbuf, mut vbuf) = (Vec::new(), Vec::new(), Vec::new());
    let mut sb = vec![zero; rows * bk.next_multiple_of(LANES)];
    let (qb, qrs) = rows_of(q, m, i0, rows, d.e, &mut qbuf);
    let mut acc = vec![zero; rows * d.ev];
    let mut mx = vec![E::Acc::neg_infinity(); rows];
    let mut sum = vec![zero; rows];
    let lo = exp_floor::<E::Acc>();
    let mut j0 = 0;
    while j0 < last_key {
        let n = bk.min(last_key - j0);
        let w = n.next_multiple_of(LANES);
        let (kop, krs) = rows_of(k, m, j0, n, d.e, &mut kbuf);
        let (vop, vrs) = rows_of(v, m, j0, n, d.ev, &mut vbuf);
        let s = &mut sb[..rows * w];
        // S = scale Q K^T
        mm(
            (rows, n, d.e),
            s,
            w,
            false,
            (qb, (qrs, 1)),
            (kop, (1, krs)),
            scale,
        );
        // the rows' maxima first, then their exponentials, then their sums: the exponentials of
        // consecutive rows are independent work the processor overlaps
        let mut live = [0usize; BQ];
        let mut corr = [E::Acc::one(); BQ];
        for (r, row) in s.chunks_exact_mut(w).enumerate() {
            let (lv, dead) = live_columns(mask, m, i0 + r, j0, n, row);
            dead.fill(zero);
            let bmax = row_max(lv);
            let new_max = if bmax > mx[r] { bmax } else { mx[r] };
            if new_max == E::Acc::neg_infinity() {
                // every key so far is masked: nothing to add
                lv.fill(zero);
                continue;
            }
            live[r] = lv.len();
            if mx[r] != E::Acc::neg_infinity() {
                corr[r] = exp_normal(mx[r] - new_max, lo);
            } else {
                // (a row that saw no key yet holds zeros)
                corr[r] = zero;
            }
            mx[r] = new_max;
        }
        for (r, row) in s.chunks_exact_mut(w).enumerate() {
            let shift = mx[r];
            for x in &mut row[..live[r]] {
                *x = exp_normal(*x - shift, lo);
            }
        }
        for (r, row) in s.chunks_exact(w).enumerate() {
            if live[r] == 0 {
                continue;
            }
            sum[r] = sum[r] * corr[r] + sum_by(&row[..live[r]], |x| x);
            if corr[r] != E::Acc::one() && corr[r] != zero {
                for o in &mut acc[r * d.ev..(r + 1) * d.ev] {
                    *o = *o * corr[r];
                }
            }
        }
        // O += P V
        mm(
            (rows, d.ev, n),
            &mut acc,
            d.ev,
            true,
            (s, (w, 1)),
            (vop, (vrs, 1)),
            E::Acc::one(),
        );
        j0 += bk;
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
