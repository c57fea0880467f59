//! The step protocol of one call on shared memory (see the `shm` module docs): opening slots,
//! signatures, publishing steps, and waiting for peers (spin, then futex, with liveness and
//! deadline checks).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::segment;
use super::{Progress, Shm};
use crate::backend::cpu::conn::{Header, Kind, Peer};
use crate::{Detail, Error, Part, Result, detail};

/// Spin this long before sleeping on a futex.
const SPIN: Duration = Duration::from_micros(20);
/// Sleep at most this long between liveness and deadline checks.
const SLICE: Duration = Duration::from_millis(10);

/// `a >= b` for step numbers (the counters are 32-bit and wrap).
fn reached(a: u32, b: u64) -> bool {
    (a.wrapping_sub(b as u32) as i32) >= 0
}

/// One collective (or one shared-memory part of a hierarchical one) in progress.
pub(in crate::backend::cpu) struct ShmCtx<'a> {
    shm: &'a Shm,
    prog: std::sync::MutexGuard<'a, Progress>,
    /// The TCP connections by group rank (liveness).
    peers: &'a [Option<Peer>],
    rank: usize,
    timeout: Duration,
    /// When waiting gives up: `timeout` after the last progress (as on TCP, where the timeout
    /// bounds each wait for a peer, not the whole call).
    deadline: std::cell::Cell<Instant>,
    /// The signature written with each round's data: the call's header fields, the part of a
    /// hierarchical call, and the round.
    sig: [u8; 48],
    hdr: Header,
    /// The backend's bytes-sent counter (bytes written into our slots count as sent).
    sent: &'a std::sync::atomic::AtomicU64,
    /// Whether copies out of peers' slots bypass the cache (large calls).
    streaming: std::cell::Cell<bool>,
    op: &'static str,
}

impl<'a> ShmCtx<'a> {
    /// A context for the call described by `hdr` (part `part` of it).
    pub(in crate::backend::cpu) fn new(
        shm: &'a Shm,
        peers: &'a [Option<Peer>],
        hdr: &Header,
        part: u8,
        rank: usize,
        timeout: Duration,
        sent: &'a std::sync::atomic::AtomicU64,
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
            deadline: std::cell::Cell::new(Instant::now() + timeout),
            sig,
            hdr: *hdr,
            sent,
            streaming: std::cell::Cell::new(false),
            op: hdr.kind.name(),
        }
    }

    /// This rank (in the group).
    pub(in crate::backend::cpu) fn rank(&self) -> usize {
        self.rank
    }

    /// The group rank of local rank `li`.
    pub(in crate::backend::cpu) fn rank_of(&self, li: usize) -> usize {
        self.shm.local[li]
    }

    /// Number of ranks on this host.
    pub(in crate::backend::cpu) fn w(&self) -> usize {
        self.shm.local.len()
    }

    /// This rank's local index.
    pub(in crate::backend::cpu) fn li(&self) -> usize {
        self.shm.li
    }

    /// Slot bytes.
    pub(in crate::backend::cpu) fn slot(&self) -> usize {
        self.shm.slot
    }

    /// Starts a round: the slot every rank uses for it. When `writing`, first waits until
    /// every peer has finished reading what this rank last published in that slot.
    pub(in crate::backend::cpu) fn open_slot(&mut self, writing: bool) -> Result<usize> {
        let s = self.prog.next_slot;
        self.prog.next_slot ^= 1;
        let last = self.prog.last_pub[s];
        if writing && last > 0 {
            self.wait_all(last + 1)?;
        }
        Ok(s)
    }

    /// A pointer to this rank's slot `s` (`slot()` bytes).
    pub(in crate::backend::cpu) fn my_slot(&self, s: usize) -> *mut u8 {
        self.shm.segs[self.shm.li].data(s)
    }

    /// A pointer to local rank `li`'s slot `s`.
    pub(in crate::backend::cpu) fn slot_of(&self, li: usize, s: usize) -> *const u8 {
        self.shm.segs[li].data(s)
    }

    /// Writes the signature of round `round` into this rank's slot `s` (before publishing).
    pub(in crate::backend::cpu) fn write_sig(&self, s: usize, round: u64) {
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
    pub(in crate::backend::cpu) fn check_sig(&self, li: usize, s: usize, round: u64) -> Result<()> {
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
                detail!(
                    "rank ",
                    Part::Rank(self.rank),
                    format!(" called {} but rank ", self.hdr.describe()),
                    Part::Rank(peer),
                    format!(
                        " called {} (call #{} and #{} of the group, shared-memory part {} and \
                         {}, round {} and {})",
                        theirs.describe(),
                        self.hdr.seq,
                        theirs.seq,
                        want[3],
                        got[3],
                        round,
                        field(32),
                    )
                )
            }
            None => detail!(
                "rank ",
                Part::Rank(peer),
                "'s shared-memory slot holds no valid call signature (rank ",
                Part::Rank(self.rank),
                format!(" called {})", self.hdr.describe())
            ),
        };
        Err(Error::Mismatch {
            op: self.op.into(),
            detail,
        })
    }

    /// Waits until every peer has published step `x` and checks every peer's signature of
    /// round `round` in slot `s`.
    pub(in crate::backend::cpu) fn check_all(&self, s: usize, x: u64, round: u64) -> Result<()> {
        self.wait_all(x)?;
        for li in 0..self.w() {
            if li != self.shm.li {
                self.check_sig(li, s, round)?;
            }
        }
        Ok(())
    }

    /// Publishes the next step; `wrote` is the slot this rank wrote data into for it (or
    /// wrote into again, as the reduced slices of a two-shot all-reduce). Returns the step.
    pub(in crate::backend::cpu) fn publish(&mut self, wrote: Option<usize>) -> u64 {
        self.prog.step += 1;
        let x = self.prog.step;
        if let Some(s) = wrote {
            self.prog.last_pub[s] = x;
        }
        segment::publish_step(&self.shm.segs[self.shm.li], x as u32);
        x
    }

    /// Counts `n` bytes written into our slot for peers to read.
    pub(in crate::backend::cpu) fn count_sent(&self, n: usize) {
        self.sent.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Whether copies out of peers' slots use non-temporal stores.
    pub(in crate::backend::cpu) fn streaming(&self) -> bool {
        self.streaming.get()
    }

    /// Sets [`ShmCtx::streaming`] (for a call whose result is too large to stay in cache).
    pub(in crate::backend::cpu) fn set_streaming(&self, on: bool) {
        self.streaming.set(on);
    }

    /// The pid of local rank `li`'s process (cross-memory attach only).
    pub(super) fn pid_of(&self, li: usize) -> u32 {
        self.shm.pids[li]
    }

    /// The collective's name, for errors.
    pub(super) fn op(&self) -> &'static str {
        self.op
    }

    /// Whether local rank `li`'s connection has closed.
    pub(super) fn is_gone(&self, li: usize) -> bool {
        self.peers
            .get(self.shm.local[li])
            .and_then(Option::as_ref)
            .is_some_and(Peer::is_gone)
    }

    /// The error for local rank `li`, found gone (see `peer_gone`).
    pub(super) fn lost(&self, li: usize) -> Error {
        self.peer_gone(li, self.shm.local[li])
    }

    /// A peer made progress: the timeout counts from now.
    fn progressed(&self) {
        self.deadline.set(Instant::now() + self.timeout);
    }

    /// The error for local rank `li` (group rank `peer`) whose connection closed: it died, or
    /// it failed and shut the group down. In the second case it noted in its segment which
    /// rank it saw die, and that rank is the one to name (not the messenger).
    fn peer_gone(&self, li: usize, peer: usize) -> Error {
        let note = self.shm.segs[li].blame().load(Ordering::Acquire);
        let op = self.op.into();
        if note == super::NOTE_TIMED_OUT {
            return Error::Timeout {
                op,
                rank: self.rank as i64,
                timeout: self.timeout,
                detail: detail!(
                    "rank ",
                    Part::Rank(peer),
                    format!(
                        " timed out waiting in this shared-memory {} and shut the group down",
                        self.op
                    )
                ),
            };
        }
        match note.checked_sub(1).map(|r| r as usize) {
            Some(first) if first != self.rank && first != peer && note < super::NOTE_TIMED_OUT => {
                Error::PeerFailed {
                    rank: self.rank,
                    peer: first,
                    op,
                    detail: detail!(
                        "rank ",
                        Part::Rank(first),
                        " died or failed (rank ",
                        Part::Rank(peer),
                        " saw it first and shut the group down)"
                    ),
                }
            }
            _ => Error::PeerFailed {
                rank: self.rank,
                peer,
                op,
                detail: detail!(
                    "rank ",
                    Part::Rank(peer),
                    format!(
                        " died or failed inside a shared-memory {} (its connection closed)",
                        self.op
                    )
                ),
            },
        }
    }

    /// Waits until every peer on this host has published step `x`.
    pub(in crate::backend::cpu) fn wait_all(&self, x: u64) -> Result<()> {
        for li in 0..self.w() {
            if li != self.shm.li {
                self.wait_one(li, x)?;
            }
        }
        Ok(())
    }

    /// Waits until local rank `li` has published step `x`: spins briefly, then sleeps on its
    /// futex, checking its liveness and the deadline between sleeps.
    pub(in crate::backend::cpu) fn wait_one(&self, li: usize, x: u64) -> Result<()> {
        let seg = &self.shm.segs[li];
        let step = seg.step();
        if reached(step.load(Ordering::Acquire), x) {
            self.progressed();
            return Ok(());
        }
        let t0 = Instant::now();
        let mut n = 0u32;
        loop {
            std::hint::spin_loop();
            if reached(step.load(Ordering::Acquire), x) {
                self.progressed();
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
                self.progressed();
                return Ok(());
            }
            let left = self
                .deadline
                .get()
                .saturating_duration_since(Instant::now());
            segment::futex_wait(step, cur, left.min(SLICE).max(Duration::from_micros(100)));
            seg.sleepers().fetch_sub(1, Ordering::SeqCst);
            if reached(step.load(Ordering::Acquire), x) {
                self.progressed();
                return Ok(());
            }
            let peer = self.shm.local[li];
            if self
                .peers
                .get(peer)
                .and_then(Option::as_ref)
                .is_some_and(Peer::is_gone)
            {
                return Err(self.peer_gone(li, peer));
            }
            if Instant::now() >= self.deadline.get() {
                let behind: Vec<usize> = (0..self.w())
                    .filter(|&l| {
                        l != self.shm.li
                            && !reached(self.shm.segs[l].step().load(Ordering::Acquire), x)
                    })
                    .map(|l| self.shm.local[l])
                    .collect();
                return Err(Error::Timeout {
                    op: self.op.into(),
                    rank: self.rank as i64,
                    timeout: self.timeout,
                    detail: Detail::rank_names(&behind).join(format!(
                        " never reached this point of the shared-memory {} (still alive: stuck, \
                         or in another collective)",
                        self.op
                    )),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::reached;

    #[test]
    fn step_numbers_wrap() {
        assert!(reached(5, 5) && reached(6, 5) && !reached(4, 5));
        assert!(reached(2, u64::from(u32::MAX)), "the counters wrap");
    }
}
