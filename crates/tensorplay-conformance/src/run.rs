//! Running a vectors file: one world of processes per world size, then the summary.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::time::Duration;

use tensorplay_core::DType;

use crate::case::cases;
use crate::summary::{Outcome, Summary, parse_result, summarize};
use crate::world::{WORLD_ENV, run_world};
use crate::{Error, load};

/// Options of [`run_file`].
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// `"cpu"` (default) or `"nccl"` (tensors on `cuda:<local rank>`).
    pub backend: String,
    /// Timeout of every collective (default 30 s): a rank that errors leaves the others
    /// waiting this long at most.
    pub timeout: Duration,
    /// Overall limit for one world's processes (default 600 s).
    pub world_timeout: Duration,
    /// The floating dtype the inputs and loss weights are cast to (default float64, the
    /// files' own). Expected values are rounded to it and compared within
    /// [`tolerance`](crate::tolerance)`(dtype)`.
    pub dtype: DType,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            backend: "cpu".into(),
            timeout: Duration::from_secs(30),
            world_timeout: Duration::from_secs(600),
            dtype: DType::F64,
        }
    }
}

/// Runs every case of `path` and returns the summary.
///
/// Worlds run one after another, in the order their sizes first appear; within a world,
/// cases run in the order their labels first appear, all ranks together. Cases with an
/// unknown `fn`, `op` or parameter, or inconsistent records, fail without running. A rank
/// that errors, crashes or times out fails every record of its case.
///
/// In a child spawned by this function, it runs that child's share and exits the process.
///
/// # Errors
/// The file cannot be read or parsed, the results directory cannot be created, or
/// `opts.dtype` is not floating ([`Error::Dtype`]).
pub fn run_file(path: &Path, opts: &RunOptions) -> Result<Summary, Error> {
    if !opts.dtype.is_float() {
        return Err(Error::Dtype(opts.dtype));
    }
    let records = load(path)?;
    let cases = cases(&records);
    let mut worlds: Vec<usize> = vec![];
    for c in &cases {
        if c.invalid.is_none() && !worlds.contains(&c.world) {
            worlds.push(c.world);
        }
    }
    if let Ok(w) = std::env::var(WORLD_ENV) {
        // a spawned child: run its world only (spawn runs the worker and exits)
        if let Ok(w) = w.parse::<usize>() {
            let _ = run_world(&cases, w, opts, Path::new(""));
        }
    }
    if std::env::var_os("TENSORPLAY_RUN").is_some_and(|v| v == "1") {
        // a rank of a launcher's job: its world's `spawn` joins the job, judges this rank's
        // records and exits; no results folder (it would be left behind)
        for &w in &worlds {
            let _ = run_world(&cases, w, opts, Path::new(""));
        }
    }
    let dir = std::env::temp_dir().join(format!(
        "tensorplay-conformance-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    fs::create_dir_all(&dir).map_err(|e| Error::Io(dir.clone(), e))?;
    let mut outcomes: BTreeMap<(String, usize), Outcome> = BTreeMap::new();
    let mut world_errors: BTreeMap<usize, String> = BTreeMap::new();
    for &w in &worlds {
        if let Err(e) = run_world(&cases, w, opts, &dir) {
            world_errors.insert(w, first_line(&e));
        }
        for rank in 0..w {
            let file = dir.join(format!("world{w}-rank{rank}.jsonl"));
            let Ok(text) = fs::read_to_string(&file) else {
                continue;
            };
            for line in text.lines() {
                if let Ok((case, r, outcome)) = parse_result(line) {
                    outcomes.insert((case, r), outcome);
                }
            }
        }
    }
    let _ = fs::remove_dir_all(&dir);
    Ok(summarize(&cases, &outcomes, &world_errors))
}

/// The first line of an error's text.
fn first_line(e: &impl std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or("").to_string()
}
