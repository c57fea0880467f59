//! Reductions over dimensions: sum, mean, and the `sum_to_size` that broadcasting's backward
//! needs. The kernel [`reduce_kernel`] is shared with max/min/argmax.

use super::{float_dispatch, numeric_dispatch};
use crate::autograd::{Context, Function, apply};
use crate::backend::{self, DeviceStorage as _, ReduceCode};
use crate::layout::{Layout, normalize_dim};
use crate::storage::StorageElement;
use crate::{Error, Result, Tensor};

/// Normalises and deduplicates reduction dims; empty means all dims.
pub(crate) fn reduce_dims(dims: &[isize], ndim: usize, op: &'static str) -> Result<Vec<usize>> {
    if dims.is_empty() {
        return Ok((0..ndim).collect());
    }
    let mut out = Vec::with_capacity(dims.len());
    for &d in dims {
        let d = normalize_dim(d, ndim, op)?;
        if out.contains(&d) {
            return Err(Error::invalid(
                op,
                "dims",
                "distinct dimensions",
                format!("{dims:?}"),
            ));
        }
        out.push(d);
    }
    out.sort_unstable();
    Ok(out)
}

/// The output shape of reducing `dims` of `shape`.
pub(crate) fn reduced_shape(shape: &[usize], dims: &[usize], keepdim: bool) -> Vec<usize> {
    shape
        .iter()
        .enumerate()
        .filter_map(|(i, &s)| {
            if dims.contains(&i) {
                keepdim.then_some(1)
            } else {
                Some(s)
            }
        })
        .collect()
}

/// Splits a layout into the kept dims (`outer`, a layout) and the reduced dims (relative
/// offsets in row-major order of the reduced dims).
pub(crate) fn split_layout(l: &Layout, dims: &[usize]) -> (Layout, Vec<usize>) {
    let mut outer = Layout {
        shape: vec![],
        strides: vec![],
        offset: l.offset,
    };
    let mut inner = Layout {
        shape: vec![],
        strides: vec![],
        offset: 0,
    };
    for i in 0..l.shape.len() {
        let dst = if dims.contains(&i) {
            &mut inner
        } else {
            &mut outer
        };
        dst.shape.push(l.shape[i]);
        dst.strides.push(l.strides[i]);
    }
    (outer, inner.offsets())
}

/// For each output element (kept dims, row-major), folds the reduced elements with `f`,
/// which gets the values in row-major order of the reduced dims and returns the result.
pub(crate) fn reduce_kernel<T: StorageElement, R: StorageElement>(
    x: &Tensor,
    dims: &[usize],
    op: &'static str,
    f: impl Fn(&mut dyn Iterator<Item = T>) -> R,
) -> Result<Vec<R>> {
    x.with_slice(op, |s: &[T], l| {
        let (outer, inner) = split_layout(l, dims);
        let mut out = Vec::with_capacity(outer.numel());
        let inner_contig = inner.iter().enumerate().all(|(i, &o)| o == i);
        outer.for_each_offset(|o| {
            if inner.is_empty() {
                // an empty reduction must not index the storage (it may be empty)
                out.push(f(&mut std::iter::empty()));
            } else if inner_contig {
                let mut it = s[o..o + inner.len()].iter().copied();
                out.push(f(&mut it));
            } else {
                let mut it = inner.iter().map(|&r| s[o + r]);
                out.push(f(&mut it));
            }
        });
        out
    })
}

fn sum_values<T: StorageElement + super::WrappingArith>(it: &mut dyn Iterator<Item = T>) -> T {
    // eight interleaved partial sums: fewer rounding steps than one running sum; int64 sums
    // wrap on overflow
    let mut acc = [T::default(); 8];
    for (i, v) in it.enumerate() {
        acc[i & 7] = acc[i & 7].wadd(v);
    }
    let a = (acc[0].wadd(acc[4])).wadd(acc[1].wadd(acc[5]));
    let b = (acc[2].wadd(acc[6])).wadd(acc[3].wadd(acc[7]));
    a.wadd(b)
}

fn sum_kernel(x: &Tensor, dims: &[usize], keepdim: bool) -> Result<Tensor> {
    let shape = reduced_shape(x.shape(), dims, keepdim);
    let x = if x.dtype() == crate::DType::Bool {
        x.to_dtype(crate::DType::I64)?
    } else {
        x.clone()
    };
    if let Some(r) = backend::on_device(&x, |c, l| c.reduce(l, dims, ReduceCode::Sum, false)) {
        return Ok(backend::device_tensor(r?.0, &shape));
    }
    if x.is_contiguous() && crate::kernels::reduce::trailing(dims, x.ndim()) && x.dtype().is_float()
    {
        // float sums over trailing dims: the vectorised row kernel, in fixed pieces
        let n: usize = dims.iter().map(|&d| x.shape()[d]).product();
        let rows = x
            .numel()
            .checked_div(n)
            .unwrap_or_else(|| shape.iter().product());
        return float_dispatch!(x.dtype(), "sum", T => {
            let v = x.with_slice("sum", |s: &[T], l| {
                crate::kernels::reduce::sum_rows(&s[l.offset()..l.offset() + l.numel()], rows, n)
            })?;
            Ok(Tensor::from_cpu(T::into_storage(v), &shape))
        });
    }
    if x.dtype().is_half() {
        // other dims of a 16-bit tensor: summed in float32, rounded once
        return sum_kernel(&x.to_dtype(crate::DType::F32)?, dims, keepdim)?.to_dtype(x.dtype());
    }
    let leading = !dims.is_empty()
        && dims.len() < x.ndim()
        && dims.iter().enumerate().all(|(i, &d)| i == d)
        && x.is_contiguous();
    numeric_dispatch!(x.dtype(), "sum", T => {
        let v = if leading {
            // the gradients of broadcast operands (a bias over rows): whole rows added in turn
            let inner: usize = x.shape()[dims.len()..].iter().product();
            x.with_slice("sum", |s: &[T], l| sum_rows(&s[l.offset()..l.offset() + l.numel()], inner))?
        } else {
            reduce_kernel::<T, T>(&x, dims, "sum", |it| sum_values(it))?
        };
        Ok(Tensor::from_cpu(T::into_storage(v), &shape))
    })
}

/// The sum of the rows of `x` (`inner` elements each), accumulated in blocks of 32 rows added
/// to the total (fewer rounding steps than one running sum over every row). Columns are cut
/// into pieces of 64 summed on the intra-op threads; each column is summed in the same order
/// whatever the thread count.
fn sum_rows<T: StorageElement + super::WrappingArith>(x: &[T], inner: usize) -> Vec<T> {
    const COLS: usize = 64;
    let mut total = vec![T::default(); inner];
    if inner == 0 {
        return total;
    }
    crate::kernels::for_each_chunk(&mut total, COLS, x.len(), |p, total| {
        let c0 = p * COLS;
        let w = total.len();
        let mut block = vec![T::default(); w];
        for rows in x.chunks(32 * inner) {
            block.copy_from_slice(&rows[c0..c0 + w]);
            for row in rows.chunks_exact(inner).skip(1) {
                for (b, &v) in block.iter_mut().zip(&row[c0..c0 + w]) {
                    *b = b.wadd(v);
                }
            }
            for (t, &b) in total.iter_mut().zip(&block) {
                *t = t.wadd(b);
            }
        }
    });
    total
}

struct Sum {
    dims: Vec<usize>,
    keepdim: bool,
}
impl Function for Sum {
    fn name(&self) -> &str {
        "SumBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        ctx.save_value(inputs[0].shape().to_vec());
        Ok(vec![sum_kernel(inputs[0], &self.dims, self.keepdim)?])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let shape = ctx.get::<Vec<usize>>()?;
        let kept = reduced_shape(shape, &self.dims, true);
        Ok(vec![Some(g[0].reshape(&kept)?.expand(shape)?)])
    }
}

impl Tensor {
    /// Sum of all elements, as a 0-d tensor (`sum()`); bool sums to int64.
    pub fn sum(&self) -> Result<Tensor> {
        self.sum_dims(&[], false)
    }

    /// Sum over `dims` (`sum(dim, keepdim)`); an empty `dims` reduces every dimension.
    /// Errors on repeated or out-of-range dims.
    pub fn sum_dims(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        if let Some(x) = crate::amp::to_fp32(&[self])? {
            return x[0].sum_dims(dims, keepdim);
        }
        let dims = reduce_dims(dims, self.ndim(), "sum")?;
        Ok(apply(Sum { dims, keepdim }, &[self])?.remove(0))
    }

    /// Mean of all elements (float only).
    pub fn mean(&self) -> Result<Tensor> {
        self.mean_dims(&[], false)
    }

    /// Mean over `dims` (float only); an empty `dims` reduces every dimension. A 16-bit
    /// tensor's mean is summed and divided in float32 and rounded once (its sum alone may
    /// overflow the 16-bit type where the mean does not).
    pub fn mean_dims(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        if let Some(x) = crate::amp::to_fp32(&[self])? {
            return x[0].mean_dims(dims, keepdim);
        }
        if !self.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "mean",
                dtype: self.dtype(),
                expected: "a floating dtype (float32, float64, bfloat16 or float16)",
            });
        }
        if self.dtype().is_half() {
            return self
                .float()?
                .mean_dims(dims, keepdim)?
                .to_dtype(self.dtype());
        }
        let d = reduce_dims(dims, self.ndim(), "mean")?;
        // a 0-d tensor reduces over its "dim 0" of size 1
        let count: usize = d
            .iter()
            .map(|&i| self.shape().get(i).copied().unwrap_or(1))
            .product();
        self.sum_dims(dims, keepdim)?.div_scalar(count as f64)
    }

    /// Sums broadcast dimensions away so that the result has `shape` (the inverse of
    /// `expand`, used by the backward of broadcasting ops). Errors when `shape` does not
    /// broadcast to `self`'s shape.
    pub fn sum_to_size(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let nd = self.ndim();
        if shape.len() > nd {
            return Err(Error::ShapeMismatch {
                op: "sum_to_size",
                lhs: self.shape().to_vec(),
                rhs: shape.to_vec(),
            });
        }
        let lead = nd - shape.len();
        let mut dims = Vec::new();
        for i in 0..nd {
            if i < lead || (shape[i - lead] == 1 && self.shape()[i] != 1) {
                dims.push(i as isize);
            } else if shape[i - lead] != self.shape()[i] {
                return Err(Error::ShapeMismatch {
                    op: "sum_to_size",
                    lhs: self.shape().to_vec(),
                    rhs: shape.to_vec(),
                });
            }
        }
        if dims.is_empty() {
            return self.reshape(shape);
        }
        self.sum_dims(&dims, true)?.reshape(shape)
    }
}
