//! Tensor operations. Each differentiable operation is a [`crate::autograd::Function`]; the
//! public entry points are methods on [`Tensor`](crate::Tensor) and free functions re-exported
//! at the crate root.

pub(crate) mod activation;
pub(crate) mod addmm;
pub(crate) mod attention;
pub(crate) mod creation;
pub(crate) mod device;
pub(crate) mod elementwise;
pub(crate) mod gelu_erf;
pub(crate) mod gelu_tanh;
pub(crate) mod index;
pub(crate) mod mask;
pub(crate) mod matmul;
pub(crate) mod minmax;
mod operators;
pub(crate) mod reduce;
pub(crate) mod shape;
pub(crate) mod view;

use crate::backend;
use crate::cuda::CudaStorage;
use crate::kernels::math::Elem;
use crate::storage::StorageElement;
use crate::{Error, Result, Tensor};
use std::sync::Arc;

/// Dispatches on a floating dtype, binding `$T` to `f32`, `f64`, `bf16` or `f16`; returns
/// [`Error::UnsupportedDType`] naming `$op` for the others.
macro_rules! float_dispatch {
    ($dt:expr, $op:expr, $T:ident => $body:expr) => {
        $crate::with_float_dtype!($dt, $T => $body, d => {
            return Err($crate::Error::UnsupportedDType {
                op: $op,
                dtype: d,
                expected: "a floating dtype (float32, float64, bfloat16 or float16)",
            })
        })
    };
}
/// Dispatches on a numeric dtype (f32, f64, i64, bf16, f16); returns [`Error::UnsupportedDType`] naming
/// `$op` for the others.
macro_rules! numeric_dispatch {
    ($dt:expr, $op:expr, $T:ident => $body:expr) => {
        $crate::with_numeric_dtype!($dt, $T => $body, d => {
            return Err($crate::Error::UnsupportedDType {
                op: $op,
                dtype: d,
                expected: "a numeric dtype (float32, float64, int64, bfloat16 or float16)",
            })
        })
    };
}
/// Dispatches on any dtype ([`with_dtype!`](crate::with_dtype)).
macro_rules! any_dispatch {
    ($dt:expr, $T:ident => $body:expr) => {
        $crate::with_dtype!($dt, $T => $body)
    };
}
pub(crate) use {any_dispatch, float_dispatch, numeric_dispatch};

/// Addition, subtraction and multiplication that wrap around on int64 overflow (as PyTorch's
/// do) instead of panicking; plain IEEE arithmetic on floats.
pub(crate) trait WrappingArith: Copy {
    fn wadd(self, o: Self) -> Self;
    fn wsub(self, o: Self) -> Self;
    fn wmul(self, o: Self) -> Self;
}
macro_rules! impl_wrapping_float {
    ($($t:ty),*) => {$(
        impl WrappingArith for $t {
            #[inline]
            fn wadd(self, o: Self) -> Self { self + o }
            #[inline]
            fn wsub(self, o: Self) -> Self { self - o }
            #[inline]
            fn wmul(self, o: Self) -> Self { self * o }
        }
    )*};
}
impl_wrapping_float!(f32, f64);
/// The 16-bit types: in float32, rounded once, with the kernels' branch-free conversions (so
/// their loops vectorize; `half`'s operators round the same but branch).
macro_rules! impl_wrapping_half {
    ($($t:ty),*) => {$(
        impl WrappingArith for $t {
            #[inline(always)]
            fn wadd(self, o: Self) -> Self { <$t as Elem>::store(self.load() + o.load()) }
            #[inline(always)]
            fn wsub(self, o: Self) -> Self { <$t as Elem>::store(self.load() - o.load()) }
            #[inline(always)]
            fn wmul(self, o: Self) -> Self { <$t as Elem>::store(self.load() * o.load()) }
        }
    )*};
}
impl_wrapping_half!(half::bf16, half::f16);
impl WrappingArith for i64 {
    #[inline]
    fn wadd(self, o: Self) -> Self {
        self.wrapping_add(o)
    }
    #[inline]
    fn wsub(self, o: Self) -> Self {
        self.wrapping_sub(o)
    }
    #[inline]
    fn wmul(self, o: Self) -> Self {
        self.wrapping_mul(o)
    }
}

/// Runs `f` on the elements of two tensors of element types `A` and `B`, locking a shared
/// storage only once.
pub(crate) fn with_two<A: StorageElement, B: StorageElement, R>(
    a: &Tensor,
    b: &Tensor,
    op: &'static str,
    f: impl FnOnce(&[A], &crate::Layout, &[B], &crate::Layout) -> R,
) -> Result<R> {
    if Arc::ptr_eq(&a.0.storage, &b.0.storage) {
        let guard = a.0.storage.read();
        let crate::storage::Storage::Cpu(c) = &*guard else {
            return Err(crate::tensor::not_on_host(op, &guard));
        };
        crate::tensor::check_extent(c.len(), a.layout(), op)?;
        crate::tensor::check_extent(c.len(), b.layout(), op)?;
        let sa = A::slice(c).ok_or_else(|| Error::DTypeMismatch {
            op,
            lhs: c.dtype(),
            rhs: A::DTYPE,
        })?;
        let sb = B::slice(c).ok_or_else(|| Error::DTypeMismatch {
            op,
            lhs: c.dtype(),
            rhs: B::DTYPE,
        })?;
        return Ok(f(sa, a.layout(), sb, b.layout()));
    }
    a.with_slice(op, |sa: &[A], la| {
        b.with_slice(op, |sb: &[B], lb| f(sa, la, sb, lb))
    })?
}

/// `f` on the host elements of every tensor of `ts` (all of dtype `T`) with their layouts;
/// each storage is locked once however many of the tensors view it.
pub(crate) fn with_all<T: StorageElement, R>(
    ts: &[&Tensor],
    op: &'static str,
    f: impl FnOnce(&[(&[T], &crate::Layout)]) -> R,
) -> Result<R> {
    let mut cells: Vec<&Arc<crate::storage::StorageCell>> = Vec::new();
    let mut which = Vec::with_capacity(ts.len());
    for t in ts {
        match cells.iter().position(|c| Arc::ptr_eq(c, &t.0.storage)) {
            Some(i) => which.push(i),
            None => {
                which.push(cells.len());
                cells.push(&t.0.storage);
            }
        }
    }
    let guards: Vec<_> = cells.iter().map(|c| c.read()).collect();
    let mut slices: Vec<&[T]> = Vec::with_capacity(guards.len());
    for g in &guards {
        let crate::storage::Storage::Cpu(c) = &**g else {
            return Err(crate::tensor::not_on_host(op, g));
        };
        slices.push(T::slice(c).ok_or_else(|| Error::DTypeMismatch {
            op,
            lhs: c.dtype(),
            rhs: T::DTYPE,
        })?);
    }
    let views: Vec<(&[T], &crate::Layout)> = ts
        .iter()
        .zip(&which)
        .map(|(t, &i)| (slices[i], t.layout()))
        .collect();
    Ok(f(&views))
}

/// The device path of an elementwise operation of one tensor: `f` on its device storage,
/// giving a new tensor of the same shape; `None` for host tensors.
pub(crate) fn device_map(
    x: &Tensor,
    f: impl FnOnce(&CudaStorage, &crate::Layout) -> Result<CudaStorage>,
) -> Option<Result<Tensor>> {
    backend::on_device(x, |c, l| Ok(backend::device_tensor(f(c, l)?, x.shape())))
}

/// The device path of an elementwise operation of two tensors with broadcasting: `f` on their
/// device storages and layouts broadcast to the output's shape; `None` unless both are on a
/// device.
pub(crate) fn device_map2(
    a: &Tensor,
    b: &Tensor,
    op: &'static str,
    f: impl FnOnce(&CudaStorage, &crate::Layout, &CudaStorage, &crate::Layout) -> Result<CudaStorage>,
) -> Option<Result<Tensor>> {
    backend::on_device2(a, b, |ca, la, cb, lb| {
        let shape = crate::layout::broadcast_shapes(a.shape(), b.shape(), op)?;
        let (la, lb) = (la.broadcast_to(&shape, op)?, lb.broadcast_to(&shape, op)?);
        Ok(backend::device_tensor(f(ca, &la, cb, &lb)?, &shape))
    })
}

/// Checks that two tensors share a device.
pub(crate) fn same_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: a.device(),
            rhs: b.device(),
        });
    }
    Ok(())
}

/// Collects the elements of a strided view into a row-major vector (a buffer of the caching
/// allocator; rows whose elements are adjacent are copied whole).
pub(crate) fn gather_strided<T: StorageElement>(s: &[T], l: &crate::Layout) -> Vec<T> {
    if let Some(r) = l.contiguous_range() {
        let mut v = crate::storage::pool::take::<T>(r.len());
        v.copy_from_slice(&s[r]);
        return v;
    }
    let n = l.numel();
    let mut v = crate::storage::pool::take::<T>(n);
    let nd = l.shape.len();
    if n == 0 || nd == 0 {
        l.for_each_offset(|o| v[0] = s[o]);
        return v;
    }
    let inner = l.shape[nd - 1];
    let mut i = 0;
    if l.strides[nd - 1] == 1 {
        let rows = crate::Layout {
            shape: l.shape[..nd - 1].to_vec(),
            strides: l.strides[..nd - 1].to_vec(),
            offset: l.offset,
        };
        rows.for_each_offset(|o| {
            v[i..i + inner].copy_from_slice(&s[o..o + inner]);
            i += inner;
        });
    } else {
        l.for_each_offset(|o| {
            v[i] = s[o];
            i += 1;
        });
    }
    v
}
