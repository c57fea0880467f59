//! Elementwise math written as branch-free float arithmetic, so that the compiler vectorises
//! the loops that call it (at every [`CpuCapability`](super::CpuCapability) level): `exp` and
//! `tanh` for `float32`, and the element types' conversion to the type the kernels compute in.
//!
//! Error bounds (measured by the tests over dense sweeps of every finite `float32`, against
//! the `float64` functions rounded to `float32`): [`exp_f32`] within 1 unit in the last place
//! (ULP), [`tanh_f32`] within 2 ULP; both give the IEEE results at infinities and NaN.
//! `float64` uses the standard library's (libm's) functions, one element at a time.

use num_traits::Float;

use crate::dtype::FloatElement;

/// `log2(e)`.
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split in two: the high part has 9 significant bits, so `k * LN2_HI` is exact for the
/// `|k| <= 150` the reduction produces (Cody and Waite's reduction).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// `1.5 * 2^23`: adding and subtracting it rounds a float of magnitude below `2^22` to the
/// nearest integer (ties to even) without a branch or a rounding instruction.
const ROUNDER: f32 = 12_582_912.0;

/// `e^x` for `float32`, within 1 ULP. `x` is reduced to `k ln2 + r` with `|r| <= ln2 / 2`,
/// `e^r` is the degree-7 Taylor polynomial (truncation below `6e-9` relative), and `2^k` is
/// applied as two exact powers so that results in the subnormal range round once. `+inf`
/// above `88.73`, `0` below `-103.98`, NaN for NaN.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    let xc = x.clamp(-104.0, 89.0);
    let t = xc * LOG2E + ROUNDER;
    let k = t - ROUNDER;
    let r = (xc - k * LN2_HI) - k * LN2_LO;
    let p = 1.0 / 5040.0;
    let p = p * r + 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = (p * r) * r + r + 1.0;
    // k in [-150, 129], read from the low bits of `t` (a bit cast, where a float-to-int
    // conversion would not vectorise); applied as two halves, each a normal power of two
    let k = (t.to_bits() as i32).wrapping_sub(ROUNDER.to_bits() as i32);
    let k1 = k >> 1;
    let k2 = k.wrapping_sub(k1);
    let s1 = f32::from_bits((k1.wrapping_add(127) as u32) << 23);
    let s2 = f32::from_bits((k2.wrapping_add(127) as u32) << 23);
    let y = (p * s1) * s2;
    if x.is_nan() { x } else { y }
}

/// The Taylor coefficients of `tanh(x) / x` in powers of `x^2` (`1, -1/3, 2/15, ...`),
/// enough that the truncation is below `1e-8` relative for `|x| < 0.55`.
const TANH_SMALL: [f32; 9] = [
    1.0,
    -1.0 / 3.0,
    2.0 / 15.0,
    -17.0 / 315.0,
    62.0 / 2835.0,
    -1382.0 / 155_925.0,
    21844.0 / 6_081_075.0,
    -929_569.0 / 638_512_875.0,
    6_404_582.0 / 10_854_718_875.0,
];

/// `tanh(x)` for `float32`, within 2 ULP: the odd Taylor polynomial below `|x| = 0.55`, and
/// `1 - 2 / (e^(2|x|) + 1)` with the sign of `x` above (exactly `+-1` from `|x| = 9.1`).
#[inline(always)]
pub(crate) fn tanh_f32(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let mut p = TANH_SMALL[8];
    for &c in TANH_SMALL[..8].iter().rev() {
        p = p * z + c;
    }
    let small = p * x;
    let big = 1.0 - 2.0 / (exp_f32(a + a) + 1.0);
    let big = big.copysign(x);
    if a < 0.55 { small } else { big }
}

/// What the kernels compute in: `f32` or `f64`, with the vectorisable math.
pub(crate) trait Real: FloatElement + Float + Send + Sync + 'static {
    /// `e^x` (see [`exp_f32`] for `float32`'s bound).
    fn exp_k(self) -> Self;
    /// `tanh(x)` (see [`tanh_f32`]).
    fn tanh_k(self) -> Self;
    /// The constant `v`.
    fn c(v: f64) -> Self;
}

impl Real for f32 {
    #[inline(always)]
    fn exp_k(self) -> f32 {
        exp_f32(self)
    }
    #[inline(always)]
    fn tanh_k(self) -> f32 {
        tanh_f32(self)
    }
    #[inline(always)]
    fn c(v: f64) -> f32 {
        v as f32
    }
}

impl Real for f64 {
    #[inline(always)]
    fn exp_k(self) -> f64 {
        self.exp()
    }
    #[inline(always)]
    fn tanh_k(self) -> f64 {
        self.tanh()
    }
    #[inline(always)]
    fn c(v: f64) -> f64 {
        v
    }
}

/// An element type the kernels read and write: loaded into the type they compute in
/// ([`Real`]) and stored back. `float32` and `float64` compute in themselves; the 16-bit
/// float types will load into `float32`, so every kernel written over `Elem` serves them.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    /// The type the kernels compute in.
    type Acc: Real;
    /// The element as the computing type.
    fn load(self) -> Self::Acc;
    /// A computed value as the element type (rounded to nearest).
    fn store(v: Self::Acc) -> Self;
}

impl Elem for f32 {
    type Acc = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(v: f32) -> f32 {
        v
    }
}

impl Elem for f64 {
    type Acc = f64;
    #[inline(always)]
    fn load(self) -> f64 {
        self
    }
    #[inline(always)]
    fn store(v: f64) -> f64 {
        v
    }
}
