//! Elementwise operations with broadcasting: arithmetic, unary math, activations,
//! comparisons, `where`, dtype casts and in-place updates. This module holds the kernels that
//! map elements; each family of operations has a file of its own.

mod binary;
mod cast;
mod inplace;
mod methods;
mod unary;
mod where_;

use super::{float_dispatch, same_device, with_two};
use crate::kernels::{self, Map};
use crate::layout::{Layout, broadcast_shapes};
use crate::storage::StorageElement;
use crate::storage::pool::take;
use crate::{DType, Result, Tensor};

// ---------------------------------------------------------------------------------------------
// kernels

/// `f(a, b)` elementwise with broadcasting, into a new contiguous tensor.
///
/// Rows of the last dimension are processed with tight loops specialised for unit and zero
/// strides (same-shape operands, a broadcast bias row, a broadcast scalar column), so the
/// common cases vectorise.
pub(crate) fn binary_map<T: StorageElement, R: StorageElement>(
    a: &Tensor,
    b: &Tensor,
    op: &'static str,
    f: impl Fn(T, T) -> R + Sync + Send,
) -> Result<Tensor> {
    same_device(op, a, b)?;
    let shape = broadcast_shapes(a.shape(), b.shape(), op)?;
    let la = a.layout().broadcast_to(&shape, op)?;
    let lb = b.layout().broadcast_to(&shape, op)?;
    let v = with_two(a, b, op, |sa: &[T], _, sb: &[T], _| {
        let n: usize = shape.iter().product();
        if let (Some(ra), Some(rb)) = (la.contiguous_range(), lb.contiguous_range()) {
            let mut out = take::<R>(n);
            kernels::par_zip(&sa[ra], &sb[rb], &mut out, &f);
            return out;
        }
        let mut out = take::<R>(n);
        if n == 0 {
            return out;
        }
        let nd = shape.len();
        let inner = shape[nd - 1];
        if inner == 0 {
            return out;
        }
        let (ia, ib) = (la.strides[nd - 1], lb.strides[nd - 1]);
        let rows = |l: &Layout| Layout {
            shape: shape[..nd - 1].to_vec(),
            strides: l.strides[..nd - 1].to_vec(),
            offset: l.offset,
        };
        let (ra, rb) = (rows(&la), rows(&lb));
        let (oa, ob) = (ra.offsets(), rb.offsets());
        // row by row into the output's rows (a bias over rows: the `(1, 1)` arm)
        for ((&a0, &b0), o) in oa.iter().zip(&ob).zip(out.chunks_exact_mut(inner)) {
            match (ia, ib) {
                (1, 1) => {
                    for (o, (&x, &y)) in o
                        .iter_mut()
                        .zip(sa[a0..a0 + inner].iter().zip(&sb[b0..b0 + inner]))
                    {
                        *o = f(x, y);
                    }
                }
                (1, 0) => {
                    let y = sb[b0];
                    for (o, &x) in o.iter_mut().zip(&sa[a0..a0 + inner]) {
                        *o = f(x, y);
                    }
                }
                (0, 1) => {
                    let x = sa[a0];
                    for (o, &y) in o.iter_mut().zip(&sb[b0..b0 + inner]) {
                        *o = f(x, y);
                    }
                }
                _ => {
                    for (j, o) in o.iter_mut().enumerate() {
                        *o = f(sa[a0 + j * ia], sb[b0 + j * ib]);
                    }
                }
            }
        }
        out
    })?;
    Ok(Tensor::from_cpu(R::into_storage(v), &shape))
}

/// `f(x)` elementwise into a new contiguous tensor.
pub(crate) fn unary_map<T: StorageElement, R: StorageElement>(
    x: &Tensor,
    op: &'static str,
    f: impl Fn(T) -> R + Sync + Send,
) -> Result<Tensor> {
    let v = x.with_slice(op, |s: &[T], l| match l.contiguous_range() {
        Some(r) => {
            let mut out = take::<R>(r.len());
            kernels::par_map(&s[r], &mut out, &f);
            out
        }
        None => {
            let mut out = Vec::with_capacity(l.numel());
            l.for_each_offset(|o| out.push(f(s[o])));
            out
        }
    })?;
    Ok(Tensor::from_cpu(R::into_storage(v), x.shape()))
}

/// `f(x)` of a float host tensor through the vectorised kernels (a strided view is made
/// contiguous first), into a new contiguous tensor. A 16-bit tensor is widened to float32,
/// mapped by the float32 kernel and rounded once: the kernels' per-element 16-bit loads and
/// stores keep the compiler from vectorising their `exp` and `tanh` (the GPT's bfloat16 GELU
/// took a fifth of an autocast step that way).
pub(crate) fn kernel_map(x: &Tensor, op: &'static str, f: Map) -> Result<Tensor> {
    if x.dtype().is_half() {
        let _ng = crate::autograd::no_grad();
        return kernel_map(&x.to_dtype(DType::F32)?, op, f)?.to_dtype(x.dtype());
    }
    let x = x.contiguous()?;
    float_dispatch!(x.dtype(), op, T => {
        let v = x.with_slice(op, |s: &[T], l| {
            let r = l.contiguous_range().unwrap_or(0..0);
            kernels::map(f, &s[r])
        })?;
        Ok(Tensor::from_cpu(T::into_storage(v), x.shape()))
    })
}

/// `f(a, b)` of two float host tensors of one shape through a kernel over their contiguous
/// elements (strided views are made contiguous first), into a new contiguous tensor of that
/// shape. The caller checks shapes and dtypes.
pub(crate) fn kernel_zip(
    a: &Tensor,
    b: &Tensor,
    op: &'static str,
    f32_kernel: impl FnOnce(&[f32], &[f32]) -> Vec<f32>,
    f64_kernel: impl FnOnce(&[f64], &[f64]) -> Vec<f64>,
) -> Result<Tensor> {
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    let range = |l: &Layout| l.contiguous_range().unwrap_or(0..0);
    let storage = match a.dtype() {
        DType::F32 => with_two(&a, &b, op, |sa: &[f32], la, sb: &[f32], lb| {
            f32_kernel(&sa[range(la)], &sb[range(lb)])
        })
        .map(f32::into_storage)?,
        DType::F64 => with_two(&a, &b, op, |sa: &[f64], la, sb: &[f64], lb| {
            f64_kernel(&sa[range(la)], &sb[range(lb)])
        })
        .map(f64::into_storage)?,
        DType::BF16 => half_zip::<half::bf16>(&a, &b, op, f32_kernel)?,
        DType::F16 => half_zip::<half::f16>(&a, &b, op, f32_kernel)?,
        d @ (DType::I64 | DType::Bool) => {
            return Err(crate::Error::UnsupportedDType {
                op,
                dtype: d,
                expected: "a floating dtype (float32, float64, bfloat16 or float16)",
            });
        }
    };
    Ok(Tensor::from_cpu(storage, a.shape()))
}

/// [`kernel_zip`] of two 16-bit tensors: their elements loaded into float32 for the float32
/// kernel, its results rounded once.
fn half_zip<H: StorageElement + kernels::math::Elem<Acc = f32>>(
    a: &Tensor,
    b: &Tensor,
    op: &'static str,
    f32_kernel: impl FnOnce(&[f32], &[f32]) -> Vec<f32>,
) -> Result<crate::CpuStorage> {
    let range = |l: &Layout| l.contiguous_range().unwrap_or(0..0);
    let load = |s: &[H]| s.iter().map(|v| v.load()).collect::<Vec<f32>>();
    let v = with_two(a, b, op, |sa: &[H], la, sb: &[H], lb| {
        f32_kernel(&load(&sa[range(la)]), &load(&sb[range(lb)]))
    })?;
    Ok(H::into_storage(v.into_iter().map(H::store).collect()))
}

/// The dtype two operands promote to (bool < int64 < bfloat16, float16 < float32 < float64;
/// bfloat16 with float16 gives float32), as PyTorch's type promotion for tensors.
fn promote(a: DType, b: DType) -> DType {
    fn rank(d: DType) -> u8 {
        match d {
            DType::Bool => 0,
            DType::I64 => 1,
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 3,
            DType::F64 => 4,
        }
    }
    if a.is_half() && b.is_half() && a != b {
        return DType::F32;
    }
    if rank(a) >= rank(b) { a } else { b }
}
