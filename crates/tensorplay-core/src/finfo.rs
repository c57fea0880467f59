//! [`finfo`]: the numerical limits of each floating dtype (`torch.finfo`).

use crate::{DType, Error, Result};

/// The limits of a floating dtype, as `torch.finfo` gives them; every value is exact in
/// `f64`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FInfo {
    /// The dtype described.
    pub dtype: DType,
    /// Bits of one element.
    pub bits: u32,
    /// The difference between 1.0 and the next larger value.
    pub eps: f64,
    /// The largest finite value.
    pub max: f64,
    /// The most negative finite value (`-max`).
    pub min: f64,
    /// The smallest positive normal value (`torch.finfo.tiny`, `smallest_normal`).
    pub tiny: f64,
    /// The smallest positive subnormal value.
    pub smallest_subnormal: f64,
    /// The approximate decimal resolution, `10^-floor(mantissa bits * log10(2))`.
    pub resolution: f64,
}

/// The limits of `dtype` (`torch.finfo(dtype)`): float32, float64, bfloat16 or float16.
///
/// # Errors
/// [`Error::UnsupportedDType`] for int64 and bool.
///
/// ```
/// use tensorplay as tp;
/// let bf = tp::finfo(tp::DType::BF16)?;
/// assert_eq!(bf.eps, 0.0078125);
/// assert_eq!(tp::finfo(tp::DType::F16)?.max, 65504.0);
/// # Ok::<(), tp::Error>(())
/// ```
pub fn finfo(dtype: DType) -> Result<FInfo> {
    // (bits, explicit mantissa bits, decimal resolution)
    let (bits, mantissa, resolution) = match dtype {
        DType::F32 => (32, 23, 1e-6),
        DType::F64 => (64, 52, 1e-15),
        DType::BF16 => (16, 7, 0.01),
        DType::F16 => (16, 10, 0.001),
        d @ (DType::I64 | DType::Bool) => {
            return Err(Error::UnsupportedDType {
                op: "finfo",
                dtype: d,
                expected: "a floating dtype (float32, float64, bfloat16 or float16)",
            });
        }
    };
    let exponent_bits = bits - 1 - mantissa;
    let bias = (1i32 << (exponent_bits - 1)) - 1;
    let eps = 2f64.powi(-(mantissa as i32));
    let max = (2.0 - eps) * 2f64.powi(bias);
    let tiny = 2f64.powi(1 - bias);
    Ok(FInfo {
        dtype,
        bits,
        eps,
        max,
        min: -max,
        tiny,
        smallest_subnormal: tiny * eps,
        resolution,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The limits against the element types' own constants.
    #[test]
    fn limits_match_the_element_types() {
        let cases: [(DType, f64, f64, f64, f64); 4] = [
            (
                DType::F32,
                f32::EPSILON.into(),
                f32::MAX.into(),
                f32::MIN_POSITIVE.into(),
                f32::from_bits(1).into(),
            ),
            (
                DType::F64,
                f64::EPSILON,
                f64::MAX,
                f64::MIN_POSITIVE,
                f64::from_bits(1),
            ),
            (
                DType::BF16,
                half::bf16::EPSILON.to_f64(),
                half::bf16::MAX.to_f64(),
                half::bf16::MIN_POSITIVE.to_f64(),
                half::bf16::from_bits(1).to_f64(),
            ),
            (
                DType::F16,
                half::f16::EPSILON.to_f64(),
                half::f16::MAX.to_f64(),
                half::f16::MIN_POSITIVE.to_f64(),
                half::f16::from_bits(1).to_f64(),
            ),
        ];
        for (d, eps, max, tiny, sub) in cases {
            let f = finfo(d).unwrap();
            assert_eq!(
                (f.eps, f.max, f.min, f.tiny, f.smallest_subnormal),
                (eps, max, -max, tiny, sub),
                "{d}"
            );
            assert_eq!(f.bits as usize, d.size_in_bytes() * 8, "{d}: bits");
        }
        assert!(finfo(DType::I64).is_err() && finfo(DType::Bool).is_err());
    }
}
