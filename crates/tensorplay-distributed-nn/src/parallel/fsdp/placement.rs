//! A shard's place in its parameter: [`shard_placement`] (what `DTensor.placements` and
//! `DTensor.device_mesh` tell in PyTorch), for state dicts and checkpoints.

use tensorplay_collectives as dist;
use tensorplay_core::{Result, Tensor};

use super::param::ShardSpec;
use super::setup;
use crate::checkpoint::state_dict::TensorPlacement;
use crate::checkpoint::state_dict::placement::Split;
use crate::tensor::Placement;

/// Where `shard` lies in the whole parameter, if it is a shard `fully_shard` made (one of a
/// fully sharded module's `parameters()`; a tensor derived from it, such as its `detach()`,
/// is not): the parameter's shape and dtype, `Shard(0)` over the ranks of the module's mesh
/// (`mesh_dim` 0), this rank's coordinate, and its one chunk of rows (none when the rows ran
/// out before this rank: `torch.chunk`'s rule), of offsets `[first_row, 0, ...]`. A shard of
/// a tensor-parallel piece (2-D: `fully_shard` over a model `parallelize_module` had split)
/// lies in the whole tensor where both splits put it: the piece's chunks, cut to the rows this
/// rank keeps of the piece.
///
/// Errors: the group's errors when asking this rank's coordinate; `Ok(None)` for a tensor
/// that is not a shard.
pub fn shard_placement(shard: &Tensor) -> Result<Option<TensorPlacement>> {
    let Some((group, shape)) = setup::shard_info(shard) else {
        return Ok(None);
    };
    let rank = dist::get_rank(Some(&group))?;
    let world = dist::get_world_size(Some(&group))?;
    let local = ShardSpec::new(&shape, world).local_shape(&shape, rank);
    let rows = TensorPlacement::split(
        shape,
        shard.dtype(),
        Placement::Shard(0),
        Split::Rows,
        group,
        (rank, world),
        local,
    );
    Ok(Some(match setup::tp_piece_of_shard(shard) {
        // 2-D: the rows are of a tensor-parallel piece
        Some(piece) => TensorPlacement::two_d(piece, rows),
        None => rows,
    }))
}
