//! The same-host transport of the `"cpu"` backend: collectives through shared memory.
//!
//! # Co-location
//! At group creation every rank creates one segment under `/dev/shm` (see `segment`) and
//! publishes `<path> <token> <slot> <label>` (and, for `cma`, `<pid> <address>`) under
//! `shm/<rank>` in the group's store. Every rank tries to map every peer's segment and checks
//! its header; it publishes the ranks it mapped under `shm_ok/<rank>`, followed by the ranks
//! whose memory it read with `process_vm_readv` (`1`, or `2` where it asks for the gathers
//! too; see `cma`). Two ranks share a host when each mapped the other's segment: capability,
//! never names (ranks in different network namespaces sharing `/dev/shm` do share memory). Every rank reads every row, so all agree on the hosts; a host is the set of ranks
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
//! The step protocol is in `step`, the algorithms in `algo`.

mod algo;
pub(super) mod cma;
mod segment;
mod step;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub(super) use self::algo::*;
use self::segment::{CreateError, OwnSegment, Segment};
pub(super) use self::step::ShmCtx;
use super::conn::Peer;
use crate::store::Store;
use crate::{Detail, Error, Part, Result, detail};

/// The failure note of a rank that timed out (see `segment`'s `blame`).
const NOTE_TIMED_OUT: u32 = u32::MAX - 1;

/// Default slot size in bytes (two per rank per group).
const DEFAULT_SLOT: usize = 256 << 10;

/// Whether the transport is enabled (`TENSORPLAY_SHM`, default on).
pub(super) fn enabled() -> bool {
    std::env::var("TENSORPLAY_SHM").map_or(true, |v| {
        !matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "0" | "false" | "off" | "no"
        )
    })
}

/// The slot size: `TENSORPLAY_SHM_SLOT_BYTES` (a tuning and test knob: small slots reach the
/// chunk boundaries with small tensors), 256 bytes to 64 MiB, rounded down to a multiple of
/// 256; anything else is warned about once and the default used.
fn slot_bytes() -> usize {
    const MAX: usize = 64 << 20;
    let Ok(v) = std::env::var("TENSORPLAY_SHM_SLOT_BYTES") else {
        return DEFAULT_SLOT;
    };
    match v.trim().parse::<usize>() {
        Ok(b) if (256..=MAX).contains(&b) => b & !255,
        _ => {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                tracing::warn!(
                    "TENSORPLAY_SHM_SLOT_BYTES={v:?} is not a byte count from 256 to {MAX}; \
                     using {DEFAULT_SLOT}"
                );
                eprintln!(
                    "tensorplay warning: TENSORPLAY_SHM_SLOT_BYTES={v:?} is not a byte count \
                     from 256 to {MAX}; using {DEFAULT_SLOT}"
                );
            });
            DEFAULT_SLOT
        }
    }
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
    /// Whether every rank of this host reads the others' memory directly in reduce_scatter
    /// (see `cma`).
    cma: bool,
    /// Whether they do in all_gather and gather too (every rank asked for it).
    cma_gather: bool,
    /// The pid of each host member's process, by local index (0 where unknown).
    pids: Vec<u32>,
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
        peers: &[Option<Peer>],
        rank: usize,
        size: usize,
        timeout: Duration,
        enabled: bool,
    ) -> Result<(Vec<usize>, Option<Shm>)> {
        let root = Path::new(crate::shm_host::SHM_ROOT);
        // every sub-slot of a slot cut in `size` keeps at least 64 bytes
        let slot = slot_bytes().max((64 * size).next_multiple_of(256));
        let label = host_label();
        let cma_mode = if enabled { cma::mode() } else { cma::Mode::Off };
        if cma_mode != cma::Mode::Off {
            cma::allow_peers();
        }
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
                "{}\n{}\n{slot}\n{label}{}",
                o.path.as_deref().unwrap_or_else(|| Path::new("")).display(),
                o.token,
                match cma_mode {
                    cma::Mode::Off => String::new(),
                    _ => cma::advert_fields(&o.token),
                }
            ),
            None => "none".into(),
        };
        store.set(&format!("shm/{rank}"), advert.as_bytes())?;
        let keys: Vec<String> = (0..size).map(|p| format!("shm/{p}")).collect();
        wait_keys(store, &keys, timeout, peers, rank)?;
        let mut mapped: Vec<Option<Segment>> = (0..size).map(|_| None).collect();
        // the pid of each peer whose memory we read at its advertised address
        let mut pids: Vec<Option<u32>> = vec![None; size];
        pids[rank] = Some(std::process::id());
        if own.is_some() {
            for (p, key) in keys.iter().enumerate() {
                if p != rank {
                    let ad = store.get(key)?;
                    mapped[p] = parse_and_map(root, &ad, slot, &label);
                    if mapped[p].is_some() && cma_mode != cma::Mode::Off {
                        pids[p] = cma::probe_advert(&ad);
                    }
                }
            }
        }
        let bit = |b: bool| if b { '1' } else { '0' };
        // whose memory we read: '1', or '2' where we also want all_gather to (see `cma`)
        let read = |p: usize| match (pids[p].is_some(), cma_mode.gathers()) {
            (false, _) => '0',
            (true, false) => '1',
            (true, true) => '2',
        };
        // the row: which segments we mapped, then whose memory we read
        let row: String = (0..size)
            .map(|p| bit(p == rank || mapped[p].is_some()))
            .chain((0..size).map(read))
            .collect();
        let row = if own.is_some() {
            row
        } else {
            "0".repeat(2 * size)
        };
        store.set(&format!("shm_ok/{rank}"), row.as_bytes())?;
        let ok_keys: Vec<String> = (0..size).map(|p| format!("shm_ok/{p}")).collect();
        let waited = wait_keys(store, &ok_keys, timeout, peers, rank);
        // every peer has tried to map our segment (or we give up): the file can go
        if let Some(o) = own.as_mut() {
            o.unlink();
        }
        waited?;
        let mut matrix = Vec::with_capacity(size);
        let mut reads = Vec::with_capacity(size);
        for k in &ok_keys {
            let mut v = store.get(k)?;
            if v.len() != 2 * size {
                return Err(Error::Store(format!(
                    "shared-memory setup: bad row {:?} under {k}",
                    String::from_utf8_lossy(&v)
                )));
            }
            let r = v.split_off(size);
            matrix.push(v.into_iter().map(|b| b == b'1').collect::<Vec<bool>>());
            reads.push(r);
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
            detail: detail!(
                "rank ",
                Part::Rank(rank),
                ": shared-memory setup lost a segment it had mapped"
            ),
        };
        let own = match own {
            Some(o) if local.len() >= 2 => o,
            _ => return Ok((hosts, None)),
        };
        let li = local.iter().position(|&p| p == rank).unwrap_or(0);
        let all_of = |ok: &[u8]| {
            local
                .iter()
                .all(|&a| local.iter().all(|&b| ok.contains(&reads[a][b])))
        };
        let cma = all_of(b"12");
        let cma_gather = all_of(b"2");
        let local_pids = local.iter().map(|&p| pids[p].unwrap_or(0)).collect();
        if cma_mode == cma::Mode::Require && !cma_gather {
            return Err(Error::Backend {
                backend: "cpu".into(),
                detail: detail!(
                    "rank ",
                    Part::Rank(rank),
                    format!(
                        ": {}=require, but not every rank of this host can read the others' \
                         memory with process_vm_readv, or not every one asks to (seccomp, \
                         another pid namespace, Yama, or {0} other than all or require on \
                         some rank)",
                        cma::ENV
                    )
                ),
            });
        }
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
                cma,
                cma_gather,
                pids: local_pids,
                progress: Mutex::new(Progress::default()),
            }),
        ))
    }

    /// Notes in this rank's segment, before it shuts the group down after `e`, which rank it
    /// saw die (so that peers name that rank, not this one).
    pub(super) fn note_failure(&self, e: &Error) {
        let note = match e {
            Error::PeerFailed { peer, .. } => {
                (*peer as u32).saturating_add(1).min(NOTE_TIMED_OUT - 1)
            }
            Error::Timeout { .. } => NOTE_TIMED_OUT,
            _ => u32::MAX,
        };
        let own = &self.segs[self.li];
        let _ = own.blame().compare_exchange(
            0,
            note,
            std::sync::atomic::Ordering::AcqRel,
            std::sync::atomic::Ordering::Acquire,
        );
    }

    /// Whether this host's ranks read each other's memory directly (see `cma`) in
    /// reduce_scatter (`gathers` false) or in all_gather and gather (`gathers` true).
    pub(super) fn cma(&self, gathers: bool) -> bool {
        if gathers { self.cma_gather } else { self.cma }
    }

    /// The local index of group rank `r`, if it is on this host.
    pub(super) fn local_index(&self, r: usize) -> Option<usize> {
        self.local.iter().position(|&p| p == r)
    }
}

/// Waits until every rank `p` has set `keys[p]`, checking between short waits whether a
/// missing rank's TCP connection closed (it died during group creation: `PeerFailed` naming
/// it at once, not a timeout much later); `Timeout` naming the missing ranks after `timeout`.
fn wait_keys(
    store: &dyn Store,
    keys: &[String],
    timeout: Duration,
    peers: &[Option<Peer>],
    rank: usize,
) -> Result<()> {
    const OP: &str = "cpu backend init (shared-memory setup)";
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let deadline = Instant::now() + timeout;
    loop {
        let slice = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(1), Duration::from_millis(50));
        match store.wait(&refs, slice) {
            Ok(()) => return Ok(()),
            Err(Error::Timeout { .. }) => {}
            Err(e) => return Err(e),
        }
        let missing: Vec<usize> = (0..keys.len())
            .filter(|&p| !store.check(&[refs[p]]).unwrap_or(false))
            .collect();
        for &p in &missing {
            if peers
                .get(p)
                .and_then(Option::as_ref)
                .is_some_and(Peer::is_gone)
            {
                return Err(Error::PeerFailed {
                    rank,
                    peer: p,
                    op: OP.into(),
                    detail: detail!(
                        "rank ",
                        Part::Rank(p),
                        " died or failed while the group was being created"
                    ),
                });
            }
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                op: OP.into(),
                rank: rank as i64,
                timeout,
                detail: Detail::rank_names(&missing)
                    .join(" never finished the shared-memory setup (alive but stuck?)"),
            });
        }
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
    }
}
