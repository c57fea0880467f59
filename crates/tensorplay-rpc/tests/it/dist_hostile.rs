//! Distributed autograd and `DistributedOptimizer` under misuse: responses and gradient
//! messages that arrive after their context was released, a guard dropped on another thread,
//! a tensor recorded in one context used in another's backward, tensors sent twice or used
//! twice, integer tensors, a worker that dies mid-backward, and optimizers over bad parameter
//! lists, dead owners and after shutdown. Every case ends with no context left on any worker.

use crate::common;

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{TestResult, barrier, eventually, init, register_common};
use tensorplay_collectives::spawn::spawn;
use tensorplay_core::autograd::{Context, Function, apply};
use tensorplay_core::optim::SgdOptions;
use tensorplay_core::{DType, Tensor};
use tensorplay_rpc::{self as rpc, DistributedOptimizer, OptimizerKind, RRef, autograd};

fn t(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape).expect("tensor")
}

fn leaf(seed: usize) -> Tensor {
    let v: Vec<f64> = (0..4).map(|i| ((i * 3 + seed) % 5) as f64 - 2.0).collect();
    t(&v, &[4]).requires_grad_(true)
}

fn vals(x: &Tensor) -> Vec<f64> {
    x.to_vec::<f64>().expect("values")
}

/// A backward that sleeps `0` ms, then passes the gradient on.
struct SlowBackward(u64);
impl Function for SlowBackward {
    fn forward(&self, _: &mut Context, x: &[&Tensor]) -> tensorplay_core::Result<Vec<Tensor>> {
        Ok(vec![x[0].mul_scalar(1.0)?])
    }
    fn backward(&self, _: &Context, g: &[Tensor]) -> tensorplay_core::Result<Vec<Option<Tensor>>> {
        std::thread::sleep(Duration::from_millis(self.0));
        Ok(vec![Some(g[0].clone())])
    }
}

/// A backward that ends the process, as a crash would.
struct DiesInBackward;
impl Function for DiesInBackward {
    fn forward(&self, _: &mut Context, x: &[&Tensor]) -> tensorplay_core::Result<Vec<Tensor>> {
        Ok(vec![x[0].mul_scalar(1.0)?])
    }
    fn backward(&self, _: &Context, _: &[Tensor]) -> tensorplay_core::Result<Vec<Option<Tensor>>> {
        std::process::exit(0)
    }
}

static STORED: Mutex<Option<Tensor>> = Mutex::new(None);

fn register_all() {
    register_common();
    rpc::register("mul", |(a, b): (Tensor, Tensor)| a.mul(&b));
    rpc::register("add", |(a, b): (Tensor, Tensor)| a.add(&b));
    rpc::register("slow_mul", |(a, b, ms): (Tensor, Tensor, u64)| {
        std::thread::sleep(Duration::from_millis(ms));
        a.mul(&b)
    });
    // sleeps, then squares `x` on `back` and returns that
    rpc::register("slow_square_on", |(x, back, ms): (Tensor, usize, u64)| {
        std::thread::sleep(Duration::from_millis(ms));
        let y: Tensor = rpc::rpc_sync(back, "mul", (x.clone(), x), None)?;
        Ok(y)
    });
    // squares `x` on `back`, then a slow backward node, then the sum
    rpc::register(
        "square_on_slow_back",
        |(x, back, ms): (Tensor, usize, u64)| {
            let y: Tensor = rpc::rpc_sync(back, "mul", (x.clone(), x), None)?;
            apply(SlowBackward(ms), &[&y])?.remove(0).sum()
        },
    );
    rpc::register("dies_in_backward", |x: Tensor| {
        apply(DiesInBackward, &[&x])?.remove(0).sum()
    });
    rpc::register("store", |x: Tensor| {
        *STORED.lock().unwrap() = Some(x);
        Ok(())
    });
    rpc::register("use_stored", |(): ()| {
        let x = STORED.lock().unwrap().clone().expect("stored");
        x.mul_scalar(2.0)?.sum()
    });
    rpc::register("clear_stored", |(): ()| {
        *STORED.lock().unwrap() = None;
        Ok(())
    });
    rpc::register("num_contexts", |(): ()| {
        Ok(autograd::debug_info().num_autograd_contexts)
    });
    rpc::register("int_double", |x: Tensor| x.mul_scalar(2.0));
    rpc::register("make_param", |v: Vec<f64>| {
        Ok(Tensor::from_vec(v.clone(), &[v.len()])?.requires_grad_(true))
    });
    rpc::register("make_plain", |v: Vec<f64>| {
        Tensor::from_vec(v.clone(), &[v.len()])
    });
    rpc::register("make_int", |v: Vec<i64>| {
        Tensor::from_vec(v.clone(), &[v.len()])
    });
    rpc::register("value_of", |p: RRef<Tensor>| Ok(p.local_value()?.detach()));
    rpc::register("die", |(): ()| -> tensorplay_core::Result<()> {
        std::process::exit(0)
    });
}

/// Waits until no worker of `world` holds a context.
fn no_contexts_anywhere(world: usize) -> rpc::Result<()> {
    for w in 0..world {
        eventually(Duration::from_secs(5), || {
            Ok(rpc::rpc_sync::<(), usize>(w, "num_contexts", (), None)? == 0)
        })
        .map_err(|e| rpc::Error::Transport(format!("worker{w} keeps a context: {e}")))?;
    }
    Ok(())
}

/// A response (and a nested call) that arrives after its context was released recreates the
/// context neither on the caller nor on the callee.
#[test]
fn world2_late_response_after_release_leaves_no_context() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        init(rank, 2)?;
        if rank == 0 {
            let a = leaf(1);
            let ctx = autograd::context()?;
            let f = rpc::rpc_async::<_, Tensor>(
                1usize,
                "slow_mul",
                (a.clone(), a.clone(), 500u64),
                None,
            )?;
            // released once the callee runs (a cleanup that overtakes the request itself is a
            // known gap, as in PyTorch: the request then reopens the context on the callee)
            std::thread::sleep(Duration::from_millis(200));
            drop(ctx);
            assert_eq!(vals(&f.wait()?), vals(&a.mul(&a)?));
            // the callee calls back after the release
            let ctx = autograd::context()?;
            let f = rpc::rpc_async::<_, Tensor>(
                1usize,
                "slow_square_on",
                (a.clone(), 0usize, 500u64),
                None,
            )?;
            std::thread::sleep(Duration::from_millis(200));
            drop(ctx);
            assert_eq!(vals(&f.wait()?), vals(&a.mul(&a)?));
            no_contexts_anywhere(2)?;
        }
        barrier("done")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// A guard moved to another thread and dropped there releases the context; the thread that
/// opened it can open a new one, and its calls carry no stale context.
#[test]
fn world2_guard_dropped_on_another_thread() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        init(rank, 2)?;
        if rank == 0 {
            let ctx = autograd::context()?;
            let id = ctx.id();
            std::thread::spawn(move || drop(ctx))
                .join()
                .map_err(|_| "drop panicked")?;
            assert!(!autograd::is_valid_context(id));
            assert_eq!(autograd::current_context(), None);
            let a = leaf(2);
            let y: Tensor = rpc::rpc_sync(1usize, "mul", (a.clone(), a.clone()), None)?;
            assert!(!y.requires_grad() || y.grad_fn().is_some());
            no_contexts_anywhere(2)?;
            // a new context on this thread works
            let ctx = autograd::context()?;
            let y: Tensor = rpc::rpc_sync(1usize, "mul", (a.clone(), a.clone()), None)?;
            autograd::backward(ctx.id(), &[y.sum()?], false)?;
            let g = autograd::get_gradients(ctx.id())?;
            let want: Vec<f64> = vals(&a).iter().map(|x| 2.0 * x).collect();
            assert_eq!(g.get(&a).map(vals), Some(want));
            drop(ctx);
            no_contexts_anywhere(2)?;
        }
        barrier("done")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// Releasing a context while its backward pass is running: the pass returns (an error naming
/// the context, or done) well within the timeout, and no worker keeps the context.
#[test]
fn world2_release_during_backward() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        init(rank, 2)?;
        if rank == 0 {
            let a = leaf(3);
            let ctx = autograd::context()?;
            let id = ctx.id();
            let y: Tensor = rpc::rpc_sync(
                1usize,
                "square_on_slow_back",
                (a.clone(), 0usize, 600u64),
                None,
            )?;
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let _ = tx.send(autograd::backward(id, &[y], false));
            });
            std::thread::sleep(Duration::from_millis(150));
            drop(ctx);
            let r = rx
                .recv_timeout(Duration::from_secs(10))
                .map_err(|_| "backward did not return after its context was released")?;
            if let Err(e) = r {
                assert!(e.to_string().contains(&id.to_string()), "{e}");
            }
            no_contexts_anywhere(2)?;
        }
        barrier("done")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// A tensor a callee received in one context and kept is used in the backward of another:
/// an error naming both contexts, not a gradient silently added to the first context.
#[test]
fn world2_tensor_from_another_context() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        init(rank, 2)?;
        if rank == 0 {
            let a = leaf(4);
            let ctx1 = autograd::context()?;
            let id1 = ctx1.id();
            rpc::rpc_sync::<_, ()>(1usize, "store", a.clone(), None)?;
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let r = (|| -> rpc::Result<(u64, rpc::Result<()>, autograd::Gradients)> {
                    let ctx2 = autograd::context()?;
                    let y: Tensor = rpc::rpc_sync(1usize, "use_stored", (), None)?;
                    let r = autograd::backward(ctx2.id(), &[y], false);
                    Ok((ctx2.id(), r, autograd::get_gradients(ctx2.id())?))
                })();
                let _ = tx.send(r);
            });
            let (id2, r, g2) = rx.recv_timeout(Duration::from_secs(10))??;
            let g1 = autograd::get_gradients(id1)?;
            assert!(
                g1.is_empty(),
                "context {id1} got {:?}",
                g1.get(&a).map(vals)
            );
            match r {
                Ok(()) => {
                    // the only correct success: the gradient is context 2's
                    assert_eq!(g2.get(&a).map(vals), Some(vec![2.0; 4]));
                }
                Err(e) => {
                    let s = e.to_string();
                    assert!(
                        matches!(e, rpc::Error::Autograd { .. })
                            && s.contains(&id1.to_string())
                            && s.contains(&id2.to_string()),
                        "{s}"
                    );
                }
            }
            drop(ctx1);
            rpc::rpc_sync::<(), ()>(1usize, "clear_stored", (), None)?;
            no_contexts_anywhere(2)?;
        }
        barrier("done")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// One tensor sent twice in a message, an RPC result used twice, integer and no-grad tensors
/// crossing in a context, and two threads running backward in one context at once.
#[test]
fn world2_duplicates_integers_and_concurrent_backward() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        init(rank, 2)?;
        if rank == 0 {
            let a = leaf(5);
            let b = t(&[1.0, 2.0, 3.0, 4.0], &[4]);
            let ctx = autograd::context()?;
            // a*a on worker1, then (a*a + b) used twice: loss = sum((a^2 + b)^2)
            let sq: Tensor = rpc::rpc_sync(1usize, "mul", (a.clone(), a.clone()), None)?;
            let s: Tensor = rpc::rpc_sync(1usize, "add", (sq, b.clone()), None)?;
            let loss = s.mul(&s)?.sum()?;
            // integers cross without being recorded
            let i = Tensor::from_vec(vec![1i64, -2, 3], &[3])?;
            let i2: Tensor = rpc::rpc_sync(1usize, "int_double", i, None)?;
            assert_eq!(i2.dtype(), DType::I64);
            assert_eq!(i2.to_vec::<i64>()?, vec![2, -4, 6]);
            let info = autograd::context_info(ctx.id())?;
            assert_eq!((info.num_sends, info.num_recvs), (2, 2), "{info:?}");
            // two threads at once, each retaining the graph
            let id = ctx.id();
            let loss = Arc::new(loss);
            let hs: Vec<_> = (0..2)
                .map(|_| {
                    let l = loss.clone();
                    std::thread::spawn(move || autograd::backward(id, &[(*l).clone()], true))
                })
                .collect();
            for h in hs {
                h.join().map_err(|_| "backward panicked")??;
            }
            let g = autograd::get_gradients(id)?;
            // d/da sum((a^2+b)^2) = 4 a (a^2 + b), twice
            let want: Vec<f64> = vals(&a)
                .iter()
                .zip(vals(&b))
                .map(|(x, y)| 2.0 * 4.0 * x * (x * x + y))
                .collect();
            assert_eq!(g.get(&a).map(vals), Some(want));
            assert!(g.get(&b).is_none());
            drop(ctx);
            no_contexts_anywhere(2)?;
        }
        barrier("done")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// A worker that dies in the middle of the backward pass: the survivor's backward returns an
/// error naming it within the RPC timeout, and its context goes away.
#[test]
fn world2_worker_dies_mid_backward() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        rpc::init_rpc(&format!("worker{rank}"), rank, 2, common::opts(20, 4))?;
        if rank == 1 {
            std::thread::sleep(Duration::from_secs(60));
            return Err("worker1 was not killed".into());
        }
        let a = leaf(6);
        let ctx = autograd::context()?;
        let y: Tensor = rpc::rpc_sync(1usize, "dies_in_backward", a, None)?;
        let t0 = Instant::now();
        let e = autograd::backward(ctx.id(), &[y], false).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
        assert!(
            matches!(&e, rpc::Error::Autograd { worker, .. } if worker == "worker1"),
            "{e:?}"
        );
        drop(ctx);
        assert_eq!(autograd::debug_info().num_autograd_contexts, 0);
        assert_eq!(autograd::debug_info().num_current_backward_passes, 0);
        rpc::shutdown(false)?;
        Ok(())
    })?;
    Ok(())
}

fn sgd() -> OptimizerKind {
    OptimizerKind::Sgd(SgdOptions {
        lr: 0.5,
        ..Default::default()
    })
}

/// Bad parameter lists are refused naming the problem; nothing is stepped twice.
#[test]
fn world2_optimizer_bad_params() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        init(rank, 2)?;
        if rank == 0 {
            let p: RRef<Tensor> = rpc::remote(1usize, "make_param", vec![1.0, 2.0], None)?;
            // the same parameter twice (two handles to one RRef)
            let e = DistributedOptimizer::new(sgd(), &[p.clone(), p.clone()]).unwrap_err();
            assert!(e.to_string().contains("duplicate"), "{e}");
            // an integer tensor
            let i: RRef<Tensor> = rpc::remote(1usize, "make_int", vec![1i64, 2], None)?;
            let e = DistributedOptimizer::new(sgd(), &[p.clone(), i]).unwrap_err();
            assert!(
                matches!(&e, rpc::Error::Remote { worker, message, .. } if worker == "worker1" && message.contains("dtype")),
                "{e:?}"
            );
            // a tensor that does not require grad
            let n: RRef<Tensor> = rpc::remote(1usize, "make_plain", vec![1.0, 2.0], None)?;
            let e = DistributedOptimizer::new(sgd(), &[n]).unwrap_err();
            assert!(
                matches!(&e, rpc::Error::Remote { worker, message, .. } if worker == "worker1" && message.contains("requires_grad")),
                "{e:?}"
            );
            // a good one still works, from a thread that does not hold the context
            let opt = Arc::new(DistributedOptimizer::new(sgd(), std::slice::from_ref(&p))?);
            let ctx = autograd::context()?;
            let w: Tensor = p.to_here(None)?;
            let loss = w.mul(&w)?.sum()?; // grad 2w = [2, 4]
            autograd::backward(ctx.id(), &[loss], false)?;
            let (id, o) = (ctx.id(), opt.clone());
            std::thread::spawn(move || o.step(id))
                .join()
                .map_err(|_| "step panicked")??;
            let v: Tensor = rpc::rpc_sync(1usize, "value_of", p.clone(), None)?;
            assert_eq!(vals(&v), vec![0.0, 0.0]);
            drop(ctx);
            no_contexts_anywhere(2)?;
            // after shutdown: an error, and dropping it is harmless
            barrier("before shutdown")?;
            rpc::shutdown(true)?;
            let e = opt.step(id).unwrap_err();
            assert!(
                matches!(
                    e,
                    rpc::Error::NotInitialized { .. } | rpc::Error::InvalidArgument { .. }
                ),
                "{e:?}"
            );
            drop(opt);
            return Ok(());
        }
        barrier("before shutdown")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// An optimizer whose owner died: creating one and stepping one return an error naming the
/// owner within the RPC timeout.
#[test]
fn world2_optimizer_dead_owner() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        rpc::init_rpc(&format!("worker{rank}"), rank, 2, common::opts(20, 4))?;
        if rank == 1 {
            std::thread::sleep(Duration::from_secs(60));
            return Err("worker1 was not killed".into());
        }
        let p: RRef<Tensor> = rpc::remote(1usize, "make_param", vec![1.0, 2.0], None)?;
        let q: RRef<Tensor> = rpc::remote(1usize, "make_param", vec![3.0], None)?;
        let mine = RRef::new(t(&[1.0], &[1]).requires_grad_(true))?;
        let opt = DistributedOptimizer::new(sgd(), &[p.clone(), mine])?;
        let _ = rpc::rpc_sync::<(), ()>(1usize, "die", (), Some(Duration::from_secs(15)));
        let t0 = Instant::now();
        let e = DistributedOptimizer::new(sgd(), &[q]).unwrap_err();
        assert!(
            matches!(&e, rpc::Error::WorkerUnreachable { worker, .. } if worker == "worker1"),
            "{e:?}"
        );
        let ctx = autograd::context()?;
        let e = opt.step(ctx.id()).unwrap_err();
        assert!(
            matches!(&e, rpc::Error::WorkerUnreachable { worker, .. } if worker == "worker1"),
            "{e:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
        drop(ctx);
        drop(opt);
        rpc::shutdown(false)?;
        Ok(())
    })?;
    Ok(())
}
