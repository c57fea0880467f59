//! Where one state-dict entry lives: [`TensorPlacement`] (the whole tensor's shape, how the
//! ranks of one mesh dimension split it, this rank's chunks) and the two moves between a local
//! piece and the whole: [`TensorPlacement::gather`] (collective) and
//! [`TensorPlacement::slice`] (local).

use std::sync::Arc;

use tensorplay_collectives::{self as dist, ProcessGroup, ReduceOp};
use tensorplay_core::{DType, Result, Tensor, no_grad};

use super::super::planner::{LocalChunk, compose_rows};
use crate::tensor::Placement;

/// One piece of a tensor as offsets and sizes in the whole tensor's coordinates, one per
/// dimension (PyTorch's `ChunkStorageMetadata`): the piece is
/// `whole[offsets[0]..offsets[0] + sizes[0], ...]`. A 0-d tensor's only chunk has empty
/// `offsets` and `sizes`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ChunkStorageMetadata {
    /// Where the piece starts, per dimension of the whole tensor.
    pub offsets: Vec<usize>,
    /// The piece's extent, per dimension of the whole tensor.
    pub sizes: Vec<usize>,
}

impl ChunkStorageMetadata {
    /// Elements in the piece.
    pub fn numel(&self) -> usize {
        self.sizes.iter().product()
    }
}

/// How the local pieces of a split tensor are laid out, for gathering and slicing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Split {
    /// Whole on every rank.
    Whole,
    /// `torch.chunk` rows along dimension 0, `ceil(rows / world)` per rank (fully sharded).
    Rows,
    /// `stacked` equal blocks along `dim`, each cut in `world` equal chunks; a rank's piece is
    /// its chunk of every block, concatenated (tensor parallelism).
    Blocks { dim: usize, stacked: usize },
}

/// Where one entry of a model's (or an optimizer's) state dict lives on this rank: the whole
/// tensor's shape and dtype, how the ranks of one mesh dimension hold it, and the chunks of the
/// whole that this rank's local tensor is made of. [`get_model_state_dict`] returns local
/// tensors; [`model_state_dict_placements`] says, per fully qualified name, where each lies;
/// a resharding load intersects these chunks with the chunks on disk.
///
/// - `Replicate`: every rank holds the whole (one chunk covering it);
/// - `Shard(d)`: the ranks hold disjoint pieces along dimension `d` (fully sharded parameters:
///   `Shard(0)`, rows as `torch.chunk` splits them, the last ranks possibly short or empty;
///   tensor parallelism: equal pieces, a stacked block layout as several chunks);
/// - `Partial`: every rank holds a tensor of the whole shape and the whole is their sum (a
///   row-parallel Linear's bias: rank 0 holds it, the others zeros).
///
/// The local tensor is this rank's chunks in order, concatenated along the shard dimension,
/// of shape [`local_shape`](TensorPlacement::local_shape) (a fully sharded 0-d parameter's
/// local tensor is 1-d: one element on rank 0, none elsewhere).
///
/// [`get_model_state_dict`]: super::get_model_state_dict
/// [`model_state_dict_placements`]: super::model_state_dict_placements
#[derive(Debug, Clone)]
pub struct TensorPlacement {
    /// The whole tensor's shape.
    pub global_shape: Vec<usize>,
    /// The tensor's dtype.
    pub dtype: DType,
    /// How the mesh dimension's ranks hold it.
    pub placement: Placement,
    /// The mesh dimension the placement is over (0: the sharding APIs take 1-D meshes).
    pub mesh_dim: usize,
    /// This rank's coordinate along the mesh dimension (0 when replicated on no mesh).
    pub mesh_rank: usize,
    /// Ranks along the mesh dimension (1 when replicated on no mesh).
    pub mesh_size: usize,
    /// The local tensor's shape.
    pub local_shape: Vec<usize>,
    /// The chunks of the whole this rank holds, in the local tensor's order (none: this rank
    /// holds no element).
    pub chunks: Vec<ChunkStorageMetadata>,
    pub(crate) split: Split,
    pub(crate) group: Option<ProcessGroup>,
    /// A 2-D placement's two splits: the fields above then describe the whole tensor and the
    /// second split's ranks (fully sharded rows of a tensor-parallel piece).
    pub(crate) levels: Option<Arc<Levels>>,
}

/// The two splits of a 2-D placement: tensor parallelism cut `piece` from the whole tensor,
/// then fully sharding cut `rows` (a `Split::Rows` placement whose whole is the piece).
#[derive(Debug)]
pub(crate) struct Levels {
    pub(crate) piece: TensorPlacement,
    pub(crate) rows: TensorPlacement,
}

impl TensorPlacement {
    /// A tensor every rank holds whole.
    pub(crate) fn replicated(t: &Tensor) -> TensorPlacement {
        let shape = t.shape().to_vec();
        TensorPlacement {
            chunks: vec![ChunkStorageMetadata {
                offsets: vec![0; shape.len()],
                sizes: shape.clone(),
            }],
            global_shape: shape.clone(),
            dtype: t.dtype(),
            placement: Placement::Replicate,
            mesh_dim: 0,
            mesh_rank: 0,
            mesh_size: 1,
            local_shape: shape,
            split: Split::Whole,
            group: None,
            levels: None,
        }
    }

    /// A tensor split as `split` over `group` (this rank `rank` of `world`); `local_shape` is
    /// the local tensor's. A Partial tensor is `Split::Whole` with `placement` Partial.
    pub(crate) fn split(
        global_shape: Vec<usize>,
        dtype: DType,
        placement: Placement,
        split: Split,
        group: ProcessGroup,
        (rank, world): (usize, usize),
        local_shape: Vec<usize>,
    ) -> TensorPlacement {
        let mut p = TensorPlacement {
            global_shape,
            dtype,
            placement,
            mesh_dim: 0,
            mesh_rank: rank,
            mesh_size: world,
            local_shape,
            chunks: Vec::new(),
            split,
            group: Some(group),
            levels: None,
        };
        p.chunks = p.chunks_of(rank);
        p
    }

    /// A 2-D placement: `rows` (fully sharded rows, whose whole is the local piece) of the
    /// tensor-parallel `piece`. Its shape, dtype and chunks are the whole tensor's; its
    /// placement, mesh rank and size are the fully sharded split's.
    pub(crate) fn two_d(piece: TensorPlacement, rows: TensorPlacement) -> TensorPlacement {
        let kept = compose_rows(&piece.held_chunks(), kept_rows(&rows));
        TensorPlacement {
            global_shape: piece.global_shape.clone(),
            dtype: rows.dtype,
            placement: rows.placement,
            mesh_dim: rows.mesh_dim,
            mesh_rank: rows.mesh_rank,
            mesh_size: rows.mesh_size,
            local_shape: rows.local_shape.clone(),
            chunks: kept.into_iter().map(|c| c.chunk).collect(),
            split: rows.split.clone(),
            group: rows.group.clone(),
            levels: Some(Arc::new(Levels { piece, rows })),
        }
    }

    /// The ranks a `Partial` tensor is summed over and this rank among them: its own group,
    /// or a 2-D placement's tensor-parallel group when that split is `Partial`.
    pub(crate) fn partial_over(&self) -> Option<(&ProcessGroup, usize)> {
        let p = match &self.levels {
            Some(l) => &l.piece,
            None => self,
        };
        if p.placement != Placement::Partial || p.mesh_size <= 1 {
            return None;
        }
        p.group.as_ref().map(|g| (g, p.mesh_rank))
    }

    /// Whether the ranks hold different values (a `Shard` or `Partial` placement over more
    /// than one rank).
    pub fn is_sharded(&self) -> bool {
        self.levels.as_ref().is_some_and(|l| l.piece.is_sharded())
            || (self.mesh_size > 1 && self.placement != Placement::Replicate)
    }

    /// The chunks of the whole rank `rank` of the mesh dimension holds.
    /// For a 2-D placement, `rank` is along the fully sharded split, at this rank's place in the
    /// tensor-parallel one.
    pub fn chunks_of(&self, rank: usize) -> Vec<ChunkStorageMetadata> {
        if let Some(l) = &self.levels {
            let rows = kept_rows(&l.rows.with_rank(rank));
            return compose_rows(&l.piece.held_chunks(), rows)
                .into_iter()
                .map(|c| c.chunk)
                .collect();
        }
        let g = &self.global_shape;
        let whole = || ChunkStorageMetadata {
            offsets: vec![0; g.len()],
            sizes: g.clone(),
        };
        match self.split {
            Split::Whole => vec![whole()],
            Split::Rows => {
                let rows = g.first().copied().unwrap_or(1);
                let chunk = rows.div_ceil(self.mesh_size.max(1));
                let start = (rank * chunk).min(rows);
                let end = ((rank + 1) * chunk).min(rows);
                if start == end {
                    return Vec::new();
                }
                if g.is_empty() {
                    return vec![whole()];
                }
                let mut c = whole();
                c.offsets[0] = start;
                c.sizes[0] = end - start;
                vec![c]
            }
            Split::Blocks { dim, stacked } => {
                let block = g[dim] / stacked.max(1);
                let piece = block / self.mesh_size.max(1);
                (0..stacked)
                    .map(|i| {
                        let mut c = whole();
                        c.offsets[dim] = i * block + rank * piece;
                        c.sizes[dim] = piece;
                        c
                    })
                    .collect()
            }
        }
    }

    /// This rank's pieces with where each starts in its local tensor (the chunks follow each
    /// other along the shard dimension). A `Partial` tensor's rank 0 of the mesh dimension holds
    /// the whole (the others' parts are zeroed by a load), as setting a whole state dict cuts it.
    pub fn local_chunks(&self) -> Vec<LocalChunk> {
        if self.partial_over().is_some_and(|(_, rank)| rank != 0) {
            return Vec::new();
        }
        self.held_chunks()
    }

    /// [`local_chunks`](Self::local_chunks) on every rank, a `Partial` tensor's included (what
    /// its sum over the ranks holds).
    pub(crate) fn held_chunks(&self) -> Vec<LocalChunk> {
        if let Some(l) = &self.levels {
            return compose_rows(&l.piece.held_chunks(), kept_rows(&l.rows));
        }
        let nd = self.global_shape.len();
        if self.placement == Placement::Partial {
            return vec![LocalChunk {
                chunk: ChunkStorageMetadata {
                    offsets: vec![0; nd],
                    sizes: self.global_shape.clone(),
                },
                local_offsets: vec![0; nd],
            }];
        }
        let d = self.dim();
        let mut at = 0;
        self.chunks
            .iter()
            .map(|c| {
                let mut local_offsets = vec![0; nd];
                if nd > 0 {
                    local_offsets[d] = at;
                    at += c.sizes[d];
                }
                LocalChunk {
                    chunk: c.clone(),
                    local_offsets,
                }
            })
            .collect()
    }

    /// This placement as rank `rank` of its mesh dimension would hold it (one level).
    fn with_rank(&self, rank: usize) -> TensorPlacement {
        let mut p = self.clone();
        p.mesh_rank = rank;
        p.chunks = p.chunks_of(rank);
        p
    }

    /// The dimension the chunks are cut along (0 when whole).
    fn dim(&self) -> usize {
        match self.split {
            Split::Blocks { dim, .. } => dim,
            Split::Whole | Split::Rows => 0,
        }
    }

    /// The shape the gathering and slicing work in: a 0-d tensor as `[1]`.
    fn work_shape(&self) -> Vec<usize> {
        if self.global_shape.is_empty() {
            vec![1]
        } else {
            self.global_shape.clone()
        }
    }

    /// Copies `chunks` between `whole` (of [`Self::work_shape`]) and `local` (the chunks
    /// concatenated along the shard dimension): `to_local` picks the direction.
    fn copy_chunks(
        &self,
        chunks: &[ChunkStorageMetadata],
        whole: &Tensor,
        local: &Tensor,
        to_local: bool,
    ) -> Result<()> {
        let d = self.dim();
        let mut at = 0;
        for c in chunks {
            let (off, size) = if self.global_shape.is_empty() {
                (0, 1)
            } else {
                (c.offsets[d], c.sizes[d])
            };
            let w = whole.narrow(d as isize, off, size)?;
            let l = local.narrow(d as isize, at, size)?;
            if to_local {
                l.copy_(&w)?
            } else {
                w.copy_(&l)?
            };
            at += size;
        }
        Ok(())
    }

    /// The whole tensor from every rank's `local` (this rank's piece, of
    /// [`local_shape`](Self::local_shape)): one all-gather over the mesh dimension for a
    /// `Shard`, one all-reduce for a `Partial`, a copy for a `Replicate`. A new tensor on
    /// `local`'s device without autograd history. Collective over the placement's group.
    pub(crate) fn gather(&self, local: &Tensor) -> Result<Tensor> {
        if let Some(l) = &self.levels {
            return l.piece.gather(&l.rows.gather(local)?);
        }
        let _g = no_grad();
        let local = local.detach();
        let Some(group) = self.group.as_ref().filter(|_| self.mesh_size > 1) else {
            return local.deep_clone();
        };
        if self.placement == Placement::Partial {
            let sum = local.deep_clone()?;
            dist::all_reduce(&sum, ReduceOp::Sum, Some(group))?;
            return Ok(sum);
        }
        if matches!(self.split, Split::Whole) {
            return local.deep_clone();
        }
        let world = self.mesh_size;
        let work = self.work_shape();
        let numel_of = |r: usize| -> usize {
            self.chunks_of(r)
                .iter()
                .map(|c| {
                    if self.global_shape.is_empty() {
                        1
                    } else {
                        c.numel()
                    }
                })
                .sum()
        };
        let padded = (0..world).map(numel_of).max().unwrap_or(0);
        let opts = (local.dtype(), local.device());
        let block = Tensor::zeros(&[padded], opts)?;
        let mine = local.numel();
        if mine > 0 {
            block
                .narrow(0, 0, mine)?
                .copy_(&local.contiguous()?.reshape(&[mine])?)?;
        }
        let all = Tensor::zeros(&[padded * world], opts)?;
        dist::all_gather_into_tensor(&all, &block, Some(group))?;
        let whole = Tensor::zeros(&work, opts)?;
        let d = self.dim();
        for r in 0..world {
            let chunks = self.chunks_of(r);
            if chunks.is_empty() {
                continue;
            }
            let mut shape = work.clone();
            shape[d] = chunks
                .iter()
                .map(|c| {
                    if self.global_shape.is_empty() {
                        1
                    } else {
                        c.sizes[d]
                    }
                })
                .sum();
            let n = shape.iter().product();
            let piece = all.narrow(0, r * padded, n)?.reshape(&shape)?;
            self.copy_chunks(&chunks, &whole, &piece, false)?;
        }
        whole.reshape(&self.global_shape)
    }

    /// This rank's local tensor cut from `whole` (of [`global_shape`](Self::global_shape)):
    /// its chunks; for a `Partial` placement the whole on mesh rank 0 and zeros elsewhere. A new
    /// tensor on `whole`'s device. Not collective.
    pub(crate) fn slice(&self, whole: &Tensor) -> Result<Tensor> {
        if let Some(l) = &self.levels {
            return l.rows.slice(&l.piece.slice(whole)?);
        }
        let _g = no_grad();
        let whole = whole.detach();
        if self.placement == Placement::Partial && self.mesh_rank != 0 {
            return whole.zeros_like();
        }
        if matches!(self.split, Split::Whole) {
            return whole.contiguous()?.deep_clone();
        }
        let work = whole.reshape(&self.work_shape())?;
        let local = Tensor::zeros(&self.local_shape, (whole.dtype(), whole.device()))?;
        if self.global_shape.is_empty() {
            // a 0-d parameter's shard: [1] on the rank holding it, [0] elsewhere
            if !self.chunks.is_empty() {
                local.copy_(&work)?;
            }
            return Ok(local);
        }
        self.copy_chunks(&self.chunks, &work, &local, true)?;
        Ok(local)
    }
}

/// The rows of its whole a `Split::Rows` placement's rank keeps (a 0-d tensor's one "row").
fn kept_rows(rows: &TensorPlacement) -> std::ops::Range<usize> {
    match rows.chunks.first() {
        Some(c) if !c.sizes.is_empty() => c.offsets[0]..c.offsets[0] + c.sizes[0],
        Some(_) => 0..1,
        None => 0..0,
    }
}
