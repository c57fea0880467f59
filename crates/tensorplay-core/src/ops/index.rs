//! Indexing with int64 index tensors: `index_select`, `gather`, `scatter_add`. Each one's
//! backward is written with the others, so every order of derivative works.

use super::{WrappingArith, any_dispatch, gather_strided, numeric_dispatch, same_device};
use crate::autograd::{Context, Function, apply};
use crate::backend::{self, DeviceStorage as _, IndexKind};
use crate::cuda::CudaStorage;
use crate::layout::{Layout, contiguous_strides, normalize_dim};
use crate::storage::StorageElement;
use crate::{DType, Error, Result, Tensor};

/// The values of an int64 index tensor in row-major order.
fn index_values(index: &Tensor, op: &'static str) -> Result<Vec<i64>> {
    if index.dtype() != DType::I64 {
        return Err(Error::UnsupportedDType {
            op,
            dtype: index.dtype(),
            expected: "int64 for the index",
        });
    }
    // device indices are read back for the bounds check (as a synchronising copy)
    index.to_vec::<i64>()
}

/// `x`'s view restricted to `shape` (no larger in any dim) as contiguous device storage.
fn device_contiguous(
    c: &CudaStorage,
    l: &Layout,
    shape: &[usize],
    dt: DType,
) -> Result<CudaStorage> {
    c.copy_as(&sub_layout(l, shape, 0, false), dt)
}

/// `[outer, size, inner]` of `shape` around `d` (all 1 for a 0-d tensor).
fn around(shape: &[usize], d: usize) -> (usize, usize, usize) {
    if shape.is_empty() {
        return (1, 1, 1);
    }
    (
        shape[..d].iter().product(),
        shape[d],
        shape[d + 1..].iter().product(),
    )
}

/// Errors with `IndexOutOfBounds` for the first index outside `0..size` (negative indices
/// are errors, as in PyTorch's `gather`/`scatter_add`/`index_select`).
fn check_bounds(idx: &[i64], size: usize, dim: usize, op: &'static str) -> Result<()> {
    match idx.iter().find(|&&i| i < 0 || i as u64 >= size as u64) {
        Some(&index) => Err(Error::IndexOutOfBounds {
            op,
            index,
            dim,
            size,
        }),
        None => Ok(()),
    }
}

/// `layout` restricted to `shape` (each dim no larger), with dimension `dim`'s stride set to
/// 0 when `zero_dim` (its position is added from an index instead).
fn sub_layout(layout: &Layout, shape: &[usize], dim: usize, zero_dim: bool) -> Layout {
    let mut l = Layout {
        shape: shape.to_vec(),
        strides: layout.strides.clone(),
        offset: layout.offset,
    };
    if zero_dim && !shape.is_empty() {
        l.strides[dim] = 0;
    }
    l
}

fn index_select_kernel(x: &Tensor, d: usize, idx: &[i64]) -> Result<Tensor> {
    let op = "index_select";
    check_bounds(idx, x.shape()[d], d, op)?;
    let mut shape = x.shape().to_vec();
    shape[d] = idx.len();
    let inner: usize = shape[d + 1..].iter().product();
    if let Some(r) = backend::on_device(x, |c, l| {
        let xc = device_contiguous(c, l, x.shape(), x.dtype())?;
        let it = c.upload(&crate::CpuStorage::I64(idx.to_vec()))?;
        let (outer, size, inner) = around(x.shape(), d);
        xc.index(IndexKind::Select, &it, (outer, size, idx.len(), inner))
    }) {
        return Ok(backend::device_tensor(r?, &shape));
    }
    any_dispatch!(x.dtype(), T => {
        let v = x.with_slice(op, |s: &[T], l| {
            let base = sub_layout(l, &shape, d, true);
            let sd = l.strides[d];
            let mut out = Vec::with_capacity(base.numel());
            let mut k = 0usize;
            base.for_each_offset(|o| {
                out.push(s[o + idx[(k / inner) % idx.len()] as usize * sd]);
                k += 1;
            });
            out
        })?;
        Ok(Tensor::from_cpu(T::into_storage(v), &shape))
    })
}

fn gather_kernel(x: &Tensor, d: usize, index: &Tensor) -> Result<Tensor> {
    let op = "gather";
    let idx = index_values(index, op)?;
    check_bounds(&idx, x.shape().get(d).copied().unwrap_or(1), d, op)?;
    let shape = index.shape().to_vec();
    if let Some(r) = backend::on_device(x, |c, l| {
        let mut xs = shape.clone();
        if let Some(s) = xs.get_mut(d) {
            *s = x.shape()[d];
        }
        let xc = device_contiguous(c, l, &xs, x.dtype())?;
        let it = c.upload(&crate::CpuStorage::I64(idx.clone()))?;
        let (outer, size, inner) = around(&xs, d);
        xc.index(
            IndexKind::Gather,
            &it,
            (outer, size, shape.get(d).copied().unwrap_or(1), inner),
        )
    }) {
        return Ok(backend::device_tensor(r?, &shape));
    }
    any_dispatch!(x.dtype(), T => {
        let v = x.with_slice(op, |s: &[T], l| {
            let base = sub_layout(l, &shape, d, true);
            let sd = l.strides.get(d).copied().unwrap_or(0);
            let mut out = Vec::with_capacity(idx.len());
            let mut k = 0usize;
            base.for_each_offset(|o| {
                out.push(s[o + idx[k] as usize * sd]);
                k += 1;
            });
            out
        })?;
        Ok(Tensor::from_cpu(T::into_storage(v), &shape))
    })
}

fn scatter_add_kernel(x: &Tensor, d: usize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
    let op = "scatter_add";
    let idx = index_values(index, op)?;
    check_bounds(&idx, x.shape().get(d).copied().unwrap_or(1), d, op)?;
    let ishape = index.shape().to_vec();
    let cs = contiguous_strides(x.shape());
    let base = Layout {
        shape: ishape.clone(),
        strides: cs.clone(),
        offset: 0,
    };
    let base = sub_layout(&base, &ishape, d, true);
    let sd = cs.get(d).copied().unwrap_or(0);
    if let Some(r) = backend::on_device2(x, src, |cx, lx, cs_, ls| {
        let same_other_dims = ishape
            .iter()
            .zip(x.shape())
            .enumerate()
            .all(|(j, (a, b))| j == d || a == b);
        if !same_other_dims {
            return Err(Error::NotSupported {
                op,
                detail: format!(
                    "on CUDA with an index smaller than self outside dim {d} (index {ishape:?}, self {:?})",
                    x.shape()
                ),
            });
        }
        if src.dtype() != x.dtype() {
            return Err(Error::DTypeMismatch {
                op,
                lhs: x.dtype(),
                rhs: src.dtype(),
            });
        }
        let mut out = cx.copy_as(lx, x.dtype())?;
        let srcc = device_contiguous(cs_, ls, &ishape, x.dtype())?;
        let it = cx.upload(&crate::CpuStorage::I64(idx.clone()))?;
        let (outer, size, inner) = around(x.shape(), d);
        out.scatter_add(
            &it,
            &srcc,
            (outer, size, ishape.get(d).copied().unwrap_or(1), inner),
        )?;
        Ok(out)
    }) {
        return Ok(backend::device_tensor(r?, x.shape()));
    }
    numeric_dispatch!(x.dtype(), op, T => {
        let mut out: Vec<T> = x.with_slice(op, |s: &[T], l| gather_strided(s, l))?;
        let srcv: Vec<T> = src.with_slice(op, |s: &[T], l| {
            gather_strided(s, &sub_layout(l, &ishape, d, false))
        })?;
        let mut k = 0usize;
        base.for_each_offset(|o| {
            let t = o + idx[k] as usize * sd;
            out[t] = out[t].wadd(srcv[k]);
            k += 1;
        });
        crate::storage::pool::give_back(srcv);
        Ok(Tensor::from_cpu(T::into_storage(out), x.shape()))
    })
}

struct IndexSelect {
    dim: usize,
    index: Tensor,
}
impl Function for IndexSelect {
    fn name(&self) -> &str {
        "IndexSelectBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let idx = index_values(&self.index, "index_select")?;
        ctx.save_value(inputs[0].shape().to_vec());
        Ok(vec![index_select_kernel(inputs[0], self.dim, &idx)?])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        // index_add into zeros: scatter_add with the index broadcast along the other dims
        let shape = ctx.get::<Vec<usize>>()?;
        let g = &g[0];
        let mut ishape = vec![1; g.ndim()];
        ishape[self.dim] = self.index.numel();
        let index = self.index.reshape(&ishape)?.expand(g.shape())?;
        let z = Tensor::zeros(shape, (g.dtype(), g.device()))?;
        Ok(vec![Some(z.scatter_add(self.dim as isize, &index, g)?)])
    }
}

struct Gather {
    dim: usize,
    index: Tensor,
}
impl Function for Gather {
    fn name(&self) -> &str {
        "GatherBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        ctx.save_value(inputs[0].shape().to_vec());
        Ok(vec![gather_kernel(inputs[0], self.dim, &self.index)?])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let shape = ctx.get::<Vec<usize>>()?;
        let g = &g[0];
        let z = Tensor::zeros(shape, (g.dtype(), g.device()))?;
        Ok(vec![Some(z.scatter_add(
            self.dim as isize,
            &self.index,
            g,
        )?)])
    }
}

struct ScatterAdd {
    dim: usize,
    index: Tensor,
}
impl Function for ScatterAdd {
    fn name(&self) -> &str {
        "ScatterAddBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        ctx.save_value(inputs[1].shape().to_vec());
        Ok(vec![scatter_add_kernel(
            inputs[0],
            self.dim,
            &self.index,
            inputs[1],
        )?])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let g = &g[0];
        let gs = if ctx.needs_input_grad(1) {
            // src elements outside the index's extent did not contribute: pad with zeros
            let src_shape = ctx.get::<Vec<usize>>()?;
            let mut gs = g.gather(self.dim as isize, &self.index)?;
            for (d, &n) in src_shape.iter().enumerate() {
                let have = gs.shape()[d];
                if have < n {
                    let mut zs = gs.shape().to_vec();
                    zs[d] = n - have;
                    let z = Tensor::zeros(&zs, (gs.dtype(), gs.device()))?;
                    gs = Tensor::cat(&[gs, z], d as isize)?;
                }
            }
            Some(gs)
        } else {
            None
        };
        Ok(vec![ctx.needs_input_grad(0).then(|| g.clone()), gs])
    }
}

/// Checks `index` against `self` (and `src`) for gather/scatter: same number of dims and
/// each index dim no larger than the tensor's (except `dim` of `self`).
fn check_index_shape(
    op: &'static str,
    x: &Tensor,
    d: usize,
    index: &Tensor,
    src: Option<&Tensor>,
) -> Result<()> {
    if index.dtype() != DType::I64 {
        return Err(Error::UnsupportedDType {
            op,
            dtype: index.dtype(),
            expected: "int64 for the index",
        });
    }
    same_device(op, x, index)?;
    if index.ndim() != x.ndim() {
        return Err(Error::invalid(
            op,
            "index",
            format!("a tensor with as many dimensions as self ({})", x.ndim()),
            format!("{} dimensions", index.ndim()),
        ));
    }
    let fits = |t: &Tensor, skip: bool| {
        index
            .shape()
            .iter()
            .zip(t.shape())
            .enumerate()
            .all(|(i, (&a, &b))| (skip && i == d) || a <= b)
    };
    if !fits(x, true) {
        return Err(Error::ShapeMismatch {
            op,
            lhs: x.shape().to_vec(),
            rhs: index.shape().to_vec(),
        });
    }
    if let Some(src) = src {
        same_device(op, x, src)?;
        if src.dtype() != x.dtype() {
            return Err(Error::DTypeMismatch {
                op,
                lhs: x.dtype(),
                rhs: src.dtype(),
            });
        }
        if src.ndim() != x.ndim() || !fits(src, false) {
            return Err(Error::ShapeMismatch {
                op,
                lhs: src.shape().to_vec(),
                rhs: index.shape().to_vec(),
            });
        }
    }
    Ok(())
}

impl Tensor {
    /// The slices `index[i]` of `dim` (`torch.index_select`): the result has `self`'s shape
    /// with `dim` of size `index.numel()`. `index` is a 0- or 1-d int64 tensor; indices
    /// outside `0..size` (negative ones too) give [`Error::IndexOutOfBounds`].
    /// Differentiable in `self` (the backward adds the gradient at the selected slices).
    pub fn index_select(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        let op = "index_select";
        let d = normalize_dim(dim, self.ndim(), op)?;
        if self.ndim() == 0 {
            return Err(Error::invalid(
                op,
                "self",
                "a tensor with at least one dimension",
                "a 0-d tensor",
            ));
        }
        if index.ndim() > 1 {
            return Err(Error::invalid(
                op,
                "index",
                "a 0-d or 1-d int64 tensor",
                format!("shape {:?}", index.shape()),
            ));
        }
        same_device(op, self, index)?;
        let idx = index_values(index, op)?;
        check_bounds(&idx, self.shape()[d], d, op)?;
        let index = Tensor::from_vec(idx, &[index.numel()])?.to_device(self.device())?;
        Ok(apply(IndexSelect { dim: d, index }, &[self])?.remove(0))
    }

    /// `out[i][j][k] = self[index[i][j][k]][j][k]` for `dim = 0`, and likewise for other dims
    /// (`torch.gather`). `index` is int64 with as many dims as `self`, each no larger than
    /// `self`'s except `dim`; the result has `index`'s shape. Differentiable in `self`.
    pub fn gather(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        let op = "gather";
        let d = normalize_dim(dim, self.ndim(), op)?;
        check_index_shape(op, self, d, index, None)?;
        let idx = index_values(index, op)?;
        check_bounds(&idx, self.shape().get(d).copied().unwrap_or(1), d, op)?;
        let index = index.detach();
        Ok(apply(Gather { dim: d, index }, &[self])?.remove(0))
    }

    /// A copy of `self` with `src[i][j][k]` added at `[index[i][j][k]][j][k]` for `dim = 0`,
    /// and likewise for other dims (out-of-place `torch.scatter_add`). `index` and `src`
    /// have as many dims as `self`; `index` is no larger than `src` in every dim and than
    /// `self` except in `dim`. Differentiable in `self` and `src`.
    pub fn scatter_add(&self, dim: isize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        let op = "scatter_add";
        let d = normalize_dim(dim, self.ndim(), op)?;
        check_index_shape(op, self, d, index, Some(src))?;
        let idx = index_values(index, op)?;
        check_bounds(&idx, self.shape().get(d).copied().unwrap_or(1), d, op)?;
        let index = index.detach();
        Ok(apply(ScatterAdd { dim: d, index }, &[self, src])?.remove(0))
    }

    /// In-place [`Tensor::scatter_add`] (`scatter_add_`): bumps the version counter and, when
    /// recording, makes `self` take the result's history.
    pub fn scatter_add_(&self, dim: isize, index: &Tensor, src: &Tensor) -> Result<()> {
        let r = self.scatter_add(dim, index, src)?;
        self.copy_(&r)
    }
}
