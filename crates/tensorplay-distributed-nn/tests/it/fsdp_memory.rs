//! What a fully sharded rank holds, measured with `tp::memory` in real processes: the peak
//! bytes of a training step against the replicated run's, and gradient accumulation
//! (`set_requires_gradient_sync(false)`) against one process.

use std::time::Duration;

use tensorplay_core::nn::{Linear, Module, ModuleFields, Sequential, Tanh};
use tensorplay_core::optim::{AdamW, AdamWOptions, Optimizer};
use tensorplay_core::{self as tp, Tensor};
use tensorplay_distributed_nn::parallel::fsdp::{FsdpModule, FsdpOptions, fully_shard};
use tensorplay_testkit::{Tol, check_close, cpu_world};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

const WIDTH: usize = 64;
const LAYERS: usize = 8;

/// `LAYERS` Linear(WIDTH, WIDTH) layers with Tanh between, from a fixed seed.
fn model() -> tp::Result<Sequential> {
    tp::manual_seed(5);
    let mut m = Sequential::new();
    for _ in 0..LAYERS {
        m = m.add(Linear::new(WIDTH, WIDTH, true)?).add(Tanh::new());
    }
    Ok(m)
}

/// Every layer fully sharded, then the root (which holds no parameter of its own); shared
/// with the misuse tests.
pub(crate) fn shard(m: &mut Sequential) -> tp::Result<Vec<FsdpModule>> {
    let mut out = Vec::new();
    for (_, child) in m.named_children_mut() {
        if !child.local_parameters().is_empty() {
            out.push(fully_shard(child, FsdpOptions::default())?);
        }
    }
    out.push(fully_shard(m, FsdpOptions::default())?);
    Ok(out)
}

fn batch(rank: usize, rows: usize) -> tp::Result<Tensor> {
    let v: Vec<f32> = (0..rows * WIDTH)
        .map(|i| (((rank * 7919 + i) * 31) % 97) as f32 / 97.0 - 0.5)
        .collect();
    Tensor::from_vec(v, &[rows, WIDTH])
}

/// The peak bytes allocated during a training step after the first (the optimizer's state
/// exists), above what was allocated before the model was built.
fn step_peak(rank: usize, sharded: bool) -> tp::Result<usize> {
    let base = tp::memory::allocated_bytes();
    let mut m = model()?;
    if sharded {
        shard(&mut m)?;
    }
    let mut opt = AdamW::new(m.parameters(), AdamWOptions::default())?;
    let x = batch(rank, 2)?;
    let mut peak = 0;
    for step in 0..2 {
        tp::memory::reset_peak();
        opt.zero_grad()?;
        m.call(&x)?.pow_scalar(2.0)?.mean()?.backward()?;
        opt.step()?;
        if step == 1 {
            peak = tp::memory::peak_allocated_bytes() - base;
        }
    }
    Ok(peak)
}

/// Fully sharded, a rank's peak during a step is at most its share of the replicated
/// state plus five layers' worth of transient buffers (4.2 measured at worlds 2 and 4: the
/// gathered layer, its whole gradients, the all-gather output and the reduce-scatter input,
/// one at a time). The replicated run holds parameters, gradients and AdamW's two moments:
/// 16 bytes a parameter.
#[test]
fn a_rank_holds_its_share_plus_a_few_groups() {
    for world in [2, 4] {
        cpu_world(world, Duration::from_secs(60), |rank| -> TestResult {
            let replicated = step_peak(rank, false)?;
            let sharded = step_peak(rank, true)?;
            let group = (WIDTH * WIDTH + WIDTH) * 4; // one layer's float32 parameters
            let state = LAYERS * group * 4; // parameters, gradients, two moments
            let bound = state / world + 5 * group;
            if replicated < state {
                return Err(format!("replicated peak {replicated} below its state {state}").into());
            }
            if sharded > bound {
                return Err(format!(
                    "world {world}, rank {rank}: peak {sharded} bytes fully sharded, above \
                     {bound} (state {state} / {world} + 5 layers of {group}); replicated \
                     {replicated}"
                )
                .into());
            }
            if rank == 0 {
                eprintln!(
                    "world {world}: step peak {sharded} bytes sharded, {replicated} replicated \
                     (state {state}, a layer {group})"
                );
            }
            Ok(())
        });
    }
}

/// Micro-batches with `set_requires_gradient_sync(false)` accumulate whole gradients; the
/// synced last one reduce-scatters their sum: the shards' gradients equal one process's over
/// all micro-batches of all ranks.
#[test]
fn gradient_accumulation_matches_one_process() {
    const MICRO: usize = 3;
    cpu_world(2, Duration::from_secs(60), |rank| -> TestResult {
        let mut m = model()?;
        let handles = shard(&mut m)?;
        let reference = model()?;
        for k in 0..MICRO {
            let sync = k + 1 == MICRO;
            for h in &handles {
                h.set_requires_gradient_sync(sync);
            }
            m.call(&batch(rank * MICRO + k, 2)?)?
                .pow_scalar(2.0)?
                .mean()?
                .backward()?;
            if !sync && m.parameters().iter().any(|p| p.grad().is_some()) {
                return Err(
                    format!("micro-batch {k}: a shard got a gradient before the sync").into(),
                );
            }
        }
        for r in 0..2 {
            for k in 0..MICRO {
                // each rank's loss enters its gradient once; FSDP averages over the 2 ranks
                reference
                    .call(&batch(r * MICRO + k, 2)?)?
                    .pow_scalar(2.0)?
                    .mean()?
                    .div_scalar(2.0)?
                    .backward()?;
            }
        }
        for ((n, s), (_, r)) in m
            .named_parameters()
            .iter()
            .zip(reference.named_parameters())
        {
            let g = s.grad().ok_or_else(|| format!("no gradient for {n}"))?;
            let all: Vec<Vec<f64>> =
                tensorplay_collectives::all_gather_object(&g.to_vec_f64()?, None)?;
            let want = r.grad().ok_or("no reference gradient")?.to_vec_f64()?;
            check_close(
                &format!("grad of {n}"),
                &all.concat(),
                &want,
                Tol::scaled(1e-6),
            )?;
        }
        Ok(())
    });
}
