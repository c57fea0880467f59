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
mod reduce;
mod setup;
mod state;

use std::sync::Arc;

use tensorplay_collectives::device_mesh::DeviceMesh;
use tensorplay_core::nn::Module;
use tensorplay_core::{Result, Tensor};

pub use clip::clip_grad_norm_;
pub use error::FsdpError;
pub use full::full_tensor;
pub use placement::shard_placement;
pub use state::FsdpEvent;
use state::FsdpState;

/// Options of [`fully_shard`] (its keyword arguments).
#[derive(Debug, Clone)]
pub struct FsdpOptions {
    /// The ranks that share the parameters: a 1-D mesh (`mesh`); `None`: the default group.
    pub mesh: Option<DeviceMesh>,
    /// Free the gathered parameters after forward and gather them again in backward (true,
    /// the default: ZeRO-3), or keep them until backward ends (false: ZeRO-2, one all-gather
    /// per step instead of two, at the memory of the whole group). The root module keeps its
    /// parameters after a forward that backward follows either way.
    pub reshard_after_forward: bool,
}

impl Default for FsdpOptions {
    fn default() -> Self {
        FsdpOptions {
            mesh: None,
            reshard_after_forward: true,
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
/// module fully sharded already; a mesh that is not 1-D; parameters of more than one dtype,
/// or not floating point, in the group; a parameter an earlier sibling call claimed;
/// ranks that disagree on the group's parameters. Collective errors.
pub fn fully_shard<M: Module + ?Sized>(module: &mut M, options: FsdpOptions) -> Result<FsdpModule> {
    let state = setup::shard_module(module.as_module_mut(), &options)?;
    Ok(FsdpModule { state })
}
