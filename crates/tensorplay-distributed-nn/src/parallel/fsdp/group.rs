//! What one `fully_shard` call gathers and reduce-scatters together: the flat layout of its
//! parameters in the collectives' buffers, as pure arithmetic.
//!
//! Every rank's **block** holds, for each parameter of the group in order, its padded piece
//! ([`ShardSpec::padded_numel`] elements; the rank's rows first, then padding). The all-gather
//! input is the rank's block; its output is the `world` blocks in rank order. The
//! reduce-scatter input is the same `world` blocks built from the rank's full gradients, and
//! its output the rank's block of the sum. Because a parameter's rows go to the ranks in rank
//! order, the full parameter is the concatenation of its pieces taken from block 0, 1, ...

use std::ops::Range;

use super::param::ShardSpec;

/// The flat layout of a group's parameters (each with its [`ShardSpec`] over the same ranks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FlatLayout {
    specs: Vec<ShardSpec>,
    /// Where each parameter's padded piece starts in a block.
    offsets: Vec<usize>,
    block: usize,
    world: usize,
}

impl FlatLayout {
    /// The layout of parameters of these shapes over `world` ranks.
    pub(crate) fn new(shapes: &[Vec<usize>], world: usize) -> FlatLayout {
        let specs: Vec<ShardSpec> = shapes.iter().map(|s| ShardSpec::new(s, world)).collect();
        let mut offsets = Vec::with_capacity(specs.len());
        let mut at = 0;
        for s in &specs {
            offsets.push(at);
            at += s.padded_numel();
        }
        FlatLayout {
            specs,
            offsets,
            block: at,
            world: world.max(1),
        }
    }

    /// Elements of one rank's block (the all-gather's input, the reduce-scatter's output).
    pub(crate) fn block_numel(&self) -> usize {
        self.block
    }

    /// Elements of all blocks (the all-gather's output, the reduce-scatter's input).
    pub(crate) fn total_numel(&self) -> usize {
        self.block * self.world
    }

    /// Parameter `i`'s spec.
    pub(crate) fn spec(&self, i: usize) -> &ShardSpec {
        &self.specs[i]
    }

    /// Where rank `rank`'s shard of parameter `i` lies in the rank's own block (the rest of
    /// the padded piece is padding).
    pub(crate) fn in_block(&self, i: usize, rank: usize) -> Range<usize> {
        let o = self.offsets[i];
        o..o + self.specs[i].local_numel(rank)
    }

    /// The copies that take parameter `i` between the all-blocks buffer and the full
    /// parameter's contiguous elements: `(range in all blocks, range in the full parameter)`,
    /// one per rank holding rows, in rank order.
    pub(crate) fn pieces(&self, i: usize) -> Vec<(Range<usize>, Range<usize>)> {
        let s = &self.specs[i];
        (0..self.world)
            .filter_map(|r| {
                let rows = s.rows_of(r);
                if rows.is_empty() {
                    return None;
                }
                let inb = self.in_block(i, r);
                let src = r * self.block + inb.start..r * self.block + inb.end;
                Some((src, rows.start * s.row_numel..rows.end * s.row_numel))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulates `world` ranks, each holding every parameter in full with values that depend
    /// on the rank: the all-gather of the shards rebuilds rank 0's parameters, and the
    /// reduce-scatter of the ranks' "gradients" gives each rank its rows of the sum.
    #[test]
    fn gather_and_reduce_scatter_through_the_layout_match_whole_tensors() {
        let cases: [(&str, &[&[usize]], usize); 5] = [
            ("two even matrices", &[&[4, 3], &[8]], 2),
            (
                "uneven rows and a short last rank",
                &[&[5, 2], &[3], &[7, 1]],
                3,
            ),
            ("fewer rows than ranks", &[&[2, 3], &[1]], 4),
            ("a 0-d parameter", &[&[], &[6]], 2),
            ("one rank", &[&[3, 3]], 1),
        ];
        let full = |rank: usize, i: usize, n: usize| -> Vec<f64> {
            (0..n).map(|k| (rank * 1000 + i * 100 + k) as f64).collect()
        };
        let check = |(name, shapes, world): (&str, &[&[usize]], usize)| -> Result<(), String> {
            let shapes: Vec<Vec<usize>> = shapes.iter().map(|s| s.to_vec()).collect();
            let l = FlatLayout::new(&shapes, world);
            let numel = |i: usize| shapes[i].iter().product::<usize>();
            // all-gather: every rank packs its shards of rank 0's values into its block
            let mut all = vec![f64::NAN; l.total_numel()];
            for r in 0..world {
                for i in 0..shapes.len() {
                    let rows = l.spec(i).rows_of(r);
                    let rn = l.spec(i).row_numel;
                    let src = &full(0, i, numel(i))[rows.start * rn..rows.end * rn];
                    let dst = l.in_block(i, r);
                    all[r * l.block_numel()..][dst].copy_from_slice(src);
                }
            }
            for i in 0..shapes.len() {
                let mut rebuilt = vec![f64::NAN; numel(i)];
                for (src, dst) in l.pieces(i) {
                    rebuilt[dst].copy_from_slice(&all[src]);
                }
                if rebuilt != full(0, i, numel(i)) {
                    return Err(format!("{name}: parameter {i} gathered as {rebuilt:?}"));
                }
            }
            // reduce-scatter: every rank packs its full "gradients", padding zero; summed
            let mut sum = vec![0.0; l.total_numel()];
            for r in 0..world {
                let mut packed = vec![0.0; l.total_numel()];
                for i in 0..shapes.len() {
                    let g = full(r, i, numel(i));
                    for (dst, src) in l.pieces(i) {
                        packed[dst].copy_from_slice(&g[src]);
                    }
                }
                for (s, p) in sum.iter_mut().zip(&packed) {
                    *s += p;
                }
            }
            for r in 0..world {
                let block = &sum[r * l.block_numel()..(r + 1) * l.block_numel()];
                for i in 0..shapes.len() {
                    let rows = l.spec(i).rows_of(r);
                    let rn = l.spec(i).row_numel;
                    let want: Vec<f64> = (rows.start * rn..rows.end * rn)
                        .map(|k| (0..world).map(|q| full(q, i, numel(i))[k]).sum())
                        .collect();
                    if block[l.in_block(i, r)] != want[..] {
                        return Err(format!("{name}: rank {r} parameter {i} reduced wrong"));
                    }
                }
            }
            Ok(())
        };
        for c in cases {
            check(c).unwrap();
        }
    }
}
