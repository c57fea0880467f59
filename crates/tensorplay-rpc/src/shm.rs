//! The shared-memory path for large tensors between workers on one host.
//!
//! QUIC on loopback moves a few hundred MB/s (encryption and per-packet work, all on the CPU);
//! between processes of one host a tensor can instead be copied through shared memory at
//! memory speed. The path is chosen automatically per tensor: the sender uses it when the
//! tensor has at least [`min_bytes`] bytes and the receiver has confirmed, at `init_rpc`, that
//! it can read the sender's shared-memory directory. QUIC stays the path for everything else
//! (and between hosts): the frame still travels over the QUIC stream, with the tensor's bytes
//! replaced by a reference to a segment.
//!
//! # Design
//!
//! - **One directory per worker** (`/dev/shm/tensorplay-rpc-<pidns>-<pid>-<random>`, mode
//!   0700), created at `init_rpc` and removed at shutdown (and by a later `init_rpc` on this
//!   host if its process died: `tensorplay_collectives::shm_host::sweep`, shared with the
//!   `"cpu"` backend's shared-memory transport). It holds a `host` file with a random token.
//! - **Same host, confirmed**: each worker publishes `<dir>\n<token>` through the job's store;
//!   a peer that can open `<dir>/host` (a directory directly under `/dev/shm`, with our prefix,
//!   owned by our user, not a symlink) and read the same token shares this host's
//!   `/dev/shm` and may read the worker's segments. Each worker then publishes which peers it
//!   confirmed, and a sender uses the path only towards peers that confirmed it.
//! - **Segments**: files in the sender's directory, memory-mapped by the sender once and
//!   reused, so a transfer is one `memcpy` into pages that are already resident. A segment is
//!   named `<segment>.free` while free and `<segment>.<transfer>` while a transfer owns it;
//!   the sender claims a free one by renaming it (atomic), copies the tensor in, and sends
//!   `(segment, transfer)` in the frame. The receiver opens `<segment>.<transfer>`, copies
//!   from its read-only mapping of the segment (kept between transfers, see
//!   [`peer_mapping`]) into the new tensor's storage (allocated on one long-lived thread, see
//!   [`alloc_on_stable_thread`]), and gives the segment back by renaming it to
//!   `<segment>.free`. Transfer numbers are never reused, so a late or duplicate release can
//!   only ever touch its own transfer. A sender that fails before its frame was sent releases
//!   its claims itself; a receiver that fails after reading a header releases the segments it
//!   names.
//! - **Never trust names from the network**: a frame carries two numbers; the receiver builds
//!   the file name itself, inside the directory that the peer published and that was checked
//!   at `init_rpc`. Sizes are checked against the file before mapping.
//! - **Memory**: segments stay allocated while free (that is what makes them fast), up to a
//!   budget per worker ([`budget`], 1 GiB by default); over it, free segments are deleted and,
//!   failing that, the tensor travels over QUIC. A receiver keeps at most 32 peer segments
//!   mapped. A same-user process that truncates a segment while a receiver copies from it
//!   would crash that receiver (SIGBUS); workers never truncate segments, and other users
//!   cannot reach them (0700 directories).
//!
//! Settings (environment): `TENSORPLAY_RPC_SHM=0` turns the path off;
//! `TENSORPLAY_RPC_SHM_MIN_BYTES` (default 64 KiB) and `TENSORPLAY_RPC_SHM_BUDGET_MB`
//! (default 1024) tune it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::mem::MaybeUninit;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tensorplay_core::{DType, StorageElement, Tensor};

use crate::{Error, Result};

/// Where the directories live.
pub(crate) const ROOT: &str = "/dev/shm";
/// The prefix of every worker's directory.
const PREFIX: &str = "tensorplay-rpc-";
/// The token file inside a directory.
const HOST_FILE: &str = "host";
/// The smallest segment (capacities are powers of two from here).
const MIN_SEGMENT: usize = 64 << 10;

/// Whether the path is enabled (`TENSORPLAY_RPC_SHM`, default on).
pub(crate) fn enabled() -> bool {
    std::env::var("TENSORPLAY_RPC_SHM").map_or(true, |v| !matches!(v.trim(), "0" | "false" | "off"))
}

/// The smallest tensor, in bytes, sent through shared memory.
pub(crate) fn min_bytes() -> usize {
    std::env::var("TENSORPLAY_RPC_SHM_MIN_BYTES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(64 << 10)
}

/// The most bytes of segments one worker keeps.
pub(crate) fn budget() -> usize {
    std::env::var("TENSORPLAY_RPC_SHM_BUDGET_MB")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map_or(1 << 30, |mb| mb.saturating_mul(1 << 20))
}

fn shm_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Transport(format!("shared memory: {what}: {e}"))
}

use tensorplay_collectives::shm_host::{self, euid};

/// Random hex for directory names and tokens.
fn random_hex(n: usize) -> Result<String> {
    shm_host::random_hex(n).map_err(|e| shm_err("random bytes", e))
}

fn free_name(seg: u64) -> String {
    format!("{seg:016x}.free")
}

fn busy_name(seg: u64, xfer: u64) -> String {
    format!("{seg:016x}.{xfer:016x}")
}

// ---------------------------------------------------------------------------------------------
// mappings

/// A shared mapping of the first `len` bytes of a file.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; access is coordinated by the
// segment protocol (one transfer owns a segment at a time).
unsafe impl Send for Mapping {}
// SAFETY: as above; shared references only read the pointer and length.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `file`; a read-only mapping is populated at once (one
    /// call instead of a page fault per few pages, since it is read entirely right away).
    fn map(file: &File, len: usize, writable: bool) -> std::io::Result<Mapping> {
        use std::os::fd::AsRawFd;
        if len == 0 {
            return Err(std::io::Error::other("empty mapping"));
        }
        let (prot, flags) = if writable {
            (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED)
        } else {
            (libc::PROT_READ, libc::MAP_SHARED | libc::MAP_POPULATE)
        };
        // SAFETY: a fresh mapping chosen by the kernel (null hint) of an open file descriptor;
        // the result is checked for MAP_FAILED before use.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, file.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping { ptr: p.cast(), len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly what mmap returned; nothing borrows the mapping any more
        // (borrows never outlive the owner).
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// Advises the kernel to back `[ptr, ptr+len)` with huge pages where it is 2 MiB aligned: a
/// new tensor of many MiB then takes a few hundred page faults instead of thousands (the
/// faults, not the copy, dominate receiving a large tensor into fresh memory).
pub(crate) fn advise_huge(ptr: *mut u8, len: usize) {
    const HUGE: usize = 2 << 20;
    if len < 2 * HUGE {
        return;
    }
    let start = (ptr as usize).next_multiple_of(HUGE);
    let end = (ptr as usize + len) & !(HUGE - 1);
    if end > start {
        // SAFETY: advice on whole pages inside an allocation this process owns; MADV_HUGEPAGE
        // never changes the contents. Failure (THP off) is harmless and ignored.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

/// The error for a tensor whose storage cannot be allocated.
pub(crate) fn oom(bytes: usize, e: impl std::fmt::Display) -> Error {
    Error::Transport(format!(
        "cannot allocate {bytes} bytes for a received tensor: {e}"
    ))
}

/// Buffers of at least this size are allocated on [`alloc_on_stable_thread`].
const STABLE_ARENA_BYTES: usize = 4 << 20;

type AllocJob = Box<dyn FnOnce() + Send>;

/// Allocates an empty vector with room for `n` elements on one long-lived thread.
///
/// Why: glibc's malloc gives each thread an arena and returns an arena's emptied heap to the
/// kernel, so the receive buffers of large tensors, allocated on whichever thread runs the
/// transport at that moment (it moves between threads at every call), came from fresh
/// memory every time, and the kernel zeroing those pages cost as much as the copy itself
/// (perf: `clear_page_erms` a third of an echo's time at 16 MiB). Allocating them all on
/// one thread lets the allocator reuse the memory of the previous tensor once it was freed,
/// wherever it was freed. With another global allocator this costs one thread hand-off.
fn alloc_on_stable_thread<T: Send + 'static>(
    n: usize,
) -> std::result::Result<Vec<T>, std::collections::TryReserveError> {
    static JOBS: std::sync::LazyLock<Mutex<Option<std::sync::mpsc::Sender<AllocJob>>>> =
        std::sync::LazyLock::new(|| {
            let (tx, rx) = std::sync::mpsc::channel::<AllocJob>();
            let started = std::thread::Builder::new()
                .name("tp-rpc-alloc".into())
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        job();
                    }
                });
            Mutex::new(started.ok().map(|_| tx))
        });
    let alloc = move || {
        let mut v = Vec::<T>::new();
        v.try_reserve_exact(n).map(|()| v)
    };
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let sent = JOBS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .is_some_and(|jobs| {
            jobs.send(Box::new(move || {
                let _ = tx.send(alloc());
            }))
            .is_ok()
        });
    match (sent, rx) {
        (true, rx) => rx.recv().unwrap_or_else(|_| {
            let mut v = Vec::new();
            v.try_reserve_exact(n).map(|()| v)
        }),
        (false, _) => {
            let mut v = Vec::new();
            v.try_reserve_exact(n).map(|()| v)
        }
    }
}

/// A new vector of `n` elements whose bytes `fill` writes (every one of them).
///
/// # Safety contract
/// `T` must be a type for which every bit pattern is valid (f32, f64, i64, u8), and `fill`
/// must initialise the whole slice it is given or fail.
fn new_vec_with<T: Copy + Send + 'static>(
    n: usize,
    fill: impl FnOnce(&mut [MaybeUninit<u8>]) -> Result<()>,
) -> Result<Vec<T>> {
    let bytes = n * size_of::<T>();
    let mut v: Vec<T> = if bytes >= STABLE_ARENA_BYTES {
        alloc_on_stable_thread(n)
    } else {
        let mut v = Vec::new();
        v.try_reserve_exact(n).map(|()| v)
    }
    .map_err(|e| oom(bytes, e))?;
    advise_huge(v.as_mut_ptr().cast(), bytes);
    // SAFETY: the capacity holds at least `bytes` bytes; MaybeUninit<u8> has no validity
    // requirement, so viewing the spare capacity as uninitialised bytes is sound.
    let buf =
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<MaybeUninit<u8>>(), bytes) };
    fill(buf)?;
    // SAFETY: `fill` initialised all `bytes` bytes, and every bit pattern is a valid T.
    unsafe { v.set_len(n) };
    Ok(v)
}

// ---------------------------------------------------------------------------------------------
// the sender's directory and segments

struct Segment {
    id: u64,
    cap: usize,
    map: Mapping,
}

/// This worker's shared-memory directory: the segments it sends from.
pub(crate) struct ShmDir {
    path: PathBuf,
    token: String,
    min_bytes: usize,
    budget: usize,
    segments: Mutex<Vec<Arc<Segment>>>,
    next_segment: AtomicU64,
    next_transfer: AtomicU64,
    closed: AtomicBool,
}

impl ShmDir {
    /// Creates a fresh directory under `root` (after removing the directories of dead
    /// processes there).
    pub(crate) fn create(root: &Path, min_bytes: usize, budget: usize) -> Result<ShmDir> {
        shm_host::sweep(root, PREFIX);
        let name = shm_host::object_name(PREFIX).map_err(|e| shm_err("random bytes", e))?;
        let path = root.join(name);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(|e| shm_err(&format!("creating {}", path.display()), e))?;
        let token = random_hex(16)?;
        let dir = ShmDir {
            path,
            token,
            min_bytes: min_bytes.max(1),
            budget,
            segments: Mutex::new(Vec::new()),
            next_segment: AtomicU64::new(1),
            next_transfer: AtomicU64::new(1),
            closed: AtomicBool::new(false),
        };
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dir.path.join(HOST_FILE))
            .and_then(|mut f| f.write_all(dir.token.as_bytes()))
            .map_err(|e| shm_err("writing the host token", e))?;
        Ok(dir)
    }

    /// What peers need to find and confirm this directory (published through the store).
    pub(crate) fn advert(&self) -> String {
        format!("{}\n{}", self.path.display(), self.token)
    }

    /// The directory.
    #[cfg(test)]
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Whether a tensor of `bytes` bytes should take this path.
    pub(crate) fn wants(&self, bytes: usize) -> bool {
        bytes >= self.min_bytes && !self.closed.load(Ordering::Relaxed)
    }

    /// Claims a segment of at least `need` bytes for one transfer; `None` when none can be had
    /// within the budget (the tensor then goes inline).
    pub(crate) fn claim(&self, need: usize) -> Option<Claim> {
        if self.closed.load(Ordering::Relaxed) {
            return None;
        }
        let xfer = self.next_transfer.fetch_add(1, Ordering::Relaxed);
        let mut segs = self.segments.lock().unwrap_or_else(|e| e.into_inner());
        // the smallest free segment that fits (they are sorted by capacity)
        for s in segs.iter().filter(|s| s.cap >= need) {
            if std::fs::rename(
                self.path.join(free_name(s.id)),
                self.path.join(busy_name(s.id, xfer)),
            )
            .is_ok()
            {
                return Some(Claim {
                    dir: self.path.clone(),
                    seg: s.clone(),
                    xfer,
                    committed: false,
                });
            }
        }
        let cap = need.max(MIN_SEGMENT).checked_next_power_of_two()?;
        let mut total: usize = segs.iter().map(|s| s.cap).sum();
        if total + cap > self.budget {
            // delete free segments, largest first, until the new one fits
            let mut i = segs.len();
            while i > 0 && total + cap > self.budget {
                i -= 1;
                if std::fs::remove_file(self.path.join(free_name(segs[i].id))).is_ok() {
                    total -= segs[i].cap;
                    segs.remove(i);
                }
            }
            if total + cap > self.budget {
                return None;
            }
        }
        let id = self.next_segment.fetch_add(1, Ordering::Relaxed);
        let path = self.path.join(busy_name(id, xfer));
        let made = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .and_then(|f| {
                f.set_len(cap as u64)?;
                Mapping::map(&f, cap, true)
            });
        let map = match made {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(path = %path.display(), error = %e, "shared-memory segment not created; sending over QUIC");
                let _ = std::fs::remove_file(&path);
                return None;
            }
        };
        let seg = Arc::new(Segment { id, cap, map });
        let at = segs.partition_point(|s| s.cap <= cap);
        segs.insert(at, seg.clone());
        Some(Claim {
            dir: self.path.clone(),
            seg,
            xfer,
            committed: false,
        })
    }

    /// Removes the directory and forgets the segments (at shutdown); idempotent.
    pub(crate) fn close(&self) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        self.segments
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

impl Drop for ShmDir {
    fn drop(&mut self) {
        self.close();
    }
}

/// One transfer's hold on a segment. Dropped before [`Claim::commit`], it gives the segment
/// back (the frame was never sent).
pub(crate) struct Claim {
    dir: PathBuf,
    seg: Arc<Segment>,
    xfer: u64,
    committed: bool,
}

impl Claim {
    /// `(segment, transfer)`, what the frame carries.
    pub(crate) fn reference(&self) -> (u64, u64) {
        (self.seg.id, self.xfer)
    }

    /// Copies the tensor's row-major bytes to the start of the segment.
    pub(crate) fn write_tensor(&self, t: &Tensor) -> Result<()> {
        let t = t.contiguous()?;
        let n = t.numel();
        let bytes = n * t.dtype().size_in_bytes();
        if bytes > self.seg.cap {
            return Err(shm_err("segment", "smaller than the tensor"));
        }
        let dst = self.seg.map.ptr;
        fn copy<T: StorageElement>(t: &Tensor, n: usize, dst: *mut u8) -> Result<()> {
            t.with_cpu_data::<T, _>(|v, l| {
                let src = &v[l.offset()..l.offset() + n];
                // SAFETY: the segment holds at least size_of_val(src) bytes (checked by the
                // caller), this claim owns the segment (the rename protocol), and the source is
                // a live slice that cannot overlap a fresh shared mapping.
                unsafe {
                    std::ptr::copy_nonoverlapping(src.as_ptr().cast::<u8>(), dst, size_of_val(src));
                }
            })?;
            Ok(())
        }
        match t.dtype() {
            DType::F32 => copy::<f32>(&t, n, dst),
            DType::F64 => copy::<f64>(&t, n, dst),
            DType::I64 => copy::<i64>(&t, n, dst),
            DType::Bool => copy::<bool>(&t, n, dst),
        }
    }

    /// The frame was sent: the receiver gives the segment back from now on.
    pub(crate) fn commit(mut self) {
        self.committed = true;
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.committed {
            release(&self.dir, self.seg.id, self.xfer);
        }
    }
}

/// Gives a segment back to its owner (renames `<segment>.<transfer>` to `<segment>.free`);
/// a no-op when that transfer's file is gone already.
pub(crate) fn release(dir: &Path, seg: u64, xfer: u64) {
    let _ = std::fs::rename(dir.join(busy_name(seg, xfer)), dir.join(free_name(seg)));
}

// ---------------------------------------------------------------------------------------------
// the receiver's side

/// Reads a tensor of `n` elements of `dtype` from the peer's segment, then gives the segment
/// back (whether or not the read succeeded).
pub(crate) fn read_tensor(
    dir: &Path,
    seg: u64,
    xfer: u64,
    dtype: DType,
    n: usize,
    shape: &[usize],
) -> Result<Tensor> {
    let r = read_inner(dir, seg, xfer, dtype, n, shape);
    release(dir, seg, xfer);
    r
}

fn read_inner(
    dir: &Path,
    seg: u64,
    xfer: u64,
    dtype: DType,
    n: usize,
    shape: &[usize],
) -> Result<Tensor> {
    let bytes = n
        .checked_mul(dtype.size_in_bytes())
        .ok_or_else(|| Error::Serialization("tensor size overflows".into()))?;
    let path = dir.join(busy_name(seg, xfer));
    // O_NONBLOCK: a FIFO planted under the name cannot block us (regular files ignore it)
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path)
        .map_err(|e| shm_err(&format!("opening the peer's segment {}", path.display()), e))?;
    let meta = file.metadata().map_err(|e| shm_err("segment", e))?;
    // the sender wrote the bytes, so the file holds real pages for them (a sparse file that
    // only claims a size cannot make us allocate memory the peer never committed)
    if !meta.is_file()
        || meta.len() < bytes as u64
        || meta.blocks().saturating_mul(512) < bytes as u64
        || meta.uid() != euid()
    {
        return Err(Error::Serialization(format!(
            "the peer's shared-memory segment {} cannot hold the {bytes} bytes its message describes",
            path.display()
        )));
    }
    if bytes == 0 {
        return tensor_of(dtype, shape, |_| Ok(()), n);
    }
    let map =
        peer_mapping(dir, seg, &file, &meta, bytes).map_err(|e| shm_err("mapping a segment", e))?;
    drop(file);
    tensor_of(
        dtype,
        shape,
        |dst| {
            // SAFETY: the mapping is at least `bytes` long (the file was checked to be at
            // least that long; the owner never shrinks a segment), `dst` is `bytes` long, and
            // the two cannot overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(map.ptr, dst.as_mut_ptr().cast::<u8>(), bytes);
            }
            Ok(())
        },
        n,
    )
}

/// A peer's segment as this worker mapped it.
struct PeerMap {
    dev: u64,
    ino: u64,
    map: Arc<Mapping>,
    used: u64,
}

/// At most this many peer segments stay mapped.
const MAX_PEER_MAPS: usize = 32;

type PeerMaps = std::collections::HashMap<(PathBuf, u64), PeerMap>;

static PEER_MAPS: std::sync::LazyLock<Mutex<(PeerMaps, u64)>> =
    std::sync::LazyLock::new(|| Mutex::new((PeerMaps::new(), 0)));

/// A read-only mapping of at least the first `bytes` bytes of a peer's segment, kept between
/// transfers: mapping (populating the page tables) and unmapping a segment per transfer was
/// about 12% of a 16 MiB echo. A segment keeps its file (inode and size) for its life and
/// segment numbers are never reused, so a kept mapping sees the data of every later transfer
/// through the same segment; the inode is compared anyway. The least recently used mapping
/// goes when more than [`MAX_PEER_MAPS`] are kept, and all go at shutdown.
fn peer_mapping(
    dir: &Path,
    seg: u64,
    file: &File,
    meta: &std::fs::Metadata,
    bytes: usize,
) -> std::io::Result<Arc<Mapping>> {
    let mut g = PEER_MAPS.lock().unwrap_or_else(|e| e.into_inner());
    let (maps, tick) = &mut *g;
    *tick += 1;
    let key = (dir.to_path_buf(), seg);
    if let Some(m) = maps.get_mut(&key)
        && m.dev == meta.dev()
        && m.ino == meta.ino()
        && m.map.len >= bytes
    {
        m.used = *tick;
        return Ok(m.map.clone());
    }
    let map = Arc::new(Mapping::map(file, bytes, false)?);
    if maps.len() >= MAX_PEER_MAPS
        && !maps.contains_key(&key)
        && let Some(oldest) = maps
            .iter()
            .min_by_key(|(_, m)| m.used)
            .map(|(k, _)| k.clone())
    {
        maps.remove(&oldest);
    }
    maps.insert(
        key,
        PeerMap {
            dev: meta.dev(),
            ino: meta.ino(),
            map: map.clone(),
            used: *tick,
        },
    );
    Ok(map)
}

/// Unmaps every peer segment kept by [`peer_mapping`] (at shutdown).
pub(crate) fn forget_peer_mappings() {
    PEER_MAPS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .0
        .clear();
}

/// A new tensor whose `n` elements' bytes `fill` writes.
fn tensor_of(
    dtype: DType,
    shape: &[usize],
    fill: impl FnOnce(&mut [MaybeUninit<u8>]) -> Result<()>,
    n: usize,
) -> Result<Tensor> {
    Ok(match dtype {
        DType::F32 => Tensor::from_vec(new_vec_with::<f32>(n, fill)?, shape)?,
        DType::F64 => Tensor::from_vec(new_vec_with::<f64>(n, fill)?, shape)?,
        DType::I64 => Tensor::from_vec(new_vec_with::<i64>(n, fill)?, shape)?,
        DType::Bool => {
            let v = new_vec_with::<u8>(n, fill)?;
            if v.iter().any(|&b| b > 1) {
                return Err(Error::Serialization(
                    "a bool tensor with bytes other than 0 and 1".into(),
                ));
            }
            Tensor::from_vec(v.into_iter().map(|b| b == 1).collect::<Vec<bool>>(), shape)?
        }
    })
}

// ---------------------------------------------------------------------------------------------
// confirming peers, sweeping

/// The directory a peer published, when this process can read it: a directory directly under
/// `root` with our prefix and safe characters, owned by our user, not a symlink, whose `host`
/// file holds the published token.
pub(crate) fn confirm_peer(root: &Path, advert: &[u8]) -> Option<PathBuf> {
    let s = std::str::from_utf8(advert).ok()?;
    let (path, token) = s.split_once('\n')?;
    let path = Path::new(path);
    if !shm_host::check_name(root, path, PREFIX) || token.is_empty() {
        return None;
    }
    let meta = std::fs::symlink_metadata(path).ok()?;
    if !meta.is_dir() || meta.uid() != euid() {
        return None;
    }
    let mut got = String::new();
    shm_host::open_owned(&path.join(HOST_FILE), false)?
        .take(256)
        .read_to_string(&mut got)
        .ok()?;
    (got == token).then(|| path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> PathBuf {
        // a private root, so the tests neither see nor sweep anything else
        let base = if Path::new(ROOT).is_dir() {
            PathBuf::from(ROOT)
        } else {
            std::env::temp_dir()
        };
        let p = base.join(format!(
            "tp-shm-test-{}-{}",
            std::process::id(),
            random_hex(4).unwrap()
        ));
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_tensor_goes_through_a_segment_and_the_segment_is_reused() {
        let root = root();
        let dir = ShmDir::create(&root, 1, 1 << 30).unwrap();
        let peer = confirm_peer(&root, dir.advert().as_bytes()).expect("own directory confirmed");
        let x = Tensor::from_vec(
            (0..100_000).map(|i| i as f32).collect::<Vec<f32>>(),
            &[100, 1000],
        )
        .unwrap();
        for round in 0..3 {
            // new values each round: the receiver's kept mapping sees every transfer's data
            let x = x.mul_scalar(f64::from(round)).unwrap();
            let c = dir.claim(400_000).unwrap();
            c.write_tensor(&x).unwrap();
            let (seg, xfer) = c.reference();
            c.commit();
            assert_eq!(seg, 1, "round {round}: the one segment is reused");
            let y = read_tensor(&peer, seg, xfer, DType::F32, 100_000, &[100, 1000]).unwrap();
            assert_eq!(y.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
            assert_eq!(entries(dir.path()), vec!["0000000000000001.free", "host"]);
        }
        // views travel as their logical values; other dtypes too
        let t = x.t().unwrap();
        let c = dir.claim(400_000).unwrap();
        c.write_tensor(&t).unwrap();
        let (seg, xfer) = c.reference();
        c.commit();
        let y = read_tensor(&peer, seg, xfer, DType::F32, 100_000, &[1000, 100]).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), t.to_vec::<f32>().unwrap());
        let b = Tensor::from_vec(vec![true, false, true], &[3]).unwrap();
        let c = dir.claim(3).unwrap();
        c.write_tensor(&b).unwrap();
        let (seg, xfer) = c.reference();
        c.commit();
        let y = read_tensor(&peer, seg, xfer, DType::Bool, 3, &[3]).unwrap();
        assert_eq!(y.to_vec::<bool>().unwrap(), vec![true, false, true]);
        dir.close();
        assert!(!peer.exists());
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn an_unsent_claim_is_given_back_and_bad_references_are_errors() {
        let root = root();
        let dir = ShmDir::create(&root, 1, 1 << 30).unwrap();
        let peer = confirm_peer(&root, dir.advert().as_bytes()).unwrap();
        let c = dir.claim(1000).unwrap();
        let (seg, xfer) = c.reference();
        drop(c); // never committed: back to free
        assert_eq!(entries(dir.path()), vec![free_name(seg), "host".into()]);
        // a transfer that does not exist, or a segment too small for what the frame claims
        assert!(read_tensor(&peer, seg, xfer, DType::F32, 10, &[10]).is_err());
        let c = dir.claim(1000).unwrap();
        let (seg, xfer) = c.reference();
        c.commit();
        assert!(read_tensor(&peer, seg, xfer, DType::F64, 1 << 20, &[1 << 20]).is_err());
        // the failed read still gave the segment back
        assert_eq!(entries(dir.path()), vec![free_name(seg), "host".into()]);
        // a bool segment holding other bytes
        let x = Tensor::from_vec(vec![7i64; 4], &[4]).unwrap();
        let c = dir.claim(32).unwrap();
        c.write_tensor(&x).unwrap();
        let (seg, xfer) = c.reference();
        c.commit();
        assert!(read_tensor(&peer, seg, xfer, DType::Bool, 32, &[32]).is_err());
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn the_budget_bounds_the_segments() {
        let root = root();
        let dir = ShmDir::create(&root, 1, 256 << 10).unwrap();
        let a = dir.claim(100 << 10).unwrap(); // a 128 KiB segment
        let b = dir.claim(100 << 10).unwrap(); // another: 256 KiB in all
        assert!(dir.claim(10).is_none(), "over the budget with both in use");
        // both given back; neither fits a larger one, so both are deleted to make room for it
        drop(a);
        drop(b);
        let c = dir.claim(200 << 10).unwrap();
        assert_eq!(c.seg.cap, 256 << 10);
        drop(c);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn only_real_directories_with_the_token_are_confirmed() {
        let root = root();
        let dir = ShmDir::create(&root, 1, 1 << 30).unwrap();
        let ad = dir.advert();
        assert!(confirm_peer(&root, ad.as_bytes()).is_some());
        let (path, _) = ad.split_once('\n').unwrap();
        // wrong token, outside the root, traversal, a symlink, garbage
        assert!(confirm_peer(&root, format!("{path}\nbad").as_bytes()).is_none());
        assert!(confirm_peer(&std::env::temp_dir().join("elsewhere"), ad.as_bytes()).is_none());
        let sneaky = format!("{}/{PREFIX}x/../../etc\n{}", root.display(), dir.token);
        assert!(confirm_peer(&root, sneaky.as_bytes()).is_none());
        let link = root.join(format!("{PREFIX}link"));
        std::os::unix::fs::symlink(dir.path(), &link).unwrap();
        let via_link = format!("{}\n{}", link.display(), dir.token);
        assert!(confirm_peer(&root, via_link.as_bytes()).is_none());
        // a FIFO as the token file neither blocks nor confirms
        let fifo_dir = root.join(format!("{PREFIX}fifo"));
        std::fs::create_dir(&fifo_dir).unwrap();
        let fifo = std::ffi::CString::new(fifo_dir.join(HOST_FILE).to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let via_fifo = format!("{}\n{}", fifo_dir.display(), dir.token);
        assert!(confirm_peer(&root, via_fifo.as_bytes()).is_none());
        assert!(confirm_peer(&root, b"\xff\xfe").is_none());
        assert!(confirm_peer(&root, b"").is_none());
        let _ = std::fs::remove_dir_all(&root);
    }
}
