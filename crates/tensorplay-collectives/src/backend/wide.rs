//! Reductions of bfloat16 and float16 buffers in float32, rounding once.
//!
//! [`reduce_many`] reduces a destination and any number of sources in one pass: for 16-bit
//! dtypes each element is widened to float32, reduced in float32 across all the sources, divided
//! (for `Avg`) and rounded once to the 16-bit type (round to nearest even, NaN kept), so a
//! sum over `w` ranks rounds once rather than `w - 1` times. The pass runs in cache-sized
//! pieces, one monomorphic loop per op compiled for the processor's vector instructions, with
//! the core's branch-free conversions (`tensorplay_core::half_convert`) fused into it, so the loops vectorize.
//! float32, float64 and int64 buffers reduce pairwise as [`reduce_into`] does (bit for bit the
//! same as before).
//!
//! [`widen`] and [`narrow`] convert whole buffers for the paths where partial sums travel in
//! float32 (the TCP ring: see `cpu::route`).

use tensorplay_core::half_convert::HalfFloat as Half;
use tensorplay_core::{DType, bf16, f16, with_cpu_capability};

use super::{BufMut, BufRef, reduce_into};
use crate::{Error, ReduceOp, Result};

/// Elements reduced per piece (16 KiB of float32 accumulators: stays in L1).
const PIECE: usize = 4096;

/// Whether `dtype` is reduced in float32 with one rounding (bfloat16, float16).
pub(crate) fn is_16bit(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `dst = dst op srcs[0] op srcs[1] op ...` elementwise, `dst` holding the first operand.
/// For 16-bit dtypes: computed in float32, divided by `avg` when given (the `Avg` of that
/// many ranks), and rounded once; other dtypes reduce pairwise (`avg` must be `None`: their
/// caller divides). Errors when a source's dtype or length differs from `dst`'s, or `op` does
/// not apply to the dtype.
pub(crate) fn reduce_many(
    op: ReduceOp,
    dst: &mut BufMut<'_>,
    srcs: &[BufRef<'_>],
    avg: Option<usize>,
) -> Result<()> {
    let bad = |s: &BufRef<'_>| s.dtype() != dst.dtype() || s.len() != dst.len();
    if let Some(s) = srcs.iter().find(|s| bad(s)) {
        return Err(Error::invalid(
            "reduce",
            -1,
            "buffers",
            format!("{} {} elements", dst.len(), dst.dtype()),
            format!("{} {} elements", s.len(), s.dtype()),
        ));
    }
    match dst.reborrow() {
        BufMut::BF16(d) => {
            let s: Vec<&[bf16]> = srcs.iter().filter_map(|s| bf16_of(*s)).collect();
            wide(op, d, &s, avg)
        }
        BufMut::F16(d) => {
            let s: Vec<&[f16]> = srcs.iter().filter_map(|s| f16_of(*s)).collect();
            wide(op, d, &s, avg)
        }
        _ => {
            for s in srcs {
                reduce_into(op, dst, *s)?;
            }
            Ok(())
        }
    }
}

fn bf16_of(b: BufRef<'_>) -> Option<&[bf16]> {
    match b {
        BufRef::BF16(s) => Some(s),
        _ => None,
    }
}

fn f16_of(b: BufRef<'_>) -> Option<&[f16]> {
    match b {
        BufRef::F16(s) => Some(s),
        _ => None,
    }
}

/// The 16-bit reduction of `op`: checks the op, then runs [`wide_with`] with it as a
/// closure (one monomorphic loop per op, so the element loops vectorize).
fn wide<T: Half>(op: ReduceOp, d: &mut [T], srcs: &[&[T]], avg: Option<usize>) -> Result<()> {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => wide_with(d, srcs, avg, |a, b| a + b),
        ReduceOp::Product => wide_with(d, srcs, avg, |a, b| a * b),
        // NaN wins, as in `reduce_into`
        ReduceOp::Max => wide_with(d, srcs, avg, |a, b| if b > a || b.is_nan() { b } else { a }),
        ReduceOp::Min => wide_with(d, srcs, avg, |a, b| if b < a || b.is_nan() { b } else { a }),
        _ => {
            return Err(Error::invalid(
                "reduce",
                -1,
                "op",
                "Sum, Product, Min, Max or Avg for floating tensors",
                format!("{op:?}"),
            ));
        }
    }
    Ok(())
}

/// `d = fin(d f s0 f s1 ...)` rounded once, with `fin` dividing by `avg` when given;
/// compiled for the processor's vector instructions ([`with_cpu_capability`]).
#[inline(always)]
fn wide_with<T: Half>(
    d: &mut [T],
    srcs: &[&[T]],
    avg: Option<usize>,
    f: impl Fn(f32, f32) -> f32 + Copy,
) {
    with_cpu_capability(
        #[inline(always)]
        || match avg {
            Some(n) => {
                let n = n as f32;
                wide_pieces(d, srcs, f, move |x| x / n)
            }
            None => wide_pieces(d, srcs, f, |x| x),
        },
    )
}

/// The reduction in pieces of [`PIECE`] elements, widening, the first and last sources and
/// the rounding fused into the passes over float32 accumulators (one pass for two ranks).
#[inline(always)]
fn wide_pieces<T: Half>(
    d: &mut [T],
    srcs: &[&[T]],
    f: impl Fn(f32, f32) -> f32 + Copy,
    fin: impl Fn(f32) -> f32 + Copy,
) {
    let (up, down) = (T::up, T::down);
    let mut acc = [0f32; PIECE];
    let mut at = 0;
    while at < d.len() {
        let m = PIECE.min(d.len() - at);
        let (a, dd) = (&mut acc[..m], &mut d[at..at + m]);
        match srcs {
            [] => dd.iter_mut().for_each(|d| *d = down(fin(up(*d)))),
            [s] => dd
                .iter_mut()
                .zip(&s[at..at + m])
                .for_each(|(d, &x)| *d = down(fin(f(up(*d), up(x))))),
            [first, middle @ .., last] => {
                a.iter_mut()
                    .zip(dd.iter().zip(&first[at..at + m]))
                    .for_each(|(a, (&d, &x))| *a = f(up(d), up(x)));
                for s in middle {
                    a.iter_mut()
                        .zip(&s[at..at + m])
                        .for_each(|(a, &x)| *a = f(*a, up(x)));
                }
                dd.iter_mut()
                    .zip(a.iter().zip(&last[at..at + m]))
                    .for_each(|(d, (&a, &x))| *d = down(fin(f(a, up(x)))));
            }
        }
        at += m;
    }
}

/// `b`'s elements widened to float32 (exact).
pub(crate) fn widen(b: BufRef<'_>) -> Vec<f32> {
    fn up<T: Half>(s: &[T]) -> Vec<f32> {
        with_cpu_capability(
            #[inline(always)]
            || s.iter().map(|&x| T::up(x)).collect(),
        )
    }
    match b {
        BufRef::BF16(s) => up(s),
        BufRef::F16(s) => up(s),
        BufRef::F32(s) => s.to_vec(),
        BufRef::F64(s) => s.iter().map(|&x| x as f32).collect(),
        BufRef::I64(s) => s.iter().map(|&x| x as f32).collect(),
    }
}

/// Rounds float32 `src` once into the 16-bit `dst` (same length), dividing by `avg` first when
/// given. Other dtypes are left alone (not called for them).
pub(crate) fn narrow(src: &[f32], dst: &mut BufMut<'_>, avg: Option<usize>) {
    fn down<T: Half>(src: &[f32], d: &mut [T], avg: Option<usize>) {
        let n = avg.map_or(1.0, |n| n as f32);
        with_cpu_capability(
            #[inline(always)]
            || match avg {
                Some(_) => d
                    .iter_mut()
                    .zip(src)
                    .for_each(|(d, &x)| *d = T::down(x / n)),
                None => d.iter_mut().zip(src).for_each(|(d, &x)| *d = T::down(x)),
            },
        )
    }
    match dst {
        BufMut::BF16(d) => down(src, d, avg),
        BufMut::F16(d) => down(src, d, avg),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One reduction of three rank values: the float64 result, rounded once, is expected.
    struct Case {
        name: &'static str,
        op: ReduceOp,
        xs: [f32; 3],
        avg: Option<usize>,
        want: f64,
    }

    fn check(c: &Case) {
        let v: Vec<[bf16; 1]> = c.xs.iter().map(|&x| [bf16::from_f32(x)]).collect();
        let mut d = v[0];
        let srcs = [BufRef::BF16(&v[1]), BufRef::BF16(&v[2])];
        reduce_many(c.op, &mut BufMut::BF16(&mut d), &srcs, c.avg).expect(c.name);
        let want = bf16::from_f64(c.want);
        assert!(
            d[0] == want || (d[0].is_nan() && want.is_nan()),
            "{}: got {}, want {}",
            c.name,
            d[0],
            want
        );
        let mut h = c.xs.map(f16::from_f32);
        let (a, rest) = h.split_at_mut(1);
        let srcs = [BufRef::F16(&rest[0..1]), BufRef::F16(&rest[1..2])];
        reduce_many(c.op, &mut BufMut::F16(a), &srcs, c.avg).expect(c.name);
        let want = f16::from_f64(c.want);
        assert!(
            a[0] == want || (a[0].is_nan() && want.is_nan()),
            "{} (f16): got {}, want {}",
            c.name,
            a[0],
            want
        );
    }

    #[test]
    fn sixteen_bit_reductions_round_once() {
        // 256 + 1 + 1: pairwise in bfloat16 rounds 257 to 256 twice (256); once: 258
        let cases = [
            Case {
                name: "sum rounds once",
                op: ReduceOp::Sum,
                xs: [256.0, 1.0, 1.0],
                avg: None,
                want: 258.0,
            },
            Case {
                name: "avg divides before rounding",
                op: ReduceOp::Avg,
                xs: [256.0, 1.0, 1.0],
                avg: Some(3),
                want: 86.0,
            },
            Case {
                name: "product",
                op: ReduceOp::Product,
                xs: [3.0, 5.0, 7.0],
                avg: None,
                want: 105.0,
            },
            Case {
                name: "max",
                op: ReduceOp::Max,
                xs: [-1.0, 2.5, 0.5],
                avg: None,
                want: 2.5,
            },
            Case {
                name: "min keeps NaN",
                op: ReduceOp::Min,
                xs: [1.0, f32::NAN, 0.5],
                avg: None,
                want: f64::NAN,
            },
            Case {
                name: "infinity",
                op: ReduceOp::Sum,
                xs: [f32::INFINITY, 1.0, 1.0],
                avg: None,
                want: f64::INFINITY,
            },
        ];
        for c in &cases {
            check(c);
        }
    }
}
