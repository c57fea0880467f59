//! The pipeline-parallel run: the GPT split into 2 stages (2 blocks each; the embeddings on
//! the first, the final LayerNorm and the head — a copy of the token embedding, its gradient
//! summed with the embedding's every step — on the second), trained under 1F1B with each batch
//! of 16 sequences split into 4 micro-batches of 4.

use tensorplay as tp;
use tp::distributed::pipelining::{PipelineSchedule, PipelineStage, Schedule1F1B, loss_fn};
use tp::distributed::{self as dist, ReduceOp};
use tp::nn::functional::cross_entropy;
use tp::nn::{Module, ModuleCore, ModuleList};
use tp::{Tensor, no_grad};

use tensorplay_examples::gpt_batches as batches;

use super::args::Opts;
use super::runs::{Report, autocast, initial_model, train};
use super::{BATCH, Corpus, Res, VAL_BATCHES};

/// Micro-batches per batch.
const MICROBATCHES: usize = 4;
const STAGES: usize = 2;

/// One of the stage's parameters (a shared tensor).
#[derive(Module)]
struct Param {
    p: Tensor,
    core: ModuleCore,
}

impl Module for Param {
    /// Unused: the schedule runs the stage.
    fn forward(&self, x: &Tensor) -> tp::Result<Tensor> {
        Ok(x.clone())
    }
}

/// The stage's parameters as a module, for the training loop's optimizer (the schedule owns
/// the stage).
#[derive(Module)]
struct Params {
    all: ModuleList<Param>,
    core: ModuleCore,
}

impl Module for Params {
    /// Unused: the schedule runs the stage.
    fn forward(&self, x: &Tensor) -> tp::Result<Tensor> {
        Ok(x.clone())
    }
}

/// The mean next-character cross-entropy of logits `[B, T, V]` against targets `[B, T]`.
fn gpt_loss(logits: &Tensor, target: &Tensor) -> tp::Result<Tensor> {
    let n = target.numel();
    let v = logits.shape()[2];
    cross_entropy(&logits.reshape(&[n, v])?, &target.reshape(&[n])?)
}

/// Rank `rank`'s stage (of 2) under 1F1B; the report's losses are the whole batch's (the
/// mean of the micro-batches', computed on the last stage and summed to every rank).
pub(crate) fn pipeline_parallel(rank: usize, o: &Opts, corpus: &Corpus) -> Res<Report> {
    let group = dist::default_group("pipeline-parallel")?;
    let part = initial_model(o, corpus)?.pipeline_stage(rank, STAGES)?;
    let tied = part.tied_weight();
    let mut stage = PipelineStage::new(part, rank, STAGES, &group)?;
    if let Some(w) = tied {
        // with 2 stages the group of the first and last stage is the whole world
        stage.tie_parameter(&w, &group)?;
    }
    let mut all = ModuleList::new();
    for p in stage.parameters() {
        all.push(Param {
            p,
            core: ModuleCore::new(),
        });
    }
    let mut params = Params {
        all,
        core: ModuleCore::new(),
    };
    let mut sched = Schedule1F1B::new(stage, MICROBATCHES, Some(loss_fn(gpt_loss)))?;
    let trained = train(o, "pipeline-parallel", rank, &mut params, None, |_, s| {
        let (x, y) = Corpus::batch(&corpus.train, o.seed, batches::TRAIN, s, BATCH)?;
        let mut losses = vec![];
        // with --dtype bf16 the forwards run under autocast, as the other runs' (the
        // executor runs them on this thread)
        let _ac = autocast(o)?;
        if rank == 0 {
            sched.step(&x)?;
        } else {
            sched.step_with_target(&y, &mut losses)?;
        }
        mean_on_every_rank(&losses)
    })?;
    let val_loss = validation_loss(&mut sched, rank, o, corpus)?;
    Ok(trained.report(val_loss))
}

/// The mean of the last stage's `losses` (empty on the other rank), on every rank.
fn mean_on_every_rank(losses: &[Tensor]) -> Res<f64> {
    let mut sum = 0.0;
    for l in losses {
        sum += l.item_f64()?;
    }
    let n = losses.len().max(1) as f64;
    let t = Tensor::from_vec(vec![sum / n], &[1])?;
    dist::all_reduce(&t, ReduceOp::Sum, None)?;
    Ok(t.item::<f64>()?)
}

/// The validation loss through the pipeline (forward only).
fn validation_loss(
    sched: &mut PipelineSchedule,
    rank: usize,
    o: &Opts,
    corpus: &Corpus,
) -> Res<f64> {
    let _g = no_grad();
    let _ac = autocast(o)?;
    let mut losses = vec![];
    for b in 0..VAL_BATCHES {
        let (x, y) = Corpus::batch(&corpus.val, o.seed, batches::VALIDATION, b, BATCH)?;
        let outs = sched.eval((rank == 0).then_some(std::slice::from_ref(&x)))?;
        if let Some(logits) = outs.first() {
            losses.push(gpt_loss(logits, &y)?);
        }
    }
    mean_on_every_rank(&losses)
}
