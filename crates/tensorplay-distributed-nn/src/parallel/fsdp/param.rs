//! One fully sharded parameter's rows: dimension 0 split as `torch.chunk` splits it, each
//! rank's piece padded to the common chunk size for the collectives (FSDP2's rule).
//!
//! With `n` rows over `world` ranks the chunk size is `ceil(n / world)`; rank `r` holds rows
//! `r * chunk .. min((r + 1) * chunk, n)`, so the last ranks may hold fewer rows, or none
//! (`n < world` works). In the all-gather and reduce-scatter buffers every rank's piece takes
//! `chunk` rows, the missing ones as padding.

use std::ops::Range;

/// How dimension 0 of one parameter is split across the ranks of a mesh dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ShardSpec {
    /// Rows of the full parameter (its dimension 0; 1 for a 0-d parameter).
    pub(crate) rows: usize,
    /// Elements per row (the product of the other dimensions).
    pub(crate) row_numel: usize,
    /// Ranks sharing the parameter.
    pub(crate) world: usize,
}

impl ShardSpec {
    /// The spec of a parameter of `shape` over `world` ranks (`world >= 1`).
    pub(crate) fn new(shape: &[usize], world: usize) -> ShardSpec {
        let (rows, row_numel) = match shape.split_first() {
            Some((&d0, rest)) => (d0, rest.iter().product()),
            None => (1, 1),
        };
        ShardSpec {
            rows,
            row_numel,
            world: world.max(1),
        }
    }

    /// Rows per rank in the collectives' buffers: `ceil(rows / world)`.
    pub(crate) fn chunk_rows(&self) -> usize {
        self.rows.div_ceil(self.world)
    }

    /// The full parameter's rows that rank `rank` holds (empty past the last chunk).
    pub(crate) fn rows_of(&self, rank: usize) -> Range<usize> {
        let c = self.chunk_rows();
        let start = (rank * c).min(self.rows);
        start..((rank + 1) * c).min(self.rows)
    }

    /// Elements rank `rank` holds (its unpadded shard).
    pub(crate) fn local_numel(&self, rank: usize) -> usize {
        self.rows_of(rank).len() * self.row_numel
    }

    /// Elements of every rank's padded piece in the collectives' buffers.
    pub(crate) fn padded_numel(&self) -> usize {
        self.chunk_rows() * self.row_numel
    }

    /// The shape of rank `rank`'s shard of a parameter of `shape`: dimension 0 replaced by the
    /// rows it holds (a 0-d parameter's shard is 1-d: one element on rank 0, none elsewhere).
    pub(crate) fn local_shape(&self, shape: &[usize], rank: usize) -> Vec<usize> {
        let rows = self.rows_of(rank).len();
        match shape.split_first() {
            Some((_, rest)) => std::iter::once(rows).chain(rest.iter().copied()).collect(),
            None => vec![rows],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (case, shape, world, rows per rank, chunk rows)
    type Case = (
        &'static str,
        &'static [usize],
        usize,
        &'static [usize],
        usize,
    );

    #[test]
    fn rows_follow_torch_chunk() {
        let cases: [Case; 6] = [
            ("even", &[8, 3], 4, &[2, 2, 2, 2], 2),
            ("uneven, last short", &[10, 2], 4, &[3, 3, 3, 1], 3),
            ("last ranks empty", &[5], 4, &[2, 2, 1, 0], 2),
            ("fewer rows than ranks", &[2, 7], 4, &[1, 1, 0, 0], 1),
            ("one rank", &[3, 3], 1, &[3], 3),
            ("0-d parameter", &[], 2, &[1, 0], 1),
        ];
        let check = |(name, shape, world, want, chunk): Case| -> Result<(), String> {
            let s = ShardSpec::new(shape, world);
            let got: Vec<usize> = (0..world).map(|r| s.rows_of(r).len()).collect();
            if got != want || s.chunk_rows() != chunk {
                return Err(format!(
                    "{name}: rows {got:?} chunk {}, want {want:?} chunk {chunk}",
                    s.chunk_rows()
                ));
            }
            // the pieces tile the rows in rank order, and the shards' elements add up
            let mut next = 0;
            for r in 0..world {
                let rr = s.rows_of(r);
                if rr.start != next.min(s.rows) {
                    return Err(format!("{name}: rank {r} starts at {}", rr.start));
                }
                next = rr.end;
                let ls = s.local_shape(shape, r);
                if ls.iter().product::<usize>() != s.local_numel(r) {
                    return Err(format!("{name}: rank {r} shape {ls:?}"));
                }
            }
            let total: usize = (0..world).map(|r| s.local_numel(r)).sum();
            if next != s.rows || total != shape.iter().product::<usize>() {
                return Err(format!("{name}: covers {next} rows, {total} elements"));
            }
            Ok(())
        };
        for c in cases {
            check(c).unwrap();
        }
    }
}
