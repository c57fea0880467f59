//! The caching allocator of host tensors (PyTorch's CUDA caching allocator, for the CPU): a
//! freed tensor's buffer is kept in a size class and handed to the next tensor of that class,
//! so a training step reuses the same memory instead of asking the system (and faulting its
//! pages in) for every intermediate.
//!
//! - **Size classes**: a request of `b` bytes is rounded up to a multiple of an eighth of the
//!   next power of two (at most 12.5% waste); buffers below [`MIN_CACHED_BYTES`] are not cached
//!   (the system allocator serves them well). A class keeps a returned buffer only while fewer
//!   of its buffers are back than were handed out ([`take`]): the buffers of producers that
//!   allocate without the cache go back to the system instead of filling it, so a class never
//!   caches more buffers than its takers held at once.
//! - **Bound**: the cache holds at most [`cache_limit_bytes`] (256 MiB unless
//!   `TENSORPLAY_CPU_CACHE_MIB` says otherwise); a buffer that would exceed it is freed.
//! - **Release when idle**: every [`SWEEP_EVERY`] returned buffers, each class frees the
//!   buffers that sat in it unused since the previous sweep (its low-water mark: the fewest
//!   buffers it held at any moment in between), so memory a phase of the program stopped using
//!   goes back to the system, and so do the surplus buffers of a class that more buffers are
//!   returned to than taken from (outputs of producers that allocate without the cache).
//!   [`empty_cache`] frees everything.
//! - **Statistics** ([`allocated_bytes`], [`reserved_bytes`], [`peak_allocated_bytes`]) count
//!   the buffers of live host tensors by their capacity, as PyTorch counts blocks.
//!
//! A buffer is handed out by [`take`] with whatever values it held (every caller overwrites all
//! of it), so reuse costs no clearing; [`try_take_filled`] (zeros, `full`) sets every element.
//! Scratch buffers that never become a tensor's go back through [`give_back`]. New buffers of
//! 4 MiB or more are advised huge pages (`huge_pages.rs`). Thread-safe: one lock, held only to
//! push or pop a buffer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use super::{CpuStorage, StorageElement};
use crate::DType;

/// Buffers smaller than this are left to the system allocator.
pub(crate) const MIN_CACHED_BYTES: usize = 16 << 10;
/// Returned buffers between two sweeps of idle classes.
pub(crate) const SWEEP_EVERY: usize = 4096;

static ALLOCATED: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static CACHED: AtomicUsize = AtomicUsize::new(0);

#[derive(Default)]
struct Class {
    free: Vec<CpuStorage>,
    /// The fewest buffers `free` held since the last sweep: that many sat unused throughout.
    low: usize,
    /// Whether a buffer of the class was asked for since the last sweep.
    asked: bool,
    /// Buffers handed out by [`take`] and not yet back: the class keeps a returned buffer only
    /// while this is above zero.
    out: usize,
}

impl Class {
    /// A cached buffer, the newest (its pages are the likeliest to be resident).
    fn pop(&mut self) -> Option<CpuStorage> {
        self.asked = true;
        self.out += 1;
        let s = self.free.pop();
        self.low = self.low.min(self.free.len());
        s
    }
}

#[derive(Default)]
struct Cache {
    classes: HashMap<(DType, usize), Class>,
    returns: usize,
}

fn cache() -> &'static Mutex<Cache> {
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

fn lock() -> std::sync::MutexGuard<'static, Cache> {
    cache().lock().unwrap_or_else(|e| e.into_inner())
}

/// The cache's bound without `TENSORPLAY_CPU_CACHE_MIB`, in MiB.
const DEFAULT_CACHE_MIB: usize = 256;

/// The bytes a `TENSORPLAY_CPU_CACHE_MIB` value means, `None` when it is not a whole number of
/// MiB whose bytes fit a `usize`.
fn cache_bytes_of(v: &str) -> Option<usize> {
    v.trim().parse::<usize>().ok()?.checked_mul(1 << 20)
}

/// The most bytes the cache keeps: `TENSORPLAY_CPU_CACHE_MIB` MiB (a whole number; `0` turns
/// the cache off), else 256 MiB. A value that is not a whole number, or whose bytes do not fit
/// a `usize`, is reported on standard error and the default used.
pub fn cache_limit_bytes() -> usize {
    static LIMIT: OnceLock<usize> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        let Ok(v) = std::env::var("TENSORPLAY_CPU_CACHE_MIB") else {
            return DEFAULT_CACHE_MIB << 20;
        };
        match cache_bytes_of(&v) {
            Some(b) => b,
            None => {
                crate::kernels::warn_once(
                    "TENSORPLAY_CPU_CACHE_MIB",
                    &format!(
                        "TENSORPLAY_CPU_CACHE_MIB={v:?} is not a whole number of MiB that fits \
                         this machine's addresses; using {DEFAULT_CACHE_MIB}"
                    ),
                );
                DEFAULT_CACHE_MIB << 20
            }
        }
    })
}

/// The size class of `bytes`: rounded up to an eighth of the next power of two.
fn class_of(bytes: usize) -> usize {
    let p = bytes.next_power_of_two();
    let step = (p / 8).max(1);
    bytes.div_ceil(step) * step
}

/// A buffer of `n` elements of `T`: a cached one of the class (holding old values) or a new
/// one of the class's capacity (zeros). Every element must be written before it is read.
/// Aborts when memory runs out, as `Vec` does.
pub(crate) fn take<T: StorageElement>(n: usize) -> Vec<T> {
    try_take(n, None).unwrap_or_else(|_| {
        let bytes = n.saturating_mul(size_of::<T>()).max(1);
        let layout = std::alloc::Layout::from_size_align(bytes, align_of::<T>())
            .unwrap_or(std::alloc::Layout::new::<T>());
        std::alloc::handle_alloc_error(layout)
    })
}

/// A buffer of `n` elements of `T`, every one `value`, from the cache when it has one (as
/// [`take`]); an error instead of an abort when memory runs out.
pub(crate) fn try_take_filled<T: StorageElement>(
    n: usize,
    value: T,
) -> Result<Vec<T>, std::collections::TryReserveError> {
    try_take(n, Some(value))
}

/// [`take`] and [`try_take_filled`]: with `fill`, every element is set to it; without, a cached
/// buffer keeps its old values.
fn try_take<T: StorageElement>(
    n: usize,
    fill: Option<T>,
) -> Result<Vec<T>, std::collections::TryReserveError> {
    let value = fill.unwrap_or_default();
    let mut v = Vec::new();
    // sizes past what an allocation can hold go the uncached way, where reserving fails
    let bytes = n
        .checked_mul(size_of::<T>())
        .filter(|&b| b <= isize::MAX as usize / 2);
    let Some(bytes) = bytes.filter(|&b| b >= MIN_CACHED_BYTES) else {
        v.try_reserve_exact(n)?;
        v.resize(n, value);
        return Ok(v);
    };
    let class = class_of(bytes);
    let found = {
        let mut c = lock();
        c.classes.entry((T::DTYPE, class)).or_default().pop()
    };
    if let Some(s) = found {
        let cap = capacity_bytes(&s);
        CACHED.fetch_sub(cap, Ordering::Relaxed);
        if let Ok(mut v) = T::into_vec(s) {
            v.truncate(n);
            if fill.is_some() {
                v.fill(value);
            }
            v.resize(n, value);
            return Ok(v);
        }
    }
    if let Err(e) = v.try_reserve_exact(class / size_of::<T>().max(1)) {
        // nothing was handed out after all
        if let Some(k) = lock().classes.get_mut(&(T::DTYPE, class)) {
            k.out = k.out.saturating_sub(1);
        }
        return Err(e);
    }
    super::huge_pages::advise_huge_pages(&mut v);
    v.resize(n, value);
    Ok(v)
}

/// Gives a buffer from [`take`] that never became a tensor's (a scratch copy) back to the
/// cache, so its class can hand it out again instead of asking the system for fresh pages.
/// Buffers the cache does not take are freed, as when a tensor's buffer is.
pub(crate) fn give_back<T: StorageElement>(v: Vec<T>) {
    // never counted as allocated: it was not a tensor's
    on_free(Some(T::into_storage(v)), 0);
}

/// The bytes a storage's buffer occupies (its capacity).
pub(crate) fn capacity_bytes(s: &CpuStorage) -> usize {
    match s {
        CpuStorage::F32(v) => v.capacity() * 4,
        CpuStorage::F64(v) => v.capacity() * 8,
        CpuStorage::I64(v) => v.capacity() * 8,
        CpuStorage::Bool(v) => v.capacity(),
        CpuStorage::BF16(v) => v.capacity() * 2,
        CpuStorage::F16(v) => v.capacity() * 2,
    }
}

/// A live tensor's buffer of `bytes` was made.
pub(crate) fn on_alloc(bytes: usize) {
    let now = ALLOCATED.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

/// A live tensor's buffer (counted as `counted` bytes when made) was freed: a host buffer goes
/// to the cache when its class fits the bound.
pub(crate) fn on_free(s: Option<CpuStorage>, counted: usize) {
    ALLOCATED.fetch_sub(counted, Ordering::Relaxed);
    let Some(s) = s else {
        return;
    };
    let cap = capacity_bytes(&s);
    if cap < MIN_CACHED_BYTES || class_of(cap) != cap {
        return;
    }
    if CACHED.load(Ordering::Relaxed) + cap > cache_limit_bytes() {
        return;
    }
    // what a sweep took out of the cache, or the buffer itself when its class is not kept
    let (swept, refused) = {
        let mut c = lock();
        match c.classes.get_mut(&(s.dtype(), cap)) {
            Some(k) if k.out > 0 => {
                k.out -= 1;
                CACHED.fetch_add(cap, Ordering::Relaxed);
                k.free.push(s);
                c.returns += 1;
                if c.returns.is_multiple_of(SWEEP_EVERY) {
                    (sweep(&mut c), None)
                } else {
                    (Vec::new(), None)
                }
            }
            _ => (Vec::new(), Some(s)),
        }
    };
    // freed outside the lock; the sweep's buffers uncounted here, so that `sweep` stays a
    // function of the cache it is given
    let freed: usize = swept.iter().map(capacity_bytes).sum();
    CACHED.fetch_sub(freed, Ordering::Relaxed);
    drop((swept, refused));
}

/// Takes the buffers that sat unused since the last sweep (each class's low-water mark, the
/// oldest ones) out of the cache.
fn sweep(c: &mut Cache) -> Vec<CpuStorage> {
    let mut out = Vec::new();
    for k in c.classes.values_mut() {
        out.extend(k.free.drain(..k.low.min(k.free.len())));
        k.low = k.free.len();
    }
    c.classes
        .retain(|_, k| std::mem::take(&mut k.asked) || !k.free.is_empty() || k.out > 0);
    out
}

/// Bytes of the buffers of live host tensors (`torch.cuda.memory_allocated`, for the CPU).
pub fn allocated_bytes() -> usize {
    ALLOCATED.load(Ordering::Relaxed)
}

/// Bytes held by this allocator: the live buffers plus the cached ones
/// (`torch.cuda.memory_reserved`).
pub fn reserved_bytes() -> usize {
    allocated_bytes() + CACHED.load(Ordering::Relaxed)
}

/// The most bytes live at once since the start or the last [`reset_peak`]
/// (`torch.cuda.max_memory_allocated`).
pub fn peak_allocated_bytes() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts the peak over from the bytes live now (`torch.cuda.reset_peak_memory_stats`).
pub fn reset_peak() {
    PEAK.store(allocated_bytes(), Ordering::Relaxed);
}

/// Frees every cached buffer (`torch.cuda.empty_cache`); live tensors keep theirs.
pub fn empty_cache() {
    let all: Vec<CpuStorage> = {
        let mut c = lock();
        c.classes.drain().flat_map(|(_, k)| k.free).collect()
    };
    let freed: usize = all.iter().map(capacity_bytes).sum();
    CACHED.fetch_sub(freed, Ordering::Relaxed);
    drop(all);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_limits_are_read_without_wrapping() {
        let cases: [(&str, Option<usize>); 8] = [
            ("256", Some(256 << 20)),
            (" 1 ", Some(1 << 20)),
            ("0", Some(0)),
            ("-1", None),
            ("abc", None),
            ("", None),
            // these wrapped to 0 and to 1 MiB before
            ("17592186044416", None),
            ("17592186044417", None),
        ];
        for (v, want) in cases {
            assert_eq!(cache_bytes_of(v), want, "TENSORPLAY_CPU_CACHE_MIB={v:?}");
        }
    }

    /// A class's buffers after a sequence of takes and returns and a sweep.
    struct Case {
        name: &'static str,
        /// `true`: a buffer returned; `false`: one taken (when there is one).
        events: &'static [bool],
        /// buffers freed by the sweep after the events, then by a second sweep right after
        freed: [usize; 2],
    }

    fn check(case: &Case) {
        let mut c = Cache::default();
        let key = (DType::F32, 1 << 16);
        for &returned in case.events {
            let k = c.classes.entry(key).or_default();
            if returned {
                k.free.push(CpuStorage::F32(Vec::with_capacity(1 << 14)));
            } else {
                k.pop();
            }
        }
        let first = sweep(&mut c).len();
        let second = sweep(&mut c).len();
        assert_eq!([first, second], case.freed, "{}", case.name);
    }

    #[test]
    fn a_sweep_frees_what_sat_unused_since_the_last() {
        let cases = [
            Case {
                name: "returned in this window: kept, freed by the next idle sweep",
                events: &[true, true],
                freed: [0, 2],
            },
            Case {
                name: "taken and returned each step: nothing sat idle",
                events: &[true, false, true, false, true],
                freed: [0, 1],
            },
        ];
        for case in &cases {
            check(case);
        }
    }

    #[test]
    fn scratch_given_back_is_reused_and_refilled() {
        // bool buffers of classes (40 and 48 KiB) no other test of this process takes
        for (case, n, fill) in [
            ("take: old values kept", 40_000usize, None),
            ("filled: every element set", 45_000, Some(false)),
        ] {
            let mut v = take::<bool>(n);
            v.fill(true);
            let at = v.as_ptr();
            give_back(v);
            let w = match fill {
                None => take::<bool>(n),
                Some(x) => try_take_filled(n, x).expect("memory"),
            };
            assert_eq!(w.len(), n, "{case}");
            // with the cache on (not TENSORPLAY_CPU_CACHE_MIB=0) the same buffer comes back
            if cache_limit_bytes() >= class_of(n) {
                assert_eq!(
                    w.as_ptr(),
                    at,
                    "{case}: the buffer given back is handed out again"
                );
                let want = fill.unwrap_or(true);
                assert!(w.iter().all(|&x| x == want), "{case}: values {:?}", &w[..4]);
            } else if let Some(x) = fill {
                assert!(w.iter().all(|&y| y == x), "{case}: values {:?}", &w[..4]);
            }
        }
    }

    #[test]
    fn surplus_of_a_busy_class_is_freed() {
        // a window in which the class never dropped below 2 buffers: those 2 are surplus
        let mut c = Cache::default();
        let key = (DType::F32, 1 << 16);
        let k = c.classes.entry(key).or_default();
        for _ in 0..3 {
            k.free.push(CpuStorage::F32(Vec::with_capacity(1 << 14)));
        }
        assert_eq!(
            sweep(&mut c).len(),
            0,
            "first window: all were returned in it"
        );
        let k = c.classes.get_mut(&key).expect("class kept");
        for _ in 0..4 {
            k.pop();
            k.free.push(CpuStorage::F32(Vec::with_capacity(1 << 14)));
        }
        assert_eq!(sweep(&mut c).len(), 2, "two of three never left the cache");
        assert_eq!(c.classes[&key].free.len(), 1);
    }
}
