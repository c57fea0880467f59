//! [`ColwiseParallel`]: a Linear split by output features (its weight's rows).

use tensorplay_collectives::device_mesh::DeviceMesh;
use tensorplay_core::nn::Module;
use tensorplay_core::{Result, Tensor};

use super::shard::{chunk, invalid, unchunk};
use super::style::{ParallelStyle, mesh_1d, record_placements, replace_parameters};
use crate::functional::{all_gather, copy_to_group};
use crate::tensor::Placement;

const OP: &str = "ColwiseParallel";

/// Column-wise parallelism of a Linear-like module
/// (`torch.distributed.tensor.parallel.ColwiseParallel`): rank `r` of `W` holds rows
/// `r*n/W .. (r+1)*n/W` of the weight `[n, in]` and of the bias `[n]`, so it computes its
/// `n/W` output features.
///
/// - `input_layouts` (default [`Placement::Replicate`]): the layout of the input the module
///   receives. A replicated input goes through
///   [`copy_to_group`](crate::functional::copy_to_group) (identity forward; backward, the
///   ranks' input gradients are summed); `Shard(d)` (sequence parallelism) is all-gathered
///   along `d` first.
/// - `output_layouts` (default `Shard(-1)`): `Shard(-1)` leaves each rank its features (what a
///   following [`RowwiseParallel`](super::RowwiseParallel) expects); `Replicate` all-gathers
///   them into the whole output on every rank (backward, each rank keeps its piece of the
///   gradient: no communication).
/// - `use_local_output` (default true): return plain local tensors; `false` (a `DTensor` in
///   PyTorch) is refused, there is no distributed tensor type here.
/// - [`stacked(k)`](ColwiseParallel::stacked) (no PyTorch equivalent): the weight is `k`
///   blocks stacked along its rows (a fused query/key/value projection: `k = 3`), and each
///   block is split across the ranks, so rank `r` holds the `r`-th chunk of every block,
///   block after block. The module's output on a rank is then its `k` chunks side by side.
///
/// The gradient convention is Megatron's: every rank computes the full loss and calls
/// `backward` on it; each shard's gradient is then its slice of the single-process gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColwiseParallel {
    input_layouts: Placement,
    output_layouts: Placement,
    use_local_output: bool,
    stacked: usize,
}

impl Default for ColwiseParallel {
    fn default() -> Self {
        ColwiseParallel::new()
    }
}

impl ColwiseParallel {
    /// The default style: replicated input, output sharded along its last dimension, local
    /// tensors, one block.
    pub const fn new() -> ColwiseParallel {
        ColwiseParallel {
            input_layouts: Placement::Replicate,
            output_layouts: Placement::Shard(-1),
            use_local_output: true,
            stacked: 1,
        }
    }

    /// The layout of the module's input (`input_layouts`): `Replicate` or `Shard(d)`.
    pub const fn input_layouts(mut self, layout: Placement) -> ColwiseParallel {
        self.input_layouts = layout;
        self
    }

    /// The layout the output is turned into (`output_layouts`): `Shard(-1)` or `Replicate`.
    pub const fn output_layouts(mut self, layout: Placement) -> ColwiseParallel {
        self.output_layouts = layout;
        self
    }

    /// Whether the output is a local tensor (`use_local_output`); only `true` is supported.
    pub const fn use_local_output(mut self, local: bool) -> ColwiseParallel {
        self.use_local_output = local;
        self
    }

    /// The weight's rows (and the bias) are `blocks` equal blocks stacked, each split across
    /// the ranks (see the type's page); `1` is the plain split.
    pub const fn stacked(mut self, blocks: usize) -> ColwiseParallel {
        self.stacked = blocks;
        self
    }

    fn check(&self, path: &str) -> Result<()> {
        let got = |what: &str| format!("{what} for `{path}`");
        if !self.use_local_output {
            return Err(invalid(
                OP,
                "use_local_output",
                "true (there is no distributed tensor type to return)",
                got("false"),
            ));
        }
        if self.input_layouts == Placement::Partial {
            return Err(invalid(
                OP,
                "input_layouts",
                "Replicate() or Shard(d)",
                got("Partial()"),
            ));
        }
        if !matches!(
            self.output_layouts,
            Placement::Replicate | Placement::Shard(-1)
        ) {
            return Err(invalid(
                OP,
                "output_layouts",
                "Shard(-1) or Replicate()",
                got(&self.output_layouts.to_string()),
            ));
        }
        if self.stacked == 0 {
            return Err(invalid(OP, "stacked", "at least 1 block", got("0")));
        }
        Ok(())
    }
}

impl ParallelStyle for ColwiseParallel {
    fn apply(&self, path: &str, module: &mut dyn Module, mesh: &DeviceMesh) -> Result<()> {
        self.check(path)?;
        let m = mesh_1d(OP, mesh)?;
        replace_parameters(OP, path, module, |name, full| {
            chunk(OP, name, full, 0, self.stacked, m.rank, m.world)
        })?;
        record_placements(module, &m, |_| (Placement::Shard(0), self.stacked));
        let input = self.input_layouts;
        let group = m.group.clone();
        module.register_forward_pre_hook(Box::new(move |x: &Tensor| {
            Ok(Some(match input {
                Placement::Shard(d) => {
                    let dim = input.shard_dim(x.ndim()).ok_or_else(|| {
                        invalid(
                            OP,
                            "input_layouts",
                            format!("a dimension of the {}-d input", x.ndim()),
                            format!("Shard({d})"),
                        )
                    })?;
                    unchunk(&all_gather(x, Some(&group))?, dim, 1)?
                }
                _ => copy_to_group(x, Some(&group))?,
            }))
        }))?;
        if self.output_layouts == Placement::Replicate {
            let (group, rank, stacked) = (m.group, m.rank, self.stacked);
            module.register_forward_hook(Box::new(move |_x: &Tensor, y: &Tensor| {
                // Megatron's gather: the other ranks' pieces come in as values, this rank's
                // stays on the graph, so backward keeps only this rank's piece of the gradient
                // (every rank holds the whole gradient of the whole output already)
                let mut pieces = all_gather(&y.detach(), Some(&group))?;
                pieces[rank] = y.clone();
                let last = y.ndim().saturating_sub(1);
                Ok(Some(unchunk(&pieces, last, stacked)?))
            }))?;
        }
        Ok(())
    }

    fn shard_parameter(
        &self,
        name: &str,
        full: &Tensor,
        rank: usize,
        world: usize,
    ) -> Result<Tensor> {
        chunk(OP, name, full, 0, self.stacked, rank, world)
    }
}
