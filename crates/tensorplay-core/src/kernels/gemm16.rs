//! Matrix products of bfloat16 and float16 matrices on the CPU: every output element is a
//! float32 sum of the exact products, rounded once to the 16-bit type (round to nearest even).
//!
//! Three paths, chosen at run time:
//! - [`Path::Dpbf16`] (bfloat16, where the processor has AVX512_BF16 and issues it fast: AMD's,
//!   see `isa::fast_bf16_dot`; the default there at every size): `VDPBF16PS`, which multiplies
//!   two pairs of bfloat16 and adds both products to a float32 lane, A and B packed as pairs
//!   of the inner dimension, with the blocking below. On the Intel Xeon measured (issue 39 in
//!   `docs/decisions.md`) one `VDPBF16PS` (64 flops) issues about every two cycles where two
//!   float32 FMAs (32 flops each) issue every cycle, so there it reaches 78-80 GFLOP/s on one
//!   thread where the FMA path reaches 120-130; on an AMD EPYC 160-185 against 100-110;
//! - [`Path::Fma`], where the kernels' capability level is AVX-512 (otherwise the default
//!   there, for both types, when every dimension is at least [`FMA_MIN_DIM`]): A and B are
//!   widened to float32 while they are packed (A into panels of [`MR`] rows, B into panels of
//!   [`NR`] columns), and a [`MR`] x [`NR`] tile is summed with float32 FMAs in 24 vector
//!   registers over blocks of the inner dimension, the sums kept in float32 between blocks;
//! - [`Path::Convert`], below AVX-512 and for smaller products: both operands converted to
//!   float32 and the float32 `gemm`.
//!
//! The `gemm` crate's own float16 product was measured too: it computes in float32 but adds
//! each block of the inner dimension into the float16 output, rounding once per block of ~256,
//! and it was slower than the FMA path (94-104 GFLOP/s against 117-126). `VDPBF16PS` treats subnormal inputs as zero and flushes
//! subnormal results; the other paths keep them.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use super::half_convert::HalfFloat;
use super::{CpuCapability, cpu_capability, with_pool};

/// Rows of the micro-kernels' tile.
const MR: usize = 12;
/// Columns of the tile: two vectors of 16 float32 lanes.
const NR: usize = 32;

/// How the work is cut into blocks (the bits of the result depend on `kb` only).
#[derive(Debug, Clone, Copy)]
pub(super) struct Blocking {
    /// Steps of the inner dimension summed per block: a B panel's block (`kb * NR` packed
    /// elements) stays in the first-level cache while the A panels pass.
    kb: usize,
    /// The most rows of output a thread's band works on at once (a multiple of [`MR`]).
    mc: usize,
    /// Columns of output per block (a multiple of [`NR`]).
    nc: usize,
}

/// The blocking every product uses: a 32 KiB block of a B panel (float32), a 192 KiB A block,
/// 384 KiB of sums (the best of those tried in `measure_1024_one_thread`).
const BLOCKING: Blocking = Blocking {
    kb: 256,
    mc: 16 * MR,
    nc: 16 * NR,
};

/// The smallest dimension of a product [`Path::Auto`] gives to the FMA kernel; smaller ones
/// are converted to float32 and run on the float32 `gemm`.
const FMA_MIN_DIM: usize = 1024;

/// B's panels packed by one call.
const PANELS: usize = 8;

/// The most packed elements per operand kept between calls (16 MiB): above it the buffers are
/// freed (their page faults are small beside the product's work).
const KEEP_PACKED: usize = 1 << 22;

/// Which kernel a product runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Path {
    /// The default: [`Path::Dpbf16`] for bfloat16 where `isa::fast_bf16_dot`, else [`Path::Fma`]
    /// for products whose dimensions are all at least [`FMA_MIN_DIM`] at capability AVX-512,
    /// else [`Path::Convert`].
    Auto,
    /// Operands widened while packed, float32 FMA micro-kernel (needs AVX-512 F).
    Fma,
    /// bfloat16 pairs, `VDPBF16PS` micro-kernel (needs AVX-512 F and BF16).
    Dpbf16,
    /// Convert to float32 and use the float32 `gemm`.
    Convert,
}

/// An operand: its elements, row stride and column stride (in elements, non-negative).
type Operand<'a, T> = (&'a [T], isize, isize);

/// `dst = lhs @ rhs` (or `dst += lhs @ rhs` with `read_dst`) for bfloat16, as
/// `ops::matmul::gemm_into`: `dst` is `m x n` row-major, `lhs` is `m x k` and `rhs` is
/// `k x n`, each walked by its row and column strides (transposed views need no copy). Each
/// element is summed in float32 (with `read_dst`, the old value added in float32 too) and
/// rounded once. With `k = 0` and no `read_dst`, `dst` becomes zeros. Uses the intra-op
/// threads above a size threshold; the bits do not depend on the thread count.
///
/// Panics if `dst` holds fewer than `m * n` elements or an operand's extent passes its slice
/// (the callers check shapes).
pub(crate) fn gemm_bf16(
    dst: &mut [bf16],
    dims: (usize, usize, usize),
    lhs: Operand<'_, bf16>,
    rhs: Operand<'_, bf16>,
    read_dst: bool,
) {
    on_pool(dims, |par| {
        gemm_on(Path::Auto, par, dst, dims, lhs, rhs, read_dst)
    });
}

/// [`gemm_bf16`] for float16.
pub(crate) fn gemm_f16(
    dst: &mut [f16],
    dims: (usize, usize, usize),
    lhs: Operand<'_, f16>,
    rhs: Operand<'_, f16>,
    read_dst: bool,
) {
    on_pool(dims, |par| {
        gemm_on(Path::Auto, par, dst, dims, lhs, rhs, read_dst)
    });
}

/// Runs `f(parallel)` inside the intra-op pool when the product is worth several threads.
fn on_pool(dims: (usize, usize, usize), f: impl FnOnce(bool) + Send) {
    let (m, n, k) = dims;
    if super::get_num_threads() > 1 && m.saturating_mul(n).saturating_mul(k) >= 1 << 18 {
        with_pool(usize::MAX, f);
    } else {
        f(false);
    }
}

/// The path `path` resolves to on this processor and capability level: `Fma` and `Dpbf16`
/// fall back to `Convert` where their instructions are missing.
pub(super) fn resolve<T: Half16>(path: Path) -> Path {
    let avx512 = cpu_capability() >= CpuCapability::Avx512;
    #[cfg(target_arch = "x86_64")]
    let bf16_dot = std::arch::is_x86_feature_detected!("avx512bf16") && T::IS_BF16;
    #[cfg(not(target_arch = "x86_64"))]
    let bf16_dot = false;
    match path {
        Path::Auto | Path::Fma if avx512 => Path::Fma,
        Path::Dpbf16 if avx512 && bf16_dot => Path::Dpbf16,
        _ => Path::Convert,
    }
}

/// The product on `path` (resolved by [`resolve`]); `par`: inside a thread pool, split the
/// work over it.
pub(super) fn gemm_on<T: Half16>(
    path: Path,
    par: bool,
    dst: &mut [T],
    dims: (usize, usize, usize),
    lhs: Operand<'_, T>,
    rhs: Operand<'_, T>,
    read_dst: bool,
) {
    if !prologue(dst, dims, &lhs, &rhs, read_dst) {
        return;
    }
    // `Auto`: bfloat16 on `VDPBF16PS` where the processor issues it fast (`fast_bf16_dot`:
    // 1.5-1.8x the other paths at every shape measured there); otherwise the FMA kernel for
    // large products only: at the GPT's shapes (an inner or outer dimension of 128 to 512)
    // converting and running the float32 `gemm` was as fast or faster (issue 39,
    // docs/decisions.md), while at 1024^3 the FMA kernel was the faster on the Xeon measured
    let (m, n, k) = dims;
    let path = match path {
        Path::Auto
            if T::IS_BF16
                && super::isa::fast_bf16_dot()
                && !has_tiny(&lhs, (m, k))
                && !has_tiny(&rhs, (k, n)) =>
        {
            Path::Dpbf16
        }
        Path::Auto if m.min(n).min(k) < FMA_MIN_DIM => Path::Convert,
        p => p,
    };
    match resolve::<T>(path) {
        Path::Fma => run(&Wide { lhs, rhs }, BLOCKING, dst, dims, read_dst, par),
        Path::Dpbf16 => run(&Pairs::of(lhs, rhs), BLOCKING, dst, dims, read_dst, par),
        _ => via_f32(dst, dims, lhs, rhs, read_dst),
    }
}

/// Whether a bfloat16 operand holds a nonzero element below 2^-63 in magnitude (subnormals
/// included): `VDPBF16PS` reads subnormal inputs as zero and flushes subnormal products and
/// sums, so such an operand takes an exact path instead (any product of two elements of
/// 2^-63 or more is a float32 normal). Scans the operand's whole extent (elements between
/// strided rows too: a false alarm only costs speed); false for float16.
fn has_tiny<T: Half16>((s, rs, cs): &Operand<'_, T>, (r, c): (usize, usize)) -> bool {
    let bits = T::bf16_bits(s);
    let span = (r - 1) * rs.unsigned_abs() + (c - 1) * cs.unsigned_abs() + 1;
    super::dispatch(
        #[inline(always)]
        || {
            bits[..span.min(bits.len())].iter().fold(false, |any, &x| {
                any | ((x & 0x7f80) < (64 << 7) && x & 0x7fff != 0)
            })
        },
    )
}

/// Checks the extents and handles the empty products; false when nothing is left to do.
fn prologue<T: Copy + Default>(
    dst: &mut [T],
    (m, n, k): (usize, usize, usize),
    lhs: &Operand<'_, T>,
    rhs: &Operand<'_, T>,
    read_dst: bool,
) -> bool {
    if m == 0 || n == 0 {
        return false;
    }
    assert!(
        dst.len() >= m * n,
        "gemm16: dst holds {} of {m} x {n}",
        dst.len()
    );
    if k == 0 {
        if !read_dst {
            dst[..m * n].fill(T::default());
        }
        return false;
    }
    let fits = |(s, rs, cs): &Operand<'_, T>, r: usize, c: usize| {
        *rs >= 0 && *cs >= 0 && (r - 1) * rs.unsigned_abs() + (c - 1) * cs.unsigned_abs() < s.len()
    };
    assert!(
        fits(lhs, m, k) && fits(rhs, k, n),
        "gemm16: an operand's extent passes its slice (or a stride is negative)"
    );
    true
}

/// The 16-bit float types' conversions to and from float32 (whole slices, vectorized through
/// [`super::half_convert`]'s branch-free element conversions).
pub(super) trait Half16: HalfFloat {
    /// Whether this is bfloat16 (the pair kernel reads its bits).
    const IS_BF16: bool;
    /// The bits of bfloat16 elements (empty for float16).
    fn bf16_bits(s: &[Self]) -> &[u16];

    /// `dst[i] = src[i]` exactly.
    fn widen(src: &[Self], dst: &mut [f32]) {
        super::dispatch(
            #[inline(always)]
            || {
                for (d, &s) in dst.iter_mut().zip(src) {
                    *d = s.up();
                }
            },
        )
    }

    /// `dst[i] = round(src[i] + dst[i])` with `add`, else `round(src[i])`, each rounded once
    /// to nearest even.
    fn narrow(src: &[f32], dst: &mut [Self], add: bool) {
        super::dispatch(
            #[inline(always)]
            || {
                if add {
                    for (d, &s) in dst.iter_mut().zip(src) {
                        *d = Self::down(s + d.up());
                    }
                } else {
                    for (d, &s) in dst.iter_mut().zip(src) {
                        *d = Self::down(s);
                    }
                }
            },
        )
    }
}

impl Half16 for bf16 {
    const IS_BF16: bool = true;
    fn bf16_bits(s: &[bf16]) -> &[u16] {
        s.reinterpret_cast()
    }
}

impl Half16 for f16 {
    const IS_BF16: bool = false;
    fn bf16_bits(_: &[f16]) -> &[u16] {
        &[]
    }
}

/// `len` elements of row `r` of `(s, rs, cs)` from column `c0`, widened into `out`
/// (`tmp`: room to gather a strided row).
fn widen_row<T: Half16>(
    (s, rs, cs): Operand<'_, T>,
    (r, c0, len): (usize, usize, usize),
    tmp: &mut Vec<T>,
    out: &mut [f32],
) {
    let (rs, cs) = (rs as usize, cs as usize);
    let at = r * rs + c0 * cs;
    if cs == 1 {
        T::widen(&s[at..at + len], &mut out[..len]);
    } else {
        tmp.clear();
        tmp.extend((0..len).map(|c| s[at + c * cs]));
        T::widen(tmp, &mut out[..len]);
    }
}

/// `r x c` of `op` widened into `out` (resized), and the strides to walk it by: a dense
/// operand (row- or column-major, as a transposed weight is) is widened in memory order and
/// keeps its strides; any other is gathered row by row into a row-major copy.
fn widen_operand<T: Half16>(
    op: Operand<'_, T>,
    (r, c): (usize, usize),
    tmp: &mut Vec<T>,
    out: &mut Vec<f32>,
) -> (isize, isize) {
    let (s, rs, cs) = op;
    let (urs, ucs) = (rs.unsigned_abs(), cs.unsigned_abs());
    let span = (r - 1) * urs + (c - 1) * ucs + 1;
    let dense = (urs == c && ucs == 1) || (urs == 1 && ucs == r);
    out.resize(out.len().max(r * c), 0.0);
    if dense && span == r * c {
        T::widen(&s[..span], &mut out[..span]);
        return (rs, cs);
    }
    for (i, o) in out[..r * c].chunks_exact_mut(c).enumerate() {
        widen_row(op, (i, 0, c), tmp, o);
    }
    (c as isize, 1)
}

thread_local! {
    /// This thread's float32 copies of A, B and the product from the last converted product,
    /// reused (at most [`KEEP_PACKED`] elements each).
    static CONVERTED: std::cell::RefCell<[Vec<f32>; 3]> =
        const { std::cell::RefCell::new([Vec::new(), Vec::new(), Vec::new()]) };
}

/// The conversion path: both operands widened to float32, the float32 product (on the intra-op
/// threads above `gemm_into`'s threshold), each element rounded once.
fn via_f32<T: Half16>(
    dst: &mut [T],
    (m, n, k): (usize, usize, usize),
    lhs: Operand<'_, T>,
    rhs: Operand<'_, T>,
    read_dst: bool,
) {
    let [mut a, mut b, mut c] = CONVERTED.with(|v| std::mem::take(&mut *v.borrow_mut()));
    let mut tmp = Vec::new();
    let (ars, acs) = widen_operand(lhs, (m, k), &mut tmp, &mut a);
    let (brs, bcs) = widen_operand(rhs, (k, n), &mut tmp, &mut b);
    c.resize(c.len().max(m * n), 0.0);
    crate::ops::matmul::gemm_into(
        &mut c[..m * n],
        (m, n, k),
        (&a, ars, acs),
        (&b, brs, bcs),
        false,
    );
    T::narrow(&c[..m * n], &mut dst[..m * n], read_dst);
    if a.len().max(b.len()).max(c.len()) <= KEEP_PACKED {
        CONVERTED.with(|v| *v.borrow_mut() = [a, b, c]);
    }
}

/// A micro-kernel and the packing it reads. A is packed in panels of [`MR`] rows, each
/// `steps(k)` groups of [`MR`] elements; B in panels of [`NR`] columns, `steps(k)` groups of
/// [`NR`]; zero past the matrices' edges.
trait Micro: Sync {
    /// A packed element: a float32, or a pair of bfloat16 along the inner dimension.
    type P: Copy + Default + Send + Sync + 'static;
    /// This thread's packed A and B of the last product, reused (allocating and faulting in
    /// fresh pages cost 15% of a 1024^3 product).
    fn cache() -> &'static std::thread::LocalKey<std::cell::RefCell<Packed<Self::P>>>;
    /// Steps for an inner dimension of `k`.
    fn steps(k: usize) -> usize;
    /// Packs rows `i0..i0 + MR` of A (`m x k`), writing every element of `panel`.
    fn pack_a(&self, panel: &mut [Self::P], i0: usize, m: usize, k: usize);
    /// Packs columns `j0..` of B (`k x n`) into the consecutive panels of [`NR`] columns
    /// that `panels` holds (at most [`PANELS`]), writing every element.
    fn pack_b(&self, panels: &mut [Self::P], j0: usize, n: usize, k: usize);
    /// One [`MR`] x [`NR`] tile over `pl` steps into `c` (row stride `ldc`), from zero when
    /// `first`, else added to `c`.
    ///
    /// # Safety
    /// The processor has the kernel's instructions (checked by [`resolve`]); `a` holds
    /// `pl * MR` and `b` `pl * NR` elements, `c` at least `(MR - 1) * ldc + NR`.
    unsafe fn tile(pl: usize, a: &[Self::P], b: &[Self::P], c: &mut [f32], ldc: usize, first: bool);
}

/// Packed A and B.
type Packed<P> = (Vec<P>, Vec<P>);

/// Packs the operands, then runs the tiles over bands of output rows (on the threads when
/// `par`), each band's blocks summed in float32 scratch and rounded once.
fn run<T: Half16, K: Micro>(
    kern: &K,
    bl: Blocking,
    dst: &mut [T],
    dims: (usize, usize, usize),
    read_dst: bool,
    par: bool,
) {
    let (mut pa, mut pb) = K::cache().with(|c| std::mem::take(&mut *c.borrow_mut()));
    pack(kern, dims, par, (&mut pa, &mut pb));
    compute::<T, K>(&pa, &pb, bl, dst, dims, read_dst, par);
    if pa.len().max(pb.len()) <= KEEP_PACKED {
        K::cache().with(|c| *c.borrow_mut() = (pa, pb));
    }
}

/// A and B packed for `kern` into `pa` and `pb` (resized; every element written): panels of
/// [`MR`] rows and of [`NR`] columns.
fn pack<K: Micro>(
    kern: &K,
    (m, n, k): (usize, usize, usize),
    par: bool,
    (pa, pb): (&mut Vec<K::P>, &mut Vec<K::P>),
) {
    let steps = K::steps(k);
    pa.resize(m.div_ceil(MR) * steps * MR, K::P::default());
    pb.resize(n.div_ceil(NR) * steps * NR, K::P::default());
    chunks(pa, steps * MR, par, |ip, panel| {
        kern.pack_a(panel, ip * MR, m, k)
    });
    chunks(pb, steps * NR * PANELS, par, |g, panels| {
        kern.pack_b(panels, g * PANELS * NR, n, k)
    });
}

/// The tiles over the packed operands, rounded into `dst`.
fn compute<T: Half16, K: Micro>(
    pa: &[K::P],
    pb: &[K::P],
    bl: Blocking,
    dst: &mut [T],
    (m, n, k): (usize, usize, usize),
    read_dst: bool,
    par: bool,
) {
    let steps = K::steps(k);
    // bands of rows: a band's height does not change any element's sum (that depends on
    // `bl.kb` only), so the bits are the same for any thread count
    let threads = if par { rayon::current_num_threads() } else { 1 };
    let band = m.div_ceil(threads).next_multiple_of(MR).clamp(MR, bl.mc);
    chunks(&mut dst[..m * n], band * n, par, |bi, rows| {
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            s.resize(bl.mc * bl.nc, 0.0);
            let h = rows.len() / n;
            for j0 in (0..n).step_by(bl.nc) {
                let w = bl.nc.min(n - j0);
                let ldc = w.next_multiple_of(NR);
                block::<K>(&mut s, pa, pb, (bi * band, h), (j0, w), (steps, bl.kb));
                for (r, out) in rows.chunks_exact_mut(n).enumerate() {
                    T::narrow(&s[r * ldc..r * ldc + w], &mut out[j0..j0 + w], read_dst);
                }
            }
        })
    });
}

thread_local! {
    /// Each thread's float32 sums of the output block it works on.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `f(i, piece)` over the `len`-element pieces of `out`, on the current pool when `par`.
fn chunks<T: Send>(out: &mut [T], len: usize, par: bool, f: impl Fn(usize, &mut [T]) + Sync) {
    if par {
        out.par_chunks_mut(len.max(1))
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    } else {
        out.chunks_mut(len.max(1))
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    }
}

/// Sums the output block rows `i0..i0 + h`, columns `j0..j0 + w` into `s` (row stride `w`
/// rounded up to [`NR`], rows rounded up to [`MR`]) over the packed panels of `steps` steps,
/// block by block of `kb` steps, each block's sums added to the previous ones.
fn block<K: Micro>(
    s: &mut [f32],
    pa: &[K::P],
    pb: &[K::P],
    (i0, h): (usize, usize),
    (j0, w): (usize, usize),
    (steps, kb): (usize, usize),
) {
    let (hp, wp) = (h.div_ceil(MR), w.div_ceil(NR));
    let ldc = wp * NR;
    assert!(s.len() >= hp * MR * ldc && i0 % MR == 0 && j0 % NR == 0);
    for p0 in (0..steps).step_by(kb) {
        let pl = kb.min(steps - p0);
        for jr in 0..wp {
            let b = &pb[((j0 / NR + jr) * steps + p0) * NR..][..pl * NR];
            for ir in 0..hp {
                let a = &pa[((i0 / MR + ir) * steps + p0) * MR..][..pl * MR];
                let c = &mut s[ir * MR * ldc + jr * NR..][..(MR - 1) * ldc + NR];
                // SAFETY: `run` is reached only through `resolve`, which checked the
                // kernel's instructions; the slices above have the lengths `tile` reads.
                unsafe { K::tile(pl, a, b, c, ldc, p0 == 0) };
            }
        }
    }
}

#[path = "gemm16_micro.rs"]
mod micro;
use micro::{Pairs, Wide};

#[cfg(test)]
#[path = "gemm16_tests.rs"]
mod tests;
