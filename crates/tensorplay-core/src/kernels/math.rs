//! Elementwise math written as branch-free float arithmetic, so that the compiler vectorises
//! the loops that call it (at every [`CpuCapability`](super::CpuCapability) level): `exp`,
//! `tanh`, `log` and `erf` for `float32`, and the element types' conversion to the type the
//! kernels compute in.
//!
//! Error bounds (measured by the tests over dense sweeps of every finite `float32`, against
//! the `float64` functions rounded to `float32`): [`exp_f32`], [`log_f32`] and [`erf_f32`]
//! within 1 unit in the last place (ULP), [`tanh_f32`] within 2 ULP; all give the IEEE results
//! at zeros, infinities and NaN. `float64` uses the standard library's (libm's) functions, one
//! element at a time.

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
/// `e^r` is the degree-7 Taylor polynomial (truncation below `6e-9` relative) in Horner form
/// with fused multiply-adds, and `2^k` is applied as two exact powers so that results in the
/// subnormal range round once. `+inf` above `88.73`, `0` below `-103.98`, NaN for NaN.
///
/// The multiply-adds are `f32::mul_add`, rounded once at every level: a vector instruction
/// where the level has FMA, the C library's `fmaf` at the [`Default`](super::CpuCapability)
/// level, so every level gives the same bits (the fallback pays a call per element).
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    let xc = x.clamp(-104.0, 89.0);
    let t = xc.mul_add(LOG2E, ROUNDER);
    let k = t - ROUNDER;
    let r = k.mul_add(-LN2_LO, k.mul_add(-LN2_HI, xc));
    let p: f32 = 1.0 / 5040.0;
    let p = p.mul_add(r, 1.0 / 720.0);
    let p = p.mul_add(r, 1.0 / 120.0);
    let p = p.mul_add(r, 1.0 / 24.0);
    let p = p.mul_add(r, 1.0 / 6.0);
    let p = p.mul_add(r, 0.5);
    let p = (p * r).mul_add(r, r) + 1.0;
    // k in [-150, 129], read from the low bits of `t` (a bit cast, where a float-to-int
    // conversion would not vectorise); applied as two halves, each a normal power of two
    let k = (t.to_bits() as i32).wrapping_sub(ROUNDER.to_bits() as i32);
    let k1 = k >> 1;
    let k2 = k.wrapping_sub(k1);
    let s1 = f32::from_bits((k1.wrapping_add(127) as u32) << 23);
    let s2 = f32::from_bits((k2.wrapping_add(127) as u32) << 23);
    // a NaN stays NaN through `clamp` and every product, so it needs no select
    (p * s1) * s2
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

/// `2^23`: multiplying a subnormal by it makes it normal, exactly.
const TWO_23: f32 = 8_388_608.0;
/// The bits of `sqrt(1/2)` (rounded down): the mantissa is reduced to `[sqrt(1/2), sqrt(2))`.
const SQRT_HALF_BITS: i32 = 0x3f35_04f3;

/// `ln(x)` for `float32`, within 1 ULP. A subnormal `x` is first scaled by `2^23` (exactly);
/// then `x = 2^k m` with `m` in `[sqrt(1/2), sqrt(2))`, `f = m - 1` and `s = f / (2 + f)`, so
/// `ln m = 2 atanh(s) = f - f^2/2 + s (f^2/2 + R(s^2))` with `R` the tail of atanh's Taylor
/// series (`|s| < 0.172`, truncation below `3e-10` relative); the large terms `f` and
/// `k ln2` (split as in [`exp_f32`]) are added last. `-inf` at `+-0`, NaN below 0 and for NaN,
/// `+inf` at `+inf`.
#[inline(always)]
pub(crate) fn log_f32(x: f32) -> f32 {
    let tiny = x < f32::MIN_POSITIVE;
    let xs = if tiny { x * TWO_23 } else { x };
    let k_adj: i32 = if tiny { -23 } else { 0 };
    // the exponent and mantissa read from the bits, relative to sqrt(1/2)
    let ix = (xs.to_bits() as i32).wrapping_sub(SQRT_HALF_BITS);
    let k = (ix >> 23).wrapping_add(k_adj);
    let m = f32::from_bits(((ix & 0x007f_ffff) + SQRT_HALF_BITS) as u32);
    let f = m - 1.0;
    let s = f / (2.0 + f);
    let z = s * s;
    let r = 2.0 / 11.0;
    let r = r * z + 2.0 / 9.0;
    let r = r * z + 2.0 / 7.0;
    let r = r * z + 2.0 / 5.0;
    let r = r * z + 2.0 / 3.0;
    let r = r * z;
    let half_f2 = 0.5 * f * f;
    let k = k as f32;
    let y = k * LN2_HI + (f - (half_f2 - (s * (half_f2 + r) + k * LN2_LO)));
    if x.is_nan() {
        x
    } else if x < 0.0 {
        f32::NAN
    } else if x == 0.0 {
        f32::NEG_INFINITY
    } else if x == f32::INFINITY {
        x
    } else {
        y
    }
}

/// `erf(x) / x - 1` as a polynomial in `x^2` on `|x| < 1` (Chebyshev fit, error below `4e-11`):
/// the `- 1` keeps the leading coefficient's rounding out of the result's last place.
const ERF_SMALL: [f32; 8] = [
    0.128_379_17,
    -0.376_126_38,
    0.112_837_82,
    -0.026_865_43,
    0.005_221_031_6,
    -0.000_848_408_03,
    0.000_112_659_59,
    -9.667_045e-6,
];

/// `ln(erfc(x)) + x^2` as a polynomial in `x - 2.475` on `1 <= x <= 3.95` (Chebyshev fit, error
/// below `8e-9`); above 3.95 `erf` rounds to 1 in `float32`.
const ERF_BIG: [f32; 10] = [
    -1.547_963,
    -0.355_506_57,
    0.056_928_895,
    -0.011_077_314,
    0.002_218_513_5,
    -0.000_432_518_9,
    7.966_782e-5,
    -1.328_450_9e-5,
    1.635_261_6e-6,
    -6.847_706_4e-8,
];

/// `erf(x)` for `float32`, within 1 ULP: `x + x P(x^2)` below `|x| = 1`, and
/// `1 - e^(Q(|x|) - x^2)` with the sign of `x` above (exactly `+-1` from `|x| = 3.92`). NaN
/// for NaN.
#[inline(always)]
pub(crate) fn erf_f32(x: f32) -> f32 {
    let a = x.abs();
    let t = a * a;
    let mut p = ERF_SMALL[7];
    for &c in ERF_SMALL[..7].iter().rev() {
        p = p * t + c;
    }
    let small = x + x * p;
    let ac = a.min(3.95);
    let u = ac - 2.475;
    let mut q = ERF_BIG[9];
    for &c in ERF_BIG[..9].iter().rev() {
        q = q * u + c;
    }
    let big = (1.0 - exp_f32(q - ac * ac)).copysign(x);
    let y = if a < 1.0 { small } else { big };
    if x.is_nan() { x } else { y }
}

/// What the kernels compute in: `f32` or `f64`, with the vectorisable math.
pub(crate) trait Real: FloatElement + Float + Send + Sync + 'static {
    /// `e^x` (see [`exp_f32`] for `float32`'s bound).
    fn exp_k(self) -> Self;
    /// `tanh(x)` (see [`tanh_f32`]).
    fn tanh_k(self) -> Self;
    /// `ln(x)` (see [`log_f32`]).
    fn ln_k(self) -> Self;
    /// `erf(x)` (see [`erf_f32`]).
    fn erf_k(self) -> Self;
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
    fn ln_k(self) -> f32 {
        log_f32(self)
    }
    #[inline(always)]
    fn erf_k(self) -> f32 {
        erf_f32(self)
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
    fn ln_k(self) -> f64 {
        self.ln()
    }
    #[inline(always)]
    fn erf_k(self) -> f64 {
        libm::erf(self)
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
    /// The elements as the computing type without a copy, where it is the element type.
    fn as_acc(x: &[Self]) -> Option<&[Self::Acc]>;
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
    #[inline(always)]
    fn as_acc(x: &[f32]) -> Option<&[f32]> {
        Some(x)
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
    #[inline(always)]
    fn as_acc(x: &[f64]) -> Option<&[f64]> {
        Some(x)
    }
}

/// The 16-bit float types: loaded into float32 (exact), stored rounded to nearest even, with
/// the branch-free conversions of [`super::half_convert`] (so their loops vectorize).
impl<T: super::half_convert::HalfFloat> Elem for T {
    type Acc = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.up()
    }
    #[inline(always)]
    fn store(v: f32) -> T {
        T::down(v)
    }
    #[inline(always)]
    fn as_acc(_: &[T]) -> Option<&[f32]> {
        None
    }
}
