//! Optimizers (`torch.optim`): [`SGD`], [`Adam`], [`AdamW`].
//!
//! Updates are written into the parameters' storage in place, without recording autograd,
//! by typed loops over the float32/float64 elements (the version counter is bumped, as by any
//! in-place write). Parameters on CUDA are not supported yet.
//!
//! ```
//! use tensorplay::{self as tp, optim::{Optimizer, SGD, SgdOptions}};
//! let w = tp::Tensor::from_vec(vec![1.0f64, -2.0], &[2])?.requires_grad_(true);
//! let mut opt = SGD::new(vec![w.clone()], SgdOptions { lr: 0.1, ..Default::default() })?;
//! w.mul(&w)?.sum()?.backward()?; // grad = 2 w
//! opt.step()?;
//! assert_eq!(w.to_vec::<f64>()?, vec![0.8, -1.6]);
//! # Ok::<(), tp::Error>(())
//! ```

mod adam;
mod group;
pub mod lr_scheduler;
mod sgd;
mod state;

pub use adam::{Adam, AdamOptions, AdamW, AdamWOptions};
pub use group::ParamGroup;
pub use sgd::{SGD, SgdOptions};
pub use state::{GroupState, OptimizerState};

use crate::storage::StorageElement;
use crate::{Error, FloatElement, Result, Tensor};

/// An optimizer over a fixed list of parameters (`torch.optim.Optimizer`).
pub trait Optimizer: Send {
    /// Updates every parameter that has a `.grad` (`step()`); parameters without one are
    /// skipped, as in PyTorch.
    fn step(&mut self) -> Result<()> {
        let grads: Vec<Option<Tensor>> = self.params().iter().map(Tensor::grad).collect();
        self.step_with_grads(&grads)
    }

    /// Updates the parameters with the given gradients, one per parameter in order (`None`
    /// skips that parameter), ignoring `.grad`. Used by optimizers that keep gradients
    /// elsewhere (distributed autograd).
    ///
    /// Errors: [`Error::InvalidArgument`] when the number of gradients differs from the number
    /// of parameters, or a gradient's shape or dtype differs from its parameter's (the message
    /// names the parameter index); [`Error::NotSupported`] for parameters on CUDA.
    fn step_with_grads(&mut self, grads: &[Option<Tensor>]) -> Result<()>;

    /// Clears the gradient of every parameter (`zero_grad(set_to_none=True)`).
    fn zero_grad(&mut self) -> Result<()> {
        for p in self.params() {
            p.set_grad(None);
        }
        Ok(())
    }

    /// The parameters, in the order given at construction.
    fn params(&self) -> &[Tensor];

    /// The parameter groups, in order (`param_groups`): one unless the optimizer was built
    /// with `with_groups`.
    fn param_groups(&self) -> &[ParamGroup];

    /// The parameter groups, to change their hyperparameters between steps (checked at the
    /// next step); learning-rate schedulers ([`lr_scheduler`]) change `lr` through this.
    fn param_groups_mut(&mut self) -> &mut [ParamGroup];

    /// The learning rate of the first parameter group.
    fn lr(&self) -> f64 {
        self.param_groups().first().map_or(0.0, |g| g.lr)
    }

    /// Sets the learning rate of every parameter group; errors when it is negative or not
    /// finite.
    fn set_lr(&mut self, lr: f64) -> Result<()>;

    /// The optimizer's state (`state_dict()`): step counts, running buffers (momentum, Adam's
    /// moments) and the parameter groups' hyperparameters, copied (later steps do not change
    /// it). Save it with [`OptimizerState::save`].
    ///
    /// Errors: none for the built-in optimizers (the `Result` is for optimizers whose state
    /// lives elsewhere).
    fn state_dict(&self) -> Result<OptimizerState>;

    /// Restores a state from [`state_dict`](Optimizer::state_dict) (`load_state_dict`): the
    /// next steps are bit-identical to those of the optimizer it came from, given the same
    /// parameters and gradients. The hyperparameters of every group are replaced by the saved
    /// ones, as in PyTorch.
    ///
    /// Errors ([`Error::InvalidArgument`], nothing changed): another optimizer's state; groups
    /// of other sizes than this optimizer's; a state tensor of another shape or dtype than its
    /// parameter's (named `state.<index>.<name>`), or with a name this optimizer does not keep;
    /// hyperparameters that [`step`](Optimizer::step) would refuse.
    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()>;
}

pub(crate) fn check_lr(op: &'static str, lr: f64) -> Result<()> {
    if !(lr >= 0.0 && lr.is_finite()) {
        return Err(Error::invalid(op, "lr", "a finite learning rate >= 0", lr));
    }
    Ok(())
}

pub(crate) fn check_nonneg(op: &'static str, arg: &'static str, v: f64) -> Result<()> {
    if !(v >= 0.0 && v.is_finite()) {
        return Err(Error::invalid(op, arg, "a finite value >= 0", v));
    }
    Ok(())
}

/// Checks the parameters given to an optimizer: floating tensors on the CPU.
pub(crate) fn check_params(op: &'static str, params: &[Tensor]) -> Result<()> {
    // PyTorch: "optimizer got an empty parameter list"; almost always unregistered parameters
    if params.is_empty() {
        return Err(Error::invalid(
            op,
            "params",
            "at least one parameter (is the module's parameters() empty?)",
            "an empty parameter list",
        ));
    }
    for (i, p) in params.iter().enumerate() {
        if !p.dtype().is_float() {
            return Err(Error::invalid(
                op,
                "params",
                "floating-point parameters",
                format!("parameter {i} of dtype {}", p.dtype()),
            ));
        }
        if p.device().is_cuda() {
            return Err(Error::NotSupported {
                op,
                detail: format!(
                    "for parameters on CUDA yet (parameter {i} is on {})",
                    p.device()
                ),
            });
        }
    }
    Ok(())
}

/// Checks `grads` against `params`: one per parameter, same shape, dtype and device.
pub(crate) fn check_grads(
    op: &'static str,
    params: &[Tensor],
    grads: &[Option<Tensor>],
) -> Result<()> {
    if grads.len() != params.len() {
        return Err(Error::invalid(
            op,
            "grads",
            format!("{} gradients (one per parameter)", params.len()),
            grads.len(),
        ));
    }
    for (i, (p, g)) in params.iter().zip(grads).enumerate() {
        let Some(g) = g else { continue };
        if p.device().is_cuda() || g.device().is_cuda() {
            return Err(Error::NotSupported {
                op,
                detail: format!("for parameters on CUDA yet (parameter {i})"),
            });
        }
        if g.shape() != p.shape() || g.dtype() != p.dtype() {
            return Err(Error::invalid(
                op,
                "grads",
                format!(
                    "gradient {i} of shape {:?} and dtype {} (those of parameter {i})",
                    p.shape(),
                    p.dtype()
                ),
                format!("shape {:?} and dtype {}", g.shape(), g.dtype()),
            ));
        }
    }
    Ok(())
}

/// Per-parameter optimizer state of the parameter's element type.
#[derive(Debug, Clone)]
pub(crate) enum Buf {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// A float element the optimizers update.
pub(crate) trait OptElem: FloatElement + StorageElement {
    fn buf(b: &mut Buf) -> Option<&mut Vec<Self>>;
    fn wrap(v: Vec<Self>) -> Buf;
    fn c(v: f64) -> Self {
        <Self as Element>::from_f64(v)
    }
}
use crate::Element;
impl OptElem for f32 {
    fn buf(b: &mut Buf) -> Option<&mut Vec<f32>> {
        match b {
            Buf::F32(v) => Some(v),
            Buf::F64(_) => None,
        }
    }
    fn wrap(v: Vec<f32>) -> Buf {
        Buf::F32(v)
    }
}
impl OptElem for f64 {
    fn buf(b: &mut Buf) -> Option<&mut Vec<f64>> {
        match b {
            Buf::F64(v) => Some(v),
            Buf::F32(_) => None,
        }
    }
    fn wrap(v: Vec<f64>) -> Buf {
        Buf::F64(v)
    }
}

/// The state vector `slot` of type `T` with `n` elements, created by `init` when absent.
pub(crate) fn state<T: OptElem>(
    slot: &mut Option<Buf>,
    n: usize,
    init: impl FnOnce() -> Vec<T>,
) -> Result<&mut Vec<T>> {
    if slot.as_mut().and_then(T::buf).is_none_or(|v| v.len() != n) {
        *slot = Some(T::wrap(init()));
    }
    slot.as_mut().and_then(T::buf).ok_or_else(|| {
        Error::invalid(
            "optimizer",
            "state",
            "state of the parameter's dtype",
            "another dtype",
        )
    })
}

/// Runs `f(param_values, grad_values)` on the elements of a parameter and its gradient, both
/// in row-major order; writes the parameter back in place (bumping its version).
pub(crate) fn update_param<T: OptElem>(
    op: &'static str,
    p: &Tensor,
    g: &Tensor,
    f: impl FnOnce(&mut [T], &[T]),
) -> Result<()> {
    // the gradient as a row-major slice (borrowed when contiguous and not aliasing the param)
    let owned: Option<Vec<T>> = if g.shares_storage_with(p) || !g.is_contiguous() {
        Some(g.to_vec::<T>()?)
    } else {
        None
    };
    let with_grad = |gs: &[T]| -> Result<()> {
        p.with_slice_mut(op, |ps: &mut [T], l| {
            if let Some(r) = l.contiguous_range() {
                f(&mut ps[r], gs);
            } else {
                let mut vals = Vec::with_capacity(l.numel());
                l.for_each_offset(|o| vals.push(ps[o]));
                f(&mut vals, gs);
                let mut it = vals.into_iter();
                l.for_each_offset(|o| {
                    if let Some(v) = it.next() {
                        ps[o] = v;
                    }
                });
            }
        })
    };
    match owned {
        Some(v) => with_grad(&v),
        None => g.with_slice(op, |gs: &[T], l| {
            let r = l.contiguous_range().unwrap_or(0..0);
            with_grad(&gs[r])
        })?,
    }
}
