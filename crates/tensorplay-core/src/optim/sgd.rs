//! Stochastic gradient descent (`torch.optim.SGD`).

use super::{
    Buf, OptElem, Optimizer, check_grads, check_lr, check_nonneg, check_params, state, update_param,
};
use crate::ops::float_dispatch;
use crate::{Error, Result, Tensor};

/// Hyperparameters of [`SGD`]; the defaults are PyTorch's except `lr`, which PyTorch requires
/// and which defaults to `1e-3` here.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdOptions {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables momentum).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient (`grad + weight_decay * param`).
    pub weight_decay: f64,
    /// Nesterov momentum; requires `momentum > 0` and `dampening == 0`.
    pub nesterov: bool,
}

impl Default for SgdOptions {
    fn default() -> Self {
        SgdOptions {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

/// SGD with optional momentum, dampening, weight decay and Nesterov momentum, with PyTorch's
/// update rule:
///
/// ```text
/// d = g + weight_decay * p
/// if momentum != 0:
///     buf = d                                   (first step)
///     buf = momentum * buf + (1 - dampening) * d (later steps)
///     d = d + momentum * buf if nesterov else buf
/// p = p - lr * d
/// ```
#[derive(Debug)]
pub struct SGD {
    params: Vec<Tensor>,
    options: SgdOptions,
    momentum_buffers: Vec<Option<Buf>>,
}

impl SGD {
    /// An optimizer over `params`. Errors ([`Error::InvalidArgument`]) on a negative or
    /// non-finite `lr`, `momentum`, `dampening` or `weight_decay`, on `nesterov` without
    /// `momentum > 0` and `dampening == 0`, and on non-float parameters;
    /// [`Error::NotSupported`] for parameters on CUDA.
    pub fn new(params: Vec<Tensor>, options: SgdOptions) -> Result<SGD> {
        const OP: &str = "SGD";
        check_lr(OP, options.lr)?;
        check_nonneg(OP, "momentum", options.momentum)?;
        check_nonneg(OP, "dampening", options.dampening)?;
        check_nonneg(OP, "weight_decay", options.weight_decay)?;
        if options.nesterov && (options.momentum <= 0.0 || options.dampening != 0.0) {
            return Err(Error::invalid(
                OP,
                "nesterov",
                "momentum > 0 and dampening == 0 for Nesterov momentum",
                format!(
                    "momentum={}, dampening={}",
                    options.momentum, options.dampening
                ),
            ));
        }
        check_params(OP, &params)?;
        let n = params.len();
        Ok(SGD {
            params,
            options,
            momentum_buffers: vec![None; n],
        })
    }

    /// The hyperparameters.
    pub fn options(&self) -> &SgdOptions {
        &self.options
    }
}

fn sgd_update<T: OptElem>(
    p: &Tensor,
    g: &Tensor,
    o: &SgdOptions,
    buf_slot: &mut Option<Buf>,
) -> Result<()> {
    let (lr, wd, mom, damp) = (
        T::c(o.lr),
        T::c(o.weight_decay),
        T::c(o.momentum),
        T::c(o.dampening),
    );
    let use_wd = o.weight_decay != 0.0;
    if o.momentum == 0.0 {
        return update_param::<T>("SGD.step", p, g, |ps, gs| {
            for (x, &gr) in ps.iter_mut().zip(gs) {
                let d = if use_wd { gr + wd * *x } else { gr };
                *x = *x - lr * d;
            }
        });
    }
    let n = p.numel();
    let first = buf_slot
        .as_mut()
        .and_then(T::buf)
        .is_none_or(|v| v.len() != n);
    let buf = state::<T>(buf_slot, n, || vec![T::default(); n])?;
    let one_minus_damp = T::one() - damp;
    let nesterov = o.nesterov;
    update_param::<T>("SGD.step", p, g, |ps, gs| {
        for ((x, &gr), b) in ps.iter_mut().zip(gs).zip(buf.iter_mut()) {
            let d = if use_wd { gr + wd * *x } else { gr };
            *b = if first {
                d
            } else {
                mom * *b + one_minus_damp * d
            };
            let d = if nesterov { d + mom * *b } else { *b };
            *x = *x - lr * d;
        }
    })
}

impl Optimizer for SGD {
    fn step_with_grads(&mut self, grads: &[Option<Tensor>]) -> Result<()> {
        check_grads("SGD.step", &self.params, grads)?;
        for (i, g) in grads.iter().enumerate() {
            let Some(g) = g else { continue };
            let p = &self.params[i];
            let slot = &mut self.momentum_buffers[i];
            float_dispatch!(p.dtype(), "SGD.step", T => sgd_update::<T>(p, g, &self.options, slot)?);
        }
        Ok(())
    }
    fn params(&self) -> &[Tensor] {
        &self.params
    }
    fn lr(&self) -> f64 {
        self.options.lr
    }
    fn set_lr(&mut self, lr: f64) -> Result<()> {
        check_lr("SGD.set_lr", lr)?;
        self.options.lr = lr;
        Ok(())
    }
}
