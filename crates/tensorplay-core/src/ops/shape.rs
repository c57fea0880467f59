//! Joining and splitting: `cat`, `stack`, `split`, `split_with_sizes`, `chunk`. Splits are
//! views of the input, the outputs of one node whose backward is a `cat` of their gradients;
//! `cat` copies and its backward narrows the gradient per input.

use crate::autograd::{Context, Function, apply};
use crate::layout::normalize_dim;
use crate::{Error, Layout, Result, Tensor};

struct Cat {
    dim: usize,
    sizes: Vec<usize>,
}
impl Function for Cat {
    fn name(&self) -> &str {
        "CatBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let first = inputs[0];
        let mut shape = first.shape().to_vec();
        shape[self.dim] = self.sizes.iter().sum();
        if inputs.iter().all(|t| t.device() == crate::Device::Cpu) {
            let mut start = 0;
            let parts: Vec<(usize, &Tensor)> = inputs
                .iter()
                .zip(&self.sizes)
                .map(|(t, &n)| {
                    start += n;
                    (start - n, *t)
                })
                .collect();
            return Ok(vec![super::view::assemble_along(&shape, self.dim, &parts)?]);
        }
        let out = Tensor::zeros(&shape, (first.dtype(), first.device()))?;
        let mut start = 0;
        for (t, &n) in inputs.iter().zip(&self.sizes) {
            if n > 0 {
                out.narrow(self.dim as isize, start, n)?.copy_(t)?;
            }
            start += n;
        }
        Ok(vec![out])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let mut start = 0;
        let mut out = Vec::with_capacity(self.sizes.len());
        for (i, &n) in self.sizes.iter().enumerate() {
            out.push(if ctx.needs_input_grad(i) {
                Some(g[0].narrow(self.dim as isize, start, n)?)
            } else {
                None
            });
            start += n;
        }
        Ok(out)
    }
}

/// Concatenates `tensors` along `dim` (`torch.cat`); see [`Tensor::cat`].
pub fn cat(tensors: &[Tensor], dim: isize) -> Result<Tensor> {
    Tensor::cat(tensors, dim)
}

/// Stacks `tensors` along a new dimension `dim` (`torch.stack`); see [`Tensor::stack`].
pub fn stack(tensors: &[Tensor], dim: isize) -> Result<Tensor> {
    Tensor::stack(tensors, dim)
}

impl Tensor {
    /// Concatenates `tensors` along `dim` (`torch.cat`). The tensors must be non-empty in
    /// number, have at least one dimension, share dtype and device, and agree in every
    /// dimension but `dim`. Differentiable in every input.
    ///
    /// ```
    /// use tensorplay::{self as tp, Tensor};
    /// let a = Tensor::from_vec(vec![1.0f32, 2.0], &[1, 2])?;
    /// let b = Tensor::from_vec(vec![3.0f32, 4.0, 5.0, 6.0], &[2, 2])?;
    /// let c = tp::cat(&[a, b], 0)?;
    /// assert_eq!(c.shape(), &[3, 2]);
    /// assert_eq!(c.to_vec::<f32>()?, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    /// # Ok::<(), tp::Error>(())
    /// ```
    pub fn cat(tensors: &[Tensor], dim: isize) -> Result<Tensor> {
        let op = "cat";
        let first = tensors.first().ok_or_else(|| {
            Error::invalid(
                op,
                "tensors",
                "a non-empty list of tensors",
                "an empty list",
            )
        })?;
        if first.ndim() == 0 {
            return Err(Error::invalid(
                op,
                "tensors",
                "tensors with at least one dimension",
                "a 0-d tensor (use stack)",
            ));
        }
        let d = normalize_dim(dim, first.ndim(), op)?;
        for t in &tensors[1..] {
            if t.dtype() != first.dtype() {
                return Err(Error::DTypeMismatch {
                    op,
                    lhs: first.dtype(),
                    rhs: t.dtype(),
                });
            }
            super::same_device(op, first, t)?;
            let agree = t.ndim() == first.ndim()
                && t.shape()
                    .iter()
                    .zip(first.shape())
                    .enumerate()
                    .all(|(i, (a, b))| i == d || a == b);
            if !agree {
                return Err(Error::ShapeMismatch {
                    op,
                    lhs: first.shape().to_vec(),
                    rhs: t.shape().to_vec(),
                });
            }
        }
        let sizes: Vec<usize> = tensors.iter().map(|t| t.shape()[d]).collect();
        if sizes
            .iter()
            .try_fold(0usize, |a, &s| a.checked_add(s))
            .is_none()
        {
            return Err(Error::invalid(
                op,
                "tensors",
                "sizes along dim whose sum fits in usize",
                format!("{sizes:?}"),
            ));
        }
        let refs: Vec<&Tensor> = tensors.iter().collect();
        Ok(apply(Cat { dim: d, sizes }, &refs)?.remove(0))
    }

    /// Stacks `tensors` of one shape along a new dimension `dim` (`torch.stack`); `dim`
    /// may be `-ndim-1..=ndim`. Errors on an empty list or differing shapes, dtypes or
    /// devices. Differentiable in every input.
    pub fn stack(tensors: &[Tensor], dim: isize) -> Result<Tensor> {
        let op = "stack";
        let first = tensors.first().ok_or_else(|| {
            Error::invalid(
                op,
                "tensors",
                "a non-empty list of tensors",
                "an empty list",
            )
        })?;
        let d = normalize_dim(dim, first.ndim() + 1, op)?;
        let mut parts = Vec::with_capacity(tensors.len());
        for t in tensors {
            if t.shape() != first.shape() {
                return Err(Error::ShapeMismatch {
                    op,
                    lhs: first.shape().to_vec(),
                    rhs: t.shape().to_vec(),
                });
            }
            parts.push(t.unsqueeze(d as isize)?);
        }
        Tensor::cat(&parts, d as isize)
    }

    /// Splits into views of `split_size` along `dim` (`torch.split`); the last part is
    /// smaller when the size does not divide evenly. Errors when `split_size` is 0 (for a
    /// non-empty dimension) or on a 0-d tensor.
    pub fn split(&self, split_size: usize, dim: isize) -> Result<Vec<Tensor>> {
        let op = "split";
        let d = self.split_dim(dim, op)?;
        let size = self.shape()[d];
        if size == 0 {
            return self.split_parts(d, &[0]);
        }
        if split_size == 0 {
            return Err(Error::invalid(op, "split_size", "a positive size", 0));
        }
        let sizes: Vec<usize> = (0..size)
            .step_by(split_size)
            .map(|s| split_size.min(size - s))
            .collect();
        self.split_parts(d, &sizes)
    }

    /// Splits into views of the given sizes along `dim` (`torch.split` with a list); the
    /// sizes must add up to the size of `dim`.
    pub fn split_with_sizes(&self, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
        let op = "split_with_sizes";
        let d = self.split_dim(dim, op)?;
        let size = self.shape()[d];
        let total = sizes.iter().try_fold(0usize, |a, &s| a.checked_add(s));
        if total != Some(size) {
            return Err(Error::invalid(
                op,
                "split_sizes",
                format!("sizes adding up to {size} (the size of dimension {d})"),
                format!("{sizes:?}"),
            ));
        }
        self.split_parts(d, sizes)
    }

    /// Splits into `chunks` views along `dim` (`torch.chunk`): each of size
    /// `ceil(size / chunks)` but the last, so there may be fewer than `chunks` parts.
    /// Errors when `chunks` is 0.
    pub fn chunk(&self, chunks: usize, dim: isize) -> Result<Vec<Tensor>> {
        let op = "chunk";
        let d = self.split_dim(dim, op)?;
        if chunks == 0 {
            return Err(Error::invalid(
                op,
                "chunks",
                "a positive number of chunks",
                0,
            ));
        }
        let size = self.shape()[d];
        if size == 0 {
            return self.split_parts(d, &vec![0; chunks]);
        }
        self.split(size.div_ceil(chunks), d as isize)
    }

    /// Views of consecutive parts of `sizes` along dimension `d` (which exists; the sizes add
    /// up to its size), all outputs of one [`Split`] node.
    fn split_parts(&self, d: usize, sizes: &[usize]) -> Result<Vec<Tensor>> {
        let mut start = 0;
        let mut layouts = Vec::with_capacity(sizes.len());
        for &n in sizes {
            layouts.push(self.layout().narrowed(d, start, n));
            start += n;
        }
        apply(Split { dim: d, layouts }, &[self])
    }

    fn split_dim(&self, dim: isize, op: &'static str) -> Result<usize> {
        let d = normalize_dim(dim, self.ndim(), op)?;
        if self.ndim() == 0 {
            return Err(Error::invalid(
                op,
                "self",
                "a tensor with at least one dimension",
                "a 0-d tensor",
            ));
        }
        Ok(d)
    }
}

/// The parts of `split`, `split_with_sizes` and `chunk`: views of the input along `dim`, all
/// outputs of one node whose backward concatenates the parts' gradients (PyTorch's
/// `SplitBackward`; a part without a gradient contributes zeros). The input's gradient is
/// written once, where a `narrow` per part gave each part a zero-padded gradient of the
/// whole input for the backward to sum.
struct Split {
    dim: usize,
    layouts: Vec<Layout>,
}
impl Function for Split {
    fn name(&self) -> &str {
        "SplitBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(self
            .layouts
            .iter()
            .map(|l| inputs[0].view_with_layout(l.clone()))
            .collect())
    }
    fn backward(&self, _ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(Tensor::cat(g, self.dim as isize)?)])
    }
}
