//! `fully_shard` over 2-D meshes at world 4, against the single-process run of the whole
//! batch: HSDP (a `[replicate 2, shard 2]` mesh: shards over one dimension, replicas over the
//! other) and fully sharded data parallelism composed with tensor parallelism (a `[dp 2, tp
//! 2]` mesh: the GPT split Megatron-style inside each tp group, then every block and the root
//! sharded across dp, as torchtitan composes them).

use tensorplay::models::{Gpt, gpt};
use tensorplay_collectives::device_mesh::init_device_mesh;
use tensorplay_core::nn::Module;
use tensorplay_core::{self as tp, DType, Tensor};
use tensorplay_distributed_nn::parallel::fsdp::{FsdpOptions, fully_shard};
use tensorplay_testkit::{check_close, cpu_world};

use super::fsdp::{
    BATCH, CASES, Model, TIMEOUT, TestResult, Wrap, case, gathered_in, gpt_config, loss_of,
    optimizer, rows, run_case_on, tol,
};

const STEPS: usize = 3;

/// HSDP: the MLP and the GPT, nested and root-only, each rank training on its quarter of the
/// batch; gradients averaged over all four ranks.
#[test]
fn hsdp_matches_one_process() {
    cpu_world(4, TIMEOUT, |rank| -> TestResult {
        let mesh = init_device_mesh(&[2, 2], &["replicate", "shard"])?;
        for c in [CASES[0], CASES[3], CASES[5]] {
            run_case_on(&c, rank, 4, Some(&mesh))?;
        }
        Ok(())
    });
}

/// The GPT tensor-parallel over tp and fully sharded over dp: after every backward each
/// rank's gradients, gathered over its dp group, are its tensor-parallel slice of the
/// single-process gradients; after the steps, the parameters too.
#[test]
fn fully_shard_with_tensor_parallel_matches_one_process() {
    let c = case(
        "gpt dp 2 x tp 2",
        Model::Gpt,
        Wrap::Nested,
        true,
        DType::F64,
    );
    cpu_world(4, TIMEOUT, |_rank| -> TestResult {
        let mesh = init_device_mesh(&[2, 2], &["dp", "tp"])?;
        let (dp, tp_rank) = (mesh.get_local_rank("dp")?, mesh.get_local_rank("tp")?);
        let dp_group = mesh.get_group("dp")?.clone();
        tp::manual_seed(7);
        let reference = Gpt::new(gpt_config(DType::F64))?;
        let mut model = reference.tensor_parallel(mesh.get_group("tp")?)?;
        let opts = FsdpOptions {
            mesh: Some(mesh.sub_mesh("dp")?.clone()),
            ..Default::default()
        };
        for block in model.h.iter_mut() {
            fully_shard(block, opts.clone())?;
        }
        fully_shard(&mut model, opts)?;
        let mut opt = optimizer(model.parameters(), DType::F64)?;
        let mut ref_opt = optimizer(reference.parameters(), DType::F64)?;
        // the slice of the single-process tensor `full` that rank holds as parameter `name`
        let compare =
            |what: &str, name: &str, local: Option<Tensor>, full: &Tensor| -> TestResult {
                let want = gpt::shard_parameter(name, full, tp_rank, 2)?;
                let local = match local {
                    Some(t) => t,
                    None => Tensor::zeros(&[0], DType::F64)?,
                };
                let got = gathered_in(&local, Some(&dp_group))?;
                let got = if got.is_empty() {
                    vec![0.0; want.numel()] // frozen here: a row-parallel bias off tp rank 0
                } else {
                    got
                };
                check_close(
                    &format!("{what} {name} (dp {dp}, tp {tp_rank})"),
                    &got,
                    &want.to_vec_f64()?,
                    tol(DType::F64),
                )?;
                Ok(())
            };
        let per = BATCH / 2;
        for step in 0..STEPS {
            let (x, y) = rows(&c, step * BATCH + dp * per, per)?;
            let (xa, ya) = rows(&c, step * BATCH, BATCH)?;
            opt.zero_grad()?;
            loss_of(&c, &model.call(&x)?, &y)?.backward()?;
            ref_opt.zero_grad()?;
            loss_of(&c, &reference.call(&xa)?, &ya)?.backward()?;
            for ((n, s), (_, r)) in model
                .named_parameters()
                .iter()
                .zip(reference.named_parameters())
            {
                let h = r
                    .grad()
                    .ok_or_else(|| format!("no reference grad of {n}"))?;
                let g = if s.requires_grad() {
                    Some(
                        s.grad()
                            .ok_or_else(|| format!("step {step}: no grad of {n}"))?,
                    )
                } else {
                    None
                };
                compare(&format!("step {step}: grad of"), n, g, &h)?;
            }
            opt.step()?;
            ref_opt.step()?;
        }
        for ((n, s), (_, r)) in model
            .named_parameters()
            .iter()
            .zip(reference.named_parameters())
        {
            let s = if s.requires_grad() {
                Some(s.clone())
            } else {
                None
            };
            compare(&format!("after {STEPS} steps:"), n, s, &r)?;
        }
        Ok(())
    });
}

/// HSDP with one rank's weights different: every rank of the mesh fails, naming it, though
/// only its shard group and one replica group compare with it.
#[test]
fn hsdp_disagreement_fails_on_every_rank() {
    cpu_world(4, TIMEOUT, |rank| -> TestResult {
        let mesh = init_device_mesh(&[2, 2], &["replicate", "shard"])?;
        tp::manual_seed(if rank == 3 { 9 } else { 7 });
        let mut m = tensorplay_core::nn::Linear::new(4, 6, true)?;
        let res = fully_shard(
            &mut m,
            FsdpOptions {
                mesh: Some(mesh),
                ..Default::default()
            },
        );
        match res {
            Err(e) if format!("{e}").contains("rank 3") => Ok(()),
            other => Err(format!("rank {rank}: {other:?}").into()),
        }
    });
}
