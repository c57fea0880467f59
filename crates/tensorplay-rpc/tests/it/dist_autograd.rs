//! Distributed autograd across real processes: gradients through rpc_sync / rpc_async /
//! remote + to_here / proxies / nested chains equal the same computation done locally
//! (float64, integer-valued data so that every sum is exact), contexts, retain_graph,
//! failures, the unused-output case, cleanup on every worker, `RRef::backward`, and activation
//! checkpointing on both sides of an RPC.

use crate::common;

use std::sync::mpsc;
use std::time::Duration;

use common::{TestResult, barrier, eventually, init, register_common};
use tensorplay_collectives::spawn::spawn;
use tensorplay_core::Tensor;
use tensorplay_core::autograd::{Context, Function, apply};
use tensorplay_core::utils::checkpoint::checkpoint;
use tensorplay_rpc::{self as rpc, RRef, autograd as dist_autograd};

fn t(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape).expect("tensor")
}

/// Integer-valued inputs that differ per rank and seed, requiring grad.
fn leaf(rank: usize, seed: usize) -> Tensor {
    let v: Vec<f64> = (0..6)
        .map(|i| ((i * 7 + rank * 3 + seed * 5) % 9) as f64 - 4.0)
        .collect();
    t(&v, &[2, 3]).requires_grad_(true)
}

fn vals(x: &Tensor) -> Vec<f64> {
    x.to_vec::<f64>().expect("values")
}

/// A backward that always fails.
struct FailsInBackward;
impl Function for FailsInBackward {
    fn forward(&self, _: &mut Context, x: &[&Tensor]) -> tensorplay_core::Result<Vec<Tensor>> {
        Ok(vec![x[0].mul_scalar(1.0)?])
    }
    fn backward(&self, _: &Context, _: &[Tensor]) -> tensorplay_core::Result<Vec<Option<Tensor>>> {
        Err(tensorplay_core::Error::Autograd(
            "simulated error in backward".into(),
        ))
    }
}

/// Nested calls of `pass_on` that ended on this worker.
static NESTED_DONE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn register_all() {
    register_common();
    rpc::register("add", |(a, b): (Tensor, Tensor)| a.add(&b));
    rpc::register("mul", |(a, b): (Tensor, Tensor)| a.mul(&b));
    // uses its input twice
    rpc::register("square_plus", |x: Tensor| x.mul(&x)?.add(&x));
    // the same under activation checkpointing: the callee recomputes it in backward
    rpc::register("checkpointed_square_plus", |x: Tensor| {
        Ok(checkpoint(|xs| Ok(vec![xs[0].mul(&xs[0])?.add(&xs[0])?]), &[&x])?.remove(0))
    });
    // A -> B -> C: multiplies by the result of the next hop
    rpc::register("nested", |(next, a, b): (usize, Tensor, Tensor)| {
        let s: Tensor = rpc::rpc_sync(next, "add", (a.clone(), b), None)?;
        s.mul(&a)
    });
    rpc::register("fails_backward", |x: Tensor| {
        Ok(apply(FailsInBackward, &[&x])?.remove(0))
    });
    rpc::register("context_id", |(): ()| {
        Ok(dist_autograd::current_context().unwrap_or(u64::MAX))
    });
    rpc::register("num_contexts", |(): ()| {
        Ok(dist_autograd::debug_info().num_autograd_contexts)
    });
    rpc::register("scaled_sum", |(x, k): (Tensor, f64)| x.mul_scalar(k)?.sum());
    rpc::register("numel", |x: Tensor| Ok(x.numel()));
    // calls on to `next` without waiting; the nested call's end is counted in NESTED_DONE
    rpc::register("pass_on", |(next, x): (usize, Tensor)| {
        let f = rpc::rpc_async::<Tensor, usize>(next, "numel", x, None)?;
        std::thread::spawn(move || {
            let _ = f.wait();
            NESTED_DONE.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
        Ok(())
    });
    rpc::register("nested_done", |(): ()| {
        Ok(NESTED_DONE.load(std::sync::atomic::Ordering::SeqCst))
    });
    rpc::register("context_info", |id: u64| {
        let i = dist_autograd::context_info(id)?;
        Ok((i.num_sends, i.num_recvs))
    });
}

/// The gradient of `x` in `g`, or an error naming `what`.
fn grad_of(g: &dist_autograd::Gradients, x: &Tensor, what: &str) -> Result<Vec<f64>, String> {
    g.get(x)
        .map(vals)
        .ok_or_else(|| format!("{what}: no gradient for the tensor"))
}

/// The gradients of `(a, b)` from `f` run locally with `.backward()`.
fn local_grads(
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(&Tensor, &Tensor) -> tensorplay_core::Result<Tensor>,
) -> tensorplay_core::Result<(Vec<f64>, Vec<f64>)> {
    let (la, lb) = (
        a.detach().requires_grad_(true),
        b.detach().requires_grad_(true),
    );
    f(&la, &lb)?.backward()?;
    Ok((
        vals(&la.grad().expect("a grad")),
        vals(&lb.grad().expect("b grad")),
    ))
}

/// Runs one forward through RPCs inside a fresh context, backward, and compares the context's
/// gradients of `(a, b)` with the local ones.
fn check_against_local(
    what: &str,
    rank: usize,
    seed: usize,
    dist: impl Fn(&Tensor, &Tensor) -> rpc::Result<Tensor>,
    local: impl Fn(&Tensor, &Tensor) -> tensorplay_core::Result<Tensor>,
) -> TestResult {
    let (a, b) = (leaf(rank, seed), leaf(rank + 1, seed + 1));
    let (ga, gb) = local_grads(&a, &b, local)?;
    let ctx = dist_autograd::context()?;
    let loss = dist(&a, &b)?;
    dist_autograd::backward(ctx.id(), &[loss], false)?;
    let g = dist_autograd::get_gradients(ctx.id())?;
    assert_eq!(grad_of(&g, &a, what)?, ga, "{what}: gradient of a");
    assert_eq!(grad_of(&g, &b, what)?, gb, "{what}: gradient of b");
    assert_eq!(g.len(), 2, "{what}: only the two leaves of this worker");
    assert!(
        a.grad().is_none() && b.grad().is_none(),
        "{what}: .grad untouched"
    );
    Ok(())
}

fn chains(rank: usize, world: usize) -> TestResult {
    let n1 = (rank + 1) % world;
    let n2 = (rank + 2) % world;
    // rpc_sync, two hops, a leaf used on two workers
    check_against_local(
        "rpc_sync chain",
        rank,
        1,
        |a, b| {
            let s: Tensor = rpc::rpc_sync(n1, "add", (a.clone(), b.clone()), None)?;
            let p: Tensor = rpc::rpc_sync(n2, "mul", (s, a.clone()), None)?;
            Ok(p.mul(b)?.sum()?)
        },
        |a, b| a.add(b)?.mul(a)?.mul(b)?.sum(),
    )?;
    // rpc_async
    check_against_local(
        "rpc_async",
        rank,
        2,
        |a, b| {
            let f = rpc::rpc_async::<_, Tensor>(n1, "mul", (a.clone(), b.clone()), None)?;
            Ok(f.wait()?.sum()?)
        },
        |a, b| a.mul(b)?.sum(),
    )?;
    // remote + to_here, then a proxy-free second hop through the RRef's owner
    check_against_local(
        "remote + to_here",
        rank,
        3,
        |a, b| {
            let r: RRef<Tensor> = rpc::remote(n1, "add", (a.clone(), b.clone()), None)?;
            let s = r.to_here(None)?;
            let q: Tensor = rpc::rpc_sync(n2, "square_plus", s, None)?;
            Ok(q.sum()?)
        },
        |a, b| {
            let s = a.add(b)?;
            s.mul(&s)?.add(&s)?.sum()
        },
    )?;
    // nested: A -> B -> C -> back
    check_against_local(
        "nested",
        rank,
        4,
        |a, b| {
            let y: Tensor = rpc::rpc_sync(n1, "nested", (n2, a.clone(), b.clone()), None)?;
            Ok(y.sum()?)
        },
        |a, b| a.add(b)?.mul(a)?.sum(),
    )?;
    // activation checkpointing around RPC results here, and inside the callee (recomputed
    // there by the distributed backward)
    check_against_local(
        "checkpoint",
        rank,
        6,
        |a, b| {
            let s: Tensor = rpc::rpc_sync(n1, "checkpointed_square_plus", a.clone(), None)?;
            let y = checkpoint(
                |xs| Ok(vec![xs[0].mul(&xs[1])?.tanh()?.mul(&xs[1])?]),
                &[&s, b],
            )?;
            Ok(y[0].sum()?)
        },
        |a, b| {
            let s = a.mul(a)?.add(a)?;
            s.mul(b)?.tanh()?.mul(b)?.sum()
        },
    )?;
    // calls to this worker itself
    check_against_local(
        "self call",
        rank,
        5,
        |a, b| {
            let y: Tensor = rpc::rpc_sync(rank, "mul", (a.clone(), b.clone()), None)?;
            Ok(y.sum()?)
        },
        |a, b| a.mul(b)?.sum(),
    )?;
    Ok(())
}

fn run_world(world: usize) -> TestResult {
    spawn(world, move |rank| -> TestResult {
        register_all();
        init(rank, world)?;
        chains(rank, world)?;
        barrier("chains")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

#[test]
fn world2_gradients_equal_local() -> TestResult {
    run_world(2)
}

#[test]
fn world3_gradients_equal_local() -> TestResult {
    run_world(3)
}

#[test]
fn world4_gradients_equal_local() -> TestResult {
    run_world(4)
}

#[test]
fn world3_contexts_retain_graph_failures_and_cleanup() -> TestResult {
    spawn(3, |rank| -> TestResult {
        register_all();
        init(rank, 3)?;
        let next = (rank + 1) % 3;
        // ids: worker id in the top 16 bits; contexts do not nest; current while open
        {
            let ctx = dist_autograd::context()?;
            assert_eq!(ctx.id() >> 48, rank as u64);
            assert_eq!(dist_autograd::current_context(), Some(ctx.id()));
            let e = dist_autograd::context().unwrap_err();
            assert!(e.to_string().contains("already open"), "{e}");
            // the callee runs inside the same context
            let seen: u64 = rpc::rpc_sync(next, "context_id", (), None)?;
            assert_eq!(seen, ctx.id());
            // one send and one recv on each side for a call with grad
            let a = leaf(rank, 0);
            let y: Tensor = rpc::rpc_sync(next, "square_plus", a.clone(), None)?;
            let info = dist_autograd::context_info(ctx.id())?;
            assert_eq!((info.num_sends, info.num_recvs), (1, 1));
            assert_eq!(info.known_workers, vec![next]);
            let theirs: (usize, usize) = rpc::rpc_sync(next, "context_info", ctx.id(), None)?;
            assert_eq!(theirs, (1, 1));
            // retain_graph: two backwards add up
            let loss = y.sum()?;
            dist_autograd::backward(ctx.id(), std::slice::from_ref(&loss), true)?;
            dist_autograd::backward(ctx.id(), std::slice::from_ref(&loss), false)?;
            let g = dist_autograd::get_gradients(ctx.id())?;
            let once: Vec<f64> = vals(&a).iter().map(|x| 2.0 * x + 1.0).collect();
            let twice: Vec<f64> = once.iter().map(|x| 2.0 * x).collect();
            assert_eq!(grad_of(&g, &a, "retain")?, twice);
            // after a backward without retain_graph the graph is gone
            let e = dist_autograd::backward(ctx.id(), &[loss], false).unwrap_err();
            assert!(e.to_string().contains("retain_graph"), "{e}");
        }
        assert_eq!(dist_autograd::current_context(), None);
        // bad arguments
        {
            let ctx = dist_autograd::context()?;
            let a = leaf(rank, 1);
            let e = dist_autograd::backward(ctx.id(), &[], false).unwrap_err();
            assert!(e.to_string().contains("no tensors"), "{e}");
            let e = dist_autograd::backward(ctx.id(), std::slice::from_ref(&a), false).unwrap_err();
            assert!(e.to_string().contains("leaf"), "{e}");
            let e = dist_autograd::backward(ctx.id(), &[a.mul_scalar(2.0)?], false).unwrap_err();
            assert!(e.to_string().contains("more than one element"), "{e}");
            let e = dist_autograd::backward(ctx.id(), &[t(&[1.0], &[1])], false).unwrap_err();
            assert!(e.to_string().contains("does not require grad"), "{e}");
            let e = dist_autograd::backward(12345, &[a.sum()?], false).unwrap_err();
            assert!(e.to_string().contains("12345"), "{e}");
            let e = dist_autograd::get_gradients(12345).unwrap_err();
            assert!(e.to_string().contains("12345"), "{e}");
        }
        // a failing backward on the next worker, then a good one in a new context
        {
            let ctx = dist_autograd::context()?;
            let a = leaf(rank, 2);
            let y: Tensor = rpc::rpc_sync(next, "fails_backward", a.clone(), None)?;
            let e = dist_autograd::backward(ctx.id(), &[y.sum()?], false).unwrap_err();
            assert!(
                matches!(&e, rpc::Error::Autograd { worker, message } if *worker == format!("worker{next}") && message.contains("simulated error")),
                "{e:?}"
            );
            assert!(
                e.to_string()
                    .starts_with(&format!("Error on worker worker{next}: ")),
                "{e}"
            );
        }
        check_against_local(
            "after a failure",
            rank,
            6,
            |a, b| {
                Ok(rpc::rpc_sync::<_, Tensor>(next, "mul", (a.clone(), b.clone()), None)?.sum()?)
            },
            |a, b| a.mul(b)?.sum(),
        )?;
        // an RPC output the loss does not use: backward returns instead of waiting for it
        {
            let ctx = dist_autograd::context()?;
            let id = ctx.id();
            let (a, b) = (leaf(rank, 7), leaf(rank, 8));
            let used: Tensor = rpc::rpc_sync(next, "mul", (a.clone(), b.clone()), None)?;
            let _unused: Tensor = rpc::rpc_sync(next, "add", (a.clone(), b.clone()), None)?;
            let (tx, rx) = mpsc::channel();
            let loss = used.sum()?;
            std::thread::spawn(move || {
                let _ = tx.send(dist_autograd::backward(id, &[loss], false));
            });
            rx.recv_timeout(Duration::from_secs(20))
                .map_err(|_| "backward with an unused RPC output did not return")??;
            let g = dist_autograd::get_gradients(id)?;
            assert_eq!(grad_of(&g, &a, "unused")?, vals(&b));
            assert_eq!(grad_of(&g, &b, "unused")?, vals(&a));
        }
        // tensor hooks run
        {
            let ctx = dist_autograd::context()?;
            let a = leaf(rank, 9);
            a.register_hook(|g| Ok(Some(g.mul_scalar(3.0)?)))?;
            let y: Tensor = rpc::rpc_sync(next, "scaled_sum", (a.clone(), 2.0), None)?;
            dist_autograd::backward(ctx.id(), &[y], false)?;
            let g = dist_autograd::get_gradients(ctx.id())?;
            assert_eq!(grad_of(&g, &a, "hook")?, vec![6.0; 6]);
        }
        // every context is gone on every worker once released
        barrier("released")?;
        for w in 0..3usize {
            eventually(Duration::from_secs(10), || {
                Ok(rpc::rpc_sync::<(), usize>(w, "num_contexts", (), None)? == 0)
            })?;
        }
        barrier("checked")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

#[test]
fn world2_rref_backward() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        init(rank, 2)?;
        if rank == 0 {
            // an owner RRef without a context: plain local backward into .grad
            let a = leaf(0, 1);
            let own = RRef::new(a.mul_scalar(2.0)?.sum()?)?;
            own.backward(None, false)?;
            assert_eq!(vals(&a.grad().expect("grad")), vec![2.0; 6]);
            // a user RRef: the owner runs the pass rooted at its value
            let b = leaf(0, 2);
            let r: RRef<Tensor> = rpc::remote(1usize, "scaled_sum", (b.clone(), 5.0), None)?;
            let e = r.backward(None, false).unwrap_err();
            assert!(e.to_string().contains("context"), "{e}");
            let ctx = dist_autograd::context()?;
            // the fetch records the value's crossing; backward is asked of the owner
            let r2: RRef<Tensor> = rpc::remote(1usize, "scaled_sum", (b.clone(), 5.0), None)?;
            r2.backward(Some(ctx.id()), false)?;
            let g = dist_autograd::get_gradients(ctx.id())?;
            assert_eq!(grad_of(&g, &b, "rref backward")?, vec![5.0; 6]);
            drop(ctx);
        }
        barrier("done")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// A request sent inside a context and overtaken by that context's cleanup (a large tensor is
/// slow to send; the cleanup is not) must not reopen the context on the callee: every worker
/// is back to no context within a second of the late call ending, 20 times, for one hop
/// (0 -> 1) and for two (0 -> 1 -> 2, the second call still in flight when 0 releases).
#[test]
fn world3_late_requests_do_not_reopen_released_contexts() -> TestResult {
    spawn(3, |rank| -> TestResult {
        register_all();
        init(rank, 3)?;
        if rank == 0 {
            let big = Tensor::zeros(&[4 << 20], tensorplay_core::DType::F32)?;
            let all_released = |what: &str, i: usize| -> TestResult {
                for w in 0..3usize {
                    eventually(Duration::from_secs(1), || {
                        Ok(rpc::rpc_sync::<(), usize>(w, "num_contexts", (), None)? == 0)
                    })
                    .map_err(|e| format!("{what} #{i}: worker {w} still has a context: {e}"))?;
                }
                Ok(())
            };
            for i in 0..20 {
                // one hop: the guard is dropped while the call is in flight
                let f = {
                    let _ctx = dist_autograd::context()?;
                    rpc::rpc_async::<Tensor, usize>(1, "numel", big.clone(), None)?
                };
                assert_eq!(f.wait()?, 4 << 20);
                all_released("one hop", i)?;
                // two hops: worker 1 calls on to 2 and answers at once
                let before: usize = rpc::rpc_sync(1, "nested_done", (), None)?;
                {
                    let _ctx = dist_autograd::context()?;
                    rpc::rpc_sync::<(usize, Tensor), ()>(1, "pass_on", (2, big.clone()), None)?;
                }
                eventually(Duration::from_secs(30), || {
                    Ok(rpc::rpc_sync::<(), usize>(1, "nested_done", (), None)? > before)
                })?;
                all_released("two hops", i)?;
            }
        }
        barrier("late requests checked")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}
