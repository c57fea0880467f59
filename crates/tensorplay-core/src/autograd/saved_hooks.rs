//! Saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`): while a guard is alive on
//! a thread, every tensor an operation on that thread saves for backward is handed to a pack
//! hook, and the graph keeps what the hook returns instead of the tensor; backward hands the
//! packed value to the unpack hook to get the tensor back. Activation checkpointing is built
//! on them (`crate::utils::checkpoint`).
//!
//! The hooks in force are captured per saved tensor when it is saved, so backward may run on
//! any thread and after the guard is gone.

use std::any::Any;
use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;

use crate::{Result, Tensor};

/// What a pack hook returns and the graph keeps in place of a saved tensor.
pub type PackedTensor = Box<dyn Any + Send + Sync>;

/// A pair of pack and unpack hooks.
pub(crate) trait SavedTensorHooks: Send + Sync {
    /// Called when an operation saves `t` for backward (with recording on).
    fn pack(&self, t: &Tensor) -> Result<PackedTensor>;
    /// Called when backward needs the tensor again.
    fn unpack(&self, packed: &PackedTensor) -> Result<Tensor>;
}

thread_local! {
    static STACK: RefCell<Vec<Arc<dyn SavedTensorHooks>>> = const { RefCell::new(Vec::new()) };
}

/// The innermost hooks in force on this thread.
pub(crate) fn current() -> Option<Arc<dyn SavedTensorHooks>> {
    STACK.with(|s| s.borrow().last().cloned())
}

/// Pushes `hooks` on this thread's stack until the guard drops.
pub(crate) fn push(hooks: Arc<dyn SavedTensorHooks>) -> SavedTensorsHooksGuard {
    let depth = STACK.with(|s| {
        let mut s = s.borrow_mut();
        s.push(hooks);
        s.len()
    });
    SavedTensorsHooksGuard {
        depth,
        _not_send: PhantomData,
    }
}

struct FnHooks<P, U> {
    pack: P,
    unpack: U,
}

impl<P, U> SavedTensorHooks for FnHooks<P, U>
where
    P: Fn(&Tensor) -> Result<PackedTensor> + Send + Sync,
    U: Fn(&PackedTensor) -> Result<Tensor> + Send + Sync,
{
    fn pack(&self, t: &Tensor) -> Result<PackedTensor> {
        (self.pack)(t)
    }
    fn unpack(&self, packed: &PackedTensor) -> Result<Tensor> {
        (self.unpack)(packed)
    }
}

/// Installs a pack and an unpack hook for the tensors saved for backward on this thread while
/// the returned guard lives (`torch.autograd.graph.saved_tensors_hooks`).
///
/// `pack` gets each tensor an operation saves while recording (inputs and outputs alike, in
/// the order the operation saves them) and returns what the graph keeps instead; `unpack` gets
/// that value back when backward needs the tensor and must return a tensor of the same shape,
/// dtype and device (the graph checks nothing else). Only the innermost guard's hooks apply.
/// Each saved tensor remembers the hooks it was packed with, so backward may run on another
/// thread or after the guard dropped. A saved tensor whose storage is still alive when it is
/// unpacked is checked against in-place modification as usual.
///
/// Errors from either hook fail the operation (pack) or the backward (unpack) with that error.
///
/// ```
/// use tensorplay::{self as tp, autograd::saved_tensors_hooks};
/// use std::sync::{Arc, atomic::{AtomicUsize, Ordering}};
///
/// let packed = Arc::new(AtomicUsize::new(0));
/// let x = tp::randn(&[3])?.requires_grad_(true);
/// let y = {
///     let n = packed.clone();
///     let _hooks = saved_tensors_hooks(
///         // keep a copy (as off-loading to another device would)
///         move |t| { n.fetch_add(1, Ordering::Relaxed); Ok(Box::new(t.deep_clone()?)) },
///         |p| Ok(p.downcast_ref::<tp::Tensor>().expect("what pack returned").clone()),
///     );
///     x.mul(&x)?.sum()?
/// };
/// y.backward()?;
/// assert_eq!(packed.load(Ordering::Relaxed), 2); // mul saved both operands
/// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, x.mul_scalar(2.0)?.to_vec::<f32>()?);
/// # Ok::<(), tp::Error>(())
/// ```
pub fn saved_tensors_hooks<P, U>(pack: P, unpack: U) -> SavedTensorsHooksGuard
where
    P: Fn(&Tensor) -> Result<PackedTensor> + Send + Sync + 'static,
    U: Fn(&PackedTensor) -> Result<Tensor> + Send + Sync + 'static,
{
    push(Arc::new(FnHooks { pack, unpack }))
}

/// Removes the hooks of [`saved_tensors_hooks`] when dropped. Guards nest and must drop in
/// reverse order of creation (as scopes do); it cannot leave its thread.
#[must_use = "the hooks are removed as soon as the guard is dropped"]
pub struct SavedTensorsHooksGuard {
    depth: usize,
    _not_send: PhantomData<*const ()>,
}

impl Drop for SavedTensorsHooksGuard {
    fn drop(&mut self) {
        // dropped outside the borrow: dropping hooks may drop anything, even tensors whose
        // drop saves nothing but could in principle run code that installs hooks
        let popped = STACK.with(|s| {
            let mut s = s.borrow_mut();
            let at = (self.depth - 1).min(s.len());
            s.split_off(at)
        });
        drop(popped);
    }
}
