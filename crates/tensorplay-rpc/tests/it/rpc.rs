//! RPCs between real worker processes (`spawn`, 127.0.0.1) in world sizes 1 to 4: self calls,
//! calls by name, rank and `WorkerInfo`, worker infos and their errors, nested calls back to the
//! caller and chains of 20 nested `rpc_async` hops (with one transport thread too), `then`
//! callbacks that make RPCs, 1000 concurrent calls, tensors of every dtype and layout, and a
//! 64 MiB echo.

use crate::common;

use std::time::Duration;

use common::{TestResult, barrier, opts, register_common};
use tensorplay_collectives::spawn::spawn;
use tensorplay_core::{DType, Tensor};
use tensorplay_rpc::{self as rpc, WorkerInfo};

fn register_all() {
    register_common();
    rpc::register("add", |(a, b): (Tensor, Tensor)| a.add(&b));
    rpc::register("double", |x: i64| Ok(2 * x));
    rpc::register("whoami", |(): ()| Ok(rpc::current_worker()?));
    rpc::register("echo_info", |w: WorkerInfo| Ok(w));
    rpc::register("echo", |t: Tensor| Ok(t));
    rpc::register("echo_many", |v: Vec<Tensor>| Ok(v));
    rpc::register(
        "echo_mixed",
        |v: (String, Tensor, Option<Tensor>, Vec<f64>, bool, ())| Ok(v),
    );
    // a nested call back to the caller
    rpc::register("call_back", |(origin, x): (usize, i64)| {
        let y: i64 = rpc::rpc_sync(origin, "double", x, None)?;
        Ok(y + 1)
    });
    // a chain of nested rpc_async hops around the ring; returns the ranks visited
    rpc::register("hop", |(left, mut path): (u32, Vec<usize>)| {
        let me = rpc::current_worker()?.id;
        path.push(me);
        if left == 0 {
            return Ok(path);
        }
        let n = rpc::get_worker_infos()?.len();
        let next = (me + 1) % n;
        let f = rpc::rpc_async::<_, Vec<usize>>(next, "hop", (left - 1, path), None)?;
        Ok(f.wait()?)
    });
}

fn ones22() -> Tensor {
    Tensor::from_vec(vec![1.0f32; 4], &[2, 2]).unwrap()
}

/// Checks the result of a 20-hop chain started on `start` in a world of `n`.
fn check_chain(path: &[usize], start: usize, n: usize) {
    assert_eq!(path.len(), 21, "{path:?}");
    for (i, r) in path.iter().enumerate() {
        assert_eq!(*r, (start + i) % n, "{path:?}");
    }
}

#[test]
fn world1_self_calls() -> TestResult {
    spawn(1, |_| -> TestResult {
        register_all();
        rpc::init_rpc("me", 0, 1, opts(20, 4))?;
        let me = rpc::current_worker()?;
        assert_eq!(
            me,
            WorkerInfo {
                name: "me".into(),
                id: 0
            }
        );
        assert_eq!(rpc::get_worker_infos()?, vec![me.clone()]);
        let x = ones22();
        // by name, rank, WorkerInfo (borrowed and owned)
        let by_name: Tensor = rpc::rpc_sync("me", "add", (x.clone(), x.clone()), None)?;
        let by_rank: Tensor = rpc::rpc_sync(0usize, "add", (x.clone(), x.clone()), None)?;
        let by_info: Tensor = rpc::rpc_sync(&me, "add", (x.clone(), x.clone()), None)?;
        let by_info2: Tensor =
            rpc::rpc_async(me.clone(), "add", (x.clone(), x.clone()), None)?.wait()?;
        for t in [by_name, by_rank, by_info, by_info2] {
            assert_eq!(t.shape(), &[2, 2]);
            assert_eq!(t.to_vec::<f32>()?, vec![2.0; 4]);
        }
        // WorkerInfo travels and compares equal
        let back: WorkerInfo = rpc::rpc_sync("me", "echo_info", me.clone(), None)?;
        assert_eq!(back, me);
        let who: WorkerInfo = rpc::rpc_sync(0usize, "whoami", (), None)?;
        assert_eq!(who, me);
        // worker infos and their errors
        assert_eq!(rpc::get_worker_info("me")?, me);
        assert_eq!(rpc::get_worker_info(0usize)?, me);
        let e = rpc::get_worker_info("nobody").unwrap_err();
        assert!(
            matches!(&e, rpc::Error::UnknownWorker { name, known } if name.contains("nobody") && known.contains("me")),
            "{e:?}"
        );
        let e = rpc::get_worker_info(1usize).unwrap_err();
        assert!(
            matches!(&e, rpc::Error::UnknownWorker { name, .. } if name.contains('1')),
            "{e:?}"
        );
        let e = rpc::rpc_sync::<i64, i64>(5usize, "double", 1, None).unwrap_err();
        assert!(matches!(e, rpc::Error::UnknownWorker { .. }), "{e:?}");
        let e = rpc::rpc_async::<i64, i64>("worker0", "double", 1, None)
            .err()
            .unwrap();
        assert!(matches!(e, rpc::Error::UnknownWorker { .. }), "{e:?}");
        // remote to oneself: an owner RRef
        let r: rpc::RRef<Tensor> = rpc::remote("me", "add", (x.clone(), x.clone()), None)?;
        assert!(r.is_owner());
        assert!(r.confirmed_by_owner());
        assert_eq!(r.owner(), me);
        assert_eq!(r.to_here(None)?.to_vec::<f32>()?, vec![2.0; 4]);
        assert_eq!(r.local_value()?.to_vec::<f32>()?, vec![2.0; 4]);
        // nested calls to oneself and a 20-hop chain
        assert_eq!(
            rpc::rpc_sync::<_, i64>("me", "call_back", (0usize, 5i64), None)?,
            11
        );
        let path: Vec<usize> = rpc::rpc_sync("me", "hop", (20u32, Vec::<usize>::new()), None)?;
        check_chain(&path, 0, 1);
        drop(r);
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// Calls between four workers: every form of destination, nested calls, 20-hop chains from
/// every worker at once, 1000 concurrent calls from every worker, `then` callbacks.
#[test]
fn world4_calls_nested_and_concurrent() -> TestResult {
    spawn(4, |rank| -> TestResult {
        register_all();
        rpc::init_rpc(&format!("worker{rank}"), rank, 4, opts(30, 4))?;
        let n = 4;
        let next = (rank + 1) % n;
        let infos = rpc::get_worker_infos()?;
        assert_eq!(infos.len(), 4);
        for (i, w) in infos.iter().enumerate() {
            assert_eq!(w.id, i);
            assert_eq!(w.name, format!("worker{i}"));
        }
        let me = rpc::current_worker()?;
        assert_eq!(me, infos[rank]);
        assert_eq!(rpc::get_worker_info(format!("worker{next}"))?, infos[next]);
        let e = rpc::get_worker_info("worker4").unwrap_err();
        assert!(matches!(e, rpc::Error::UnknownWorker { .. }), "{e:?}");
        let e = rpc::get_worker_info(4usize).unwrap_err();
        assert!(matches!(e, rpc::Error::UnknownWorker { .. }), "{e:?}");
        let e = rpc::remote::<i64, i64>(usize::MAX, "double", 1, None)
            .err()
            .unwrap();
        assert!(matches!(e, rpc::Error::UnknownWorker { .. }), "{e:?}");

        // n = rank + 1: ones(n, n) + ones(n, n) on every other worker, every way of naming it
        let k = rank + 1;
        let x = Tensor::from_vec(vec![1.0f32; k * k], &[k, k])?;
        for dst in 0..n {
            let info = rpc::get_worker_info(dst)?;
            let outs: Vec<Tensor> = vec![
                rpc::rpc_sync(info.name.as_str(), "add", (x.clone(), x.clone()), None)?,
                rpc::rpc_sync(dst, "add", (x.clone(), x.clone()), None)?,
                rpc::rpc_sync(&info, "add", (x.clone(), x.clone()), None)?,
                rpc::rpc_async(info.clone(), "add", (x.clone(), x.clone()), None)?.wait()?,
                rpc::remote(&info, "add", (x.clone(), x.clone()), None)?.to_here(None)?,
            ];
            for t in outs {
                assert_eq!(t.shape(), &[k, k]);
                assert_eq!(t.to_vec::<f32>()?, vec![2.0; k * k]);
            }
            // the callee is the worker asked for, and WorkerInfo round-trips
            let who: WorkerInfo = rpc::rpc_sync(dst, "whoami", (), None)?;
            assert_eq!(who, info);
            let back: WorkerInfo = rpc::rpc_sync(dst, "echo_info", me.clone(), None)?;
            assert_eq!(back, me);
            // a nested call back to this worker
            let y: i64 = rpc::rpc_sync(dst, "call_back", (rank, 10 * rank as i64), None)?;
            assert_eq!(y, 20 * rank as i64 + 1);
        }
        // a 20-hop chain of nested rpc_async calls, started on every worker at once
        let path: Vec<usize> = rpc::rpc_sync(next, "hop", (20u32, Vec::<usize>::new()), None)?;
        check_chain(&path, next, n);

        // 1000 concurrent calls from every worker, spread over all workers, all answered
        let futs = (0..1000i64)
            .map(|i| {
                rpc::rpc_async::<i64, i64>(i as usize % n, "double", i * 7 + rank as i64, None)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let outs = rpc::wait_all(futs)?;
        assert_eq!(outs.len(), 1000);
        for (i, v) in outs.iter().enumerate() {
            assert_eq!(*v, 2 * (i as i64 * 7 + rank as i64));
        }

        // then callbacks: plain, chained, and one that itself makes an RPC
        let f = rpc::rpc_async::<i64, i64>(next, "double", 3, None)?
            .then(|r| r.map(|v| v + 1))
            .then(|r| r.map(|v| v * 10));
        assert_eq!(f.wait()?, 70);
        let f = rpc::rpc_async::<i64, i64>(next, "double", 3, None)?
            .then(move |r| rpc::rpc_sync::<i64, i64>(next, "double", r?, None));
        match f.wait_timeout(Duration::from_secs(20)) {
            Ok(v) => assert_eq!(v?, 12),
            Err(_) => panic!("a then-callback making an RPC did not complete"),
        }
        barrier("done")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

/// One transport thread per worker: nested calls, chains from every worker at once, and
/// callbacks making RPCs must still complete (a thread pool that deadlocks is what PyTorch's
/// users reported).
#[test]
fn world3_one_worker_thread_never_deadlocks() -> TestResult {
    spawn(3, |rank| -> TestResult {
        register_all();
        rpc::init_rpc(&format!("worker{rank}"), rank, 3, opts(30, 1))?;
        let n = 3;
        let next = (rank + 1) % n;
        // nested calls back to the caller, many at once
        let futs = (0..50i64)
            .map(|i| rpc::rpc_async::<_, i64>(next, "call_back", (rank, i), None))
            .collect::<Result<Vec<_>, _>>()?;
        for (i, v) in rpc::wait_all(futs)?.into_iter().enumerate() {
            assert_eq!(v, 2 * i as i64 + 1);
        }
        // several 20-hop chains from every worker at once
        let chains = (0..4)
            .map(|_| {
                rpc::rpc_async::<_, Vec<usize>>(next, "hop", (20u32, Vec::<usize>::new()), None)
            })
            .collect::<Result<Vec<_>, _>>()?;
        for p in rpc::wait_all(chains)? {
            check_chain(&p, next, n);
        }
        // callbacks that block on further RPCs, more of them than transport threads
        let futs: Vec<_> = (0..8i64)
            .map(|i| {
                rpc::rpc_async::<i64, i64>(next, "double", i, None)
                    .map(|f| f.then(move |r| rpc::rpc_sync::<i64, i64>(next, "double", r?, None)))
            })
            .collect::<Result<_, _>>()?;
        for (i, f) in futs.into_iter().enumerate() {
            match f.wait_timeout(Duration::from_secs(20)) {
                Ok(v) => assert_eq!(v?, 4 * i as i64),
                Err(_) => panic!("callback {i} making an RPC deadlocked with one worker thread"),
            }
        }
        barrier("done")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}

fn assert_same(a: &Tensor, b: &Tensor) -> TestResult {
    assert_eq!(a.shape(), b.shape());
    assert_eq!(a.dtype(), b.dtype());
    match a.dtype() {
        // bit for bit (NaN included)
        DType::F32 => {
            let bits = |t: &Tensor| {
                t.to_vec::<f32>()
                    .map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            };
            assert_eq!(bits(a)?, bits(b)?);
        }
        DType::F64 => {
            let bits = |t: &Tensor| {
                t.to_vec::<f64>()
                    .map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            };
            assert_eq!(bits(a)?, bits(b)?);
        }
        DType::I64 => assert_eq!(a.to_vec::<i64>()?, b.to_vec::<i64>()?),
        DType::Bool => assert_eq!(a.to_vec::<bool>()?, b.to_vec::<bool>()?),
        DType::BF16 => {
            let bits = |t: &Tensor| {
                t.to_vec::<tensorplay_core::bf16>()
                    .map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            };
            assert_eq!(bits(a)?, bits(b)?);
        }
        DType::F16 => {
            let bits = |t: &Tensor| {
                t.to_vec::<tensorplay_core::f16>()
                    .map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            };
            assert_eq!(bits(a)?, bits(b)?);
        }
    }
    Ok(())
}

/// Tensors of every dtype and of odd shapes and layouts round-trip between two workers, alone,
/// in lists and mixed with other values; a 64 MiB tensor echoes intact.
#[test]
fn world2_tensors_round_trip() -> TestResult {
    spawn(2, |rank| -> TestResult {
        register_all();
        rpc::init_rpc(&format!("worker{rank}"), rank, 2, opts(60, 4))?;
        if rank == 0 {
            let base =
                Tensor::from_vec((0..6).map(|i| i as f32 - 2.5).collect::<Vec<_>>(), &[2, 3])?;
            let transposed = base.t()?;
            assert!(!transposed.is_contiguous());
            let wide = Tensor::from_vec((0..25).map(f64::from).collect::<Vec<_>>(), &[5, 5])?;
            let narrowed = wide.narrow(1, 2, 2)?;
            let cases = vec![
                base.clone(),
                transposed.clone(),
                narrowed.clone(),
                Tensor::from_vec(vec![1.5f64, -0.0, f64::MAX, f64::MIN_POSITIVE], &[4])?,
                Tensor::from_vec(vec![i64::MIN, -1, 0, i64::MAX], &[2, 2])?,
                Tensor::from_vec(vec![true, false, true], &[3])?,
                Tensor::from_vec(Vec::<f32>::new(), &[0])?,
                Tensor::from_vec(Vec::<i64>::new(), &[2, 0, 3])?,
                Tensor::from_vec(Vec::<bool>::new(), &[0, 4])?,
                Tensor::scalar(42.25f64),
                Tensor::from_vec(vec![f32::NAN, f32::INFINITY], &[1, 1, 2])?,
            ];
            for t in &cases {
                let back: Tensor = rpc::rpc_sync(1usize, "echo", t.clone(), None)?;
                assert_same(&back, t)?;
                // (core reports tensors with a 0-sized dimension as non-contiguous)
                assert!(back.is_contiguous() || back.numel() == 0);
            }
            // all at once, the same tensor twice
            let mut many = cases.clone();
            many.push(base.clone());
            let back: Vec<Tensor> = rpc::rpc_sync(1usize, "echo_many", many.clone(), None)?;
            assert_eq!(back.len(), many.len());
            for (a, b) in back.iter().zip(&many) {
                assert_same(a, b)?;
            }
            let empty: Vec<Tensor> =
                rpc::rpc_sync(1usize, "echo_many", Vec::<Tensor>::new(), None)?;
            assert!(empty.is_empty());
            // mixed with other values
            let v = (
                "héllo".to_string(),
                transposed.clone(),
                Some(narrowed.clone()),
                vec![1.0, f64::NEG_INFINITY],
                true,
                (),
            );
            let back: (String, Tensor, Option<Tensor>, Vec<f64>, bool, ()) =
                rpc::rpc_sync(1usize, "echo_mixed", v, None)?;
            assert_eq!(back.0, "héllo");
            assert_same(&back.1, &transposed)?;
            assert_same(back.2.as_ref().unwrap(), &narrowed)?;
            assert_eq!(back.3, vec![1.0, f64::NEG_INFINITY]);
            assert!(back.4);
            // a 64 MiB tensor
            let n = 16 << 20;
            let big = Tensor::from_vec(
                (0..n).map(|i| (i % 1_000_003) as f32).collect::<Vec<_>>(),
                &[n / 1024, 1024],
            )?;
            let t0 = std::time::Instant::now();
            let back: Tensor =
                rpc::rpc_sync(1usize, "echo", big.clone(), Some(Duration::from_secs(60)))?;
            eprintln!("64 MiB echo: {:?}", t0.elapsed());
            assert_same(&back, &big)?;
        }
        barrier("done")?;
        rpc::shutdown(true)?;
        Ok(())
    })?;
    Ok(())
}
