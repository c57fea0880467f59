//! Hostile input and misuse: extreme timeouts (`Duration::MAX`), arguments that cannot be
//! encoded (alone and after RRefs that were already forked), owner RRefs dropped while their
//! value is still being computed, `to_here` timeouts on the owner, methods of the same name on
//! values of different types, absurd options, concurrent `init_rpc`, and deep ping-pong
//! nesting on one transport thread. Every case must give a typed error (or the right value)
//! quickly, never a panic or a hang, and leave every owner table empty.

use crate::common;

use std::time::{Duration, Instant};

use common::{TestResult, barrier, debug_counts, eventually, opts, register_common, rpc_error};
use tensorplay_collectives::spawn::spawn;
use tensorplay_core::Tensor;
use tensorplay_rpc::{self as rpc, Decoder, Encoder, RRef, Wire};

/// An RRef a function keeps after its call.
static STASH: std::sync::Mutex<Option<RRef<f64>>> = std::sync::Mutex::new(None);

/// A value whose encoding always fails (like a CUDA tensor or a deleted RRef would).
struct Unsendable;

impl Wire for Unsendable {
    fn encode(&self, _: &mut Encoder) -> rpc::Result<()> {
        Err(rpc::Error::invalid(
            "test",
            "unsendable",
            "a value that can travel",
            "Unsendable",
        ))
    }
    fn decode(_: &mut Decoder) -> rpc::Result<Self> {
        Err(rpc::Error::Serialization("Unsendable".into()))
    }
}

fn register_all() {
    register_common();
    rpc::register("double", |x: i64| Ok(2 * x));
    rpc::register("ident", |v: f64| Ok(v));
    rpc::register("sleep_ms", |ms: u64| {
        std::thread::sleep(Duration::from_millis(ms));
        Ok(ms)
    });
    // ping-pong: calls the other worker with depth - 1 until 0, returns the depth reached
    rpc::register("pingpong", |(depth, world): (u64, usize)| {
        if depth == 0 {
            return Ok(0u64);
        }
        let me = rpc::current_worker()?.id;
        let next = (me + 1) % world;
        let r: u64 = rpc::rpc_sync(next, "pingpong", (depth - 1, world), None)?;
        Ok(r + 1)
    });
    rpc::register(
        "stash_and_fail",
        |r: RRef<f64>| -> tensorplay_core::Result<()> {
            *STASH.lock().unwrap() = Some(r);
            Err(tensorplay_core::Error::InvalidArgument {
                op: "stash_and_fail",
                arg: "r",
                expected: "nothing".into(),
                got: "an RRef, kept".into(),
            })
        },
    );
    rpc::register("stashed_value", |(): ()| {
        let r = STASH.lock().unwrap().clone();
        match r {
            Some(r) => r.to_here(Some(Duration::from_secs(5))),
            None => Ok(-1.0),
        }
    });
    rpc::register("clear_stash", |(): ()| {
        STASH.lock().unwrap().take();
        Ok(())
    });
    rpc::register("slow_new_rref", |ms: u64| {
        let r = RRef::new(1.5f64)?;
        std::thread::sleep(Duration::from_millis(ms));
        Ok(r)
    });
    rpc::register("set_default_timeout_ms", |ms: u64| {
        rpc::set_rpc_timeout(Duration::from_millis(ms))?;
        Ok(())
    });
    rpc::register("new_rref", |v: f64| Ok(RRef::new(v)?));
    rpc::register_method("len", |v: &Vec<f64>, (): ()| Ok(v.len() as u64));
    rpc::register_method("len", |t: &Tensor, (): ()| Ok(t.numel() as u64));
}

fn is_invalid(e: &rpc::Error, arg: &str) -> bool {
    matches!(e, rpc::Error::InvalidArgument { arg: a, .. } if a == arg)
}

/// `Duration::MAX` as the default timeout, as a per-call timeout, for `to_here`,
/// `wait_timeout` and the graceful shutdown: no `Instant` overflow panics, and calls work.
#[test]
fn world1_duration_max_timeouts() -> TestResult {
    spawn(1, |_| -> TestResult {
        register_all();
        rpc::init_rpc(
            "me",
            0,
            1,
            rpc::RpcBackendOptions {
                rpc_timeout: Duration::MAX,
                ..opts(10, 2)
            },
        )?;
        assert_eq!(rpc::get_rpc_timeout()?, Duration::MAX);
        assert_eq!(rpc::rpc_sync::<i64, i64>("me", "double", 4, None)?, 8);
        assert_eq!(
            rpc::rpc_sync::<i64, i64>("me", "double", 5, Some(Duration::MAX))?,
            10
        );
        let f = rpc::rpc_async::<i64, i64>("me", "double", 6, Some(Duration::MAX))?;
        match f.wait_timeout(Duration::MAX) {
            Ok(r) => assert_eq!(r?, 12),
            Err(_) => panic!("wait_timeout(MAX) gave up"),
        }
        let r: RRef<i64> = rpc::remote("me", "double", 7i64, Some(Duration::MAX))?;
        assert_eq!(r.to_here(Some(Duration::MAX))?, 14);
        assert_eq!(r.local_value()?, 14);
        drop(r);
        rpc::set_rpc_timeout(Duration::MAX)?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// `to_here` on the owner honours its own timeout (not the default one), and
/// `to_here_async` returns at once there instead of blocking until the value exists.
#[test]
fn world1_owner_to_here_timeout() -> TestResult {
    spawn(1, |_| -> TestResult {
        register_all();
        rpc::init_rpc("me", 0, 1, opts(30, 2))?;
        let r: RRef<u64> = rpc::remote("me", "sleep_ms", 1500u64, None)?;
        assert!(r.is_owner());
        let t0 = Instant::now();
        let f = r.to_here_async(None)?;
        assert!(
            t0.elapsed() < Duration::from_millis(500),
            "to_here_async blocked for {:?}",
            t0.elapsed()
        );
        let t0 = Instant::now();
        let e = r.to_here(Some(Duration::from_millis(100))).unwrap_err();
        assert!(matches!(rpc_error(&e), rpc::Error::Timeout { .. }), "{e:?}");
        assert!(
            t0.elapsed() < Duration::from_millis(1000),
            "to_here(100 ms) on the owner took {:?}",
            t0.elapsed()
        );
        assert_eq!(f.wait()?, 1500);
        assert_eq!(r.to_here(Some(Duration::from_millis(100)))?, 1500);
        drop(r);
        assert_eq!(rpc::debug_info()?, rpc::RRefDebugInfo::default());
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// An owner RRef made by `remote` to this worker and dropped before its value was computed
/// leaves nothing in the owner table once the function finished.
#[test]
fn world1_owner_rref_dropped_before_its_value() -> TestResult {
    spawn(1, |_| -> TestResult {
        register_all();
        rpc::init_rpc("me", 0, 1, opts(30, 2))?;
        let r: RRef<u64> = rpc::remote("me", "sleep_ms", 300u64, None)?;
        drop(r);
        std::thread::sleep(Duration::from_millis(700));
        assert_eq!(rpc::debug_info()?, rpc::RRefDebugInfo::default());
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// Methods of the same name registered for values of different types both work.
#[test]
fn world1_methods_of_one_name_on_two_types() -> TestResult {
    spawn(1, |_| -> TestResult {
        register_all();
        rpc::init_rpc("me", 0, 1, opts(30, 2))?;
        let v = RRef::new(vec![1.0f64, 2.0, 3.0])?;
        let t = RRef::new(Tensor::from_vec(vec![1.0f32; 5], &[5])?)?;
        assert_eq!(v.rpc_sync::<(), u64>("len", (), None)?, 3);
        assert_eq!(t.rpc_sync::<(), u64>("len", (), None)?, 5);
        // a method of a name registered for other types only is a typed remote error
        let s = RRef::new(7i64)?;
        let e = s.rpc_sync::<(), u64>("len", (), None).unwrap_err();
        assert!(
            matches!(&e, rpc::Error::Remote { worker, kind, .. } if worker == "me" && kind == "Signature"),
            "{e:?}"
        );
        drop((v, t, s));
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// Absurd options are typed errors naming the argument, not panics or endless waits.
#[test]
fn world1_absurd_options() -> TestResult {
    spawn(1, |_| -> TestResult {
        register_all();
        let e = rpc::init_rpc(
            "me",
            0,
            1,
            rpc::RpcBackendOptions {
                num_worker_threads: usize::MAX,
                ..opts(5, 1)
            },
        )
        .unwrap_err();
        assert!(is_invalid(&e, "num_worker_threads"), "{e:?}");
        assert!(!rpc::is_initialized());
        let e = rpc::init_rpc("me", 0, 0, opts(5, 1)).unwrap_err();
        assert!(is_invalid(&e, "rank"), "{e:?}");
        let e = rpc::init_rpc("me", usize::MAX, usize::MAX, opts(5, 1)).unwrap_err();
        assert!(is_invalid(&e, "rank"), "{e:?}");
        // a world size the store's counters cannot reach (it wrapped to -1 and let the
        // rendezvous through, then allocated for usize::MAX workers)
        let e = rpc::init_rpc("me", 0, usize::MAX, opts(1, 1)).unwrap_err();
        assert!(is_invalid(&e, "world_size"), "{e:?}");
        // a job whose other workers never come: an error within the timeout
        let t0 = Instant::now();
        let e = rpc::init_rpc("me", 0, 3, opts(1, 1)).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
        assert!(!rpc::is_initialized(), "{e:?}");
        // and the process still initialises properly afterwards
        rpc::init_rpc("me", 0, 1, opts(10, 1))?;
        let e = rpc::rpc_sync::<i64, i64>(usize::MAX, "double", 1, None).unwrap_err();
        assert!(
            matches!(&e, rpc::Error::UnknownWorker { name, known } if name.contains(&usize::MAX.to_string()) && known.contains("0=me")),
            "{e:?}"
        );
        for bad in ["", "Me", "me ", "mé", &"m".repeat(300)] {
            let e = rpc::rpc_sync::<i64, i64>(bad, "double", 1, None).unwrap_err();
            assert!(matches!(e, rpc::Error::UnknownWorker { .. }), "{e:?}");
        }
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// Two threads calling `init_rpc` at once: exactly one succeeds, the other says RPC is already
/// initialised (or being initialised).
#[test]
fn world1_concurrent_init() -> TestResult {
    spawn(1, |_| -> TestResult {
        register_all();
        let ts: Vec<_> = (0..2)
            .map(|_| std::thread::spawn(|| rpc::init_rpc("me", 0, 1, opts(5, 1))))
            .collect();
        let rs: Vec<rpc::Result<()>> = ts.into_iter().map(|t| t.join().unwrap()).collect();
        let ok = rs.iter().filter(|r| r.is_ok()).count();
        assert_eq!(ok, 1, "{rs:?}");
        for r in &rs {
            if let Err(e) = r {
                assert!(is_invalid(e, "state"), "{e:?}");
            }
        }
        assert_eq!(rpc::rpc_sync::<i64, i64>("me", "double", 2, None)?, 4);
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// Arguments that cannot be encoded: `remote`, `rpc_async` and methods report the error at
/// once, and nothing is left behind: no user RRef waiting for a confirmation that never
/// comes, no parent kept for a child that never left, no fork registered early on the owner.
/// The graceful shutdown then succeeds quickly.
#[test]
fn world2_unencodable_arguments_leave_nothing_behind() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        rpc::init_rpc(&format!("worker{rank}"), rank, 2, opts(20, 2))?;
        if rank == 0 {
            let e = rpc::remote::<_, f64>(1usize, "ident", Unsendable, None).unwrap_err();
            assert!(is_invalid(&e, "unsendable"), "{e:?}");
            let e = rpc::rpc_async::<_, f64>(1usize, "ident", Unsendable, None)
                .map(|_| ())
                .unwrap_err();
            assert!(is_invalid(&e, "unsendable"), "{e:?}");
            // after an RRef that was already forked in the same message
            let user: RRef<f64> = rpc::remote(1usize, "ident", 1.5, None)?;
            assert_eq!(user.to_here(None)?, 1.5);
            let own = RRef::new(2.5f64)?;
            for to in [0usize, 1] {
                let e = rpc::rpc_async::<_, f64>(to, "ident", (user.clone(), Unsendable), None)
                    .map(|_| ())
                    .unwrap_err();
                assert!(is_invalid(&e, "unsendable"), "{e:?}");
                let e = rpc::rpc_async::<_, f64>(to, "ident", (own.clone(), Unsendable), None)
                    .map(|_| ())
                    .unwrap_err();
                assert!(is_invalid(&e, "unsendable"), "{e:?}");
                let e = rpc::remote::<_, f64>(to, "ident", (user.clone(), Unsendable), None)
                    .unwrap_err();
                assert!(is_invalid(&e, "unsendable"), "{e:?}");
                let e = rpc::remote::<_, f64>(to, "ident", (own.clone(), Unsendable), None)
                    .unwrap_err();
                assert!(is_invalid(&e, "unsendable"), "{e:?}");
            }
            let info = rpc::debug_info()?;
            assert_eq!(
                (
                    info.num_owner_rrefs,
                    info.num_forks,
                    info.num_pending_children
                ),
                (1, 0, 0),
                "{info:?}"
            );
            drop((user, own));
            eventually(Duration::from_secs(5), || {
                Ok(debug_counts(1)? == (0, 0, 0, 0) && debug_counts(0)? == (0, 0, 0, 0))
            })?;
        }
        barrier("done")?;
        let t0 = Instant::now();
        rpc::shutdown(true)?;
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "shutdown took {:?}",
            t0.elapsed()
        );
        Ok(())
    })?;
    Ok(())
}

/// A → B → A → B ... 64 calls deep with one transport thread per worker: no deadlock.
#[test]
fn world2_deep_pingpong_one_thread() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        rpc::init_rpc(&format!("worker{rank}"), rank, 2, opts(20, 1))?;
        if rank == 0 {
            let t0 = Instant::now();
            let d: u64 = rpc::rpc_sync(1usize, "pingpong", (64u64, 2usize), None)?;
            assert_eq!(d, 64);
            assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        }
        barrier("done")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// `init_rpc` and `shutdown` called from async code (a user's own tokio runtime): a failed
/// initialisation and both kinds of shutdown return instead of panicking ("Cannot drop a
/// runtime in a context where blocking is not allowed").
#[test]
fn world1_init_and_shutdown_from_async_code() -> TestResult {
    spawn(1, |_| -> TestResult {
        register_all();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let mut o = opts(10, 1);
            o.set_device_map(
                "nobody",
                std::collections::HashMap::from([(
                    tensorplay_core::Device::Cpu,
                    tensorplay_core::Device::Cpu,
                )]),
            );
            let e = rpc::init_rpc("me", 0, 1, o).unwrap_err();
            assert!(is_invalid(&e, "device_maps"), "{e:?}");
            assert!(!rpc::is_initialized());
            for graceful in [true, false] {
                rpc::init_rpc("me", 0, 1, opts(10, 1))?;
                let v = rpc::rpc_async::<i64, i64>("me", "double", 21, None)?.await?;
                assert_eq!(v, 42);
                rpc::shutdown(graceful)?;
                assert!(!rpc::is_initialized());
            }
            Ok::<_, rpc::Error>(())
        })?;
        Ok(())
    })?;
    Ok(())
}

/// A graceful shutdown called by a remote function is refused at once (it would wait for the
/// very call running it until the timeout); a non-graceful one closes RPC and the caller gets
/// `WorkerUnreachable`, not a hang.
#[test]
fn world1_shutdown_inside_a_function() -> TestResult {
    spawn(1, |_| -> TestResult {
        register_all();
        rpc::register("shutdown_inside", |graceful: bool| {
            rpc::shutdown(graceful)?;
            Ok(())
        });
        rpc::init_rpc("me", 0, 1, opts(20, 1))?;
        let t0 = Instant::now();
        let e = rpc::rpc_sync::<bool, ()>("me", "shutdown_inside", true, None).unwrap_err();
        assert!(
            matches!(&e, rpc::Error::Remote { worker, kind, message } if worker == "me" && kind == "InvalidArgument" && message.contains("shutdown(true) called by a remote function")),
            "{e:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        assert!(rpc::is_initialized());
        assert_eq!(rpc::rpc_sync::<i64, i64>("me", "double", 2, None)?, 4);
        let t0 = Instant::now();
        let e = rpc::rpc_sync::<bool, ()>("me", "shutdown_inside", false, None).unwrap_err();
        assert!(
            matches!(&e, rpc::Error::WorkerUnreachable { worker, .. } if worker == "me")
                || matches!(&e, rpc::Error::NotInitialized { .. }),
            "{e:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        assert!(!rpc::is_initialized());
        // and RPC starts again
        rpc::init_rpc("me", 0, 1, opts(20, 1))?;
        assert_eq!(rpc::rpc_sync::<i64, i64>("me", "double", 3, None)?, 6);
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// A `then` callback that panics completes its future with an error of kind `Panic`, not with
/// "RPC was shut down" while RPC is running.
#[test]
fn world1_panicking_then_callback() -> TestResult {
    spawn(1, |_| -> TestResult {
        register_all();
        rpc::init_rpc("me", 0, 1, opts(20, 1))?;
        let f = rpc::rpc_async::<u64, u64>("me", "sleep_ms", 100, None)?
            .then(|_| -> rpc::Result<u64> { panic!("callback panics") });
        let e = f.wait().unwrap_err();
        assert!(
            matches!(&e, rpc::Error::Remote { worker, kind, message } if worker == "me" && kind == "Panic" && message.contains("callback panics")),
            "{e:?}"
        );
        assert!(rpc::is_initialized());
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// 300 RRefs dropped right after `remote` (before their confirmation), a third of them also
/// passed to a third worker that drops them at once: every table empties.
#[test]
fn world3_many_rrefs_dropped_at_once() -> TestResult {
    spawn(3, |rank| -> TestResult {
        register_all();
        rpc::register("drop_it", |r: RRef<f64>| Ok(r.rref_id().local_id));
        rpc::init_rpc(&format!("worker{rank}"), rank, 3, opts(20, 2))?;
        if rank == 0 {
            let mut passed = Vec::new();
            for i in 0..300 {
                let r: RRef<f64> = rpc::remote(1usize, "ident", f64::from(i), None)?;
                if i % 3 == 0 {
                    passed.push(rpc::rpc_async::<_, u64>(
                        2usize,
                        "drop_it",
                        r.clone(),
                        None,
                    )?);
                }
                drop(r);
            }
            assert_eq!(rpc::wait_all(passed)?.len(), 100);
            eventually(Duration::from_secs(10), || {
                Ok(debug_counts(1)? == (0, 0, 0, 0)
                    && debug_counts(2)? == (0, 0, 0, 0)
                    && debug_counts(0)? == (0, 0, 0, 0))
            })?;
        }
        barrier("done")?;
        rpc::shutdown(true)?;
        assert!(!rpc::is_initialized());
        Ok(())
    })?;
    Ok(())
}

/// Found by the hostile trial of issue 18, each failing before its fix: an owner's RRef kept by
/// a function that then fails stays usable by the callee (the owner undid its fork on any
/// error, so the value went with the owner's last handle and the callee's `to_here` timed
/// out); an RRef returned to a caller that already timed out does not stay on its owner (its
/// fork was never undone); the owner waits for a value as long as the fetching caller does,
/// not only its own default timeout.
#[test]
fn world2_rrefs_in_failed_and_timed_out_calls() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        rpc::init_rpc(&format!("worker{rank}"), rank, 2, opts(20, 2))?;
        if rank == 0 {
            let zeros = (0, 0, 0, 0);
            // kept by a function that fails
            let own = RRef::new(7.0f64)?;
            let e =
                rpc::rpc_sync::<_, ()>(1usize, "stash_and_fail", own.clone(), None).unwrap_err();
            assert!(matches!(e, rpc::Error::Remote { .. }), "{e:?}");
            drop(own);
            let v: f64 = rpc::rpc_sync(1usize, "stashed_value", (), None)?;
            assert_eq!(v, 7.0, "the stashed RRef lost its value");
            rpc::rpc_sync::<_, ()>(1usize, "clear_stash", (), None)?;
            eventually(Duration::from_secs(5), || {
                Ok(debug_counts(0)? == zeros && debug_counts(1)? == zeros)
            })
            .map_err(|e| format!("after the stash: {e}: {:?}", debug_counts(0)))?;
            // returned to a caller that timed out
            let e = rpc::rpc_sync::<u64, RRef<f64>>(
                1usize,
                "slow_new_rref",
                1500,
                Some(Duration::from_millis(300)),
            )
            .map(|_| ())
            .unwrap_err();
            assert!(matches!(e, rpc::Error::Timeout { .. }), "{e:?}");
            std::thread::sleep(Duration::from_millis(1500));
            eventually(Duration::from_secs(10), || Ok(debug_counts(1)? == zeros))
                .map_err(|e| format!("after the timed-out call: {e}: {:?}", debug_counts(1)))?;
            // the owner waits as long as the caller of to_here, beyond its own default
            rpc::rpc_sync::<u64, ()>(1usize, "set_default_timeout_ms", 300, None)?;
            let r: RRef<u64> =
                rpc::remote(1usize, "sleep_ms", 1200u64, Some(Duration::from_secs(10)))?;
            assert_eq!(r.to_here(Some(Duration::from_secs(10)))?, 1200);
            rpc::rpc_sync::<u64, ()>(1usize, "set_default_timeout_ms", 20_000, None)?;
            drop(r);
            eventually(Duration::from_secs(5), || {
                Ok(debug_counts(0)? == zeros && debug_counts(1)? == zeros)
            })?;
        }
        barrier("done")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// Runs `f` on a thread and fails (instead of hanging the test) when it does not end within
/// `limit`.
fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .map_err(|_| format!("{what} did not end within {limit:?} (deadlock)"))
}

/// Found by the new-user trial of issue 18 (failing before its fix): an RRef whose value holds
/// RRefs owned by the same worker deadlocked that worker when the last handle went, because the
/// owner table dropped the value while locked and the inner handles' drop locked it again. On
/// one worker (`RRef<RRef<f64>>`, `RRef<Vec<RRef<f64>>>`), and across workers (the value made
/// by `remote`, the transport thread of its owner stuck).
#[test]
fn world2_rrefs_holding_rrefs_drop_without_deadlock() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        rpc::init_rpc(&format!("worker{rank}"), rank, 2, opts(20, 2))?;
        if rank == 0 {
            let zeros = (0, 0, 0, 0);
            within(
                Duration::from_secs(5),
                "dropping RRef<RRef<f64>>",
                || -> rpc::Result<()> {
                    let outer = RRef::new(RRef::new(1.0f64)?)?;
                    drop(outer);
                    let list = RRef::new(vec![RRef::new(2.0f64)?, RRef::new(3.0f64)?])?;
                    drop(list);
                    Ok(())
                },
            )??;
            assert_eq!(debug_counts(0)?, zeros);
            let rr: RRef<RRef<f64>> = rpc::remote(1usize, "new_rref", 4.0, None)?;
            assert_eq!(rr.to_here(None)?.to_here(None)?, 4.0);
            drop(rr);
            eventually(Duration::from_secs(5), || Ok(debug_counts(1)? == zeros))?;
            let v: f64 = rpc::rpc_sync(1usize, "ident", 5.0, Some(Duration::from_secs(5)))?;
            assert_eq!(v, 5.0);
        }
        barrier("done")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}
