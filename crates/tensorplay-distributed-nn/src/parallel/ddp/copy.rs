//! Moving gradients into and out of the flat bucket buffers: one pass over the elements, the
//! scaling fused in, no temporary tensors.

use tensorplay_core::{DType, Error, Result, Tensor};

/// `dst[offset .. offset + src.numel()] = src * scale` (in `src`'s logical row-major order;
/// `src` may be strided or a stride-0 broadcast). `dst` is a contiguous 1-D CPU tensor of the
/// same dtype.
pub(crate) fn copy_in(dst: &Tensor, offset: usize, src: &Tensor, scale: f64) -> Result<()> {
    if src.shares_storage_with(dst) {
        // never hold the same storage's read and write locks at once
        return copy_in(dst, offset, &src.deep_clone()?, scale);
    }
    match dst.dtype() {
        DType::F32 => copy_in_t::<f32>(dst, offset, src, scale as f32),
        DType::F64 => copy_in_t::<f64>(dst, offset, src, scale),
        other @ (DType::I64 | DType::Bool | DType::BF16 | DType::F16) => Err(unsupported(other)),
    }
}

/// Sets `dst[offset .. offset + numel]` to zero.
pub(crate) fn zero(dst: &Tensor, offset: usize, numel: usize) -> Result<()> {
    match dst.dtype() {
        DType::F32 => dst.with_cpu_data_mut(|d: &mut [f32], l| {
            let b = l.offset() + offset;
            d[b..b + numel].fill(0.0);
        }),
        DType::F64 => dst.with_cpu_data_mut(|d: &mut [f64], l| {
            let b = l.offset() + offset;
            d[b..b + numel].fill(0.0);
        }),
        other @ (DType::I64 | DType::Bool | DType::BF16 | DType::F16) => Err(unsupported(other)),
    }
}

/// `dst = src[offset .. offset + dst.numel()] * scale`, `dst` contiguous (any shape), `src` a
/// contiguous 1-D tensor of the same dtype.
pub(crate) fn copy_out(dst: &Tensor, src: &Tensor, offset: usize, scale: f64) -> Result<()> {
    if src.shares_storage_with(dst) {
        return Err(Error::Autograd(
            "a gradient buffer aliases its bucket".into(),
        ));
    }
    match dst.dtype() {
        DType::F32 => copy_out_t::<f32>(dst, src, offset, scale as f32),
        DType::F64 => copy_out_t::<f64>(dst, src, offset, scale),
        other @ (DType::I64 | DType::Bool | DType::BF16 | DType::F16) => Err(unsupported(other)),
    }
}

/// Multiplies `t[offset .. offset + numel]` by `scale` in place.
pub(crate) fn scale(t: &Tensor, offset: usize, numel: usize, scale: f64) -> Result<()> {
    match t.dtype() {
        DType::F32 => t.with_cpu_data_mut(|d: &mut [f32], l| {
            let b = l.offset() + offset;
            d[b..b + numel].iter_mut().for_each(|x| *x *= scale as f32);
        }),
        DType::F64 => t.with_cpu_data_mut(|d: &mut [f64], l| {
            let b = l.offset() + offset;
            d[b..b + numel].iter_mut().for_each(|x| *x *= scale);
        }),
        other @ (DType::I64 | DType::Bool | DType::BF16 | DType::F16) => Err(unsupported(other)),
    }
}

fn unsupported(dtype: DType) -> Error {
    Error::UnsupportedDType {
        op: "DistributedDataParallel",
        dtype,
        expected: "float32 or float64 gradients",
    }
}

trait Num: tensorplay_core::StorageElement + std::ops::Mul<Output = Self> + PartialEq {
    const ONE: Self;
}
impl Num for f32 {
    const ONE: f32 = 1.0;
}
impl Num for f64 {
    const ONE: f64 = 1.0;
}

fn copy_in_t<T: Num>(dst: &Tensor, offset: usize, src: &Tensor, scale: T) -> Result<()> {
    let n = src.numel();
    src.with_cpu_data(|s: &[T], sl| {
        dst.with_cpu_data_mut(|d: &mut [T], dl| {
            let b = dl.offset() + offset;
            let out = &mut d[b..b + n];
            match sl.contiguous_range() {
                Some(r) if scale == T::ONE => out.copy_from_slice(&s[r]),
                Some(r) => out.iter_mut().zip(&s[r]).for_each(|(o, &x)| *o = x * scale),
                None => {
                    let mut i = 0;
                    sl.for_each_offset(|o| {
                        out[i] = s[o] * scale;
                        i += 1;
                    });
                }
            }
        })
    })?
}

fn copy_out_t<T: Num>(dst: &Tensor, src: &Tensor, offset: usize, scale: T) -> Result<()> {
    let n = dst.numel();
    src.with_cpu_data(|s: &[T], sl| {
        dst.with_cpu_data_mut(|d: &mut [T], dl| {
            let b = sl.offset() + offset;
            let input = &s[b..b + n];
            let out = match dl.contiguous_range() {
                Some(r) => &mut d[r],
                None => return,
            };
            if scale == T::ONE {
                out.copy_from_slice(input);
            } else {
                out.iter_mut().zip(input).for_each(|(o, &x)| *o = x * scale);
            }
        })
    })?
}
