//! RRefs between three real worker processes: `remote` and `to_here`, RRefs passed owner ->
//! user, user -> owner and user -> user, RRefs returned by RPCs, `local_value` on a user,
//! `RRef::new`, proxies through registered methods, `confirmed_by_owner`, failing creations, and
//! the reference counting: once every user dropped its RRefs every owner table is empty
//! (`debug_info`), before a graceful shutdown that succeeds.

use crate::common;

use std::time::Duration;

use common::{TestResult, barrier, debug_counts, eventually, opts, register_common, rpc_error};
use tensorplay_collectives::spawn::spawn;
use tensorplay_core::Tensor;
use tensorplay_rpc::{self as rpc, RRef, WorkerInfo};

fn invalid(msg: &str) -> tensorplay_core::Error {
    tensorplay_core::Error::InvalidArgument {
        op: "fail",
        arg: "x",
        expected: "nothing".into(),
        got: msg.into(),
    }
}

fn register_all() {
    register_common();
    rpc::register("add", |(a, b): (Tensor, Tensor)| a.add(&b));
    rpc::register("ident", |v: f64| Ok(v));
    rpc::register("fail", |(): ()| -> tensorplay_core::Result<f64> {
        Err(invalid("expected failure"))
    });
    rpc::register("rref_sum", |r: RRef<Tensor>| r.to_here(None)?.sum());
    rpc::register("rref_is_owner", |r: RRef<Tensor>| Ok(r.is_owner()));
    rpc::register("rref_confirmed", |r: RRef<Tensor>| {
        Ok(r.confirmed_by_owner())
    });
    rpc::register("rref_owner", |r: RRef<Tensor>| Ok(r.owner()));
    // combines two RRefs (of any owners) on the callee
    rpc::register("rref_add", |(a, b): (RRef<Tensor>, RRef<Tensor>)| {
        a.to_here(None)?.add(&b.to_here(None)?)
    });
    // an RRef returned as a result: owned by the callee ...
    rpc::register("make_rref", |v: f64| Ok(RRef::new(v)?));
    // ... or by another worker (the callee is a user passing it on)
    rpc::register("make_remote", |(to, v): (usize, f64)| {
        let r: RRef<f64> = rpc::remote(to, "ident", v, None)?;
        Ok(r)
    });
    rpc::register_method("numel", |t: &Tensor, (): ()| Ok(t.numel()));
    rpc::register_method("size", |t: &Tensor, (): ()| Ok(t.shape().to_vec()));
    rpc::register_method("add_scalar", |t: &Tensor, s: f64| t.add_scalar(s));
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.to_vec::<f32>().unwrap()
}

#[test]
fn world3_rrefs() -> TestResult {
    spawn(3, |rank| -> TestResult {
        register_all();
        rpc::init_rpc(&format!("worker{rank}"), rank, 3, opts(30, 4))?;
        let n = 3;
        let next = (rank + 1) % n;
        let third = (rank + 2) % n;
        let me = rpc::current_worker()?;
        let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;

        // remote + to_here: a user RRef owned by `next`
        let rr: RRef<Tensor> = rpc::remote(next, "add", (x.clone(), x.clone()), None)?;
        assert!(!rr.is_owner());
        assert_eq!(rr.owner(), rpc::get_worker_info(next)?);
        assert_eq!(rr.owner_name(), format!("worker{next}"));
        assert_eq!(vals(&rr.to_here(None)?), vec![2.0, 4.0, 6.0, 8.0]);
        eventually(Duration::from_secs(10), || Ok(rr.confirmed_by_owner()))?;
        // the owner counts it
        let (owners, forks, _, _) = debug_counts(next)?;
        assert!(
            owners >= 1 && forks >= 1,
            "owner {next}: {owners} owners, {forks} forks"
        );

        // local_value on a user is an error naming both workers
        let e = rr.local_value().unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, rpc::Error::InvalidArgument { .. }), "{e:?}");
        assert!(
            msg.contains(&format!("worker{next}")) && msg.contains(&format!("worker{rank}")),
            "{msg}"
        );

        // user -> owner: the owner resolves it to its own value
        assert!(rpc::rpc_sync::<_, bool>(
            next,
            "rref_is_owner",
            rr.clone(),
            None
        )?);
        let s: Tensor = rpc::rpc_sync(next, "rref_sum", rr.clone(), None)?;
        assert_eq!(s.item::<f32>()?, 20.0);
        // user -> user: the third worker becomes a user and fetches from the owner
        assert!(!rpc::rpc_sync::<_, bool>(
            third,
            "rref_is_owner",
            rr.clone(),
            None
        )?);
        let s: Tensor = rpc::rpc_sync(third, "rref_sum", rr.clone(), None)?;
        assert_eq!(s.item::<f32>()?, 20.0);
        let o: WorkerInfo = rpc::rpc_sync(third, "rref_owner", rr.clone(), None)?;
        assert_eq!(o, rr.owner());
        // a user RRef received from a user is confirmed before the function runs (PyTorch)
        assert!(rpc::rpc_sync::<_, bool>(
            third,
            "rref_confirmed",
            rr.clone(),
            None
        )?);
        // ... and through remote() on the third worker
        let r3: RRef<Tensor> = rpc::remote(third, "rref_sum", rr.clone(), None)?;
        assert_eq!(r3.to_here(None)?.item::<f32>()?, 20.0);

        // RRef::new on the owner
        let mine = RRef::new(x.clone())?;
        assert!(mine.is_owner());
        assert!(mine.confirmed_by_owner());
        assert_eq!(mine.owner(), me);
        assert_eq!(vals(&mine.local_value()?), vals(&x));
        assert_eq!(vals(&mine.to_here(None)?), vals(&x));
        // owner -> user
        assert!(!rpc::rpc_sync::<_, bool>(
            next,
            "rref_is_owner",
            mine.clone(),
            None
        )?);
        assert!(rpc::rpc_sync::<_, bool>(
            next,
            "rref_confirmed",
            mine.clone(),
            None
        )?);
        let s: Tensor = rpc::rpc_sync(next, "rref_sum", mine.clone(), None)?;
        assert_eq!(s.item::<f32>()?, 10.0);
        let o: WorkerInfo = rpc::rpc_sync(next, "rref_owner", mine.clone(), None)?;
        assert_eq!(o, me);
        // owner -> owner (to oneself)
        assert!(rpc::rpc_sync::<_, bool>(
            rank,
            "rref_is_owner",
            mine.clone(),
            None
        )?);
        // two RRefs of different owners combined on a third worker (2x + x)
        let sum: RRef<Tensor> = rpc::remote(third, "rref_add", (rr.clone(), mine.clone()), None)?;
        assert_eq!(vals(&sum.to_here(None)?), vec![3.0, 6.0, 9.0, 12.0]);

        // proxies: registered methods run on the owner
        let numel: usize = rr.rpc_sync("numel", (), None)?;
        assert_eq!(numel, 4);
        let size: Vec<usize> = rr.rpc_async("size", (), None)?.wait()?;
        assert_eq!(size, vec![2, 2]);
        let plus: Tensor = rr.rpc_sync("add_scalar", 1.0f64, None)?;
        assert_eq!(vals(&plus), vec![3.0, 5.0, 7.0, 9.0]);
        let plus: Tensor = mine.rpc_sync("add_scalar", 0.5f64, None)?; // owner is self
        assert_eq!(vals(&plus), vec![1.5, 2.5, 3.5, 4.5]);
        let e = rr.rpc_sync::<(), usize>("non_exist", (), None).unwrap_err();
        assert!(
            matches!(&e, rpc::Error::Remote { worker, kind, message } if *worker == format!("worker{next}") && kind == "UnknownMethod" && message.contains("non_exist")),
            "{e:?}"
        );
        let e = rr
            .rpc_async::<(), usize>("non_exist", (), None)?
            .wait()
            .unwrap_err();
        assert!(
            matches!(&e, rpc::Error::Remote { kind, .. } if kind == "UnknownMethod"),
            "{e:?}"
        );
        let e = rr
            .rpc_sync::<String, usize>("numel", "x".into(), None)
            .unwrap_err();
        assert!(
            matches!(&e, rpc::Error::Remote { kind, .. } if kind == "Signature"),
            "{e:?}"
        );

        // RRefs returned as results: owned by the callee, by a third worker, by this worker
        let ur: RRef<f64> = rpc::rpc_sync(next, "make_rref", 7.5f64, None)?;
        assert!(!ur.is_owner());
        assert_eq!(ur.owner().id, next);
        assert!(ur.confirmed_by_owner());
        assert_eq!(ur.to_here(None)?, 7.5);
        let ur3: RRef<f64> = rpc::rpc_sync(next, "make_remote", (third, 2.5f64), None)?;
        assert_eq!(ur3.owner().id, third);
        assert!(!ur3.is_owner());
        assert_eq!(ur3.to_here(None)?, 2.5);
        eventually(Duration::from_secs(10), || Ok(ur3.confirmed_by_owner()))?;
        let own: RRef<f64> = rpc::rpc_sync(next, "make_remote", (rank, 4.5f64), None)?;
        assert!(own.is_owner());
        assert_eq!(own.local_value()?, 4.5);

        // a failing creation shows at to_here, with the owner's name and the error's kind
        let rf: RRef<f64> = rpc::remote(next, "fail", (), None)?;
        let e = rf.to_here(None).unwrap_err();
        assert!(
            matches!(rpc_error(&e), rpc::Error::Remote { worker, kind, message } if *worker == format!("worker{next}") && kind == "InvalidArgument" && message.contains("expected failure")),
            "{e:?}"
        );
        let e = rf.to_here(None).unwrap_err();
        assert!(
            matches!(rpc_error(&e), rpc::Error::Remote { kind, .. } if kind == "InvalidArgument"),
            "{e:?}"
        );
        let rs: RRef<f64> = rpc::remote(rank, "fail", (), None)?; // owned by this worker
        let e = rs.to_here(None).unwrap_err();
        assert!(
            matches!(rpc_error(&e), rpc::Error::Remote { worker, kind, .. } if *worker == me.name && kind == "InvalidArgument"),
            "{e:?}"
        );
        let ru: RRef<f64> = rpc::remote(next, "no_such_function", (), None)?;
        let e = ru.to_here(None).unwrap_err();
        assert!(
            matches!(rpc_error(&e), rpc::Error::Remote { kind, .. } if kind == "UnknownFunction"),
            "{e:?}"
        );

        // 20 RRefs on every worker, fetched together
        let many: Vec<RRef<f64>> = (0..20)
            .map(|i| rpc::remote(i % n, "ident", i as f64, None))
            .collect::<Result<_, _>>()?;
        let futs = many
            .iter()
            .map(|r| r.to_here_async(None))
            .collect::<Result<Vec<_>, _>>()?;
        assert_eq!(
            rpc::wait_all(futs)?,
            (0..20).map(f64::from).collect::<Vec<_>>()
        );

        // every user drops its RRefs: the owner tables empty out on every worker
        drop((rr, r3, mine, sum, ur, ur3, own, rf, rs, ru, many));
        barrier("dropped")?;
        eventually(Duration::from_secs(20), || {
            let i = rpc::debug_info()?;
            Ok(i == rpc::RRefDebugInfo::default())
        })
        .map_err(|e| format!("worker{rank}: {e}: {:?}", rpc::debug_info()))?;
        barrier("empty")?;
        assert_eq!(rpc::debug_info()?, rpc::RRefDebugInfo::default());
        barrier("checked")?;

        // an RRef alive at shutdown: deleted there, an error afterwards
        let kept: RRef<Tensor> = rpc::remote(next, "add", (x.clone(), x.clone()), None)?;
        assert_eq!(vals(&kept.to_here(None)?), vec![2.0, 4.0, 6.0, 8.0]);
        rpc::shutdown(true)?;
        assert!(kept.to_here(None).is_err());
        assert!(matches!(
            rpc::debug_info(),
            Err(rpc::Error::NotInitialized { .. })
        ));
        drop(kept);
        Ok(())
    })?;
    Ok(())
}

/// An RRef made by a function that was called on its own worker (`rpc_sync` to oneself whose
/// function returns `RRef::new(v)`) holds its value: `local_value`, `to_here` and a
/// `DistributedOptimizer` see it, and the owner table empties when it is dropped.
#[test]
fn world2_rrefs_returned_by_self_calls_hold_their_value() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        rpc::register("make_param", |v: Vec<f64>| {
            let n = v.len();
            Ok(RRef::new(Tensor::from_vec(v, &[n])?.requires_grad_(true))?)
        });
        rpc::init_rpc(&format!("worker{rank}"), rank, 2, opts(20, 4))?;
        if rank == 0 {
            let r: RRef<f64> = rpc::rpc_sync(0, "make_rref", 2.5, None)?;
            assert!(r.is_owner());
            assert_eq!(r.local_value()?, 2.5);
            assert_eq!(r.to_here(Some(Duration::from_secs(5)))?, 2.5);
            assert_eq!(debug_counts(0)?, (1, 0, 0, 0));
            drop(r);
            eventually(Duration::from_secs(5), || {
                Ok(debug_counts(0)? == (0, 0, 0, 0))
            })?;
            // a parameter made that way, stepped by a distributed optimizer
            let p: RRef<Tensor> = rpc::rpc_sync(0, "make_param", vec![1.0, -2.0], None)?;
            let opt = rpc::DistributedOptimizer::new(
                rpc::OptimizerKind::Sgd(tensorplay_core::optim::SgdOptions {
                    lr: 0.1,
                    ..Default::default()
                }),
                std::slice::from_ref(&p),
            )?;
            {
                let ctx = rpc::autograd::context()?;
                let x = p.local_value()?;
                let loss = x.mul(&x)?.sum()?; // gradient 2x: x - 0.1 * 2x = 0.8x
                rpc::autograd::backward(ctx.id(), &[loss], false)?;
                opt.step(ctx.id())?;
            }
            let after = p.local_value()?.to_vec::<f64>()?;
            assert!(
                (after[0] - 0.8).abs() < 1e-12 && (after[1] + 1.6).abs() < 1e-12,
                "{after:?}"
            );
            drop((opt, p));
            eventually(Duration::from_secs(5), || {
                Ok(debug_counts(0)? == (0, 0, 0, 0))
            })?;
        }
        barrier("self calls checked")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}
