//! Reductions of bfloat16 and float16 buffers in float32, rounding once.
//!
//! [`reduce_many`] reduces a destination and any number of sources in one pass: for 16-bit
//! dtypes each element is widened to float32, reduced in float32 across all the sources, divided
//! (for `Avg`) and rounded once to the 16-bit type (round to nearest even, NaN kept), so a
//! sum over `w` ranks rounds once rather than `w - 1` times. The pass runs in cache-sized
//! pieces, with bit-level widening and rounding for bfloat16 that the compiler vectorizes.
//! float32, float64 and int64 buffers reduce pairwise as [`reduce_into`] does (bit for bit the
//! same as before).
//!
//! [`widen`] and [`narrow`] convert whole buffers for the paths where partial sums travel in
//! float32 (the TCP ring: see `cpu::route`).

use tensorplay_core::{DType, bf16, f16};

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
            wide(op, d, &s, avg, bf16_to_f32, f32_to_bf16)
        }
        BufMut::F16(d) => {
            let s: Vec<&[f16]> = srcs.iter().filter_map(|s| f16_of(*s)).collect();
            wide(op, d, &s, avg, f16::to_f32, f16::from_f32)
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

/// bfloat16 to float32: exact (the high half of the float32 bits).
#[inline(always)]
fn bf16_to_f32(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// float32 to bfloat16, round to nearest even; NaN stays NaN (quieted), infinities stay.
#[inline(always)]
fn f32_to_bf16(x: f32) -> bf16 {
    let b = x.to_bits();
    if x.is_nan() {
        return bf16::from_bits(((b >> 16) | 0x0040) as u16);
    }
    let round = 0x7fff + ((b >> 16) & 1);
    bf16::from_bits((b.wrapping_add(round) >> 16) as u16)
}

/// The 16-bit reduction: per piece, float32 accumulators from `d`, every source reduced in,
/// divided, rounded once into `d`.
fn wide<T: Copy>(
    op: ReduceOp,
    d: &mut [T],
    srcs: &[&[T]],
    avg: Option<usize>,
    up: impl Fn(T) -> f32 + Copy,
    down: impl Fn(f32) -> T + Copy,
) -> Result<()> {
    let f: fn(f32, f32) -> f32 = match op {
        ReduceOp::Sum | ReduceOp::Avg => |a, b| a + b,
        ReduceOp::Product => |a, b| a * b,
        // NaN wins, as in `reduce_into`
        ReduceOp::Max => |a, b| if b > a || b.is_nan() { b } else { a },
        ReduceOp::Min => |a, b| if b < a || b.is_nan() { b } else { a },
        _ => {
            return Err(Error::invalid(
                "reduce",
                -1,
                "op",
                "Sum, Product, Min, Max or Avg for floating tensors",
                format!("{op:?}"),
            ));
        }
    };
    let scale = avg.map(|n| n as f32);
    let mut acc = [0f32; PIECE];
    let mut at = 0;
    while at < d.len() {
        let m = PIECE.min(d.len() - at);
        let (a, dd) = (&mut acc[..m], &mut d[at..at + m]);
        a.iter_mut().zip(dd.iter()).for_each(|(a, &x)| *a = up(x));
        for s in srcs {
            a.iter_mut()
                .zip(&s[at..at + m])
                .for_each(|(a, &x)| *a = f(*a, up(x)));
        }
        if let Some(n) = scale {
            a.iter_mut().for_each(|a| *a /= n);
        }
        dd.iter_mut().zip(a.iter()).for_each(|(x, &a)| *x = down(a));
        at += m;
    }
    Ok(())
}

/// `b`'s elements widened to float32 (exact).
pub(crate) fn widen(b: BufRef<'_>) -> Vec<f32> {
    match b {
        BufRef::BF16(s) => s.iter().map(|&x| bf16_to_f32(x)).collect(),
        BufRef::F16(s) => s.iter().map(|&x| x.to_f32()).collect(),
        BufRef::F32(s) => s.to_vec(),
        BufRef::F64(s) => s.iter().map(|&x| x as f32).collect(),
        BufRef::I64(s) => s.iter().map(|&x| x as f32).collect(),
    }
}

/// Rounds float32 `src` once into the 16-bit `dst` (same length), dividing by `avg` first when
/// given. Other dtypes are left alone (not called for them).
pub(crate) fn narrow(src: &[f32], dst: &mut BufMut<'_>, avg: Option<usize>) {
    let n = avg.map_or(1.0, |n| n as f32);
    match dst {
        BufMut::BF16(d) => d
            .iter_mut()
            .zip(src)
            .for_each(|(d, &x)| *d = f32_to_bf16(if avg.is_some() { x / n } else { x })),
        BufMut::F16(d) => d
            .iter_mut()
            .zip(src)
            .for_each(|(d, &x)| *d = f16::from_f32(if avg.is_some() { x / n } else { x })),
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

    #[test]
    fn bf16_rounding_matches_half_on_every_pattern() {
        for hi in 0..=u16::MAX {
            for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                let x = f32::from_bits(((hi as u32) << 16) | lo);
                let (got, want) = (f32_to_bf16(x), bf16::from_f32(x));
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{x:e} ({:#x}): got {:#x}, want {:#x}",
                    x.to_bits(),
                    got.to_bits(),
                    want.to_bits()
                );
            }
        }
    }
}
