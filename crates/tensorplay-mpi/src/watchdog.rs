//! Timeouts for calls that have none: an MPI call cannot be cancelled, so a watchdog thread
//! watches every call in flight, and when one runs past its group's timeout it prints the
//! report a `Timeout` error would carry (the call, the rank, and the flight recorder's
//! diagnosis of every rank's dump: who is behind, in which call) and ends the job with
//! `MPI_Abort` and [`TIMEOUT_EXIT_CODE`] (124, as `timeout(1)`); `mpirun` then stops the other ranks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::TIMEOUT_EXIT_CODE;

/// How often the watchdog looks.
const TICK: Duration = Duration::from_millis(100);

struct Call {
    what: String,
    timeout: Duration,
    deadline: Instant,
}

#[derive(Default)]
struct Watchdog {
    calls: Mutex<HashMap<u64, Call>>,
    next: AtomicU64,
}

fn watchdog() -> &'static Watchdog {
    static W: OnceLock<Watchdog> = OnceLock::new();
    W.get_or_init(|| {
        std::thread::Builder::new()
            .name("tensorplay-mpi-watchdog".into())
            .spawn(watch)
            .expect("the watchdog thread starts");
        Watchdog::default()
    })
}

/// A call in flight; dropping it ends the watch.
pub(crate) struct Guard(u64);

impl Drop for Guard {
    fn drop(&mut self) {
        let w = watchdog();
        w.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.0);
    }
}

/// Watches `what` (the call, its group and rank, for the report) for `timeout`.
pub(crate) fn watch_call(what: String, timeout: Duration) -> Guard {
    let w = watchdog();
    let id = w.next.fetch_add(1, Ordering::Relaxed);
    let deadline = Instant::now()
        .checked_add(timeout)
        .unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 24 * 3600));
    w.calls.lock().unwrap_or_else(|e| e.into_inner()).insert(
        id,
        Call {
            what,
            timeout,
            deadline,
        },
    );
    Guard(id)
}

fn watch() {
    loop {
        std::thread::sleep(TICK);
        let expired = {
            let w = watchdog();
            let calls = w.calls.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            calls
                .values()
                .find(|c| c.deadline <= now)
                .map(|c| (c.what.clone(), c.timeout))
        };
        if let Some((what, timeout)) = expired {
            abort(&what, timeout);
        }
    }
}

/// Prints the report and ends the job.
fn abort(what: &str, timeout: Duration) -> ! {
    let mut report = format!(
        "tensorplay mpi backend: {what} ran for more than its timeout ({timeout:?}). An MPI \
         call cannot be cancelled: ending the job with MPI_Abort (exit code \
         {TIMEOUT_EXIT_CODE})."
    );
    match tensorplay_collectives::dump_flight_recorder() {
        Ok(dir) => {
            // the other ranks write theirs when asked; give them a moment
            std::thread::sleep(Duration::from_secs(2));
            match tensorplay_collectives::recorder::read_dumps(&dir) {
                Ok((dumps, _)) => {
                    let d = tensorplay_collectives::recorder::diagnose(&dumps);
                    report.push_str(&format!("\nflight recorder ({}):\n{d}", dir.display()));
                }
                Err(e) => report.push_str(&format!("\nflight recorder: {e}")),
            }
        }
        Err(e) => report.push_str(&format!("\nflight recorder not written: {e}")),
    }
    eprintln!("{report}");
    // SAFETY: MPI is initialised (a watched call runs on one of its communicators) and
    // MPI_Abort may be called from any thread under MPI_THREAD_MULTIPLE; it does not return
    // (the abort below is for an MPI that does).
    unsafe {
        mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, TIMEOUT_EXIT_CODE);
    }
    std::process::abort()
}
