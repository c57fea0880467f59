//! Receive buffers: new vectors for large tensors, allocated where the allocator can reuse
//! memory, with huge pages where they help (`tensorplay_core::memory::advise_huge_pages`).

use std::mem::MaybeUninit;
use std::sync::Mutex;

use crate::{Error, Result};

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
pub(super) fn new_vec_with<T: Copy + Send + 'static>(
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
    tensorplay_core::memory::advise_huge_pages(&mut v);
    // SAFETY: the capacity holds at least `bytes` bytes; MaybeUninit<u8> has no validity
    // requirement, so viewing the spare capacity as uninitialised bytes is sound.
    let buf =
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<MaybeUninit<u8>>(), bytes) };
    fill(buf)?;
    // SAFETY: `fill` initialised all `bytes` bytes, and every bit pattern is a valid T.
    unsafe { v.set_len(n) };
    Ok(v)
}
