//! How a main job's process joins its job: under a launcher (`tensorplay-run`, torchrun's,
//! Slurm's or Open MPI's variables) it takes its rank from the environment; started by hand it
//! is rank 0 and starts the other ranks as processes of itself, watches them while the job runs
//! (a rank that dies stops the job at once, naming that rank, instead of leaving rank 0 to wait
//! out its collective timeout) and joins them at the end (a rank that does not exit is stopped).

use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// How long the ranks rank 0 started may take to exit once rank 0 has finished its part.
const EXIT_GRACE_OK: Duration = Duration::from_secs(60);
/// The same once rank 0 has failed (the others are then usually failing too, or stuck).
const EXIT_GRACE_ERR: Duration = Duration::from_secs(10);
/// How long the watcher lets rank 0 reach [`join`] itself after another rank failed, so that
/// rank 0's own error, when it has one, is the one reported.
const REPORT_GRACE: Duration = Duration::from_secs(3);

/// This process's rank, once [`launch`] has decided it.
static RANK: OnceLock<usize> = OnceLock::new();

/// The other ranks' processes, when this process started them (rank 0 started by hand).
pub struct Ranks {
    children: Arc<Mutex<Vec<(usize, Child)>>>,
    joining: Arc<AtomicBool>,
    watcher: Option<JoinHandle<()>>,
}

impl Ranks {
    fn none() -> Ranks {
        Ranks {
            children: Arc::default(),
            joining: Arc::default(),
            watcher: None,
        }
    }

    /// Watches `children` every 100 ms; when one exits unsuccessfully before rank 0 reaches
    /// [`join`], `on_failure` runs with its rank and status (in the job: stop the others, report,
    /// exit).
    fn watch(children: Vec<(usize, Child)>, on_failure: fn(usize, ExitStatus)) -> Ranks {
        let children = Arc::new(Mutex::new(children));
        let joining = Arc::new(AtomicBool::new(false));
        let (c, j) = (Arc::clone(&children), Arc::clone(&joining));
        let watcher = thread::spawn(move || {
            while !j.load(Ordering::Acquire) {
                let failed = first_failure(&mut c.lock().unwrap_or_else(PoisonError::into_inner));
                if let Some((rank, status)) = failed {
                    let since = Instant::now();
                    while since.elapsed() < REPORT_GRACE {
                        if j.load(Ordering::Acquire) {
                            return;
                        }
                        thread::sleep(Duration::from_millis(20));
                    }
                    kill_all(&mut c.lock().unwrap_or_else(PoisonError::into_inner));
                    on_failure(rank, status);
                    return;
                }
                thread::sleep(Duration::from_millis(100));
            }
        });
        Ranks {
            children,
            joining,
            watcher: Some(watcher),
        }
    }
}

/// The first of `children` that has exited unsuccessfully, with its status.
fn first_failure(children: &mut [(usize, Child)]) -> Option<(usize, ExitStatus)> {
    children
        .iter_mut()
        .find_map(|(rank, c)| match c.try_wait() {
            Ok(Some(s)) if !s.success() => Some((*rank, s)),
            _ => None,
        })
}

fn kill_all(children: &mut [(usize, Child)]) {
    for (_, c) in children {
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn stop_job(rank: usize, status: ExitStatus) {
    eprintln!(
        "error on rank 0: rank {rank} failed ({status}) while the job ran; stopped the others"
    );
    std::process::exit(1);
}

/// This process's `(rank, init method, the ranks it started)` in a job of exactly `world`
/// processes.
///
/// Errors: `RANK` or `WORLD_SIZE` that is not a number, a `WORLD_SIZE` other than `world`, a
/// `RANK` outside `0..world`, or a child that cannot be started.
pub fn launch(world: usize) -> Res<(usize, String, Ranks)> {
    let var = |n: &str| tensorplay::distributed::launch_env::lookup_env(n).map(|f| f.value);
    match (var("RANK"), var("WORLD_SIZE")) {
        (Some(r), Some(w)) => {
            let rank: usize = r.parse().map_err(|e| format!("bad RANK {r:?}: {e}"))?;
            let size: usize = w
                .parse()
                .map_err(|e| format!("bad WORLD_SIZE {w:?}: {e}"))?;
            if size != world {
                return Err(format!(
                    "this job runs on exactly {world} processes, WORLD_SIZE is {size}"
                )
                .into());
            }
            if rank >= world {
                return Err(format!("RANK is {rank}, expected 0 to {}", world - 1).into());
            }
            let _ = RANK.set(rank);
            Ok((rank, "env://".into(), Ranks::none()))
        }
        _ => {
            let _ = RANK.set(0);
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let exe = std::env::current_exe()?;
            let mut children = Vec::new();
            for rank in 1..world {
                let child = Command::new(&exe)
                    .args(std::env::args().skip(1))
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", world.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .spawn();
                match child {
                    Ok(c) => children.push((rank, c)),
                    Err(e) => {
                        kill_all(&mut children);
                        return Err(format!("starting rank {rank}: {e}").into());
                    }
                }
            }
            Ok((
                0,
                format!("tcp://127.0.0.1:{port}"),
                Ranks::watch(children, stop_job),
            ))
        }
    }
}

/// Joins the ranks rank 0 started and returns `result`, rank 0's own: an error when a rank
/// failed or had to be stopped (it gets 60 s to exit after rank 0 succeeded, 10 s after rank 0
/// failed), naming that rank; rank 0's own error comes first.
pub fn join<T>(ranks: Ranks, result: Res<T>) -> Res<T> {
    let grace = if result.is_ok() {
        EXIT_GRACE_OK
    } else {
        EXIT_GRACE_ERR
    };
    join_within(ranks, result, grace)
}

fn join_within<T>(mut ranks: Ranks, result: Res<T>, grace: Duration) -> Res<T> {
    ranks.joining.store(true, Ordering::Release);
    if let Some(w) = ranks.watcher.take() {
        let _ = w.join();
    }
    let children = std::mem::take(
        &mut *ranks
            .children
            .lock()
            .unwrap_or_else(PoisonError::into_inner),
    );
    let deadline = Instant::now() + grace;
    let mut failed = None;
    for (rank, mut c) in children {
        let problem = loop {
            match c.try_wait() {
                Ok(Some(s)) if s.success() => break None,
                Ok(Some(s)) => break Some(format!("rank {rank} failed: {s}")),
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(20)),
                Ok(None) => {
                    let _ = c.kill();
                    let _ = c.wait();
                    break Some(format!(
                        "rank {rank} had not exited {} s after rank 0 finished; stopped it",
                        grace.as_secs_f64()
                    ));
                }
                Err(e) => break Some(format!("rank {rank}: waiting for it: {e}")),
            }
        };
        failed = failed.or(problem);
    }
    match (result, failed) {
        (Ok(_), Some(f)) => Err(f.into()),
        (Err(e), Some(f)) => Err(format!("{e} (and {f})").into()),
        (r, None) => r,
    }
}

/// Prints `e` to stderr, naming this process's rank when [`launch`] decided it.
pub fn report(e: &dyn std::fmt::Display) {
    match RANK.get() {
        Some(rank) => eprintln!("error on rank {rank}: {e}"),
        None => eprintln!("error: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn sh(script: &str) -> Child {
        Command::new("sh").args(["-c", script]).spawn().unwrap()
    }

    #[test]
    fn a_failed_rank_is_found_among_running_ones() {
        let mut children = vec![(1, sh("sleep 30")), (2, sh("exit 3")), (3, sh("exit 0"))];
        let since = Instant::now();
        let found = loop {
            if let Some(f) = first_failure(&mut children) {
                break f;
            }
            assert!(since.elapsed() < Duration::from_secs(20), "exit 3 not seen");
            thread::sleep(Duration::from_millis(10));
        };
        assert_eq!((found.0, found.1.code()), (2, Some(3)));
        kill_all(&mut children);
        // the watcher acts on it while rank 0 is still at work, and stops the others
        static SEEN: AtomicUsize = AtomicUsize::new(0);
        let ranks = Ranks::watch(vec![(1, sh("sleep 30")), (2, sh("exit 5"))], |r, s| {
            assert_eq!(s.code(), Some(5));
            SEEN.store(r, Ordering::SeqCst);
        });
        let since = Instant::now();
        while SEEN.load(Ordering::SeqCst) == 0 {
            assert!(
                since.elapsed() < Duration::from_secs(20),
                "rank 2's exit not acted on"
            );
            thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(SEEN.load(Ordering::SeqCst), 2);
        let e = join_within(ranks, Ok(()), Duration::from_secs(20))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("rank 1 failed: signal: 9"), "{e}");
    }

    #[test]
    fn a_rank_that_does_not_exit_is_stopped_and_named() {
        // the hang a stopped (SIGSTOP) rank caused: rank 0 failed, then waited on it forever
        let ranks = Ranks::watch(vec![(1, sh("exit 0")), (2, sh("sleep 30"))], |r, s| {
            panic!("rank {r} reported as failed ({s}) while joining")
        });
        thread::sleep(Duration::from_millis(200));
        let since = Instant::now();
        let e = join_within::<()>(
            ranks,
            Err("collective timed out".into()),
            Duration::from_millis(300),
        )
        .unwrap_err()
        .to_string();
        assert!(since.elapsed() < Duration::from_secs(10), "{e}");
        assert!(
            e.starts_with("collective timed out (and rank 2 had not exited"),
            "{e}"
        );
        // a failure after rank 0 succeeded is an error naming that rank
        let ranks = Ranks::watch(vec![(1, sh("sleep 0.5; exit 4"))], |r, s| {
            panic!("rank {r} reported as failed ({s}) while joining")
        });
        let e = join_within(ranks, Ok(()), Duration::from_secs(20))
            .unwrap_err()
            .to_string();
        assert_eq!(e, "rank 1 failed: exit status: 4");
        let ranks = Ranks::watch(vec![(1, sh("exit 0"))], |_, _| ());
        assert!(join_within(ranks, Ok(()), Duration::from_secs(20)).is_ok());
    }
}
