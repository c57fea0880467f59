//! Normalising activations: `softmax` and `log_softmax` over one dimension, numerically
//! stable (the max is subtracted first). On the CPU over the last dimension, forward and
//! backward are fused row kernels; elsewhere, and whenever a backward is itself recorded
//! (`create_graph`), they are composed of differentiable tensor operations, so double backward
//! works.

use crate::autograd::{Context, Function, apply, is_grad_enabled};
use crate::kernels;
use crate::layout::normalize_dim;
use crate::ops::elementwise::kernel_zip;
use crate::ops::float_dispatch;
use crate::storage::StorageElement;
use crate::{Error, Result, Tensor};

/// Whether the fused row kernels compute this softmax: a host tensor normalised over its last
/// dimension.
fn fused(x: &Tensor, dim: usize) -> bool {
    !x.device().is_cuda() && x.ndim() >= 1 && dim == x.ndim() - 1
}

/// Softmax (or log-softmax) over the last dimension by the fused row kernel.
fn rows_forward(x: &Tensor, log: bool) -> Result<Tensor> {
    let n = x.shape()[x.ndim() - 1];
    let x = x.contiguous()?;
    let op = if log { "log_softmax" } else { "softmax" };
    float_dispatch!(x.dtype(), op, T => {
        let v = x.with_slice(op, |s: &[T], l| {
            kernels::softmax(&s[l.contiguous_range().unwrap_or(0..0)], n, log)
        })?;
        Ok(Tensor::from_cpu(T::into_storage(v), x.shape()))
    })
}

/// The fused backward of [`rows_forward`] from its output `y` and the output's gradient `g`.
fn rows_backward(y: &Tensor, g: &Tensor, log: bool) -> Result<Tensor> {
    let n = y.shape()[y.ndim() - 1];
    kernel_zip(
        y,
        g,
        if log {
            "log_softmax_backward"
        } else {
            "softmax_backward"
        },
        |y, g| kernels::softmax_backward(y, g, n, log),
        |y, g| kernels::softmax_backward(y, g, n, log),
    )
}

/// Whether a backward can use the fused kernel: no graph of the backward is recorded, and the
/// gradient matches the saved output.
fn fused_backward(y: &Tensor, g: &Tensor, dim: usize) -> bool {
    fused(y, dim) && !is_grad_enabled() && g.shape() == y.shape() && g.dtype() == y.dtype()
}

/// `x - max(x, dim)` with the max kept as a size-1 dim; forward only (runs without
/// recording inside `Function::forward`).
fn shifted(x: &Tensor, dim: usize) -> Result<Tensor> {
    if x.numel() == 0 {
        return Ok(x.detach());
    }
    let (m, _) = x.max_dim(dim as isize, true)?;
    x.sub(&m)
}

struct Softmax {
    dim: usize,
}
impl Function for Softmax {
    fn name(&self) -> &str {
        "SoftmaxBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let d = self.dim as isize;
        let y = if fused(inputs[0], self.dim) {
            rows_forward(inputs[0], false)?
        } else {
            let e = shifted(inputs[0], self.dim)?.exp()?;
            e.div(&e.sum_dims(&[d], true)?)?
        };
        ctx.save_for_backward(&[&y]);
        Ok(vec![y])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        // dx = g*y - y*sum(g*y)
        let y = ctx.saved_tensors()?.remove(0);
        if fused_backward(&y, &g[0], self.dim) {
            return Ok(vec![Some(rows_backward(&y, &g[0], false)?)]);
        }
        let gy = g[0].mul(&y)?;
        let s = gy.sum_dims(&[self.dim as isize], true)?;
        Ok(vec![Some(gy.sub(&y.mul(&s)?)?)])
    }
}

struct LogSoftmax {
    dim: usize,
}
impl Function for LogSoftmax {
    fn name(&self) -> &str {
        "LogSoftmaxBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let d = self.dim as isize;
        let y = if fused(inputs[0], self.dim) {
            rows_forward(inputs[0], true)?
        } else {
            let z = shifted(inputs[0], self.dim)?;
            let lse = z.exp()?.sum_dims(&[d], true)?.log()?;
            z.sub(&lse)?
        };
        ctx.save_for_backward(&[&y]);
        Ok(vec![y])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        // dx = g - exp(y)*sum(g)
        let y = ctx.saved_tensors()?.remove(0);
        if fused_backward(&y, &g[0], self.dim) {
            return Ok(vec![Some(rows_backward(&y, &g[0], true)?)]);
        }
        let s = g[0].sum_dims(&[self.dim as isize], true)?;
        Ok(vec![Some(g[0].sub(&y.exp()?.mul(&s)?)?)])
    }
}

fn check(x: &Tensor, dim: isize, op: &'static str) -> Result<usize> {
    if !x.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op,
            dtype: x.dtype(),
            expected: "a floating dtype (float32, float64, bfloat16 or float16)",
        });
    }
    normalize_dim(dim, x.ndim(), op)
}

impl Tensor {
    /// `exp(x) / sum(exp(x))` over `dim` (`torch.softmax`), computed as
    /// `exp(x - max) / sum(exp(x - max))`. Float only; errors on an out-of-range `dim`.
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        if let Some(x) = crate::amp::to_fp32(&[self])? {
            return x[0].softmax(dim);
        }
        let dim = check(self, dim, "softmax")?;
        Ok(apply(Softmax { dim }, &[self])?.remove(0))
    }

    /// `log(softmax(x))` over `dim` (`torch.log_softmax`), computed as
    /// `(x - max) - log(sum(exp(x - max)))`. Float only; errors on an out-of-range `dim`.
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        if let Some(x) = crate::amp::to_fp32(&[self])? {
            return x[0].log_softmax(dim);
        }
        let dim = check(self, dim, "log_softmax")?;
        Ok(apply(LogSoftmax { dim }, &[self])?.remove(0))
    }
}
