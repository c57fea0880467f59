//! Activation checkpointing inside data-parallel modules, across real processes: every layer or
//! block in a `CheckpointWrapper`, then `fully_shard` per layer or block and on the root
//! (torchtitan's order), or the whole model in DDP; gradients and parameters after a few steps
//! against the single-process run without checkpointing, with the tolerances of `fsdp.rs`.
//! The recomputation in backward runs while the block's group is gathered by its pre-backward
//! hook: with the parameters freed it would compute with empty tensors and fail.

use std::sync::{Arc, Mutex};

use tensorplay_core::nn::{Linear, Module, ModuleCore, Sequential};
use tensorplay_core::utils::checkpoint::CheckpointWrapper;
use tensorplay_core::{self as tp, DType, Tensor};
use tensorplay_distributed_nn::parallel::DistributedDataParallel as Ddp;
use tensorplay_distributed_nn::parallel::fsdp::{FsdpOptions, fully_shard};
use tensorplay_testkit::{Tol, check_close, cpu_world};

use super::fsdp::{
    Case, Model, Wrap, build, case, check_world, gathered, loss, optimizer, rows, tol,
};

const fn checkpointed(c: Case) -> Case {
    Case {
        checkpointed: true,
        ..c
    }
}

const CASES: [Case; 4] = [
    checkpointed(case(
        "gpt, per-block checkpointing, reshard after forward",
        Model::Gpt,
        Wrap::Nested,
        true,
        DType::F64,
    )),
    checkpointed(case(
        "gpt, per-block checkpointing, kept until backward",
        Model::Gpt,
        Wrap::Nested,
        false,
        DType::F64,
    )),
    checkpointed(case(
        "gpt, per-block checkpointing, float32",
        Model::Gpt,
        Wrap::Nested,
        true,
        DType::F32,
    )),
    checkpointed(case(
        "mlp, per-layer checkpointing",
        Model::Mlp,
        Wrap::Nested,
        true,
        DType::F64,
    )),
];

#[test]
fn fully_sharded_checkpointed_blocks_match_one_process_world_2() {
    check_world(2, &CASES);
}

/// DDP over the GPT with every block checkpointed: each step's gradients and the parameters
/// after the last equal one process's on the whole batch, without checkpointing.
#[test]
fn ddp_with_checkpointed_blocks_matches_one_process_world_2() {
    const WORLD: usize = 2;
    const BATCH: usize = 8;
    cpu_world(
        WORLD,
        std::time::Duration::from_secs(60),
        |rank| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            let c = checkpointed(case(
                "gpt under ddp",
                Model::Gpt,
                Wrap::RootOnly,
                true,
                DType::F64,
            ));
            let ddp = Ddp::new(build(&c, true)?)?;
            let reference = build(&c, false)?;
            let mut opt = optimizer(ddp.parameters(), c.dtype)?;
            let mut ref_opt = optimizer(reference.parameters(), c.dtype)?;
            let per = BATCH / WORLD;
            for step in 0..3 {
                let (x, y) = rows(&c, step * BATCH + rank * per, per)?;
                let (xa, ya) = rows(&c, step * BATCH, BATCH)?;
                opt.zero_grad()?;
                loss(&c, &ddp, &x, &y)?.backward()?;
                ref_opt.zero_grad()?;
                loss(&c, reference.as_ref(), &xa, &ya)?.backward()?;
                for ((n, p), (_, r)) in ddp
                    .module()
                    .named_parameters()
                    .iter()
                    .zip(reference.named_parameters())
                {
                    let (g, h) = (p.grad().ok_or("no grad")?, r.grad().ok_or("no ref grad")?);
                    check_close(
                        &format!("ddp, step {step}: grad of {n}"),
                        &g.to_vec_f64()?,
                        &h.to_vec_f64()?,
                        tol(c.dtype),
                    )?;
                }
                opt.step()?;
                ref_opt.step()?;
            }
            for ((n, p), (_, r)) in ddp
                .module()
                .named_parameters()
                .iter()
                .zip(reference.named_parameters())
            {
                check_close(
                    &format!("ddp: {n} after 3 steps"),
                    &p.to_vec_f64()?,
                    &r.to_vec_f64()?,
                    tol(c.dtype),
                )?;
            }
            Ok(())
        },
    );
}

/// A linear layer and tanh that records, at every forward, whether its weight held the whole
/// parameter (gathered) or was freed.
#[derive(Module)]
struct Recording {
    lin: Linear,
    #[module(skip)]
    gathered: Arc<Mutex<Vec<bool>>>,
    core: ModuleCore,
}

impl Module for Recording {
    fn forward(&self, x: &Tensor) -> tp::Result<Tensor> {
        let w = &self.lin.weight;
        let whole = w.storage_numel() == w.numel();
        self.gathered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(whole);
        self.lin.call(x)?.tanh()
    }
}

/// Three layers of width 6, each checkpointed when `ac`; the log their forwards write to.
fn recording_model(ac: bool) -> tp::Result<(Sequential, Arc<Mutex<Vec<bool>>>)> {
    tp::manual_seed(9);
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut m = Sequential::new();
    for _ in 0..3 {
        let r = Recording {
            lin: Linear::new(6, 6, true)?,
            gathered: log.clone(),
            core: ModuleCore::new(),
        };
        m = if ac {
            m.add(CheckpointWrapper::new(r))
        } else {
            m.add(r)
        };
    }
    Ok((m, log))
}

/// Under `fully_shard` with resharding after forward, each checkpointed layer's forward runs
/// twice, and both times (forward, and recomputation in backward) on gathered parameters; the
/// reduce-scattered gradients equal one process's.
#[test]
fn recomputation_runs_on_gathered_parameters() {
    cpu_world(
        2,
        std::time::Duration::from_secs(60),
        |rank| -> Result<(), String> {
            let e = |e: tp::Error| e.to_string();
            let (mut model, log) = recording_model(true).map_err(e)?;
            let (reference, _) = recording_model(false).map_err(e)?;
            let layers: Vec<_> = (0..3).map(|i| i.to_string()).collect();
            for (name, child) in tensorplay_core::nn::ModuleFields::named_children_mut(&mut model) {
                if layers.contains(&name) {
                    fully_shard(child, FsdpOptions::default()).map_err(e)?;
                }
            }
            fully_shard(&mut model, FsdpOptions::default()).map_err(e)?;
            let data = |from: usize, n: usize| {
                let v: Vec<f32> = (from * 6..(from + n) * 6)
                    .map(|i| ((i * 37 % 23) as f32) / 23.0 - 0.5)
                    .collect();
                Tensor::from_vec(v, &[n, 6])
            };
            let x = data(rank * 4, 4).map_err(e)?;
            model
                .call(&x)
                .map_err(e)?
                .pow_scalar(2.0)
                .map_err(e)?
                .sum()
                .map_err(e)?
                .backward()
                .map_err(e)?;
            let xa = data(0, 8).map_err(e)?;
            // the sum over the whole batch is twice the mean of the ranks' sums: halve it
            reference
                .call(&xa)
                .map_err(e)?
                .pow_scalar(2.0)
                .map_err(e)?
                .sum()
                .map_err(e)?
                .mul_scalar(0.5)
                .map_err(e)?
                .backward()
                .map_err(e)?;
            let seen = log.lock().map_err(|p| p.to_string())?.clone();
            if seen != [true; 6] {
                return Err(format!(
                    "rank {rank}: forwards saw gathered weights {seen:?}; want 6 (3 forwards, 3 \
                 recomputations), all gathered"
                ));
            }
            for ((n, s), (_, r)) in model
                .named_parameters()
                .iter()
                .zip(reference.named_parameters())
            {
                let (g, h) = (
                    s.grad().ok_or("no grad")?,
                    r.grad().ok_or("no reference grad")?,
                );
                check_close(
                    &format!("rank {rank}: grad of {n}"),
                    &gathered(&g).map_err(e)?,
                    &h.to_vec_f64().map_err(e)?,
                    Tol::scaled(1e-5),
                )?;
            }
            Ok(())
        },
    );
}
