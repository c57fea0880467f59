//! [`RowwiseParallel`]: a Linear split by input features (its weight's columns).

use tensorplay_collectives::device_mesh::DeviceMesh;
use tensorplay_core::nn::Module;
use tensorplay_core::{Result, Tensor};

use super::shard::{chunk, invalid};
use super::style::{ParallelStyle, mesh_1d, record_placements, replace_parameters};
use crate::functional::{copy_to_group, reduce_from_group};
use crate::tensor::Placement;

const OP: &str = "RowwiseParallel";

/// Row-wise parallelism of a Linear-like module
/// (`torch.distributed.tensor.parallel.RowwiseParallel`): rank `r` of `W` holds columns
/// `r*k/W .. (r+1)*k/W` of the weight `[out, k]`, so it multiplies its `k/W` input features
/// and produces a partial sum of the output; the partial sums are added across the ranks.
///
/// - `input_layouts` (default `Shard(-1)`): the input already holds this rank's features (the
///   output of a [`ColwiseParallel`](super::ColwiseParallel)); `Replicate`: every rank has
///   the whole input and takes its features (backward, the ranks' pieces of the input
///   gradient are put back together on every rank).
/// - `output_layouts` (default [`Placement::Replicate`]): the partial sums are added with
///   [`reduce_from_group`](crate::functional::reduce_from_group) (an all-reduce forward,
///   identity backward), so every rank holds the whole output.
/// - `use_local_output` (default true): plain local tensors; `false` is refused.
///
/// **The bias** is added once: its placement is [`Placement::Partial`] — the mesh
/// dimension's rank 0 holds its value (and trains it: its gradient is the single-process
/// one), the other ranks hold zeros that do not require grad — so the sum of the ranks'
/// outputs `x_r W_r^T + b_r` counts it once. (PyTorch keeps a replicated bias and divides it
/// by `W` inside the sum; a frozen zero keeps the values exact and the optimizer's work on
/// one rank.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowwiseParallel {
    input_layouts: Placement,
    output_layouts: Placement,
    use_local_output: bool,
}

impl Default for RowwiseParallel {
    fn default() -> Self {
        RowwiseParallel::new()
    }
}

impl RowwiseParallel {
    /// The default style: input sharded along its last dimension, output replicated, local
    /// tensors.
    pub const fn new() -> RowwiseParallel {
        RowwiseParallel {
            input_layouts: Placement::Shard(-1),
            output_layouts: Placement::Replicate,
            use_local_output: true,
        }
    }

    /// The layout of the module's input (`input_layouts`): `Shard(-1)` or `Replicate`.
    pub const fn input_layouts(mut self, layout: Placement) -> RowwiseParallel {
        self.input_layouts = layout;
        self
    }

    /// The layout the output is turned into (`output_layouts`): `Replicate` (sequence
    /// parallelism's `Shard(d)` output, a reduce-scatter, is not supported yet).
    pub const fn output_layouts(mut self, layout: Placement) -> RowwiseParallel {
        self.output_layouts = layout;
        self
    }

    /// Whether the output is a local tensor (`use_local_output`); only `true` is supported.
    pub const fn use_local_output(mut self, local: bool) -> RowwiseParallel {
        self.use_local_output = local;
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
        if !matches!(
            self.input_layouts,
            Placement::Replicate | Placement::Shard(-1)
        ) {
            return Err(invalid(
                OP,
                "input_layouts",
                "Shard(-1) or Replicate()",
                got(&self.input_layouts.to_string()),
            ));
        }
        if self.output_layouts != Placement::Replicate {
            return Err(invalid(
                OP,
                "output_layouts",
                "Replicate() (a Shard output is not supported yet)",
                got(&self.output_layouts.to_string()),
            ));
        }
        Ok(())
    }
}

impl ParallelStyle for RowwiseParallel {
    fn apply(&self, path: &str, module: &mut dyn Module, mesh: &DeviceMesh) -> Result<()> {
        self.check(path)?;
        let m = mesh_1d(OP, mesh)?;
        replace_parameters(OP, path, module, |name, full| {
            self.shard_parameter(name, full, m.rank, m.world)
        })?;
        if m.rank != 0 {
            // the zeros of a Partial bias stay zeros: no gradient, no optimizer step
            for (name, p) in module.local_parameters_mut() {
                if name == "bias" {
                    *p = p.detach();
                }
            }
        }
        record_placements(module, &m, |name| {
            if name == "bias" {
                (Placement::Partial, 1)
            } else {
                (Placement::Shard(1), 1)
            }
        });
        if self.input_layouts == Placement::Replicate {
            let (group, rank, world) = (m.group.clone(), m.rank, m.world);
            module.register_forward_pre_hook(Box::new(move |x: &Tensor| {
                let n = x.shape().last().copied().unwrap_or(0);
                if !n.is_multiple_of(world) {
                    return Err(invalid(
                        OP,
                        "input",
                        format!("a last dimension divisible by the mesh size {world}"),
                        format!("shape {:?}", x.shape()),
                    ));
                }
                let last = x.ndim() as isize - 1;
                // the sum of the ranks' zero-padded pieces is the whole input gradient
                Ok(Some(copy_to_group(x, Some(&group))?.narrow(
                    last,
                    rank * n / world,
                    n / world,
                )?))
            }))?;
        }
        let group = m.group;
        module.register_forward_hook(Box::new(move |_x: &Tensor, y: &Tensor| {
            Ok(Some(reduce_from_group(y, Some(&group))?))
        }))?;
        Ok(())
    }

    fn shard_parameter(
        &self,
        name: &str,
        full: &Tensor,
        rank: usize,
        world: usize,
    ) -> Result<Tensor> {
        if name == "bias" {
            if rank >= world {
                return chunk(OP, name, full, 0, 1, rank, world);
            }
            let b = full.detach();
            return if rank == 0 {
                b.contiguous()?.deep_clone()
            } else {
                b.zeros_like()
            };
        }
        chunk(OP, name, full, 1, 1, rank, world)
    }
}
