//! Writing the flight recorder: one JSON file per process (`rank<R>.json`) in the dump folder,
//! on a timeout or a peer failure, on request of another process of the job (a watcher thread
//! on its own store connection), or on demand ([`dump_flight_recorder`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::{Entry, live_groups};
use crate::store::{PrefixStore, Store, TcpStore};
use crate::{Error, Result};

/// The variable naming the dump folder (default: a folder under the temp dir named after the
/// job's `MASTER_ADDR` and `MASTER_PORT`, so that every process of a job, and the launcher,
/// find the same one).
pub const FR_DIR_ENV: &str = "TENSORPLAY_FR_DIR";

/// One process's dump.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Dump {
    /// The process's global rank.
    pub rank: usize,
    /// Its process id.
    pub pid: u32,
    /// Why it dumped.
    pub reason: String,
    /// When, in milliseconds since the Unix epoch.
    pub time_ms: f64,
    /// The job's id (the same on every rank of one job; empty outside a job), so that dumps
    /// of earlier jobs left in a kept folder are told apart.
    #[serde(default)]
    pub job: String,
    /// Every live group's ring.
    pub groups: Vec<GroupDump>,
}

/// One group's ring in a [`Dump`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GroupDump {
    /// The group's name (`world`, `group0`, ...).
    pub name: String,
    /// Its backend.
    pub backend: String,
    /// Its members' global ranks.
    pub ranks: Vec<usize>,
    /// Its last operations, oldest first.
    pub entries: Vec<Entry>,
}

/// The dump folder of this process's job: [`FR_DIR_ENV`], else
/// `<temp>/tensorplay-fr-<MASTER_ADDR>-<MASTER_PORT>`, else `<temp>/tensorplay-fr-<pid>`.
pub fn dump_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(FR_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    match (std::env::var("MASTER_ADDR"), std::env::var("MASTER_PORT")) {
        (Ok(a), Ok(p)) => job_dump_dir(&a, &p),
        _ => std::env::temp_dir().join(format!("tensorplay-fr-{}", std::process::id())),
    }
}

/// The default dump folder of the job whose store is at `master_addr:master_port` (what its
/// processes use when [`FR_DIR_ENV`] is not set): `<temp>/tensorplay-fr-<addr>-<port>`.
pub fn job_dump_dir(master_addr: &str, master_port: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "tensorplay-fr-{}-{master_port}",
        master_addr.replace([':', '/', '[', ']'], "_")
    ))
}

fn my_rank() -> usize {
    crate::get_rank(None).ok().unwrap_or_else(|| {
        std::env::var("RANK")
            .ok()
            .and_then(|r| r.parse().ok())
            .unwrap_or(0)
    })
}

/// Writes this process's dump; returns its path.
fn write(reason: &str) -> Result<PathBuf> {
    let groups: Vec<GroupDump> = live_groups()
        .iter()
        .map(|g| GroupDump {
            name: g.name.clone(),
            backend: g.backend.clone(),
            ranks: g.ranks.clone(),
            entries: g.entries(),
        })
        .collect();
    let rank = my_rank();
    let dump = Dump {
        rank,
        pid: std::process::id(),
        reason: reason.to_string(),
        time_ms: super::ms(SystemTime::now()),
        job: JOB
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default(),
        groups,
    };
    let dir = dump_dir();
    let io =
        |e: std::io::Error| Error::Io(format!("flight recorder dump in {}: {e}", dir.display()));
    std::fs::create_dir_all(&dir).map_err(io)?;
    let path = dir.join(format!("rank{rank}.json"));
    // the main thread (a failure) and the watcher (another rank's request) may write at once
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(".rank{rank}.{}.{n}.tmp", std::process::id()));
    let text =
        serde_json::to_vec_pretty(&dump).map_err(|e| Error::Io(format!("flight recorder: {e}")))?;
    let written = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, &path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(io)?;
    Ok(path)
}

/// Asks every process of the job to dump (through the world's store).
///
/// Rank 0 hosts the store: when it asks, it waits (up to a second) until the other ranks
/// have written theirs, so that its exit does not take the store away from under them.
fn request_all(reason: &str) {
    let Ok(store) = crate::world_store() else {
        return;
    };
    let Ok(k) = store.add("fr/requests", 1) else {
        return;
    };
    let v = format!("{}|{reason}", std::process::id());
    if store.set(&format!("fr/dump/{k}"), v.as_bytes()).is_err() || my_rank() != 0 {
        return;
    }
    let others = crate::get_world_size(None).map_or(0, |n| n.saturating_sub(1)) as i64;
    let until = std::time::Instant::now() + Duration::from_secs(1);
    while store.add(&format!("fr/dumped/{k}"), 0).unwrap_or(others) < others
        && std::time::Instant::now() < until
    {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// [`request_all`] on a thread of its own, waited for at most two seconds: a store whose
/// host is frozen (stopped, not dead) must not hold the error back for the store's timeout.
fn request_all_bounded(reason: String) {
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("tensorplay-fr-ask".into())
        .spawn(move || {
            request_all(&reason);
            let _ = tx.send(());
        });
    if spawned.is_ok() {
        let _ = rx.recv_timeout(Duration::from_secs(2));
    }
}

/// Writes this process's flight recorder and asks the other processes of the job to write
/// theirs (`dist.dump_flight_recorder`, PyTorch's `_dump_nccl_trace`); returns the folder.
/// `tensorplay-fr <folder>` then explains the dumps.
///
/// # Errors
/// [`Error::Io`] when the folder cannot be written.
pub fn dump_flight_recorder() -> Result<PathBuf> {
    if crate::world_store().is_err() {
        return Err(Error::NotInitialized {
            op: "dump_flight_recorder".into(),
        });
    }
    write("on demand (dump_flight_recorder)")?;
    request_all_bounded("another rank called dump_flight_recorder".into());
    Ok(dump_dir())
}

/// Whether an operation of this process timed out or lost a peer.
static FAILURE_SEEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether an operation of this process has timed out or lost a peer (a backend whose runtime
/// must end the whole job then, MPI's, asks at exit).
pub fn failure_seen() -> bool {
    FAILURE_SEEN.load(Ordering::Relaxed)
}

/// On a timeout or a peer failure of an operation: dumps (when recording is on), asks the
/// others to dump, and returns `e` with the folder named in it.
pub(crate) fn on_failure(e: Error) -> Error {
    let (Error::Timeout { .. } | Error::PeerFailed { .. }) = &e else {
        return e;
    };
    FAILURE_SEEN.store(true, Ordering::Relaxed);
    if super::capacity() == 0 {
        return e;
    }
    let first = e.to_string();
    let first = first.lines().next().unwrap_or("");
    let Ok(path) = write(first) else { return e };
    request_all_bounded(format!("rank {} failed: {first}", my_rank()));
    let note = format!(
        "; flight recorder written to {} (run `tensorplay-fr {}` for a diagnosis)",
        path.display(),
        dump_dir().display()
    );
    e.with_note(&note)
}

/// The id of this process's job, agreed at `init_process_group` (see [`agree_job_id`]).
static JOB: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Agrees on the job's id through the world's `store` (rank 0 makes it: its pid and the
/// time) and keeps it for the dumps.
pub(crate) fn agree_job_id(store: &dyn Store, rank: usize, timeout: Duration) -> Result<()> {
    const KEY: &str = "fr/job";
    if rank == 0 {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        store.set(KEY, format!("{}-{nanos}", std::process::id()).as_bytes())?;
    } else {
        store.wait(&[KEY], timeout)?;
    }
    let id = String::from_utf8_lossy(&store.get(KEY)?).into_owned();
    *JOB.lock().unwrap_or_else(|e| e.into_inner()) = Some(id);
    Ok(())
}

/// Increases when the default group goes, so that its watcher stops.
pub(crate) static WORLD_GENERATION: AtomicU64 = AtomicU64::new(0);

/// Starts the thread that dumps when another process asks: it waits on the job's store, over
/// a connection of its own (`master`, keys under `prefix`), and stops with the default group.
pub(crate) fn start_watcher(master: SocketAddr, prefix: String) {
    if super::capacity() == 0 {
        return;
    }
    let generation = WORLD_GENERATION.load(Ordering::SeqCst);
    let _ = std::thread::Builder::new()
        .name("tensorplay-fr-watch".into())
        .spawn(move || {
            let Ok(conn) = TcpStore::connect(master, Duration::from_secs(10)) else {
                return;
            };
            let store = PrefixStore::new(prefix, Arc::new(conn));
            let mut next = 1u64;
            while WORLD_GENERATION.load(Ordering::SeqCst) == generation {
                let key = format!("fr/dump/{next}");
                match store.wait(&[&key], Duration::from_secs(2)) {
                    Ok(()) => {
                        if WORLD_GENERATION.load(Ordering::SeqCst) != generation {
                            return;
                        }
                        let v = store
                            .get(&key)
                            .map(|v| String::from_utf8_lossy(&v).into_owned())
                            .unwrap_or_default();
                        let (pid, why) = v.split_once('|').unwrap_or(("", &v));
                        // the process that asked has written its own dump already
                        if pid != std::process::id().to_string() {
                            let _ = write(&format!("asked: {why}"));
                            let _ = store.add(&format!("fr/dumped/{next}"), 1);
                        }
                        next += 1;
                    }
                    Err(Error::Timeout { .. }) => {}
                    Err(_) => return,
                }
            }
        });
}
