//! Spawned worlds of real processes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tensorplay_collectives::spawn::is_spawned_child;
use tensorplay_collectives::{self as dist, InitOptions, SpawnOptions};

/// What a rank's body returns: any error, carried back to the parent by `spawn`.
pub type RankResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// The variable [`cpu_world_in`] passes a [`SharedDir`] down in.
const SHARED_DIR_ENV: &str = "TP_TEST_SHARED_DIR";

/// A scratch folder that the test process creates and every world it spawns with
/// [`cpu_world_in`] shares (the ranks re-run the test from its start, so a folder made there
/// would be theirs alone). The test process removes it on drop.
#[derive(Debug)]
pub struct SharedDir {
    path: PathBuf,
    owner: bool,
}

impl SharedDir {
    /// In the test process, a fresh `TMPDIR/tp-TAG-PID`; in a spawned rank, its parent's.
    ///
    /// # Panics
    /// When the folder cannot be created (a test's environment is broken).
    pub fn new(tag: &str) -> SharedDir {
        if is_spawned_child()
            && let Ok(d) = std::env::var(SHARED_DIR_ENV)
        {
            return SharedDir {
                path: d.into(),
                owner: false,
            };
        }
        let path = std::env::temp_dir().join(format!("tp-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("cannot create the test folder {}: {e}", path.display()));
        SharedDir { path, owner: true }
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.path
    }
}

impl Drop for SharedDir {
    fn drop(&mut self) {
        if self.owner {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// [`cpu_world`] whose ranks see `dir` as their [`SharedDir`].
///
/// # Panics
/// When a rank fails, as [`cpu_world`].
#[track_caller]
pub fn cpu_world_in<E>(
    n: usize,
    timeout: Duration,
    dir: &SharedDir,
    f: impl Fn(usize) -> Result<(), E>,
) where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let options = SpawnOptions {
        env: vec![(SHARED_DIR_ENV.into(), dir.dir().display().to_string())],
        ..SpawnOptions::new(n)
    };
    run(options, timeout, f);
}

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
    run(SpawnOptions::new(n), timeout, f);
}

/// Spawns the world of `options` and runs `f` in each rank between the group's set-up and
/// tear-down; panics with `spawn`'s report when a rank fails.
#[track_caller]
fn run<E>(options: SpawnOptions, timeout: Duration, f: impl Fn(usize) -> Result<(), E>)
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let res = dist::spawn_with(options, |rank| -> RankResult {
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
