//! The arithmetic of a device mesh, without processes: which shapes and names are valid, where
//! a rank sits in the mesh, and which ranks form the groups along each dimension.
//!
//! A mesh of shape `[d0, d1, ..]` lays its ranks out in row-major order (the last dimension
//! varies fastest), as `torch.arange(world).view(shape)` does: with shape `[2, 2]` and names
//! `["dp", "tp"]`, ranks 0 and 1 share a `"tp"` group, ranks 0 and 2 a `"dp"` group.

use crate::{Error, Result};

/// Checks a mesh's `shape` and dimension `names` against the number of ranks it must cover
/// (`ranks`). `op` names the caller in the error; `rank` is this process's global rank (-1
/// when unknown).
///
/// # Errors
/// [`Error::InvalidArgument`] naming the argument: an empty `shape` or a zero extent
/// (`mesh_shape`), names not one per dimension, empty or repeated (`mesh_dim_names`), or a
/// shape whose product differs from `ranks` (`mesh_shape`, "the world size").
pub(crate) fn validate(
    op: &str,
    rank: i64,
    shape: &[usize],
    names: &[&str],
    ranks: usize,
) -> Result<()> {
    let bad = |arg: &str, expected: String, got: String| {
        Err(Error::invalid(op, rank, arg, expected, got))
    };
    if shape.is_empty() || shape.contains(&0) {
        return bad(
            "mesh_shape",
            "at least one dimension, each of extent 1 or more".into(),
            format!("{shape:?}"),
        );
    }
    if names.len() != shape.len() {
        return bad(
            "mesh_dim_names",
            format!("one name per dimension of mesh_shape {shape:?}"),
            format!("{names:?}"),
        );
    }
    for (i, n) in names.iter().enumerate() {
        if n.is_empty() || names[..i].contains(n) {
            return bad(
                "mesh_dim_names",
                "distinct, non-empty names".into(),
                format!("{names:?}"),
            );
        }
    }
    let product = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    if product != Some(ranks) {
        return bad(
            "mesh_shape",
            format!("extents whose product is the world size {ranks}"),
            format!("{shape:?}"),
        );
    }
    Ok(())
}

/// The coordinates of the mesh position `index` (`0..product(shape)`), row-major.
pub(crate) fn coordinates(shape: &[usize], index: usize) -> Vec<usize> {
    let mut coords = vec![0; shape.len()];
    let mut rest = index;
    for (c, &d) in coords.iter_mut().zip(shape).rev() {
        *c = rest % d;
        rest /= d;
    }
    coords
}

/// The row-major position of `coords` in a mesh of `shape`.
pub(crate) fn index_of(shape: &[usize], coords: &[usize]) -> usize {
    coords
        .iter()
        .zip(shape)
        .fold(0, |acc, (&c, &d)| acc * d + c)
}

/// Every group along dimension `dim` of a mesh of `shape`, as mesh positions: one group per
/// position of the other dimensions (in row-major order of those), each listing the positions
/// that differ only in `dim`, by increasing coordinate. This is the order in which every rank
/// creates the groups of `dim`.
pub(crate) fn groups_along(shape: &[usize], dim: usize) -> Vec<Vec<usize>> {
    let total: usize = shape.iter().product();
    let mut groups = Vec::with_capacity(total / shape[dim]);
    for start in 0..total {
        let mut c = coordinates(shape, start);
        if c[dim] != 0 {
            continue;
        }
        groups.push(
            (0..shape[dim])
                .map(|k| {
                    c[dim] = k;
                    index_of(shape, &c)
                })
                .collect(),
        );
    }
    groups
}
