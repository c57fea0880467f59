//! The two micro-kernels of the 16-bit products and their packing: float32 FMAs over operands
//! widened while packed ([`Wide`]), and `VDPBF16PS` over bfloat16 pairs ([`Pairs`]).

use std::cell::RefCell;
use std::thread::LocalKey;

use super::{Half16, MR, Micro, NR, Operand, Packed, widen_row};

thread_local! {
    static WIDE: RefCell<Packed<f32>> = const { RefCell::new((Vec::new(), Vec::new())) };
    static PAIRS: RefCell<Packed<u32>> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Operands widened to float32 while packed; float32 FMA tiles.
pub(super) struct Wide<'a, T> {
    pub(super) lhs: Operand<'a, T>,
    pub(super) rhs: Operand<'a, T>,
}

impl<T: Half16> Micro for Wide<'_, T> {
    type P = f32;

    fn cache() -> &'static LocalKey<RefCell<Packed<f32>>> {
        &WIDE
    }

    fn steps(k: usize) -> usize {
        k
    }

    fn pack_a(&self, panel: &mut [f32], i0: usize, m: usize, k: usize) {
        let mut row = vec![0.0f32; k];
        let mut tmp = Vec::new();
        let h = MR.min(m - i0);
        for r in 0..h {
            widen_row(self.lhs, (i0 + r, 0, k), &mut tmp, &mut row);
            for (g, &x) in panel.chunks_exact_mut(MR).zip(&row) {
                g[r] = x;
            }
        }
        if h < MR {
            for g in panel.chunks_exact_mut(MR) {
                g[h..].fill(0.0);
            }
        }
    }

    fn pack_b(&self, panels: &mut [f32], j0: usize, n: usize, k: usize) {
        // a row of B is widened once for all the panels of the group (one conversion call per
        // row and group rather than per row and panel)
        let count = panels.len() / (k * NR);
        let w = (count * NR).min(n - j0);
        let mut row = vec![0.0f32; count * NR];
        let mut tmp = Vec::new();
        for p in 0..k {
            widen_row(self.rhs, (p, j0, w), &mut tmp, &mut row);
            for (q, src) in row.chunks_exact(NR).enumerate() {
                panels[(q * k + p) * NR..][..NR].copy_from_slice(src);
            }
        }
    }

    #[inline]
    unsafe fn tile(pl: usize, a: &[f32], b: &[f32], c: &mut [f32], ldc: usize, first: bool) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract is `fma_tile`'s
        unsafe {
            fma_tile(pl, a, b, c, ldc, first)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!(
            "gemm16: the FMA path on a processor without AVX-512 ({pl} {a:?} {b:?} {c:?} {ldc} {first})"
        )
    }
}

/// bfloat16 operands packed as pairs along the inner dimension (bits, strides); `VDPBF16PS`
/// tiles.
pub(super) struct Pairs<'a> {
    lhs: (&'a [u16], usize, usize),
    rhs: (&'a [u16], usize, usize),
}

impl<'a> Pairs<'a> {
    /// The bfloat16 operands' bits (`T` is bfloat16 where this path is chosen).
    pub(super) fn of<T: Half16>(lhs: Operand<'a, T>, rhs: Operand<'a, T>) -> Pairs<'a> {
        let bits = |(s, rs, cs): Operand<'a, T>| (T::bf16_bits(s), rs as usize, cs as usize);
        Pairs {
            lhs: bits(lhs),
            rhs: bits(rhs),
        }
    }
}

impl Micro for Pairs<'_> {
    /// `(x[2p], x[2p+1])`: the lower half the even element.
    type P = u32;

    fn cache() -> &'static LocalKey<RefCell<Packed<u32>>> {
        &PAIRS
    }

    fn steps(k: usize) -> usize {
        k.div_ceil(2)
    }

    fn pack_a(&self, panel: &mut [u32], i0: usize, m: usize, k: usize) {
        let (a, rs, cs) = self.lhs;
        let h = MR.min(m - i0);
        if h < MR {
            panel.fill(0);
        }
        if cs != 1 {
            // step by step: a transposed A's rows are adjacent within a step
            for (p, g) in panel.chunks_exact_mut(MR).enumerate() {
                let (c0, c1) = (2 * p * cs, (2 * p + 1) * cs);
                for (r, g) in g[..h].iter_mut().enumerate() {
                    let at = (i0 + r) * rs;
                    *g = pair(a[at + c0], if 2 * p + 1 < k { a[at + c1] } else { 0 });
                }
            }
            return;
        }
        // row by row: a row's pairs are adjacent elements
        for r in 0..h {
            let at = (i0 + r) * rs;
            let row = &a[at..at + k];
            let (pairs, odd) = row.split_at(k & !1);
            let pairs = pairs.chunks_exact(2).map(|x| pair(x[0], x[1]));
            let dst = panel.iter_mut().skip(r).step_by(MR);
            for (g, v) in dst.zip(pairs.chain(odd.iter().map(|&x| pair(x, 0)))) {
                *g = v;
            }
        }
    }

    fn pack_b(&self, panels: &mut [u32], j0: usize, n: usize, k: usize) {
        let panel_len = k.div_ceil(2) * NR;
        for (q, panel) in panels.chunks_exact_mut(panel_len).enumerate() {
            self.pack_b_panel(panel, j0 + q * NR, n, k);
        }
    }

    #[inline]
    unsafe fn tile(pl: usize, a: &[u32], b: &[u32], c: &mut [f32], ldc: usize, first: bool) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract is `dpbf16_tile`'s
        unsafe {
            dpbf16_tile(pl, a, b, c, ldc, first)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!(
            "gemm16: VDPBF16PS on a processor without it ({pl} {a:?} {b:?} {c:?} {ldc} {first})"
        )
    }
}

impl Pairs<'_> {
    /// [`Micro::pack_b`] of one panel (columns `j0..j0 + NR`, some of them past `n`).
    fn pack_b_panel(&self, panel: &mut [u32], j0: usize, n: usize, k: usize) {
        let (b, rs, cs) = self.rhs;
        let w = NR.min(n.saturating_sub(j0));
        if w < NR {
            panel.fill(0);
        }
        if rs == 1 {
            // columns contiguous (a transposed weight): a column's pairs are adjacent
            for j in 0..w {
                let col = &b[(j0 + j) * cs..(j0 + j) * cs + k];
                let (pairs, odd) = col.split_at(k & !1);
                let pairs = pairs.chunks_exact(2).map(|x| pair(x[0], x[1]));
                let dst = panel.iter_mut().skip(j).step_by(NR);
                for (g, v) in dst.zip(pairs.chain(odd.iter().map(|&x| pair(x, 0)))) {
                    *g = v;
                }
            }
            return;
        }
        // rows contiguous (or neither): two rows interleaved per step
        for (p, g) in panel.chunks_exact_mut(NR).enumerate() {
            let (k0, k1) = (2 * p * rs, (2 * p + 1) * rs);
            let g = &mut g[..w];
            if 2 * p + 1 < k && cs == 1 {
                let (r0, r1) = (&b[k0 + j0..k0 + j0 + w], &b[k1 + j0..k1 + j0 + w]);
                for (g, (&lo, &hi)) in g.iter_mut().zip(r0.iter().zip(r1)) {
                    *g = pair(lo, hi);
                }
            } else {
                for (j, g) in g.iter_mut().enumerate() {
                    let c = (j0 + j) * cs;
                    *g = pair(b[k0 + c], if 2 * p + 1 < k { b[k1 + c] } else { 0 });
                }
            }
        }
    }
}

/// Two bfloat16 (bits) as one packed pair: `lo` in the low half (the even step).
#[inline(always)]
fn pair(lo: u16, hi: u16) -> u32 {
    u32::from(lo) | u32::from(hi) << 16
}

/// Writes (or with `!first` adds onto `c`) the `MR x 2` vectors of `acc`'s tile: the body of
/// both tiles, `$step(p, &mut acc)` adding step `p`.
macro_rules! tile_body {
    ($pl:expr, $c:expr, $ldc:expr, $first:expr, |$p:ident, $acc:ident| $step:block) => {{
        use std::arch::x86_64::*;
        let (c, ldc) = ($c, $ldc);
        debug_assert!(c.len() >= (MR - 1) * ldc + NR);
        let cp = c.as_mut_ptr();
        let mut $acc = [[_mm512_setzero_ps(); 2]; MR];
        if !$first {
            for (r, row) in $acc.iter_mut().enumerate() {
                // SAFETY: row r's 32 floats lie within `c` (length asserted by the caller)
                unsafe {
                    row[0] = _mm512_loadu_ps(cp.add(r * ldc));
                    row[1] = _mm512_loadu_ps(cp.add(r * ldc + 16));
                }
            }
        }
        for $p in 0..$pl {
            $step
        }
        for (r, row) in $acc.iter().enumerate() {
            // SAFETY: as above
            unsafe {
                _mm512_storeu_ps(cp.add(r * ldc), row[0]);
                _mm512_storeu_ps(cp.add(r * ldc + 16), row[1]);
            }
        }
    }};
}

/// [`Wide`]'s tile: `c[r][j] (+)= sum_p a[p][r] * b[p][j]` with float32 FMAs.
///
/// # Safety
/// The processor has AVX-512 F; `a` holds `pl * MR`, `b` `pl * NR` and `c` at least
/// `(MR - 1) * ldc + NR` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn fma_tile(pl: usize, a: &[f32], b: &[f32], c: &mut [f32], ldc: usize, first: bool) {
    debug_assert!(a.len() >= pl * MR && b.len() >= pl * NR);
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    tile_body!(pl, c, ldc, first, |p, acc| {
        // SAFETY: p < pl, within `a` and `b` by the contract
        let (b0, b1) = unsafe {
            (
                _mm512_loadu_ps(bp.add(p * NR)),
                _mm512_loadu_ps(bp.add(p * NR + 16)),
            )
        };
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: as above
            let av = _mm512_set1_ps(unsafe { *ap.add(p * MR + r) });
            row[0] = _mm512_fmadd_ps(av, b0, row[0]);
            row[1] = _mm512_fmadd_ps(av, b1, row[1]);
        }
    });
}

/// [`Pairs`]' tile: `c[r][j] (+)= sum_p dot(a[p][r], b[p][j])` over bfloat16 pairs.
///
/// # Safety
/// The processor has AVX-512 F and BF16; `a` holds `pl * MR` and `b` `pl * NR` pairs, `c` at
/// least `(MR - 1) * ldc + NR` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dpbf16_tile(pl: usize, a: &[u32], b: &[u32], c: &mut [f32], ldc: usize, first: bool) {
    debug_assert!(a.len() >= pl * MR && b.len() >= pl * NR);
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    tile_body!(pl, c, ldc, first, |p, acc| {
        // SAFETY: p < pl, within `a` and `b`; `__m512i` and `__m512bh` are both 64 bytes of
        // plain bits
        let (b0, b1): (__m512bh, __m512bh) = unsafe {
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(bp.add(p * NR).cast())),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    bp.add(p * NR + 16).cast(),
                )),
            )
        };
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: as above
            let av: __m512bh = unsafe {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                    *ap.add(p * MR + r) as i32
                ))
            };
            row[0] = _mm512_dpbf16_ps(row[0], av, b0);
            row[1] = _mm512_dpbf16_ps(row[1], av, b1);
        }
    });
}
