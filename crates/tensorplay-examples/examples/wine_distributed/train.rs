//! What every run shares: the single-process reference, the recipe (Adam), the training loop
//! with its progress bar and checkpoints, and the process group of the two collective runs.

use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use tensorplay as tp;
use tensorplay_examples::resume::{self, Progress};
use tp::Tensor;
use tp::distributed::{self as dist, ReduceOp};
use tp::nn::{self, Module};
use tp::optim::{Adam, AdamOptions, Optimizer};

use crate::args::Opts;
use crate::{COMPARE_STEPS, Res, WORLD};

fn progress(epochs: usize, what: &str, rank: usize) -> ProgressBar {
    if rank != 0 {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(epochs as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{prefix:>16} {bar:30} {pos}/{len} epochs [{elapsed}] {msg}")
    {
        bar.set_style(style);
    }
    bar.set_prefix(what.to_string());
    bar
}

pub(crate) fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// The single-process reference: `model` trained for `steps` steps of the same recipe;
/// returns the losses.
pub(crate) fn reference(
    model: &nn::Sequential,
    batches: &[(Tensor, Tensor)],
    steps: usize,
) -> Res<Vec<f64>> {
    let loss_fn = nn::CrossEntropyLoss::new();
    let mut opt = Adam::new(model.parameters(), adam())?;
    let mut losses = Vec::with_capacity(steps);
    for (x, y) in batches.iter().cycle().take(steps) {
        opt.zero_grad()?;
        let loss = loss_fn.forward(&model.call(x)?, y)?;
        losses.push(loss.item_f64()?);
        loss.backward()?;
        opt.step()?;
    }
    Ok(losses)
}

pub(crate) fn adam() -> AdamOptions {
    AdamOptions {
        lr: 1e-3,
        ..Default::default()
    }
}

/// A new leaf with a copy of `t`'s values (its own storage, no history).
pub(crate) fn fresh(t: &Tensor) -> tp::Result<Tensor> {
    Ok(t.detach().deep_clone()?.requires_grad_(true))
}

/// A deep copy of a Linear (its own storage).
pub(crate) fn copy_linear(l: &nn::Linear) -> Res<nn::Linear> {
    let w = fresh(&l.weight)?;
    let b = match &l.bias {
        Some(b) => Some(fresh(b)?),
        None => None,
    };
    Ok(nn::Linear::from_weights(w, b)?)
}

/// The training loop every run shares, from `p` (a fresh start or a checkpoint) to the last
/// epoch: `step(x, y)` takes one optimizer step on a minibatch and returns its mean loss;
/// `save(p)` writes a checkpoint, every `--checkpoint-every` steps.
pub(crate) fn train(
    o: &Opts,
    run: &str,
    rank: usize,
    batches: &[(Tensor, Tensor)],
    mut p: Progress,
    mut step: impl FnMut(&Tensor, &Tensor) -> Res<f64>,
    mut save: impl FnMut(&Progress) -> Res<()>,
) -> Res<Progress> {
    let rows: usize = batches.iter().map(|(_, y)| y.numel()).sum();
    let bar = progress(o.epochs, run, rank);
    bar.set_position(p.epoch_losses.len() as u64);
    let start = Instant::now();
    let wall_before = p.wall;
    let steps = o.epochs * batches.len();
    while p.step < steps {
        let (x, y) = &batches[p.step % batches.len()];
        let loss = step(x, y)?;
        if p.losses.len() < COMPARE_STEPS {
            p.losses.push(loss);
        }
        p.total += loss * y.numel() as f64;
        p.step += 1;
        if p.step.is_multiple_of(batches.len()) {
            let mean = p.total / rows as f64;
            p.epoch_losses.push(mean);
            p.total = 0.0;
            bar.set_message(format!("loss {mean:.4}"));
            bar.inc(1);
        }
        if let Some(c) = &o.checkpoint
            && p.step.is_multiple_of(c.every)
            && p.step < steps
        {
            p.wall = wall_before + start.elapsed().as_secs_f64();
            save(&p)?;
        }
        resume::maybe_kill(run, p.step, rank);
    }
    bar.finish_and_clear();
    p.wall = wall_before + start.elapsed().as_secs_f64();
    Ok(p)
}

/// Joins the 2-rank process group of the tensor-parallel and data-parallel runs.
pub(crate) fn init_group(rank: usize, init: &str) -> Res<()> {
    dist::init_process_group(
        "cpu",
        dist::InitOptions {
            init_method: init.to_string(),
            rank: Some(rank),
            world_size: Some(WORLD),
            timeout: Duration::from_secs(120),
        },
    )?;
    Ok(())
}

/// The bytes every rank's collectives sent on the default group, summed over the ranks.
pub(crate) fn collective_bytes() -> Res<u64> {
    let sent = Tensor::from_vec(
        vec![dist::default_group("bytes")?.bytes_sent() as f64],
        &[1],
    )?;
    dist::all_reduce(&sent, ReduceOp::Sum, None)?;
    Ok(sent.item::<f64>()? as u64)
}
