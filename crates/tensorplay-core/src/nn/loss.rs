//! Losses: cross-entropy (one fused function) and mean squared error.

use super::functional;
use crate::autograd::{Context, Function, is_grad_enabled};
use crate::backend::{self, DeviceStorage as _};
use crate::cuda::CudaStorage;
use crate::kernels;
use crate::ops::float_dispatch;
use crate::storage::StorageElement;
use crate::{DType, Error, Result, Tensor};

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
    /// The host's fused forward: the saved tensors are `[logits, lse [N, 1]]` (else
    /// `[logits, probs [N, C], maxes [N, 1]]`).
    fused: bool,
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
            ctx.save_value(CeSaved {
                target,
                n,
                c,
                fused: false,
            });
            return Ok(vec![loss]);
        }
        // the host: one pass per row for its log-sum-exp and loss (kernels::loss)
        let (lse, loss) = float_dispatch!(x.dtype(), "cross_entropy", T => {
            let (lse, total) = x.with_slice("cross_entropy", |s: &[T], l| {
                kernels::cross_entropy::<T>(&s[l.offset..l.offset + n * c], &target, c)
            })?;
            let mean = <T as crate::Element>::from_f64(total / n as f64);
            // the log-sum-exps stay in the computing type (float32 for the 16-bit types)
            (
                Tensor::from_vec(lse, &[n, 1])?,
                Tensor::from_cpu(T::into_storage(vec![mean]), &[]),
            )
        });
        ctx.save_for_backward(&[inputs[0], &lse]);
        ctx.save_value(CeSaved {
            target,
            n,
            c,
            fused: true,
        });
        Ok(vec![loss])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        if !ctx.needs_input_grad(0) {
            return Ok(vec![None, None]);
        }
        let saved = ctx.saved_tensors()?;
        let CeSaved {
            target,
            n,
            c,
            fused,
        } = ctx.get::<CeSaved>()?;
        let (n, c) = (*n, *c);
        let x = &saved[0];
        // the logits' shift of each row: the log-sum-exp (fused) or the maximum
        let shift = if *fused { &saved[1] } else { &saved[2] };
        let g = &g[0];
        if !is_grad_enabled() {
            // first-order backward: one fused pass over the logits (or the saved probabilities)
            let scale = g.item_f64()? / n as f64;
            if *fused {
                let x = x.contiguous()?;
                let gx = float_dispatch!(x.dtype(), "cross_entropy_backward", T => {
                    let lse = shift.to_vec::<<T as kernels::math::Elem>::Acc>()?;
                    let sc = <<T as kernels::math::Elem>::Acc as crate::Element>::from_f64(scale);
                    let v = x.with_slice("cross_entropy_backward", |s: &[T], l| {
                        let s = &s[l.offset..l.offset + n * c];
                        kernels::cross_entropy_backward::<T>(s, target, &lse, c, sc)
                    })?;
                    Tensor::from_cpu(T::into_storage(v), &[n, c])
                });
                return Ok(vec![Some(gx), None]);
            }
            let probs = &saved[1];
            let onehot = onehot(target, n, c)?
                .to_dtype(x.dtype())?
                .to_device(x.device())?;
            let gx = probs.mul_scalar(scale)?.sub(&onehot.mul_scalar(scale)?)?;
            return Ok(vec![Some(gx), None]);
        }
        // recorded backward (create_graph): softmax - onehot from differentiable ops on the
        // saved logits, so the gradient can be differentiated again
        let onehot = onehot(target, n, c)?
            .to_dtype(x.dtype())?
            .to_device(x.device())?;
        let e = x.sub(shift)?.exp()?;
        let sm = e.div(&e.sum_dims(&[1], true)?)?;
        let gx = sm.sub(&onehot)?.div_scalar(n as f64)?.mul(g)?;
        Ok(vec![Some(gx), None])
    }
}
