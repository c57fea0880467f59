//! Activation checkpointing (`torch.utils.checkpoint`, the non-reentrant form): trade compute
//! for memory by dropping the tensors a region saves for backward and recomputing them when
//! backward needs them.
//!
//! [`checkpoint`] runs a function with recording on, so the graph is built as usual, but under
//! saved-tensor hooks ([`crate::autograd::saved_tensors_hooks`]) that keep only a number per
//! saved tensor. The first time backward unpacks one of them, the function runs again on the
//! same inputs (detached, with the same `requires_grad`), with recording on and the random
//! generator put back to its state at the forward (so dropout draws the same masks), and the
//! tensors it saves are handed out by their order. [`CheckpointWrapper`] does this around a
//! module's forward, block by block (PyTorch's `checkpoint_wrapper`).

mod wrapper;

use std::sync::{Arc, Mutex, PoisonError};

use crate::autograd::{
    PackedTensor, SavedTensorHooks, TensorMeta, is_grad_enabled, push_saved_tensors_hooks,
    set_grad_enabled,
};
use crate::random::{Generator, default_generator};
use crate::{Error, Result, Tensor};

pub use wrapper::CheckpointWrapper;

/// The function [`checkpoint`] runs twice: inputs to outputs.
type Body = dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync;

/// One call of [`checkpoint`]: what recomputing needs and what it produced.
struct Frame {
    body: Box<Body>,
    /// The inputs as given (kept: recomputing starts from them).
    inputs: Vec<Tensor>,
    /// The default generator's state when the forward started.
    rng: Generator,
    /// The autocast regions of the forward (the recompute in backward runs under them).
    autocast: crate::amp::Regions,
    /// Shape, dtype and device of every tensor saved in the forward, by save order.
    saved: Mutex<Vec<TensorMeta>>,
    /// The recomputed saved tensors (with their version when saved), each taken by its unpack.
    recomputed: Mutex<Vec<Option<(Tensor, u64)>>>,
}

impl Frame {
    fn lock_saved(&self) -> std::sync::MutexGuard<'_, Vec<TensorMeta>> {
        self.saved.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Saved tensor `i`, recomputing the function when it is not at hand.
    fn unpack(&self, i: usize) -> Result<Tensor> {
        if is_grad_enabled() {
            return Err(Error::Autograd(
                "checkpoint: backward with create_graph (double backward) through a \
                 checkpointed region is not supported: its recomputed tensors are not connected \
                 to the graph outside it; call the function without checkpoint for \
                 higher-order gradients"
                    .into(),
            ));
        }
        let mut rec = self
            .recomputed
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if rec.get(i).is_none_or(Option::is_none) {
            *rec = self.recompute()?;
        }
        let (t, v) = rec.get_mut(i).and_then(Option::take).ok_or_else(|| {
            Error::Autograd(format!(
                "checkpoint: saved tensor {i} is not among the {} the recomputation saved",
                rec.len()
            ))
        })?;
        if t.version() != v {
            return Err(Error::Autograd(format!(
                "checkpoint: tensor {i} saved by the recomputed function (shape {:?}) was \
                 modified by an in-place operation later in the function (version {} instead \
                 of {v}); the same code fails without checkpoint",
                t.shape(),
                t.version()
            )));
        }
        Ok(t)
    }

    /// Runs the function again as the forward ran it and returns what it saved, in order,
    /// after checking it saved as many tensors of the same shapes as the forward.
    fn recompute(&self) -> Result<Vec<Option<(Tensor, u64)>>> {
        let inputs: Vec<Tensor> = self
            .inputs
            .iter()
            .map(|x| {
                let d = x.detach();
                if x.requires_grad() {
                    d.set_requires_grad(true)?;
                }
                Ok(d)
            })
            .collect::<Result<_>>()?;
        let capture = Arc::new(Capture::default());
        {
            let _mode = set_grad_enabled(true);
            let _rng = RngSwap::enter(self.rng.clone());
            let _autocast = crate::amp::enter_regions(&self.autocast);
            let _hooks = push_saved_tensors_hooks(capture.clone());
            drop((self.body)(&inputs)?);
        }
        let got = std::mem::take(&mut *capture.lock());
        let want = self.lock_saved();
        if got.len() != want.len() {
            return Err(Error::Autograd(format!(
                "checkpoint: the checkpointed function saved {} tensors for backward in its \
                 forward but {} when it was recomputed in backward; it must run the same \
                 operations both times (does it depend on state that changed in between, such \
                 as the training mode or a global?)",
                want.len(),
                got.len()
            )));
        }
        for (i, ((t, _), m)) in got.iter().zip(want.iter()).enumerate() {
            let now = TensorMeta::of(t);
            if now != *m {
                return Err(Error::Autograd(format!(
                    "checkpoint: saved tensor {i} of the checkpointed function was {:?} {} on \
                     {} in the forward but {:?} {} on {} when recomputed; the function must \
                     compute the same way both times",
                    m.shape, m.dtype, m.device, now.shape, now.dtype, now.device
                )));
            }
        }
        Ok(got.into_iter().map(Some).collect())
    }
}

/// The hooks of the forward: a number per saved tensor.
struct Pack(Arc<Frame>);

impl SavedTensorHooks for Pack {
    fn pack(&self, t: &Tensor) -> Result<PackedTensor> {
        let mut saved = self.0.lock_saved();
        saved.push(TensorMeta::of(t));
        Ok(Box::new(saved.len() - 1))
    }
    fn unpack(&self, packed: &PackedTensor) -> Result<Tensor> {
        let i = packed.downcast_ref::<usize>().ok_or_else(|| {
            Error::Autograd("checkpoint: a saved tensor was not packed by checkpoint".into())
        })?;
        self.0.unpack(*i)
    }
}

/// The hooks of the recomputation: keep every saved tensor (and its version) in order.
#[derive(Default)]
struct Capture(Mutex<Vec<(Tensor, u64)>>);

impl Capture {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(Tensor, u64)>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl SavedTensorHooks for Capture {
    fn pack(&self, t: &Tensor) -> Result<PackedTensor> {
        self.lock().push((t.detach(), t.version()));
        Ok(Box::new(()))
    }
    fn unpack(&self, _: &PackedTensor) -> Result<Tensor> {
        Err(Error::Autograd(
            "checkpoint: backward through the graph of a recomputation (the outputs of a \
             checkpointed function's recomputation are not meant to leave it)"
                .into(),
        ))
    }
}

/// Puts a saved generator state in place of the default generator's and the current one back
/// when dropped (also on an error), so recomputing does not move the stream.
struct RngSwap(Option<Generator>);

impl RngSwap {
    fn enter(state: Generator) -> RngSwap {
        RngSwap(Some(std::mem::replace(&mut *default_generator(), state)))
    }
}

impl Drop for RngSwap {
    fn drop(&mut self) {
        if let Some(g) = self.0.take() {
            *default_generator() = g;
        }
    }
}

/// Runs `f(inputs)` without keeping the tensors its operations save for backward, and
/// recomputes them in backward (`torch.utils.checkpoint.checkpoint(f, *inputs,
/// use_reentrant=False)`): the memory of a region's activations traded for a second forward
/// of it.
///
/// `f` gets the inputs (the same handles) and returns any number of tensors; it must be a
/// deterministic function of its inputs, the tensors it captures (parameters) and the default
/// random generator, because in backward it runs again: with recording on, on the inputs
/// detached (keeping their `requires_grad`), with the generator set to its state at this call
/// (so dropout masks repeat; the generator's stream is put back afterwards), and the tensors
/// it saves replace the forward's by their order. Only the first unpack recomputes; each
/// recomputed tensor is dropped once handed out, so a second backward (`retain_graph`)
/// recomputes again. The inputs are kept until the graph is freed. Parameters and inputs
/// modified in place between forward and backward are detected as without checkpoint.
///
/// With recording off (`no_grad`), `f` simply runs. Checkpoints nest: an inner region is
/// recomputed by its own checkpoint. Backward may run on another thread than the forward.
///
/// ```
/// use tensorplay::{self as tp, nn::{self, Module}, utils::checkpoint::checkpoint};
/// use std::sync::Arc;
///
/// tp::manual_seed(0);
/// let mlp = Arc::new(nn::Sequential::new()
///     .add(nn::Linear::new(8, 32, true)?)
///     .add(nn::GELU::new())
///     .add(nn::Linear::new(32, 8, true)?));
/// let x = tp::randn(&[4, 8])?.requires_grad_(true);
/// let m = mlp.clone();
/// let y = checkpoint(move |xs| Ok(vec![m.call(&xs[0])?]), &[&x])?.remove(0);
/// y.pow_scalar(2.0)?.mean()?.backward()?; // the MLP's activations are recomputed here
/// assert_eq!(x.grad().unwrap().shape(), [4, 8]);
/// # Ok::<(), tp::Error>(())
/// ```
///
/// # Errors
/// Whatever `f` returns. In backward ([`Error::Autograd`]): the recomputation saved a
/// different number of tensors than the forward, or one of another shape, dtype or device
/// (`f` is not deterministic); a saved input or parameter was modified in place in between;
/// backward with `create_graph` through the region (not supported).
pub fn checkpoint<F>(f: F, inputs: &[&Tensor]) -> Result<Vec<Tensor>>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
{
    let inputs: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    if !is_grad_enabled() {
        return f(&inputs);
    }
    let frame = Arc::new(Frame {
        body: Box::new(f),
        inputs,
        rng: default_generator().clone(),
        autocast: crate::amp::current_regions(),
        saved: Mutex::new(Vec::new()),
        recomputed: Mutex::new(Vec::new()),
    });
    let _hooks = push_saved_tensors_hooks(Arc::new(Pack(frame.clone())));
    (frame.body)(&frame.inputs)
}
