//! A fully sharded parameter put back together: `DTensor.full_tensor()` for the shards
//! `parameters()` lists.

use tensorplay_collectives::{self as dist, Error as DistError};
use tensorplay_core::{Result, Tensor, no_grad};

use super::param::ShardSpec;
use super::setup;

fn not_a_shard(op: &'static str, t: &Tensor) -> tensorplay_core::Error {
    DistError::invalid(
        op,
        dist::get_rank(None).map_or(-1, |r| r as i64),
        "shard",
        "a shard that fully_shard made (one of a fully sharded module's parameters())",
        format!("a tensor of shape {:?}", t.shape()),
    )
    .into()
}

/// This rank's rows of a fully sharded parameter as a plain tensor (PyTorch's `to_local()` on
/// an FSDP2 parameter). Our shards are plain tensors already, so this is the same handle
/// (shared storage, autograd identity and `.grad`): shape `[rows this rank holds, ..]`, the
/// shard's dtype; no collective.
///
/// Errors: `shard` is not a shard `fully_shard` made (`InvalidArgument`).
pub fn to_local(shard: &Tensor) -> Result<Tensor> {
    match setup::shard_info(shard) {
        Some(_) => Ok(shard.clone()),
        None => Err(not_a_shard("to_local", shard)),
    }
}

/// The whole tensor of which `shard` is this rank's rows (PyTorch's `full_tensor()` on an
/// FSDP2 parameter): one all-gather of every rank's padded rows over the shard's group, the
/// padding dropped. A new tensor of the full parameter's shape and the shard's dtype, with no
/// autograd history; for saving whole weights or comparing with a single-process model. A
/// collective: every rank of the group calls it with its shard of the same parameter.
///
/// Errors: `shard` is not a shard `fully_shard` made (`InvalidArgument`); collective errors.
pub fn full_tensor(shard: &Tensor) -> Result<Tensor> {
    let Some((group, shape)) = setup::shard_info(shard) else {
        return Err(not_a_shard("full_tensor", shard));
    };
    let world = dist::get_world_size(Some(&group))?;
    let spec = ShardSpec::new(&shape, world);
    let _g = no_grad();
    let padded = spec.padded_numel();
    let block = Tensor::zeros(&[padded], (shard.dtype(), shard.device()))?;
    let mine = shard.numel();
    if mine > 0 {
        block
            .narrow(0, 0, mine)?
            .copy_(&shard.detach().reshape(&[mine])?)?;
    }
    let all = Tensor::zeros(&[padded * world], (shard.dtype(), shard.device()))?;
    dist::all_gather_into_tensor(&all, &block, Some(&group))?;
    let full = Tensor::zeros(
        &[spec.rows * spec.row_numel],
        (shard.dtype(), shard.device()),
    )?;
    for r in 0..world {
        let rows = spec.rows_of(r);
        let n = rows.len() * spec.row_numel;
        if n > 0 {
            full.narrow(0, rows.start * spec.row_numel, n)?
                .copy_(&all.narrow(0, r * padded, n)?)?;
        }
    }
    full.reshape(&shape)
}
