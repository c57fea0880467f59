//! `DistributedOptimizer`: a two-worker model (a trainer holding the first layer, a parameter
//! server holding the second) trained with distributed autograd has the same loss curve and
//! weights as the same model trained in one process (float64, 1e-6), for SGD with momentum,
//! Adam and AdamW; owners' errors surface on the caller.

use crate::common;

use common::{TestResult, barrier, init, register_common};
use tensorplay_collectives::spawn::spawn;
use tensorplay_core::Tensor;
use tensorplay_core::optim::{Adam, AdamOptions, AdamW, AdamWOptions, Optimizer, SGD, SgdOptions};
use tensorplay_rpc::{self as rpc, DistributedOptimizer, OptimizerKind, RRef, autograd};

fn values(n: usize, k: usize, scale: f64) -> Vec<f64> {
    (0..n)
        .map(|i| (((i * 7 + k * 3) % 11) as f64 - 5.0) * scale)
        .collect()
}

fn w0() -> Tensor {
    Tensor::from_vec(values(12, 1, 0.1), &[3, 4]).expect("w0")
}
fn w1() -> Tensor {
    Tensor::from_vec(values(8, 2, 0.1), &[4, 2]).expect("w1")
}
fn data() -> (Tensor, Tensor) {
    (
        Tensor::from_vec(values(24, 3, 0.2), &[8, 3]).expect("x"),
        Tensor::from_vec(values(16, 4, 0.1), &[8, 2]).expect("y"),
    )
}

fn loss_of(out: &Tensor, target: &Tensor) -> tensorplay_core::Result<Tensor> {
    out.sub(target)?.pow_scalar(2.0)?.mean()
}

fn local_optimizer(kind: OptimizerKind, params: Vec<Tensor>) -> Box<dyn Optimizer> {
    match kind {
        OptimizerKind::Sgd(o) => Box::new(SGD::new(params, o).expect("sgd")),
        OptimizerKind::Adam(o) => Box::new(Adam::new(params, o).expect("adam")),
        OptimizerKind::AdamW(o) => Box::new(AdamW::new(params, o).expect("adamw")),
    }
}

const STEPS: usize = 25;

/// Losses and final weights of the single-process run.
fn single_process(kind: OptimizerKind) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (a, b) = (w0().requires_grad_(true), w1().requires_grad_(true));
    let mut opt = local_optimizer(kind, vec![a.clone(), b.clone()]);
    let (x, y) = data();
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        opt.zero_grad().expect("zero_grad");
        let h = x.matmul(&a).and_then(|h| h.tanh()).expect("h");
        let loss = loss_of(&h.matmul(&b).expect("out"), &y).expect("loss");
        losses.push(loss.item::<f64>().expect("item"));
        loss.backward().expect("backward");
        opt.step().expect("step");
    }
    (
        losses,
        a.to_vec::<f64>().expect("a"),
        b.to_vec::<f64>().expect("b"),
    )
}

fn kinds() -> Vec<(&'static str, OptimizerKind)> {
    vec![
        (
            "SGD",
            OptimizerKind::Sgd(SgdOptions {
                lr: 0.05,
                momentum: 0.9,
                nesterov: true,
                weight_decay: 0.01,
                ..Default::default()
            }),
        ),
        (
            "Adam",
            OptimizerKind::Adam(AdamOptions {
                lr: 0.01,
                amsgrad: true,
                ..Default::default()
            }),
        ),
        (
            "AdamW",
            OptimizerKind::AdamW(AdamWOptions {
                lr: 0.05,
                ..Default::default()
            }),
        ),
    ]
}

fn close(what: &str, a: &[f64], b: &[f64]) -> Result<(), String> {
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f64, f64::max);
    if a.len() != b.len() || worst > 1e-6 {
        return Err(format!("{what}: differ by {worst:e}: {a:?} vs {b:?}"));
    }
    Ok(())
}

#[test]
fn two_worker_training_equals_single_process() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_common();
        rpc::register("make_w1", |(): ()| Ok(w1().requires_grad_(true)));
        rpc::register("ps_forward", |(h, w): (Tensor, RRef<Tensor>)| {
            h.matmul(&w.local_value()?)
        });
        rpc::register("get_value", |w: RRef<Tensor>| Ok(w.local_value()?.detach()));
        init(rank, 2)?;
        if rank == 0 {
            let (x, y) = data();
            for (name, kind) in kinds() {
                let (want_losses, want_a, want_b) = single_process(kind);
                let a = w0().requires_grad_(true);
                let b: RRef<Tensor> = rpc::remote("worker1", "make_w1", (), None)?;
                let opt = DistributedOptimizer::new(kind, &[RRef::new(a.clone())?, b.clone()])?;
                let mut losses = Vec::new();
                for _ in 0..STEPS {
                    let ctx = autograd::context()?;
                    let h = x.matmul(&a)?.tanh()?;
                    let out: Tensor = rpc::rpc_sync("worker1", "ps_forward", (h, b.clone()), None)?;
                    let loss = loss_of(&out, &y)?;
                    losses.push(loss.item::<f64>()?);
                    autograd::backward(ctx.id(), &[loss], false)?;
                    opt.step(ctx.id())?;
                }
                close(&format!("{name} losses"), &losses, &want_losses)?;
                close(&format!("{name} local layer"), &a.to_vec::<f64>()?, &want_a)?;
                let remote_b: Tensor = rpc::rpc_sync("worker1", "get_value", b.clone(), None)?;
                close(
                    &format!("{name} remote layer"),
                    &remote_b.to_vec::<f64>()?,
                    &want_b,
                )?;
                // it learned something
                assert!(losses[STEPS - 1] < losses[0], "{name}: {losses:?}");
            }
            // an owner's error surfaces on the caller, naming the owner
            let b: RRef<Tensor> = rpc::remote("worker1", "make_w1", (), None)?;
            let bad = OptimizerKind::Sgd(SgdOptions {
                lr: -1.0,
                ..Default::default()
            });
            let e = DistributedOptimizer::new(bad, std::slice::from_ref(&b)).unwrap_err();
            assert!(
                matches!(&e, rpc::Error::Remote { worker, message, .. } if worker == "worker1" && message.contains("lr")),
                "{e:?}"
            );
            let e = DistributedOptimizer::new(bad, &[]).unwrap_err();
            assert!(e.to_string().contains("params"), "{e}");
            let opt = DistributedOptimizer::new(kinds()[0].1, &[b])?;
            let e = opt.step(777).unwrap_err();
            assert!(e.to_string().contains("777"), "{e}");
        }
        barrier("done")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// A learning-rate scheduler drives a distributed optimizer as it drives a local one: the
/// rate it sets reaches all 3 owners, seen in each parameter's update (SGD on sum(p^2):
/// p <- p * (1 - 2 lr)), epoch by epoch.
#[test]
fn a_scheduler_drives_a_distributed_optimizer_on_three_owners() -> TestResult {
    use tensorplay_core::optim::lr_scheduler::{LrScheduler, StepLR};
    spawn(4, |rank| -> TestResult {
        register_common();
        rpc::register("make_leaf", |v: Vec<f64>| {
            let n = v.len();
            Ok(Tensor::from_vec(v, &[n])?.requires_grad_(true))
        });
        rpc::register("sq_sum", |r: RRef<Tensor>| {
            let p = r.local_value()?;
            p.mul(&p)?.sum()
        });
        rpc::register("value_of", |w: RRef<Tensor>| Ok(w.local_value()?.detach()));
        init(rank, 4)?;
        if rank == 0 {
            let params = (1..4usize)
                .map(|o| rpc::remote(o, "make_leaf", vec![o as f64, -2.0 * o as f64], None))
                .collect::<rpc::Result<Vec<RRef<Tensor>>>>()?;
            let mut opt = DistributedOptimizer::new(
                OptimizerKind::Sgd(SgdOptions {
                    lr: 0.2,
                    ..Default::default()
                }),
                &params,
            )?;
            let mut sched = StepLR::new(&mut opt, 1, 0.5)?;
            let value = |p: &RRef<Tensor>| -> rpc::Result<Vec<f64>> {
                Ok(
                    rpc::rpc_sync::<_, Tensor>(p.owner().id, "value_of", p.clone(), None)?
                        .to_vec::<f64>()?,
                )
            };
            for epoch in 0..3 {
                let lr = 0.2 * 0.5f64.powi(epoch);
                assert!((opt.lr() - lr).abs() < 1e-15, "epoch {epoch}: {}", opt.lr());
                let before = params.iter().map(value).collect::<rpc::Result<Vec<_>>>()?;
                {
                    let ctx = autograd::context()?;
                    let mut loss: Option<Tensor> = None;
                    for p in &params {
                        let l: Tensor = rpc::rpc_sync(p.owner().id, "sq_sum", p.clone(), None)?;
                        loss = Some(match loss {
                            Some(s) => s.add(&l)?,
                            None => l,
                        });
                    }
                    let loss = loss.ok_or("no loss")?;
                    autograd::backward(ctx.id(), &[loss], false)?;
                    opt.step(ctx.id())?;
                }
                for (i, p) in params.iter().enumerate() {
                    let after = value(p)?;
                    let want: Vec<f64> = before[i].iter().map(|x| x * (1.0 - 2.0 * lr)).collect();
                    close(
                        &format!("epoch {epoch} owner {}", p.owner().id),
                        &after,
                        &want,
                    )?;
                }
                sched.step(&mut opt)?;
            }
            assert_eq!(sched.get_last_lr(), &[0.2 * 0.125]);
            let e = opt.set_lr(-1.0).unwrap_err();
            assert!(e.to_string().contains("lr"), "{e}");
        }
        barrier("scheduled")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}
