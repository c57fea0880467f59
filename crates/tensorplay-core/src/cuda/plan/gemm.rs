//! The cuBLAS GEMM of a matrix product: operands' transposes, leading dimensions and batch
//! strides from their views.

use crate::Layout;

/// A matrix product as one cuBLAS strided-batched GEMM call, in cuBLAS's column-major terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Gemm {
    pub(crate) transa: bool,
    pub(crate) transb: bool,
    pub(crate) m: i32,
    pub(crate) n: i32,
    pub(crate) k: i32,
    /// Elements from the first operand's base (cuBLAS's A: our right-hand side).
    pub(crate) a_offset: usize,
    pub(crate) lda: i32,
    pub(crate) stride_a: i64,
    pub(crate) b_offset: usize,
    pub(crate) ldb: i32,
    pub(crate) stride_b: i64,
    pub(crate) ldc: i32,
    pub(crate) stride_c: i64,
    pub(crate) batch: i32,
}

/// A 3-d operand `[batch, rows, cols]` cuBLAS can read in place: one batch stride (0 when
/// broadcast) and rows or columns contiguous. Returns (transposed in row-major terms, leading
/// dimension, batch stride, offset), or `None` when a copy is needed first.
fn gemm_operand(l: &Layout) -> Option<(bool, usize, usize, usize)> {
    let (shape, st) = (&l.shape, &l.strides);
    let (r, c) = (shape[1], shape[2]);
    let batch_stride = if shape[0] <= 1 { 0 } else { st[0] };
    if st[2] == 1 || c == 1 {
        let ld = if r <= 1 { c.max(1) } else { st[1] };
        if ld >= c.max(1) {
            return Some((false, ld, batch_stride, l.offset));
        }
    }
    if st[1] == 1 || r == 1 {
        let ld = if c <= 1 { r.max(1) } else { st[2] };
        if ld >= r.max(1) {
            return Some((true, ld, batch_stride, l.offset));
        }
    }
    None
}

/// The GEMM computing row-major `C[b] = A[b] @ B[b]` for 3-d views `a: [batch|1, m, k]` and
/// `b: [batch|1, k, n]` into a contiguous `C: [batch, m, n]`; `None` when an operand must be
/// made contiguous first (see `gemm_operand`) or a size exceeds cuBLAS's 32-bit ints.
pub(crate) fn gemm(la: &Layout, lb: &Layout, batch: usize) -> Option<Gemm> {
    let (m, k, n) = (la.shape[1], la.shape[2], lb.shape[2]);
    let (ta, lda, sa, oa) = gemm_operand(la)?;
    let (tb, ldb, sb, ob) = gemm_operand(lb)?;
    let fits = |v: usize| i32::try_from(v).is_ok();
    if ![m, n, k, lda, ldb, batch].into_iter().all(fits) {
        return None;
    }
    // row-major C = A B is column-major C^T = B^T A^T: cuBLAS's first operand is our B. A
    // row-major (untransposed) matrix read column-major is its transpose, so it goes in as is.
    Some(Gemm {
        transa: tb,
        transb: ta,
        m: n as i32,
        n: m as i32,
        k: k as i32,
        a_offset: ob,
        lda: ldb as i32,
        stride_a: sb as i64,
        b_offset: oa,
        ldb: lda as i32,
        stride_b: sa as i64,
        ldc: n.max(1) as i32,
        stride_c: (m * n) as i64,
        batch: batch as i32,
    })
}
