//! [`CheckpointWrapper`]: a module whose forward runs under [`checkpoint`] (PyTorch's
//! `checkpoint_wrapper`, torchtitan's per-block activation checkpointing).
//!
//! Recomputing in backward needs the module after the forward call returned, so the wrapper
//! holds it in an `Arc` and lends each checkpointed forward a handle to it through a slot it
//! can empty. Mutable access to the module empties every slot first (the graphs of earlier
//! forwards then refuse to recompute, with an error, instead of recomputing with a changed
//! module), which leaves the wrapper the only owner again.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use super::checkpoint;
use crate::autograd::is_grad_enabled;
use crate::nn::{Module, ModuleCore, ModuleFields};
use crate::{Error, Result, Tensor};

/// The handle a forward's recomputation reaches the module through; emptied when the module is
/// borrowed mutably.
type Slot<M> = Mutex<Option<Arc<M>>>;

/// Wraps a module so that its forward runs under [`checkpoint`]: the activations inside it are
/// not kept for backward but recomputed there, block by block (PyTorch's
/// `checkpoint_wrapper`). Apply it to each transformer block; with fully sharded data
/// parallelism wrap first, then `fully_shard` the wrapped blocks (torchtitan's order; the
/// recomputation then runs while the block's parameters are gathered for backward).
///
/// The wrapper is transparent: its parameters, buffers, children, names, hooks and training
/// flag are the wrapped module's (`h.0.attn.c_attn.weight` stays that, where PyTorch's wrapper
/// adds `_checkpoint_wrapped_module.` to `named_parameters` and strips it from the state
/// dict), so a state dict loads into the model with or without it. [`Module::call`] runs the
/// module's forward hooks once, outside the checkpointed region; recomputation calls the
/// module's [`Module::forward`] only. It dereferences to the module, so its fields and methods
/// are reachable as before.
///
/// Checkpointing can be switched off ([`CheckpointWrapper::set_enabled`]); it is skipped with
/// recording off (`no_grad`, evaluation). Changing the module (any mutable access: `train`,
/// `to`, `fully_shard`, [`DerefMut`]) between a forward and its backward makes that backward
/// fail with [`Error::Autograd`] rather than recompute with the changed module.
///
/// ```
/// use tensorplay::{self as tp, nn::{self, Module}, utils::checkpoint::CheckpointWrapper};
///
/// tp::manual_seed(0);
/// let block = nn::Sequential::new()
///     .add(nn::Linear::new(8, 32, true)?)
///     .add(nn::Tanh::new())
///     .add(nn::Linear::new(32, 8, true)?);
/// let wrapped = CheckpointWrapper::new(block);
/// let names: Vec<String> = wrapped.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["0.weight", "0.bias", "2.weight", "2.bias"]); // unchanged
/// let x = tp::randn(&[4, 8])?.requires_grad_(true);
/// wrapped.call(&x)?.sum()?.backward()?; // the block's forward runs again here
/// assert_eq!(x.grad().unwrap().shape(), [4, 8]);
/// # Ok::<(), tp::Error>(())
/// ```
pub struct CheckpointWrapper<M: Module + 'static> {
    inner: Arc<M>,
    lent: Mutex<Vec<Weak<Slot<M>>>>,
    enabled: bool,
}

impl<M: Module + 'static> CheckpointWrapper<M> {
    /// Wraps `module`, checkpointing on.
    pub fn new(module: M) -> CheckpointWrapper<M> {
        CheckpointWrapper {
            inner: Arc::new(module),
            lent: Mutex::new(Vec::new()),
            enabled: true,
        }
    }

    /// Turns checkpointing on or off (off: the forward is the module's own).
    pub fn set_enabled(&mut self, enabled: bool) {
        self.enabled = enabled;
    }

    /// Whether the forward is checkpointed.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The wrapped module.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// The wrapped module, mutably; earlier forwards' graphs can no longer recompute (their
    /// backward errors).
    pub fn inner_mut(&mut self) -> &mut M {
        self.revoke();
        // after `revoke` no slot holds a handle and only slots ever get one: the wrapper's is
        // the only strong reference, and no weak one is ever made
        Arc::get_mut(&mut self.inner).expect("a revoked checkpoint wrapper owns its module")
    }

    /// The wrapped module, unwrapped; as [`CheckpointWrapper::inner_mut`] for earlier graphs.
    pub fn into_inner(mut self) -> M {
        self.revoke();
        match Arc::try_unwrap(self.inner) {
            Ok(m) => m,
            Err(_) => unreachable!("a revoked checkpoint wrapper owns its module"),
        }
    }

    /// Empties every slot lent to a forward, waiting for a recomputation in progress.
    fn revoke(&mut self) {
        let lent = std::mem::take(self.lent.get_mut().unwrap_or_else(PoisonError::into_inner));
        for slot in lent.iter().filter_map(Weak::upgrade) {
            let taken = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
            drop(taken);
        }
    }
}

impl<M: Module + 'static> Deref for CheckpointWrapper<M> {
    type Target = M;
    fn deref(&self) -> &M {
        self.inner()
    }
}

impl<M: Module + 'static> DerefMut for CheckpointWrapper<M> {
    fn deref_mut(&mut self) -> &mut M {
        self.inner_mut()
    }
}

impl<M: Module + 'static> std::fmt::Debug for CheckpointWrapper<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointWrapper")
            .field("module", &std::any::type_name::<M>())
            .field("enabled", &self.enabled)
            .finish()
    }
}

/// Everything the wrapped module holds, under the same names.
impl<M: Module + 'static> ModuleFields for CheckpointWrapper<M> {
    fn core(&self) -> &ModuleCore {
        self.inner.core()
    }
    fn core_mut(&mut self) -> &mut ModuleCore {
        self.inner_mut().core_mut()
    }
    fn local_parameters(&self) -> Vec<(String, Tensor)> {
        self.inner.local_parameters()
    }
    fn local_parameters_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        self.inner_mut().local_parameters_mut()
    }
    fn local_buffers(&self) -> Vec<(String, Tensor)> {
        self.inner.local_buffers()
    }
    fn local_buffers_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        self.inner_mut().local_buffers_mut()
    }
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        self.inner.named_children()
    }
    fn named_children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        self.inner_mut().named_children_mut()
    }
}

impl<M: Module + 'static> Module for CheckpointWrapper<M> {
    /// The wrapped module's forward, under [`checkpoint`] when enabled and recording.
    ///
    /// Errors: the module's; in backward, those of [`checkpoint`], and [`Error::Autograd`]
    /// when the module was borrowed mutably after this forward.
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        if !self.enabled || !is_grad_enabled() {
            return self.inner.forward(input);
        }
        let slot: Arc<Slot<M>> = Arc::new(Mutex::new(Some(self.inner.clone())));
        {
            let mut lent = self.lent.lock().unwrap_or_else(PoisonError::into_inner);
            lent.retain(|w| w.strong_count() > 0);
            lent.push(Arc::downgrade(&slot));
        }
        let mut out = checkpoint(
            move |xs| {
                let m = slot.lock().unwrap_or_else(PoisonError::into_inner);
                let m = m.as_ref().ok_or_else(|| {
                    Error::Autograd(format!(
                        "checkpoint wrapper of {}: the module was changed (borrowed mutably) \
                         after this forward, so its activations cannot be recomputed; run \
                         backward before changing the module",
                        std::any::type_name::<M>()
                    ))
                })?;
                Ok(vec![m.forward(&xs[0])?])
            },
            &[input],
        )?;
        Ok(out.remove(0))
    }

    /// The wrapped module's own [`Module::reset_parameters`].
    fn reset_parameters(&mut self) -> Result<()> {
        self.inner_mut().reset_parameters()
    }
}
