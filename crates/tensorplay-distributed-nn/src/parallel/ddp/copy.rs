//! Moving gradients into and out of the flat bucket buffers: one pass over the elements, the
//! scaling fused in, no temporary tensors. float32, float64, bfloat16 and float16 gradients;
//! a 16-bit element is scaled in float32 and rounded once.

use tensorplay_core::{DType, Error, Result, Tensor, bf16, f16};

/// `$body` with `$T` bound to the element type of the floating dtype `$dt`; an error for the
/// others.
macro_rules! float {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            other @ (DType::I64 | DType::Bool) => Err(unsupported(other)),
        }
    };
}

/// `dst[offset .. offset + src.numel()] = src * scale` (in `src`'s logical row-major order;
/// `src` may be strided or a stride-0 broadcast). `dst` is a contiguous 1-D CPU tensor of the
/// same dtype.
pub(crate) fn copy_in(dst: &Tensor, offset: usize, src: &Tensor, scale: f64) -> Result<()> {
    if src.shares_storage_with(dst) {
        // never hold the same storage's read and write locks at once
        return copy_in(dst, offset, &src.deep_clone()?, scale);
    }
    float!(dst.dtype(), T => copy_in_t::<T>(dst, offset, src, scale))
}

/// Sets `dst[offset .. offset + numel]` to zero.
pub(crate) fn zero(dst: &Tensor, offset: usize, numel: usize) -> Result<()> {
    float!(dst.dtype(), T => dst.with_cpu_data_mut(|d: &mut [T], l| {
        let b = l.offset() + offset;
        d[b..b + numel].fill(T::scaled(T::ONE, 0.0));
    }))
}

/// `dst = src[offset .. offset + dst.numel()] * scale`, `dst` contiguous (any shape), `src` a
/// contiguous 1-D tensor of the same dtype.
pub(crate) fn copy_out(dst: &Tensor, src: &Tensor, offset: usize, scale: f64) -> Result<()> {
    if src.shares_storage_with(dst) {
        return Err(Error::Autograd(
            "a gradient buffer aliases its bucket".into(),
        ));
    }
    float!(dst.dtype(), T => copy_out_t::<T>(dst, src, offset, scale))
}

/// Multiplies `t[offset .. offset + numel]` by `scale` in place.
pub(crate) fn scale(t: &Tensor, offset: usize, numel: usize, scale: f64) -> Result<()> {
    float!(t.dtype(), T => t.with_cpu_data_mut(|d: &mut [T], l| {
        let b = l.offset() + offset;
        d[b..b + numel].iter_mut().for_each(|x| *x = x.scaled(scale));
    }))
}

fn unsupported(dtype: DType) -> Error {
    Error::UnsupportedDType {
        op: "DistributedDataParallel",
        dtype,
        expected: "float32, float64, bfloat16 or float16 gradients",
    }
}

trait Num: tensorplay_core::StorageElement {
    const ONE: Self;
    /// `self * s`, rounded once to this type (float32 arithmetic for the 16-bit types and
    /// float32, float64 for float64).
    fn scaled(self, s: f64) -> Self;
}
impl Num for f32 {
    const ONE: f32 = 1.0;
    fn scaled(self, s: f64) -> f32 {
        self * s as f32
    }
}
impl Num for f64 {
    const ONE: f64 = 1.0;
    fn scaled(self, s: f64) -> f64 {
        self * s
    }
}
impl Num for bf16 {
    const ONE: bf16 = bf16::ONE;
    fn scaled(self, s: f64) -> bf16 {
        bf16::from_f32(self.to_f32() * s as f32)
    }
}
impl Num for f16 {
    const ONE: f16 = f16::ONE;
    fn scaled(self, s: f64) -> f16 {
        f16::from_f32(self.to_f32() * s as f32)
    }
}

fn copy_in_t<T: Num>(dst: &Tensor, offset: usize, src: &Tensor, scale: f64) -> Result<()> {
    let n = src.numel();
    src.with_cpu_data(|s: &[T], sl| {
        dst.with_cpu_data_mut(|d: &mut [T], dl| {
            let b = dl.offset() + offset;
            let out = &mut d[b..b + n];
            match sl.contiguous_range() {
                Some(r) if scale == 1.0 => out.copy_from_slice(&s[r]),
                Some(r) => out
                    .iter_mut()
                    .zip(&s[r])
                    .for_each(|(o, &x)| *o = x.scaled(scale)),
                None => {
                    let mut i = 0;
                    sl.for_each_offset(|o| {
                        out[i] = s[o].scaled(scale);
                        i += 1;
                    });
                }
            }
        })
    })?
}

fn copy_out_t<T: Num>(dst: &Tensor, src: &Tensor, offset: usize, scale: f64) -> Result<()> {
    let n = dst.numel();
    src.with_cpu_data(|s: &[T], sl| {
        dst.with_cpu_data_mut(|d: &mut [T], dl| {
            let b = sl.offset() + offset;
            let input = &s[b..b + n];
            let out = match dl.contiguous_range() {
                Some(r) => &mut d[r],
                None => return,
            };
            if scale == 1.0 {
                out.copy_from_slice(input);
            } else {
                out.iter_mut()
                    .zip(input)
                    .for_each(|(o, &x)| *o = x.scaled(scale));
            }
        })
    })?
}
