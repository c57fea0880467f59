//! Losses: cross-entropy (one fused function) and mean squared error.

use super::functional;
use crate::autograd::{Context, Function, is_grad_enabled};
use crate::backend::{self, DeviceStorage as _};
use crate::cuda::CudaStorage;
use crate::ops::float_dispatch;
use crate::storage::StorageElement;
use crate::{DType, Error, FloatElement, Result, Tensor};

/// Mean squared error with mean reduction (`torch.nn.MSELoss()`).
#[derive(Debug, Default, Clone, Copy)]
pub struct MSELoss;

impl MSELoss {
    /// A new loss.
    pub fn new() -> MSELoss {
        MSELoss
    }
    /// `mean((input - target)^2)`, a 0-d tensor; see [`functional::mse_loss`].
    pub fn forward(&self, input: &Tensor, target: &Tensor) -> Result<Tensor> {
        functional::mse_loss(input, target)
    }
}

/// Cross-entropy of logits against class indices with mean reduction
/// (`torch.nn.CrossEntropyLoss()`).
#[derive(Debug, Default, Clone, Copy)]
pub struct CrossEntropyLoss;

impl CrossEntropyLoss {
    /// A new loss.
    pub fn new() -> CrossEntropyLoss {
        CrossEntropyLoss
    }
    /// The mean over rows of `logsumexp(input[i]) - input[i, target[i]]`, a 0-d tensor; see
    /// [`functional::cross_entropy`].
    pub fn forward(&self, input: &Tensor, target: &Tensor) -> Result<Tensor> {
        functional::cross_entropy(input, target)
    }
}

/// Validates cross-entropy arguments and returns the class indices.
pub(crate) fn check_cross_entropy(input: &Tensor, target: &Tensor) -> Result<Vec<i64>> {
    const OP: &str = "cross_entropy";
    if input.ndim() != 2 {
        return Err(Error::invalid(
            OP,
            "input",
            "2-d logits [N, C]",
            format!("shape {:?}", input.shape()),
        ));
    }
    if !input.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype: input.dtype(),
            expected: "float32 or float64 logits",
        });
    }
    if target.dtype() != DType::I64 {
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype: target.dtype(),
            expected: "int64 class indices for the target",
        });
    }
    let (n, c) = (input.shape()[0], input.shape()[1]);
    if target.shape() != [n] {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: vec![n],
            rhs: target.shape().to_vec(),
        });
    }
    let t = target.to_vec::<i64>()?;
    if let Some(&bad) = t.iter().find(|&&k| k < 0 || k as usize >= c) {
        return Err(Error::IndexOutOfBounds {
            op: OP,
            index: bad,
            dim: 1,
            size: c,
        });
    }
    Ok(t)
}

/// Per-row softmax probabilities (row-major `[N, C]`), the row maxima and the mean loss.
fn ce_forward<T: FloatElement + StorageElement>(
    s: &[T],
    n: usize,
    c: usize,
    target: &[i64],
) -> (Vec<T>, Vec<T>, T) {
    let mut probs = Vec::with_capacity(n * c);
    let mut maxes = Vec::with_capacity(n);
    let mut total = 0.0f64;
    for (i, row) in s.chunks_exact(c.max(1)).take(n).enumerate() {
        let m = row.iter().copied().fold(T::neg_infinity(), T::max);
        // a row of -inf (or empty) gives NaN as in PyTorch; keep the shift finite otherwise
        let shift = if m.is_finite() { m } else { T::zero() };
        let start = probs.len();
        let mut sum = T::zero();
        for &x in row {
            let e = (x - shift).exp();
            sum = sum + e;
            probs.push(e);
        }
        let inv = T::one() / sum;
        for p in &mut probs[start..] {
            *p = *p * inv;
        }
        let lse = shift + sum.ln();
        let xt = row[target[i] as usize];
        total += crate::Element::to_f64(lse - xt);
        maxes.push(shift);
    }
    let mean = <T as crate::Element>::from_f64(total / n as f64);
    (probs, maxes, mean)
}

/// The device's per-row losses `[n]` and probabilities `[n, c]` as tensors.
fn cx_rows(
    (loss, probs): (CudaStorage, CudaStorage),
    n: usize,
    c: usize,
) -> Result<(Tensor, Tensor)> {
    Ok((
        backend::device_tensor(loss, &[n]),
        backend::device_tensor(probs, &[n, c]),
    ))
}

/// The one-hot rows of `target` as a float64 host tensor `[n, c]`.
fn onehot(target: &[i64], n: usize, c: usize) -> Result<Tensor> {
    let mut v = vec![0.0f64; n * c];
    for (i, &k) in target.iter().enumerate() {
        v[i * c + k as usize] = 1.0;
    }
    Tensor::from_vec(v, &[n, c])
}

/// Fused cross-entropy: inputs `[logits [N, C], target [N] int64]`, output the mean loss.
pub(crate) struct CrossEntropyFn;

struct CeSaved {
    target: Vec<i64>,
    n: usize,
    c: usize,
}

impl Function for CrossEntropyFn {
    fn name(&self) -> &str {
        "CrossEntropyLossBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (x, t) = (inputs[0], inputs[1]);
        let target = check_cross_entropy(x, t)?;
        let (n, c) = (x.shape()[0], x.shape()[1]);
        let x = x.contiguous()?;
        if let Some(r) = backend::on_device2(&x, t, |cx, lx, ct, lt| {
            let xc = cx.copy_as(lx, x.dtype())?;
            let tc = ct.copy_as(lt, DType::I64)?;
            cx_rows(xc.cross_entropy(&tc, n, c)?, n, c)
        }) {
            let (rows, probs) = r?;
            let loss = rows.sum()?.div_scalar(n as f64)?;
            let maxes = x.detach().max_dim(1, true)?.0;
            ctx.save_for_backward(&[inputs[0], &probs, &maxes]);
            ctx.save_value(CeSaved { target, n, c });
            return Ok(vec![loss]);
        }
        let (probs, maxes, loss) = float_dispatch!(x.dtype(), "cross_entropy", T => {
            let (p, m, l) = x.with_slice("cross_entropy", |s: &[T], l| {
                ce_forward::<T>(&s[l.offset..l.offset + n * c], n, c, &target)
            })?;
            (
                Tensor::from_cpu(T::into_storage(p), &[n, c]),
                Tensor::from_cpu(T::into_storage(m), &[n, 1]),
                Tensor::from_cpu(T::into_storage(vec![l]), &[]),
            )
        });
        ctx.save_for_backward(&[inputs[0], &probs, &maxes]);
        ctx.save_value(CeSaved { target, n, c });
        Ok(vec![loss])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        if !ctx.needs_input_grad(0) {
            return Ok(vec![None, None]);
        }
        let saved = ctx.saved_tensors()?;
        let (x, probs, maxes) = (&saved[0], &saved[1], &saved[2]);
        let CeSaved { target, n, c } = ctx.get::<CeSaved>()?;
        let (n, c) = (*n, *c);
        let g = &g[0];
        if !is_grad_enabled() {
            // first-order backward: one fused pass over the saved probabilities
            let scale = g.item_f64()? / n as f64;
            if probs.device().is_cuda() {
                let onehot = onehot(target, n, c)?
                    .to_dtype(x.dtype())?
                    .to_device(x.device())?;
                let gx = probs.mul_scalar(scale)?.sub(&onehot.mul_scalar(scale)?)?;
                return Ok(vec![Some(gx), None]);
            }
            let gx = float_dispatch!(probs.dtype(), "cross_entropy_backward", T => {
                let sc = <T as crate::Element>::from_f64(scale);
                let v = probs.with_slice("cross_entropy_backward", |s: &[T], _| {
                    let mut v: Vec<T> = s.iter().map(|&p| p * sc).collect();
                    for (i, &k) in target.iter().enumerate() {
                        let e = &mut v[i * c + k as usize];
                        *e -= sc;
                    }
                    v
                })?;
                Tensor::from_cpu(T::into_storage(v), &[n, c])
            });
            return Ok(vec![Some(gx), None]);
        }
        // recorded backward (create_graph): softmax - onehot from differentiable ops on the
        // saved logits, so the gradient can be differentiated again
        let onehot = onehot(target, n, c)?
            .to_dtype(x.dtype())?
            .to_device(x.device())?;
        let e = x.sub(maxes)?.exp()?;
        let sm = e.div(&e.sum_dims(&[1], true)?)?;
        let gx = sm.sub(&onehot)?.div_scalar(n as f64)?.mul(g)?;
        Ok(vec![Some(gx), None])
    }
}
