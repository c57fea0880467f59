//! `spawn`: real child processes re-running each test. Code before a `spawn` call also runs in
//! the children, so the tests pass their scratch directory down through an env var.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tensorplay_collectives::spawn::is_spawned_child;
use tensorplay_collectives::{Error, SpawnOptions, spawn, spawn_with};

/// A scratch directory shared by the parent and its children (`TP_TEST_DIR`).
fn shared_dir(tag: &str) -> PathBuf {
    if let Ok(d) = std::env::var("TP_TEST_DIR") {
        return d.into();
    }
    let d = std::env::temp_dir().join(format!("tp-spawn-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn opts(n: usize, dir: &std::path::Path, timeout_s: u64) -> SpawnOptions {
    SpawnOptions {
        nprocs: n,
        timeout: Some(Duration::from_secs(timeout_s)),
        env: vec![("TP_TEST_DIR".into(), dir.display().to_string())],
    }
}

#[test]
fn three_ranks_run_with_their_env() {
    let dir = shared_dir("env");
    spawn_with(opts(3, &dir, 60), |rank| {
        assert!(is_spawned_child());
        let env = |k: &str| std::env::var(k).unwrap_or_default();
        let line = format!(
            "{rank} {} {} {} {} {} {}",
            env("RANK"),
            env("WORLD_SIZE"),
            env("LOCAL_RANK"),
            env("LOCAL_WORLD_SIZE"),
            env("MASTER_ADDR"),
            env("MASTER_PORT")
                .parse::<u16>()
                .map(|_| "port")
                .unwrap_or("bad"),
        );
        std::fs::write(dir.join(format!("rank{rank}")), line)?;
        Ok(())
    })
    .unwrap();
    for r in 0..3 {
        let got = std::fs::read_to_string(dir.join(format!("rank{r}"))).unwrap();
        assert_eq!(got, format!("{r} {r} 3 {r} 3 127.0.0.1 port"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_failing_rank_is_reported_with_its_message() {
    let err = spawn(3, |rank| {
        if rank == 1 {
            return Err("rank one failed on purpose".into());
        }
        Ok(())
    })
    .unwrap_err();
    match &err {
        Error::Spawn { rank, reason, .. } => {
            assert_eq!(*rank, 1, "{err}");
            assert!(reason.contains("rank one failed on purpose"), "{err}");
            assert!(reason.contains("code 1"), "{err}");
        }
        other => panic!("expected Spawn, got {other}"),
    }
}

/// The failure line is found whole while the child writes partial lines to stdout at the same
/// time (as libtest's progress output does): output is merged line by line, never mid-line.
#[test]
fn a_failing_rank_is_reported_while_stdout_is_busy() {
    let err = spawn(2, |rank| {
        if rank == 1 {
            use std::io::Write;
            let noisy = std::thread::spawn(|| {
                for _ in 0..2000 {
                    let mut out = std::io::stdout().lock();
                    let _ = out.write_all(b"partial-");
                    let _ = out.flush();
                }
            });
            std::thread::sleep(Duration::from_millis(2));
            let e: Result<(), Box<dyn std::error::Error + Send + Sync>> =
                Err("rank one failed while stdout was busy".into());
            let _ = noisy.join();
            return e;
        }
        Ok(())
    })
    .unwrap_err();
    match &err {
        Error::Spawn { rank, reason, .. } => {
            assert_eq!(*rank, 1, "{err}");
            assert!(
                reason.contains("rank one failed while stdout was busy"),
                "{err}"
            );
        }
        other => panic!("expected Spawn, got {other}"),
    }
}

/// A failure message is found after a partial line on stderr (a progress bar, `eprint!`), and
/// a child that prints megabytes leaves only the last 64 KiB or so in the report.
#[test]
fn a_failure_after_a_partial_line_and_much_output_is_reported() {
    let err = spawn(2, |rank| {
        if rank == 1 {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            for i in 0..40_000 {
                writeln!(out, "line {i} of much output")?;
            }
            drop(out);
            eprint!("progress 42%\r");
            return Err("rank one failed after a progress bar".into());
        }
        Ok(())
    })
    .unwrap_err();
    match &err {
        Error::Spawn {
            rank,
            reason,
            output,
        } => {
            assert_eq!(*rank, 1, "{reason}");
            assert!(
                reason.contains("rank one failed after a progress bar"),
                "{reason}"
            );
            assert!(output.len() < 80 * 1024, "{} bytes kept", output.len());
            assert!(output.starts_with("[... output truncated ...]"), "{reason}");
        }
        other => panic!("expected Spawn, got {other}"),
    }
}

#[test]
fn crate_errors_propagate_with_question_mark() {
    let err = spawn(2, |rank| {
        if rank == 0 {
            Err(Error::Store("custom store failure".into()))?;
        }
        Ok(())
    })
    .unwrap_err();
    assert!(matches!(&err, Error::Spawn { rank: 0, .. }), "{err}");
    assert!(err.to_string().contains("custom store failure"), "{err}");
}

#[test]
fn a_panicking_rank_is_reported_with_the_panic_text() {
    let err = spawn(3, |rank| {
        if rank == 2 {
            panic!("boom from rank two");
        }
        Ok(())
    })
    .unwrap_err();
    match &err {
        Error::Spawn {
            rank,
            reason,
            output,
        } => {
            assert_eq!(*rank, 2, "{err}");
            // the reason quotes the panic with its location; the output does not repeat it
            assert!(
                reason.contains(concat!("panicked at ", file!(), ":")),
                "{err}"
            );
            assert!(reason.contains("boom from rank two"), "{err}");
            assert!(!output.contains("boom from rank two"), "{err}");
        }
        other => panic!("expected Spawn, got {other}"),
    }
}

#[test]
fn a_hanging_rank_is_killed_by_the_overall_timeout() {
    let dir = shared_dir("hang");
    let start = Instant::now();
    let err = spawn_with(opts(3, &dir, 3), |rank| {
        if rank == 1 {
            std::thread::sleep(Duration::from_secs(60));
        }
        Ok(())
    })
    .unwrap_err();
    let took = start.elapsed();
    assert!(took >= Duration::from_secs(3), "{took:?}");
    assert!(took < Duration::from_secs(15), "{took:?}");
    match &err {
        Error::Spawn { rank, reason, .. } => {
            assert_eq!(*rank, 1, "{err}");
            assert!(reason.contains("timed out after 3"), "{err}");
        }
        other => panic!("expected Spawn, got {other}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// As `torch.multiprocessing.spawn`, `spawn` has no overall timeout by default: the same job
/// (ranks that take 3 s) is killed under a configured 1 s limit and completes with the
/// default options.
#[test]
fn spawn_has_no_default_timeout() {
    assert_eq!(SpawnOptions::new(2).timeout, None);
    let dir = shared_dir("no-timeout");
    let job = |rank: usize| -> Result<(), tensorplay_collectives::SpawnError> {
        std::thread::sleep(Duration::from_secs(3));
        std::fs::write(dir.join(format!("done{rank}")), "x")?;
        Ok(())
    };
    // (case, options, whether the job must complete)
    let cases = [
        (
            "a configured 1 s limit",
            SpawnOptions {
                timeout: Some(Duration::from_secs(1)),
                ..opts(2, &dir, 1)
            },
            false,
        ),
        (
            "the default options",
            SpawnOptions {
                env: opts(2, &dir, 1).env,
                ..SpawnOptions::new(2)
            },
            true,
        ),
    ];
    for (case, o, completes) in cases {
        if !is_spawned_child() {
            for r in 0..2 {
                let _ = std::fs::remove_file(dir.join(format!("done{r}")));
            }
        }
        let start = Instant::now();
        let r = spawn_with(o, job);
        let took = start.elapsed();
        if is_spawned_child() {
            // the second case's children pass the first call (it returns Ok at once there)
            continue;
        }
        match (r, completes) {
            (Ok(()), true) => {
                assert!(took >= Duration::from_secs(3), "{case}: {took:?}");
                for rank in 0..2 {
                    assert!(dir.join(format!("done{rank}")).exists(), "{case}: {rank}");
                }
            }
            (Err(Error::Spawn { reason, .. }), false) => {
                // killed before they finished: they never wrote their files
                assert!(
                    reason.contains("timed out after 1.0s, the timeout set in SpawnOptions"),
                    "{case}: {reason}"
                );
                for rank in 0..2 {
                    assert!(!dir.join(format!("done{rank}")).exists(), "{case}: {rank}");
                }
            }
            (r, _) => panic!("{case}: {r:?}"),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(unix)]
#[test]
fn an_aborting_rank_is_reported_with_its_signal() {
    let err = spawn(2, |rank| {
        if rank == 0 {
            std::process::abort();
        }
        Ok(())
    })
    .unwrap_err();
    match &err {
        Error::Spawn { rank, reason, .. } => {
            assert_eq!(*rank, 0, "{err}");
            assert!(reason.contains("signal 6"), "{err}");
            assert!(reason.contains("SIGABRT"), "{err}");
        }
        other => panic!("expected Spawn, got {other}"),
    }
}

#[test]
fn other_ranks_are_killed_when_one_fails() {
    let dir = shared_dir("kill");
    let start = Instant::now();
    let err = spawn_with(opts(3, &dir, 120), |rank| {
        if rank == 0 {
            std::thread::sleep(Duration::from_millis(200));
            return Err("rank zero gives up".into());
        }
        std::thread::sleep(Duration::from_secs(30));
        std::fs::write(dir.join(format!("finished{rank}")), "x")?;
        Ok(())
    })
    .unwrap_err();
    let took = start.elapsed();
    assert!(took < Duration::from_secs(15), "{took:?}");
    assert!(matches!(&err, Error::Spawn { rank: 0, .. }), "{err}");
    std::thread::sleep(Duration::from_millis(200));
    for r in 1..3 {
        assert!(!dir.join(format!("finished{r}")).exists());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn zero_processes_is_an_invalid_argument() {
    assert!(matches!(
        spawn(0, |_| Ok(())),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn nested_spawn_runs_grandchildren() {
    let dir = shared_dir("nested");
    spawn_with(opts(2, &dir, 60), |outer| {
        let d = dir.clone();
        spawn_with(opts(2, &d, 60), |inner| {
            std::fs::write(d.join(format!("n{outer}{inner}")), "x")?;
            Ok(())
        })?;
        Ok(())
    })
    .unwrap();
    for o in 0..2 {
        for i in 0..2 {
            assert!(dir.join(format!("n{o}{i}")).exists(), "n{o}{i}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_second_spawn_call_runs_its_own_function() {
    // a program may call spawn several times, as with mp.spawn: the children of the second call
    // ran the first call's function once (a new user's program), silently
    let dir = shared_dir("twice");
    let log = |rank: usize, what: &str| -> Result<(), std::io::Error> {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("log{rank}")))?;
        writeln!(f, "{what}")
    };
    spawn_with(opts(2, &dir, 60), |rank| Ok(log(rank, "first")?)).unwrap();
    spawn_with(opts(2, &dir, 60), |rank| Ok(log(rank, "second")?)).unwrap();
    spawn_with(opts(1, &dir, 60), |rank| Ok(log(rank, "third")?)).unwrap();
    for (rank, want) in [(0, "first\nsecond\nthird\n"), (1, "first\nsecond\n")] {
        let got = std::fs::read_to_string(dir.join(format!("log{rank}"))).unwrap_or_default();
        assert_eq!(
            got, want,
            "rank {rank}: the functions its processes ran, in order"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
