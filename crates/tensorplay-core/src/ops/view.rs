//! Views without copies: reshape/view, permute/transpose, narrow/select, squeeze/unsqueeze,
//! expand; and `contiguous`.

use super::any_dispatch;
use crate::autograd::{Context, Function, apply};
use crate::backend::DeviceStorage as _;
use crate::layout::{Layout, checked_numel, contiguous_strides, normalize_dim};
use crate::storage::StorageElement;
use crate::{Error, Result, Tensor};

fn resolve_shape(numel: usize, shape: &[isize], op: &'static str) -> Result<Vec<usize>> {
    let mut infer = None;
    let mut known = 1usize;
    for (i, &s) in shape.iter().enumerate() {
        if s == -1 {
            if infer.is_some() {
                return Err(Error::invalid(
                    op,
                    "shape",
                    "at most one -1",
                    format!("{shape:?}"),
                ));
            }
            infer = Some(i);
        } else if s < 0 {
            return Err(Error::invalid(
                op,
                "shape",
                "sizes >= 0 or -1",
                format!("{shape:?}"),
            ));
        } else {
            known = known.checked_mul(s as usize).ok_or_else(|| {
                Error::invalid(
                    op,
                    "shape",
                    "a shape whose number of elements fits in usize",
                    format!("{shape:?}"),
                )
            })?;
        }
    }
    let mut out: Vec<usize> = shape.iter().map(|&s| s.max(0) as usize).collect();
    if let Some(i) = infer {
        if known == 0 || !numel.is_multiple_of(known) {
            return Err(Error::invalid(
                op,
                "shape",
                format!("a shape compatible with {numel} elements"),
                format!("{shape:?}"),
            ));
        }
        out[i] = numel / known;
    }
    if checked_numel(&out, op)? != numel {
        return Err(Error::invalid(
            op,
            "shape",
            format!("a shape with {numel} elements"),
            format!("{shape:?}"),
        ));
    }
    Ok(out)
}

/// A shape argument: `&[usize]` or `&[isize]` (the latter allows one `-1`).
pub trait ShapeArg {
    /// The target shape for a tensor of `numel` elements.
    fn resolve(&self, numel: usize, op: &'static str) -> Result<Vec<usize>>;
}
impl ShapeArg for [usize] {
    fn resolve(&self, numel: usize, op: &'static str) -> Result<Vec<usize>> {
        // a size above isize::MAX must not wrap around to -1 (and be inferred)
        let v = self
            .iter()
            .map(|&s| isize::try_from(s))
            .collect::<std::result::Result<Vec<isize>, _>>()
            .map_err(|_| {
                Error::invalid(
                    op,
                    "shape",
                    "sizes of at most isize::MAX",
                    format!("{self:?}"),
                )
            })?;
        resolve_shape(numel, &v, op)
    }
}
impl<const N: usize> ShapeArg for [usize; N] {
    fn resolve(&self, numel: usize, op: &'static str) -> Result<Vec<usize>> {
        self.as_slice().resolve(numel, op)
    }
}
impl ShapeArg for Vec<usize> {
    fn resolve(&self, numel: usize, op: &'static str) -> Result<Vec<usize>> {
        self.as_slice().resolve(numel, op)
    }
}
impl ShapeArg for [isize] {
    fn resolve(&self, numel: usize, op: &'static str) -> Result<Vec<usize>> {
        resolve_shape(numel, self, op)
    }
}
impl<const N: usize> ShapeArg for [isize; N] {
    fn resolve(&self, numel: usize, op: &'static str) -> Result<Vec<usize>> {
        resolve_shape(numel, self, op)
    }
}
impl ShapeArg for Vec<isize> {
    fn resolve(&self, numel: usize, op: &'static str) -> Result<Vec<usize>> {
        resolve_shape(numel, self, op)
    }
}

// Plain integer literals (`x.reshape(&[4, -1])`) infer as i32, so i32 and i64 shapes work too.
macro_rules! signed_shape {
    ($t:ty) => {
        impl ShapeArg for [$t] {
            fn resolve(&self, numel: usize, op: &'static str) -> Result<Vec<usize>> {
                let v: Vec<isize> = self.iter().map(|&s| s as isize).collect();
                resolve_shape(numel, &v, op)
            }
        }
        impl<const N: usize> ShapeArg for [$t; N] {
            fn resolve(&self, numel: usize, op: &'static str) -> Result<Vec<usize>> {
                self.as_slice().resolve(numel, op)
            }
        }
        impl ShapeArg for Vec<$t> {
            fn resolve(&self, numel: usize, op: &'static str) -> Result<Vec<usize>> {
                self.as_slice().resolve(numel, op)
            }
        }
    };
}
signed_shape!(i32);
signed_shape!(i64);

/// A view with another layout over the same storage.
struct Restride {
    name: &'static str,
    layout: Layout,
    back: Back,
}
enum Back {
    Reshape(Vec<usize>),
    Permute(Vec<usize>),
    Expand(Vec<usize>),
    Narrow {
        shape: Vec<usize>,
        dim: usize,
        start: usize,
    },
}
impl Function for Restride {
    fn name(&self) -> &str {
        self.name
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![inputs[0].view_with_layout(self.layout.clone())])
    }
    fn backward(&self, _ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let g = &g[0];
        Ok(vec![Some(match &self.back {
            Back::Reshape(s) => g.reshape(s.as_slice())?,
            Back::Permute(inv) => g.permute(inv)?,
            Back::Expand(s) => g.sum_to_size(s)?,
            Back::Narrow { shape, dim, start } => narrow_backward(g, shape, *dim, *start)?,
        })])
    }
}

/// Zeros of `shape` with `g` written at `start..start+len` along `dim`; differentiable (its
/// backward is `narrow`).
struct NarrowBackward {
    shape: Vec<usize>,
    dim: usize,
    start: usize,
    len: usize,
}
impl Function for NarrowBackward {
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let g = inputs[0];
        if g.device() != crate::Device::Cpu {
            let out = Tensor::zeros(&self.shape, (g.dtype(), g.device()))?;
            let region = out.narrow(self.dim as isize, self.start, g.shape()[self.dim])?;
            region.copy_(g)?;
            return Ok(vec![out]);
        }
        Ok(vec![assemble_along(
            &self.shape,
            self.dim,
            &[(self.start, g)],
        )?])
    }
    fn backward(&self, _ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(g[0].narrow(
            self.dim as isize,
            self.start,
            self.len,
        )?)])
    }
}

/// On the host: a new contiguous tensor of `shape` whose elements `at..at + len` along `dim`
/// are `part`'s, for each `(at, part)` of `parts` (host tensors of one dtype, each of `shape`
/// but `len` along `dim`; the ranges do not overlap), and zeros wherever no part lands: the
/// forward of `cat` and of `narrow`'s backward. One pass over the output: each row's gaps are
/// zeroed and each part's rows copied in place (a part that is not contiguous is gathered
/// once into a scratch buffer of the caching allocator).
pub(super) fn assemble_along(
    shape: &[usize],
    dim: usize,
    parts: &[(usize, &Tensor)],
) -> Result<Tensor> {
    let op = "cat";
    let n = checked_numel(shape, op)?;
    let inner: usize = shape[dim + 1..].iter().product();
    let full = shape[dim] * inner;
    let dtype = parts.first().map_or(crate::DType::F32, |(_, t)| t.dtype());
    let mut spans: Vec<(usize, usize)> = parts
        .iter()
        .map(|(at, t)| (at * inner, t.shape()[dim] * inner))
        .collect();
    spans.sort_unstable();
    Ok(any_dispatch!(dtype, T => {
        let mut out = crate::storage::pool::take::<T>(n);
        if n > 0 && full > 0 {
            for row in out.chunks_mut(full) {
                let mut cur = 0;
                for &(at, len) in &spans {
                    if at > cur {
                        row[cur..at].fill(T::default());
                    }
                    cur = cur.max(at + len);
                }
                row[cur.min(full)..].fill(T::default());
            }
            for &(at, t) in parts {
                let (at, len) = (at * inner, t.shape()[dim] * inner);
                if len == 0 {
                    continue;
                }
                let write = |src: &[T], out: &mut [T]| {
                    for (row, src) in out.chunks_mut(full).zip(src.chunks(len)) {
                        row[at..at + len].copy_from_slice(src);
                    }
                };
                t.with_slice(op, |s: &[T], l| match l.contiguous_range() {
                    Some(r) => write(&s[r], &mut out),
                    None => {
                        let src = super::gather_strided(s, l);
                        write(&src, &mut out);
                        crate::storage::pool::give_back(src);
                    }
                })?;
            }
        }
        Tensor::from_cpu(T::into_storage(out), shape)
    }))
}

fn narrow_backward(g: &Tensor, shape: &[usize], dim: usize, start: usize) -> Result<Tensor> {
    Ok(apply(
        NarrowBackward {
            shape: shape.to_vec(),
            dim,
            start,
            len: g.shape()[dim],
        },
        &[g],
    )?
    .remove(0))
}

struct Contiguous;
impl Function for Contiguous {
    fn name(&self) -> &str {
        "CloneBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let x = inputs[0];
        if let Some(r) = super::device_map(x, |c, l| c.copy_as(l, x.dtype())) {
            return Ok(vec![r?]);
        }
        any_dispatch!(x.dtype(), T => {
            let v: Vec<T> = x.with_slice("contiguous", |s: &[T], l| super::gather_strided(s, l))?;
            Ok(vec![Tensor::from_cpu(T::into_storage(v), x.shape())])
        })
    }
    fn backward(&self, _ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(g[0].clone())])
    }
}

impl Tensor {
    fn restride(&self, name: &'static str, layout: Layout, back: Back) -> Result<Tensor> {
        Ok(apply(Restride { name, layout, back }, &[self])?.remove(0))
    }

    /// A row-major copy when this view is not contiguous; otherwise the same handle.
    /// Differentiable.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        if self.device().is_meta() {
            return crate::ops::creation::meta("contiguous", self.shape(), self.dtype());
        }
        Ok(apply(Contiguous, &[self])?.remove(0))
    }

    /// A copy with its own storage (`clone()` in PyTorch; `Clone` on `Tensor` shares). On the
    /// meta device, a new meta tensor of the same shape without history.
    pub fn deep_clone(&self) -> Result<Tensor> {
        if self.device().is_meta() {
            return crate::ops::creation::meta("deep_clone", self.shape(), self.dtype());
        }
        Ok(apply(Contiguous, &[self])?.remove(0))
    }

    /// The same elements with a new shape (`reshape`): a view when the elements' strides allow
    /// one (always for a contiguous tensor; for a strided view when the new dimensions split or
    /// merge evenly spaced ones, as PyTorch's `view`), a copy otherwise. One dimension may be
    /// `-1` when passing `&[isize]`.
    pub fn reshape<S: ShapeArg + ?Sized>(&self, shape: &S) -> Result<Tensor> {
        let shape = shape.resolve(self.numel(), "reshape")?;
        if shape == self.shape() {
            return Ok(self.clone());
        }
        if !self.is_contiguous()
            && let Some(strides) = crate::layout::view_strides(self.shape(), self.strides(), &shape)
        {
            let layout = Layout {
                strides,
                shape,
                offset: self.layout().offset,
            };
            return self.restride("ViewBackward", layout, Back::Reshape(self.shape().to_vec()));
        }
        let x = self.contiguous()?;
        let layout = Layout {
            strides: contiguous_strides(&shape),
            shape,
            offset: x.layout().offset,
        };
        x.restride("ViewBackward", layout, Back::Reshape(self.shape().to_vec()))
    }

    /// Like [`Tensor::reshape`] but never copies (`view`): errors when the elements' strides
    /// do not allow the new shape without moving them (a transposed tensor merged across its
    /// swapped dimensions, say).
    pub fn view<S: ShapeArg + ?Sized>(&self, shape: &S) -> Result<Tensor> {
        let resolved = shape.resolve(self.numel(), "view")?;
        if !self.is_contiguous()
            && crate::layout::view_strides(self.shape(), self.strides(), &resolved).is_none()
        {
            return Err(Error::invalid(
                "view",
                "self",
                "strides that allow the new shape without a copy (use reshape, which copies)",
                format!(
                    "strides {:?} for shape {:?}, viewed as {:?}",
                    self.strides(),
                    self.shape(),
                    resolved
                ),
            ));
        }
        self.reshape(resolved.as_slice())
    }

    /// Flattens to one dimension.
    pub fn flatten(&self) -> Result<Tensor> {
        self.reshape(&[self.numel()])
    }

    /// Reorders dimensions (`permute`); `dims` must be a permutation of `0..ndim`.
    pub fn permute(&self, dims: &[usize]) -> Result<Tensor> {
        let nd = self.ndim();
        let mut seen = vec![false; nd];
        if dims.len() != nd
            || dims
                .iter()
                .any(|&d| d >= nd || std::mem::replace(&mut seen[d], true))
        {
            return Err(Error::invalid(
                "permute",
                "dims",
                format!("a permutation of 0..{nd}"),
                format!("{dims:?}"),
            ));
        }
        let l = self.layout();
        let layout = Layout {
            shape: dims.iter().map(|&d| l.shape[d]).collect(),
            strides: dims.iter().map(|&d| l.strides[d]).collect(),
            offset: l.offset,
        };
        let mut inv = vec![0; nd];
        for (i, &d) in dims.iter().enumerate() {
            inv[d] = i;
        }
        self.restride("PermuteBackward", layout, Back::Permute(inv))
    }

    /// Swaps two dimensions (`transpose`); negative dims count from the end.
    pub fn transpose(&self, dim0: isize, dim1: isize) -> Result<Tensor> {
        let nd = self.ndim();
        let a = normalize_dim(dim0, nd, "transpose")?;
        let b = normalize_dim(dim1, nd, "transpose")?;
        if nd < 2 {
            return Ok(self.clone());
        }
        let mut p: Vec<usize> = (0..nd).collect();
        p.swap(a, b);
        self.permute(&p)
    }

    /// The transpose of a matrix (`t()`); 0- and 1-d tensors are returned as they are.
    pub fn t(&self) -> Result<Tensor> {
        match self.ndim() {
            0 | 1 => Ok(self.clone()),
            2 => self.transpose(0, 1),
            n => Err(Error::invalid(
                "t",
                "self",
                "a tensor with at most 2 dimensions",
                format!("{n} dimensions"),
            )),
        }
    }

    /// Elements `start..start + length` along `dim`, as a view (`narrow`).
    pub fn narrow(&self, dim: isize, start: usize, length: usize) -> Result<Tensor> {
        let d = normalize_dim(dim, self.ndim(), "narrow")?;
        if self.ndim() == 0 {
            return Err(Error::invalid(
                "narrow",
                "self",
                "a tensor with at least one dimension",
                "a 0-d tensor",
            ));
        }
        let size = self.shape()[d];
        if start.checked_add(length).is_none_or(|e| e > size) {
            return Err(Error::invalid(
                "narrow",
                "start + length",
                format!("<= size {size} of dimension {d}"),
                format!("start {start} + length {length}"),
            ));
        }
        let layout = self.layout().narrowed(d, start, length);
        self.restride(
            "NarrowBackward",
            layout,
            Back::Narrow {
                shape: self.shape().to_vec(),
                dim: d,
                start,
            },
        )
    }

    /// Element `index` along `dim`, removing that dimension (`select`, `x[..., i, ...]`).
    /// Negative indices count from the end.
    pub fn select(&self, dim: isize, index: isize) -> Result<Tensor> {
        let d = normalize_dim(dim, self.ndim(), "select")?;
        let size = *self.shape().get(d).ok_or_else(|| {
            Error::invalid(
                "select",
                "self",
                "a tensor with at least one dimension",
                "a 0-d tensor",
            )
        })?;
        let i = if index < 0 {
            index + size as isize
        } else {
            index
        };
        if i < 0 || i as usize >= size {
            return Err(Error::IndexOutOfBounds {
                op: "select",
                index: index as i64,
                dim: d,
                size,
            });
        }
        self.narrow(d as isize, i as usize, 1)?
            .squeeze_dim(d as isize)
    }

    /// Removes dimension `dim` if its size is 1 (`squeeze(dim)`); otherwise returns the
    /// tensor unchanged.
    pub fn squeeze_dim(&self, dim: isize) -> Result<Tensor> {
        let d = normalize_dim(dim, self.ndim(), "squeeze")?;
        if self.ndim() == 0 || self.shape()[d] != 1 {
            return Ok(self.clone());
        }
        let mut s = self.shape().to_vec();
        s.remove(d);
        self.reshape_view(s)
    }

    /// Removes every dimension of size 1 (`squeeze()`).
    pub fn squeeze(&self) -> Result<Tensor> {
        let s: Vec<usize> = self.shape().iter().copied().filter(|&d| d != 1).collect();
        self.reshape_view(s)
    }

    /// Inserts a dimension of size 1 at `dim` (`unsqueeze`); `dim` may be `-ndim-1..=ndim`.
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let d = normalize_dim(dim, self.ndim() + 1, "unsqueeze")?;
        let mut s = self.shape().to_vec();
        s.insert(d, 1);
        self.reshape_view(s)
    }

    /// A view with size-1 dimensions added or removed; never copies.
    fn reshape_view(&self, shape: Vec<usize>) -> Result<Tensor> {
        // keep the strides of the non-unit dims
        let l = self.layout();
        let kept: Vec<usize> = l
            .shape
            .iter()
            .zip(&l.strides)
            .filter(|(s, _)| **s != 1)
            .map(|(_, st)| *st)
            .collect();
        let mut it = kept.into_iter();
        let strides: Vec<usize> = shape
            .iter()
            .map(|&s| if s == 1 { 0 } else { it.next().unwrap_or(0) })
            .collect();
        let mut layout = Layout {
            shape,
            strides,
            offset: l.offset,
        };
        let cs = contiguous_strides(&layout.shape);
        for (i, s) in layout.shape.iter().enumerate() {
            if *s == 1 {
                layout.strides[i] = cs[i];
            }
        }
        self.restride("ViewBackward", layout, Back::Reshape(self.shape().to_vec()))
    }

    /// Broadcasts to `shape` without copying (`expand`): dims of size 1 may grow, and new
    /// leading dims may be added. Errors when the shapes do not broadcast or `shape` has more
    /// elements than `usize` can count.
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        if shape == self.shape() {
            return Ok(self.clone());
        }
        checked_numel(shape, "expand")?;
        let layout = self.layout().broadcast_to(shape, "expand")?;
        self.restride(
            "ExpandBackward",
            layout,
            Back::Expand(self.shape().to_vec()),
        )
    }
}
