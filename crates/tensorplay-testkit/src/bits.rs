//! Tensors compared exactly: each element's bit pattern, for every dtype.

use tensorplay_core::{Result, Tensor, with_dtype};

/// The bit pattern of each of `t`'s elements in row-major order, widened to `u64` (NaN
/// payloads and `-0.0` compare exactly; a `bool` is 0 or 1). Copies a CUDA tensor to the
/// host. Errors as [`Tensor::to_vec`] does (a meta tensor).
pub fn element_bits(t: &Tensor) -> Result<Vec<u64>> {
    with_dtype!(t.dtype(), T => {
        let v = t.to_vec::<T>()?;
        Ok(tensorplay_core::bytes::as_bytes(&v)
            .chunks_exact(size_of::<T>())
            .map(|c| match *c {
                [a] => u64::from(a),
                [a, b] => u64::from(u16::from_ne_bytes([a, b])),
                [a, b, c, d] => u64::from(u32::from_ne_bytes([a, b, c, d])),
                _ => u64::from_ne_bytes(c.try_into().unwrap_or([0; 8])),
            })
            .collect())
    })
}

/// `t`'s elements as little-endian bytes, row-major (what a safetensors file holds).
pub fn le_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let size = t.dtype().size_in_bytes();
    Ok(element_bits(t)?
        .into_iter()
        .flat_map(|b| b.to_le_bytes().into_iter().take(size))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensorplay_core::{DType, bf16, f16};

    #[test]
    fn every_dtype_gives_its_bits() {
        let cases: Vec<(&str, Tensor, Vec<u64>)> = vec![
            (
                "f32",
                Tensor::from_vec(vec![1.5f32, -0.0], &[2]).unwrap(),
                vec![u64::from(1.5f32.to_bits()), u64::from((-0.0f32).to_bits())],
            ),
            (
                "f64",
                Tensor::from_vec(vec![2.0f64], &[1]).unwrap(),
                vec![2.0f64.to_bits()],
            ),
            (
                "i64",
                Tensor::from_vec(vec![-1i64], &[1]).unwrap(),
                vec![u64::MAX],
            ),
            (
                "bool",
                Tensor::from_vec(vec![true, false], &[2]).unwrap(),
                vec![1, 0],
            ),
            (
                "bf16",
                Tensor::from_vec(vec![bf16::from_f32(1.0)], &[1]).unwrap(),
                vec![0x3f80],
            ),
            (
                "f16",
                Tensor::from_vec(vec![f16::from_f32(1.0)], &[1]).unwrap(),
                vec![0x3c00],
            ),
        ];
        assert_eq!(cases.len(), DType::ALL.len(), "a case per dtype");
        for (name, t, want) in cases {
            assert_eq!(element_bits(&t).unwrap(), want, "{name}");
            let size = t.dtype().size_in_bytes();
            assert_eq!(
                le_bytes(&t).unwrap().len(),
                want.len() * size,
                "{name}: bytes"
            );
        }
    }
}
