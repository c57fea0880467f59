//! Distributed autograd (`torch.distributed.autograd`): a forward pass that crosses workers
//! through RPC, and a backward pass that follows it back.
//!
//! # Contexts
//! [`context`] opens a context on this thread (a guard; its id is `worker_id << 48 | counter`,
//! as in PyTorch). While it is open, every RPC this thread makes ([`rpc_sync`](crate::rpc_sync),
//! [`rpc_async`](crate::rpc_async), [`remote`](crate::remote), [`RRef::to_here`], proxies)
//! carries the context id and a message id; the callee opens the same context on demand and
//! makes it current while the function runs, so nested RPCs carry it on. Dropping the guard
//! releases the context here and sends a cleanup to every worker it reached, which forward it
//! to the workers they reached.
//!
//! # Recording
//! When a tensor that requires grad crosses an RPC inside a context (an argument or a result),
//! the sender keeps it under the message id (a *send function*) and the receiver makes the
//! received copy the output of a `RecvRpcBackward` node keyed by the same message id, as
//! PyTorch's FAST mode does.
//!
//! # Backward
//! [`backward`] runs the local engine from the roots. Gradients reaching leaves are added to the
//! context (never to `.grad`; read them with [`get_gradients`]). When the engine reaches a
//! `RecvRpcBackward` node it sends the gradient to the worker that sent the tensor, which runs
//! its engine from that send function (and so on), and waits for that to finish; so `backward`
//! returns once the whole distributed pass is done. Differences from PyTorch, on purpose:
//! - a send function whose output the loss does not use never gets a gradient and is simply
//!   never run: `backward` returns (PyTorch waits for it forever);
//! - every participant of a failing pass returns [`Error::Autograd`] naming the worker where
//!   the failure happened (`Error on worker <name>: …`); calls carry the RPC timeout, so no
//!   participant waits forever;
//! - a worker runs one engine pass per gradient message it receives (PyTorch merges them into
//!   one pass): gradients are the same sums, but a tensor hook on a tensor reached by two
//!   messages runs once per message with that message's part.
//!
//! Saved tensors are kept until the context is released, so the graph can be run again;
//! `retain_graph = false` makes a second `backward` in the same context an error, as in
//! PyTorch.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tensorplay_core::autograd::{ExecuteOptions, Function, LeafSink, run_backward};
use tensorplay_core::{DType, Tensor, TensorId};

use crate::agent::agent;
pub use crate::proto::context::ContextId;
use crate::proto::context::ContextTable;
use crate::proto::message::AutogradHeader;
use crate::{Error, RRef, Result};

/// The registered name of the gradient message.
pub(crate) const PROPAGATE: &str = "tensorplay::dist_autograd::propagate";
/// The registered name of the cleanup message.
pub(crate) const CLEANUP: &str = "tensorplay::dist_autograd::cleanup";
/// The registered method running a backward pass rooted at an RRef's value on its owner.
pub(crate) const RREF_BACKWARD: &str = "tensorplay::dist_autograd::rref_backward";

/// One context on this worker.
#[derive(Default)]
pub(crate) struct Ctx {
    /// Send functions by message id: the tensors that required grad, in message order.
    sends: HashMap<u64, Vec<Tensor>>,
    /// Number of recv functions recorded.
    recvs: usize,
    /// Gradients accumulated here, by leaf.
    grads: HashMap<TensorId, (Tensor, Tensor)>,
    /// A backward without `retain_graph` ran.
    consumed: bool,
    /// The first failure of a remote part of the running pass.
    failure: Option<Error>,
}

/// The shell's data of one context (the table in [`crate::proto::context`] holds the rest).
pub(crate) type Shared = Arc<Mutex<Ctx>>;

/// This worker's context table (the agent's).
pub(crate) type Contexts = Mutex<ContextTable<Shared>>;

static PASSES: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static CURRENT: Cell<Option<ContextId>> = const { Cell::new(None) };
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn not_found(id: ContextId) -> Error {
    Error::invalid(
        "distributed autograd",
        "context_id",
        "the id of a context open on this worker",
        format!("{id}: could not find autograd context with id {id}"),
    )
}

fn get(id: ContextId) -> Result<Shared> {
    agent("dist_autograd")
        .ok()
        .and_then(|a| lock(&a.contexts).get(id))
        .ok_or_else(|| not_found(id))
}

/// How long a worker remembers a context it released, so that a request sent inside it and
/// overtaken by its cleanup does not reopen it: past any RPC timeout.
pub(crate) fn released_horizon(rpc_timeout: std::time::Duration) -> std::time::Duration {
    if rpc_timeout.is_zero() {
        std::time::Duration::from_secs(24 * 3600)
    } else {
        rpc_timeout
            .saturating_mul(2)
            .max(std::time::Duration::from_secs(60))
    }
}

/// An open distributed autograd context, current on the thread that opened it until dropped
/// (`with dist_autograd.context() as context_id`).
#[derive(Debug)]
pub struct ContextGuard {
    id: ContextId,
}

impl ContextGuard {
    /// The context id (pass it to [`backward`], [`get_gradients`] and
    /// [`DistributedOptimizer::step`](crate::DistributedOptimizer::step)).
    pub fn id(&self) -> ContextId {
        self.id
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        CURRENT.with(|c| {
            if c.get() == Some(self.id) {
                c.set(None);
            }
        });
        release(self.id);
    }
}

/// Opens a new context and makes it this thread's current one (`dist_autograd.context()`).
///
/// # Errors
/// [`Error::NotInitialized`]; [`Error::InvalidArgument`] when this thread already has a
/// current context (contexts do not nest, as in PyTorch).
pub fn context() -> Result<ContextGuard> {
    let a = agent("dist_autograd::context")?;
    if let Some(cur) = current_context() {
        return Err(Error::invalid(
            "dist_autograd::context",
            "context",
            "no open context on this thread (contexts do not nest)",
            format!("context {cur} is already open on this thread"),
        ));
    }
    let (id, _) = lock(&a.contexts).create();
    CURRENT.with(|c| c.set(Some(id)));
    Ok(ContextGuard { id })
}

/// This thread's current context, if any. A context released meanwhile (its guard dropped on
/// another thread, or a cleanup that reached a callee while its function ran) is not current.
pub fn current_context() -> Option<ContextId> {
    CURRENT.with(Cell::get).filter(|&id| is_valid_context(id))
}

/// Whether context `id` is open on this worker.
pub fn is_valid_context(id: ContextId) -> bool {
    agent("dist_autograd").is_ok_and(|a| lock(&a.contexts).get(id).is_some())
}

/// Runs `f` with `ctx` as this thread's current context (the callee side of an RPC).
pub(crate) fn with_context<R>(ctx: Option<ContextId>, f: impl FnOnce() -> R) -> R {
    let Some(ctx) = ctx else {
        return f();
    };
    struct Restore(Option<ContextId>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CURRENT.with(|c| c.replace(Some(ctx))));
    f()
}

/// Releases `id` here and, in the background, on every worker it reached.
fn release(id: ContextId) {
    let Ok(a) = agent("dist_autograd cleanup") else {
        return;
    };
    let cleanups = lock(&a.contexts).release(id, std::time::Instant::now());
    for c in cleanups {
        // best effort: a worker that is gone has nothing left to clean
        let _ = crate::rpc_async::<ContextId, ()>(c.to, CLEANUP, c.context, None);
    }
}

/// What crossing counts of a context say about its graph (`_retrieve_context`), for tests and
/// debugging.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContextInfo {
    /// Send functions recorded here (messages that carried tensors requiring grad).
    pub num_sends: usize,
    /// Recv functions recorded here.
    pub num_recvs: usize,
    /// Ranks of the workers this context was sent to, ascending.
    pub known_workers: Vec<usize>,
}

/// The send/recv counts and known workers of context `id` on this worker.
///
/// # Errors
/// [`Error::InvalidArgument`] when `id` is not open here.
pub fn context_info(id: ContextId) -> Result<ContextInfo> {
    let c = get(id)?;
    let known = agent("dist_autograd")
        .map(|a| lock(&a.contexts).known(id))
        .unwrap_or_default();
    let c = lock(&c);
    Ok(ContextInfo {
        num_sends: c.sends.len(),
        num_recvs: c.recvs,
        known_workers: known,
    })
}

/// Counts of this worker's distributed autograd state (`_get_debug_info`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DebugInfo {
    /// Contexts open on this worker.
    pub num_autograd_contexts: usize,
    /// Engine passes running on this worker.
    pub num_current_backward_passes: usize,
}

/// This worker's [`DebugInfo`].
pub fn debug_info() -> DebugInfo {
    DebugInfo {
        num_autograd_contexts: agent("dist_autograd").map_or(0, |a| lock(&a.contexts).len()),
        num_current_backward_passes: PASSES.load(Ordering::Relaxed) as usize,
    }
}

/// The gradients a context accumulated on this worker (`get_gradients`): one entry per leaf
/// tensor reached here, keyed by tensor identity.
#[derive(Debug, Clone, Default)]
pub struct Gradients {
    entries: HashMap<TensorId, (Tensor, Tensor)>,
}

impl Gradients {
    /// The gradient of `t` (the same tensor handle, or a clone of it), if one reached it.
    pub fn get(&self, t: &Tensor) -> Option<&Tensor> {
        self.entries.get(&t.id()).map(|(_, g)| g)
    }
    /// The number of tensors with a gradient.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// Whether no gradient reached this worker.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// Every (tensor, gradient) pair, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&Tensor, &Tensor)> {
        self.entries.values().map(|(t, g)| (t, g))
    }
}

/// The gradients context `id` accumulated on this worker (`get_gradients`).
///
/// # Errors
/// [`Error::InvalidArgument`] when `id` is not open here.
pub fn get_gradients(id: ContextId) -> Result<Gradients> {
    let c = get(id)?;
    let c = lock(&c);
    Ok(Gradients {
        entries: c.grads.clone(),
    })
}

// ---------------------------------------------------------------------------------------------
// recording

/// The autograd header of a request from this thread to `to` (its current context, if any).
pub(crate) fn request_header(tensors: &[Tensor], me: usize, to: usize) -> Option<AutogradHeader> {
    outgoing(current_context(), tensors, me, to)
}

/// The autograd header of a message to `to` carrying `tensors` within `ctx` (`None` outside a
/// context): the context, a new message id, and the indices of the tensors that require
/// grad. Records the send function and the known worker.
pub(crate) fn outgoing(
    ctx: Option<ContextId>,
    tensors: &[Tensor],
    _me: usize,
    to: usize,
) -> Option<AutogradHeader> {
    // a context released meanwhile records nothing and is not sent on: recreating it here
    // would leave it on this worker (and on `to`) for good
    let id = ctx?;
    let a = agent("dist_autograd").ok()?;
    let (c, msg) = {
        let mut table = lock(&a.contexts);
        let c = table.sent(id, to)?;
        (c, table.message_id())
    };
    let grad = tensorplay_core::autograd::is_grad_enabled();
    let mut requires_grad = Vec::new();
    let sent: Vec<Tensor> = tensors
        .iter()
        .enumerate()
        .filter(|(_, t)| grad && t.requires_grad())
        .map(|(i, t)| {
            requires_grad.push(i as u32);
            t.clone()
        })
        .collect();
    if !sent.is_empty() {
        lock(&c).sends.insert(msg, sent);
    }
    Some(AutogradHeader {
        context: id,
        message: msg,
        requires_grad,
    })
}

/// The receiving side of [`outgoing`]: opens the context (a `request` for a context another
/// worker created), and makes the tensors that required grad on the sender outputs of a
/// `RecvRpcBackward` node. Returns the context id.
///
/// A response, a request for a context this worker created, or a request overtaken by its
/// context's cleanup (see [`crate::proto::context`]) finds the context closed: its tensors
/// are not recorded and the context is not reopened (nothing would ever release it again).
pub(crate) fn incoming(
    header: Option<&AutogradHeader>,
    from: usize,
    mut tensors: Vec<Tensor>,
    request: bool,
) -> Result<(Option<ContextId>, Vec<Tensor>)> {
    let Some(&AutogradHeader {
        context: id,
        message: msg,
        requires_grad: ref idx,
    }) = header
    else {
        return Ok((None, tensors));
    };
    // a malformed header is an error whether or not its context is open here
    if let Some(&i) = idx.iter().find(|&&i| i as usize >= tensors.len()) {
        return Err(Error::Serialization(format!(
            "autograd header names tensor index {i} of a message with {} tensors",
            tensors.len()
        )));
    }
    if idx.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::Serialization(format!(
            "autograd header names tensor indices {idx:?}, not in ascending order"
        )));
    }
    let opened = agent("dist_autograd")
        .ok()
        .and_then(|a| lock(&a.contexts).received(id, request, std::time::Instant::now()));
    let Some(c) = opened else {
        return Ok((None, tensors));
    };
    if idx.is_empty() {
        return Ok((Some(id), tensors));
    }
    let picked: Vec<usize> = idx.iter().map(|&i| i as usize).collect();
    let recv = RecvRpcBackward {
        ctx: id,
        msg,
        from,
        tensors: Mutex::new(Some(picked.iter().map(|&i| tensors[i].clone()).collect())),
    };
    // the node needs an input that requires grad to be recorded; no gradient flows to it
    let anchor =
        Tensor::zeros(&[1], (DType::F32, tensorplay_core::Device::Cpu))?.requires_grad_(true);
    let outs = {
        let _g = tensorplay_core::set_grad_enabled(true);
        tensorplay_core::autograd::apply(recv, &[&anchor])?
    };
    for (&i, t) in picked.iter().zip(outs) {
        tensors[i] = t;
    }
    lock(&c).recvs += 1;
    Ok((Some(id), tensors))
}

/// The node that makes received tensors part of the graph: its backward sends their
/// gradients to the worker they came from and waits for that worker's part of the pass.
struct RecvRpcBackward {
    ctx: ContextId,
    msg: u64,
    from: usize,
    tensors: Mutex<Option<Vec<Tensor>>>,
}

impl Function for RecvRpcBackward {
    fn name(&self) -> &str {
        "RecvRpcBackward"
    }

    fn forward(
        &self,
        _ctx: &mut tensorplay_core::autograd::Context,
        _inputs: &[&Tensor],
    ) -> tensorplay_core::Result<Vec<Tensor>> {
        Ok(lock(&self.tensors).take().unwrap_or_default())
    }

    fn backward(
        &self,
        _ctx: &tensorplay_core::autograd::Context,
        grads: &[Tensor],
    ) -> tensorplay_core::Result<Vec<Option<Tensor>>> {
        // the engine runs on the thread of the pass, with the pass's context current
        let pass = CURRENT.with(Cell::get);
        if pass != Some(self.ctx) {
            let pass = pass.map_or_else(|| "no context".to_string(), |p| format!("context {p}"));
            return Err(tensorplay_core::Error::Autograd(format!(
                "a tensor received in distributed autograd context {} is used in a backward pass of {pass}; its gradient can only flow in context {} (run dist_autograd::backward there, or send the tensor again in this context)",
                self.ctx, self.ctx
            )));
        }
        let r = crate::rpc_sync::<(ContextId, u64, Vec<Tensor>), ()>(
            self.from,
            PROPAGATE,
            (self.ctx, self.msg, grads.to_vec()),
            None,
        );
        match r {
            Ok(()) => Ok(vec![None]),
            Err(e) => {
                let e = as_autograd_error(e, self.from);
                if let Ok(c) = get(self.ctx) {
                    lock(&c).failure.get_or_insert_with(|| e.clone());
                }
                Err(e.into())
            }
        }
    }
}

/// The error of a remote part of a pass, naming the worker where it happened.
fn as_autograd_error(e: Error, from: usize) -> Error {
    match e {
        Error::Remote {
            worker,
            kind,
            message,
        } => Error::Autograd {
            worker,
            message: if kind == "Autograd" {
                message
            } else {
                format!("{kind}: {message}")
            },
        },
        e @ Error::Autograd { .. } => e,
        other => Error::Autograd {
            worker: agent("dist_autograd")
                .ok()
                .and_then(|a| a.workers.get(from).map(|w| w.name.clone()))
                .unwrap_or_else(|| format!("rank {from}")),
            message: other.to_string(),
        },
    }
}

// ---------------------------------------------------------------------------------------------
// backward

/// Runs this worker's engine from `roots` within context `id`, adding leaf gradients to it.
fn run_pass(id: ContextId, c: &Shared, roots: Vec<(Tensor, Tensor)>) -> Result<()> {
    let me = agent("dist_autograd::backward")?.me.name.clone();
    let mut edges = Vec::with_capacity(roots.len());
    for (t, g) in roots {
        let e = t.gradient_edge().ok_or_else(|| {
            Error::invalid(
                "dist_autograd::backward",
                "roots",
                "tensors that require grad",
                "a tensor that does not require grad",
            )
        })?;
        edges.push((e, g));
    }
    PASSES.fetch_add(1, Ordering::Relaxed);
    let r = with_context(Some(id), || {
        run_backward(
            &edges,
            &[],
            ExecuteOptions {
                retain_graph: true,
                create_graph: false,
                leaf_sink: LeafSink::Collect,
            },
        )
    });
    PASSES.fetch_sub(1, Ordering::Relaxed);
    match r {
        Ok(res) => {
            let mut c = lock(c);
            for (t, g) in res.leaf_grads {
                match c.grads.get_mut(&t.id()) {
                    Some((_, acc)) => *acc = acc.add(&g)?,
                    None => {
                        c.grads.insert(t.id(), (t, g));
                    }
                }
            }
            Ok(())
        }
        Err(e) => Err(lock(c).failure.take().unwrap_or(Error::Autograd {
            worker: me,
            message: e.to_string(),
        })),
    }
}

/// Runs the distributed backward pass of context `context_id` from `roots`
/// (`dist_autograd.backward`): each root must be a one-element tensor computed on this worker
/// (with a `grad_fn`) and gets gradient 1. Blocks until every worker the pass reaches has
/// finished. Gradients go to the context ([`get_gradients`] on each worker), never to `.grad`;
/// repeated calls with `retain_graph` add up.
///
/// # Errors
/// [`Error::InvalidArgument`] for an unknown context, no roots, or a root that does not
/// require grad, is a leaf or has more than one element, and for a second backward after one
/// without `retain_graph`; [`Error::Autograd`] naming the worker where the pass failed.
pub fn backward(context_id: ContextId, roots: &[Tensor], retain_graph: bool) -> Result<()> {
    const OP: &str = "dist_autograd::backward";
    let c = get(context_id)?;
    if roots.is_empty() {
        return Err(Error::invalid(
            OP,
            "roots",
            "at least one tensor",
            "no tensors provided for gradient computation",
        ));
    }
    for (i, r) in roots.iter().enumerate() {
        let bad = if !r.requires_grad() {
            Some("a tensor that does not require grad")
        } else if r.grad_fn().is_none() {
            Some("a leaf tensor (it has no grad_fn)")
        } else if r.numel() != 1 {
            Some("a tensor with more than one element")
        } else {
            None
        };
        if let Some(bad) = bad {
            return Err(Error::invalid(
                OP,
                format!("roots[{i}]"),
                "a one-element tensor computed with autograd",
                bad,
            ));
        }
    }
    {
        let mut g = lock(&c);
        if g.consumed {
            return Err(Error::invalid(
                OP,
                "retain_graph",
                "retain_graph=true on the earlier backward of this context",
                "a second backward through a graph already released",
            ));
        }
        g.failure = None;
    }
    let seeds = roots
        .iter()
        .map(|r| Ok((r.clone(), Tensor::ones(r.shape(), (r.dtype(), r.device()))?)))
        .collect::<Result<Vec<_>>>()?;
    let r = run_pass(context_id, &c, seeds);
    if r.is_ok() && !retain_graph {
        lock(&c).consumed = true;
    }
    r
}

/// Serves a gradient message: runs the engine from send function `msg` of context `ctx`.
fn propagate(ctx: ContextId, msg: u64, grads: Vec<Tensor>) -> Result<()> {
    let c = get(ctx)?;
    let sent = lock(&c).sends.get(&msg).cloned().ok_or_else(|| {
        Error::invalid(
            "dist_autograd propagate",
            "message_id",
            "a send function of this context",
            msg,
        )
    })?;
    if sent.len() != grads.len() {
        return Err(Error::invalid(
            "dist_autograd propagate",
            "grads",
            format!("{} gradients", sent.len()),
            grads.len(),
        ));
    }
    run_pass(ctx, &c, sent.into_iter().zip(grads).collect())
}

/// Registers the messages distributed autograd exchanges (at `init_rpc`).
pub(crate) fn register_builtins() {
    crate::register(
        PROPAGATE,
        |(ctx, msg, grads): (ContextId, u64, Vec<Tensor>)| {
            propagate(ctx, msg, grads).map_err(tensorplay_core::Error::from)
        },
    );
    crate::register(CLEANUP, |ctx: ContextId| {
        release(ctx);
        Ok(())
    });
    crate::register_method(
        RREF_BACKWARD,
        |v: &Tensor, (ctx, retain): (ContextId, bool)| {
            backward(ctx, std::slice::from_ref(v), retain).map_err(tensorplay_core::Error::from)
        },
    );
}

impl RRef<Tensor> {
    /// Runs backward from the scalar tensor this RRef holds (`RRef.backward`). With a context
    /// id: the distributed pass of that context, rooted on the owner (a user RRef asks the
    /// owner to run it). Without one (owner only): a plain local `backward()` into `.grad`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a user RRef without a context id; otherwise as
    /// [`backward`] (on the owner) or [`Tensor::backward`].
    pub fn backward(&self, context_id: Option<ContextId>, retain_graph: bool) -> Result<()> {
        match context_id {
            None if self.is_owner() => Ok(self.local_value()?.backward()?),
            None => Err(Error::invalid(
                "RRef::backward",
                "context_id",
                "a distributed autograd context id for a user RRef",
                "None",
            )),
            Some(id) if self.is_owner() => {
                backward(id, std::slice::from_ref(&self.local_value()?), retain_graph)
            }
            Some(id) => {
                self.rpc_sync::<(ContextId, bool), ()>(RREF_BACKWARD, (id, retain_graph), None)
            }
        }
    }
}
