//! A first end-to-end check: two workers, calls both ways, RRefs, errors, shutdown.

use std::time::Duration;

use tensorplay_collectives::spawn::spawn;
use tensorplay_core::Tensor;
use tensorplay_rpc as rpc;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn register_all() {
    rpc::register("add", |(a, b): (Tensor, Tensor)| a.add(&b));
    rpc::register("whoami", |(): ()| {
        Ok(rpc::current_worker()
            .map_err(tensorplay_core::Error::from)?
            .id)
    });
    rpc::register("fail", |(): ()| -> tensorplay_core::Result<()> {
        Err(Tensor::from_vec(vec![1.0f32], &[1])?
            .reshape(&[2usize])
            .unwrap_err())
    });
    rpc::register("nested", |(to, x): (usize, f64)| {
        let y: f64 = rpc::rpc_sync(to, "double", x, None)?;
        Ok(y + 1.0)
    });
    rpc::register("double", |x: f64| Ok(2.0 * x));
    rpc::register("sum_rref", |r: rpc::RRef<Tensor>| r.to_here(None)?.sum());
}

#[test]
fn two_workers() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        rpc::init_rpc(
            &format!("worker{rank}"),
            rank,
            2,
            rpc::RpcBackendOptions {
                rpc_timeout: Duration::from_secs(20),
                ..Default::default()
            },
        )?;
        let other = 1 - rank;
        let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2])?;
        let y: Tensor = rpc::rpc_sync(
            format!("worker{other}"),
            "add",
            (x.clone(), x.clone()),
            None,
        )?;
        assert_eq!(y.to_vec::<f32>()?, vec![2.0, 4.0]);
        let who: usize = rpc::rpc_sync(other, "whoami", (), None)?;
        assert_eq!(who, other);
        let me: usize = rpc::rpc_sync(rank, "whoami", (), None)?;
        assert_eq!(me, rank);
        let e = rpc::rpc_sync::<(), ()>(other, "fail", (), None).unwrap_err();
        assert!(
            matches!(&e, rpc::Error::Remote { worker, kind, .. } if *worker == format!("worker{other}") && !kind.is_empty()),
            "{e}"
        );
        let z: f64 = rpc::rpc_sync(other, "nested", (rank, 5.0), None)?;
        assert_eq!(z, 11.0);
        let r: rpc::RRef<Tensor> = rpc::remote(other, "add", (x.clone(), x.clone()), None)?;
        assert_eq!(r.to_here(None)?.to_vec::<f32>()?, vec![2.0, 4.0]);
        assert!(!r.is_owner());
        // the RRef goes back to its owner (user -> owner) and is summed there
        let s: Tensor = rpc::rpc_sync(other, "sum_rref", r.clone(), None)?;
        assert_eq!(s.item::<f32>()?, 6.0);
        // an owner RRef sent to the other worker (owner -> user)
        let mine = rpc::RRef::new(x.clone())?;
        let s: Tensor = rpc::rpc_sync(other, "sum_rref", mine.clone(), None)?;
        assert_eq!(s.item::<f32>()?, 3.0);
        let futs: Vec<_> = (0..200)
            .map(|i| rpc::rpc_async::<f64, f64>(other, "double", i as f64, None))
            .collect::<Result<_, _>>()?;
        let outs = rpc::wait_all(futs)?;
        assert_eq!(outs[199], 398.0);
        drop(r);
        drop(mine);
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}
