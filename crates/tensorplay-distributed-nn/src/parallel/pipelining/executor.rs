//! The executor: runs one rank's action list for one step, in order, recording each action
//! it runs (the trace tests compare with the list). It decides nothing: the order is the
//! schedule's, checked by the simulator before the first step.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tensorplay_collectives::{ProcessGroup, Work};
use tensorplay_core::autograd::{self, WeightGrads};
use tensorplay_core::{Result, Tensor};

use super::error::{PipelineError, core_invalid};
use super::schedule::{Action, ActionKind, PipelineShape};
use super::stage::PipelineStage;
use super::step_sync::{POLL, StepSync};
use super::wire::{self, Header, Kind};

/// The loss of the last stage: `loss_fn(output, target)`, a one-element tensor.
pub type LossFn = Arc<dyn Fn(&Tensor, &Tensor) -> Result<Tensor> + Send + Sync>;

type Key = (usize, usize);

/// One step's inputs and state on this rank.
pub(crate) struct Step<'a> {
    pub(crate) shape: PipelineShape,
    pub(crate) stages: &'a mut [PipelineStage],
    pub(crate) group: ProcessGroup,
    pub(crate) step: u64,
    /// Where this step's failures are posted and read.
    sync: StepSync,
    /// The first stage's inputs, per micro-batch.
    pub(crate) inputs: Vec<Vec<Tensor>>,
    /// The last stage's targets, per micro-batch.
    pub(crate) targets: Vec<Tensor>,
    pub(crate) loss_fn: Option<LossFn>,
    /// Training (backward follows) or evaluation (forward only, no graph).
    pub(crate) training: bool,
    /// The last stage's losses, unscaled, per micro-batch.
    pub(crate) losses: Vec<Tensor>,
    /// The last stage's outputs (evaluation), per micro-batch.
    pub(crate) outputs: Vec<Vec<Tensor>>,
    /// Each action as it ran.
    pub(crate) trace: Vec<Action>,
    /// Time spent in compute actions.
    pub(crate) compute: Duration,
    // per (stage, micro-batch)
    fwd_in: HashMap<Key, Vec<Tensor>>,
    fwd_out: HashMap<Key, Vec<Tensor>>,
    out_grads: HashMap<Key, Vec<Option<Tensor>>>,
    in_grads: HashMap<Key, Vec<Option<Tensor>>>,
    weights: HashMap<Key, WeightGrads>,
    sends: Vec<Work>,
    /// Per stage: micro-batches whose weight gradients are done (`B` or `W`).
    grads_done: HashMap<usize, usize>,
    /// The data-parallel averages in flight.
    dp_works: Vec<Work>,
}

impl<'a> Step<'a> {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        shape: PipelineShape,
        stages: &'a mut [PipelineStage],
        sync: StepSync,
        step: u64,
        inputs: Vec<Vec<Tensor>>,
        targets: Vec<Tensor>,
        loss_fn: Option<LossFn>,
        training: bool,
    ) -> Step<'a> {
        Step {
            shape,
            stages,
            group: sync.group().clone(),
            step,
            sync,
            inputs,
            targets,
            loss_fn,
            training,
            losses: vec![],
            outputs: vec![],
            trace: vec![],
            compute: Duration::ZERO,
            fwd_in: HashMap::new(),
            fwd_out: HashMap::new(),
            out_grads: HashMap::new(),
            in_grads: HashMap::new(),
            weights: HashMap::new(),
            sends: vec![],
            grads_done: HashMap::new(),
            dp_works: vec![],
        }
    }

    fn me(&self) -> usize {
        self.group.my_global_rank()
    }

    fn stage(&self, s: usize) -> &PipelineStage {
        self.stages
            .iter()
            .find(|st| st.stage_index == s)
            .expect("the schedule's stage")
    }

    /// Global rank of the group rank that runs stage `s`.
    fn rank_of(&self, s: usize) -> usize {
        self.group.ranks()[self.shape.rank_of(s)]
    }

    /// Runs `actions` in order, then waits for this rank's sends and sums tied gradients.
    /// On an error, tells the other ranks (through the group's store) before returning it.
    pub(crate) fn run(&mut self, actions: &[Action]) -> Result<()> {
        for a in actions {
            if let Err(e) = self.run_one(a) {
                return Err(self.fail(a, e));
            }
            self.trace.push(*a);
        }
        // errors after the list are blamed on its last action
        let last = actions
            .last()
            .copied()
            .unwrap_or_else(|| Action::new(self.stages[0].stage_index, ActionKind::Forward, 0));
        for w in std::mem::take(&mut self.sends) {
            w.wait(None).map_err(|e| {
                self.fail(
                    &last,
                    PipelineError::Action {
                        stage: last.stage,
                        rank: self.me(),
                        microbatch: last.microbatch,
                        action: last.to_string(),
                        message: format!("a send of this step failed: {e}"),
                        source: None,
                    }
                    .into(),
                )
            })?;
        }
        self.reduce_grads().map_err(|e| self.fail(&last, e))
    }

    /// Waits for the data-parallel averages and sums the tied parameters' gradients.
    fn reduce_grads(&mut self) -> Result<()> {
        for w in std::mem::take(&mut self.dp_works) {
            w.wait(None)?;
        }
        if self.training {
            for st in self.stages.iter() {
                for (p, g) in &st.tied {
                    let grad = match p.grad() {
                        Some(g) => g,
                        None => Tensor::zeros(p.shape(), p.dtype())?,
                    };
                    tensorplay_collectives::all_reduce(
                        &grad,
                        tensorplay_collectives::ReduceOp::Sum,
                        Some(g),
                    )?;
                    p.set_grad(Some(grad));
                }
            }
        }
        Ok(())
    }

    /// Wraps `e` as this action's error (unless it already is a pipeline error) and posts it
    /// for the other ranks.
    fn fail(&self, a: &Action, e: tensorplay_core::Error) -> tensorplay_core::Error {
        let pe = match e.downcast_ref::<PipelineError>() {
            Some(p) => p.clone(),
            None => PipelineError::Action {
                stage: a.stage,
                rank: self.me(),
                microbatch: a.microbatch,
                action: a.to_string(),
                message: e.to_string(),
                source: Some(Arc::new(e)),
            },
        };
        if !matches!(pe, PipelineError::PeerFailed { .. }) {
            self.post_failure(a.stage, self.me(), &pe.to_string());
        }
        pe.into()
    }

    /// Tells the other ranks that stage `stage` on rank `rank` failed, unless a failure was
    /// posted first (the first one is the cause; best effort: a rank that cannot reach the
    /// store still returns its error).
    fn post_failure(&self, stage: usize, rank: usize, message: &str) -> bool {
        self.sync.post_failure(stage, rank, message)
    }

    /// Waits for `w`, a message from stage `from` on global rank `peer`, looking every
    /// [`POLL`] for another rank's failure. A lost peer (its connection failed, or it did not
    /// answer within the group's timeout) is named as the stage that failed.
    fn wait(&self, a: &Action, w: &Work, what: &str, (from, peer): (usize, usize)) -> Result<()> {
        loop {
            match w.wait(Some(POLL)) {
                Ok(()) => return Ok(()),
                Err(tensorplay_collectives::Error::Timeout { op, .. })
                    if op.starts_with("Work::wait") =>
                {
                    if let Some(f) = self.peer_failure(a) {
                        return Err(f.into());
                    }
                }
                Err(e) => {
                    // a failed receive may be the consequence of another rank's failure
                    if let Some(f) = self.peer_failure(a) {
                        return Err(f.into());
                    }
                    // lost: its connection failed, it timed out, or an earlier failure with
                    // it (a send of this step) shut the group's connections down
                    if matches!(
                        e,
                        tensorplay_collectives::Error::PeerFailed { .. }
                            | tensorplay_collectives::Error::Timeout { .. }
                            | tensorplay_collectives::Error::Backend { .. }
                    ) {
                        let mut message = format!(
                            "lost (seen by stage {} on rank {} {what}): {e}",
                            a.stage,
                            self.me()
                        );
                        if !self.post_failure(from, peer, &message) {
                            // the other ranks cannot learn it either: each names its neighbour
                            message.push_str(
                                " (the job's store, served by the group's first rank, does \
                                 not answer either: that rank may be the first lost)",
                            );
                        }
                        return Err(PipelineError::PeerFailed {
                            stage: a.stage,
                            rank: self.me(),
                            action: a.to_string(),
                            failed_stage: from,
                            failed_rank: peer,
                            message,
                        }
                        .into());
                    }
                    return Err(PipelineError::Action {
                        stage: a.stage,
                        rank: self.me(),
                        microbatch: a.microbatch,
                        action: a.to_string(),
                        message: format!("{what}: {e}"),
                        source: None,
                    }
                    .into());
                }
            }
        }
    }

    /// Another rank's failure posted for this step.
    fn peer_failure(&self, a: &Action) -> Option<PipelineError> {
        self.sync
            .posted_failure()
            .map(|f| f.seen_by(a.stage, self.me(), a.to_string()))
    }

    fn run_one(&mut self, a: &Action) -> Result<()> {
        let (s, mb) = (a.stage, a.microbatch);
        let started = std::time::Instant::now();
        match a.kind {
            ActionKind::Forward => self.forward(s, mb)?,
            ActionKind::Backward => {
                self.backward(s, mb, false)?;
                self.weight_grads_done(s)?;
            }
            ActionKind::BackwardInput => self.backward(s, mb, true)?,
            ActionKind::BackwardWeight => {
                let w = self
                    .weights
                    .remove(&(s, mb))
                    .ok_or_else(|| missing(a, "its I"))?;
                w.run()?;
                self.weight_grads_done(s)?;
            }
            ActionKind::SendF => {
                let outs = self.fwd_out_for_send(s, mb)?;
                self.send(a, s + 1, Kind::Activation, outs)?;
                return Ok(());
            }
            ActionKind::SendB => {
                let grads = self
                    .in_grads
                    .remove(&(s, mb))
                    .ok_or_else(|| missing(a, "its backward"))?;
                let grads = grads.into_iter().flatten().collect();
                self.send(a, s - 1, Kind::Gradient, grads)?;
                return Ok(());
            }
            ActionKind::RecvF => {
                let ts = self.recv(a, s - 1, Kind::Activation)?;
                self.fwd_in.insert((s, mb), ts);
                return Ok(());
            }
            ActionKind::RecvB => {
                let ts = self.recv(a, s + 1, Kind::Gradient)?;
                self.out_grads
                    .insert((s, mb), ts.into_iter().map(Some).collect());
                return Ok(());
            }
        }
        self.compute += started.elapsed();
        Ok(())
    }

    /// Counts a micro-batch whose weight gradients stage `s` finished; after the last, starts
    /// the average of its gradients over its data-parallel group.
    fn weight_grads_done(&mut self, s: usize) -> Result<()> {
        let n = self.grads_done.entry(s).or_insert(0);
        *n += 1;
        if *n < self.shape.microbatches {
            return Ok(());
        }
        let st = self.stage(s);
        let Some(dp) = st.data_parallel.clone() else {
            return Ok(());
        };
        for p in st.parameters() {
            let g = match p.grad() {
                Some(g) => g,
                None => {
                    let z = Tensor::zeros(p.shape(), p.dtype())?;
                    p.set_grad(Some(z.clone()));
                    z
                }
            };
            let w = tensorplay_collectives::all_reduce_async(
                &g,
                tensorplay_collectives::ReduceOp::Avg,
                Some(&dp),
            )?;
            self.dp_works.push(w);
        }
        Ok(())
    }

    /// The stage's forward of micro-batch `mb`: its inputs are the batch's (first stage), the
    /// previous stage's outputs on this rank, or what was received; made leaves that require
    /// grad (float ones, when training) so that backward stops at them.
    fn forward(&mut self, s: usize, mb: usize) -> Result<()> {
        let raw = if s == 0 {
            self.inputs.get(mb).cloned().unwrap_or_default()
        } else if let Some(r) = self.fwd_in.remove(&(s, mb)) {
            r
        } else {
            // the previous stage ran on this rank
            self.fwd_out_for_send(s - 1, mb)?
        };
        let train = self.training;
        let leaves: Vec<Tensor> = raw
            .iter()
            .map(|t| {
                let l = t.detach();
                if train && s > 0 && t.dtype().is_float() {
                    l.requires_grad_(true)
                } else {
                    l
                }
            })
            .collect();
        let _mode = autograd::set_grad_enabled(train);
        let outs = self.stage(s).module.forward_stage(&leaves)?;
        let last = s + 1 == self.shape.stages();
        if last && self.loss_fn.is_some() && !self.targets.is_empty() {
            let f = self.loss_fn.clone().expect("checked");
            let target = self
                .targets
                .get(mb)
                .ok_or_else(|| core_invalid("loss_fn", "target", "a target per micro-batch", mb))?;
            let out = outs
                .first()
                .ok_or_else(|| core_invalid("loss_fn", "output", "at least one output", 0))?;
            let loss = f(out, target)?;
            if loss.numel() != 1 {
                return Err(core_invalid(
                    "loss_fn",
                    "its result",
                    "a one-element loss",
                    format!("shape {:?}", loss.shape()),
                ));
            }
            self.losses.push(loss.detach());
            if train && !loss.requires_grad() {
                return Err(core_invalid(
                    "loss_fn",
                    "its result",
                    "a loss computed from the stage's output (it does not require grad: \
                     detached?)",
                    format!("a loss of {}", loss.dtype()),
                ));
            }
            if train {
                // the mean over micro-batches: each one's gradient scaled by 1/m
                let scaled = loss.mul_scalar(1.0 / self.shape.microbatches as f64)?;
                self.fwd_out.insert((s, mb), vec![scaled]);
            }
        } else if last {
            self.outputs.push(outs.iter().map(Tensor::detach).collect());
        } else {
            if train {
                // the next stage sends a gradient for each float output: each must carry one
                if let Some(i) = outs
                    .iter()
                    .position(|o| o.dtype().is_float() && !o.requires_grad())
                {
                    return Err(core_invalid(
                        "PipelineStage forward",
                        "outputs",
                        "float outputs computed from the stage's parameters or inputs (the \
                         next stage returns their gradients)",
                        format!("output {i} does not require grad (detached?)"),
                    ));
                }
            }
            self.fwd_out.insert((s, mb), outs);
        }
        if train {
            self.fwd_in.insert((s, mb), leaves);
        }
        Ok(())
    }

    /// The outputs of stage `s`'s forward of `mb`, detached, to send (or hand to the next
    /// stage on this rank). Training keeps the graph for backward.
    fn fwd_out_for_send(&mut self, s: usize, mb: usize) -> Result<Vec<Tensor>> {
        let outs = if self.training {
            self.fwd_out.get(&(s, mb)).cloned()
        } else {
            self.fwd_out.remove(&(s, mb))
        };
        let outs = outs.ok_or_else(|| {
            tensorplay_core::Error::Autograd(format!(
                "stage {s} has no output of micro-batch {mb} (its forward did not run)"
            ))
        })?;
        outs.iter().map(|t| t.detach().contiguous()).collect()
    }

    /// Stage `s`'s backward of `mb` (full, or with `split` its input half, keeping the weight
    /// half for `W`).
    fn backward(&mut self, s: usize, mb: usize, split: bool) -> Result<()> {
        let outs = self.fwd_out.remove(&(s, mb)).unwrap_or_default();
        let last = s + 1 == self.shape.stages();
        let grads: Vec<Option<Tensor>> = if last {
            vec![None; outs.len()]
        } else if let Some(g) = self.out_grads.remove(&(s, mb)) {
            g
        } else {
            // the next stage ran on this rank
            self.in_grads.remove(&(s + 1, mb)).unwrap_or_default()
        };
        // outputs that carry no gradient (integer ones, or not computed from anything that
        // requires grad) take no part
        let (mut roots, mut root_grads) = (vec![], vec![]);
        let mut g_iter = grads.into_iter();
        for o in outs {
            // the next stage returns a gradient for each float output (its leaves)
            let g = if last || !o.dtype().is_float() {
                None
            } else {
                g_iter.next().flatten()
            };
            if o.requires_grad() {
                roots.push(o);
                root_grads.push(g);
            }
        }
        let inputs = self.fwd_in.remove(&(s, mb)).unwrap_or_default();
        let wanted: Vec<Tensor> = inputs
            .iter()
            .filter(|t| t.requires_grad())
            .cloned()
            .collect();
        let in_grads = if roots.is_empty() {
            vec![None; wanted.len()]
        } else if split {
            let (g, w) = autograd::backward_input(&roots, &root_grads, &wanted)?;
            self.weights.insert((s, mb), w);
            g
        } else {
            autograd::backward(&roots, &root_grads, false, false)?;
            wanted.iter().map(|t| t.grad()).collect()
        };
        // gradients of the inputs that require grad, in order (a zero for one the outputs
        // do not depend on)
        let mut out = Vec::with_capacity(in_grads.len());
        for (t, g) in wanted.iter().zip(in_grads) {
            out.push(Some(match g {
                Some(g) => g,
                None => Tensor::zeros(t.shape(), t.dtype())?,
            }));
        }
        if s > 0 {
            self.in_grads.insert((s, mb), out);
        }
        Ok(())
    }

    fn send(&mut self, a: &Action, to: usize, kind: Kind, tensors: Vec<Tensor>) -> Result<()> {
        let header = Header {
            kind,
            stage: a.stage,
            microbatch: a.microbatch,
            step: self.step,
            tensors: tensors
                .iter()
                .map(|t| (t.dtype(), t.shape().to_vec()))
                .collect(),
        };
        let peer = self.rank_of(to);
        let works = wire::post_send(&self.group, peer, &header, &tensors).map_err(|m| {
            tensorplay_core::Error::Custom {
                context: format!("sending to stage {to} (rank {peer})"),
                message: m,
            }
        })?;
        self.sends.extend(works);
        Ok(())
    }

    /// Receives stage `from`'s message for this action, checking that it is the one the
    /// schedule expects.
    fn recv(&mut self, a: &Action, from: usize, kind: Kind) -> Result<Vec<Tensor>> {
        let peer = self.rank_of(from);
        let want = format!(
            "stage {from}'s micro-batch {} {} (step {})",
            a.microbatch,
            kind.word(),
            self.step
        );
        let what = format!("waiting for {want} from rank {peer}");
        let (h, w) = wire::post_header(&self.group, peer, format!("{want}, header"))?;
        self.wait(a, &w, &what, (from, peer))?;
        let header = Header::decode(&h).map_err(|m| mismatch(a, self.me(), &want, &m))?;
        if header.kind != kind
            || header.stage != from
            || header.microbatch != a.microbatch
            || header.step != self.step
        {
            return Err(mismatch(a, self.me(), &want, &header.describe()).into());
        }
        let (ts, works) = wire::post_tensors(&self.group, peer, &header)?;
        for w in &works {
            self.wait(a, w, &what, (from, peer))?;
        }
        Ok(ts)
    }
}

fn missing(a: &Action, what: &str) -> tensorplay_core::Error {
    tensorplay_core::Error::Autograd(format!("{a} runs before {what}"))
}

fn mismatch(a: &Action, rank: usize, want: &str, got: &str) -> PipelineError {
    PipelineError::Mismatch {
        rank,
        detail: format!(
            "stage {} at action {a} expected {want} and received {got}: the ranks run \
             different schedules, micro-batch counts or steps",
            a.stage
        ),
    }
}
