//! [`get_model_state_dict`], [`set_model_state_dict`] and [`model_state_dict_placements`].

use std::collections::{BTreeMap, BTreeSet};

use tensorplay_collectives as dist;
use tensorplay_core::nn::Module;
use tensorplay_core::{Result, Tensor, no_grad};

use super::{
    StateDictOptions, TensorPlacement, agree, entries, invalid, my_rank, offload, placement_of,
    verdict, world_group,
};

const SET: &str = "set_model_state_dict";

/// The model's parameters and buffers by fully qualified name
/// (`torch.distributed.checkpoint.state_dict.get_model_state_dict`): the same keys for a
/// plain model and for one wrapped in DDP (no `module.` prefix), split by tensor parallelism or
/// fully sharded.
///
/// - By default each value is this rank's local tensor, detached, sharing storage with the
///   model as `state_dict()` does (a fully sharded parameter's shard, a tensor-parallel piece,
///   a replicated tensor whole); [`model_state_dict_placements`] says where each lies.
/// - With `full_state_dict`, each value is the whole tensor: new tensors, gathered over each
///   parameter's mesh (a collective per split parameter, on every rank); with `cpu_offload`
///   too, rank 0 of the default group returns them and the other ranks an empty dict.
/// - `cpu_offload` moves the values to the CPU.
///
/// Shapes and dtypes are the parameters': a fully sharded `[n, ...]` parameter's value is
/// `[rows, ...]` locally (rows as `torch.chunk` gives them) and `[n, ...]` whole.
///
/// # Errors
/// Collective errors (a rank that does not take part times out, naming it); a device error
/// when offloading.
pub fn get_model_state_dict<M: Module + ?Sized>(
    module: &M,
    options: StateDictOptions,
) -> Result<BTreeMap<String, Tensor>> {
    let module = module.as_module();
    let group = world_group();
    let rank = my_rank(group.as_ref());
    let mut out = BTreeMap::new();
    for e in entries(module) {
        let value = if options.full_state_dict {
            placement_of(&e.tensor)?.gather(&e.tensor)?
        } else {
            e.tensor.detach()
        };
        out.insert(e.fqn, value);
    }
    if !options.cpu_offload {
        return Ok(out);
    }
    if options.full_state_dict && rank != 0 {
        return Ok(BTreeMap::new());
    }
    offload(out)
}

/// Where each entry of the model's local state dict lies (no collective): per fully qualified
/// name, the whole tensor's shape and dtype, its placement over a mesh dimension and this
/// rank's chunks (see [`TensorPlacement`]). The keys are [`get_model_state_dict`]'s.
///
/// # Errors
/// The group's errors when asking this rank's coordinate in a mesh.
pub fn model_state_dict_placements<M: Module + ?Sized>(
    module: &M,
) -> Result<BTreeMap<String, TensorPlacement>> {
    entries(module.as_module())
        .into_iter()
        .map(|e| Ok((e.fqn, placement_of(&e.tensor)?)))
        .collect()
}

/// What the given value of one entry must look like, for the error.
fn expected_shape(p: &TensorPlacement, full: bool) -> (Vec<usize>, String) {
    if full || !p.is_sharded() {
        let what = if p.is_sharded() {
            " (the whole tensor: full_state_dict is set)".to_string()
        } else {
            String::new()
        };
        (p.global_shape.clone(), what)
    } else {
        (
            p.local_shape.clone(),
            format!(
                " (this rank's {} piece of the whole {:?}: full_state_dict is not set, so a \
                 sharded state dict is expected)",
                p.placement, p.global_shape
            ),
        )
    }
}

/// This rank's check of `state` against the model: keys (strict) and shapes.
fn check(
    state: &BTreeMap<String, Tensor>,
    own: &[(super::Entry, TensorPlacement)],
    options: StateDictOptions,
    rank: usize,
) -> Result<()> {
    if options.strict {
        let keys: BTreeSet<&str> = own.iter().map(|(e, _)| e.fqn.as_str()).collect();
        let missing: Vec<&str> = keys
            .iter()
            .copied()
            .filter(|k| !state.contains_key(*k))
            .collect();
        let unexpected: Vec<&str> = state
            .keys()
            .map(String::as_str)
            .filter(|k| !keys.contains(k))
            .collect();
        if !missing.is_empty() || !unexpected.is_empty() {
            return Err(invalid(
                SET,
                rank,
                "state_dict",
                "exactly the model's keys (strict)",
                format!("missing keys {missing:?}, unexpected keys {unexpected:?}"),
            ));
        }
    }
    for (e, p) in own {
        let Some(v) = state.get(&e.fqn) else { continue };
        let (want, why) = expected_shape(p, options.full_state_dict);
        if v.shape() != want.as_slice() {
            let hint = if p.is_sharded() && v.shape() == p.global_shape.as_slice() {
                " (the whole tensor)"
            } else if p.is_sharded() && v.shape() == p.local_shape.as_slice() {
                " (this rank's shard)"
            } else {
                ""
            };
            return Err(invalid(
                SET,
                rank,
                "state_dict",
                format!("shape {want:?} for key {:?}{why}", e.fqn),
                format!("shape {:?}{hint}", v.shape()),
            ));
        }
    }
    Ok(())
}

/// Copies `state` into the model's parameters and buffers in place, without autograd
/// (`torch.distributed.checkpoint.state_dict.set_model_state_dict`); the keys are those of
/// [`get_model_state_dict`], whatever wraps or splits the model.
///
/// - By default `state` holds this rank's local tensors (what [`get_model_state_dict`]
///   returned on this rank).
/// - With `full_state_dict` it holds whole tensors, and each rank copies its piece of them;
///   with `broadcast_from_rank0` too, only rank 0 of the default group needs them (the
///   others may pass an empty dict): rank 0 broadcasts each tensor.
/// - With `strict` (the default) the keys must be exactly the model's.
///
/// Values are converted to each tensor's dtype and device. Every rank checks its input first
/// and the ranks agree before any value changes: an error on one rank is an error on every
/// rank, and nothing changed anywhere.
///
/// # Errors
/// [`Error::InvalidArgument`](tensorplay_core::Error::InvalidArgument) naming the rank: missing
/// or unexpected keys (with `strict`), a value whose shape is not the one expected (naming the
/// key, the shape expected and whether a whole tensor was given where a shard was expected,
/// or the reverse), `broadcast_from_rank0` without `full_state_dict`; on the other ranks, an
/// error naming the ranks that refused and the first one's reason. Collective errors.
pub fn set_model_state_dict<M: Module + ?Sized>(
    module: &mut M,
    state: &BTreeMap<String, Tensor>,
    options: StateDictOptions,
) -> Result<()> {
    let module = module.as_module_mut();
    let group = world_group();
    let rank = my_rank(group.as_ref());
    let own: Vec<_> = entries(module)
        .into_iter()
        .map(|e| Ok((placement_of(&e.tensor)?, e)))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .map(|(p, e)| (e, p))
        .collect();
    let holds = !options.broadcast_from_rank0 || rank == 0;
    let mine = if let Err(e) = options.check_broadcast(SET, rank) {
        Err(e)
    } else if holds {
        check(state, &own, options, rank)
    } else {
        Ok(())
    };
    let present: Vec<bool> = own
        .iter()
        .map(|(e, _)| state.contains_key(&e.fqn))
        .collect();
    let all_present = agree(SET, verdict(&mine), present, group.as_ref())?;
    mine?;
    let _g = no_grad();
    for (i, (e, p)) in own.iter().enumerate() {
        let whole = if options.broadcast_from_rank0 {
            if !all_present[0][i] {
                continue;
            }
            let dev = e.tensor.device();
            let t = match state.get(&e.fqn).filter(|_| rank == 0) {
                Some(v) => v.detach().to_dtype(p.dtype)?.to_device(dev)?.contiguous()?,
                None => Tensor::zeros(&p.global_shape, (p.dtype, dev))?,
            };
            let t = t.deep_clone()?;
            if group.is_some() {
                dist::broadcast(&t, 0, group.as_ref())?;
            }
            t
        } else {
            match state.get(&e.fqn) {
                Some(v) => v.clone(),
                None => continue,
            }
        };
        let local = if options.full_state_dict {
            p.slice(&whole)?
        } else {
            whole
        };
        e.tensor.copy_(&local)?;
    }
    Ok(())
}
