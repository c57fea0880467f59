//! The backward engine: runs a graph from root gradients to leaves.

use std::cell::RefCell;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use super::grad_mode::set_grad_enabled;
use super::graph::{Edge, GradientEdge, Node, NodeKind, TensorMeta};
use crate::{Error, Result, Tensor};

/// How a backward pass runs and where leaf gradients go.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExecuteOptions {
    /// Keep saved tensors so that the graph can be run again (`retain_graph`).
    pub retain_graph: bool,
    /// Record the backward computation itself, for higher-order gradients (`create_graph`).
    pub create_graph: bool,
    /// Where gradients that reach leaves go.
    pub leaf_sink: LeafSink,
}

/// Where the gradients that reach leaf tensors go.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LeafSink {
    /// Accumulate into each leaf's `.grad` (`Tensor::backward`).
    #[default]
    AccumulateGrad,
    /// Return them in [`BackwardResult::leaf_grads`] and leave `.grad` untouched
    /// (distributed autograd keeps gradients per context this way).
    Collect,
    /// Neither: only the captured edges matter (`autograd::grad`).
    Discard,
}

/// What [`run_backward`] returns.
#[derive(Debug, Default)]
pub struct BackwardResult {
    /// One entry per requested capture edge: the gradient that flowed into it, if any.
    pub captured: Vec<Option<Tensor>>,
    /// With [`LeafSink::Collect`]: each reached leaf and the sum of its gradients.
    pub leaf_grads: Vec<(Tensor, Tensor)>,
}

#[derive(PartialEq, Eq)]
struct Ready {
    seq: u64,
    /// How many nodes were queued before this one: among equal `seq` (the accumulate nodes)
    /// the earlier-queued runs first, so the order never depends on where nodes live in memory.
    pushed: u64,
    key: usize,
}
impl Ord for Ready {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        // accumulate nodes (seq u64::MAX) first, as soon as they are ready, as in PyTorch:
        // a leaf's `.grad` (and its post-accumulate hooks, which start data parallelism's
        // all-reduces) must not wait for the rest of the pass; then later-created nodes first
        // (reverse creation order); ties in queueing order (a node's edges in order), so every
        // rank of a data-parallel job starts its buckets in the same order
        self.seq
            .cmp(&o.seq)
            .then(o.pushed.cmp(&self.pushed))
            .then(self.key.cmp(&o.key))
    }
}
impl PartialOrd for Ready {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// A function queued with [`queue_callback`], run when the backward pass that queued it ends.
pub type Callback = Box<dyn FnOnce() -> Result<()> + Send>;

thread_local! {
    /// One frame per backward pass running on this thread (passes nest when a hook or a
    /// backward function starts another one): the callbacks queued during it.
    static CALLBACKS: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

/// One running pass: whether it accumulates into `.grad`, and its queued callbacks.
struct Frame {
    accumulates: bool,
    callbacks: Vec<Callback>,
}

/// Whether the backward pass running on this thread accumulates into leaves' `.grad` (a
/// `backward` call, not `autograd::grad` or distributed autograd); `false` outside a pass. A
/// tensor hook can tell from it whether the gradient it sees will reach `.grad`.
pub fn accumulating_pass() -> bool {
    CALLBACKS.with(|c| c.borrow().last().is_some_and(|f| f.accumulates))
}

/// Queues `f` to run once the backward pass that is running on this thread has run all of its
/// nodes (PyTorch's `Variable._execution_engine.queue_callback`): the end-of-backward hook
/// that data parallelism waits for its gradient all-reduces in. Callbacks run in the order
/// they were queued, on the thread of the pass, and may queue more; the first error a
/// callback returns becomes the result of the backward call (the remaining callbacks still
/// run, so that each can release what it holds). When the pass itself fails, its queued
/// callbacks are dropped without running.
///
/// Errors ([`Error::Autograd`]) when no backward pass is running on this thread: call it from
/// a tensor hook, a post-accumulate-grad hook or a custom function's backward.
pub fn queue_callback(f: impl FnOnce() -> Result<()> + Send + 'static) -> Result<()> {
    CALLBACKS.with(|c| {
        let mut c = c.borrow_mut();
        match c.last_mut() {
            Some(frame) => {
                frame.callbacks.push(Box::new(f));
                Ok(())
            }
            None => Err(Error::Autograd(
                "queue_callback called outside a backward pass: call it from a hook or a \
                 backward function"
                    .into(),
            )),
        }
    })
}

/// Pops this pass's callback frame when the pass ends, also on an early error return.
struct CallbackFrame;

impl CallbackFrame {
    fn push(accumulates: bool) -> CallbackFrame {
        CALLBACKS.with(|c| {
            c.borrow_mut().push(Frame {
                accumulates,
                callbacks: Vec::new(),
            })
        });
        CallbackFrame
    }

    /// Runs the queued callbacks (and those they queue) in order; the first error wins.
    fn run(&self) -> Result<()> {
        let mut first_err = None;
        loop {
            let batch = CALLBACKS.with(|c| {
                c.borrow_mut()
                    .last_mut()
                    .map(|f| std::mem::take(&mut f.callbacks))
                    .unwrap_or_default()
            });
            if batch.is_empty() {
                break;
            }
            for f in batch {
                if let Err(e) = f()
                    && first_err.is_none()
                {
                    first_err = Some(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for CallbackFrame {
    fn drop(&mut self) {
        // callbacks left unrun (the pass failed) are dropped outside the borrow: their `Drop`
        // may do anything, even start another backward pass
        let frame = CALLBACKS.with(|c| c.borrow_mut().pop());
        drop(frame);
    }
}

fn key(n: &Arc<Node>) -> usize {
    Arc::as_ptr(n) as usize
}

fn accumulate(slot: &mut Option<Tensor>, g: Tensor) -> Result<()> {
    *slot = Some(match slot.take() {
        None => g,
        Some(prev) => prev.add(&g)?,
    });
    Ok(())
}

/// The lower-level engine entry: runs backward from `roots` (each an edge with the gradient
/// that enters there) through every reachable node.
///
/// `capture` lists edges whose incoming gradient is returned in
/// [`BackwardResult::captured`]; when it is non-empty, only the nodes that lead to a captured
/// edge run (as `torch.autograd.grad` does). Leaf gradients go where `options.leaf_sink`
/// says. Distributed autograd starts passes from received gradients this way.
///
/// Errors: a backward function's error (prefixed with its node's name), gradients of the
/// wrong count or shape, a root gradient or a hook's gradient whose shape, dtype or device
/// differs from its tensor's, or backward through a freed graph.
pub fn run_backward(
    roots: &[(GradientEdge, Tensor)],
    capture: &[GradientEdge],
    options: ExecuteOptions,
) -> Result<BackwardResult> {
    run(roots, capture, options, None)
}

/// The part of a split backward's input half ([`super::split`]) left for its weight half:
/// root gradients whose nodes lead to no captured input, and nodes run for their
/// input-leading edges only, with their output gradients and the edges still to compute.
#[derive(Default)]
pub(crate) struct Deferred {
    pub(crate) roots: Vec<(GradientEdge, Tensor)>,
    pub(crate) nodes: Vec<(Arc<Node>, Vec<Tensor>, Vec<bool>)>,
}

/// [`run_backward`]; with `defer`, the input half of a split backward: only the edges that
/// lead to `capture` are computed (each function's `needs_input_grad` says so), and the rest
/// is recorded in `defer` (those nodes keep their saved tensors).
pub(crate) fn run(
    roots: &[(GradientEdge, Tensor)],
    capture: &[GradientEdge],
    options: ExecuteOptions,
    mut defer: Option<&mut Deferred>,
) -> Result<BackwardResult> {
    // gradients take their forward's dtypes: no autocast inside backward
    let _no_autocast = crate::amp::disabled_for_backward();
    // 1. discover reachable nodes and dependency counts
    let mut nodes: HashMap<usize, Arc<Node>> = HashMap::new();
    let mut deps: HashMap<usize, usize> = HashMap::new();
    let mut stack: Vec<Arc<Node>> = Vec::new();
    for (e, _) in roots {
        let k = key(&e.0.node);
        if nodes.insert(k, e.0.node.clone()).is_none() {
            stack.push(e.0.node.clone());
        }
    }
    while let Some(n) = stack.pop() {
        for e in n.next_edges.iter().flatten() {
            let k = key(&e.node);
            *deps.entry(k).or_insert(0) += 1;
            if nodes.insert(k, e.node.clone()).is_none() {
                stack.push(e.node.clone());
            }
        }
    }

    // 2. with captures, find the nodes that lead to a captured edge
    let needed: Option<HashMap<usize, bool>> = if capture.is_empty() && defer.is_none() {
        None
    } else {
        let targets: std::collections::HashSet<usize> =
            capture.iter().map(|e| key(&e.0.node)).collect();
        // topological order by Kahn, then reverse
        let mut d = deps.clone();
        let mut order = Vec::with_capacity(nodes.len());
        let mut q: Vec<usize> = nodes
            .keys()
            .filter(|k| d.get(k).copied().unwrap_or(0) == 0)
            .copied()
            .collect();
        while let Some(k) = q.pop() {
            order.push(k);
            for e in nodes[&k].next_edges.iter().flatten() {
                let c = key(&e.node);
                let v = d.get_mut(&c).expect("child counted");
                *v -= 1;
                if *v == 0 {
                    q.push(c);
                }
            }
        }
        let mut needed = HashMap::with_capacity(nodes.len());
        for k in order.iter().rev() {
            let n = &nodes[k];
            let v = targets.contains(k)
                || n.next_edges
                    .iter()
                    .flatten()
                    .any(|e| needed.get(&key(&e.node)).copied().unwrap_or(false));
            needed.insert(*k, v);
        }
        Some(needed)
    };

    // 3. execute
    let _mode = set_grad_enabled(options.create_graph);
    let callbacks =
        CallbackFrame::push(options.leaf_sink == LeafSink::AccumulateGrad && needed.is_none());
    let mut buffers: HashMap<usize, Vec<Option<Tensor>>> = HashMap::new();
    let leads = |n: &Arc<Node>| {
        needed
            .as_ref()
            .is_none_or(|m| m.get(&key(n)).copied().unwrap_or(false))
    };
    // split backward: roots that lead to no input wait for the weight half
    let roots: Vec<&(GradientEdge, Tensor)> = match defer.as_deref_mut() {
        None => roots.iter().collect(),
        Some(d) => {
            let (now, later): (Vec<_>, Vec<_>) = roots.iter().partition(|(e, _)| leads(&e.0.node));
            d.roots.extend(later.into_iter().cloned());
            now
        }
    };
    for (e, g) in roots.iter().copied() {
        let n = &e.0.node;
        if e.0.input_nr >= n.num_outputs() {
            return Err(Error::Autograd(format!(
                "root edge input {} out of range for {} with {} inputs",
                e.0.input_nr,
                n.name(),
                n.num_outputs()
            )));
        }
        check_grad_meta(&n.output_meta[e.0.input_nr], g, || {
            format!("root gradient for input {} of {}", e.0.input_nr, n.name())
        })?;
        let buf = buffers
            .entry(key(n))
            .or_insert_with(|| vec![None; n.num_outputs()]);
        accumulate(&mut buf[e.0.input_nr], g.clone())?;
    }
    let mut ready = BinaryHeap::new();
    let mut pushed = 0u64;
    // the roots, in the order given (the nodes without a parent in the graph)
    for (e, _) in roots.iter().copied() {
        let k = key(&e.0.node);
        if deps.get(&k).copied().unwrap_or(0) == 0 && !ready.iter().any(|r: &Ready| r.key == k) {
            ready.push(Ready {
                seq: e.0.node.seq,
                pushed,
                key: k,
            });
            pushed += 1;
        }
    }
    let mut result = BackwardResult {
        captured: vec![None; capture.len()],
        leaf_grads: vec![],
    };
    let mut leaf_index: HashMap<usize, usize> = HashMap::new();

    while let Some(Ready { key: k, .. }) = ready.pop() {
        let node = nodes[&k].clone();
        let mut grads = buffers
            .remove(&k)
            .unwrap_or_else(|| vec![None; node.num_outputs()]);
        // tensor hooks
        {
            let hooks = node
                .pre_hooks
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            for (nr, h) in hooks {
                if let Some(g) = grads.get(nr).and_then(|g| g.as_ref())
                    && let Some(new) = h(g)?
                {
                    check_grad_meta(&node.output_meta[nr], &new, || {
                        format!("gradient returned by a hook on {}", node.name())
                    })?;
                    grads[nr] = Some(new);
                }
            }
        }
        for (ci, c) in capture.iter().enumerate() {
            if key(&c.0.node) == k
                && let Some(g) = grads.get(c.0.input_nr).and_then(|g| g.clone())
            {
                accumulate(&mut result.captured[ci], g)?;
            }
        }
        // with captures, a node runs only when one of its inputs' nodes leads to a capture
        let is_needed = needed.as_ref().is_none_or(|m| {
            node.next_edges
                .iter()
                .flatten()
                .any(|e| m.get(&key(&e.node)).copied().unwrap_or(false))
        });
        let outputs: Vec<Option<Tensor>> = match &node.kind {
            NodeKind::AccumulateGrad { leaf } => {
                if let Some(g) = grads.into_iter().next().flatten() {
                    match options.leaf_sink {
                        LeafSink::AccumulateGrad if needed.is_none() => {
                            let g = if options.create_graph { g } else { g.detach() };
                            accumulate_into_leaf(leaf, g, options.create_graph)?;
                            run_post_accumulate_hooks(leaf)?;
                        }
                        LeafSink::Collect => match leaf_index.get(&k) {
                            Some(&i) => {
                                let s = result.leaf_grads[i].1.add(&g)?;
                                result.leaf_grads[i].1 = s;
                            }
                            None => {
                                leaf_index.insert(k, result.leaf_grads.len());
                                result.leaf_grads.push((leaf.clone(), g));
                            }
                        },
                        _ => {}
                    }
                }
                vec![]
            }
            NodeKind::Function { .. } if defer.is_some() && !grads.iter().any(Option::is_some) => {
                vec![None; node.next_edges.len()]
            }
            NodeKind::Function { func, ctx } if is_needed => {
                // split backward: the edges to compute now, and those left for the weight half
                let mask: Option<(Vec<bool>, Vec<bool>)> = defer.as_ref().map(|_| {
                    node.next_edges
                        .iter()
                        .map(|e| match e {
                            Some(e) => (leads(&e.node), !leads(&e.node)),
                            None => (false, false),
                        })
                        .unzip()
                });
                let mut full = Vec::with_capacity(grads.len());
                for (i, g) in grads.into_iter().enumerate() {
                    full.push(match g {
                        Some(g) => g,
                        None => node.output_meta[i].zeros()?,
                    });
                }
                let mut ctx = ctx.lock().unwrap_or_else(|e| e.into_inner());
                if ctx.released {
                    return Err(Error::Autograd(format!(
                        "trying to backward through the graph a second time (node {}); its \
                         saved values were freed by the first backward: pass \
                         retain_graph=true to it if you need to",
                        func.name()
                    )));
                }
                ctx.mask = mask.as_ref().map(|m| m.0.clone());
                let out = func
                    .backward(&ctx, &full)
                    .map_err(|e| backward_error(func.name(), e));
                ctx.mask = None;
                let mut out = out?;
                let later = mask.as_ref().is_some_and(|m| m.1.iter().any(|&b| b));
                if !options.retain_graph && !later {
                    // a node that saved nothing can run again (PyTorch's rule): a cast that
                    // autocast's cache shares between several forwards, each with its backward
                    ctx.released = !ctx.saved.is_empty() || !ctx.values.is_empty();
                    ctx.saved.clear();
                    ctx.values.clear();
                }
                drop(ctx);
                check_grads(&node, &out)?;
                if let (Some((now, rest)), Some(d)) = (mask, defer.as_deref_mut()) {
                    for (o, keep) in out.iter_mut().zip(&now) {
                        if !keep {
                            *o = None;
                        }
                    }
                    if rest.iter().any(|&b| b) {
                        d.nodes.push((node.clone(), full, rest));
                    }
                }
                out
            }
            NodeKind::Function { .. } => vec![None; node.next_edges.len()],
        };
        for (i, e) in node.next_edges.iter().enumerate() {
            let Some(Edge {
                node: child,
                input_nr,
            }) = e
            else {
                continue;
            };
            let ck = key(child);
            if let Some(Some(g)) = outputs.get(i) {
                let buf = buffers
                    .entry(ck)
                    .or_insert_with(|| vec![None; child.num_outputs()]);
                accumulate(&mut buf[*input_nr], g.clone())?;
            }
            let d = deps.get_mut(&ck).expect("child was counted");
            *d -= 1;
            if *d == 0 {
                ready.push(Ready {
                    seq: child.seq,
                    pushed,
                    key: ck,
                });
                pushed += 1;
            }
        }
    }
    callbacks.run()?;
    Ok(result)
}

/// A backward function's error, named after its node.
pub(crate) fn backward_error(name: &str, e: Error) -> Error {
    match e {
        Error::Autograd(m) => Error::Autograd(m),
        other => Error::Custom {
            context: format!("in backward of {name}"),
            message: other.to_string(),
        },
    }
}

/// Runs the leaf's post-accumulate-grad hooks (registration order) after its `.grad` was
/// updated. The list is copied first, so a hook may register or remove hooks.
fn run_post_accumulate_hooks(leaf: &Tensor) -> Result<()> {
    let hooks: Vec<_> = leaf
        .meta()
        .post_accumulate_hooks
        .iter()
        .map(|(_, h)| h.clone())
        .collect();
    for h in hooks {
        h(leaf)?;
    }
    Ok(())
}

/// Adds `g` to `leaf.grad` without holding the leaf's lock during the addition (which may
/// lock other tensors) and without losing a gradient that another thread's backward stored
/// meanwhile: the sum is stored only if `.grad` is still the tensor it was computed from,
/// and recomputed otherwise.
fn accumulate_into_leaf(leaf: &Tensor, g: Tensor, create_graph: bool) -> Result<()> {
    loop {
        let prev = leaf.meta().grad.clone();
        let new = match &prev {
            None => g.clone(),
            Some(p) => {
                let s = p.add(&g)?;
                if create_graph { s } else { s.detach() }
            }
        };
        let mut meta = leaf.meta();
        let unchanged = match (&meta.grad, &prev) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(&a.0, &b.0),
            _ => false,
        };
        if unchanged {
            meta.grad = Some(new);
            return Ok(());
        }
    }
}

/// Errors when a gradient entering a node (a root gradient, or one a hook returned) differs
/// in shape, dtype or device from the tensor it is the gradient of.
fn check_grad_meta(meta: &TensorMeta, g: &Tensor, what: impl FnOnce() -> String) -> Result<()> {
    if g.shape() != meta.shape.as_slice() || g.dtype() != meta.dtype || g.device() != meta.device {
        return Err(Error::Autograd(format!(
            "{}: got shape {:?}, dtype {}, device {}; expected shape {:?}, dtype {}, device {}",
            what(),
            g.shape(),
            g.dtype(),
            g.device(),
            meta.shape,
            meta.dtype,
            meta.device
        )));
    }
    Ok(())
}

pub(crate) fn check_grads(node: &Node, out: &[Option<Tensor>]) -> Result<()> {
    if out.len() != node.next_edges.len() {
        return Err(Error::Autograd(format!(
            "function {} returned {} gradients, but it has {} inputs",
            node.name(),
            out.len(),
            node.next_edges.len()
        )));
    }
    for (i, (g, m)) in out.iter().zip(&node.input_meta).enumerate() {
        if let (Some(g), Some(_)) = (g, &node.next_edges[i]) {
            if g.shape() != m.shape.as_slice() {
                return Err(Error::Autograd(format!(
                    "function {} returned an invalid gradient at index {i}: got shape {:?} \
                     but expected shape {:?}",
                    node.name(),
                    g.shape(),
                    m.shape
                )));
            }
            if g.dtype() != m.dtype {
                return Err(Error::Autograd(format!(
                    "function {} returned a gradient of dtype {} at index {i}; expected {}",
                    node.name(),
                    g.dtype(),
                    m.dtype
                )));
            }
        }
    }
    Ok(())
}
