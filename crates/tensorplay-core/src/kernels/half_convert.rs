//! Conversions between float32 and the 16-bit float types, branch-free so that a loop of them
//! vectorizes (the `half` crate's per-element conversions branch, or call F16C one element at
//! a time). Every function gives the same bits as `half`'s for every input, except which NaN a
//! NaN becomes (always a NaN). The kernels' loads and stores (`math::Elem`) and the
//! collectives' 16-bit reductions use them.

use half::{bf16, f16};

/// bfloat16 to float32: exact (the bfloat16 bits are float32's high half).
#[inline(always)]
pub fn bf16_to_f32(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// float32 to bfloat16, rounded to nearest even; infinities kept, NaN stays NaN (quieted),
/// values beyond bfloat16's largest round to infinity.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> bf16 {
    let b = x.to_bits();
    let quiet = ((b >> 16) | 0x0040) as u16;
    let round = 0x7fff + ((b >> 16) & 1);
    let rounded = (b.wrapping_add(round) >> 16) as u16;
    bf16::from_bits(if x.is_nan() { quiet } else { rounded })
}

/// float16 to float32: exact (subnormals included; infinities and NaN kept).
#[inline(always)]
pub fn f16_to_f32(x: f16) -> f32 {
    let h = x.to_bits() as u32;
    // exponent and mantissa moved into float32's fields and scaled by 2^(127 - 15): exact for
    // normals, and for subnormals, which land as float32 subnormals and come out normal
    let scaled = f32::from_bits((h & 0x7fff) << 13) * f32::from_bits((254 - 15) << 23);
    // float16's exponent 31 (infinity, NaN) scales to 2^16 or more: give it float32's 255
    let special = if scaled >= f32::from_bits((127 + 16) << 23) {
        0x7f80_0000
    } else {
        0
    };
    f32::from_bits(scaled.to_bits() | special | ((h & 0x8000) << 16))
}

/// float32 to float16, rounded to nearest even; magnitudes from 65520 up and infinities give
/// infinity, tiny values round to subnormals or zero, NaN stays NaN (quieted).
#[inline(always)]
pub fn f32_to_f16(x: f32) -> f16 {
    let b = x.to_bits();
    let sign = (b >> 16) & 0x8000;
    let a = b & 0x7fff_ffff;
    let nan = 0x7e00 | ((a >> 13) & 0x3ff);
    // normal results: rebias the exponent and round the 13 dropped bits to nearest even (a
    // carry out of the mantissa moves the exponent on, up to infinity)
    let normal = a
        .wrapping_sub((127 - 15) << 23)
        .wrapping_add(0x0fff + ((a >> 13) & 1))
        >> 13;
    // subnormal results: adding 0.5 (whose last place is float16's smallest subnormal) lets
    // float32's own rounding round; the mantissa left is the subnormal's bits
    let half = f32::from_bits(126 << 23);
    let subnormal = (f32::from_bits(a) + half)
        .to_bits()
        .wrapping_sub(half.to_bits());
    let o = if a > 0x7f80_0000 {
        nan
    } else if a >= (127 + 16) << 23 {
        0x7c00
    } else if a < 113 << 23 {
        subnormal
    } else {
        normal
    };
    f16::from_bits((o | sign) as u16)
}

/// The 16-bit float types with the conversions above, for code generic over both (the
/// kernels' loads and stores, the 16-bit matrix products, the collectives' reductions).
pub trait HalfFloat: Copy + Default + Send + Sync + 'static {
    /// The element widened to float32 (exact).
    fn up(self) -> f32;
    /// `x` rounded to the type, to nearest even (NaN kept).
    fn down(x: f32) -> Self;
}

impl HalfFloat for bf16 {
    #[inline(always)]
    fn up(self) -> f32 {
        bf16_to_f32(self)
    }
    #[inline(always)]
    fn down(x: f32) -> Self {
        f32_to_bf16(x)
    }
}

impl HalfFloat for f16 {
    #[inline(always)]
    fn up(self) -> f32 {
        f16_to_f32(self)
    }
    #[inline(always)]
    fn down(x: f32) -> Self {
        f32_to_f16(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same(got: f32, want: f32) -> bool {
        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan())
    }

    #[test]
    fn widening_matches_half_on_every_pattern() {
        for bits in 0..=u16::MAX {
            let cases = [
                (
                    "bf16",
                    bf16_to_f32(bf16::from_bits(bits)),
                    bf16::from_bits(bits).to_f32(),
                ),
                (
                    "f16",
                    f16_to_f32(f16::from_bits(bits)),
                    f16::from_bits(bits).to_f32(),
                ),
            ];
            for (name, got, want) in cases {
                assert!(
                    same(got, want),
                    "{name} {bits:#06x}: got {got:e} ({:#x}), want {want:e} ({:#x})",
                    got.to_bits(),
                    want.to_bits()
                );
            }
        }
    }

    /// Every float32 high half with low halves at the rounding boundaries of both types
    /// (bfloat16 drops 16 bits, a normal float16 13, a subnormal float16 up to 24) and a few
    /// pseudo-random ones.
    #[test]
    fn narrowing_matches_half_on_every_high_half() {
        let mut seed = 0x9e37_79b9u32;
        let mut lows = vec![
            0u32, 1, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x2000, 0x2001, 0x3000, 0x7fff, 0x8000,
            0x8001, 0xc000, 0xffff,
        ];
        for hi in 0..=u16::MAX as u32 {
            lows.truncate(14);
            for _ in 0..4 {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                lows.push(seed >> 16);
            }
            for &lo in &lows {
                let x = f32::from_bits((hi << 16) | lo);
                let cases = [
                    (
                        "bf16",
                        f32_to_bf16(x).to_bits(),
                        bf16::from_f32(x).to_bits(),
                        f32_to_bf16(x).is_nan(),
                    ),
                    (
                        "f16",
                        f32_to_f16(x).to_bits(),
                        f16::from_f32(x).to_bits(),
                        f32_to_f16(x).is_nan(),
                    ),
                ];
                for (name, got, want, nan) in cases {
                    assert!(
                        got == want || (nan && x.is_nan()),
                        "{name} of {x:e} ({:#x}): got {got:#06x}, want {want:#06x}",
                        x.to_bits()
                    );
                }
            }
        }
    }
}
