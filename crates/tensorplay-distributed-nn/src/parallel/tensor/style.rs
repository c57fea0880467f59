//! [`ParallelStyle`]: what a plan entry does to the module it names, and the helpers the
//! styles share (the mesh dimension they run on, replacing a parameter by its shard).

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

use tensorplay_collectives::ProcessGroup;
use tensorplay_collectives::device_mesh::DeviceMesh;
use tensorplay_core::nn::Module;
use tensorplay_core::{Result, Tensor, TensorId};

use super::shard::invalid;
use crate::checkpoint::state_dict::TensorPlacement;
use crate::checkpoint::state_dict::placement::Split;
use crate::tensor::Placement;

/// A way to parallelise one module over a 1-D [`DeviceMesh`]
/// (`torch.distributed.tensor.parallel.ParallelStyle`): [`ColwiseParallel`] and
/// [`RowwiseParallel`] implement it; [`parallelize_module`] applies a plan of them.
///
/// [`ColwiseParallel`]: super::ColwiseParallel
/// [`RowwiseParallel`]: super::RowwiseParallel
/// [`parallelize_module`]: super::parallelize_module
pub trait ParallelStyle: Send + Sync {
    /// Parallelises `module` on this rank: replaces its parameters by this rank's shards (new
    /// leaf tensors, each requiring grad as the full one did) and registers the forward
    /// pre-hook and hook that move its input and output between layouts. `path` is the
    /// module's dotted name, for errors.
    ///
    /// # Errors
    /// A module without the parameters the style splits, extents the mesh size does not
    /// divide, layout options the style does not support, a mesh that is not 1-D.
    fn apply(&self, path: &str, module: &mut dyn Module, mesh: &DeviceMesh) -> Result<()>;

    /// Rank `rank`'s (of `world`) value of the module's parameter `name` (as the module
    /// names it locally: `"weight"`, `"bias"`) given its full value: what [`apply`] leaves on
    /// that rank. Use it to shard a checkpoint or to compare gradients with one process's.
    ///
    /// [`apply`]: ParallelStyle::apply
    ///
    /// # Errors
    /// As [`apply`](ParallelStyle::apply) for the shapes; `rank >= world`.
    fn shard_parameter(
        &self,
        name: &str,
        full: &Tensor,
        rank: usize,
        world: usize,
    ) -> Result<Tensor>;
}

/// The group, this rank's coordinate and the size of a 1-D mesh.
pub(crate) struct MeshDim1 {
    pub(crate) group: ProcessGroup,
    pub(crate) rank: usize,
    pub(crate) world: usize,
}

/// Checks that `mesh` is 1-D and returns its group, coordinate and size.
pub(crate) fn mesh_1d(op: &'static str, mesh: &DeviceMesh) -> Result<MeshDim1> {
    if mesh.ndim() != 1 {
        return Err(invalid(
            op,
            "device_mesh",
            "a 1-D mesh (the tensor-parallel dimension of a larger mesh: mesh[\"tp\"])",
            format!("{mesh:?}"),
        ));
    }
    Ok(MeshDim1 {
        group: mesh.get_group(0)?.clone(),
        rank: mesh.get_local_rank(0)?,
        world: mesh.size(0)?,
    })
}

/// Replaces every parameter of `module` (its own, not its children's) by `shard(name,
/// full)`, keeping `requires_grad`; errors when `module` lacks a parameter named `weight`.
pub(crate) fn replace_parameters(
    op: &'static str,
    path: &str,
    module: &mut dyn Module,
    shard: impl Fn(&str, &Tensor) -> Result<Tensor>,
) -> Result<()> {
    let mut params = module.local_parameters_mut();
    if !params.iter().any(|(n, _)| n == "weight") {
        return Err(invalid(
            op,
            "parallelize_plan",
            "a Linear-like module (a 2-D `weight` [out_features, in_features], an optional \
             `bias` [out_features])",
            format!(
                "`{path}` with parameters {:?}",
                params.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>()
            ),
        ));
    }
    for (name, p) in params.iter_mut() {
        let rg = p.requires_grad();
        let s = shard(name, p)?;
        **p = if rg { s.requires_grad_(true) } else { s };
    }
    Ok(())
}

/// The placement of every parameter a style replaced, by the local tensor's id (ids are never
/// reused, so entries of dropped models are only stale).
static PLACEMENTS: Mutex<BTreeMap<TensorId, TensorPlacement>> = Mutex::new(BTreeMap::new());

/// Records where each of `module`'s own parameters lies, as the style made it: `layout(name)`
/// gives its placement (`Shard(d)` or `Partial`) and, for a `Shard`, the blocks stacked along
/// `d`. Call it after the module holds its final local tensors.
pub(crate) fn record_placements(
    module: &dyn Module,
    m: &MeshDim1,
    layout: impl Fn(&str) -> (Placement, usize),
) {
    let mut all = PLACEMENTS.lock().unwrap_or_else(PoisonError::into_inner);
    for (name, p) in module.local_parameters() {
        let (placement, stacked) = layout(&name);
        let mut global = p.shape().to_vec();
        let split = match placement.shard_dim(global.len()) {
            Some(dim) => {
                global[dim] *= m.world;
                Split::Blocks { dim, stacked }
            }
            None => Split::Whole,
        };
        let tp = TensorPlacement::split(
            global,
            p.dtype(),
            placement,
            split,
            m.group.clone(),
            (m.rank, m.world),
            p.shape().to_vec(),
        );
        all.insert(p.id(), tp);
    }
}

/// Where `t` lies, if it is a parameter a tensor-parallel style replaced by its local piece.
pub(crate) fn tp_placement(t: &Tensor) -> Option<TensorPlacement> {
    let all = PLACEMENTS.lock().unwrap_or_else(PoisonError::into_inner);
    all.get(&t.id()).cloned()
}
