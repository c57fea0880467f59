//! Normalising activations: `softmax` and `log_softmax` over one dimension, numerically
//! stable (the max is subtracted first). Their backwards are written with differentiable
//! tensor operations, so double backward works.

use crate::autograd::{Context, Function, apply};
use crate::layout::normalize_dim;
use crate::{Error, Result, Tensor};

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
        let e = shifted(inputs[0], self.dim)?.exp()?;
        let y = e.div(&e.sum_dims(&[d], true)?)?;
        ctx.save_for_backward(&[&y]);
        Ok(vec![y])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        // dx = g*y - y*sum(g*y)
        let y = ctx.saved_tensors()?.remove(0);
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
        let z = shifted(inputs[0], self.dim)?;
        let lse = z.exp()?.sum_dims(&[d], true)?.log()?;
        let y = z.sub(&lse)?;
        ctx.save_for_backward(&[&y]);
        Ok(vec![y])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        // dx = g - exp(y)*sum(g)
        let y = ctx.saved_tensors()?.remove(0);
        let s = g[0].sum_dims(&[self.dim as isize], true)?;
        Ok(vec![Some(g[0].sub(&y.exp()?.mul(&s)?)?)])
    }
}

fn check(x: &Tensor, dim: isize, op: &'static str) -> Result<usize> {
    if !x.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op,
            dtype: x.dtype(),
            expected: "float32 or float64",
        });
    }
    normalize_dim(dim, x.ndim(), op)
}

impl Tensor {
    /// `exp(x) / sum(exp(x))` over `dim` (`torch.softmax`), computed as
    /// `exp(x - max) / sum(exp(x - max))`. Float only; errors on an out-of-range `dim`.
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        let dim = check(self, dim, "softmax")?;
        Ok(apply(Softmax { dim }, &[self])?.remove(0))
    }

    /// `log(softmax(x))` over `dim` (`torch.log_softmax`), computed as
    /// `(x - max) - log(sum(exp(x - max)))`. Float only; errors on an out-of-range `dim`.
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        let dim = check(self, dim, "log_softmax")?;
        Ok(apply(LogSoftmax { dim }, &[self])?.remove(0))
    }
}
