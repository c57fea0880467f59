//! The tensor-parallel run (the first of three): the MLP split over the 2 ranks by a plan
//! (`parallelize_module`): `"0"` (11 -> 64) column-parallel, `"2"` (64 -> 64) row-parallel, the
//! head `"4"` replicated. Every rank computes the whole minibatch's loss and backpropagates it;
//! each shard's gradient is then its slice of the single-process gradient, and the replicated
//! head gets the whole gradient on every rank (no further synchronisation).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::Duration;

use tensorplay as tp;
use tensorplay_examples::resume::{self, Progress};
use tensorplay_examples::wine;
use tp::distributed::checkpoint;
use tp::distributed::device_mesh::DeviceMesh;
use tp::distributed::tensor::parallel::{ColwiseParallel, RowwiseParallel, parallelize_module};
use tp::distributed::{self as dist};
use tp::nn::{self, Module};
use tp::optim::{Adam, Optimizer};
use tp::{Tensor, no_grad};
use wine::CLASSES;

use crate::args::Opts;
use crate::report::{Report, finished, record_done};
use crate::train::{adam, collective_bytes, copy_linear, init_group, reference, train};
use crate::{BATCH, HIDDEN, Res};

/// The full model from the seed (identical on every rank), split over the default group by
/// the plan, and a deep copy of the full model for the reference.
fn tp_models(seed: u64, f: usize) -> Res<(nn::Sequential, nn::Sequential)> {
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
    let mut model = nn::Sequential::new()
        .add(l1)
        .add(nn::ReLU::new())
        .add(l2)
        .add(nn::ReLU::new())
        .add(l3);
    let mesh = DeviceMesh::from_group(&dist::default_group("tensor-parallel")?, "tp")?;
    parallelize_module(
        &mut model,
        &mesh,
        &[
            ("0", &ColwiseParallel::new()),
            ("2", &RowwiseParallel::new()),
        ],
    )?;
    Ok((model, full))
}

pub(crate) fn tensor_parallel(rank: usize, init: &str, o: &Opts) -> Res<Report> {
    const RUN: &str = "tensor-parallel";
    if let Some(r) = finished(o, RUN, rank)? {
        return Ok(r);
    }
    let (train_set, test, f) = wine::load()?;
    let batches = wine::batches(&train_set, f, BATCH)?;
    init_group(rank, init)?;
    let (model, full) = tp_models(o.seed, f)?;
    let loss_fn = nn::CrossEntropyLoss::new();
    let opt = RefCell::new(Adam::new(model.parameters(), adam())?);
    let mut start = Progress::default();
    if let Some(c) = &o.checkpoint
        && checkpoint::sharded_exists(&c.dir, RUN)
    {
        // every rank restores its own shard (and optimizer state) of the same step
        let shard = checkpoint::load_sharded(&c.dir, RUN, None)?;
        let file = format!(
            "{}/{RUN}.step{}.rank{rank}.safetensors",
            c.dir.display(),
            shard.step
        );
        let u = resume::unpack(shard.tensors, &shard.metadata, &file)?;
        let named = model.named_parameters();
        let values = named
            .iter()
            .map(|(k, _)| u.model.get(k).ok_or_else(|| format!("shard lacks {k}")))
            .collect::<Result<Vec<_>, _>>()?;
        let params: Vec<Tensor> = named.into_iter().map(|(_, p)| p).collect();
        resume::restore(&params, &values)?;
        opt.borrow_mut()
            .load_state_dict(&u.opt.ok_or("shard lacks the optimizer state")?)?;
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
            opt.zero_grad()?;
            let loss = loss_fn.forward(&model.call(x)?, y)?;
            let value = loss.item_f64()?;
            // every rank computes the same loss and backpropagates all of it
            loss.backward()?;
            opt.step()?;
            Ok(value)
        },
        |p| {
            let Some(c) = &o.checkpoint else {
                return Ok(());
            };
            let state: BTreeMap<String, Tensor> = model.named_parameters().into_iter().collect();
            let (t, m) = resume::pack(&state, Some(&opt.borrow().state_dict()?), p);
            checkpoint::save_sharded(&c.dir, RUN, p.step as u64, &t, &m, None)?;
            Ok(())
        },
    )?;
    let accuracy = {
        let _g = no_grad();
        let logits = model.call(&Tensor::from_slice(&test.x, &[test.rows(), f])?)?;
        wine::accuracy(&logits, &test.y)?
    };
    let collective_bytes = collective_bytes()?;
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
