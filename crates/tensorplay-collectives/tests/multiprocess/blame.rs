//! Failure attribution in real processes, each case repeated (the races it guards against
//! are timing-dependent): a rank SIGKILLed while the others wait for it in a collective is the
//! rank `spawn` blames, never a survivor that reported it; a rank that never arrives at
//! rendezvous is named by every rank that waited, also after the store's host left.

use std::time::Duration;

use tensorplay_collectives::{self as dist, InitOptions, ReduceOp, SpawnOptions};
use tensorplay_core::{DType, Tensor};

use super::TestResult;

/// How many times each case runs.
const RUNS: usize = 20;

fn init(timeout: Duration) -> dist::Result<()> {
    dist::init_process_group(
        "cpu",
        InitOptions {
            timeout,
            ..Default::default()
        },
    )
}

#[test]
fn a_killed_rank_is_blamed_not_the_survivors() -> TestResult {
    for run in 0..RUNS {
        let opts = SpawnOptions {
            timeout: Some(Duration::from_secs(60)),
            env: vec![("TENSORPLAY_SPAWN_VERBOSE".into(), "0".into())],
            ..SpawnOptions::new(3)
        };
        let r = dist::spawn_with(opts, |rank| -> TestResult {
            init(Duration::from_secs(10))?;
            dist::barrier(None)?;
            if rank == 2 {
                // SAFETY: signals this very process; nothing runs after it.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
            let t = Tensor::ones(&[1000], DType::F32)?;
            dist::all_reduce(&t, ReduceOp::Sum, None)?;
            Ok(())
        });
        if dist::spawn::is_spawned_child() {
            // the children of run k pass runs 0..k (spawn returns Ok there): parent-only check
            continue;
        }
        match r {
            Err(dist::Error::Spawn {
                rank: 2, reason, ..
            }) => {
                assert!(reason.contains("signal 9"), "run {run}: {reason}");
                // the survivors' recorders show the operation in flight when it died
                assert!(
                    reason.contains("failed in #1 all_reduce"),
                    "run {run}: {reason}"
                );
                assert!(reason.contains("rank 2: no dump"), "run {run}: {reason}");
            }
            other => return Err(format!("run {run}: expected rank 2 blamed, got {other:?}").into()),
        }
    }
    Ok(())
}

#[test]
fn a_rank_that_never_arrives_is_named_by_every_rank() -> TestResult {
    for run in 0..RUNS / 2 {
        let opts = SpawnOptions {
            timeout: Some(Duration::from_secs(60)),
            env: vec![("TENSORPLAY_SPAWN_VERBOSE".into(), "0".into())],
            ..SpawnOptions::new(3)
        };
        dist::spawn_with(opts, |rank| -> TestResult {
            if rank == 2 {
                return Ok(()); // never calls init_process_group
            }
            let e = init(Duration::from_millis(1500)).unwrap_err().to_string();
            if !(e.contains("missing ranks: 2") || e.contains("before ranks 2 arrived")) {
                return Err(format!("rank {rank} does not name rank 2: {e}").into());
            }
            assert!(!e.contains("rank -1"), "{e}");
            Ok(())
        })
        .map_err(|e| format!("run {run}: {e}"))?;
    }
    Ok(())
}

/// A rank that skips one collective: the job fails in time, and the flight-recorder diagnosis
/// in `spawn`'s error names the skipping rank, the operation and its call site.
#[test]
fn a_skipped_collective_is_diagnosed_by_the_flight_recorder() -> TestResult {
    let opts = SpawnOptions {
        timeout: Some(Duration::from_secs(60)),
        env: vec![("TENSORPLAY_SPAWN_VERBOSE".into(), "0".into())],
        ..SpawnOptions::new(3)
    };
    let r = dist::spawn_with(opts, |rank| -> TestResult {
        init(Duration::from_secs(3))?;
        let t = Tensor::ones(&[8], DType::F32)?;
        dist::all_reduce(&t, ReduceOp::Sum, None)?;
        if rank == 2 {
            // skips the next collective, and lives on long enough to be asked for its recorder
            std::thread::sleep(Duration::from_secs(8));
            return Ok(());
        }
        dist::all_reduce(&t, ReduceOp::Sum, None)?; // the call the others wait in
        Ok(())
    });
    let Err(dist::Error::Spawn { rank, reason, .. }) = r else {
        return Err(format!("expected the job to fail, got {r:?}").into());
    };
    // the rank the others waited for is named first, not the first to time out
    assert_eq!(rank, 2, "{reason}");
    assert!(
        reason.starts_with("was still running when rank "),
        "{reason}"
    );
    assert!(!reason.contains("shared-memory"), "{reason}");
    assert!(reason.contains("flight recorder:"), "{reason}");
    assert!(
        reason.contains("operation #1 all_reduce (called at "),
        "{reason}"
    );
    assert!(
        reason.contains("multiprocess/blame.rs:"),
        "the call site: {reason}"
    );
    assert!(
        reason.contains("rank 2 never called #1 all_reduce: it is behind"),
        "{reason}"
    );
    assert!(
        reason.contains("rank 0 failed in #1 all_reduce"),
        "{reason}"
    );
    assert!(!reason.contains("rank -1"), "{reason}");
    Ok(())
}

/// A rank that returns early (exit code 0) while the others still expect it in a collective:
/// it is named first, though it did not fail.
#[test]
fn a_rank_that_exits_early_with_success_is_named() -> TestResult {
    let opts = SpawnOptions {
        timeout: Some(Duration::from_secs(60)),
        env: vec![("TENSORPLAY_SPAWN_VERBOSE".into(), "0".into())],
        ..SpawnOptions::new(3)
    };
    let r = dist::spawn_with(opts, |rank| -> TestResult {
        init(Duration::from_secs(10))?;
        let t = Tensor::ones(&[8], DType::F32)?;
        dist::all_reduce(&t, ReduceOp::Sum, None)?;
        if rank == 1 {
            return Ok(()); // leaves without the second all_reduce
        }
        dist::all_reduce(&t, ReduceOp::Sum, None)?;
        Ok(())
    });
    let Err(dist::Error::Spawn { rank, reason, .. }) = r else {
        return Err(format!("expected the job to fail, got {r:?}").into());
    };
    assert_eq!(rank, 1, "{reason}");
    assert!(
        reason.starts_with("exited with code 0 while rank "),
        "{reason}"
    );
    assert!(!reason.contains("rank -1"), "{reason}");
    Ok(())
}

/// One rank's bad argument fails the call on every rank; the job's error names that rank,
/// not a rank that only reports it (10 runs).
#[test]
fn a_rank_with_a_bad_argument_is_blamed_not_the_ranks_that_report_it() -> TestResult {
    for run in 0..10 {
        let opts = SpawnOptions {
            timeout: Some(Duration::from_secs(60)),
            env: vec![("TENSORPLAY_SPAWN_VERBOSE".into(), "0".into())],
            ..SpawnOptions::new(3)
        };
        let r = dist::spawn_with(opts, |rank| -> TestResult {
            init(Duration::from_secs(10))?;
            let t = Tensor::ones(&[8], DType::F32)?;
            dist::broadcast(&t, if rank == 1 { 99 } else { 0 }, None)?;
            Ok(())
        });
        if dist::spawn::is_spawned_child() {
            // the children of run k pass runs 0..k (spawn returns Ok there): parent-only check
            continue;
        }
        let Err(dist::Error::Spawn { rank, reason, .. }) = r else {
            return Err(format!("run {run}: expected the job to fail, got {r:?}").into());
        };
        assert_eq!(rank, 1, "run {run}: {reason}");
        assert!(reason.contains("src"), "run {run}: {reason}");
    }
    Ok(())
}

/// The store's host (rank 0) frozen by SIGSTOP while the others wait for it in a collective:
/// asking for flight-recorder dumps through its store must not hold their timeouts back, and
/// the job names rank 0 (still running, not answering).
#[test]
fn a_frozen_store_host_does_not_stretch_the_timeout() -> TestResult {
    let opts = SpawnOptions {
        timeout: Some(Duration::from_secs(60)),
        env: vec![("TENSORPLAY_SPAWN_VERBOSE".into(), "0".into())],
        ..SpawnOptions::new(3)
    };
    let start = std::time::Instant::now();
    let r = dist::spawn_with(opts, |rank| -> TestResult {
        init(Duration::from_secs(5))?;
        dist::barrier(None)?;
        if rank == 0 {
            // SAFETY: stops this process; spawn kills it when the job ends
            unsafe { libc::raise(libc::SIGSTOP) };
        }
        let t = Tensor::ones(&[8], DType::F32)?;
        dist::all_reduce(&t, ReduceOp::Sum, None)?;
        Ok(())
    });
    let took = start.elapsed();
    let Err(dist::Error::Spawn { rank, reason, .. }) = r else {
        return Err(format!("expected the job to fail, got {r:?}").into());
    };
    assert_eq!(rank, 0, "{reason}");
    // the 5 s timeout, at most 2 s of asking for dumps, spawn's 1.5 s grace: about 8.5 s
    // (measured); asking without a bound added two store timeouts on top (about 16.5 s)
    assert!(took < Duration::from_secs(13), "took {took:?}: {reason}");
    Ok(())
}
