//! `fully_shard` used out of the happy path, across real processes (world 2): a backward that
//! fails half-way, weights kept gathered across an optimizer step, a step between forward and
//! backward, parameters unfrozen after wrapping, ranks with different weights, a weight tied
//! across an inner group, unsynced gradients and `zero_grad`, and whole-tensor clipping of
//! shards. Each either gives the single-process values or a clear error on every rank.

use std::time::Duration;

use tensorplay_core::nn::{Linear, Module, ModuleFields, Sequential, Tanh};
use tensorplay_core::optim::{Optimizer, SGD, SgdOptions};
use tensorplay_core::{self as tp, DType, Tensor};
use tensorplay_distributed_nn::parallel::fsdp::{self as fsdp, FsdpOptions, fully_shard};
use tensorplay_testkit::{Tol, check_close, cpu_world};

use super::fsdp_memory::shard;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Linear(4, 6) -> Tanh -> Linear(6, 3), float64, from `seed`.
fn model(seed: u64) -> tp::Result<Sequential> {
    tp::manual_seed(seed);
    let leaf = |t: &Tensor| -> tp::Result<Tensor> {
        Ok(t.detach()
            .to_dtype(DType::F64)?
            .deep_clone()?
            .requires_grad_(true))
    };
    let mut m = Sequential::new();
    for (i, o) in [(4, 6), (6, 3)] {
        let l = Linear::new(i, o, true)?;
        let b = l.bias.as_ref().map(leaf).transpose()?;
        m = m.add(Linear::from_weights(leaf(&l.weight)?, b)?);
        if i == 4 {
            m = m.add(Tanh::new());
        }
    }
    Ok(m)
}

fn batch(k: usize, rows: usize) -> tp::Result<Tensor> {
    let v: Vec<f64> = (0..rows * 4)
        .map(|i| ((k * 31 + i * 7) as f64 * 0.13).sin())
        .collect();
    Tensor::from_vec(v, &[rows, 4])
}

fn sgd(p: Vec<Tensor>) -> tp::Result<SGD> {
    SGD::new(
        p,
        SgdOptions {
            lr: 0.1,
            ..Default::default()
        },
    )
}

/// The loss of a batch every rank also trains on whole (so one process is the reference).
fn loss(m: &dyn Module, k: usize) -> tp::Result<Tensor> {
    m.call(&batch(k, 4)?)?.pow_scalar(2.0)?.mean()
}

/// Every parameter (shards gathered) against the reference's.
fn same_params(m: &dyn Module, r: &dyn Module, what: &str) -> Result<(), String> {
    for ((n, s), (_, q)) in m.named_parameters().iter().zip(r.named_parameters()) {
        let all: Vec<Vec<f64>> = tensorplay_collectives::all_gather_object(
            &s.to_vec_f64().map_err(|e| e.to_string())?,
            None,
        )
        .map_err(|e| e.to_string())?;
        check_close(
            &format!("{what}: {n}"),
            &all.concat(),
            &q.to_vec_f64().map_err(|e| e.to_string())?,
            Tol::scaled(1e-12),
        )?;
    }
    Ok(())
}

fn err_has<T>(what: &str, r: tp::Result<T>, needles: &[&str]) -> Result<(), String> {
    match r {
        Ok(_) => Err(format!("{what}: accepted")),
        Err(e) => {
            let m = format!("{e:?}");
            match needles.iter().find(|n| !m.contains(*n)) {
                Some(n) => Err(format!("{what}: the error lacks {n:?}: {m}")),
                None => Ok(()),
            }
        }
    }
}

type Case = (&'static str, fn(usize) -> Result<(), String>);

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

const CASES: [Case; 14] = [
    ("a backward that fails half-way, then training", |_| {
        let mut m = model(1).map_err(e)?;
        shard(&mut m).map_err(e)?;
        let r = model(1).map_err(e)?;
        let (mut opt, mut ropt) = (
            sgd(m.parameters()).map_err(e)?,
            sgd(r.parameters()).map_err(e)?,
        );
        // step 0 fails in backward after the last layer's gradients went out
        let x = batch(0, 4).map_err(e)?.requires_grad_(true);
        x.register_hook(|_| Err(tp::Error::Autograd("injected".into())))
            .map_err(e)?;
        let l = m
            .call(&x)
            .map_err(e)?
            .pow_scalar(2.0)
            .map_err(e)?
            .mean()
            .map_err(e)?;
        if l.backward().is_ok() {
            return Err("the injected failure did not fail backward".into());
        }
        for k in 1..4 {
            opt.zero_grad().map_err(e)?;
            loss(&m, k).map_err(e)?.backward().map_err(e)?;
            opt.step().map_err(e)?;
            ropt.zero_grad().map_err(e)?;
            loss(&r, k).map_err(e)?.backward().map_err(e)?;
            ropt.step().map_err(e)?;
        }
        same_params(&m, &r, "after a failed backward")
    }),
    (
        "a forward without backward, a step, then training (the root keeps its weights)",
        |_| {
            let mut m = model(2).map_err(e)?;
            fully_shard(&mut m, FsdpOptions::default()).map_err(e)?; // the root alone
            let r = model(2).map_err(e)?;
            let (mut opt, mut ropt) = (
                sgd(m.parameters()).map_err(e)?,
                sgd(r.parameters()).map_err(e)?,
            );
            for (net, o) in [(&m as &dyn Module, &mut opt), (&r, &mut ropt)] {
                loss(net, 0).map_err(e)?.backward().map_err(e)?;
                net.call(&batch(9, 2).map_err(e)?).map_err(e)?; // gradients on, no backward
                o.step().map_err(e)?;
                o.zero_grad().map_err(e)?;
                loss(net, 1).map_err(e)?.backward().map_err(e)?;
                o.step().map_err(e)?;
            }
            same_params(&m, &r, "after a forward without backward")
        },
    ),
    ("an optimizer step between forward and backward", |_| {
        let mut m = model(3).map_err(e)?;
        shard(&mut m).map_err(e)?;
        let mut opt = sgd(m.parameters()).map_err(e)?;
        loss(&m, 0).map_err(e)?.backward().map_err(e)?;
        let l = loss(&m, 1).map_err(e)?;
        opt.step().map_err(e)?;
        err_has(
            "step before backward",
            l.backward(),
            &["between the module's forward and its backward"],
        )
    }),
    ("parameters unfrozen after wrapping", |_| {
        let mut m = model(4).map_err(e)?;
        let mut r = model(4).map_err(e)?;
        m.requires_grad_(false).map_err(e)?;
        shard(&mut m).map_err(e)?;
        m.requires_grad_(true).map_err(e)?;
        r.requires_grad_(true).map_err(e)?;
        let (mut opt, mut ropt) = (
            sgd(m.parameters()).map_err(e)?,
            sgd(r.parameters()).map_err(e)?,
        );
        for (net, o) in [(&m as &dyn Module, &mut opt), (&r, &mut ropt)] {
            loss(net, 0).map_err(e)?.backward().map_err(e)?;
            o.step().map_err(e)?;
        }
        same_params(&m, &r, "unfrozen after wrapping")
    }),
    ("ranks with different weights", |rank| {
        let mut m = model(10 + rank as u64).map_err(e)?;
        err_has(
            "different seeds",
            fully_shard(&mut m, FsdpOptions::default()),
            &["same weights", "rank 1's sums to"],
        )
    }),
    (
        "a weight tied across an inner group and a module outside it",
        |_| {
            tp::manual_seed(9); // the same weights on every rank
            let w = tp::randn(&[3, 3]).map_err(e)?.requires_grad_(true);
            let mut m = Sequential::new()
                .add(Linear::from_weights(w.clone(), None).map_err(e)?)
                .add(Linear::from_weights(w, None).map_err(e)?);
            let first = m
                .named_children_mut()
                .into_iter()
                .next()
                .ok_or("no child")?
                .1;
            fully_shard(first, FsdpOptions::default()).map_err(e)?;
            err_has(
                "tied",
                fully_shard(&mut m, FsdpOptions::default()),
                &["\"1.weight\"", "inner fully_shard call"],
            )
        },
    ),
    (
        "zero_grad clears gradients accumulated without sync",
        |_| {
            let mut m = model(5).map_err(e)?;
            let handles = shard(&mut m).map_err(e)?;
            let r = model(5).map_err(e)?;
            let root = handles.last().ok_or("no handle")?;
            root.set_requires_gradient_sync(false);
            loss(&m, 0).map_err(e)?.backward().map_err(e)?;
            m.zero_grad().map_err(e)?;
            root.set_requires_gradient_sync(true);
            loss(&m, 1).map_err(e)?.backward().map_err(e)?;
            loss(&r, 1).map_err(e)?.backward().map_err(e)?;
            for ((n, s), (_, q)) in m.named_parameters().iter().zip(r.named_parameters()) {
                let g = s.grad().ok_or_else(|| format!("no gradient for {n}"))?;
                let all: Vec<Vec<f64>> =
                    tensorplay_collectives::all_gather_object(&g.to_vec_f64().map_err(e)?, None)
                        .map_err(e)?;
                check_close(
                    &format!("grad of {n}"),
                    &all.concat(),
                    &q.grad()
                        .ok_or("no reference grad")?
                        .to_vec_f64()
                        .map_err(e)?,
                    Tol::scaled(1e-12),
                )?;
            }
            Ok(())
        },
    ),
    ("whole-tensor clipping of shards is refused", |_| {
        let mut m = model(6).map_err(e)?;
        shard(&mut m).map_err(e)?;
        loss(&m, 0).map_err(e)?.backward().map_err(e)?;
        err_has(
            "clip",
            tp::nn::utils::clip_grad_norm_(&m.parameters(), 1.0, 2.0, false),
            &["fsdp::clip_grad_norm_", "fully_shard"],
        )
    }),
    ("a transposed (non-contiguous) weight", |_| {
        view_weights_train_as_one_process(|| {
            Tensor::from_vec((1..=12).map(f64::from).collect::<Vec<_>>(), &[4, 3])?.t()
        })
    }),
    (
        "a weight with a storage offset (rows of a bigger tensor)",
        |_| {
            view_weights_train_as_one_process(|| {
                let big = Tensor::from_vec((1..=20).map(f64::from).collect::<Vec<_>>(), &[5, 4])?;
                Ok(big.narrow(0, 2, 3)?.detach())
            })
        },
    ),
    (
        "a non-leaf weight is refused on every rank, the module left whole",
        |_| {
            tp::manual_seed(3);
            let w = tp::randn(&[3, 4])
                .map_err(e)?
                .requires_grad_(true)
                .mul_scalar(1.0)
                .map_err(e)?;
            let mut m = Sequential::new().add(Linear::from_weights(w, None).map_err(e)?);
            err_has(
                "non-leaf",
                fully_shard(&mut m, FsdpOptions::default()),
                &["\"0.weight\" is not a leaf", "nothing was changed"],
            )?;
            m.call(&batch(0, 2).map_err(e)?.to_dtype(DType::F32).map_err(e)?)
                .map(|_| ())
                .map_err(|x| format!("the module does not run after the refusal: {x}"))
        },
    ),
    (
        "two parameters viewing one storage (a fused weight split in two)",
        |_| {
            let big = Tensor::from_vec(
                (0..24).map(|i| f64::from(i) * 0.1).collect::<Vec<_>>(),
                &[6, 4],
            )
            .map_err(e)?;
            let half = |i: usize| -> tp::Result<Tensor> {
                Ok(big.narrow(0, 3 * i, 3)?.requires_grad_(true))
            };
            let mut m = Sequential::new()
                .add(Linear::from_weights(half(0).map_err(e)?, None).map_err(e)?)
                .add(Linear::from_weights(half(1).map_err(e)?, None).map_err(e)?);
            let first = m
                .named_children_mut()
                .into_iter()
                .next()
                .ok_or("no child")?
                .1;
            fully_shard(first, FsdpOptions::default()).map_err(e)?;
            let second = m.parameters()[1].clone(); // the first is now a shard
            let want: Vec<f64> = (12..24).map(|i| f64::from(i) * 0.1).collect();
            check_close(
                "the other module's weight",
                &second.to_vec_f64().map_err(e)?,
                &want,
                Tol::EXACT,
            )
        },
    ),
    (
        "fsdp clip_grad_norm_ with a bad max_norm on one rank",
        |rank| {
            let mut m = model(7).map_err(e)?;
            shard(&mut m).map_err(e)?;
            loss(&m, 0).map_err(e)?.backward().map_err(e)?;
            let before: Vec<Vec<f64>> = grads(&m)?;
            let max_norm = if rank == 1 { f64::NAN } else { 1e-3 };
            let needle = if rank == 1 {
                "max_norm"
            } else {
                "rank(s) [1] refused"
            };
            err_has(
                "bad max_norm",
                fsdp::clip_grad_norm_(&m.parameters(), max_norm, 2.0, false),
                &[needle],
            )?;
            if grads(&m)? != before {
                return Err("a gradient changed although a rank refused".into());
            }
            Ok(())
        },
    ),
    (
        "fsdp clip_grad_norm_ with no gradients on one rank",
        |rank| {
            let mut m = model(8).map_err(e)?;
            shard(&mut m).map_err(e)?;
            loss(&m, 0).map_err(e)?.backward().map_err(e)?;
            if rank == 1 {
                m.parameters().iter().for_each(|p| p.set_grad(None));
            }
            let total = fsdp::clip_grad_norm_(&m.parameters(), 1e9, 2.0, false).map_err(e)?;
            let all: Vec<f64> =
                tensorplay_collectives::all_gather_object(&total, None).map_err(e)?;
            if all[0] != all[1] || total <= 0.0 {
                return Err(format!("the ranks' totals differ or are empty: {all:?}"));
            }
            Ok(())
        },
    ),
];

/// This rank's gradients, parameter by parameter.
fn grads(m: &dyn Module) -> Result<Vec<Vec<f64>>, String> {
    m.parameters()
        .iter()
        .map(|p| {
            p.grad()
                .map_or(Ok(Vec::new()), |g| g.to_vec_f64().map_err(e))
        })
        .collect()
}

/// A one-layer model whose weight is `weight()` (a view), fully sharded, against the same
/// model in one process: the same outputs and the same weights after three SGD steps.
fn view_weights_train_as_one_process(weight: fn() -> tp::Result<Tensor>) -> Result<(), String> {
    let build = || -> tp::Result<Sequential> {
        Ok(Sequential::new().add(Linear::from_weights(weight()?.requires_grad_(true), None)?))
    };
    let (mut m, r) = (build().map_err(e)?, build().map_err(e)?);
    fully_shard(&mut m, FsdpOptions::default()).map_err(e)?;
    let x = |k: usize| -> tp::Result<Tensor> {
        let cols = r.parameters()[0].shape()[1];
        let v: Vec<f64> = (0..2 * cols)
            .map(|i| ((k * 13 + i) as f64 * 0.37).sin())
            .collect();
        Tensor::from_vec(v, &[2, cols])
    };
    let (mut opt, mut ropt) = (
        sgd(m.parameters()).map_err(e)?,
        sgd(r.parameters()).map_err(e)?,
    );
    for k in 0..3 {
        let (y, ry) = (
            m.call(&x(k).map_err(e)?).map_err(e)?,
            r.call(&x(k).map_err(e)?).map_err(e)?,
        );
        check_close(
            &format!("output {k}"),
            &y.to_vec_f64().map_err(e)?,
            &ry.to_vec_f64().map_err(e)?,
            Tol::scaled(1e-12),
        )?;
        for (o, out) in [(&mut opt, y), (&mut ropt, ry)] {
            o.zero_grad().map_err(e)?;
            out.pow_scalar(2.0)
                .map_err(e)?
                .mean()
                .map_err(e)?
                .backward()
                .map_err(e)?;
            o.step().map_err(e)?;
        }
    }
    same_params(&m, &r, "view weights after three steps")
}

#[test]
fn misuse_gives_one_process_values_or_a_clear_error() {
    cpu_world(2, Duration::from_secs(30), |rank| -> TestResult {
        let check = |(name, f): Case| f(rank).map_err(|m| format!("{name}: {m}"));
        for c in CASES {
            check(c)?;
        }
        Ok(())
    });
}
