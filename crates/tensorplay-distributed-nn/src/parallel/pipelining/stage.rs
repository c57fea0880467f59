//! A pipeline stage: a part of the model on this rank, with its place in the pipeline.

use tensorplay_collectives::{self as dist, ProcessGroup};
use tensorplay_core::nn::Module;
use tensorplay_core::{Result, Tensor};

use super::error::{PipelineError, core_invalid};

/// What a stage runs: `inputs -> outputs`. Every [`Module`] is one (one input, one output);
/// [`MultiIo`] wraps a module whose stage takes or returns several tensors.
pub trait StageModule {
    /// The stage's outputs for its inputs (the previous stage's outputs, in order; the first
    /// stage's inputs are the micro-batch's).
    ///
    /// # Errors
    /// The module's.
    fn forward_stage(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>>;
    /// The module.
    fn module(&self) -> &dyn Module;
    /// The module, mutably.
    fn module_mut(&mut self) -> &mut dyn Module;
}

impl<M: Module + 'static> StageModule for M {
    /// `[module(inputs[0])]`.
    fn forward_stage(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        match inputs {
            [x] => Ok(vec![self.call(x)?]),
            _ => Err(core_invalid(
                "PipelineStage forward",
                "inputs",
                "one tensor (wrap the module in MultiIo for several)",
                inputs.len(),
            )),
        }
    }
    fn module(&self) -> &dyn Module {
        self
    }
    fn module_mut(&mut self) -> &mut dyn Module {
        self
    }
}

/// A module whose stage takes or returns several tensors: `forward(module, inputs)` gives
/// the outputs. The next stage receives them in order.
pub struct MultiIo<M, F> {
    module: M,
    forward: F,
}

impl<M, F> MultiIo<M, F>
where
    M: Module + 'static,
    F: Fn(&M, &[Tensor]) -> Result<Vec<Tensor>>,
{
    /// Wraps `module` with its multi-tensor `forward`.
    pub fn new(module: M, forward: F) -> MultiIo<M, F> {
        MultiIo { module, forward }
    }
}

impl<M, F> StageModule for MultiIo<M, F>
where
    M: Module + 'static,
    F: Fn(&M, &[Tensor]) -> Result<Vec<Tensor>>,
{
    fn forward_stage(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        (self.forward)(&self.module, inputs)
    }
    fn module(&self) -> &dyn Module {
        &self.module
    }
    fn module_mut(&mut self) -> &mut dyn Module {
        &mut self.module
    }
}

/// One stage of a pipeline (`torch.distributed.pipelining.PipelineStage`): `submodule` is
/// stage `stage_index` of `num_stages`, run by this rank of the pipeline `group` (stage `s`
/// runs on the group's rank `s % group size`: one stage per rank, or several, looped, for the
/// interleaved schedules). The model is split by hand: each rank builds its stages' modules
/// (see `tensorplay::models::gpt_stage` for the GPT). Activations, their gradients and their
/// shapes travel between stages with each message, so shapes may change from step to step.
pub struct PipelineStage {
    pub(crate) module: Box<dyn StageModule>,
    pub(crate) stage_index: usize,
    pub(crate) num_stages: usize,
    pub(crate) group: ProcessGroup,
    /// Parameters shared with another stage and the group that sums their gradients.
    pub(crate) tied: Vec<(Tensor, ProcessGroup)>,
    /// The stage's data-parallel replicas: gradients averaged over it each step.
    pub(crate) data_parallel: Option<ProcessGroup>,
}

impl std::fmt::Debug for PipelineStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PipelineStage({} of {}, group {:?})",
            self.stage_index,
            self.num_stages,
            self.group.ranks()
        )
    }
}

impl PipelineStage {
    /// Stage `stage_index` of `num_stages` running `submodule` (a [`Module`], or a
    /// [`MultiIo`]) on this rank of `group`.
    ///
    /// # Errors
    /// `stage_index >= num_stages`; `num_stages` not a multiple of the group's size; a stage
    /// that does not run on this rank (`stage_index % group size` is another rank); a group
    /// this process is not in.
    pub fn new(
        submodule: impl StageModule + 'static,
        stage_index: usize,
        num_stages: usize,
        group: &ProcessGroup,
    ) -> Result<PipelineStage> {
        let me = group.my_global_rank();
        let bad = |arg: &str, expected: String, got: usize| -> tensorplay_core::Error {
            PipelineError::Invalid {
                op: "PipelineStage::new",
                rank: me,
                arg: arg.into(),
                expected,
                got: got.to_string(),
            }
            .into()
        };
        let Some(r) = group.rank() else {
            return Err(PipelineError::Invalid {
                op: "PipelineStage::new",
                rank: me,
                arg: "group".into(),
                expected: format!("a group with rank {me}"),
                got: format!("a group of ranks {:?}", group.ranks()),
            }
            .into());
        };
        let p = group.size();
        if num_stages == 0 || !num_stages.is_multiple_of(p) {
            return Err(bad(
                "num_stages",
                format!("a multiple of the pipeline group's {p} ranks"),
                num_stages,
            ));
        }
        if stage_index >= num_stages {
            return Err(bad(
                "stage_index",
                format!("below num_stages = {num_stages}"),
                stage_index,
            ));
        }
        if stage_index % p != r {
            return Err(bad(
                "stage_index",
                format!(
                    "a stage of this rank (group rank {r} of {p} runs stages {r}, {}, ...)",
                    r + p
                ),
                stage_index,
            ));
        }
        Ok(PipelineStage {
            module: Box::new(submodule),
            stage_index,
            num_stages,
            group: group.clone(),
            tied: Vec::new(),
            data_parallel: None,
        })
    }

    /// The stage's index.
    pub fn stage_index(&self) -> usize {
        self.stage_index
    }

    /// The number of stages.
    pub fn num_stages(&self) -> usize {
        self.num_stages
    }

    /// Whether this is the first stage (it takes the batch).
    pub fn is_first(&self) -> bool {
        self.stage_index == 0
    }

    /// Whether this is the last stage (it computes the loss).
    pub fn is_last(&self) -> bool {
        self.stage_index + 1 == self.num_stages
    }

    /// The stage's module (`stage.submod`).
    pub fn submod(&self) -> &dyn Module {
        self.module.module()
    }

    /// The stage's module, mutably (to switch `train`/`eval`, load a state dict).
    pub fn submod_mut(&mut self) -> &mut dyn Module {
        self.module.module_mut()
    }

    /// The stage's parameters (for its optimizer).
    pub fn parameters(&self) -> Vec<Tensor> {
        self.submod().parameters()
    }

    /// Makes this stage one of the data-parallel replicas of `group` (pipeline x data
    /// parallel on a `DeviceMesh` `[pp, dp]`: `group` is the mesh's `"dp"` group, each replica
    /// of the pipeline taking its share of the batch): once the stage's last micro-batch's
    /// weight gradients are computed, its gradients are averaged over `group`
    /// (asynchronously, overlapped with the rest of the step; waited for at its end), as DDP
    /// with `no_sync` on every micro-batch but the last. Every replica runs the same schedule.
    ///
    /// # Errors
    /// This rank is not in `group`.
    pub fn data_parallel(mut self, group: &ProcessGroup) -> Result<PipelineStage> {
        dist::get_rank(Some(group))?;
        self.data_parallel = Some(group.clone());
        Ok(self)
    }

    /// Declares `param` (a parameter of this stage) shared with another stage on another
    /// rank — the GPT's token embedding on the first stage and its head on the last
    /// (Megatron's embedding group) — and `group` the ranks that hold a copy: after each
    /// training step's backward, the copies' gradients are summed over `group`, so that the
    /// copies, equal at the start, stay equal after every update. Every rank of `group` must
    /// tie its copy, in the same order.
    ///
    /// # Errors
    /// `param` is not one of this stage's parameters, or this rank is not in `group`.
    pub fn tie_parameter(&mut self, param: &Tensor, group: &ProcessGroup) -> Result<()> {
        let me = self.group.my_global_rank();
        if !self.parameters().iter().any(|p| p.id() == param.id()) {
            return Err(PipelineError::Invalid {
                op: "PipelineStage::tie_parameter",
                rank: me,
                arg: "param".into(),
                expected: format!("a parameter of stage {}", self.stage_index),
                got: format!("a tensor of shape {:?} that is not one", param.shape()),
            }
            .into());
        }
        dist::get_rank(Some(group))?;
        self.tied.push((param.clone(), group.clone()));
        Ok(())
    }
}
