//! Reverse-mode automatic differentiation (`torch.autograd`).
//!
//! Operations on tensors that require grad record a graph of [`Node`]s; `backward` runs it from
//! the loss to the leaves. The pieces:
//! - [`Function`] and [`apply`]: custom differentiable operations (every built-in op uses them).
//! - [`backward`], [`grad`], and the `Tensor` methods `backward`, `grad`, `requires_grad_`,
//!   `detach`, `register_hook`, `register_post_accumulate_grad_hook`, `retain_grad`.
//! - [`queue_callback`]: run a function when the current backward pass ends (data
//!   parallelism waits for its all-reduces there).
//! - [`no_grad`] / [`set_grad_enabled`]: thread-local recording switch.
//! - [`run_backward`]: the lower-level entry (roots as graph edges with given gradients, leaf
//!   gradients collected into a map instead of `.grad`), used by distributed autograd.
//! - [`gradcheck`]: finite-difference check in float64.
//! - [`saved_tensors_hooks`]: pack and unpack the tensors saved for backward (activation
//!   checkpointing, `crate::utils::checkpoint`, is built on them).
//!
//! Nodes run as soon as they are ready, leaf accumulations first (as in PyTorch), so a leaf's
//! `.grad` and its post-accumulate hooks come as early in the pass as its gradient is known.
//! Semantics follow PyTorch: gradients accumulate on leaves, a graph is freed after backward
//! unless `retain_graph`, `create_graph` records the backward for double backward, and a tensor
//! saved for backward that is modified in place makes backward fail.

mod engine;
mod function;
mod grad_mode;
mod gradcheck;
pub(crate) mod graph;
mod saved_hooks;
mod split;

use std::sync::{Arc, Weak};

pub use engine::{
    BackwardResult, Callback, ExecuteOptions, LeafSink, accumulating_pass, queue_callback,
    run_backward,
};
pub use function::{Function, apply};
pub use grad_mode::{GradModeGuard, is_grad_enabled, no_grad, set_grad_enabled};
pub use gradcheck::{GradcheckOptions, gradcheck, gradgradcheck};
pub use graph::{Context, GradientEdge, Hook, Node, TensorMeta};
pub use saved_hooks::{PackedTensor, SavedTensorsHooksGuard, saved_tensors_hooks};
pub(crate) use saved_hooks::{SavedTensorHooks, push as push_saved_tensors_hooks};
pub use split::{WeightGrads, backward_input};

use crate::{Error, Result, Tensor};
use graph::Edge;

/// A hook run after a backward pass has accumulated a gradient into a leaf's `.grad`; it gets
/// the leaf (read the new value with [`Tensor::grad`]). See
/// [`Tensor::register_post_accumulate_grad_hook`].
pub type PostAccumulateGradHook = Arc<dyn Fn(&Tensor) -> Result<()> + Send + Sync>;

static NEXT_HOOK_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The handle of a registered post-accumulate-grad hook (PyTorch's `RemovableHandle`):
/// [`HookHandle::remove`] unregisters it. Dropping the handle keeps the hook.
#[derive(Debug)]
pub struct HookHandle {
    id: u64,
    tensor: Weak<crate::tensor::TensorImpl>,
}

impl HookHandle {
    /// Unregisters the hook; a no-op when the tensor is gone or the hook was removed already.
    pub fn remove(&self) {
        if let Some(t) = self.tensor.upgrade() {
            Tensor(t)
                .meta()
                .post_accumulate_hooks
                .retain(|(id, _)| *id != self.id);
        }
    }
}

impl Tensor {
    /// Whether operations on this tensor are recorded: it is a leaf that requires grad or
    /// the output of a recorded operation.
    pub fn requires_grad(&self) -> bool {
        let m = self.meta();
        m.requires_grad || m.grad_fn.is_some()
    }

    /// Sets whether this leaf requires grad and returns the same handle, so calls chain
    /// (`tp::randn(&[2])?.requires_grad_(true)`). Only floating tensors can require grad;
    /// on other dtypes, and on non-leaf tensors, this leaves the flag unchanged (use
    /// [`Tensor::set_requires_grad`] to get an error instead).
    pub fn requires_grad_(self, requires_grad: bool) -> Tensor {
        let _ = self.set_requires_grad(requires_grad);
        self
    }

    /// Sets whether this leaf requires grad. Errors on a non-floating dtype, and when turning
    /// it off on a non-leaf tensor (as PyTorch does).
    pub fn set_requires_grad(&self, requires_grad: bool) -> Result<()> {
        if requires_grad && !self.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "requires_grad_",
                dtype: self.dtype(),
                expected: "a floating dtype (only float tensors can require gradients)",
            });
        }
        let mut m = self.meta();
        if m.grad_fn.is_some() {
            if !requires_grad {
                return Err(Error::Autograd(
                    "you can only change requires_grad flags of leaf tensors; use detach() \
                     to get a tensor that does not require grad"
                        .into(),
                ));
            }
            return Ok(());
        }
        m.requires_grad = requires_grad;
        Ok(())
    }

    /// Whether this is a leaf: created by the user rather than by a recorded operation.
    pub fn is_leaf(&self) -> bool {
        self.meta().grad_fn.is_none()
    }

    /// The accumulated gradient (`.grad`), if any.
    pub fn grad(&self) -> Option<Tensor> {
        self.meta().grad.clone()
    }

    /// Replaces the accumulated gradient (`x.grad = g`); `None` clears it.
    pub fn set_grad(&self, grad: Option<Tensor>) {
        self.meta().grad = grad;
    }

    /// The node that produced this tensor (`grad_fn`), `None` for leaves.
    pub fn grad_fn(&self) -> Option<Arc<Node>> {
        self.meta().grad_fn.as_ref().map(|e| e.node.clone())
    }

    /// Where a gradient for this tensor enters the graph: its `grad_fn` output, or the
    /// accumulator of a leaf that requires grad. `None` when it does not require grad.
    pub fn gradient_edge(&self) -> Option<GradientEdge> {
        self.gradient_edge_internal().map(GradientEdge)
    }

    pub(crate) fn gradient_edge_internal(&self) -> Option<Edge> {
        let mut m = self.meta();
        if let Some(e) = &m.grad_fn {
            return Some(e.clone());
        }
        if !m.requires_grad {
            return None;
        }
        let node = match m.grad_accumulator.upgrade() {
            Some(n) => n,
            None => {
                let n = Node::accumulate_grad(self);
                for h in &m.leaf_hooks {
                    n.add_pre_hook(0, h.clone());
                }
                m.grad_accumulator = Arc::downgrade(&n);
                n
            }
        };
        Some(Edge { node, input_nr: 0 })
    }

    /// A new handle on the same storage, cut from the graph (`detach`).
    pub fn detach(&self) -> Tensor {
        self.view_with_layout(self.layout().clone())
    }

    /// Computes the gradient of this scalar with respect to the leaves and accumulates it in
    /// their `.grad` (`loss.backward()`). Errors when the tensor has more than one element
    /// (use [`Tensor::backward_with`]) or does not require grad.
    pub fn backward(&self) -> Result<()> {
        self.backward_with(None, false, false)
    }

    /// `backward(gradient, retain_graph, create_graph)`: `gradient` must have this tensor's
    /// shape, dtype and device; it may be `None` only for one-element tensors.
    pub fn backward_with(
        &self,
        gradient: Option<&Tensor>,
        retain_graph: bool,
        create_graph: bool,
    ) -> Result<()> {
        backward(
            std::slice::from_ref(self),
            &[gradient.cloned()],
            retain_graph,
            create_graph,
        )
    }

    /// Registers a hook run on the gradient of this tensor each time one is computed
    /// (`register_hook`); returning `Some(g)` replaces the gradient. Errors when the tensor
    /// does not require grad.
    pub fn register_hook<F>(&self, hook: F) -> Result<()>
    where
        F: Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync + 'static,
    {
        let e = self.gradient_edge_internal().ok_or_else(|| {
            Error::Autograd(
                "cannot register a hook on a tensor that doesn't require gradient".into(),
            )
        })?;
        let hook: Hook = Arc::new(hook);
        if e.node.leaf().is_some() {
            // the accumulator is held weakly: keep the hook with the leaf so that it survives
            // until the leaf is used
            self.meta().leaf_hooks.push(hook.clone());
        }
        e.node.add_pre_hook(e.input_nr, hook);
        Ok(())
    }

    /// Registers a hook run each time a backward pass has accumulated a gradient into this
    /// leaf's `.grad` (`register_post_accumulate_grad_hook`): the hook gets the leaf, and
    /// [`Tensor::grad`] holds the updated sum. Hooks run in registration order, on the thread
    /// of the backward pass; an error from a hook fails that backward call. Passes that do not
    /// accumulate into `.grad` (`autograd::grad`, distributed autograd) do not run them. Data
    /// parallelism starts its gradient all-reduces from these hooks.
    ///
    /// Errors ([`Error::Autograd`]) on a non-leaf tensor and on a leaf that does not require
    /// grad.
    pub fn register_post_accumulate_grad_hook<F>(&self, hook: F) -> Result<HookHandle>
    where
        F: Fn(&Tensor) -> Result<()> + Send + Sync + 'static,
    {
        let mut m = self.meta();
        if m.grad_fn.is_some() {
            return Err(Error::Autograd(
                "post-accumulate-grad hooks can only be registered on leaf tensors".into(),
            ));
        }
        if !m.requires_grad {
            return Err(Error::Autograd(
                "cannot register a post-accumulate-grad hook on a tensor that doesn't \
                 require grad"
                    .into(),
            ));
        }
        let id = NEXT_HOOK_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        m.post_accumulate_hooks.push((id, Arc::new(hook)));
        Ok(HookHandle {
            id,
            tensor: Arc::downgrade(&self.0),
        })
    }

    /// Makes this non-leaf tensor keep its gradient in `.grad` during backward
    /// (`retain_grad`). No effect on leaves.
    pub fn retain_grad(&self) -> Result<()> {
        if self.is_leaf() {
            return Ok(());
        }
        {
            let mut m = self.meta();
            if m.retains_grad {
                return Ok(());
            }
            m.retains_grad = true;
        }
        let weak: Weak<crate::tensor::TensorImpl> = Arc::downgrade(&self.0);
        self.register_hook(move |g| {
            if let Some(t) = weak.upgrade() {
                let t = Tensor(t);
                let g = g.detach();
                let prev = t.meta().grad.take();
                let new = match prev {
                    None => g,
                    Some(p) => p.add(&g)?.detach(),
                };
                t.meta().grad = Some(new);
            }
            Ok(None)
        })
    }
}

fn root_grads(tensors: &[Tensor], grads: &[Option<Tensor>]) -> Result<Vec<(GradientEdge, Tensor)>> {
    if grads.len() != tensors.len() {
        return Err(Error::invalid(
            "backward",
            "grad_tensors",
            format!("{} gradients (one per tensor)", tensors.len()),
            grads.len(),
        ));
    }
    let mut roots = Vec::with_capacity(tensors.len());
    for (i, (t, g)) in tensors.iter().zip(grads).enumerate() {
        let edge = t.gradient_edge().ok_or_else(|| {
            Error::Autograd(format!(
                "element {i} of tensors does not require grad and does not have a grad_fn"
            ))
        })?;
        let g = match g {
            Some(g) => {
                if g.shape() != t.shape() {
                    return Err(Error::ShapeMismatch {
                        op: "backward (grad_tensors)",
                        lhs: t.shape().to_vec(),
                        rhs: g.shape().to_vec(),
                    });
                }
                if g.dtype() != t.dtype() {
                    return Err(Error::DTypeMismatch {
                        op: "backward (grad_tensors)",
                        lhs: t.dtype(),
                        rhs: g.dtype(),
                    });
                }
                if g.device() != t.device() {
                    return Err(Error::DeviceMismatch {
                        op: "backward (grad_tensors)",
                        lhs: t.device(),
                        rhs: g.device(),
                    });
                }
                g.clone()
            }
            None => {
                if t.numel() != 1 {
                    return Err(Error::Autograd(format!(
                        "grad can be implicitly created only for scalar outputs; tensor {i} \
                         has shape {:?}",
                        t.shape()
                    )));
                }
                Tensor::ones(t.shape(), (t.dtype(), t.device()))?
            }
        };
        roots.push((edge, g));
    }
    Ok(roots)
}

/// Runs backward from several tensors at once (`torch.autograd.backward`), accumulating into
/// the leaves' `.grad`. `grad_tensors[i]` may be `None` for one-element tensors.
pub fn backward(
    tensors: &[Tensor],
    grad_tensors: &[Option<Tensor>],
    retain_graph: bool,
    create_graph: bool,
) -> Result<()> {
    let roots = root_grads(tensors, grad_tensors)?;
    run_backward(
        &roots,
        &[],
        ExecuteOptions {
            retain_graph: retain_graph || create_graph,
            create_graph,
            leaf_sink: LeafSink::AccumulateGrad,
        },
    )?;
    Ok(())
}

/// Options of [`grad`].
#[derive(Debug, Clone, Copy, Default)]
pub struct GradOptions {
    /// Keep the graph (defaults to `create_graph` when `None`).
    pub retain_graph: Option<bool>,
    /// Record the backward so that the result can be differentiated again.
    pub create_graph: bool,
    /// Return `None` for inputs the outputs do not depend on instead of an error.
    pub allow_unused: bool,
}

/// The gradients of `outputs` with respect to `inputs` (`torch.autograd.grad`), without
/// touching any `.grad`. `grad_outputs[i]` may be `None` for one-element outputs; pass an
/// empty slice for all `None`.
///
/// Errors when an input does not require grad, or is unused and `allow_unused` is off.
pub fn grad(
    outputs: &[Tensor],
    inputs: &[Tensor],
    grad_outputs: &[Option<Tensor>],
    options: GradOptions,
) -> Result<Vec<Option<Tensor>>> {
    let go: Vec<Option<Tensor>> = if grad_outputs.is_empty() {
        vec![None; outputs.len()]
    } else {
        grad_outputs.to_vec()
    };
    let roots = root_grads(outputs, &go)?;
    let mut capture = Vec::with_capacity(inputs.len());
    for (i, t) in inputs.iter().enumerate() {
        capture.push(t.gradient_edge().ok_or_else(|| {
            Error::Autograd(format!("input {i} of autograd::grad does not require grad"))
        })?);
    }
    let res = run_backward(
        &roots,
        &capture,
        ExecuteOptions {
            retain_graph: options.retain_graph.unwrap_or(options.create_graph),
            create_graph: options.create_graph,
            leaf_sink: LeafSink::Discard,
        },
    )?;
    if !options.allow_unused
        && let Some(i) = res.captured.iter().position(|g| g.is_none())
    {
        return Err(Error::Autograd(format!(
            "input {i} of autograd::grad was not used in the graph; set allow_unused if \
                 this is intended"
        )));
    }
    Ok(res.captured)
}
