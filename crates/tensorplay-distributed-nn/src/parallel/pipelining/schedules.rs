//! The schedules users call (`ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`,
//! `ScheduleInterleavedZeroBubble`): each builds a [`PipelineSchedule`] that runs this rank's
//! action list, checked by the simulator when it is built.

use std::sync::Arc;

use tensorplay_collectives::{self as dist, ProcessGroup};
use tensorplay_core::{Result, Tensor};

use super::error::PipelineError;
use super::executor::{LossFn, Step};
use super::schedule::{Action, PipelineShape, ScheduleError, ScheduleKind};
use super::sim::{Costs, SimReport, simulate};
use super::stage::PipelineStage;
use super::step_sync::{MAX_RANKS, Mode, Refused, StepSync};

/// A pipeline schedule on this rank: its stages, the number of micro-batches, the loss, and
/// every rank's action list (checked by the simulator when built). Built by
/// [`ScheduleGPipe::new`], [`Schedule1F1B::new`], [`ScheduleInterleaved1F1B::new`] or
/// [`ScheduleInterleavedZeroBubble::new`].
///
/// Each training step splits the batch (dim 0) into `n_microbatches` equal micro-batches, runs
/// this rank's actions, and leaves in every stage parameter's `.grad` the gradient of the
/// mean of the micro-batches' losses (the whole batch's, for a mean loss), as PyTorch's
/// `scale_grads`. The first stage's rank calls [`PipelineSchedule::step`] with the batch,
/// the last stage's [`PipelineSchedule::step_with_target`] with the targets, the others
/// [`PipelineSchedule::step_middle`] ([`PipelineSchedule::step_full`] when one rank holds
/// both ends).
pub struct PipelineSchedule {
    kind: ScheduleKind,
    shape: PipelineShape,
    stages: Vec<PipelineStage>,
    group: ProcessGroup,
    loss_fn: Option<LossFn>,
    lists: Vec<Vec<Action>>,
    step: u64,
    checked: bool,
    trace: Vec<Action>,
    compute: std::time::Duration,
    /// This process's number for the schedule (the order it built schedules on its group), in
    /// its store keys.
    id: u64,
    /// Why later steps are refused: a step failed after messages may have been sent.
    poisoned: Option<String>,
}

/// Per pipeline group (by its global ranks), in this process: how many schedules were built
/// on it (each schedule's id) and why its point-to-point channels can no longer be trusted
/// (a step of one of its schedules failed mid-step).
static GROUPS: std::sync::Mutex<Vec<GroupEntry>> = std::sync::Mutex::new(Vec::new());

/// A group's global ranks, its schedules built so far, why it is poisoned.
type GroupEntry = (Vec<usize>, u64, Option<String>);

/// Runs `f` on `group`'s entry in [`GROUPS`].
fn with_group<R>(group: &ProcessGroup, f: impl FnOnce(&mut u64, &mut Option<String>) -> R) -> R {
    let mut g = GROUPS.lock().unwrap_or_else(|e| e.into_inner());
    let i = match g.iter().position(|(r, _, _)| r == group.ranks()) {
        Some(i) => i,
        None => {
            g.push((group.ranks().to_vec(), 0, None));
            g.len() - 1
        }
    };
    let (_, n, why) = &mut g[i];
    f(n, why)
}

impl std::fmt::Debug for PipelineSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}({:?}, stages {:?})",
            self.kind,
            self.shape,
            self.stage_indices()
        )
    }
}

macro_rules! single_stage_schedule {
    ($name:ident, $kind:expr, $doc:literal) => {
        #[doc = $doc]
        #[derive(Debug, Clone, Copy)]
        pub struct $name;

        // PyTorch's class names, each building the one schedule type
        #[allow(clippy::new_ret_no_self)]
        impl $name {
            /// The schedule of `stage` (this rank's only stage) over `n_microbatches`
            /// micro-batches per step, with `loss_fn(output, target)` on the last stage
            /// (`None` on the others, or for evaluation only).
            ///
            /// # Errors
            /// As [`PipelineSchedule::new`].
            pub fn new(
                stage: PipelineStage,
                n_microbatches: usize,
                loss_fn: Option<LossFn>,
            ) -> Result<PipelineSchedule> {
                PipelineSchedule::new($kind, vec![stage], n_microbatches, loss_fn)
            }
        }
    };
}

macro_rules! multi_stage_schedule {
    ($name:ident, $kind:expr, $doc:literal) => {
        #[doc = $doc]
        #[derive(Debug, Clone, Copy)]
        pub struct $name;

        // PyTorch's class names, each building the one schedule type
        #[allow(clippy::new_ret_no_self)]
        impl $name {
            /// The schedule of `stages` (this rank's stages: `r`, `r + p`, ...) over
            /// `n_microbatches` micro-batches per step (a multiple of the group's size), with
            /// `loss_fn` on the last stage.
            ///
            /// # Errors
            /// As [`PipelineSchedule::new`].
            pub fn new(
                stages: Vec<PipelineStage>,
                n_microbatches: usize,
                loss_fn: Option<LossFn>,
            ) -> Result<PipelineSchedule> {
                PipelineSchedule::new($kind, stages, n_microbatches, loss_fn)
            }
        }
    };
}

single_stage_schedule!(
    ScheduleGPipe,
    ScheduleKind::GPipe,
    "GPipe (`torch.distributed.pipelining.ScheduleGPipe`): every micro-batch's forward, then \
     every backward; holds all micro-batches' activations."
);
single_stage_schedule!(
    Schedule1F1B,
    ScheduleKind::OneFOneB,
    "1F1B (`Schedule1F1B`): after a warm-up, one forward and one backward in turn; holds at \
     most as many micro-batches as stages after it."
);
multi_stage_schedule!(
    ScheduleInterleaved1F1B,
    ScheduleKind::Interleaved1F1B,
    "Interleaved 1F1B (`ScheduleInterleaved1F1B`): several stages per rank, the bubble divided \
     by about their number."
);
multi_stage_schedule!(
    ScheduleInterleavedZeroBubble,
    ScheduleKind::InterleavedZeroBubble,
    "Interleaved zero bubble (`ScheduleInterleavedZeroBubble`): interleaved 1F1B with each \
     backward split into input-gradient and weight-gradient actions, the latter moved into \
     the bubbles."
);

impl PipelineSchedule {
    /// `kind` over this rank's `stages` (each a [`PipelineStage`] of the same group, in
    /// increasing order) with `n_microbatches` per step.
    ///
    /// # Errors
    /// No stage; stages of different groups or pipelines, or not this rank's (`r`, `r + p`,
    /// ... for group rank `r`); a shape the schedule cannot run ([`ScheduleKind::check`]:
    /// at least as many micro-batches as ranks, a multiple of them for the interleaved
    /// schedules, one stage per rank for GPipe and 1F1B); a list the simulator refuses.
    pub fn new(
        kind: ScheduleKind,
        stages: Vec<PipelineStage>,
        n_microbatches: usize,
        loss_fn: Option<LossFn>,
    ) -> Result<PipelineSchedule> {
        let Some(first) = stages.first() else {
            return Err(invalid(
                kind.name(),
                dist::get_rank(None).unwrap_or(0),
                "stages",
                "at least one stage",
                "none",
            ));
        };
        let group = first.group.clone();
        let me = group.my_global_rank();
        let p = group.size();
        if p > MAX_RANKS {
            return Err(invalid(
                kind.name(),
                me,
                "stages",
                &format!("a pipeline group of at most {MAX_RANKS} ranks"),
                &format!("a group of {p}"),
            ));
        }
        let num_stages = first.num_stages;
        let shape = PipelineShape {
            ranks: p,
            stages_per_rank: num_stages / p,
            microbatches: n_microbatches,
        };
        kind.check(&shape).map_err(|e| -> tensorplay_core::Error {
            match e {
                ScheduleError::Shape {
                    arg, expected, got, ..
                } => invalid(kind.name(), me, arg, &expected, &got.to_string()),
                other => invalid(kind.name(), me, "shape", "one it runs", &other.to_string()),
            }
        })?;
        let r = group.rank().unwrap_or(0);
        let want = shape.stages_of(r);
        let got: Vec<usize> = stages.iter().map(|s| s.stage_index).collect();
        let same_group = stages
            .iter()
            .all(|s| s.group.ranks() == group.ranks() && s.num_stages == num_stages);
        if got != want || !same_group {
            return Err(invalid(
                kind.name(),
                me,
                "stages",
                &format!("stages {want:?} of {num_stages} on this group (rank {r} of {p})"),
                &format!("stages {got:?}"),
            ));
        }
        let lists = kind
            .actions(&shape)
            .map_err(|e| -> tensorplay_core::Error {
                invalid(
                    kind.name(),
                    me,
                    "schedule",
                    "one the simulator accepts",
                    &e.to_string(),
                )
            })?;
        simulate(&shape, &lists, &Costs::default()).map_err(|e| -> tensorplay_core::Error {
            invalid(
                kind.name(),
                me,
                "schedule",
                "one the simulator accepts",
                &e.to_string(),
            )
        })?;
        let id = with_group(&group, |n, _| {
            *n += 1;
            *n - 1
        });
        Ok(PipelineSchedule {
            kind,
            shape,
            stages,
            group,
            loss_fn,
            lists,
            step: 0,
            checked: false,
            trace: vec![],
            compute: std::time::Duration::ZERO,
            id,
            poisoned: None,
        })
    }

    fn stage_indices(&self) -> Vec<usize> {
        self.stages.iter().map(|s| s.stage_index).collect()
    }

    /// The schedule's kind.
    pub fn kind(&self) -> ScheduleKind {
        self.kind
    }

    /// The pipeline's shape.
    pub fn shape(&self) -> PipelineShape {
        self.shape
    }

    /// This rank's stages.
    pub fn stages(&self) -> &[PipelineStage] {
        &self.stages
    }

    /// This rank's stages, mutably (train/eval, state dicts).
    pub fn stages_mut(&mut self) -> &mut [PipelineStage] {
        &mut self.stages
    }

    /// Every rank's action list (`[r]` is group rank `r`'s), as checked by the simulator.
    pub fn actions(&self) -> &[Vec<Action>] {
        &self.lists
    }

    /// This rank's actions as run by the last step, in order (equal to its list).
    pub fn last_trace(&self) -> &[Action] {
        &self.trace
    }

    /// Time this rank spent in compute actions (forward, backward) in the last step.
    pub fn last_compute_time(&self) -> std::time::Duration {
        self.compute
    }

    /// The simulator's report for this schedule (unit costs: forward 1, backward 2).
    pub fn simulated(&self) -> SimReport {
        simulate(&self.shape, &self.lists, &Costs::default()).expect("checked when built")
    }

    /// A training step on the first stage's rank: `inputs` is the batch (`[B, ...]`, split on
    /// dim 0).
    ///
    /// # Errors
    /// As [`PipelineSchedule::step_full`].
    pub fn step(&mut self, inputs: &Tensor) -> Result<()> {
        self.step_full(Some(std::slice::from_ref(inputs)), None, None)
    }

    /// A training step on the last stage's rank: `target` is split like the batch, and each
    /// micro-batch's loss (unscaled) is pushed onto `losses`.
    ///
    /// # Errors
    /// As [`PipelineSchedule::step_full`].
    pub fn step_with_target(&mut self, target: &Tensor, losses: &mut Vec<Tensor>) -> Result<()> {
        self.step_full(None, Some(target), Some(losses))
    }

    /// A training step on a rank that holds neither the first nor the last stage.
    ///
    /// # Errors
    /// As [`PipelineSchedule::step_full`].
    pub fn step_middle(&mut self) -> Result<()> {
        self.step_full(None, None, None)
    }

    /// A training step with whatever this rank's stages need: `inputs` (the first stage's,
    /// each split on dim 0), `target` and `losses` (the last stage's).
    ///
    /// # Errors
    /// ([`PipelineError`] inside [`tensorplay_core::Error::External`]) `inputs` missing on
    /// the first stage's rank or given on another, `target` likewise for the last, a batch
    /// whose dim 0 does not split into `n_microbatches` equal parts; at the first step, ranks
    /// that disagree on the schedule, its micro-batches or stages (on every rank); any
    /// action's failure, naming the stage and micro-batch; another stage's failure (this rank
    /// stops instead of waiting).
    pub fn step_full(
        &mut self,
        inputs: Option<&[Tensor]>,
        target: Option<&Tensor>,
        losses: Option<&mut Vec<Tensor>>,
    ) -> Result<()> {
        self.agree()?;
        let (step, sync) = self.next_step("step")?;
        let stage = self.stages[0].stage_index;
        let args = self.split_args("step", inputs, target);
        let (ins, targets) = self.begun(sync.begin(Mode::Train, stage, args))?;
        let r = self.group.rank().unwrap_or(0);
        let actions = self.lists[r].clone();
        let mut st = Step::new(
            self.shape,
            &mut self.stages,
            sync.clone(),
            step,
            ins,
            targets,
            self.loss_fn.clone(),
            true,
        );
        let res = st.run(&actions);
        self.trace = std::mem::take(&mut st.trace);
        self.compute = st.compute;
        let got = std::mem::take(&mut st.losses);
        self.ended(step, res.and_then(|()| sync.finish(stage)))?;
        if let Some(l) = losses {
            l.extend(got);
        }
        Ok(())
    }

    /// A forward-only step (`schedule.eval`): no graph, no gradients. Returns, on the last
    /// stage's rank, its outputs for the whole batch (the micro-batches' outputs concatenated
    /// on dim 0), else an empty list. `inputs` as for [`PipelineSchedule::step_full`].
    ///
    /// # Errors
    /// As [`PipelineSchedule::step_full`].
    pub fn eval(&mut self, inputs: Option<&[Tensor]>) -> Result<Vec<Tensor>> {
        self.agree()?;
        let (step, sync) = self.next_step("eval")?;
        let stage = self.stages[0].stage_index;
        let args = self.split_args("eval", inputs, None);
        let (ins, _) = self.begun(sync.begin(Mode::Eval, stage, args))?;
        let r = self.group.rank().unwrap_or(0);
        let actions: Vec<Action> = self.lists[r]
            .iter()
            .filter(|a| {
                use super::schedule::ActionKind::*;
                matches!(a.kind, Forward | SendF | RecvF)
            })
            .copied()
            .collect();
        // forward-only order: micro-batch by micro-batch, stages in order
        let mut ordered = actions.clone();
        ordered.sort_by_key(|a| (a.microbatch, a.stage, rank_in_stage(a)));
        let mut st = Step::new(
            self.shape,
            &mut self.stages,
            sync.clone(),
            step,
            ins,
            vec![],
            None,
            false,
        );
        let res = st.run(&ordered);
        self.trace = std::mem::take(&mut st.trace);
        let outs = std::mem::take(&mut st.outputs);
        self.ended(step, res.and_then(|()| sync.finish(stage)))?;
        if outs.is_empty() {
            return Ok(vec![]);
        }
        let n = outs[0].len();
        if let Some(mb) = outs.iter().position(|o| o.len() != n) {
            return Err(invalid(
                "eval",
                self.group.my_global_rank(),
                "the last stage's outputs",
                &format!("{n} per micro-batch, as micro-batch 0's"),
                &format!("{} for micro-batch {mb}", outs[mb].len()),
            ));
        }
        (0..n)
            .map(|i| {
                let parts: Vec<Tensor> = outs.iter().map(|o| o[i].clone()).collect();
                Tensor::cat(&parts, 0)
            })
            .collect()
    }

    /// Numbers the next step (every call counts one, failed or refused, on every rank) and
    /// refuses it when an earlier step failed after messages may have been sent.
    fn next_step(&mut self, op: &'static str) -> Result<(u64, StepSync)> {
        let step = self.step;
        self.step += 1;
        if self.poisoned.is_none() {
            // another schedule's failed step on this group leaves its messages in flight too
            self.poisoned = with_group(&self.group, |_, why| why.clone());
        }
        if let Some(why) = &self.poisoned {
            return Err(invalid(
                op,
                self.group.my_global_rank(),
                "the schedule",
                "one whose steps have not failed mid-step",
                &format!(
                    "{why}; that step's messages may still be in flight on the group: build \
                     a new process group and schedule (or restart from a checkpoint)"
                ),
            ));
        }
        Ok((step, StepSync::new(self.group.clone(), self.id, step)))
    }

    /// The start of a step: refused cleanly (the next step runs as if this one was not
    /// called) or not (later steps are refused).
    fn begun<T>(&mut self, r: std::result::Result<T, Refused>) -> Result<T> {
        r.map_err(|Refused { error, clean }| {
            if !clean {
                self.poison(format!(
                    "step {} failed at its start: {error}",
                    self.step - 1
                ));
            }
            error
        })
    }

    /// The end of step `step`: on an error, later steps are refused.
    fn ended(&mut self, step: u64, r: Result<()>) -> Result<()> {
        r.inspect_err(|e| self.poison(format!("step {step} failed: {e}")))
    }

    /// Refuses later steps of this schedule and of every schedule on its group.
    fn poison(&mut self, why: String) {
        with_group(&self.group, |_, w| *w = Some(why.clone()));
        self.poisoned = Some(why);
    }

    /// Checks who passed what and splits the batch and targets into micro-batches.
    fn split_args(
        &self,
        op: &'static str,
        inputs: Option<&[Tensor]>,
        target: Option<&Tensor>,
    ) -> Result<(Vec<Vec<Tensor>>, Vec<Tensor>)> {
        let me = self.group.my_global_rank();
        let first = self.stages.iter().any(PipelineStage::is_first);
        let last = self.stages.iter().any(PipelineStage::is_last);
        if first != inputs.is_some() {
            let e = if first {
                "the batch (this rank holds stage 0)"
            } else {
                "none (stage 0 is on another rank)"
            };
            return Err(invalid(
                op,
                me,
                "inputs",
                e,
                if inputs.is_some() { "some" } else { "none" },
            ));
        }
        let training = op == "step";
        if training && last != target.is_some() {
            let e = if last {
                "the targets (this rank holds the last stage)"
            } else {
                "none (the last stage is on another rank)"
            };
            return Err(invalid(
                op,
                me,
                "target",
                e,
                if target.is_some() { "some" } else { "none" },
            ));
        }
        if training && last && self.loss_fn.is_none() {
            return Err(invalid(
                op,
                me,
                "loss_fn",
                "a loss function (given to the schedule)",
                "none",
            ));
        }
        let m = self.shape.microbatches;
        let split = |arg: &str, t: &Tensor| -> Result<Vec<Tensor>> {
            let b = t.shape().first().copied().unwrap_or(0);
            if b == 0 || !b.is_multiple_of(m) {
                return Err(invalid(
                    op,
                    me,
                    arg,
                    &format!("a batch whose dim 0 splits into {m} equal micro-batches"),
                    &format!("shape {:?}", t.shape()),
                ));
            }
            t.chunk(m, 0)
        };
        let mut per_mb: Vec<Vec<Tensor>> = vec![vec![]; if first { m } else { 0 }];
        for (i, t) in inputs.unwrap_or(&[]).iter().enumerate() {
            for (mb, c) in split(&format!("inputs[{i}]"), t)?.into_iter().enumerate() {
                per_mb[mb].push(c);
            }
        }
        let targets = match target {
            Some(t) => split("target", t)?,
            None => vec![],
        };
        Ok((per_mb, targets))
    }

    /// At the first step: every rank of the pipeline group runs the same schedule with the
    /// same micro-batches and stages, and holds the stages it should (an error on every rank
    /// otherwise).
    fn agree(&mut self) -> Result<()> {
        if self.checked {
            return Ok(());
        }
        let mine = super::agreement::Signature {
            schedule: self.kind.name().to_string(),
            n_microbatches: self.shape.microbatches,
            num_stages: self.shape.stages(),
            stages: self.stage_indices(),
            tied: self
                .stages
                .iter()
                .flat_map(|s| s.tied.iter())
                .map(|(p, g)| (g.ranks().to_vec(), p.shape().to_vec()))
                .collect(),
            id: self.id,
        };
        super::agreement::agree(&self.group, &self.shape, &mine)?;
        self.checked = true;
        Ok(())
    }
}

/// Receives before the forward they feed, sends after it.
fn rank_in_stage(a: &Action) -> u8 {
    use super::schedule::ActionKind::*;
    match a.kind {
        RecvF => 0,
        Forward => 1,
        _ => 2,
    }
}

fn invalid(
    op: &'static str,
    rank: usize,
    arg: &str,
    expected: &str,
    got: &str,
) -> tensorplay_core::Error {
    PipelineError::Invalid {
        op,
        rank,
        arg: arg.to_string(),
        expected: expected.to_string(),
        got: got.to_string(),
    }
    .into()
}

/// A [`LossFn`] from a closure.
pub fn loss_fn(f: impl Fn(&Tensor, &Tensor) -> Result<Tensor> + Send + Sync + 'static) -> LossFn {
    Arc::new(f)
}
