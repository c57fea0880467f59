//! Spawned worlds of real processes.

use std::time::Duration;

use tensorplay_collectives::{self as dist, InitOptions};

/// What a rank's body returns: any error, carried back to the parent by `spawn`.
pub type RankResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Runs `f(rank)` on every rank of a world of `n` processes started by `spawn` (this test
/// binary again), each with the default process group on the "cpu" backend (collective timeout
/// `timeout`) initialised before and, after a barrier, destroyed after: rank 0 hosts the store,
/// so no rank may leave while others still work.
///
/// # Panics
/// When a rank fails: the message is `spawn`'s report, naming the rank and its error.
#[track_caller]
pub fn cpu_world<E>(n: usize, timeout: Duration, f: impl Fn(usize) -> Result<(), E>)
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let res = dist::spawn(n, |rank| -> RankResult {
        dist::init_process_group(
            "cpu",
            InitOptions {
                timeout,
                ..Default::default()
            },
        )?;
        f(rank).map_err(Into::into)?;
        dist::barrier(None)?;
        dist::destroy_process_group()?;
        Ok(())
    });
    if let Err(e) = res {
        panic!("{e}");
    }
}
