//! The state of one `fully_shard` group — its parameters' shards and unsharded tensors — and
//! the hooks that run its all-gather (`gather.rs`) and reduce-scatter (`reduce.rs`) around
//! forward and backward.
//!
//! Every parameter has two tensors. The **unsharded** one is the leaf the module holds and
//! computes with; its storage is freed ([`Tensor::resize_storage_`] to 0) while the group is
//! resharded and refilled by the all-gather. The **shard** is a leaf of the rank's rows
//! (see [`super::param`]); it is what `parameters()` lists, so the optimizer steps it and keeps
//! its state for it alone.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use tensorplay_collectives::{self as dist, ProcessGroup, Work};
use tensorplay_core::nn::AttachedState;
use tensorplay_core::{DType, Result, Tensor, TensorId};

use super::FsdpOptions;
use super::error::FsdpError;
use super::group::FlatLayout;
use super::policy::MixedPrecisionPolicy;

pub(super) const GATHER: &str = "the all-gather before forward or backward";
pub(super) const REDUCE: &str = "the reduce-scatter of the gradients";
/// Why a shard's `.grad` is incomplete while a reduce-scatter is left in flight.
pub(super) const PENDING: &str = "fully_shard's reduce-scatter left in flight by \
    set_is_last_backward(false): call set_is_last_backward(true) before the last \
    micro-batch's backward";
pub(super) const REPLICATE: &str = "the all-reduce of the gradient rows across the replicas (HSDP)";

/// One parameter of a group.
pub(crate) struct Managed {
    /// Its name under the module `fully_shard` was called on.
    pub(crate) name: String,
    /// The tensor the module holds (full shape; storage freed while resharded).
    pub(crate) full: Tensor,
    /// This rank's rows, a leaf: what the optimizer steps.
    pub(crate) shard: Tensor,
}

/// One event of a group's life (for tests of prefetching and overlap); each is recorded with
/// a number from one process-wide sequence, so events of different groups can be ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsdpEvent {
    /// The all-gather of the group's parameters was issued (by its own hook, or ahead of use
    /// by the hook of the group before it: prefetching).
    AllGather,
    /// The module's forward began (after its pre-forward hook).
    ForwardStart,
    /// The module's forward ended (its post-forward hook ran).
    ForwardEnd,
    /// The reduce-scatter of the group's gradients was issued.
    ReduceScatter,
    /// The end of backward finished the group (gradients in the shards' `.grad`).
    BackwardEnd,
    /// The unsharded parameters were freed.
    Reshard,
}

/// What changes from step to step.
pub(super) struct Runtime {
    /// The unsharded parameters hold the shards' values.
    pub(super) unsharded: bool,
    /// Gradients accumulated into unsharded parameters in the running backward.
    pub(super) ready: usize,
    /// The reduce-scatter in flight: its handle, output (this rank's block), input, and the
    /// shards' versions when it was issued.
    pub(super) reduce: Option<(Work, Tensor, Tensor, Vec<u64>)>,
    /// An all-gather issued ahead of use (prefetched): its handle, its output and the
    /// shards' versions when it was issued (a shard written since makes it stale).
    pub(super) pending: Option<(Work, Tensor, Vec<u64>)>,
    /// The root learnt the groups' forward order (its first forward ended).
    pub(super) order_learnt: bool,
    /// The end-of-backward callback is queued for the running backward.
    pub(super) callback_queued: bool,
    /// The shards' versions when the unsharded parameters were last filled (a shard written
    /// since, by an optimizer step, makes them stale).
    pub(super) gathered_versions: Vec<u64>,
    /// The shards' versions at the last forward (backward refuses to pair other weights with
    /// that forward's activations).
    pub(super) forward_versions: Vec<u64>,
    /// Parameters that take gradients now, and which have their gradient hook.
    pub(super) trainable: usize,
    pub(super) hooked: Vec<bool>,
    pub(super) reshard_after_forward: bool,
    pub(super) reshard_after_backward: bool,
    pub(super) requires_gradient_sync: bool,
    /// The end of backward waits for the reduce-scatter (false: it stays in flight).
    pub(super) is_last_backward: bool,
    pub(super) events: Vec<(u64, FsdpEvent)>,
}

/// The groups to prefetch, learnt from the first forward: the group whose forward comes
/// after this one's, and the group whose backward comes after this one's.
#[derive(Default)]
pub(super) struct Links {
    pub(super) next_forward: Option<Weak<FsdpState>>,
    pub(super) next_backward: Option<Weak<FsdpState>>,
    /// Set by `set_modules_to_forward_prefetch`: prefetched instead of `next_forward`.
    pub(super) explicit_forward: Option<Vec<Weak<FsdpState>>>,
    /// Set by `set_modules_to_backward_prefetch`: prefetched instead of `next_backward`.
    pub(super) explicit_backward: Option<Vec<Weak<FsdpState>>>,
}

/// The state of one `fully_shard` call, attached to its module.
pub(crate) struct FsdpState {
    /// The call's number on this rank (0 for the first `fully_shard`), for errors.
    pub(crate) index: usize,
    /// The ranks that share the shards (`rank` and `world` are this process's place in it).
    pub(crate) group: ProcessGroup,
    /// HSDP: the ranks that hold the same shards (a 2-D mesh's dimension 0); the reduced
    /// gradient rows are all-reduced across them.
    pub(crate) replicate: Option<ProcessGroup>,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    /// The dtype the parameters are gathered and computed in (`param_dtype`, or theirs).
    pub(crate) param_dtype: DType,
    /// The dtype the gradients are reduce-scattered in.
    pub(crate) reduce_dtype: DType,
    /// The casts of the forward's input and output.
    pub(crate) policy: MixedPrecisionPolicy,
    pub(crate) params: Vec<Managed>,
    pub(crate) layout: FlatLayout,
    /// A fully sharded module above this one was wrapped (this one is not a root).
    has_parent: AtomicBool,
    rt: Mutex<Runtime>,
    pub(super) links: Mutex<Links>,
    /// The module's path under the root, set when the root is sharded.
    path: Mutex<Option<String>>,
    /// The groups of fully sharded modules below this one (set when this one is sharded):
    /// the setters recurse into them, as PyTorch's `recurse=True`.
    below: Mutex<Vec<Weak<FsdpState>>>,
    me: Weak<FsdpState>,
}

/// The sequence numbers of [`FsdpEvent`]s.
static EVENT_SEQ: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The groups in the order of the root's first forward, while it runs.
    static RECORDING: RefCell<Option<Vec<Weak<FsdpState>>>> = const { RefCell::new(None) };
}

pub(super) fn record(rt: &mut Runtime, e: FsdpEvent) {
    rt.events
        .push((EVENT_SEQ.fetch_add(1, Ordering::Relaxed), e));
}

impl FsdpState {
    pub(crate) fn new(
        index: usize,
        (group, replicate): (ProcessGroup, Option<ProcessGroup>),
        (rank, world): (usize, usize),
        (param_dtype, reduce_dtype): (DType, DType),
        params: Vec<Managed>,
        options: &FsdpOptions,
        me: Weak<FsdpState>,
    ) -> FsdpState {
        let shapes: Vec<Vec<usize>> = params.iter().map(|p| p.full.shape().to_vec()).collect();
        let n = params.len();
        FsdpState {
            index,
            group,
            replicate,
            rank,
            world,
            param_dtype,
            reduce_dtype,
            policy: options.mp_policy,
            layout: FlatLayout::new(&shapes, world),
            params,
            has_parent: AtomicBool::new(false),
            rt: Mutex::new(Runtime {
                unsharded: false,
                ready: 0,
                reduce: None,
                pending: None,
                order_learnt: false,
                callback_queued: false,
                gathered_versions: Vec::new(),
                forward_versions: Vec::new(),
                trainable: 0,
                hooked: vec![false; n],
                reshard_after_forward: options.reshard_after_forward,
                reshard_after_backward: true,
                requires_gradient_sync: true,
                is_last_backward: true,
                events: Vec::new(),
            }),
            links: Mutex::new(Links::default()),
            path: Mutex::new(None),
            below: Mutex::new(Vec::new()),
            me,
        }
    }

    /// A weak handle on this state (it lives in an `Arc` made by `Arc::new_cyclic`).
    pub(crate) fn me(&self) -> Weak<FsdpState> {
        self.me.clone()
    }

    /// Records the groups of the fully sharded modules below this one.
    pub(crate) fn set_below(&self, below: Vec<Weak<FsdpState>>) {
        *self.below.lock().unwrap_or_else(PoisonError::into_inner) = below;
    }

    /// This group and every group below it.
    fn with_below(&self, f: &dyn Fn(&FsdpState)) {
        f(self);
        let below = self
            .below
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        for s in below.iter().filter_map(Weak::upgrade) {
            f(&s);
        }
    }

    /// Records the module's path under the root (for errors).
    pub(crate) fn set_path(&self, path: &str) {
        *self.path.lock().unwrap_or_else(PoisonError::into_inner) = Some(path.to_string());
    }

    /// The group, for errors: its module's path or its call's number, and its first
    /// parameter.
    pub(crate) fn label(&self) -> String {
        let path = self
            .path
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let at = match path.as_deref() {
            Some("") => "the root".to_string(),
            Some(p) => format!("{p:?}"),
            None => format!("of fully_shard call {}", self.index),
        };
        match self.params.first() {
            Some(p) => format!("{at} ({} parameters from {:?})", self.params.len(), p.name),
            None => at,
        }
    }

    /// The error of a failed collective of this group.
    pub(super) fn failed(
        &self,
        phase: &'static str,
    ) -> impl FnOnce(dist::Error) -> tensorplay_core::Error + '_ {
        move |source| {
            tensorplay_core::Error::external(FsdpError::Collective {
                rank: self.group.my_global_rank(),
                group: self.label(),
                phase,
                source,
            })
        }
    }

    pub(super) fn rt(&self) -> MutexGuard<'_, Runtime> {
        // the runtime is consistent between statements: a panic leaves nothing half-written
        self.rt.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether no fully sharded module above this one was wrapped (the root keeps its
    /// parameters from forward to backward and learns the groups' order).
    /// The device of the group's shards (the CPU for a group without parameters): where its
    /// collectives' buffers go, whatever the thread's default device.
    pub(super) fn device(&self) -> tensorplay_core::Device {
        self.params
            .first()
            .map_or(tensorplay_core::Device::Cpu, |p| p.shard.device())
    }

    pub(crate) fn is_root(&self) -> bool {
        !self.has_parent.load(Ordering::Relaxed)
    }

    /// Marks this group as below another fully sharded module.
    pub(crate) fn set_has_parent(&self) {
        self.has_parent.store(true, Ordering::Relaxed);
    }

    /// The pre-forward hook: recovers from a backward that failed half-way, follows changes
    /// of `requires_grad`, then gathers the parameters and prefetches the next group.
    pub(crate) fn pre_forward(self: &Arc<Self>) -> Result<()> {
        if self.device().is_meta() {
            return Err(tensorplay_core::Error::InvalidArgument {
                op: "fully_shard (forward)",
                arg: "module",
                expected: "parameters with memory: after building on the meta device, call \
                           Module::to_empty(device) and then reset_parameters() (or load a \
                           checkpoint)"
                    .into(),
                got: format!(
                    "rank {}: group {}: its shards are on the meta device",
                    self.group.my_global_rank(),
                    self.label()
                ),
            });
        }
        {
            let mut rt = self.rt();
            if rt.callback_queued {
                self.recover_failed_backward(&mut rt)?;
            }
            self.sync_trainable_locked(&mut rt)?;
            if self.is_root() && !rt.order_learnt {
                // named once, at the root's first forward
                self.set_path("");
                RECORDING.set(Some(Vec::new()));
            }
            RECORDING.with_borrow_mut(|r| {
                if let Some(order) = r
                    && !order
                        .iter()
                        .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(self)))
                {
                    order.push(Arc::downgrade(self));
                }
            });
            self.unshard_locked(&mut rt)?;
            rt.forward_versions = self.shard_versions();
            record(&mut rt, FsdpEvent::ForwardStart);
        }
        // the next group's all-gather runs while this one computes
        self.prefetch_next(false)
    }

    /// A forward starts while the last backward's end never came (the backward failed, and
    /// the engine dropped its end-of-backward callbacks): its reduce-scatter is waited for and
    /// dropped, its unsharded gradients too (unless gradients accumulate unsynced), and the
    /// parameters freed, so the next step starts clean.
    fn recover_failed_backward(&self, rt: &mut Runtime) -> Result<()> {
        rt.callback_queued = false;
        rt.ready = 0;
        if let Some((work, ..)) = rt.reduce.take() {
            for p in &self.params {
                p.shard.mark_grad_pending(None);
            }
            work.wait(None).map_err(self.failed(REDUCE))?;
        }
        if rt.requires_gradient_sync {
            for p in &self.params {
                p.full.set_grad(None);
            }
        }
        self.drop_pending(rt)?;
        self.reshard_locked(rt)
    }

    /// Makes the unsharded parameters take gradients as their shards do (a user may freeze or
    /// unfreeze `parameters()` after wrapping), with a gradient hook on each trainable one.
    fn sync_trainable_locked(self: &Arc<Self>, rt: &mut Runtime) -> Result<()> {
        let mut trainable = 0;
        for (i, p) in self.params.iter().enumerate() {
            let want = p.shard.requires_grad();
            if p.full.requires_grad() != want {
                p.full.set_requires_grad(want)?;
            }
            if want {
                trainable += 1;
                if !rt.hooked[i] {
                    let weak: Weak<FsdpState> = Arc::downgrade(self);
                    // the hook stays registered with its handle dropped
                    let _handle = p
                        .full
                        .register_post_accumulate_grad_hook(move |_| match weak.upgrade() {
                            Some(s) => s.grad_ready(i),
                            None => Ok(()),
                        })?;
                    rt.hooked[i] = true;
                }
            }
        }
        rt.trainable = trainable;
        Ok(())
    }

    /// [`FsdpState::sync_trainable_locked`] at wrap time.
    pub(crate) fn sync_trainable(self: &Arc<Self>) -> Result<()> {
        let mut rt = self.rt();
        self.sync_trainable_locked(&mut rt)
    }

    /// The post-forward hook: registers the pre-backward hook on the output when a backward
    /// may follow, and frees the parameters unless they are kept for backward (the root, or
    /// `reshard_after_forward = false`).
    pub(crate) fn post_forward(self: &Arc<Self>, output: &Tensor) -> Result<()> {
        let mut rt = self.rt();
        record(&mut rt, FsdpEvent::ForwardEnd);
        if self.is_root() && !rt.order_learnt {
            if let Some(order) = RECORDING.take() {
                Self::learn_order(order);
            }
            rt.order_learnt = true;
        }
        let backward_follows =
            tensorplay_core::autograd::is_grad_enabled() && output.requires_grad();
        if backward_follows {
            let weak = Arc::downgrade(self);
            output.register_hook(move |_| {
                if let Some(s) = weak.upgrade() {
                    s.pre_backward()?;
                }
                Ok(None)
            })?;
        }
        let keep = backward_follows && (self.is_root() || !rt.reshard_after_forward);
        if !keep {
            self.reshard_locked(&mut rt)?;
        }
        Ok(())
    }

    /// The pre-backward hook (the gradient of the module's output arrived): gathers the
    /// parameters again if they were freed, and queues the end-of-backward work.
    fn pre_backward(self: &Arc<Self>) -> Result<()> {
        {
            let mut rt = self.rt();
            if rt.forward_versions != self.shard_versions() {
                let name = self.params.first().map_or("", |p| p.name.as_str());
                return Err(tensorplay_core::Error::Autograd(format!(
                    "fully_shard on rank {}: group {}: the shards (such as {name:?}) were \
                     written between the module's forward and its backward (an optimizer step \
                     before backward?): backward would pair the new weights with the old \
                     activations; step after backward",
                    self.group.my_global_rank(),
                    self.label()
                )));
            }
            self.queue_end_locked(&mut rt)?;
            self.unshard_locked(&mut rt)?;
        }
        // the group backward reaches next is gathered while this one computes
        self.prefetch_next(true)
    }

    fn queue_end_locked(self: &Arc<Self>, rt: &mut Runtime) -> Result<()> {
        if rt.callback_queued {
            return Ok(());
        }
        let weak = Arc::downgrade(self);
        tensorplay_core::autograd::queue_callback(move || match weak.upgrade() {
            Some(s) => s.end_backward(),
            None => Ok(()),
        })?;
        rt.callback_queued = true;
        Ok(())
    }

    /// The post-accumulate-grad hook of parameter `i`: once every trainable parameter of the
    /// group has its gradient, their reduce-scatter starts while backward goes on.
    pub(crate) fn grad_ready(self: &Arc<Self>, _i: usize) -> Result<()> {
        let mut rt = self.rt();
        self.queue_end_locked(&mut rt)?;
        if !rt.requires_gradient_sync {
            return Ok(());
        }
        rt.ready += 1;
        if rt.ready >= rt.trainable {
            self.start_reduce_locked(&mut rt)?;
        }
        Ok(())
    }

    /// The end of backward: a reduce-scatter whose gradients did not all arrive goes out now,
    /// the reduce-scatter is waited for, its averaged block lands in the shards' `.grad`
    /// (added to what is there), and the parameters are freed.
    fn end_backward(self: &Arc<Self>) -> Result<()> {
        let mut rt = self.rt();
        rt.callback_queued = false;
        if rt.requires_gradient_sync && rt.ready > 0 {
            self.start_reduce_locked(&mut rt)?;
        }
        if rt.is_last_backward {
            self.finish_reduce_locked(&mut rt)?;
        } else if rt.reduce.is_some() {
            // left in flight: an optimizer step before it lands must not skip these shards
            for p in self.params.iter().filter(|p| p.shard.requires_grad()) {
                p.shard.mark_grad_pending(Some(PENDING));
            }
        }
        self.drop_pending(&mut rt)?;
        record(&mut rt, FsdpEvent::BackwardEnd);
        if rt.reshard_after_backward {
            self.reshard_locked(&mut rt)?;
        }
        Ok(())
    }

    pub(crate) fn set_reshard_after_forward(&self, v: bool) {
        self.with_below(&|s| s.rt().reshard_after_forward = v);
    }
    pub(crate) fn set_reshard_after_backward(&self, v: bool) {
        self.with_below(&|s| s.rt().reshard_after_backward = v);
    }
    pub(crate) fn set_requires_gradient_sync(&self, v: bool) {
        self.with_below(&|s| s.rt().requires_gradient_sync = v);
    }
    pub(crate) fn set_is_last_backward(&self, v: bool) {
        self.with_below(&|s| s.rt().is_last_backward = v);
    }
    pub(crate) fn is_unsharded(&self) -> bool {
        self.rt().unsharded
    }
    pub(crate) fn take_events(&self) -> Vec<(u64, FsdpEvent)> {
        std::mem::take(&mut self.rt().events)
    }

    /// The unsharded tensors' ids (what nested `fully_shard` calls above this one skip).
    pub(crate) fn full_ids(&self) -> impl Iterator<Item = TensorId> + '_ {
        self.params.iter().map(|p| p.full.id())
    }
}

impl AttachedState for FsdpState {
    fn kind(&self) -> &'static str {
        "fully_shard"
    }
    fn parameter_in_place_of(&self, param: &Tensor) -> Option<Tensor> {
        let id = param.id();
        self.params
            .iter()
            .find(|p| p.full.id() == id)
            .map(|p| p.shard.clone())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn zero_grad(&self) {
        // gradients accumulated unsynced (`set_requires_gradient_sync(false)`) live on the
        // unsharded parameters
        for p in &self.params {
            p.full.set_grad(None);
        }
    }
}
