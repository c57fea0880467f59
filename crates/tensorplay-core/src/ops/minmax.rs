//! Max/min reductions: `max_dim`/`min_dim` (values and indices), `max()`/`min()` over all
//! elements, `argmax`/`argmin`. NaN counts as larger (for max) and smaller (for min) than
//! everything, so it propagates, as in PyTorch; ties pick the first index.

use std::cell::RefCell;

use super::numeric_dispatch;
use super::reduce::{reduce_kernel, reduced_shape};
use crate::DType;
use crate::autograd::{Context, Function, apply};
use crate::backend::{self, DeviceStorage as _, ReduceCode};
use crate::layout::normalize_dim;
use crate::storage::StorageElement;
use crate::{Error, Result, Tensor};

/// Index (in row-major order of the reduced dims) of the max (or min) of the values; the
/// first NaN wins, then the first extreme value.
fn arg_extreme<T: PartialOrd + Copy>(
    it: &mut dyn Iterator<Item = T>,
    is_max: bool,
) -> (i64, Option<T>) {
    let mut best: Option<T> = None;
    let mut best_i = 0i64;
    for (i, v) in it.enumerate() {
        #[allow(clippy::eq_op)]
        let v_nan = v != v;
        let replace = match best {
            None => true,
            #[allow(clippy::eq_op)]
            Some(b) if b != b => false,
            Some(b) => v_nan || if is_max { v > b } else { v < b },
        };
        if replace {
            best = Some(v);
            best_i = i as i64;
        }
    }
    (best_i, best)
}

fn op_name(is_max: bool, arg: bool) -> &'static str {
    match (is_max, arg) {
        (true, false) => "max",
        (false, false) => "min",
        (true, true) => "argmax",
        (false, true) => "argmin",
    }
}

/// The int64 indices of the max (min) over `dims` (kept dims in row-major order), as a flat
/// tensor on `x`'s device; indices count in row-major order of the reduced dims.
fn arg_kernel(x: &Tensor, dims: &[usize], is_max: bool, op: &'static str) -> Result<Tensor> {
    let x = x.detach();
    if dims.iter().any(|&d| x.shape()[d] == 0) {
        return Err(Error::invalid(
            op,
            "self",
            "a non-empty reduction (the reduced dimension must have non-zero size)",
            format!("shape {:?}", x.shape()),
        ));
    }
    let code = if is_max {
        ReduceCode::Max
    } else {
        ReduceCode::Min
    };
    if let Some(r) = backend::on_device(&x, |c, l| {
        check_numeric(x.dtype(), op)?;
        let (_, idx) = c.reduce(l, dims, code, true)?;
        idx.ok_or_else(|| Error::NotSupported {
            op,
            detail: "indices from the device".into(),
        })
    }) {
        let idx = r?;
        let m = reduced_shape(x.shape(), dims, false)
            .iter()
            .product::<usize>();
        return Ok(backend::device_tensor(idx, &[m]));
    }
    numeric_dispatch!(x.dtype(), op, T => {
        let v = reduce_kernel::<T, i64>(&x, dims, op, |it| arg_extreme(it, is_max).0)?;
        let n = v.len();
        Tensor::from_vec(v, &[n])
    })
}

fn check_numeric(dt: DType, op: &'static str) -> Result<()> {
    if dt == DType::Bool {
        return Err(Error::UnsupportedDType {
            op,
            dtype: dt,
            expected: "float32, float64 or int64",
        });
    }
    Ok(())
}

/// The value (as `f64`) and flat index of the max (min) over all elements.
fn extreme_all(x: &Tensor, is_max: bool) -> Result<Tensor> {
    let op = op_name(is_max, false);
    let x = x.detach();
    if x.numel() == 0 {
        return Err(Error::invalid(
            op,
            "self",
            "a non-empty tensor (there is no identity for max/min)",
            format!("shape {:?}", x.shape()),
        ));
    }
    let dims: Vec<usize> = (0..x.ndim()).collect();
    let code = if is_max {
        ReduceCode::Max
    } else {
        ReduceCode::Min
    };
    if let Some(r) = backend::on_device(&x, |c, l| {
        check_numeric(x.dtype(), op)?;
        Ok(c.reduce(l, &dims, code, false)?.0)
    }) {
        return Ok(backend::device_tensor(r?, &[]));
    }
    numeric_dispatch!(x.dtype(), op, T => {
        let out = RefCell::new(Vec::<T>::new());
        reduce_kernel::<T, i64>(&x, &dims, op, |it| {
            let (i, v) = arg_extreme(it, is_max);
            if let Some(v) = v {
                out.borrow_mut().push(v);
            }
            i
        })?;
        Ok(Tensor::from_cpu(T::into_storage(out.into_inner()), &[]))
    })
}

/// `max()`/`min()` over all elements; the gradient is split evenly among the elements equal
/// to the result (PyTorch's rule for the full reduction).
struct ExtremeAll {
    is_max: bool,
}
impl Function for ExtremeAll {
    fn name(&self) -> &str {
        if self.is_max {
            "MaxBackward"
        } else {
            "MinBackward"
        }
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let y = extreme_all(inputs[0], self.is_max)?;
        ctx.save_for_backward(&[inputs[0], &y]);
        Ok(vec![y])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let s = ctx.saved_tensors()?;
        let (x, y) = (s[0].detach(), s[1].detach());
        // the positions selected: equal to the result, or NaN when the result is NaN
        let mask = if y.item_f64()?.is_nan() {
            x.ne(&x)?
        } else {
            x.eq(&y)?
        };
        let mask = mask.to_dtype(g[0].dtype())?;
        let count = mask.sum()?;
        Ok(vec![Some(mask.div(&count)?.mul(&g[0])?)])
    }
}

impl Tensor {
    /// Max over `dim` with the index of the max (`torch.max(x, dim, keepdim)`): returns
    /// `(values, indices)` with int64 indices. NaN propagates; ties pick the first index.
    /// The gradient flows to the selected element only. Errors on an out-of-range `dim`, an
    /// empty reduced dimension, or a bool tensor.
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        self.extreme_dim(dim, keepdim, true)
    }

    /// Min over `dim` with the index of the min (`torch.min(x, dim, keepdim)`); see
    /// [`Tensor::max_dim`].
    pub fn min_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        self.extreme_dim(dim, keepdim, false)
    }

    fn extreme_dim(&self, dim: isize, keepdim: bool, is_max: bool) -> Result<(Tensor, Tensor)> {
        let op = op_name(is_max, false);
        let d = normalize_dim(dim, self.ndim(), op)?;
        if self.ndim() == 0 {
            let idx = Tensor::from_vec(vec![0i64], &[])?.to_device(self.device())?;
            arg_kernel(self, &[], is_max, op)?; // dtype check
            return Ok((self.clone(), idx));
        }
        let kept = reduced_shape(self.shape(), &[d], true);
        let idx = arg_kernel(self, &[d], is_max, op)?.reshape(&kept[..])?;
        // the values are a gather of the input: differentiable, and its backward scatters
        // the gradient to the selected index
        let values = self.gather(d as isize, &idx)?;
        if keepdim {
            Ok((values, idx))
        } else {
            Ok((
                values.squeeze_dim(d as isize)?,
                idx.squeeze_dim(d as isize)?,
            ))
        }
    }

    /// Max of all elements as a 0-d tensor (`torch.max(x)`); NaN propagates. The gradient is
    /// split evenly among tied maxima. Errors on an empty or bool tensor.
    pub fn max(&self) -> Result<Tensor> {
        Ok(apply(ExtremeAll { is_max: true }, &[self])?.remove(0))
    }

    /// Min of all elements as a 0-d tensor (`torch.min(x)`); see [`Tensor::max`].
    pub fn min(&self) -> Result<Tensor> {
        Ok(apply(ExtremeAll { is_max: false }, &[self])?.remove(0))
    }

    /// Index of the max (`torch.argmax`) as int64: over `dim`, or, with `dim = None`, into
    /// the flattened tensor as a 0-d tensor (`keepdim` is then ignored, as in PyTorch).
    /// NaN counts as the max; ties pick the first index. Not differentiable.
    pub fn argmax(&self, dim: Option<isize>, keepdim: bool) -> Result<Tensor> {
        self.arg_extreme(dim, keepdim, true)
    }

    /// Index of the min (`torch.argmin`); see [`Tensor::argmax`].
    pub fn argmin(&self, dim: Option<isize>, keepdim: bool) -> Result<Tensor> {
        self.arg_extreme(dim, keepdim, false)
    }

    fn arg_extreme(&self, dim: Option<isize>, keepdim: bool, is_max: bool) -> Result<Tensor> {
        let op = op_name(is_max, true);
        match dim {
            None => {
                let flat = self.detach().reshape(&[self.numel()])?;
                arg_kernel(&flat, &[0], is_max, op)?.reshape(&[] as &[usize])
            }
            Some(dim) => {
                let d = normalize_dim(dim, self.ndim(), op)?;
                if self.ndim() == 0 {
                    arg_kernel(self, &[], is_max, op)?;
                    return Tensor::from_vec(vec![0i64], &[])?.to_device(self.device());
                }
                arg_kernel(self, &[d], is_max, op)?
                    .reshape(&reduced_shape(self.shape(), &[d], keepdim)[..])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_and_ties() {
        let v = [1.0f64, 3.0, 3.0, 2.0];
        assert_eq!(arg_extreme(&mut v.iter().copied(), true), (1, Some(3.0)));
        assert_eq!(arg_extreme(&mut v.iter().copied(), false), (0, Some(1.0)));
        let v = [1.0f64, f64::NAN, 5.0, f64::NAN];
        let (i, b) = arg_extreme(&mut v.iter().copied(), true);
        assert_eq!(i, 1);
        assert!(b.is_some_and(f64::is_nan));
        let (i, _) = arg_extreme(&mut v.iter().copied(), false);
        assert_eq!(i, 1);
    }
}
