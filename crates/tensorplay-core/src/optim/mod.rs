//! Optimizers (`torch.optim`): [`SGD`], [`Adam`], [`AdamW`].
//!
//! Updates are written into the parameters' storage in place, without recording autograd,
//! by typed loops over the float32/float64 elements, or for parameters on CUDA by one fused
//! kernel per parameter with the state beside it (the version counter is bumped, as by any
//! in-place write).
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

use crate::backend;
use crate::cuda::CudaStorage;
use crate::storage::StorageElement;
use crate::{Error, FloatElement, Result, Tensor};

/// An optimizer over a fixed list of parameters (`torch.optim.Optimizer`).
pub trait Optimizer: Send {
    /// The optimizer's name as its state dict records it (`"SGD"`, `"Adam"`, `"AdamW"`), for
    /// checking a saved state before loading it; `""` when it does not say.
    fn kind(&self) -> &'static str {
        ""
    }

    /// Updates every parameter that has a `.grad` (`step()`); parameters without one are
    /// skipped, as in PyTorch.
    ///
    /// Errors: as [`Optimizer::step_with_grads`], and [`Error::InvalidArgument`] when a
    /// parameter's gradient is still being reduced ([`Tensor::grad_pending`]; nothing is
    /// updated).
    fn step(&mut self) -> Result<()> {
        if let Some((i, why)) = self
            .params()
            .iter()
            .enumerate()
            .find_map(|(i, p)| p.grad_pending().map(|w| (i, w)))
        {
            return Err(Error::invalid(
                "Optimizer::step",
                "params",
                "parameters whose gradients are complete",
                format!("parameter {i}'s gradient is still being reduced ({why})"),
            ));
        }
        let grads: Vec<Option<Tensor>> = self.params().iter().map(Tensor::grad).collect();
        self.step_with_grads(&grads)
    }

    /// Updates the parameters with the given gradients, one per parameter in order (`None`
    /// skips that parameter), ignoring `.grad`. Used by optimizers that keep gradients
    /// elsewhere (distributed autograd).
    ///
    /// Errors: [`Error::InvalidArgument`] when the number of gradients differs from the number
    /// of parameters, or a gradient's shape or dtype differs from its parameter's (the message
    /// names the parameter index), or it is on another device; [`Error::NotSupported`] for a
    /// CUDA parameter that is a strided or offset view of a larger storage.
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

/// Checks the parameters given to an optimizer: float32 or float64 tensors (16-bit ones are
/// refused here, before any step could update some parameters and then fail on others).
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
        if !matches!(p.dtype(), crate::DType::F32 | crate::DType::F64) {
            return Err(Error::invalid(
                op,
                "params",
                "float32 or float64 parameters (16-bit training keeps float32 master weights: \
                 autocast or MixedPrecisionPolicy)",
                format!("parameter {i} of dtype {}", p.dtype()),
            ));
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
        if p.device() != g.device() {
            return Err(Error::invalid(
                op,
                "grads",
                format!("gradient {i} on {} (parameter {i}'s device)", p.device()),
                format!("a gradient on {}", g.device()),
            ));
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

/// Per-parameter optimizer state of the parameter's element type: host vectors, or for a
/// parameter on a device a contiguous tensor there.
#[derive(Debug, Clone)]
pub(crate) enum Buf {
    F32(Counted<f32>),
    F64(Counted<f64>),
    Device(Tensor),
}

/// A host state vector that [`crate::memory::allocated_bytes`] counts while it lives, as it
/// counts tensors (the optimizer's state is part of what a rank holds). Never resized.
#[derive(Debug)]
pub(crate) struct Counted<T> {
    v: Vec<T>,
    bytes: usize,
}

impl<T> Counted<T> {
    pub(crate) fn new(v: Vec<T>) -> Counted<T> {
        let bytes = v.capacity() * size_of::<T>();
        crate::storage::pool::on_alloc(bytes);
        Counted { v, bytes }
    }
}

impl<T: Clone> Clone for Counted<T> {
    fn clone(&self) -> Self {
        Counted::new(self.v.clone())
    }
}

impl<T> Drop for Counted<T> {
    fn drop(&mut self) {
        crate::storage::pool::on_free(None, self.bytes);
    }
}

impl<T> std::ops::Deref for Counted<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.v
    }
}

impl<T> std::ops::DerefMut for Counted<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.v
    }
}

/// The state `slot` of device parameter `p` as a contiguous tensor beside it: kept when it
/// is one already, uploaded from a loaded host state, else zeros. Returns it and whether it
/// was made as zeros.
pub(crate) fn device_state(slot: &mut Option<Buf>, p: &Tensor) -> Result<(Tensor, bool)> {
    if let Some(Buf::Device(t)) = slot
        && t.shape() == p.shape()
        && t.dtype() == p.dtype()
        && t.device() == p.device()
    {
        return Ok((t.clone(), false));
    }
    let (t, fresh) = match slot {
        Some(b @ (Buf::F32(_) | Buf::F64(_))) => match state::buf_tensor(b, p) {
            Ok(t) => (t.to_dtype(p.dtype())?.to_device(p.device())?, false),
            Err(_) => (Tensor::zeros(p.shape(), (p.dtype(), p.device()))?, true),
        },
        _ => (Tensor::zeros(p.shape(), (p.dtype(), p.device()))?, true),
    };
    *slot = Some(Buf::Device(t.clone()));
    Ok((t, fresh))
}

/// The device path of an optimizer step for parameter `p` with gradient `g`: `f` gets the
/// parameter's device storage (write-locked), its element count, the gradient's storage and
/// the state tensors' storages (write-locked, in order). `None` for host parameters.
///
/// # Errors
/// `NotSupported` for a parameter that is not contiguous from the start of its storage.
pub(crate) fn device_step(
    op: &'static str,
    p: &Tensor,
    g: &Tensor,
    states: &[&Tensor],
    f: impl FnOnce(&mut CudaStorage, usize, &CudaStorage, &mut [&mut CudaStorage]) -> Result<()>,
) -> Option<Result<()>> {
    if !p.device().is_cuda() {
        return None;
    }
    Some((|| {
        if !p.is_contiguous() || p.layout().offset() != 0 {
            return Err(Error::NotSupported {
                op,
                detail: "for a CUDA parameter that is a strided or offset view (make it a \
                         tensor of its own)"
                    .into(),
            });
        }
        if p.numel() == 0 {
            return Ok(());
        }
        // a gradient that aliases the parameter, or is strided, is copied first
        let g = if g.shares_storage_with(p) || !g.is_contiguous() || g.layout().offset() != 0 {
            g.detach().deep_clone()?
        } else {
            g.clone()
        };
        let n = p.numel();
        let lost = || Error::NotSupported {
            op,
            detail: "state on another device than its parameter".into(),
        };
        backend::on_device_mut(p, |cp, _| {
            backend::on_device(&g, |cg, _| match states {
                [] => f(cp, n, cg, &mut []),
                [a] => backend::on_device_mut(a, |ca, _| f(cp, n, cg, &mut [ca]))
                    .unwrap_or_else(|| Err(lost())),
                [a, b] => backend::on_device_mut(a, |ca, _| {
                    backend::on_device_mut(b, |cb, _| f(cp, n, cg, &mut [ca, cb]))
                        .unwrap_or_else(|| Err(lost()))
                })
                .unwrap_or_else(|| Err(lost())),
                [a, b, c] => backend::on_device_mut(a, |ca, _| {
                    backend::on_device_mut(b, |cb, _| {
                        backend::on_device_mut(c, |cc, _| f(cp, n, cg, &mut [ca, cb, cc]))
                            .unwrap_or_else(|| Err(lost()))
                    })
                    .unwrap_or_else(|| Err(lost()))
                })
                .unwrap_or_else(|| Err(lost())),
                _ => Err(lost()),
            })
            .unwrap_or_else(|| Err(lost()))
        })
        .unwrap_or_else(|| Err(lost()))
    })())
}

/// Dispatches on the dtypes the optimizers update in place (`float32`, `float64`), binding
/// `$T`; a 16-bit parameter is an [`Error::UnsupportedDType`](crate::Error::UnsupportedDType)
/// naming `$op`: low-precision training keeps float32 master weights and optimizer state
/// (autocast, or the fully-sharded `MixedPrecisionPolicy`), and 16-bit optimizer state is out
/// of scope.
macro_rules! opt_dispatch {
    ($dt:expr, $op:expr, $T:ident => $body:expr) => {
        match $dt {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            d @ ($crate::DType::BF16
            | $crate::DType::F16
            | $crate::DType::I64
            | $crate::DType::Bool) => {
                return Err($crate::Error::UnsupportedDType {
                    op: $op,
                    dtype: d,
                    expected: "float32 or float64 parameters (16-bit training keeps float32 \
                               master weights: autocast or MixedPrecisionPolicy)",
                })
            }
        }
    };
}
pub(crate) use opt_dispatch;

/// A float element the optimizers update.
pub(crate) trait OptElem: FloatElement + StorageElement {
    fn buf(b: &mut Buf) -> Option<&mut [Self]>;
    fn wrap(v: Vec<Self>) -> Buf;
    fn c(v: f64) -> Self {
        <Self as Element>::from_f64(v)
    }
}
use crate::Element;
impl OptElem for f32 {
    fn buf(b: &mut Buf) -> Option<&mut [f32]> {
        match b {
            Buf::F32(v) => Some(v),
            Buf::F64(_) | Buf::Device(_) => None,
        }
    }
    fn wrap(v: Vec<f32>) -> Buf {
        Buf::F32(Counted::new(v))
    }
}
impl OptElem for f64 {
    fn buf(b: &mut Buf) -> Option<&mut [f64]> {
        match b {
            Buf::F64(v) => Some(v),
            Buf::F32(_) | Buf::Device(_) => None,
        }
    }
    fn wrap(v: Vec<f64>) -> Buf {
        Buf::F64(Counted::new(v))
    }
}

/// The state vector `slot` of type `T` with `n` elements, created by `init` when absent.
pub(crate) fn state<T: OptElem>(
    slot: &mut Option<Buf>,
    n: usize,
    init: impl FnOnce() -> Vec<T>,
) -> Result<&mut [T]> {
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
