//! Data parallelism (`torch.nn.parallel`): [`DistributedDataParallel`].
//!
//! Every rank holds a full replica of the model and trains it on its own shard of each batch;
//! the gradients are averaged across ranks during backward, so after `backward` every rank's
//! `.grad` is the gradient of the mean of the ranks' losses and the replicas stay identical
//! step after step. The façade re-exports this module as `tensorplay::nn::parallel`; the
//! design and its differences from PyTorch are in `docs/data-parallel.md`.
//!
//! How one step goes:
//! 1. **forward** (with grad enabled): a one-round handshake with every rank (same step, same
//!    buckets, nobody broke the protocol; ranks that [`join`](DistributedDataParallel::join)ed
//!    are counted), buffers are broadcast, then the module runs.
//! 2. **backward**: as each parameter's gradient is accumulated, a hook copies it, divided by
//!    the world size, into its **bucket** (parameters in reverse registration order, the first
//!    bucket at least 1 MiB, then `bucket_cap_mb`; rebuilt once from the order gradients
//!    actually arrived in the first step). A full bucket starts an asynchronous SUM all-reduce
//!    at once, while backward goes on; buckets start strictly in bucket order on every rank.
//! 3. **end of backward** (an autograd callback): parameters that got no gradient go out as
//!    zeros, all all-reduces are waited for, and the averaged gradients are written to `.grad`
//!    — except for parameters no rank used this step, which keep their `.grad` (`None` after
//!    `zero_grad`), as in PyTorch.

mod buckets;
mod comm_hook;
mod copy;
mod error;
mod protocol;
mod reducer;
mod schedule;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tensorplay_collectives::{self as dist, ProcessGroup};
use tensorplay_core::autograd::HookHandle;
use tensorplay_core::nn::{Module, ModuleCore};
use tensorplay_core::{Device, Error, Result, Tensor};

pub use comm_hook::{CommFuture, CommHook, GradBucket, default_hooks};
pub use error::DdpError;
use reducer::{JoinRound, Reducer, ReducerOptions};

/// Options of [`DistributedDataParallel::with_options`], PyTorch's constructor arguments.
#[derive(Clone)]
pub struct DdpOptions {
    /// The group whose ranks hold the replicas (`process_group`); `None`: the default group.
    pub process_group: Option<ProcessGroup>,
    /// The size of every bucket after the first, in MiB (`bucket_cap_mb`, default 25; PyTorch's
    /// "MB" are MiB). The first bucket closes at 1 MiB (or this cap, if smaller). Must be
    /// positive and finite.
    pub bucket_cap_mb: f64,
    /// Broadcast the buffers (running statistics and the like) from the lowest training rank
    /// before every synced forward (`broadcast_buffers`, default true).
    pub broadcast_buffers: bool,
    /// Walk the graph after each forward to find the parameters the output does not depend on,
    /// so that their buckets go out at the start of backward (`find_unused_parameters`, default
    /// false). Not needed for correctness here: unused parameters are found at the end of
    /// backward anyway; the flag only buys overlap, at the cost of the walk.
    pub find_unused_parameters: bool,
    /// Make each `.grad` a view into its bucket instead of a copy (`gradient_as_bucket_view`,
    /// default false): saves a copy of every gradient, but the `.grad` tensors are overwritten
    /// by the next synced backward.
    pub gradient_as_bucket_view: bool,
    /// Accepted for PyTorch compatibility (`static_graph`); it changes nothing: the reducer
    /// needs no promise that the graph is static.
    pub static_graph: bool,
    /// With [`DistributedDataParallel::join`]: divide by the initial world size (true, the
    /// default, as PyTorch) or by the number of ranks still training (false).
    pub divide_by_initial_world_size: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            process_group: None,
            bucket_cap_mb: 25.0,
            broadcast_buffers: true,
            find_unused_parameters: false,
            gradient_as_bucket_view: false,
            static_graph: false,
            divide_by_initial_world_size: true,
        }
    }
}

impl std::fmt::Debug for DdpOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DdpOptions")
            .field("bucket_cap_mb", &self.bucket_cap_mb)
            .field("broadcast_buffers", &self.broadcast_buffers)
            .field("find_unused_parameters", &self.find_unused_parameters)
            .field("gradient_as_bucket_view", &self.gradient_as_bucket_view)
            .field("static_graph", &self.static_graph)
            .field(
                "divide_by_initial_world_size",
                &self.divide_by_initial_world_size,
            )
            .finish_non_exhaustive()
    }
}

/// The state DDP attaches to its wrapper's core: nothing but the mark that DDP took the
/// module over (another parallelism API refuses it).
struct DdpMarker;

impl tensorplay_core::nn::AttachedState for DdpMarker {
    fn kind(&self) -> &'static str {
        "DistributedDataParallel"
    }
    fn parameter_in_place_of(&self, _param: &Tensor) -> Option<Tensor> {
        None
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// What the last synced step's reduction cost (PyTorch's `_get_ddp_logging_data` timings).
#[derive(Debug, Clone, PartialEq)]
pub struct StepStats {
    /// The step (0 is the first synced forward).
    pub step: u64,
    /// Number of buckets.
    pub buckets: usize,
    /// Bytes of gradients all-reduced (the buckets' total size).
    pub bytes: usize,
    /// Sum of the buckets' all-reduce durations (from when each started running on the
    /// group's communication thread to when it finished).
    pub comm_time: Duration,
    /// The part of `comm_time` that ran before backward ended, hidden behind it (`None` when no
    /// all-reduce reported its timing, as with a hook that returns its own futures).
    pub hidden_fraction: Option<f64>,
    /// From the first gradient ready to the end of backward.
    pub backward_time: Option<Duration>,
    /// How long the end of backward waited for the all-reduces (the exposed communication).
    pub wait_time: Duration,
}

/// Data-parallel training of a module (`torch.nn.parallel.DistributedDataParallel`).
///
/// Wrap the same model on every rank of a process group; call it like the module. Parameters
/// and buffers are broadcast from the group's rank 0 at construction; the gradients of
/// `backward` come out averaged across ranks (see the [module docs](self) for how).
///
/// ```no_run
/// use tensorplay::{self as tp, nn::{self, Module}, optim::{Optimizer, SGD, SgdOptions}};
/// use tp::distributed as dist;
/// use tp::nn::parallel::DistributedDataParallel as Ddp;
///
/// fn main() -> tp::Result<()> {
///     dist::init_process_group("cpu", Default::default())?; // env:// (tensorplay-run sets it)
///     let model = nn::Sequential::new()
///         .add(nn::Linear::new(16, 32, true)?)
///         .add(nn::ReLU::new())
///         .add(nn::Linear::new(32, 4, true)?);
///     let ddp = Ddp::new(model)?;
///     let mut opt = SGD::new(ddp.parameters(), SgdOptions { lr: 0.1, ..Default::default() })?;
///     let x = tp::randn(&[8, 16])?; // this rank's shard of the batch
///     let y = tp::randint(0, 4, &[8])?;
///     opt.zero_grad()?;
///     let loss = nn::CrossEntropyLoss::new().forward(&ddp.call(&x)?, &y)?;
///     loss.backward()?; // gradients are averaged across ranks here
///     opt.step()?;
///     dist::barrier(None)?; // no rank leaves while another still needs it
///     dist::destroy_process_group()?;
///     Ok(())
/// }
/// ```
///
/// # Errors
/// Construction fails on every rank alike with [`DdpError::ModelMismatch`] when the ranks'
/// parameter lists (names, shapes, dtypes) differ, naming the first difference; with
/// [`Error::InvalidArgument`] for a bad option. A training forward fails with
/// [`DdpError::Misuse`] on a rank that broke the protocol (two training forwards before one
/// backward) and with [`DdpError::PeerMisuse`] on the others, all at the same point; a failed
/// all-reduce (a rank that died, a timeout) fails `backward` with [`DdpError::Communication`].
#[derive(Module)]
pub struct DistributedDataParallel<M: Module> {
    module: M,
    #[module(skip)]
    reducer: Arc<Reducer>,
    #[module(skip)]
    hooks: Vec<HookHandle>,
    #[module(skip)]
    sync: AtomicBool,
    broadcast_buffers: bool,
    core: ModuleCore,
}

impl<M: Module> DistributedDataParallel<M> {
    /// Wraps `module` on the default process group with PyTorch's defaults.
    pub fn new(module: M) -> Result<Self> {
        Self::with_options(module, DdpOptions::default())
    }

    /// Wraps `module` with `options` (see [`DdpOptions`]).
    pub fn with_options(module: M, options: DdpOptions) -> Result<Self> {
        let group = match options.process_group.clone() {
            Some(g) => g,
            None => dist::default_group("DistributedDataParallel")?,
        };
        let rank = group.my_global_rank();
        if !group.is_member() {
            return Err(dist::Error::invalid(
                "DistributedDataParallel",
                rank as i64,
                "process_group",
                "a group this rank belongs to",
                format!("a group of ranks {:?}", group.ranks()),
            )
            .into());
        }
        if let Some((path, m)) = module
            .named_modules()
            .into_iter()
            .find(|(_, m)| m.core().attached().is_some())
        {
            let kind = m.core().attached().map_or("", |a| a.kind());
            return Err(dist::Error::invalid(
                "DistributedDataParallel",
                rank as i64,
                "module",
                "a module no other parallelism API has taken over",
                format!(
                    "{kind} was applied to {} already (use one of them)",
                    if path.is_empty() {
                        "the module".to_string()
                    } else {
                        format!("{path:?}")
                    }
                ),
            )
            .into());
        }
        if !(options.bucket_cap_mb.is_finite() && options.bucket_cap_mb > 0.0) {
            return Err(dist::Error::invalid(
                "DistributedDataParallel",
                rank as i64,
                "bucket_cap_mb",
                "a positive, finite number of MiB",
                options.bucket_cap_mb,
            )
            .into());
        }
        let instance = check_same_model(&module, &group, &options)?;
        sync_module_states(&module, &group)?;
        let cap = ((options.bucket_cap_mb * 1024.0 * 1024.0) as usize).max(1);
        // a parameter registered twice (tied weights) is reduced once
        let mut seen = std::collections::HashSet::new();
        let trainable: Vec<(String, Tensor)> = module
            .named_parameters()
            .into_iter()
            .filter(|(_, p)| p.requires_grad() && seen.insert(p.id()))
            .collect();
        let reducer = Reducer::new(
            group,
            trainable,
            ReducerOptions {
                broadcast_buffers: options.broadcast_buffers,
                find_unused_parameters: options.find_unused_parameters,
                gradient_as_bucket_view: options.gradient_as_bucket_view,
                divide_by_initial_world_size: options.divide_by_initial_world_size,
                bucket_limits: [buckets::FIRST_BUCKET_BYTES.min(cap), cap],
            },
            instance,
        )?;
        let hooks = reducer.install_hooks()?;
        let mut core = ModuleCore::new();
        // marks the wrapper, so that fully_shard refuses it
        core.attach(Arc::new(DdpMarker))?;
        Ok(DistributedDataParallel {
            module,
            reducer,
            hooks,
            sync: AtomicBool::new(true),
            broadcast_buffers: options.broadcast_buffers,
            core,
        })
    }

    /// The wrapped module (`ddp.module`).
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The wrapped module, mutably. Do not replace its parameters: the reducer holds them.
    pub fn module_mut(&mut self) -> &mut M {
        &mut self.module
    }

    /// The process group the replicas live in.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.reducer.group
    }

    /// Accumulates gradients locally until the guard is dropped (`no_sync()`): backward passes
    /// of forwards run under the guard are not reduced; the first synced backward after it
    /// reduces the sum of everything accumulated. Every rank must use it for the same steps.
    pub fn no_sync(&self) -> NoSync<'_> {
        let prev = self.sync.swap(false, Ordering::SeqCst);
        NoSync {
            flag: &self.sync,
            prev,
        }
    }

    /// Call when this rank has run out of data (PyTorch's `Join` context with this model):
    /// until every rank has called `join`, this rank shadows the others' synced steps, taking
    /// part in their handshakes, buffer broadcasts and all-reduces with zero gradients, so
    /// uneven inputs neither hang nor fail. The gradients of the ranks still training are
    /// divided by the initial world size (or by the number still training; see
    /// [`DdpOptions::divide_by_initial_world_size`]). When every rank has joined, every rank
    /// takes the parameters and buffers of the rank that trained the most steps (the last to
    /// join), so the replicas are identical again; then it returns.
    ///
    /// Errors: a collective's error, or [`DdpError::Misuse`] when called between a training
    /// forward and its backward.
    pub fn join(&self) -> Result<()> {
        loop {
            match self.reducer.join_round()? {
                JoinRound::Shadow(src) => {
                    self.sync_buffers(src)?;
                    self.reducer.join_backward()?;
                }
                JoinRound::Done(authority) => {
                    return broadcast_states(&self.module, &self.reducer.group, authority);
                }
            }
        }
    }

    /// Installs a communication hook (`register_comm_hook`; the hook's state is whatever its
    /// closure captures). It is called once per bucket per synced step, in bucket order, with
    /// the process group and the bucket's **undivided** flat gradient, does the communication
    /// itself and returns a [`CommFuture`] of the tensor written back to `.grad` (same length
    /// and dtype as the bucket). [`default_hooks::allreduce_hook`] is what DDP does without a
    /// hook. The hook must not call this `DistributedDataParallel`.
    ///
    /// Errors ([`DdpError::Misuse`]) when a hook is installed already or training has started.
    pub fn register_comm_hook<F>(&self, hook: F) -> Result<()>
    where
        F: Fn(&ProcessGroup, &GradBucket) -> Result<CommFuture> + Send + Sync + 'static,
    {
        self.reducer.set_comm_hook(Arc::new(hook))
    }

    /// The buckets, in launch order, as the names of the parameters each holds (in buffer
    /// order). Changes once, after the first synced step, when the buckets are rebuilt.
    pub fn bucket_parameter_names(&self) -> Vec<Vec<String>> {
        self.reducer.bucket_names()
    }

    /// The cost of the last synced step's reduction; `None` before the first.
    pub fn last_step_stats(&self) -> Option<StepStats> {
        self.reducer.stats()
    }

    fn sync_buffers(&self, src: usize) -> Result<()> {
        if !self.broadcast_buffers || self.reducer.world == 1 {
            return Ok(());
        }
        let _g = tensorplay_core::no_grad();
        for (_, b) in self.module.named_buffers() {
            dist::with_phase(reducer::PHASE, || {
                dist::broadcast(&b, src, Some(&self.reducer.group))
            })?;
        }
        Ok(())
    }
}

impl<M: Module> Drop for DistributedDataParallel<M> {
    fn drop(&mut self) {
        for h in self.hooks.drain(..) {
            h.remove();
        }
    }
}

/// The guard of [`DistributedDataParallel::no_sync`].
#[derive(Debug)]
pub struct NoSync<'a> {
    flag: &'a AtomicBool,
    prev: bool,
}

impl Drop for NoSync<'_> {
    fn drop(&mut self) {
        self.flag.store(self.prev, Ordering::SeqCst);
    }
}

impl<M: Module> Module for DistributedDataParallel<M> {
    /// The module's forward; with grad enabled, the start of a data-parallel step (see the
    /// type's docs).
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        if !tensorplay_core::autograd::is_grad_enabled() {
            return self.module.call(input);
        }
        if !self.module.is_training() {
            // evaluation: no collectives; a backward through it would not be reduced
            let out = self.module.call(input)?;
            if out.requires_grad() {
                out.register_hook(|_| {
                    Err(Error::Autograd(
                        "backward through a forward of DistributedDataParallel in eval() mode: \
                         its gradients would not be reduced across ranks; call train() before \
                         a forward you backpropagate through"
                            .into(),
                    ))
                })?;
            }
            return Ok(out);
        }
        if !self.sync.load(Ordering::SeqCst) {
            self.reducer.forward_without_sync()?;
            return self.module.call(input);
        }
        let src = self.reducer.prepare_forward()?;
        let out = self
            .sync_buffers(src)
            .and_then(|()| self.module.call(input))
            .and_then(|out| {
                self.reducer.after_forward(&out)?;
                Ok(out)
            });
        if out.is_err() {
            // the other ranks' backward must not wait for this rank's gradients
            self.reducer.abandon_after_forward_error();
        }
        out
    }
    /// Refused: the reducer holds the parameters; move the module before wrapping it.
    fn to_device(&mut self, _device: Device) -> Result<()> {
        Err(Error::NotSupported {
            op: "to_device",
            detail: "here: move the module to its device before wrapping it in \
                     DistributedDataParallel"
                .into(),
        })
    }
}

/// Every rank's parameter and buffer list (names, shapes, dtypes, requires_grad) and options
/// against the group rank 0's; the first difference fails construction on every rank with the
/// same text. Returns the number every rank takes for this instance (rank 0's random one).
fn check_same_model(module: &dyn Module, group: &ProcessGroup, o: &DdpOptions) -> Result<i64> {
    type Entry = (String, String, Vec<usize>, String, bool);
    let mine: Vec<Entry> = module
        .named_parameters()
        .into_iter()
        .map(|(n, p)| {
            (
                "parameter".to_string(),
                n,
                p.shape().to_vec(),
                p.dtype().to_string(),
                p.requires_grad(),
            )
        })
        .chain(module.named_buffers().into_iter().map(|(n, b)| {
            (
                "buffer".to_string(),
                n,
                b.shape().to_vec(),
                b.dtype().to_string(),
                false,
            )
        }))
        .collect();
    let options = format!(
        "bucket_cap_mb {}, broadcast_buffers {}, find_unused_parameters {}, \
         gradient_as_bucket_view {}, divide_by_initial_world_size {}",
        o.bucket_cap_mb,
        o.broadcast_buffers,
        o.find_unused_parameters,
        o.gradient_as_bucket_view,
        o.divide_by_initial_world_size
    );
    use std::hash::{BuildHasher, Hasher};
    let nonce = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish() as i64;
    let all = dist::all_gather_object(&(mine, options, nonce), Some(group))?;
    let ranks = group.ranks();
    let show = |e: &Entry| {
        format!(
            "{} {:?} of shape {:?}, dtype {}{}",
            e.0,
            e.1,
            e.2,
            e.3,
            if e.0 == "parameter" && !e.4 {
                " (frozen)"
            } else {
                ""
            }
        )
    };
    let mismatch = |detail: String| -> Result<i64> {
        Err(DdpError::ModelMismatch {
            rank: group.my_global_rank(),
            detail,
        }
        .into())
    };
    let (base, base_options, _) = &all[0];
    for (r, (list, options, _)) in all.iter().enumerate().skip(1) {
        if let Some(i) = (0..list.len().min(base.len())).find(|&i| list[i] != base[i]) {
            return mismatch(format!(
                "entry {i} of rank {} is {}, of rank {} is {}",
                ranks[r],
                show(&list[i]),
                ranks[0],
                show(&base[i])
            ));
        }
        if list.len() != base.len() {
            let (long, who) = if list.len() > base.len() {
                (list, ranks[r])
            } else {
                (base, ranks[0])
            };
            let extra = &long[list.len().min(base.len())];
            return mismatch(format!(
                "rank {} has {} parameters and buffers, rank {} has {}; the first extra one, on \
                 rank {who}, is {}",
                ranks[r],
                list.len(),
                ranks[0],
                base.len(),
                show(extra)
            ));
        }
        if options != base_options {
            return mismatch(format!(
                "rank {} has options ({options}), rank {} has ({base_options})",
                ranks[r], ranks[0]
            ));
        }
    }
    Ok(all[0].2)
}

/// Broadcasts every parameter and buffer from the group's rank 0 (`_sync_module_states`).
fn sync_module_states(module: &dyn Module, group: &ProcessGroup) -> Result<()> {
    broadcast_states(module, group, group.global_rank(0)?)
}

/// Broadcasts every parameter and buffer from global rank `src`.
fn broadcast_states(module: &dyn Module, group: &ProcessGroup, src: usize) -> Result<()> {
    if group.size() == 1 {
        return Ok(());
    }
    let _g = tensorplay_core::no_grad();
    for (_, t) in module
        .named_parameters()
        .into_iter()
        .chain(module.named_buffers())
    {
        dist::with_phase(reducer::PHASE, || {
            dist::broadcast(&t.detach(), src, Some(group))
        })?;
    }
    Ok(())
}
