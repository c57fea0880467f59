//! The data-parallel run (the third of three): each rank holds the whole MLP in a
//! `DistributedDataParallel` and takes its share of every minibatch; the loss reported is
//! the whole minibatch's.

use std::cell::RefCell;
use std::time::Duration;

use tensorplay as tp;
use tensorplay_examples::resume::{self, Progress};
use tensorplay_examples::wine;
use tp::distributed::checkpoint;
use tp::distributed::{self as dist, ReduceOp};
use tp::nn::{self, Module};
use tp::optim::{Adam, Optimizer};
use tp::{Tensor, no_grad};
use wine::CLASSES;

use crate::args::Opts;
use crate::report::{Report, finished, record_done};
use crate::train::{adam, collective_bytes, copy_linear, init_group, reference, train};
use crate::{BATCH, HIDDEN, Res, WORLD};

/// The MLP from the seed (the same initial weights as the other runs' references) and a deep
/// copy of it for the reference.
fn mlp(seed: u64, f: usize) -> Res<(nn::Sequential, nn::Sequential)> {
    tp::manual_seed(seed);
    let l1 = nn::Linear::new(f, HIDDEN, true)?;
    let l2 = nn::Linear::new(HIDDEN, HIDDEN, true)?;
    let l3 = nn::Linear::new(HIDDEN, CLASSES, true)?;
    let full = nn::Sequential::new()
        .add(copy_linear(&l1)?)
        .add(nn::ReLU::new())
        .add(copy_linear(&l2)?)
        .add(nn::ReLU::new())
        .add(copy_linear(&l3)?);
    let model = nn::Sequential::new()
        .add(l1)
        .add(nn::ReLU::new())
        .add(l2)
        .add(nn::ReLU::new())
        .add(l3);
    Ok((model, full))
}

/// This rank's rows of a minibatch of `b` rows: `(start, len)`; rank 0 takes the first
/// ceil(b/2), rank 1 the rest.
fn dp_shard(b: usize, rank: usize) -> (usize, usize) {
    let first = b.div_ceil(WORLD);
    let start = (rank * first).min(b);
    (start, first.min(b - start))
}

pub(crate) fn data_parallel(rank: usize, init: &str, o: &Opts) -> Res<Report> {
    use tp::nn::parallel::DistributedDataParallel as Ddp;
    const RUN: &str = "data-parallel";
    if let Some(r) = finished(o, RUN, rank)? {
        return Ok(r);
    }
    let (train_set, test, f) = wine::load()?;
    let batches = wine::batches(&train_set, f, BATCH)?;
    let path = o
        .checkpoint
        .as_ref()
        .map(|c| c.dir.join(format!("{RUN}.safetensors")));
    // rank 0 wrote it; every rank reads it (before any rank can write a newer one: the next
    // save needs every rank's steps)
    let resumed = match &path {
        Some(p) if p.is_file() => {
            let (t, m) = tp::serialize::load_with_metadata(p)?;
            Some(resume::unpack(t, &m, &p.display().to_string())?)
        }
        _ => None,
    };
    init_group(rank, init)?;
    let (mut model, full) = mlp(o.seed, f)?;
    if let Some(u) = &resumed {
        model.load_state_dict(&u.model, true)?;
    }
    // broadcasts rank 0's parameters (the same ones: every rank built or loaded them)
    let ddp = Ddp::new(model)?;
    let loss_fn = nn::CrossEntropyLoss::new();
    let opt = RefCell::new(Adam::new(ddp.parameters(), adam())?);
    let mut start = Progress::default();
    if let Some(u) = resumed {
        opt.borrow_mut()
            .load_state_dict(&u.opt.ok_or("checkpoint lacks the optimizer state")?)?;
        start = u.progress;
    }
    let p = train(
        o,
        RUN,
        rank,
        &batches,
        start,
        |x, y| {
            let mut opt = opt.borrow_mut();
            let b = y.numel();
            let (first, len) = dp_shard(b, rank);
            let share = len as f64 / b as f64;
            opt.zero_grad()?;
            let local = loss_fn.forward(
                &ddp.call(&x.narrow(0, first, len)?)?,
                &y.narrow(0, first, len)?,
            )?;
            // DDP divides the summed gradients by WORLD: scaled by WORLD * b_r / b, they add up
            // to the gradient of the whole minibatch's mean loss
            local.mul_scalar(WORLD as f64 * share)?.backward()?;
            opt.step()?;
            // the whole minibatch's mean loss: the ranks' shares of it, summed
            let _g = no_grad();
            let t = Tensor::from_vec(vec![local.item_f64()? * share], &[1])?;
            dist::all_reduce(&t, ReduceOp::Sum, None)?;
            Ok(t.item::<f64>()?)
        },
        |p| {
            let Some(path) = &path else {
                return Ok(());
            };
            // replicated: rank 0 writes, the others wait for it
            let state = ddp.module().state_dict()?;
            let (t, m) = resume::pack(&state, Some(&opt.borrow().state_dict()?), p);
            checkpoint::save_replicated(&t, &m, path, None)?;
            Ok(())
        },
    )?;
    let accuracy = if rank == 0 {
        let _g = no_grad();
        let logits = ddp
            .module()
            .call(&Tensor::from_slice(&test.x, &[test.rows(), f])?)?;
        wine::accuracy(&logits, &test.y)?
    } else {
        0.0
    };
    let collective_bytes = collective_bytes()?;
    drop(opt);
    drop(ddp);
    dist::destroy_process_group()?;
    let reference = if rank == 0 {
        reference(&full, &batches, p.losses.len())?
    } else {
        Vec::new()
    };
    let r = Report {
        accuracy,
        losses: p.losses,
        reference,
        epoch_losses: p.epoch_losses,
        wall: Duration::from_secs_f64(p.wall),
        collective_bytes,
        rpc_bytes: 0,
    };
    record_done(o, RUN, rank, &r)?;
    Ok(r)
}
