//! The chunk arithmetic of tensor parallelism: a rank's piece of a full tensor (optionally
//! made of stacked blocks, each split across the ranks), and the inverse, a whole rebuilt
//! from every rank's piece.

use tensorplay_core::{Error, Result, Tensor, cat};

/// An [`Error::InvalidArgument`] of the tensor-parallel API.
pub(crate) fn invalid(
    op: &'static str,
    arg: &'static str,
    expected: impl Into<String>,
    got: impl std::fmt::Display,
) -> Error {
    Error::InvalidArgument {
        op,
        arg,
        expected: expected.into(),
        got: got.to_string(),
    }
}

/// Rank `rank`'s piece (of `world`) of `full` along dimension `dim`, where `full` is `stacked`
/// equal blocks along `dim` and every block is split in `world` equal chunks: the rank's
/// chunk of each block, concatenated in block order. With `stacked == 1` this is the `rank`-th
/// of `world` equal chunks (`Shard(dim)`). A new contiguous tensor that does not require grad.
///
/// # Errors
/// [`Error::InvalidArgument`] (naming `name`) when `full` lacks dimension `dim`, or
/// `stacked * world` does not divide its extent; `rank >= world`.
pub(crate) fn chunk(
    op: &'static str,
    name: &str,
    full: &Tensor,
    dim: usize,
    stacked: usize,
    rank: usize,
    world: usize,
) -> Result<Tensor> {
    if rank >= world || stacked == 0 {
        return Err(invalid(
            op,
            "rank",
            format!("less than the mesh dimension's size {world}, with at least one block"),
            format!("rank {rank}, {stacked} blocks"),
        ));
    }
    let full = full.detach();
    if full.ndim() <= dim {
        return Err(invalid(
            op,
            "module",
            format!("a parameter `{name}` with a dimension {dim} to split"),
            format!("shape {:?}", full.shape()),
        ));
    }
    let n = full.shape()[dim];
    if !n.is_multiple_of(stacked * world) {
        let what = if stacked == 1 {
            format!("dimension {dim} of `{name}` divisible by the mesh size {world}")
        } else {
            format!(
                "dimension {dim} of `{name}` made of {stacked} stacked blocks, each divisible by \
                 the mesh size {world} (a multiple of {})",
                stacked * world
            )
        };
        return Err(invalid(
            op,
            "module",
            what,
            format!("shape {:?}", full.shape()),
        ));
    }
    let block = n / stacked;
    let piece = block / world;
    let d = dim as isize;
    let out = if stacked == 1 {
        full.narrow(d, rank * piece, piece)?
    } else {
        let parts = (0..stacked)
            .map(|i| full.narrow(d, i * block + rank * piece, piece))
            .collect::<Result<Vec<_>>>()?;
        cat(&parts, d)?
    };
    out.contiguous()?.deep_clone()
}

/// The whole rebuilt from every rank's piece along dimension `dim` (`pieces[r]` is rank `r`'s,
/// as [`chunk`] cuts them): with `stacked` blocks, block `i` is the ranks' `i`-th chunks in
/// rank order. Differentiable (narrow and cat).
pub(crate) fn unchunk(pieces: &[Tensor], dim: usize, stacked: usize) -> Result<Tensor> {
    if stacked == 1 {
        return cat(pieces, dim as isize);
    }
    let piece = pieces[0].shape()[dim] / stacked;
    let mut parts = Vec::with_capacity(pieces.len() * stacked);
    for i in 0..stacked {
        for p in pieces {
            parts.push(p.narrow(dim as isize, i * piece, piece)?);
        }
    }
    cat(&parts, dim as isize)
}
