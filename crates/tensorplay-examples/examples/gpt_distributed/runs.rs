//! The runs of the job: the single-process reference and the three distributed runs
//! (tensor-parallel, data-parallel, fully-sharded), each trained by [`train`] with the recipe.
//! With `--dtype bf16` every forward runs under [`autocast`] bfloat16 over the float32 master
//! weights, and the fully-sharded run gathers its parameters in bfloat16 and reduces its
//! gradients in float32 ([`mp_policy`]).

use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use tensorplay as tp;
use tp::distributed::fsdp::{FsdpOptions, MixedPrecisionPolicy, fully_shard};
use tp::distributed::{self as dist, ReduceOp};
use tp::models::Gpt;
use tp::nn::Module;
use tp::nn::parallel::DistributedDataParallel as Ddp;
use tp::optim::lr_scheduler::{LrScheduler, WarmupCosineLR};
use tp::optim::{AdamW, Optimizer};
use tp::{DType, Device, Tensor, no_grad};

use tensorplay_examples::gpt_batches as batches;
use tensorplay_examples::gpt_checks::{MEMORY_FIRST_STEP, state_bytes};

use super::args::Opts;
use super::checkpointing::Checkpointing;
use super::{BATCH, Corpus, Res, VAL_BATCHES, WARMUP, adamw, config};

pub(crate) struct Report {
    /// The training loss of every step.
    pub(crate) losses: Vec<f64>,
    pub(crate) val_loss: f64,
    pub(crate) wall: Duration,
    /// Resident bytes after step [`MEMORY_FIRST_STEP`] and after the last step.
    pub(crate) resident: [Option<u64>; 2],
    /// Rank 0's bytes of parameters, gradients and optimizer state after the last step
    /// ([`state_bytes`]).
    pub(crate) state_bytes: usize,
}

fn progress(steps: usize, what: &str, rank: usize) -> ProgressBar {
    if rank != 0 {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(steps as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{prefix:>16} {bar:30} {pos}/{len} steps [{elapsed}] {msg}")
    {
        bar.set_style(style);
    }
    bar.set_prefix(what.to_string());
    bar
}

/// The autocast region of one forward: bfloat16 on the CPU with `--dtype bf16`, none with
/// float32. Backward runs outside it (it takes the forward's dtypes).
pub(crate) fn autocast(o: &Opts) -> Res<Option<tp::amp::AutocastGuard>> {
    Ok(match o.dtype {
        DType::F32 => None,
        d => Some(tp::autocast(Device::Cpu, d)?),
    })
}

/// The fully-sharded run's precision: with `--dtype bf16`, torchtitan's policy (parameters
/// gathered and computed in bfloat16, gradients reduce-scattered in float32 into the float32
/// shards); with float32, nothing changes.
fn mp_policy(o: &Opts) -> MixedPrecisionPolicy {
    match o.dtype {
        DType::F32 => MixedPrecisionPolicy::default(),
        d => MixedPrecisionPolicy {
            param_dtype: Some(d),
            reduce_dtype: Some(DType::F32),
            ..Default::default()
        },
    }
}

/// The model every run starts from: built from the seed, the same on every rank.
pub(crate) fn initial_model(o: &Opts, corpus: &Corpus) -> Res<Gpt> {
    tp::manual_seed(o.seed);
    Ok(Gpt::new(config(corpus.vocab.len()))?)
}

/// The recipe's learning-rate schedule for a run of `steps` steps: the warm-up is always
/// [`WARMUP`] steps, so the compared first 100 steps are the same whatever `--steps` is; the
/// cosine decay runs from there to the last step. A run of at most `WARMUP` steps (as in CI,
/// `--steps 100`) ends inside the warm-up.
fn schedule(opt: &mut AdamW, steps: usize) -> Res<WarmupCosineLR> {
    Ok(WarmupCosineLR::new(
        opt,
        WARMUP,
        steps.max(WARMUP + 1),
        0.1,
    )?)
}

/// What [`train`] measured.
pub(crate) struct Trained {
    losses: Vec<f64>,
    wall: Duration,
    resident: [Option<u64>; 2],
    state_bytes: usize,
}

impl Trained {
    pub(crate) fn report(self, val_loss: f64) -> Report {
        Report {
            losses: self.losses,
            val_loss,
            wall: self.wall,
            resident: self.resident,
            state_bytes: self.state_bytes,
        }
    }
}

/// `steps` optimizer steps of the recipe on `model`'s parameters; `step(model, index)` runs one
/// forward and backward and returns the loss of the whole batch. With `ckpt`, the run starts
/// from the committed checkpoint in its folder (if any) and saves one every `every` steps.
pub(crate) fn train<M: Module + ?Sized>(
    o: &Opts,
    run: &str,
    rank: usize,
    model: &mut M,
    ckpt: Option<&Checkpointing>,
    mut step: impl FnMut(&M, usize) -> Res<f64>,
) -> Res<Trained> {
    let params = model.parameters();
    let mut opt = AdamW::new(params.clone(), adamw())?;
    let mut sched = schedule(&mut opt, o.steps)?;
    let (first, mut losses) = match ckpt {
        Some(c) => c.resume(model, &mut opt)?,
        None => (0, Vec::with_capacity(o.steps)),
    };
    // the schedule is a function of the step: replayed to where the checkpoint left it
    for _ in 0..first {
        sched.step(&mut opt)?;
    }
    let bar = progress(o.steps, run, rank);
    bar.set_position(first as u64);
    let start = Instant::now();
    let mut resident = [None; 2];
    for s in first..o.steps {
        opt.zero_grad()?;
        let loss = step(model, s)?;
        if !loss.is_finite() {
            return Err(format!("{run}: the loss of step {s} is {loss}").into());
        }
        opt.step()?;
        sched.step(&mut opt)?;
        losses.push(loss);
        if s + 1 == MEMORY_FIRST_STEP {
            resident[0] = tp::memory::process_resident_bytes();
        }
        if s % 10 == 0 {
            bar.set_message(format!("loss {loss:.4}"));
        }
        bar.inc(1);
        if let Some(c) = ckpt {
            c.after_step(s + 1, model, &mut opt, &losses, rank)?;
        }
    }
    bar.finish_and_clear();
    let wall = start.elapsed();
    resident[1] = tp::memory::process_resident_bytes();
    Ok(Trained {
        losses,
        wall,
        resident,
        state_bytes: state_bytes(&params, &opt)?,
    })
}

/// The mean loss of the fixed validation batches (in the run's precision).
fn validation_loss(model: &Gpt, corpus: &Corpus, o: &Opts) -> Res<f64> {
    let _g = no_grad();
    let _ac = autocast(o)?;
    let mut sum = 0.0;
    for b in 0..VAL_BATCHES {
        let (x, y) = Corpus::batch(&corpus.val, o.seed, batches::VALIDATION, b, BATCH)?;
        sum += model.loss(&x, &y)?.item_f64()?;
    }
    Ok(sum / VAL_BATCHES as f64)
}

pub(crate) fn single_process(o: &Opts, corpus: &Corpus) -> Res<(Report, Gpt)> {
    // 0: the default rule (the cores of the process's affinity)
    tp::set_num_threads(o.threads.map_or(0, usize::from));
    let mut model = initial_model(o, corpus)?;
    let trained = train(o, "single-process", 0, &mut model, None, |m, s| {
        whole_batch_step(m, o, corpus, s)
    })?;
    let val_loss = validation_loss(&model, corpus, o)?;
    Ok((trained.report(val_loss), model))
}

pub(crate) fn tensor_parallel(
    rank: usize,
    o: &Opts,
    corpus: &Corpus,
    ckpt: Option<&Checkpointing>,
) -> Res<Report> {
    let group = dist::default_group("tensor-parallel")?;
    let mut model = initial_model(o, corpus)?.tensor_parallel(&group)?;
    // every rank computes the whole batch's loss; each shard's gradient is its slice of the
    // single-process gradient
    let trained = train(o, "tensor-parallel", rank, &mut model, ckpt, |m, s| {
        whole_batch_step(m, o, corpus, s)
    })?;
    let val_loss = validation_loss(&model, corpus, o)?;
    Ok(trained.report(val_loss))
}

/// One step on the whole batch (single-process and tensor-parallel): forward (under
/// autocast with `--dtype bf16`), backward, the loss.
fn whole_batch_step(model: &Gpt, o: &Opts, corpus: &Corpus, s: usize) -> Res<f64> {
    let (x, y) = Corpus::batch(&corpus.train, o.seed, batches::TRAIN, s, BATCH)?;
    let loss = {
        let _ac = autocast(o)?;
        model.loss(&x, &y)?
    };
    loss.backward()?;
    Ok(loss.item_f64()?)
}

/// One step of a run in which each rank takes its rows of the batch (data-parallel and
/// fully-sharded): forward through `model` (the wrapper that runs the collectives),
/// backward of the rank's mean loss, and the whole batch's loss (the mean of the ranks'), rank
/// `rank` of `world` (which divides [`BATCH`]).
fn sharded_batch_step(
    model: &dyn Module,
    (rank, world): (usize, usize),
    o: &Opts,
    corpus: &Corpus,
    s: usize,
) -> Res<f64> {
    let rows = batches::shard_rows(BATCH, rank, world);
    let (x, y) = Corpus::batch(&corpus.train, o.seed, batches::TRAIN, s, BATCH)?;
    let (x, y) = (
        x.narrow(0, rows.start, rows.len())?,
        y.narrow(0, rows.start, rows.len())?,
    );
    let local = {
        let _ac = autocast(o)?;
        let logits = model.call(&x)?;
        let n = y.numel();
        let v = logits.shape()[2];
        tp::nn::functional::cross_entropy(&logits.reshape(&[n, v])?, &y.reshape(&[n])?)?
    };
    // both wrappers average the gradients of the equal shares: the whole batch's mean loss
    local.backward()?;
    let _g = no_grad();
    let t = Tensor::from_vec(vec![local.item_f64()? / world as f64], &[1])?;
    dist::all_reduce(&t, ReduceOp::Sum, None)?;
    Ok(t.item::<f64>()?)
}

/// The data-parallel run, rank `rank` of `world`.
pub(crate) fn data_parallel(
    (rank, world): (usize, usize),
    o: &Opts,
    corpus: &Corpus,
    ckpt: Option<&Checkpointing>,
) -> Res<Report> {
    // broadcasts rank 0's parameters (the same ones: every rank built them from the seed)
    let mut ddp = Ddp::new(initial_model(o, corpus)?)?;
    let trained = train(o, "data-parallel", rank, &mut ddp, ckpt, |m, s| {
        sharded_batch_step(m, (rank, world), o, corpus, s)
    })?;
    let val_loss = validation_loss(ddp.module(), corpus, o)?;
    Ok(trained.report(val_loss))
}

/// Each block fully sharded, then the root (the embeddings, the tied head and the final
/// LayerNorm): every rank keeps half of every parameter, its gradient and AdamW's moments
/// (float32 also with `--dtype bf16`: the shards are the master weights).
pub(crate) fn fully_sharded(
    (rank, world): (usize, usize),
    o: &Opts,
    corpus: &Corpus,
    ckpt: Option<&Checkpointing>,
) -> Res<Report> {
    // no broadcast: every rank built the same weights from the seed, as FSDP2 expects
    let mut model = initial_model(o, corpus)?;
    let opts = || FsdpOptions {
        mp_policy: mp_policy(o),
        ..Default::default()
    };
    for block in model.h.iter_mut() {
        fully_shard(block, opts())?;
    }
    fully_shard(&mut model, opts())?;
    let trained = train(o, "fully-sharded", rank, &mut model, ckpt, |m, s| {
        sharded_batch_step(m, (rank, world), o, corpus, s)
    })?;
    let val_loss = validation_loss(&model, corpus, o)?;
    Ok(trained.report(val_loss))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MAX_STEPS;
    use tensorplay_examples::gpt_checks::COMPARE_STEPS;

    #[test]
    fn the_schedule_accepts_every_permitted_step_count() {
        // CI runs `--steps 100`: the warm-up alone (this was refused once, failing CI)
        for steps in [COMPARE_STEPS, WARMUP, WARMUP + 1, 600, MAX_STEPS] {
            let w = Tensor::from_vec(vec![0.0f32; 2], &[2])
                .unwrap()
                .requires_grad_(true);
            let mut opt = AdamW::new(vec![w], adamw()).unwrap();
            let mut sched =
                schedule(&mut opt, steps).unwrap_or_else(|e| panic!("--steps {steps}: {e}"));
            let mut lrs = Vec::new();
            for _ in 0..COMPARE_STEPS {
                sched.step(&mut opt).unwrap();
                lrs.push(opt.lr());
            }
            // the compared steps warm up the same way for every run length
            assert!(
                (lrs[9] - 1e-3 * 11.0 / 100.0).abs() < 1e-12,
                "--steps {steps}: {lrs:?}"
            );
            assert!(
                lrs.windows(2).all(|p| p[1] >= p[0]),
                "--steps {steps}: {lrs:?}"
            );
        }
    }
}
