//! Split backward (zero-bubble pipelines): the input gradients of a piece of a model first
//! (`B`, [`backward_input`]), its weight gradients later ([`WeightGrads::run`], `W`).
//!
//! The input half runs only the graph's edges that lead to the given inputs: each function
//! is called with `needs_input_grad` false for its other inputs, so a linear layer computes
//! `dx = dy W` and not `dW = dy^T x`. Every edge it skips is kept — the node, its output
//! gradients, and the node's saved tensors — and the weight half runs those edges and
//! everything below them, accumulating into the leaves' `.grad` (with their
//! post-accumulate hooks) as `backward` would have. The two halves' sum is `backward`'s.

use std::sync::Arc;

use super::engine::{self, Deferred, ExecuteOptions, LeafSink};
use super::graph::{GradientEdge, Node, NodeKind};
use crate::{Error, Result, Tensor};

/// The weight half of a split backward, returned by [`backward_input`]: run it once with
/// [`WeightGrads::run`]. Until then it holds the output gradients and saved tensors the
/// weight gradients need; dropping it unrun frees them and leaves `.grad` without those
/// contributions.
#[must_use = "the weight gradients are computed only when run() is called"]
pub struct WeightGrads {
    deferred: Deferred,
}

impl std::fmt::Debug for WeightGrads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "WeightGrads({} nodes, {} roots)",
            self.deferred.nodes.len(),
            self.deferred.roots.len()
        )
    }
}

/// The input half of `backward(outputs, grad_outputs)`: returns the gradients of `inputs`
/// (as `autograd::grad` would, `None` for an input the outputs do not depend on) and the
/// [`WeightGrads`] that later accumulate everything else into the leaves' `.grad`. No leaf's
/// `.grad` changes here. `grad_outputs[i]` may be `None` for a one-element output; `inputs`
/// may be empty (a first stage whose input is token ids: everything is left for the weight
/// half). The graph is freed as it is used (no `retain_graph`).
///
/// # Errors
/// As `autograd::grad`: an output that does not require grad, a gradient of the wrong shape,
/// dtype or device, an input that does not require grad, a backward function's error.
pub fn backward_input(
    outputs: &[Tensor],
    grad_outputs: &[Option<Tensor>],
    inputs: &[Tensor],
) -> Result<(Vec<Option<Tensor>>, WeightGrads)> {
    let roots = super::root_grads(outputs, grad_outputs)?;
    let mut capture = Vec::with_capacity(inputs.len());
    for (i, t) in inputs.iter().enumerate() {
        capture.push(t.gradient_edge().ok_or_else(|| {
            Error::Autograd(format!("input {i} of backward_input does not require grad"))
        })?);
    }
    let mut deferred = Deferred::default();
    let res = engine::run(
        &roots,
        &capture,
        ExecuteOptions {
            retain_graph: false,
            create_graph: false,
            leaf_sink: LeafSink::Discard,
        },
        Some(&mut deferred),
    )?;
    Ok((res.captured, WeightGrads { deferred }))
}

impl WeightGrads {
    /// Computes the weight gradients left by [`backward_input`] and accumulates them into
    /// the leaves' `.grad`, running their post-accumulate hooks (so data parallelism's
    /// gradient reduction starts here).
    ///
    /// # Errors
    /// A backward function's error; the graph freed by another backward.
    pub fn run(self) -> Result<()> {
        let Deferred { mut roots, nodes } = self.deferred;
        for (node, grads, mask) in nodes {
            roots.extend(run_rest(&node, &grads, &mask)?);
        }
        if roots.is_empty() {
            return Ok(());
        }
        engine::run_backward(&roots, &[], ExecuteOptions::default())?;
        Ok(())
    }

    /// Whether nothing is left to compute (the outputs reach no weight).
    pub fn is_empty(&self) -> bool {
        self.deferred.nodes.is_empty() && self.deferred.roots.is_empty()
    }
}

/// Runs `node`'s backward for the edges in `mask` only and frees its saved tensors; returns
/// the gradients those edges carry on.
fn run_rest(
    node: &Arc<Node>,
    grads: &[Tensor],
    mask: &[bool],
) -> Result<Vec<(GradientEdge, Tensor)>> {
    let NodeKind::Function { func, ctx } = &node.kind else {
        return Ok(vec![]);
    };
    let mut ctx = ctx.lock().unwrap_or_else(|e| e.into_inner());
    if ctx.released {
        return Err(Error::Autograd(format!(
            "the weight half of a split backward found node {} already freed (another \
             backward ran through it)",
            func.name()
        )));
    }
    ctx.mask = Some(mask.to_vec());
    let out = func.backward(&ctx, grads);
    ctx.mask = None;
    ctx.released = !ctx.saved.is_empty() || !ctx.values.is_empty();
    ctx.saved.clear();
    ctx.values.clear();
    drop(ctx);
    let out = out.map_err(|e| engine::backward_error(func.name(), e))?;
    engine::check_grads(node, &out)?;
    let mut roots = Vec::new();
    for ((edge, g), &m) in node.next_edges.iter().zip(out).zip(mask) {
        if let (Some(e), Some(g), true) = (edge, g, m) {
            roots.push((GradientEdge(e.clone()), g));
        }
    }
    Ok(roots)
}
