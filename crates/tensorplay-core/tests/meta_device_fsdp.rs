//! Misuse of deferred initialisation across ranks: `fully_shard` on meta modules in
//! hostile uses (ranks that disagree, forward before `to_empty`, mixed precision, HSDP, a
//! checkpoint loaded into a meta-built model, DDP over a meta model). Every probe runs real
//! processes; a rank that hangs fails through the group's timeout.

use std::collections::BTreeMap;
use std::time::Duration;

use tensorplay::distributed::{
    self as dist,
    checkpoint::state_dict::{StateDictOptions, get_model_state_dict, set_model_state_dict},
    device_mesh::init_device_mesh,
    fsdp::{FsdpOptions, MixedPrecisionPolicy, fully_shard},
};
use tensorplay::nn::parallel::DistributedDataParallel;
use tensorplay::{
    self as tp, DType, Device, Tensor,
    nn::{self, Linear, Module, Sequential},
    optim::{Optimizer, SGD, SgdOptions},
};
use tensorplay_testkit::{Tol, check_close, cpu_world};

const TIMEOUT: Duration = Duration::from_secs(30);
type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// A float64 MLP 5 -> 7 -> 3 on the thread's default device.
fn mlp() -> tp::Result<Sequential> {
    let mut m = Sequential::new();
    for w in [[5, 7], [7, 3]] {
        let l = Linear::new(w[0], w[1], true)?;
        let f = |t: &Tensor| -> tp::Result<Tensor> {
            Ok(t.detach().to_dtype(DType::F64)?.requires_grad_(true))
        };
        let b = l.bias.as_ref().map(f).transpose()?;
        m = m.add(Linear::from_weights(f(&l.weight)?, b)?);
    }
    Ok(m)
}

fn on_meta() -> tp::Result<Sequential> {
    tp::with_default_device(Device::Meta, mlp)
}

fn batch() -> tp::Result<(Tensor, Tensor)> {
    let x: Vec<f64> = (0..20).map(|i| (i as f64 * 0.37).sin()).collect();
    let y: Vec<f64> = (0..12).map(|i| (i as f64 * 0.11).cos()).collect();
    Ok((Tensor::from_vec(x, &[4, 5])?, Tensor::from_vec(y, &[4, 3])?))
}

fn gathered(shard: &Tensor) -> tp::Result<Vec<f64>> {
    let all: Vec<Vec<f64>> = dist::all_gather_object(&shard.to_vec_f64()?, None)?;
    Ok(all.concat())
}

fn expect_err<T>(rank: usize, what: &str, r: tp::Result<T>) -> TestResult {
    match r {
        Err(e) => {
            eprintln!("[rank {rank}] {what}: error as expected: {e}");
            Ok(())
        }
        Ok(_) => Err(format!("rank {rank}: {what} succeeded, expected a clear error").into()),
    }
}

/// Rank 0 builds on the meta device, rank 1 eagerly: `fully_shard` must fail on both ranks
/// (naming the disagreement), not hang, not shard garbage.
#[test]
fn fully_shard_with_one_rank_on_meta_fails_on_every_rank() {
    cpu_world(2, TIMEOUT, |rank| -> TestResult {
        let mut m = if rank == 0 { on_meta()? } else { mlp()? };
        expect_err(
            rank,
            "fully_shard (meta on rank 0 only)",
            fully_shard(&mut m, FsdpOptions::default()),
        )
    });
}

/// Forward through a sharded meta model before `to_empty`: a clear error on every rank.
#[test]
fn forward_before_to_empty_fails_on_every_rank() {
    cpu_world(2, TIMEOUT, |rank| -> TestResult {
        let mut m = on_meta()?;
        let _h = fully_shard(&mut m, FsdpOptions::default())?;
        let (x, _) = batch()?;
        match m.call(&x) {
            Err(e) if e.to_string().contains("to_empty") && e.to_string().contains("meta") => {
                Ok(())
            }
            other => Err(format!(
                "rank {rank}: forward before to_empty gave {other:?}, expected an error \
                 naming the meta device and to_empty"
            )
            .into()),
        }
    });
}

/// PyTorch users often call `fully_shard` inside `with torch.device("meta")`; doing so here
/// must work as outside it (the setup's own bookkeeping must not land on the meta device).
#[test]
fn fully_shard_inside_the_meta_scope() {
    cpu_world(2, TIMEOUT, |rank| -> TestResult {
        let r = tp::with_default_device(Device::Meta, || -> tp::Result<_> {
            let mut m = mlp()?;
            let h = fully_shard(&mut m, FsdpOptions::default())?;
            Ok((m, h))
        });
        let (mut m, _h) =
            r.map_err(|e| format!("rank {rank}: fully_shard in the meta scope: {e}"))?;
        m.to_empty(Device::Cpu)?;
        tp::manual_seed(3);
        m.reset_parameters()?;
        let (x, _) = batch()?;
        m.call(&x)?;
        Ok(())
    });
}

/// One training step of `m` (sharded) on the batch: its loss and its gathered parameters after.
fn step(m: &Sequential) -> tp::Result<(Vec<f64>, Vec<Vec<f64>>)> {
    let (x, y) = batch()?;
    let mut o = SGD::new(
        m.parameters(),
        SgdOptions {
            lr: 0.1,
            ..Default::default()
        },
    )?;
    let l = nn::functional::mse_loss(&m.call(&x)?.to_dtype(DType::F64)?, &y)?;
    l.backward()?;
    o.step()?;
    let ps = m
        .parameters()
        .iter()
        .map(gathered)
        .collect::<tp::Result<Vec<_>>>()?;
    Ok((l.to_vec_f64()?, ps))
}

/// Mixed precision (float32 compute over float64 shards) on a meta-built model: `to_empty`,
/// reset and a training step give what the same model built eagerly, reset alike, gives.
#[test]
fn mixed_precision_on_a_meta_model_trains_as_the_eager_one() {
    cpu_world(2, TIMEOUT, |rank| -> TestResult {
        let opts = FsdpOptions {
            mp_policy: MixedPrecisionPolicy {
                param_dtype: Some(DType::F32),
                ..Default::default()
            },
            ..Default::default()
        };
        let mut eager = mlp()?;
        let _he = fully_shard(&mut eager, opts.clone())?;
        tp::manual_seed(9);
        eager.reset_parameters()?;
        let mut lazy = on_meta()?;
        let _hl = fully_shard(&mut lazy, opts)?;
        lazy.to_empty(Device::Cpu)?;
        tp::manual_seed(9);
        lazy.reset_parameters()?;
        for p in lazy.parameters() {
            if p.dtype() != DType::F64 || p.device() != Device::Cpu {
                return Err(format!("rank {rank}: shard {} on {}", p.dtype(), p.device()).into());
            }
        }
        let (le, pe) = step(&eager)?;
        let (ll, pl) = step(&lazy)?;
        check_close(&format!("rank {rank}: loss"), &ll, &le, Tol::EXACT)?;
        for (i, (a, b)) in pl.iter().zip(&pe).enumerate() {
            check_close(
                &format!("rank {rank}: parameter {i} after the step"),
                a,
                b,
                Tol::EXACT,
            )?;
        }
        Ok(())
    });
}

/// HSDP (a [2, 1] mesh: two replicas of one shard) on a meta-built model: each replica gets
/// the whole model's values, the same on both.
#[test]
fn hsdp_on_a_meta_model() {
    cpu_world(2, TIMEOUT, |rank| -> TestResult {
        let mesh = init_device_mesh(&[2, 1], &["replicate", "shard"])?;
        let mut whole = mlp()?;
        tp::manual_seed(13);
        whole.reset_parameters()?;
        let mut m = on_meta()?;
        let _h = fully_shard(
            &mut m,
            FsdpOptions {
                mesh: Some(mesh),
                ..Default::default()
            },
        )?;
        m.to_empty(Device::Cpu)?;
        tp::manual_seed(13);
        m.reset_parameters()?;
        for ((n, p), (_, w)) in m
            .named_parameters()
            .into_iter()
            .zip(whole.named_parameters())
        {
            check_close(
                &format!("rank {rank}: {n}"),
                &p.to_vec_f64()?,
                &w.to_vec_f64()?,
                Tol::EXACT,
            )?;
        }
        let (x, _) = batch()?;
        m.call(&x)?;
        Ok(())
    });
}

/// A full checkpoint broadcast from rank 0 into a meta-built, `to_empty`'d sharded model
/// gives back the checkpoint's values.
#[test]
fn full_state_dict_from_rank0_into_a_meta_built_model() {
    cpu_world(2, TIMEOUT, |rank| -> TestResult {
        tp::manual_seed(17);
        let src = mlp()?;
        let mut m = on_meta()?;
        let _h = fully_shard(&mut m, FsdpOptions::default())?;
        m.to_empty(Device::Cpu)?;
        let state: BTreeMap<String, Tensor> = if rank == 0 {
            src.state_dict()?
        } else {
            BTreeMap::new()
        };
        set_model_state_dict(
            &mut m,
            &state,
            StateDictOptions {
                full_state_dict: true,
                broadcast_from_rank0: true,
                ..Default::default()
            },
        )?;
        let got = get_model_state_dict(
            &m,
            StateDictOptions {
                full_state_dict: true,
                ..Default::default()
            },
        )?;
        for (k, v) in src.state_dict()? {
            let g = got
                .get(&k)
                .ok_or_else(|| format!("rank {rank}: {k} missing"))?;
            check_close(
                &format!("rank {rank}: {k}"),
                &g.to_vec_f64()?,
                &v.to_vec_f64()?,
                Tol::EXACT,
            )?;
        }
        Ok(())
    });
}

/// The same, loaded while the model is still on the meta device (no `to_empty`): a clear
/// error on every rank, no hang.
#[test]
fn full_state_dict_into_a_model_still_on_meta_fails_on_every_rank() {
    cpu_world(2, TIMEOUT, |rank| -> TestResult {
        tp::manual_seed(17);
        let src = mlp()?;
        let mut m = on_meta()?;
        let _h = fully_shard(&mut m, FsdpOptions::default())?;
        let state: BTreeMap<String, Tensor> = if rank == 0 {
            src.state_dict()?
        } else {
            BTreeMap::new()
        };
        let r = set_model_state_dict(
            &mut m,
            &state,
            StateDictOptions {
                full_state_dict: true,
                broadcast_from_rank0: true,
                ..Default::default()
            },
        );
        expect_err(rank, "set_model_state_dict into meta", r)
    });
}

/// DDP over a meta model (its constructor broadcasts rank 0's parameters): a clear error on
/// every rank, no hang.
#[test]
fn ddp_over_a_meta_model_fails_on_every_rank() {
    cpu_world(2, TIMEOUT, |rank| -> TestResult {
        expect_err(
            rank,
            "DDP over meta",
            DistributedDataParallel::new(on_meta()?),
        )
    });
}

/// DDP where only rank 1's model is on the meta device: an error on every rank, no hang.
#[test]
fn ddp_with_one_meta_rank_fails_on_every_rank() {
    cpu_world(2, TIMEOUT, |rank| -> TestResult {
        let m = if rank == 1 { on_meta()? } else { mlp()? };
        expect_err(
            rank,
            "DDP with rank 1 on meta",
            DistributedDataParallel::new(m),
        )
    });
}

/// The full state dict of a sharded model still on the meta device: a clear error on every
/// rank, no hang.
#[test]
fn full_state_dict_of_a_model_still_on_meta_fails_on_every_rank() {
    cpu_world(2, TIMEOUT, |rank| -> TestResult {
        let mut m = on_meta()?;
        let _h = fully_shard(&mut m, FsdpOptions::default())?;
        let r = get_model_state_dict(
            &m,
            StateDictOptions {
                full_state_dict: true,
                ..Default::default()
            },
        );
        expect_err(rank, "get_model_state_dict(full) on meta", r)
    });
}

/// A training step of a materialised sharded model (and of DDP) run while the thread's
/// default device is meta (the user builds the next model on meta meanwhile, or forgot
/// `set_default_device(Device::Cpu)`): the step works on the model's own device, as in PyTorch,
/// whose collectives' buffers follow the parameters' device, not the default one.
#[test]
fn training_steps_under_a_meta_default_device() {
    cpu_world(2, TIMEOUT, |rank| -> TestResult {
        // two identical models: one steps normally, the other under a meta default
        let mut handles = Vec::new();
        let mut models = Vec::new();
        for _ in 0..2 {
            let mut m = on_meta()?;
            handles.push(fully_shard(&mut m, FsdpOptions::default())?);
            m.to_empty(Device::Cpu)?;
            tp::manual_seed(5);
            m.reset_parameters()?;
            models.push(m);
        }
        let (want, _) = step(&models[0])?;
        let mut bad = Vec::new();
        match tp::with_default_device(Device::Meta, || step(&models[1])) {
            Ok((got, _)) if got == want => {}
            Ok((got, _)) => bad.push(format!(
                "FSDP step under a meta default: loss {got:?}, want {want:?}"
            )),
            Err(e) => bad.push(format!("FSDP step under a meta default: {e}")),
        }
        tp::manual_seed(5);
        let d = DistributedDataParallel::new(mlp()?)?;
        let (x, y) = batch()?;
        let r = tp::with_default_device(Device::Meta, || -> tp::Result<()> {
            nn::functional::mse_loss(&d.call(&x)?, &y)?.backward()
        });
        if let Err(e) = r {
            bad.push(format!("DDP step under a meta default: {e}"));
        }
        if !bad.is_empty() {
            return Err(format!("rank {rank}: {}", bad.join("; ")).into());
        }
        Ok(())
    });
}

/// A float64 model whose second layer shares the first one's weight (a tied, square weight).
fn tied() -> tp::Result<Sequential> {
    let a = Linear::new(5, 5, true)?;
    let w = a.weight.detach().to_dtype(DType::F64)?.requires_grad_(true);
    let b0 = a
        .bias
        .as_ref()
        .map(|b| -> tp::Result<Tensor> {
            Ok(b.detach().to_dtype(DType::F64)?.requires_grad_(true))
        })
        .transpose()?;
    Ok(Sequential::new()
        .add(Linear::from_weights(w.clone(), b0)?)
        .add(Linear::from_weights(w, None)?))
}

/// More ranks than rows (empty shards), and tied weights: built on meta, sharded, allocated and
/// reset, the gathered shards are the whole model's values reset from the same seed.
#[test]
fn deferred_init_with_empty_shards_and_tied_weights() {
    type Build = fn() -> tp::Result<Sequential>;
    let cases: [(&str, usize, Build); 2] = [
        ("mlp over 4 ranks (3-row layer)", 4, mlp),
        ("tied square weight", 2, tied),
    ];
    for (name, world, build) in cases {
        cpu_world(world, TIMEOUT, move |rank| -> TestResult {
            let mut whole = build()?;
            tp::manual_seed(23);
            whole.reset_parameters()?;
            let mut m = tp::with_default_device(Device::Meta, build)?;
            let _h = fully_shard(&mut m, FsdpOptions::default())
                .map_err(|e| format!("{name}, rank {rank}: fully_shard: {e}"))?;
            m.to_empty(Device::Cpu)?;
            tp::manual_seed(23);
            m.reset_parameters()?;
            for ((n, p), (_, w)) in m
                .named_parameters()
                .into_iter()
                .zip(whole.named_parameters())
            {
                check_close(
                    &format!("{name}, rank {rank}: {n}"),
                    &gathered(&p)?,
                    &w.to_vec_f64()?,
                    Tol::EXACT,
                )?;
            }
            let (x, _) = batch()?;
            m.call(&x)?;
            Ok(())
        });
    }
}
