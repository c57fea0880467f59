//! The flight recorder: every process group keeps a ring buffer of its last operations
//! (`TENSORPLAY_FR_BUFFER_SIZE`, default 2000; 0 turns it off) with their sequence number,
//! dtype, shape and bytes, state, times and the user's call site. When an operation times out
//! or a peer fails, the process writes every group's buffer to the flight-recorder folder and
//! asks the other processes of the job (through the store) to do the same; `tensorplay-fr DIR`
//! reads the dumps and says which rank waits where, and which rank is behind or elsewhere
//! ([`diagnose`]).
//!
//! Recording costs a lock and a few clock reads per operation, above the backend contract,
//! so every backend gets it.

mod diagnose;
mod dump;

use std::collections::VecDeque;
use std::panic::Location;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use tensorplay_core::{DType, Tensor};

pub use diagnose::{Diagnosis, diagnose, read_dumps};
pub use dump::{
    Dump, FR_DIR_ENV, GroupDump, dump_dir, dump_flight_recorder, failure_seen, job_dump_dir,
};
pub(crate) use dump::{WORLD_GENERATION, agree_job_id, on_failure, start_watcher};

/// The variable that sets the ring's size per group (0: off).
pub const FR_BUFFER_SIZE_ENV: &str = "TENSORPLAY_FR_BUFFER_SIZE";
/// The default ring size per group.
pub const DEFAULT_FR_BUFFER_SIZE: usize = 2000;

fn capacity() -> usize {
    static CAP: OnceLock<usize> = OnceLock::new();
    *CAP.get_or_init(|| match std::env::var(FR_BUFFER_SIZE_ENV) {
        Err(_) => DEFAULT_FR_BUFFER_SIZE,
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            // a typo should not pass silently, nor stop the job
            eprintln!(
                "tensorplay: {FR_BUFFER_SIZE_ENV}={v:?} is not a number of operations (0 turns the flight recorder off); using {DEFAULT_FR_BUFFER_SIZE}"
            );
            DEFAULT_FR_BUFFER_SIZE
        }),
    })
}

/// Where an operation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Called, waiting for its turn after the group's earlier operations.
    Issued,
    /// Running (exchanging with the other ranks).
    Started,
    /// Finished.
    Done,
    /// Failed (the error is kept).
    Failed,
}

/// One operation as dumped.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    /// The operation's number in its group on this rank (0, 1, ...): ranks that issue the same
    /// operations in the same order give them the same numbers.
    pub seq: u64,
    /// The operation (`all_reduce`, `barrier`, ...).
    pub op: String,
    /// The main tensor's dtype, when there is one.
    pub dtype: Option<String>,
    /// The main tensor's shape.
    pub shape: Vec<usize>,
    /// The main tensor's size in bytes.
    pub bytes: u64,
    /// Where it stands.
    pub state: State,
    /// When it was called, in milliseconds since the Unix epoch.
    pub issued_ms: f64,
    /// When it began running.
    pub started_ms: Option<f64>,
    /// When it finished or failed.
    pub finished_ms: Option<f64>,
    /// Its error, when it failed.
    pub error: Option<String>,
    /// The user's call site (`file:line:column`).
    pub site: String,
    /// For a point-to-point operation (`send`, `recv`): the other rank (global). These
    /// are numbered apart from the collectives (`seq` counts the group's point-to-point
    /// operations on this rank), since ranks need not make the same ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<usize>,
    /// A point-to-point operation's tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<u64>,
    /// What the caller said the message is (pipelining: `"stage 1 micro-batch 3
    /// activation"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
}

/// How many dims of a shape the ring keeps (a dump of a tensor with more shows the first 8).
const SHAPE_DIMS: usize = 8;

/// An operation in the ring (the cheap form of an [`Entry`]).
struct Rec {
    /// The ring's own number (collectives and point-to-point together).
    uid: u64,
    seq: u64,
    op: &'static str,
    dtype: Option<DType>,
    /// The first [`SHAPE_DIMS`] dims (no allocation per operation) and the rank.
    shape: [usize; SHAPE_DIMS],
    ndim: u8,
    bytes: u64,
    state: State,
    issued: SystemTime,
    started: Option<SystemTime>,
    finished: Option<SystemTime>,
    error: Option<String>,
    site: &'static Location<'static>,
    /// Point-to-point: the peer (global), the tag and the caller's label.
    p2p: Option<(usize, u64, Option<String>)>,
}

fn ms(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

impl Rec {
    fn entry(&self) -> Entry {
        Entry {
            seq: self.seq,
            op: self.op.to_string(),
            dtype: self.dtype.map(|d| d.to_string()),
            shape: self.shape[..usize::from(self.ndim).min(SHAPE_DIMS)].to_vec(),
            bytes: self.bytes,
            state: self.state,
            issued_ms: ms(self.issued),
            started_ms: self.started.map(ms),
            finished_ms: self.finished.map(ms),
            error: self.error.clone(),
            site: format!(
                "{}:{}:{}",
                self.site.file(),
                self.site.line(),
                self.site.column()
            ),
            peer: self.p2p.as_ref().map(|p| p.0),
            tag: self.p2p.as_ref().map(|p| p.1),
            label: self.p2p.as_ref().and_then(|p| p.2.clone()),
        }
    }
}

#[derive(Default)]
struct Ring {
    next: u64,
    next_p2p: u64,
    next_uid: u64,
    recs: VecDeque<Rec>,
}

/// The recorder of one process group on this rank.
pub(crate) struct GroupRecorder {
    pub(crate) name: String,
    pub(crate) backend: String,
    pub(crate) ranks: Vec<usize>,
    cap: usize,
    ring: Mutex<Ring>,
}

/// A recorded operation's handle (`None` when recording is off).
#[derive(Clone, Copy)]
pub(crate) struct Id(Option<u64>);

static GROUPS: Mutex<Vec<Weak<GroupRecorder>>> = Mutex::new(Vec::new());

impl GroupRecorder {
    /// The recorder of a new group (registered for dumps while it lives).
    pub(crate) fn new(name: &str, backend: &str, ranks: &[usize]) -> Arc<GroupRecorder> {
        let r = Arc::new(GroupRecorder {
            name: name.to_string(),
            backend: backend.to_string(),
            ranks: ranks.to_vec(),
            cap: capacity(),
            ring: Mutex::new(Ring::default()),
        });
        if r.cap > 0 {
            let mut g = GROUPS.lock().unwrap_or_else(|e| e.into_inner());
            g.retain(|w| w.strong_count() > 0);
            g.push(Arc::downgrade(&r));
        }
        r
    }

    fn ring(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a call of `op` at `site` on `t`.
    pub(crate) fn issued(
        &self,
        op: &'static str,
        site: &'static Location<'static>,
        t: Option<&Tensor>,
    ) -> Id {
        self.record(op, site, t, None)
    }

    /// Records a point-to-point `op` (`"send"`, `"recv"`) with global rank `peer`.
    pub(crate) fn issued_p2p(
        &self,
        op: &'static str,
        site: &'static Location<'static>,
        t: &Tensor,
        peer: usize,
        tag: u64,
        label: Option<String>,
    ) -> Id {
        self.record(op, site, Some(t), Some((peer, tag, label)))
    }

    fn record(
        &self,
        op: &'static str,
        site: &'static Location<'static>,
        t: Option<&Tensor>,
        p2p: Option<(usize, u64, Option<String>)>,
    ) -> Id {
        if self.cap == 0 {
            return Id(None);
        }
        let now = SystemTime::now();
        let (mut shape, mut ndim) = ([0usize; SHAPE_DIMS], 0u8);
        if let Some(t) = t {
            for (d, &s) in shape.iter_mut().zip(t.shape()) {
                *d = s;
            }
            ndim = t.ndim().min(255) as u8;
        }
        let mut ring = self.ring();
        let seq = if p2p.is_some() {
            ring.next_p2p += 1;
            ring.next_p2p - 1
        } else {
            ring.next += 1;
            ring.next - 1
        };
        let uid = ring.next_uid;
        ring.next_uid += 1;
        if ring.recs.len() == self.cap {
            ring.recs.pop_front();
        }
        ring.recs.push_back(Rec {
            uid,
            seq,
            op,
            dtype: t.map(Tensor::dtype),
            shape,
            ndim,
            bytes: t.map_or(0, |t| (t.numel() * t.dtype().size_in_bytes()) as u64),
            state: State::Issued,
            issued: now,
            started: None,
            finished: None,
            error: None,
            site,
            p2p,
        });
        Id(Some(uid))
    }

    fn update(&self, id: Id, f: impl FnOnce(&mut Rec)) {
        let Id(Some(uid)) = id else { return };
        let mut ring = self.ring();
        // the newest records are at the back, and the one asked for is almost always there
        if let Some(r) = ring.recs.iter_mut().rev().find(|r| r.uid == uid) {
            f(r);
        }
    }

    /// The operation began running.
    pub(crate) fn started(&self, id: Id) {
        let now = SystemTime::now();
        self.update(id, |r| {
            r.state = State::Started;
            r.started = Some(now);
        });
    }

    /// The operation finished with `result`.
    pub(crate) fn finished<T>(&self, id: Id, result: &crate::Result<T>) {
        let now = SystemTime::now();
        self.update(id, |r| {
            r.finished = Some(now);
            match result {
                Ok(_) => r.state = State::Done,
                Err(e) => {
                    r.state = State::Failed;
                    r.error = Some(e.to_string());
                }
            }
        });
    }

    /// The ring as entries, oldest first.
    pub(crate) fn entries(&self) -> Vec<Entry> {
        self.ring().recs.iter().map(Rec::entry).collect()
    }
}

/// The recorders of the live groups of this process.
pub(crate) fn live_groups() -> Vec<Arc<GroupRecorder>> {
    GROUPS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect()
}
