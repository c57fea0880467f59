//! Activation checkpointing inside data-parallel modules, across real processes: every layer or
//! block in a `CheckpointWrapper`, then `fully_shard` per layer or block and on the root
//! (torchtitan's order), or the whole model in DDP; gradients and parameters after a few steps
//! against the single-process run without checkpointing, with the tolerances of `fsdp.rs`.
//! The recomputation in backward runs while the block's group is gathered by its pre-backward
//! hook: with the parameters freed it would compute with empty tensors and fail.

use tensorplay_core::DType;
use tensorplay_core::nn::Module;
use tensorplay_distributed_nn::parallel::DistributedDataParallel as Ddp;
use tensorplay_testkit::{check_close, cpu_world};

use super::fsdp::{Case, Model, Wrap, build, case, check_world, loss, optimizer, rows, tol};

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
