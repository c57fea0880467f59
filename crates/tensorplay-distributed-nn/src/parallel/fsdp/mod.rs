//! Fully sharded data parallelism (`torch.distributed.fsdp.fully_shard`, FSDP2): every rank
//! keeps only its rows of each parameter, and so only its part of the gradients and of the
//! optimizer's state; whole parameters exist only while a module computes with them.
//!
//! Call [`fully_shard`] bottom-up on the same model on every rank (each transformer block,
//! then the root). Each call makes the module's parameters not claimed by an earlier call one
//! **group**:
//!
//! - every parameter is split along dimension 0 as `torch.chunk` splits it (`param.rs`); the
//!   rank's rows become a new leaf, the **shard**, which is what `parameters()` and
//!   `named_parameters()` list from then on: an optimizer built from them steps the shards and
//!   keeps state for them only;
//! - before the module's forward a hook all-gathers the group's shards into one flat buffer
//!   (`group.rs`) and copies them out into the module's own (unsharded) parameters; after
//!   forward it frees them again (`reshard_after_forward`, ZeRO-3), except on the root, whose
//!   parameters backward needs first;
//! - when the gradient of the module's output arrives in backward, a hook gathers the
//!   parameters again; when every trainable parameter of the group has its gradient, their
//!   reduce-scatter starts while backward goes on; at the end of backward the averaged rows
//!   land in the shards' `.grad` and the parameters are freed.
//!
//! The ranks must build the same model with the same values (from the same seed): unlike
//! [`DistributedDataParallel`](super::DistributedDataParallel), nothing is broadcast, as in
//! PyTorch's FSDP2. What differs from PyTorch is in `docs/decisions.md`; the guide is
//! `docs/fully-sharded.md`.

// the layout's accessors beyond what the runtime uses are exercised by its tests
#![cfg_attr(not(test), allow(dead_code))]

mod clip;
mod error;
mod full;
mod gather;
pub(crate) mod group;
pub(crate) mod param;
mod placement;
mod policy;
mod reduce;
mod scaler;
pub(crate) mod setup;
mod state;

use std::sync::Arc;

use tensorplay_collectives::device_mesh::DeviceMesh;
use tensorplay_core::nn::Module;
use tensorplay_core::{Result, Tensor};

pub use clip::clip_grad_norm_;
pub use error::FsdpError;
pub use full::{full_tensor, to_local};
pub use placement::shard_placement;
pub use policy::MixedPrecisionPolicy;
pub use scaler::ShardedGradScaler;
pub use state::FsdpEvent;
use state::FsdpState;

/// Options of [`fully_shard`] (its keyword arguments).
#[derive(Debug, Clone)]
pub struct FsdpOptions {
    /// The ranks that share the parameters (`mesh`): a 1-D mesh; or a 2-D mesh for HSDP,
    /// whose dimension 0 replicates and dimension 1 shards (each parameter is sharded across
    /// dimension 1's ranks, and the reduced gradient rows are all-reduced across dimension
    /// 0's, so gradients average over every rank of the mesh); `None`: the default group.
    /// For fully sharded training beside tensor parallelism, pass the data-parallel
    /// sub-mesh (`mesh.sub_mesh("dp")`).
    pub mesh: Option<DeviceMesh>,
    /// Free the gathered parameters after forward and gather them again in backward (true,
    /// the default: ZeRO-3), or keep them until backward ends (false: ZeRO-2, one all-gather
    /// per step instead of two, at the memory of the whole group). The root module keeps its
    /// parameters after a forward that backward follows either way.
    pub reshard_after_forward: bool,
    /// The dtypes the group computes, communicates and answers in (`mp_policy`); the default
    /// keeps the parameters' own dtype throughout.
    pub mp_policy: MixedPrecisionPolicy,
    /// Parameters of the module this call leaves alone (`ignored_params`): not sharded, listed
    /// by `parameters()` as they are, their gradients not synchronised (each rank keeps its
    /// own: reduce them yourself, or train them rank-locally). Every rank must ignore the same
    /// parameters.
    pub ignored_params: Vec<Tensor>,
}

impl Default for FsdpOptions {
    fn default() -> Self {
        FsdpOptions {
            mesh: None,
            reshard_after_forward: true,
            mp_policy: MixedPrecisionPolicy::default(),
            ignored_params: Vec::new(),
        }
    }
}

/// What [`fully_shard`] returns: a handle on the fully sharded module's group (PyTorch adds
/// these methods to the module's class). Cheap to clone; the module keeps the state alive.
#[derive(Clone)]
pub struct FsdpModule {
    state: Arc<FsdpState>,
}

impl std::fmt::Debug for FsdpModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpModule")
            .field("call", &self.state.index)
            .field("parameters", &self.state.params.len())
            .field("world", &self.state.world)
            .finish_non_exhaustive()
    }
}

impl FsdpModule {
    /// Gathers the group's parameters now (`unshard()`), so that the module's own tensors
    /// hold the full values until [`FsdpModule::reshard`]; a forward in between does not
    /// gather again. A collective: every rank calls it.
    ///
    /// Errors: collective errors (a rank that does not take part times out, naming it).
    pub fn unshard(&self) -> Result<()> {
        self.state.unshard()
    }

    /// Issues the group's all-gather and returns at once (`unshard(async_op=True)`): the
    /// returned handle's [`wait`](UnshardHandle::wait) — or the module's next forward —
    /// finishes it. A collective: every rank calls it. Nothing is issued when the parameters
    /// are gathered or being gathered already.
    ///
    /// Errors: collective errors.
    pub fn unshard_async(&self) -> Result<UnshardHandle> {
        self.state.prefetch()?;
        Ok(UnshardHandle {
            state: self.state.clone(),
        })
    }

    /// Frees the group's gathered parameters (`reshard()`); nothing when they are not
    /// gathered.
    pub fn reshard(&self) -> Result<()> {
        self.state.reshard()
    }

    /// Whether the group's parameters are gathered now.
    pub fn is_unsharded(&self) -> bool {
        self.state.is_unsharded()
    }

    /// Whether this module is a root: no fully sharded module above it was wrapped (a root
    /// keeps its parameters from forward to backward and learns the groups' order for
    /// prefetching).
    pub fn is_root(&self) -> bool {
        self.state.is_root()
    }

    /// Changes [`FsdpOptions::reshard_after_forward`] (`set_reshard_after_forward`), for this
    /// module's group and those of the fully sharded modules below it (PyTorch's
    /// `recurse=True`, as for the two setters after this one).
    pub fn set_reshard_after_forward(&self, reshard: bool) {
        self.state.set_reshard_after_forward(reshard)
    }

    /// Whether backward frees the gathered parameters once their gradients are out
    /// (`set_reshard_after_backward`, default true); this group and those below it.
    pub fn set_reshard_after_backward(&self, reshard: bool) {
        self.state.set_reshard_after_backward(reshard)
    }

    /// Whether backward reduce-scatters the gradients (`set_requires_gradient_sync`, default
    /// true), for this group and those of the fully sharded modules below it: call it on the
    /// root. With `false` the gradients accumulate, whole, in the module's unsharded
    /// parameters across backward passes (gradient accumulation over micro-batches); the next
    /// backward with `true` reduce-scatters the sums. Meanwhile each rank holds the whole
    /// group's gradients: the memory FSDP otherwise saves.
    pub fn set_requires_gradient_sync(&self, sync: bool) {
        self.state.set_requires_gradient_sync(sync)
    }

    /// Whether the next backward is the last before the optimizer step
    /// (`set_is_last_backward`, default true), for this group and those below it: call it on
    /// the root. With `false`, the end of backward does not wait for the last reduce-scatter:
    /// it stays in flight while the next micro-batch's forward runs, and the shards' `.grad`
    /// is complete only after a backward with `true` (gradient accumulation with the gradients
    /// synchronised every micro-batch, each rank keeping only its rows).
    pub fn set_is_last_backward(&self, last: bool) {
        self.state.set_is_last_backward(last)
    }

    /// The groups whose all-gathers this group's pre-forward hook issues, in order, instead of
    /// the next group of the first forward's order (`set_modules_to_forward_prefetch`);
    /// an empty list prefetches nothing.
    ///
    /// A collective over the group's ranks (unlike PyTorch's): the ranks' lists are compared,
    /// since all-gathers issued in different orders would pair different groups' shards.
    ///
    /// Errors: [`Error::InvalidArgument`](tensorplay_core::Error::InvalidArgument) on every
    /// rank when the ranks' lists differ (naming a rank and both lists); collective errors.
    pub fn set_modules_to_forward_prefetch(&self, modules: &[&FsdpModule]) -> Result<()> {
        self.state
            .set_explicit_prefetch(false, modules.iter().map(|m| &m.state))
    }

    /// The groups whose all-gathers this group's pre-backward hook issues, in order, instead
    /// of the group backward reaches next (`set_modules_to_backward_prefetch`); an empty list
    /// prefetches nothing. A collective, checked as
    /// [`set_modules_to_forward_prefetch`](Self::set_modules_to_forward_prefetch).
    ///
    /// Errors: as `set_modules_to_forward_prefetch`.
    pub fn set_modules_to_backward_prefetch(&self, modules: &[&FsdpModule]) -> Result<()> {
        self.state
            .set_explicit_prefetch(true, modules.iter().map(|m| &m.state))
    }

    /// Runs `method` — a method of the module other than `forward`, such as a generation loop
    /// that calls the module's layers itself — as the module's forward: the group is gathered
    /// before, and freed (or kept for backward, as after a forward) after, with `method`'s
    /// output as the forward's (PyTorch's `register_fsdp_forward_method(module, name)`; Rust
    /// has no method table to patch, so the call goes through here). Groups below this one
    /// gather in their own forwards as usual.
    ///
    /// Errors: `method`'s error (the group is freed first); collective errors.
    pub fn forward_method(&self, method: impl FnOnce() -> Result<Tensor>) -> Result<Tensor> {
        self.state.pre_forward()?;
        match method() {
            Ok(out) => {
                self.state.post_forward(&out)?;
                Ok(out)
            }
            Err(e) => {
                // best effort: the method's error is the one to report
                let _ = self.state.reshard();
                Err(e)
            }
        }
    }

    /// The shards of the group's parameters with their names under the module `fully_shard`
    /// was called on (those of nested calls excluded).
    pub fn sharded_parameters(&self) -> Vec<(String, Tensor)> {
        self.state
            .params
            .iter()
            .map(|p| (p.name.clone(), p.shard.clone()))
            .collect()
    }

    /// The group's events since the last call, in order, each with its number in one
    /// process-wide sequence (so events of different groups can be ordered): all-gathers,
    /// forward start and end, reduce-scatters, resharding, the end of backward. What tests of
    /// prefetching and overlap read.
    pub fn take_events(&self) -> Vec<(u64, FsdpEvent)> {
        self.state.take_events()
    }
}

/// What [`FsdpModule::unshard_async`] returns (PyTorch's `UnshardHandle`).
#[must_use = "the all-gather is finished by wait() or by the module's next forward"]
pub struct UnshardHandle {
    state: Arc<FsdpState>,
}

impl UnshardHandle {
    /// Waits for the all-gather and fills the module's parameters.
    ///
    /// Errors: collective errors (a rank that did not take part times out, naming it).
    pub fn wait(self) -> Result<()> {
        self.state.unshard()
    }
}

impl std::fmt::Debug for UnshardHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnshardHandle")
            .field("call", &self.state.index)
            .finish_non_exhaustive()
    }
}

/// Shards `module`'s parameters across the ranks of `options.mesh`
/// (`torch.distributed.fsdp.fully_shard`); see the [module docs](self) for what happens
/// when. Call it on the same model on every rank, bottom-up: inner modules (transformer
/// blocks) first, the root last; the root's group takes the parameters no inner call took.
/// Build the optimizer from `module.parameters()` afterwards (the shards).
///
/// Every rank's parameter names, shapes and dtypes, and the order of calls, are compared
/// first: the first difference is an error on every rank, naming it.
///
/// ```no_run
/// use tensorplay::{self as tp, nn::{self, Module}, optim::{AdamW, AdamWOptions, Optimizer}};
/// use tp::distributed::{self as dist, fsdp::{FsdpOptions, fully_shard}};
///
/// fn main() -> tp::Result<()> {
///     dist::init_process_group("cpu", Default::default())?;
///     tp::manual_seed(0); // the same weights on every rank
///     let mut model = nn::Sequential::new()
///         .add(nn::Linear::new(16, 64, true)?)
///         .add(nn::Tanh::new())
///         .add(nn::Linear::new(64, 4, true)?);
///     fully_shard(&mut model, FsdpOptions::default())?;
///     let mut opt = AdamW::new(model.parameters(), AdamWOptions::default())?; // shards
///     let x = tp::randn(&[8, 16])?; // this rank's part of the batch
///     opt.zero_grad()?;
///     model.call(&x)?.pow_scalar(2.0)?.mean()?.backward()?; // gradients reduce-scattered
///     opt.step()?;
///     dist::destroy_process_group()?;
///     Ok(())
/// }
/// ```
///
/// # Errors
/// [`Error::InvalidArgument`](tensorplay_core::Error::InvalidArgument), naming the rank: a
/// module fully sharded already; a mesh that is neither 1-D nor 2-D; parameters not floating point, or
/// of more than one dtype without a `mp_policy.param_dtype`; a policy dtype that is not
/// floating point; a parameter an earlier sibling call claimed;
/// ranks that disagree on the group's parameters. Collective errors.
pub fn fully_shard<M: Module + ?Sized>(module: &mut M, options: FsdpOptions) -> Result<FsdpModule> {
    let state = setup::shard_module(module.as_module_mut(), &options)?;
    Ok(FsdpModule { state })
}
