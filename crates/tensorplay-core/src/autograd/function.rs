//! The public `Function` trait: custom differentiable operations.

use std::sync::{Arc, Mutex};

use super::grad_mode::{is_grad_enabled, set_grad_enabled};
use super::graph::{Context, Edge, Node, NodeKind, SavedTensor, TensorMeta};
use super::saved_hooks;
use crate::{Result, Tensor};

/// A differentiable operation, like a subclass of `torch.autograd.Function`.
///
/// `forward` runs with gradient recording off and may save tensors and values in the
/// [`Context`]; `backward` receives one gradient per output (zeros for outputs that did not
/// reach the loss) and returns one optional gradient per input, of the input's shape.
/// `backward` runs with recording on when the caller asked for `create_graph`, so a backward
/// written with differentiable tensor operations can itself be differentiated (double
/// backward). Every built-in operation of this crate is written against this trait, and so
/// are the distributed layers' collectives.
///
/// ```
/// use tensorplay::{self as tp, autograd::{Context, Function}, Tensor};
///
/// /// y = x^3, dy/dx = 3x^2.
/// struct Cube;
/// impl Function for Cube {
///     fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> tp::Result<Vec<Tensor>> {
///         ctx.save_for_backward(&[inputs[0]]);
///         Ok(vec![inputs[0].pow_scalar(3.0)?])
///     }
///     fn backward(&self, ctx: &Context, grads: &[Tensor]) -> tp::Result<Vec<Option<Tensor>>> {
///         let x = &ctx.saved_tensors()?[0];
///         Ok(vec![Some(grads[0].mul(&x.mul(x)?.mul_scalar(3.0)?)?)])
///     }
/// }
///
/// let x = Tensor::from_vec(vec![2.0f64], &[1])?.requires_grad_(true);
/// let y = tp::autograd::apply(Cube, &[&x])?.remove(0);
/// y.sum()?.backward()?;
/// assert_eq!(x.grad().unwrap().to_vec::<f64>()?, vec![12.0]);
/// # Ok::<(), tp::Error>(())
/// ```
pub trait Function: Send + Sync + 'static {
    /// A short name for error messages and `grad_fn` (defaults to the type's name).
    fn name(&self) -> &str {
        let full = std::any::type_name::<Self>();
        full.rsplit("::").next().unwrap_or(full)
    }

    /// Computes the outputs. Runs with gradient recording off.
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>>;

    /// Computes the input gradients from the output gradients (`grad_outputs[i]` has the
    /// shape of output `i`). Return `None` for inputs that need no gradient.
    fn backward(&self, ctx: &Context, grad_outputs: &[Tensor]) -> Result<Vec<Option<Tensor>>>;
}

/// Applies `f` to `inputs` and records it in the graph when an input requires grad
/// (`Function.apply`). Returns the outputs of `forward`, each carrying a `grad_fn` when
/// recorded.
pub fn apply<F: Function>(f: F, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let recording = is_grad_enabled();
    let needs: Vec<bool> = inputs
        .iter()
        .map(|t| recording && t.requires_grad())
        .collect();
    let any = needs.iter().any(|&b| b);
    let mut ctx = Context::new(needs);
    let raw = {
        let _g = set_grad_enabled(false);
        f.forward(&mut ctx, inputs)?
    };
    if !any {
        return Ok(raw);
    }
    let next_edges: Vec<Option<Edge>> = inputs
        .iter()
        .zip(&ctx.needs_input_grad)
        .map(|(t, &n)| if n { t.gradient_edge_internal() } else { None })
        .collect();
    let input_meta = inputs.iter().map(|t| TensorMeta::of(t)).collect();
    let output_meta = raw.iter().map(TensorMeta::of).collect();
    let pending = std::mem::take(&mut ctx.pending);
    let hooks = saved_hooks::current();
    let mut saved = Vec::with_capacity(pending.len());
    for t in pending {
        let version = t.version();
        let output_nr = raw.iter().position(|o| Arc::ptr_eq(&o.0, &t.0));
        saved.push(match (&hooks, output_nr) {
            (Some(h), output_nr) => SavedTensor::Packed {
                packed: h.pack(&t)?,
                hooks: h.clone(),
                output_nr,
                storage: Arc::downgrade(&t.0.storage),
                version,
            },
            (None, Some(output_nr)) => SavedTensor::Output {
                data: t,
                output_nr,
                version,
            },
            (None, None) => SavedTensor::Plain { tensor: t, version },
        });
    }
    ctx.saved = saved;
    let non_diff = std::mem::take(&mut ctx.non_differentiable);
    let node = Arc::new_cyclic(|weak| {
        ctx.node = weak.clone();
        Node {
            seq: Node::next_seq(),
            kind: NodeKind::Function {
                func: Box::new(f),
                ctx: Mutex::new(ctx),
            },
            next_edges,
            input_meta,
            output_meta,
            pre_hooks: Mutex::new(vec![]),
        }
    });
    Ok(raw
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let out = r.view_with_layout(r.layout().clone());
            let differentiable =
                r.dtype().is_float() && !non_diff.iter().any(|n| Arc::ptr_eq(&n.0, &r.0));
            if differentiable {
                out.meta().grad_fn = Some(Edge {
                    node: node.clone(),
                    input_nr: i,
                });
            }
            out
        })
        .collect())
}
