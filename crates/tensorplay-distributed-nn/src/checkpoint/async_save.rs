//! [`async_save`]: the ranks agree on the plan and copy their pieces to host memory while
//! training waits; a background thread per rank then writes and flushes the files, reports to
//! rank 0 through the group's store, and rank 0's thread commits.

use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tensorplay_collectives::ProcessGroup;
use tensorplay_collectives::store::Store;
use tensorplay_core::{Error, Result};

use super::format::FileLayout;
use super::metadata::Metadata;
use super::save::{Bytes, Prepared, files_of, prepare, staged, write_file};
use super::state::StateDict;
use super::storage::{FileSystemWriter, StorageWriter};
use super::sync::failed_ranks;

/// How long a rank's background writer waits for the others' reports and for rank 0's commit.
const REPORT_TIMEOUT: Duration = Duration::from_secs(600);

/// A save in progress ([`async_save`]'s; PyTorch returns a `Future`).
#[must_use = "a save in progress: wait on it before the next save and before exiting"]
pub struct AsyncSaveHandle {
    thread: Option<JoinHandle<Result<Metadata>>>,
}

impl std::fmt::Debug for AsyncSaveHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncSaveHandle")
            .field("done", &self.is_done())
            .finish()
    }
}

impl AsyncSaveHandle {
    /// Whether the background write has ended (committed or failed).
    pub fn is_done(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Waits for the save to be committed; returns its metadata.
    ///
    /// # Errors
    /// [`Error::Checkpoint`]: this rank could not write its file, another rank could not
    /// (named), no report came within 10 minutes (a rank died), or rank 0 could not commit.
    /// The folder's previous checkpoint is then still the committed one.
    pub fn wait(mut self) -> Result<Metadata> {
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(Error::Checkpoint {
                path: String::new(),
                problem: "the background writer panicked".into(),
            }),
            None => Err(Error::Checkpoint {
                path: String::new(),
                problem: "waited on twice".into(),
            }),
        }
    }
}

/// [`save`](super::save) in the background (`torch.distributed.checkpoint.async_save`):
/// collective over `group` like `save`, it returns once the ranks have agreed on the plan and
/// each has copied its pieces to host memory; the files are written, flushed and committed by
/// a background thread per rank, so training goes on meanwhile (the state may change right
/// away: the copies are what gets written). [`AsyncSaveHandle::wait`] returns the committed
/// metadata. A job killed before the commit leaves the folder's previous checkpoint loadable.
/// One save at a time per folder: wait on a handle before the next save into it.
///
/// The background threads report to rank 0 through the group's store, not its collectives, so
/// they never interleave with training's collectives.
///
/// # Errors
/// Those of [`save`](super::save)'s planning half, on every rank, before anything is written.
pub fn async_save(
    state: &StateDict,
    checkpoint_dir: impl AsRef<Path>,
    group: Option<&ProcessGroup>,
) -> Result<AsyncSaveHandle> {
    async_save_with(
        state,
        Box::new(FileSystemWriter::new(checkpoint_dir)),
        group,
    )
}

/// [`async_save`] through any [`StorageWriter`].
///
/// # Errors
/// As [`async_save`].
pub fn async_save_with(
    state: &StateDict,
    mut writer: Box<dyn StorageWriter>,
    group: Option<&ProcessGroup>,
) -> Result<AsyncSaveHandle> {
    let mut p = prepare(state, &mut *writer, group)?;
    let store = p.ranks.group().map(|g| g.store().clone());
    let (rank, id) = (p.ranks.rank, p.save_id.clone());
    // a failure from here on is reported where rank 0's writer waits, so that it fails at once
    let report_failure = |e: Error| -> Error {
        if let Some(store) = &store {
            let r: Report = Err(e.to_string());
            let _ = store.set(
                &report_key(&id, rank),
                &serde_json::to_vec(&r).unwrap_or_default(),
            );
        }
        e
    };
    let pieces: Vec<Vec<u8>> = p
        .mine()
        .map(staged)
        .collect::<Result<_>>()
        .map_err(report_failure)?;
    let layout = p.layout(rank);
    p.release_pieces();
    let thread_store = store.clone();
    let thread = std::thread::Builder::new()
        .name("tp-async-save".into())
        .spawn(move || background(p, (layout, pieces), writer, thread_store))
        .map_err(|e| {
            report_failure(Error::Checkpoint {
                path: String::new(),
                problem: format!("could not start the background writer: {e}"),
            })
        })?;
    Ok(AsyncSaveHandle {
        thread: Some(thread),
    })
}

/// The store key of rank `r`'s report on save `id`, and of the commit's outcome.
fn report_key(id: &str, r: usize) -> String {
    format!("dcp/{id}/report/{r}")
}
fn commit_key(id: &str) -> String {
    format!("dcp/{id}/commit")
}

/// A rank's report: its pieces' checksums, or why it could not write.
type Report = std::result::Result<Vec<String>, String>;

fn background(
    p: Prepared,
    (layout, pieces): (FileLayout, Vec<Vec<u8>>),
    mut writer: Box<dyn StorageWriter>,
    store: Option<Arc<dyn Store>>,
) -> Result<Metadata> {
    let (rank, world, id) = (p.ranks.rank, p.ranks.world, p.save_id.clone());
    let location = writer.location();
    let fail = |problem: String| Error::Checkpoint {
        path: location.clone(),
        problem,
    };
    let bytes: Vec<Bytes<'_>> = pieces.iter().map(|b| Bytes::Host(b)).collect();
    let written: Report = if bytes.is_empty() {
        Ok(Vec::new())
    } else {
        write_file(&mut *writer, &p.file_name(), &layout, &bytes).map_err(|e| e.to_string())
    };
    drop(bytes);
    drop(pieces);
    let Some(store) = store else {
        // one process: commit here
        let crcs = written.map_err(&fail)?;
        let metadata = p.metadata(&[crcs]);
        writer.commit(&metadata)?;
        writer.remove_stale(&files_of(&metadata));
        return Ok(metadata);
    };
    let text = serde_json::to_vec(&written).unwrap_or_default();
    store.set(&report_key(&id, rank), &text)?;
    if rank == 0 {
        let outcome = commit_all(&p, &mut *writer, &*store, world);
        let said = match &outcome {
            Ok(_) => "ok".to_string(),
            Err(e) => e.to_string(),
        };
        store.set(&commit_key(&id), said.as_bytes())?;
        let metadata = outcome?;
        writer.remove_stale(&files_of(&metadata));
        return Ok(metadata);
    }
    written.map_err(&fail)?;
    wait_for(&*store, &[commit_key(&id)])
        .map_err(|e| fail(format!("rank 0 did not commit: {e}")))?;
    let said = String::from_utf8_lossy(&store.get(&commit_key(&id))?).into_owned();
    if said != "ok" {
        return Err(fail(format!("rank 0 could not commit: {said}")));
    }
    // the same metadata rank 0 wrote (every rank can build it from the reports)
    let crcs = gather_reports(&*store, &id, world).map_err(&fail)?;
    let metadata = p.metadata(&crcs);
    writer.remove_stale(&files_of(&metadata));
    Ok(metadata)
}

/// Waits until every key is set, asking the store every 50 ms (a store `wait` would hold the
/// rank's store connection, which training's own store calls share, for as long as it waits).
fn wait_for(store: &dyn Store, keys: &[String]) -> std::result::Result<(), String> {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let start = std::time::Instant::now();
    loop {
        if store.check(&refs).map_err(|e| e.to_string())? {
            return Ok(());
        }
        if start.elapsed() > REPORT_TIMEOUT {
            return Err(format!("{keys:?} not set within {REPORT_TIMEOUT:?}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every rank's checksums, once all have reported (or the first failure).
fn gather_reports(
    store: &dyn Store,
    id: &str,
    world: usize,
) -> std::result::Result<Vec<Vec<String>>, String> {
    let keys: Vec<String> = (0..world).map(|r| report_key(id, r)).collect();
    wait_for(store, &keys).map_err(|e| format!("not every rank reported its file: {e}"))?;
    let mut reports: Vec<Report> = Vec::with_capacity(world);
    for k in &keys {
        let b = store.get(k).map_err(|e| e.to_string())?;
        reports.push(serde_json::from_slice(&b).map_err(|e| e.to_string())?);
    }
    if let Some(bad) = failed_ranks(reports.iter().map(|r| r.as_ref().err().map(String::as_str))) {
        return Err(bad);
    }
    Ok(reports.into_iter().map(|r| r.unwrap_or_default()).collect())
}

/// Rank 0: waits for every report, then commits.
fn commit_all(
    p: &Prepared,
    writer: &mut dyn StorageWriter,
    store: &dyn Store,
    world: usize,
) -> Result<Metadata> {
    let crcs = gather_reports(store, &p.save_id, world).map_err(|problem| Error::Checkpoint {
        path: writer.location(),
        problem,
    })?;
    let metadata = p.metadata(&crcs);
    metadata.validate(Path::new(&writer.location()))?;
    writer.commit(&metadata)?;
    Ok(metadata)
}
