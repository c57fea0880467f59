//! One rank's shared-memory segment: its layout, creation (reserved up front, mode 0600),
//! mapping a peer's segment after checking it, and the futex that peers wait on.
//!
//! Layout (all offsets in bytes; the segment is `HEADER + 2 * (SIG + slot)` long):
//!
//! | offset | what |
//! |---|---|
//! | 0 | magic `TPSHMCC1` |
//! | 8 | the slot size in bytes (u64) |
//! | 16 | the owner's random token (32 ASCII hex digits) |
//! | 128 | `step`: the owner's published step counter (u32, the futex word) |
//! | 192 | `sleepers`: how many peers sleep on `step` (u32) |
//! | 256 | `blame`: after the owner failed, 1 + the group rank it saw die, `u32::MAX - 1` if it timed out, `u32::MAX` otherwise |
//! | 4096 + i * (SIG + slot) | slot `i` (0 or 1): a 64-byte signature, then `slot` bytes of data |
//!
//! Only the owner writes its segment's `step`, signatures and slots; peers write only
//! `sleepers`. Who may read or write a slot when is the step protocol's business (see the
//! module docs of `shm`).

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::shm_host::{self, MapMode, Mmap};

const MAGIC: &[u8; 8] = b"TPSHMCC1";
/// Bytes before the first slot.
pub(super) const HEADER: usize = 4096;
/// Bytes of a slot's signature.
pub(super) const SIG: usize = 64;
const TOKEN_AT: usize = 16;
const TOKEN_LEN: usize = 32;
const STEP_AT: usize = 128;
const SLEEPERS_AT: usize = 192;
const BLAME_AT: usize = 256;
/// The prefix of every segment's name under `/dev/shm`.
pub(super) const PREFIX: &str = "tensorplay-cc-";

/// A shared read-write mapping of a whole segment.
pub(super) struct Segment {
    map: Mmap,
    slot: usize,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("len", &self.map.len())
            .field("slot", &self.slot)
            .finish()
    }
}

/// The segment length for slots of `slot` bytes.
pub(super) fn segment_len(slot: usize) -> usize {
    HEADER + 2 * (SIG + slot)
}

/// Why this rank has no segment of its own.
#[derive(Debug)]
pub(super) enum CreateError {
    /// `/dev/shm` is full (or too small): fall back to TCP.
    NoSpace(io::Error),
    /// Anything else (no `/dev/shm`, no permission): fall back to TCP too.
    Other(io::Error),
    /// The transport is turned off (`TENSORPLAY_SHM=0`).
    Off,
}

/// This rank's own segment while its file still exists (unlinked by [`OwnSegment::unlink`]
/// once every peer has had its chance to map it, and on drop at the latest).
pub(super) struct OwnSegment {
    seg: Option<Segment>,
    pub(super) path: Option<PathBuf>,
    pub(super) token: String,
}

impl OwnSegment {
    /// Creates a segment with slots of `slot` bytes under `root` (after sweeping the segments
    /// of dead processes there). The file is created exclusively with mode 0600 and its space
    /// reserved with `fallocate`, so that a full `/dev/shm` is an error here and never a
    /// SIGBUS later.
    pub(super) fn create(root: &Path, slot: usize) -> Result<OwnSegment, CreateError> {
        shm_host::sweep(root, PREFIX);
        let name = shm_host::object_name(PREFIX).map_err(CreateError::Other)?;
        let token = shm_host::random_hex(TOKEN_LEN / 2).map_err(CreateError::Other)?;
        let path = root.join(name);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(CreateError::Other)?;
        let len = segment_len(slot);
        let cleanup = |e: io::Error| {
            let _ = std::fs::remove_file(&path);
            e
        };
        // SAFETY: fallocate on a descriptor we own, for a range starting at 0 of `len` bytes.
        let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) };
        if r != 0 {
            let e = cleanup(io::Error::last_os_error());
            return Err(match e.raw_os_error() {
                Some(libc::ENOSPC) | Some(libc::EDQUOT) => CreateError::NoSpace(e),
                _ => CreateError::Other(e),
            });
        }
        let map = Mmap::map(&file, len, MapMode::ReadWrite)
            .map_err(|e| CreateError::Other(cleanup(e)))?;
        let ptr = map.as_ptr();
        let seg = Segment { map, slot };
        // SAFETY: the header lies inside the fresh mapping, which nobody else knows of yet.
        unsafe {
            std::ptr::copy_nonoverlapping(MAGIC.as_ptr(), ptr, 8);
            std::ptr::copy_nonoverlapping((slot as u64).to_le_bytes().as_ptr(), ptr.add(8), 8);
            std::ptr::copy_nonoverlapping(token.as_ptr(), ptr.add(TOKEN_AT), TOKEN_LEN);
        }
        Ok(OwnSegment {
            seg: Some(seg),
            path: Some(path),
            token,
        })
    }

    /// Unlinks the file and keeps only the mapping.
    pub(super) fn into_segment(mut self) -> Option<Segment> {
        self.unlink();
        self.seg.take()
    }

    /// Removes the file (the mappings stay valid).
    pub(super) fn unlink(&mut self) {
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Drop for OwnSegment {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// Maps the segment a peer advertised as `path` with `token` and slots of `slot` bytes, when
/// this process can: the path is one of ours directly under `root`, the file is a regular
/// file of this user with its space really allocated, and its header holds the same magic,
/// slot size and token. `None` otherwise (the peer then counts as on another host).
pub(super) fn map_peer(root: &Path, path: &Path, token: &str, slot: usize) -> Option<Segment> {
    if !shm_host::check_name(root, path, PREFIX) || token.len() != TOKEN_LEN {
        return None;
    }
    let file = shm_host::open_owned(path, true)?;
    let meta = file.metadata().ok()?;
    let len = segment_len(slot);
    if meta.len() != len as u64 || meta.blocks().saturating_mul(512) < len as u64 {
        return None;
    }
    let map = Mmap::map(&file, len, MapMode::ReadWrite).ok()?;
    let ptr = map.as_ptr();
    let seg = Segment { map, slot };
    // SAFETY: the header lies inside the mapping; the owner wrote it before advertising the
    // segment and never writes it again.
    let ok = unsafe {
        std::slice::from_raw_parts(ptr, 8) == MAGIC
            && std::slice::from_raw_parts(ptr.add(8), 8) == (slot as u64).to_le_bytes()
            && std::slice::from_raw_parts(ptr.add(TOKEN_AT), TOKEN_LEN) == token.as_bytes()
    };
    ok.then_some(seg)
}

impl Segment {
    fn atomic(&self, at: usize) -> &AtomicU32 {
        // SAFETY: `at` is a 4-aligned offset inside the header of a live, page-aligned
        // mapping; the word is only ever accessed atomically, by every process.
        unsafe { &*self.map.as_ptr().add(at).cast::<AtomicU32>() }
    }

    /// The owner's step counter.
    pub(super) fn step(&self) -> &AtomicU32 {
        self.atomic(STEP_AT)
    }

    /// How many peers sleep on the step counter.
    pub(super) fn sleepers(&self) -> &AtomicU32 {
        self.atomic(SLEEPERS_AT)
    }

    /// The owner's failure note (see the layout).
    pub(super) fn blame(&self) -> &AtomicU32 {
        self.atomic(BLAME_AT)
    }

    /// Slot `i`'s signature area (SIG bytes).
    pub(super) fn sig(&self, i: usize) -> *mut u8 {
        // SAFETY: inside the mapping (i is 0 or 1).
        unsafe { self.map.as_ptr().add(HEADER + (i & 1) * (SIG + self.slot)) }
    }

    /// Slot `i`'s data area (`slot` bytes, 64-byte aligned).
    pub(super) fn data(&self, i: usize) -> *mut u8 {
        // SAFETY: inside the mapping (i is 0 or 1).
        unsafe { self.sig(i).add(SIG) }
    }
}

/// Sleeps while `word == expected`, at most `t` (a shared futex: the word is in memory other
/// processes map). Returns early on a wake-up, a signal, or when the word changed.
pub(super) fn futex_wait(word: &AtomicU32, expected: u32, t: Duration) {
    let ts = libc::timespec {
        tv_sec: t.as_secs() as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid, aligned u32 that lives as long as this call, with a valid
    // relative timeout; every outcome (woken, timed out, EAGAIN, EINTR) is fine for the
    // caller, which re-checks the word.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every process sleeping on `word`.
pub(super) fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned u32; it only wakes waiters.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Stores `v` into this segment's step counter and wakes sleepers, if any. The store and the
/// load of `sleepers` are both SeqCst, and so are the sleeper's increment and re-check in
/// [`super::wait`]: either we see the sleeper or it sees the new value.
pub(super) fn publish_step(seg: &Segment, v: u32) {
    seg.step().store(v, Ordering::SeqCst);
    if seg.sleepers().load(Ordering::SeqCst) > 0 {
        futex_wake(seg.step());
    }
}
