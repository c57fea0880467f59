//! State dicts of parallel models (`torch.distributed.checkpoint.state_dict`): one set of
//! fully qualified names for a model whatever wraps or splits it, with local shards or whole
//! tensors.
//!
//! - [`get_model_state_dict`] / [`set_model_state_dict`]: the model's parameters and buffers
//!   by the names of the unwrapped model (`"0.weight"`, never `"module.0.weight"`): a plain
//!   model, one wrapped in [`DistributedDataParallel`](crate::parallel::DistributedDataParallel),
//!   one split by [`parallelize_module`](crate::parallel::tensor::parallelize_module) and one
//!   split by [`fully_shard`](crate::parallel::fsdp::fully_shard) give the same keys. By
//!   default each value is this rank's local tensor (a shard, or the whole where replicated);
//!   with [`StateDictOptions::full_state_dict`] the whole tensors, gathered.
//! - [`model_state_dict_placements`]: per name, where the local tensor lies in the whole
//!   ([`TensorPlacement`]: global shape, placement, this rank's chunks with offsets and sizes):
//!   what a resharding checkpoint needs to match the chunks it saved with those it loads.
//! - [`get_optimizer_state_dict`] / [`set_optimizer_state_dict`]: the optimizer's state keyed
//!   by parameter name ([`OptimizerStateDict`]), each tensor sharded as its parameter (or whole).
//!
//! The collectives run over each tensor's own group (a fully sharded module's mesh, a
//! tensor-parallel mesh); the checks that every rank accepts its input, and
//! [`StateDictOptions::broadcast_from_rank0`], use the default group when one is initialised.
//! Every function is collective whenever a process group is initialised: call it on every
//! rank, in the same order. The guide is `docs/fully-sharded.md`.

mod model;
mod optimizer;
pub(crate) mod placement;

use std::collections::BTreeMap;

use tensorplay_collectives::{self as dist, Error as DistError, ProcessGroup};
use tensorplay_core::nn::Module;
use tensorplay_core::{Result, Tensor};

pub use model::{get_model_state_dict, model_state_dict_placements, set_model_state_dict};
pub use optimizer::{
    OptimizerStateDict, ParamGroupState, get_optimizer_state_dict, set_optimizer_state_dict,
};
pub use placement::{ChunkStorageMetadata, TensorPlacement};

use crate::parallel::fsdp::shard_placement;
use crate::parallel::tensor::tp_placement;

/// Options of the state-dict functions (PyTorch's `StateDictOptions`; the defaults are
/// PyTorch's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateDictOptions {
    /// Whole tensors instead of local shards (default false): `get_*` gathers them (a
    /// collective per sharded tensor), `set_*` expects them and cuts each rank's piece.
    pub full_state_dict: bool,
    /// Move the values to the CPU (default false); with `full_state_dict`, only rank 0 of the
    /// default group returns values (the others an empty dict), as PyTorch, so that one copy
    /// of the whole model is held.
    pub cpu_offload: bool,
    /// For `set_*` with `full_state_dict` (default false): only rank 0 of the default group
    /// needs to hold the dict; the others pass an empty one and receive each tensor by
    /// broadcast before cutting their piece.
    pub broadcast_from_rank0: bool,
    /// For `set_*` (default true, PyTorch's `strict`): every key of the model must be given
    /// and no other. With false, missing keys keep their values and unknown keys are ignored;
    /// shapes are checked either way.
    pub strict: bool,
}

impl Default for StateDictOptions {
    fn default() -> Self {
        StateDictOptions {
            full_state_dict: false,
            cpu_offload: false,
            broadcast_from_rank0: false,
            strict: true,
        }
    }
}

impl StateDictOptions {
    /// `broadcast_from_rank0` needs `full_state_dict` (rank 0 broadcasts whole tensors): an
    /// `InvalidArgument` of `op` naming this rank otherwise.
    pub(crate) fn check_broadcast(&self, op: &str, rank: usize) -> Result<()> {
        if self.broadcast_from_rank0 && !self.full_state_dict {
            return Err(invalid(
                op,
                rank,
                "options",
                "full_state_dict with broadcast_from_rank0 (rank 0 broadcasts whole tensors)",
                "broadcast_from_rank0 without full_state_dict",
            ));
        }
        Ok(())
    }
}

/// One parameter or buffer of a model under its fully qualified name.
pub(crate) struct Entry {
    pub(crate) fqn: String,
    /// The module's own tensor (a shard for a split parameter).
    pub(crate) tensor: Tensor,
    pub(crate) is_param: bool,
}

/// The prefixes DDP wrappers add to their module's names: `"module."` under the wrapper's
/// path, with what replaces it.
fn wrapper_prefixes(module: &dyn Module) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = module
        .named_modules()
        .into_iter()
        .filter(|(_, m)| {
            m.core()
                .attached()
                .is_some_and(|a| a.kind() == "DistributedDataParallel")
        })
        .map(|(path, _)| {
            if path.is_empty() {
                ("module.".to_string(), String::new())
            } else {
                (format!("{path}.module."), format!("{path}."))
            }
        })
        .collect();
    out.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
    out
}

/// `name` without the wrappers' prefixes.
fn fqn(name: &str, prefixes: &[(String, String)]) -> String {
    for (p, r) in prefixes {
        if let Some(rest) = name.strip_prefix(p.as_str()) {
            return format!("{r}{rest}");
        }
    }
    name.to_string()
}

/// The model's parameters (as `named_parameters` lists them: shards where split, tied weights
/// once) then buffers, under their fully qualified names.
pub(crate) fn entries(module: &dyn Module) -> Vec<Entry> {
    let prefixes = wrapper_prefixes(module);
    let params = module
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, t, true));
    let buffers = module
        .named_buffers()
        .into_iter()
        .map(|(n, t)| (n, t, false));
    params
        .chain(buffers)
        .map(|(n, tensor, is_param)| Entry {
            fqn: fqn(&n, &prefixes),
            tensor,
            is_param,
        })
        .collect()
}

/// Where the model's tensor `t` lies: a fully sharded shard, a tensor-parallel piece, or
/// whole.
pub(crate) fn placement_of(t: &Tensor) -> Result<TensorPlacement> {
    if let Some(p) = shard_placement(t)? {
        return Ok(p);
    }
    Ok(tp_placement(t).unwrap_or_else(|| TensorPlacement::replicated(t)))
}

/// The default group, when a process group is initialised.
pub(crate) fn world_group() -> Option<ProcessGroup> {
    if dist::is_initialized() {
        dist::default_group("state_dict").ok()
    } else {
        None
    }
}

/// This rank in the default group (0 without one).
pub(crate) fn my_rank(group: Option<&ProcessGroup>) -> usize {
    group.map_or(0, ProcessGroup::my_global_rank)
}

/// An `InvalidArgument` of `op` naming this rank.
pub(crate) fn invalid(
    op: &str,
    rank: usize,
    arg: &str,
    expected: impl Into<String>,
    got: impl std::fmt::Display,
) -> tensorplay_core::Error {
    DistError::invalid(op, rank as i64, arg, expected, got).into()
}

/// Every rank's verdict on its input, known to all: `verdict` is this rank's error message
/// (`None`: accepted). Returns every rank's `extra` when this rank failed (the caller returns
/// its own error next) or every rank accepted; else an error naming the ranks that refused and
/// the first one's reason. Collective over `group` (nothing without one).
pub(crate) fn agree<T>(
    op: &str,
    verdict: Option<String>,
    extra: T,
    group: Option<&ProcessGroup>,
) -> Result<Vec<T>>
where
    T: serde::Serialize + serde::de::DeserializeOwned,
{
    let Some(group) = group else {
        return Ok(vec![extra]);
    };
    let mine_failed = verdict.is_some();
    let all: Vec<(Option<String>, T)> = dist::all_gather_object(&(verdict, extra), Some(group))?;
    let failed: Vec<(usize, String)> = all
        .iter()
        .enumerate()
        .filter_map(|(r, (v, _))| v.clone().map(|v| (group.ranks()[r], v)))
        .collect();
    if let Some((first, why)) = failed.first().filter(|_| !mine_failed) {
        let ranks: Vec<usize> = failed.iter().map(|(r, _)| *r).collect();
        return Err(invalid(
            op,
            group.my_global_rank(),
            "state_dict",
            "a state dict every rank accepts (nothing was changed on any rank)",
            format!("rank(s) {ranks:?} refused theirs; rank {first}: {why}"),
        ));
    }
    Ok(all.into_iter().map(|(_, e)| e).collect())
}

/// The message of `r`'s error, for [`agree`].
pub(crate) fn verdict<T>(r: &Result<T>) -> Option<String> {
    r.as_ref().err().map(ToString::to_string)
}

/// The dict's values on the CPU.
pub(crate) fn offload(map: BTreeMap<String, Tensor>) -> Result<BTreeMap<String, Tensor>> {
    map.into_iter().map(|(k, t)| Ok((k, t.cpu()?))).collect()
}
