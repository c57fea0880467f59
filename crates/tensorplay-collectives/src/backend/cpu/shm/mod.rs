//! The same-host transport of the `"cpu"` backend: collectives through shared memory.
//!
//! # Co-location
//! At group creation every rank creates one segment under `/dev/shm` (see `segment`) and
//! publishes `<path> <token> <slot> <label>` under `shm/<rank>` in the group's store. Every
//! rank tries to map every peer's segment and checks its header; it publishes the ranks it
//! mapped under `shm_ok/<rank>`. Two ranks share a host when each mapped the other's segment:
//! capability, never names (ranks in different network namespaces sharing `/dev/shm` do share
//! memory). Every rank reads every row, so all agree on the hosts; a host is the set of ranks
//! that mutually mapped the lowest of them, and if the relation is not an equivalence (never
//! seen in practice) the group uses TCP only. Then each rank unlinks its segment's file: from
//! here on nothing of the group is visible in `/dev/shm`, whatever happens to the processes.
//!
//! # Steps
//! Each segment has a step counter only its owner writes, and two slots. Every rank of a host
//! runs the same sequence of *publishes* for the same sequence of collectives, so a step
//! number means the same point of the same collective on every rank. A publish of step `X`
//! says: "my data for step `X` is in place, and I have finished every read of data published
//! at steps below `X`". So a rank reads a peer's step-`X` data after seeing the peer's step
//! reach `X`, and it may overwrite a slot whose data it published at step `L` once every
//! peer's step has reached `L + 1`. Slots alternate round by round on every rank (double
//! buffering), so a rank writes the next chunk while its peers still read the last one, and
//! no collective ends with a barrier.
//!
//! # Waiting
//! A short spin (about 20 µs), then a shared futex on the peer's step counter in slices of
//! 10 ms; between slices the waiter checks the peer's TCP connection (a closed one means the
//! peer died or failed: [`Error::PeerFailed`] naming it) and the call's deadline
//! ([`Error::Timeout`] naming the ranks it waited for).
//!
//! The algorithms are in `algo`.

mod algo;
mod segment;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

pub(super) use self::algo::*;
use self::segment::{CreateError, OwnSegment, Segment};
use super::conn::{Header, Kind, Peer};
use crate::store::Store;
use crate::{Error, Result};

/// Default slot size in bytes (two per rank per group).
const DEFAULT_SLOT: usize = 256 << 10;

/// Whether the transport is enabled (`TENSORPLAY_SHM`, default on).
pub(super) fn enabled() -> bool {
    std::env::var("TENSORPLAY_SHM").map_or(true, |v| !matches!(v.trim(), "0" | "false" | "off"))
}

/// The slot size: `TENSORPLAY_SHM_SLOT_BYTES` (a tuning and test knob: small slots reach the
/// chunk boundaries with small tensors), rounded down to a multiple of 256, at least 256.
fn slot_bytes() -> usize {
    std::env::var("TENSORPLAY_SHM_SLOT_BYTES")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map_or(DEFAULT_SLOT, |b| (b.clamp(256, 1 << 30)) & !255)
}

/// The test-only host label (`TENSORPLAY_SHM_TEST_HOST`): ranks with different labels never
/// map each other, as if they ran on different hosts. A comma-separated list gives one label
/// per global rank (`RANK` picks it), so one setting splits a whole job.
fn host_label() -> String {
    let v = std::env::var("TENSORPLAY_SHM_TEST_HOST").unwrap_or_default();
    let rank: usize = std::env::var("RANK")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    let label = if v.contains(',') {
        v.split(',').nth(rank).unwrap_or("").to_string()
    } else {
        v
    };
    label
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(32)
        .collect()
}

/// Warns once per process that `/dev/shm` is too small.
fn warn_no_space(e: &std::io::Error) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tracing::warn!(
            "cpu backend: no room in /dev/shm for the shared-memory transport ({e}); \
             collectives between ranks of this host use TCP (enlarge /dev/shm, e.g. docker \
             --shm-size, or set TENSORPLAY_SHM_SLOT_BYTES lower)"
        );
        eprintln!(
            "tensorplay warning: no room in /dev/shm for the shared-memory transport ({e}); \
             falling back to TCP"
        );
    });
}

/// Mutable progress of the step protocol.
#[derive(Debug, Default)]
struct Progress {
    /// This rank's last published step.
    step: u64,
    /// Per slot, the step at which this rank last published data in it (0: never).
    last_pub: [u64; 2],
    /// The slot the next round uses.
    next_slot: usize,
}

/// The shared-memory state of one group on one rank.
#[derive(Debug)]
pub(super) struct Shm {
    /// Group rank of each host member, ascending (this rank included).
    local: Vec<usize>,
    /// This rank's index in `local`.
    li: usize,
    /// Segments by local index.
    segs: Vec<Segment>,
    /// Slot bytes.
    slot: usize,
    progress: Mutex<Progress>,
}

impl Shm {
    /// Sets the transport up for rank `rank` of a group of `size` (see the module docs); every
    /// rank of the group takes part, also where the transport is off here (`enabled`
    /// false: it then shares a host with nobody). Returns every rank's host id (its lowest
    /// group rank, the same on every rank) and, when this rank shares its host with others,
    /// the mapped segments. Errors only when peers do not answer within `timeout`.
    pub(super) fn setup(
        store: &dyn Store,
        rank: usize,
        size: usize,
        timeout: Duration,
        enabled: bool,
    ) -> Result<(Vec<usize>, Option<Shm>)> {
        let root = Path::new(crate::shm_host::SHM_ROOT);
        // every sub-slot of a slot cut in `size` keeps at least 64 bytes
        let slot = slot_bytes().max((64 * size).next_multiple_of(256));
        let label = host_label();
        let created = if enabled {
            OwnSegment::create(root, slot)
        } else {
            Err(CreateError::Off)
        };
        let mut own = match created {
            Ok(s) => Some(s),
            Err(CreateError::NoSpace(e)) => {
                warn_no_space(&e);
                None
            }
            Err(CreateError::Other(e)) => {
                tracing::debug!("cpu backend rank {rank}: no shared-memory segment: {e}");
                None
            }
            Err(CreateError::Off) => None,
        };
        let advert = match &own {
            Some(o) => format!(
                "{}\n{}\n{slot}\n{label}",
                o.path.as_deref().unwrap_or_else(|| Path::new("")).display(),
                o.token
            ),
            None => "none".into(),
        };
        store.set(&format!("shm/{rank}"), advert.as_bytes())?;
        let keys: Vec<String> = (0..size).map(|p| format!("shm/{p}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        store.wait(&refs, timeout)?;
        let mut mapped: Vec<Option<Segment>> = (0..size).map(|_| None).collect();
        if own.is_some() {
            for (p, key) in keys.iter().enumerate() {
                if p != rank {
                    let ad = store.get(key)?;
                    mapped[p] = parse_and_map(root, &ad, slot, &label);
                }
            }
        }
        let row: String = (0..size)
            .map(|p| {
                if p == rank || mapped[p].is_some() {
                    '1'
                } else {
                    '0'
                }
            })
            .collect();
        let row = if own.is_some() { row } else { "0".repeat(size) };
        store.set(&format!("shm_ok/{rank}"), row.as_bytes())?;
        let ok_keys: Vec<String> = (0..size).map(|p| format!("shm_ok/{p}")).collect();
        let ok_refs: Vec<&str> = ok_keys.iter().map(String::as_str).collect();
        let waited = store.wait(&ok_refs, timeout);
        // every peer has tried to map our segment (or we give up): the file can go
        if let Some(o) = own.as_mut() {
            o.unlink();
        }
        waited?;
        let mut matrix = Vec::with_capacity(size);
        for k in &ok_keys {
            let v = store.get(k)?;
            if v.len() != size {
                return Err(Error::Store(format!(
                    "shared-memory setup: bad row {:?} under {k}",
                    String::from_utf8_lossy(&v)
                )));
            }
            matrix.push(v.into_iter().map(|b| b == b'1').collect::<Vec<bool>>());
        }
        let Some(hosts) = hosts_of(&matrix) else {
            tracing::warn!(
                "cpu backend: the ranks' shared-memory reachability is not consistent; using TCP"
            );
            return Ok(((0..size).collect(), None));
        };
        let local: Vec<usize> = (0..size).filter(|&p| hosts[p] == hosts[rank]).collect();
        let broken = || Error::Backend {
            backend: "cpu".into(),
            detail: format!("rank {rank}: shared-memory setup lost a segment it had mapped"),
        };
        let own = match own {
            Some(o) if local.len() >= 2 => o,
            _ => return Ok((hosts, None)),
        };
        let li = local.iter().position(|&p| p == rank).unwrap_or(0);
        let mut segs = Vec::with_capacity(local.len());
        let mut own = own.into_segment();
        for &p in &local {
            let seg = if p == rank {
                own.take()
            } else {
                mapped[p].take()
            };
            segs.push(seg.ok_or_else(broken)?);
        }
        Ok((
            hosts,
            Some(Shm {
                local,
                li,
                segs,
                slot,
                progress: Mutex::new(Progress::default()),
            }),
        ))
    }

    /// The local index of group rank `r`, if it is on this host.
    pub(super) fn local_index(&self, r: usize) -> Option<usize> {
        self.local.iter().position(|&p| p == r)
    }
}

/// Parses a peer's advert and maps its segment when the label and slot size match ours.
fn parse_and_map(root: &Path, advert: &[u8], slot: usize, label: &str) -> Option<Segment> {
    let s = std::str::from_utf8(advert).ok()?;
    let mut it = s.split('\n');
    let (path, token, their_slot, their_label) = (it.next()?, it.next()?, it.next()?, it.next()?);
    if their_label != label || their_slot.parse::<usize>().ok()? != slot {
        return None;
    }
    segment::map_peer(root, &PathBuf::from(path), token, slot)
}

/// Host ids from the reachability matrix: rank `r`'s host is the lowest rank `p` that `r` and
/// `p` both mapped. `None` when that is not an equivalence (some member of a host did not map
/// another).
fn hosts_of(m: &[Vec<bool>]) -> Option<Vec<usize>> {
    let n = m.len();
    let mutual = |a: usize, b: usize| a == b || (m[a][b] && m[b][a]);
    let hosts: Vec<usize> = (0..n)
        .map(|r| (0..n).find(|&p| mutual(r, p)).unwrap_or(r))
        .collect();
    for a in 0..n {
        for b in 0..n {
            if (hosts[a] == hosts[b]) != mutual(a, b) {
                return None;
            }
        }
    }
    Some(hosts)
}

/// Spin this long before sleeping on a futex.
const SPIN: Duration = Duration::from_micros(20);
/// Sleep at most this long between liveness and deadline checks.
const SLICE: Duration = Duration::from_millis(10);

/// `a >= b` for step numbers (the counters are 32-bit and wrap).
fn reached(a: u32, b: u64) -> bool {
    (a.wrapping_sub(b as u32) as i32) >= 0
}

/// One collective (or one shared-memory part of a hierarchical one) in progress.
pub(super) struct ShmCtx<'a> {
    shm: &'a Shm,
    prog: std::sync::MutexGuard<'a, Progress>,
    /// The TCP connections by group rank (liveness).
    peers: &'a [Option<Peer>],
    rank: usize,
    timeout: Duration,
    deadline: Instant,
    /// The signature written with each round's data: the call's header fields, the part of a
    /// hierarchical call, and the round.
    sig: [u8; 48],
    hdr: Header,
    op: &'static str,
}

impl<'a> ShmCtx<'a> {
    /// A context for the call described by `hdr` (part `part` of it).
    pub(super) fn new(
        shm: &'a Shm,
        peers: &'a [Option<Peer>],
        hdr: &Header,
        part: u8,
        rank: usize,
        timeout: Duration,
    ) -> ShmCtx<'a> {
        let mut sig = [0u8; 48];
        sig[0] = hdr.kind as u8;
        sig[1] = hdr.dtype;
        sig[2] = hdr.redop;
        sig[3] = part;
        sig[8..16].copy_from_slice(&hdr.seq.to_le_bytes());
        sig[16..24].copy_from_slice(&hdr.count.to_le_bytes());
        sig[24..32].copy_from_slice(&hdr.aux.to_le_bytes());
        ShmCtx {
            shm,
            prog: shm.progress.lock().unwrap_or_else(|e| e.into_inner()),
            peers,
            rank,
            timeout,
            deadline: Instant::now() + timeout,
            sig,
            hdr: *hdr,
            op: hdr.kind.name(),
        }
    }

    /// This rank (in the group).
    pub(super) fn rank(&self) -> usize {
        self.rank
    }

    /// The group rank of local rank `li`.
    pub(super) fn rank_of(&self, li: usize) -> usize {
        self.shm.local[li]
    }

    /// Number of ranks on this host.
    pub(super) fn w(&self) -> usize {
        self.shm.local.len()
    }

    /// This rank's local index.
    pub(super) fn li(&self) -> usize {
        self.shm.li
    }

    /// Slot bytes.
    pub(super) fn slot(&self) -> usize {
        self.shm.slot
    }

    /// Starts a round: the slot every rank uses for it. When `writing`, first waits until
    /// every peer has finished reading what this rank last published in that slot.
    pub(super) fn open_slot(&mut self, writing: bool) -> Result<usize> {
        let s = self.prog.next_slot;
        self.prog.next_slot ^= 1;
        let last = self.prog.last_pub[s];
        if writing && last > 0 {
            self.wait_all(last + 1)?;
        }
        Ok(s)
    }

    /// A pointer to this rank's slot `s` (`slot()` bytes).
    pub(super) fn my_slot(&self, s: usize) -> *mut u8 {
        self.shm.segs[self.shm.li].data(s)
    }

    /// A pointer to local rank `li`'s slot `s`.
    pub(super) fn slot_of(&self, li: usize, s: usize) -> *const u8 {
        self.shm.segs[li].data(s)
    }

    /// Writes the signature of round `round` into this rank's slot `s` (before publishing).
    pub(super) fn write_sig(&self, s: usize, round: u64) {
        let mut sig = self.sig;
        sig[32..40].copy_from_slice(&round.to_le_bytes());
        // SAFETY: the signature area is SIG >= 48 bytes of our own slot, which no peer reads
        // until we publish (the caller opened the slot for writing).
        unsafe {
            std::ptr::copy_nonoverlapping(sig.as_ptr(), self.shm.segs[self.shm.li].sig(s), 48);
        }
    }

    /// Checks local rank `li`'s signature for round `round` in slot `s` (after waiting for
    /// its data): a peer in another collective, or the same one with other arguments, is a
    /// [`Error::Mismatch`].
    pub(super) fn check_sig(&self, li: usize, s: usize, round: u64) -> Result<()> {
        let mut want = self.sig;
        want[32..40].copy_from_slice(&round.to_le_bytes());
        let mut got = [0u8; 48];
        // SAFETY: the peer published this slot's data (and signature) at a step we have seen,
        // and does not write it again until we publish a later step.
        unsafe {
            std::ptr::copy_nonoverlapping(self.shm.segs[li].sig(s), got.as_mut_ptr(), 48);
        }
        if got == want {
            return Ok(());
        }
        let field = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&got[at..at + 8]);
            u64::from_le_bytes(w)
        };
        let peer = self.shm.local[li];
        let detail = match Kind::from_u8(got[0]) {
            Some(kind) => {
                let theirs = Header {
                    kind,
                    dtype: got[1],
                    redop: got[2],
                    seq: field(8),
                    count: field(16),
                    aux: field(24),
                    len: 0,
                };
                format!(
                    "rank {} called {} but rank {peer} called {} (call #{} and #{} of the group, \
                     shared-memory part {} and {}, round {} and {})",
                    self.rank,
                    self.hdr.describe(),
                    theirs.describe(),
                    self.hdr.seq,
                    theirs.seq,
                    want[3],
                    got[3],
                    round,
                    field(32),
                )
            }
            None => format!(
                "rank {peer}'s shared-memory slot holds no valid call signature (rank {} called {})",
                self.rank,
                self.hdr.describe()
            ),
        };
        Err(Error::Mismatch {
            op: self.op.into(),
            detail,
        })
    }

    /// Publishes the next step; `wrote` is the slot this rank wrote data into for it (or
    /// wrote into again, as the reduced slices of a two-shot all-reduce). Returns the step.
    pub(super) fn publish(&mut self, wrote: Option<usize>) -> u64 {
        self.prog.step += 1;
        let x = self.prog.step;
        if let Some(s) = wrote {
            self.prog.last_pub[s] = x;
        }
        segment::publish_step(&self.shm.segs[self.shm.li], x as u32);
        x
    }

    /// Waits until every peer on this host has published step `x`.
    pub(super) fn wait_all(&self, x: u64) -> Result<()> {
        for li in 0..self.w() {
            if li != self.shm.li {
                self.wait_one(li, x)?;
            }
        }
        Ok(())
    }

    /// Waits until local rank `li` has published step `x`: spins briefly, then sleeps on its
    /// futex, checking its liveness and the deadline between sleeps.
    pub(super) fn wait_one(&self, li: usize, x: u64) -> Result<()> {
        let seg = &self.shm.segs[li];
        let step = seg.step();
        if reached(step.load(Ordering::Acquire), x) {
            return Ok(());
        }
        let t0 = Instant::now();
        let mut n = 0u32;
        loop {
            std::hint::spin_loop();
            if reached(step.load(Ordering::Acquire), x) {
                return Ok(());
            }
            n += 1;
            if n.is_multiple_of(64) && t0.elapsed() > SPIN {
                break;
            }
        }
        loop {
            seg.sleepers().fetch_add(1, Ordering::SeqCst);
            let cur = step.load(Ordering::SeqCst);
            if reached(cur, x) {
                seg.sleepers().fetch_sub(1, Ordering::SeqCst);
                return Ok(());
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            segment::futex_wait(step, cur, left.min(SLICE).max(Duration::from_micros(100)));
            seg.sleepers().fetch_sub(1, Ordering::SeqCst);
            if reached(step.load(Ordering::Acquire), x) {
                return Ok(());
            }
            let peer = self.shm.local[li];
            if self
                .peers
                .get(peer)
                .and_then(Option::as_ref)
                .is_some_and(Peer::is_gone)
            {
                return Err(Error::PeerFailed {
                    rank: self.rank,
                    peer,
                    op: self.op.into(),
                    detail: format!(
                        "rank {peer} died or failed inside a shared-memory {} (its connection \
                         closed)",
                        self.op
                    ),
                });
            }
            if Instant::now() >= self.deadline {
                let behind = (0..self.w())
                    .filter(|&l| {
                        l != self.shm.li
                            && !reached(self.shm.segs[l].step().load(Ordering::Acquire), x)
                    })
                    // "rank N" each: the group-to-global translation of messages finds them
                    .map(|l| format!("rank {}", self.shm.local[l]))
                    .collect::<Vec<String>>()
                    .join(", ");
                return Err(Error::Timeout {
                    op: self.op.into(),
                    rank: self.rank as i64,
                    timeout: self.timeout,
                    detail: format!(
                        "{behind} never reached this point of the shared-memory {} \
                         (still alive: stuck, or in another collective)",
                        self.op
                    ),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_classes_of_mutual_mapping() {
        let t = true;
        let f = false;
        // 0,2 on one host, 1,3 on another
        let m = vec![
            vec![t, f, t, f],
            vec![f, t, f, t],
            vec![t, f, t, f],
            vec![f, t, f, t],
        ];
        assert_eq!(hosts_of(&m), Some(vec![0, 1, 0, 1]));
        // one-sided mapping is no mapping
        let m = vec![vec![t, t], vec![f, t]];
        assert_eq!(hosts_of(&m), Some(vec![0, 1]));
        // not transitive: 0~1, 1~2, but not 0~2
        let m = vec![vec![t, t, f], vec![t, t, t], vec![f, t, t]];
        assert_eq!(hosts_of(&m), None);
        assert!(reached(5, 5) && reached(6, 5) && !reached(4, 5));
        assert!(reached(2, u64::from(u32::MAX)), "the counters wrap");
    }
}
