//! Failures between real worker processes: remote errors keep their kind and message and name
//! the worker (also through a nested call), unknown functions, wrong argument and result types,
//! panics, per-call and default timeouts, `set_rpc_timeout`, a worker that dies in the middle of
//! a call, `NotInitialized` before `init_rpc` and after `shutdown`, worker-name validation,
//! duplicate names, and `shutdown` followed by `init_rpc` in the same processes.

use crate::common;

use std::time::{Duration, Instant};

use common::{TestResult, barrier, opts, register_common, rpc_error};
use tensorplay_collectives::spawn::spawn;
use tensorplay_core::Tensor;
use tensorplay_rpc::{self as rpc, RRef};

fn invalid() -> tensorplay_core::Error {
    tensorplay_core::Error::InvalidArgument {
        op: "my_op",
        arg: "x",
        expected: "a positive number".into(),
        got: "-1".into(),
    }
}

fn register_all() {
    register_common();
    rpc::register("double", |x: i64| Ok(2 * x));
    rpc::register("fail", |(): ()| -> tensorplay_core::Result<()> {
        Err(invalid())
    });
    rpc::register("shape_fail", |(): ()| -> tensorplay_core::Result<Tensor> {
        Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3])?
            .add(&Tensor::from_vec(vec![1.0f32; 2], &[2])?)
    });
    rpc::register("panics", |(): ()| -> tensorplay_core::Result<()> {
        panic!("this function panics")
    });
    // calls `func` on `to` and passes its result or error on
    rpc::register("relay", |(to, func): (usize, String)| {
        rpc::rpc_sync::<(), ()>(to, &func, (), None)?;
        Ok(())
    });
    rpc::register("sleep_ms", |ms: u64| {
        std::thread::sleep(Duration::from_millis(ms));
        Ok(ms)
    });
    rpc::register_method("sleep_then_get", |v: &u64, ms: u64| {
        std::thread::sleep(Duration::from_millis(ms));
        Ok(*v)
    });
    rpc::register("die", |(): ()| -> tensorplay_core::Result<()> {
        // a worker that exits in the middle of a call, without closing anything
        std::process::exit(0)
    });
}

fn is_timeout(e: &rpc::Error, worker: &str) -> bool {
    matches!(e, rpc::Error::Timeout { worker: w, .. } if w == worker)
}

/// Remote errors, types, panics and timeouts between three workers.
#[test]
fn world3_errors_and_timeouts() -> TestResult {
    spawn(3, |rank| -> TestResult {
        register_all();
        rpc::init_rpc(&format!("worker{rank}"), rank, 3, opts(20, 4))?;
        if rank == 0 {
            // a remote error keeps its kind and message and names the worker
            let e = rpc::rpc_sync::<(), ()>(1usize, "fail", (), None).unwrap_err();
            match &e {
                rpc::Error::Remote {
                    worker,
                    kind,
                    message,
                } => {
                    assert_eq!(worker, "worker1");
                    assert_eq!(kind, "InvalidArgument");
                    assert_eq!(message, &invalid().to_string());
                }
                other => panic!("{other:?}"),
            }
            assert!(e.to_string().contains("worker1"), "{e}");
            // the same through rpc_async and wait_all
            let futs = (0..5)
                .map(|_| rpc::rpc_async::<(), ()>(2usize, "fail", (), None))
                .collect::<Result<Vec<_>, _>>()?;
            let e = rpc::wait_all(futs).unwrap_err();
            assert!(
                matches!(&e, rpc::Error::Remote { worker, .. } if worker == "worker2"),
                "{e:?}"
            );
            let e = rpc::rpc_sync::<(), Tensor>(2usize, "shape_fail", (), None).unwrap_err();
            assert!(
                matches!(&e, rpc::Error::Remote { worker, kind, message } if worker == "worker2" && kind == "ShapeMismatch" && message.contains("[3]")),
                "{e:?}"
            );
            // an error two calls deep names the worker where it happened
            let e = rpc::rpc_sync::<_, ()>(1usize, "relay", (2usize, "fail".to_string()), None)
                .unwrap_err();
            assert!(
                matches!(&e, rpc::Error::Remote { worker, kind, message } if worker == "worker2" && kind == "InvalidArgument" && *message == invalid().to_string()),
                "{e:?}"
            );
            // so does an unknown function two calls deep
            let e = rpc::rpc_sync::<_, ()>(1usize, "relay", (2usize, "no_such".to_string()), None)
                .unwrap_err();
            assert!(
                matches!(&e, rpc::Error::Remote { worker, kind, .. } if worker == "worker2" && kind == "UnknownFunction"),
                "{e:?}"
            );
            // unknown function
            let e = rpc::rpc_sync::<(), ()>(1usize, "no_such_function", (), None).unwrap_err();
            assert!(
                matches!(&e, rpc::Error::Remote { worker, kind, message } if worker == "worker1" && kind == "UnknownFunction" && message.contains("no_such_function")),
                "{e:?}"
            );
            // wrong argument type, wrong result type
            let e = rpc::rpc_sync::<f64, i64>(1usize, "double", 1.0, None).unwrap_err();
            assert!(
                matches!(&e, rpc::Error::Remote { worker, kind, message } if worker == "worker1" && kind == "Signature" && message.contains("f64") && message.contains("i64")),
                "{e:?}"
            );
            let e = rpc::rpc_sync::<i64, String>(1usize, "double", 1, None).unwrap_err();
            assert!(
                matches!(&e, rpc::Error::Remote { kind, message, .. } if kind == "Signature" && message.contains("String")),
                "{e:?}"
            );
            // a panic is an error of kind Panic, and the worker keeps serving
            let e = rpc::rpc_sync::<(), ()>(1usize, "panics", (), None).unwrap_err();
            assert!(
                matches!(&e, rpc::Error::Remote { worker, kind, message } if worker == "worker1" && kind == "Panic" && message.contains("this function panics")),
                "{e:?}"
            );
            assert_eq!(rpc::rpc_sync::<i64, i64>(1usize, "double", 21, None)?, 42);

            // per-call timeout on a slow function
            let t0 = Instant::now();
            let e = rpc::rpc_sync::<u64, u64>(
                1usize,
                "sleep_ms",
                2000,
                Some(Duration::from_millis(300)),
            )
            .unwrap_err();
            assert!(is_timeout(&e, "worker1"), "{e:?}");
            assert!(
                t0.elapsed() < Duration::from_millis(1800),
                "{:?}",
                t0.elapsed()
            );
            let e = rpc::rpc_async::<u64, u64>(
                2usize,
                "sleep_ms",
                2000,
                Some(Duration::from_millis(300)),
            )?
            .wait()
            .unwrap_err();
            assert!(
                matches!(e, rpc::Error::Timeout { timeout, .. } if timeout == Duration::from_millis(300)),
                "{e:?}"
            );
            // the default timeout
            assert_eq!(rpc::get_rpc_timeout()?, Duration::from_secs(20));
            rpc::set_rpc_timeout(Duration::from_millis(200))?;
            assert_eq!(rpc::get_rpc_timeout()?, Duration::from_millis(200));
            let t0 = Instant::now();
            let e = rpc::rpc_sync::<u64, u64>(2usize, "sleep_ms", 2000, None).unwrap_err();
            assert!(
                matches!(&e, rpc::Error::Timeout { worker, timeout, .. } if worker == "worker2" && *timeout == Duration::from_millis(200)),
                "{e:?}"
            );
            assert!(t0.elapsed() < Duration::from_millis(1800));
            // a per-call timeout overrides the default: longer, and zero (none)
            assert_eq!(
                rpc::rpc_sync::<u64, u64>(1usize, "sleep_ms", 400, Some(Duration::from_secs(10)))?,
                400
            );
            assert_eq!(
                rpc::rpc_sync::<u64, u64>(1usize, "sleep_ms", 400, Some(Duration::ZERO))?,
                400
            );
            // to_here and proxies time out the same way
            rpc::set_rpc_timeout(Duration::from_secs(20))?;
            let slow: RRef<u64> = rpc::remote(1usize, "sleep_ms", 1000u64, None)?;
            let e = slow.to_here(Some(Duration::from_millis(200))).unwrap_err();
            assert!(is_timeout(rpc_error(&e), "worker1"), "{e:?}");
            assert_eq!(slow.to_here(None)?, 1000);
            let e = slow
                .rpc_sync::<u64, u64>("sleep_then_get", 2000, Some(Duration::from_millis(300)))
                .unwrap_err();
            assert!(is_timeout(&e, "worker1"), "{e:?}");
            assert_eq!(slow.rpc_sync::<u64, u64>("sleep_then_get", 10, None)?, 1000);
            // set_rpc_timeout only affects calls issued afterwards
            let f = rpc::rpc_async::<u64, u64>(2usize, "sleep_ms", 600, None)?;
            rpc::set_rpc_timeout(Duration::from_millis(50))?;
            assert_eq!(f.wait()?, 600);
            let e = rpc::rpc_sync::<u64, u64>(2usize, "sleep_ms", 600, None).unwrap_err();
            assert!(is_timeout(&e, "worker2"), "{e:?}");
            // zero: no timeout
            rpc::set_rpc_timeout(Duration::ZERO)?;
            assert_eq!(
                rpc::rpc_sync::<u64, u64>(2usize, "sleep_ms", 300, None)?,
                300
            );
            rpc::set_rpc_timeout(Duration::from_secs(20))?;
            // wait_timeout hands the future back
            let f = rpc::rpc_async::<u64, u64>(1usize, "sleep_ms", 500, None)?;
            let f = f
                .wait_timeout(Duration::from_millis(50))
                .expect_err("not done yet");
            assert!(!f.done());
            assert_eq!(
                f.wait_timeout(Duration::from_secs(10))
                    .ok()
                    .expect("done")?,
                500
            );
            drop(slow);
            // remote's own timeout: the creation's error shows on use; the owner still
            // creates the value late, and the deletion sent when the RRef is dropped (which may
            // arrive before the creation) leaves nothing behind there
            let late: RRef<u64> =
                rpc::remote(2usize, "sleep_ms", 700u64, Some(Duration::from_millis(100)))?;
            let t0 = Instant::now();
            let e = late.to_here(None).unwrap_err();
            // the creation's timeout ends the wait, not the late value
            assert!(
                t0.elapsed() < Duration::from_millis(550),
                "{:?}",
                t0.elapsed()
            );
            assert!(
                matches!(rpc_error(&e), rpc::Error::Timeout { worker, timeout, .. } if worker == "worker2" && *timeout == Duration::from_millis(100)),
                "{e:?}"
            );
            drop(late);
            // dropped while the owner is still creating it
            let mid: RRef<u64> =
                rpc::remote(2usize, "sleep_ms", 700u64, Some(Duration::from_millis(100)))?;
            std::thread::sleep(Duration::from_millis(250));
            drop(mid);
            // until the owner has finished creating it (the check below must see the end)
            std::thread::sleep(Duration::from_millis(700));
            let early: RRef<u64> =
                rpc::remote(2usize, "sleep_ms", 0u64, Some(Duration::from_nanos(1)))?;
            let _ = early.to_here(None);
            drop(early);
        }
        barrier("done")?;
        if rank == 2 {
            // both late creations have finished and were removed
            let t0 = Instant::now();
            while rpc::debug_info()? != rpc::RRefDebugInfo::default() {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "owner table not empty: {:?}",
                    rpc::debug_info()?
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// A worker that exits in the middle of a call: the caller gets `WorkerUnreachable` naming it,
/// well within the call's timeout (not a `Timeout`, not a hang), and so do later calls.
#[test]
fn world2_dead_worker_is_unreachable() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        rpc::init_rpc(&format!("worker{rank}"), rank, 2, opts(20, 4))?;
        if rank == 1 {
            // served until worker 0 makes us exit
            std::thread::sleep(Duration::from_secs(60));
            return Err("worker1 was not killed".into());
        }
        assert_eq!(rpc::rpc_sync::<i64, i64>(1usize, "double", 4, None)?, 8);
        let t0 = Instant::now();
        let e =
            rpc::rpc_sync::<(), ()>(1usize, "die", (), Some(Duration::from_secs(15))).unwrap_err();
        let took = t0.elapsed();
        eprintln!("dead worker noticed after {took:?}: {e}");
        assert!(
            matches!(&e, rpc::Error::WorkerUnreachable { worker, .. } if worker == "worker1"),
            "{e:?}"
        );
        assert!(took < Duration::from_secs(12), "{took:?}");
        // a later call fails too, without crashing this worker
        let t0 = Instant::now();
        let e = rpc::rpc_async::<i64, i64>(1usize, "double", 1, Some(Duration::from_secs(15)))?
            .wait()
            .unwrap_err();
        eprintln!("later call failed after {:?}: {e}", t0.elapsed());
        assert!(
            matches!(&e, rpc::Error::WorkerUnreachable { worker, .. } if worker == "worker1"),
            "{e:?}"
        );
        // this worker still works
        assert_eq!(rpc::rpc_sync::<i64, i64>(0usize, "double", 4, None)?, 8);
        rpc::shutdown(false)?;
        Ok(())
    })?;
    Ok(())
}

fn assert_not_initialized<T: std::fmt::Debug>(r: rpc::Result<T>) {
    match r {
        Err(rpc::Error::NotInitialized { op }) => assert!(!op.is_empty()),
        other => panic!("expected NotInitialized, got {other:?}"),
    }
}

fn all_not_initialized() {
    assert!(!rpc::is_initialized());
    assert_not_initialized(rpc::rpc_sync::<i64, i64>(0usize, "double", 1, None));
    assert_not_initialized(rpc::rpc_async::<i64, i64>("me", "double", 1, None).map(|_| ()));
    assert_not_initialized(rpc::remote::<i64, i64>(0usize, "double", 1, None).map(|_| ()));
    assert_not_initialized(rpc::get_worker_info("me"));
    assert_not_initialized(rpc::get_worker_infos());
    assert_not_initialized(rpc::current_worker());
    assert_not_initialized(rpc::get_rpc_timeout());
    assert_not_initialized(rpc::set_rpc_timeout(Duration::from_secs(1)));
    assert_not_initialized(rpc::debug_info());
    assert_not_initialized(RRef::new(1.0f64).map(|_| ()));
    assert_not_initialized(rpc::shutdown(true));
    assert_not_initialized(rpc::shutdown(false));
}

fn assert_bad_name(name: &str, says: &str) {
    match rpc::init_rpc(name, 0, 1, opts(5, 1)) {
        Err(e @ rpc::Error::InvalidArgument { .. }) => {
            assert!(e.to_string().contains(says), "{name:?}: {e}");
        }
        other => panic!("{name:?}: {other:?}"),
    }
    assert!(!rpc::is_initialized());
}

/// One worker: `NotInitialized` before `init_rpc` and after `shutdown`, name validation,
/// `init_rpc` twice, an RRef used after shutdown, and `init_rpc` again afterwards.
#[test]
fn world1_lifecycle_and_names() -> TestResult {
    spawn(1, |_| -> TestResult {
        register_all();
        all_not_initialized();
        assert_bad_name("", "non-empty");
        assert_bad_name(&"a".repeat(500), "shorter than 128");
        assert_bad_name(&"a".repeat(128), "shorter than 128");
        assert_bad_name("abc*", "must match");
        assert_bad_name(" ", "must match");
        assert_bad_name("wörker", "must match");
        let e = rpc::init_rpc("me", 1, 1, opts(5, 1)).unwrap_err();
        assert!(matches!(e, rpc::Error::InvalidArgument { .. }), "{e:?}");
        let e = rpc::init_rpc(
            "me",
            0,
            1,
            rpc::RpcBackendOptions {
                init_method: "file:///nowhere".into(),
                ..opts(5, 1)
            },
        )
        .unwrap_err();
        assert!(!rpc::is_initialized(), "{e:?}");

        rpc::init_rpc(&"a_Z-9:".repeat(21), 0, 1, opts(10, 1))?; // 126 characters: allowed
        rpc::shutdown(true)?;
        all_not_initialized();

        rpc::init_rpc("me", 0, 1, opts(10, 2))?;
        let e = rpc::init_rpc("me", 0, 1, opts(10, 2)).unwrap_err();
        assert!(e.to_string().contains("already initialized"), "{e}");
        assert!(rpc::is_initialized());
        let r: RRef<i64> = rpc::remote("me", "double", 5i64, None)?;
        assert_eq!(r.to_here(None)?, 10);
        rpc::shutdown(true)?;
        all_not_initialized();
        // an RRef of the previous session is an error, not a panic
        assert!(r.to_here(None).is_err());
        drop(r);
        // and again; a call still in flight at a non-graceful shutdown fails instead of
        // leaving its waiter blocked forever
        rpc::init_rpc("me", 0, 1, opts(10, 2))?;
        assert_eq!(rpc::rpc_sync::<i64, i64>("me", "double", 3, None)?, 6);
        let f = rpc::rpc_async::<u64, u64>("me", "sleep_ms", 1500, None)?;
        let g =
            rpc::rpc_async::<u64, u64>("me", "sleep_ms", 1500, None)?.then(|r| r.map(|v| v + 1));
        rpc::shutdown(false)?;
        all_not_initialized();
        for f in [f, g] {
            match f.wait_timeout(Duration::from_secs(10)) {
                Ok(r) => assert!(r.is_err(), "{r:?}"),
                Err(_) => panic!("a call in flight at shutdown never completed"),
            }
        }
        Ok(())
    })?;
    Ok(())
}

/// Duplicate names fail on every worker with "not unique"; then the same processes initialise
/// with good names, shut down and initialise again, and RPCs work every time.
#[test]
fn world3_duplicate_names_then_reinit() -> TestResult {
    spawn(3, |rank| -> TestResult {
        register_all();
        let name = if rank == 2 { "worker2" } else { "dup" };
        let e = rpc::init_rpc(name, rank, 3, opts(20, 2)).unwrap_err();
        assert!(e.to_string().contains("not unique"), "{e}");
        assert!(!rpc::is_initialized());
        for round in 0..3 {
            rpc::init_rpc(&format!("w{rank}r{round}"), rank, 3, opts(20, 2))?;
            for dst in 0..3 {
                let name = format!("w{dst}r{round}");
                assert_eq!(
                    rpc::rpc_sync::<i64, i64>(name.as_str(), "double", rank as i64 + 1, None)?,
                    2 * rank as i64 + 2
                );
            }
            rpc::shutdown(true)?;
            assert!(!rpc::is_initialized());
        }
        Ok(())
    })?;
    Ok(())
}
