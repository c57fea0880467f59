//! Transparent huge pages for large host buffers.
//!
//! A new host buffer of at least [`HUGE_MIN_BYTES`] that the caching allocator (or the RPC
//! receive path) creates is advised (`madvise(MADV_HUGEPAGE)`) before its first write (a
//! `Vec` handed to `Tensor::from_vec` keeps whatever its maker did), so the kernel backs its whole 2 MiB pages with huge pages where the
//! system allows it (`/sys/kernel/mm/transparent_hugepage/enabled` at `madvise` or `always`):
//! one page fault per 2 MiB instead of 512, fewer TLB misses for passes over the buffer, and
//! a peer reading it with `process_vm_readv` (the shared-memory reduce_scatter) pins 2 MiB at
//! a time (benchmarks.md, issue 38's last part: reduce_scatter 0.30x -> 0.46x of memcpy).
//! `TENSORPLAY_CPU_HUGEPAGES=0` (or `false`, `off`, `no`) turns the advice off; where the
//! kernel has no transparent huge pages the advice fails and changes nothing.

use std::sync::OnceLock;

/// One huge page (x86-64 and aarch64 with 4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// Buffers of at least this many bytes are advised: two huge pages, so at least one whole
/// aligned huge page lies inside wherever the buffer starts.
const HUGE_MIN_BYTES: usize = 2 * HUGE_PAGE;

/// The environment variable that turns the advice off.
const ENV: &str = "TENSORPLAY_CPU_HUGEPAGES";

/// Whether large buffers are advised ([`ENV`] read once).
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        !matches!(
            std::env::var(ENV).as_deref().map(str::trim),
            Ok("0" | "false" | "off" | "no")
        )
    })
}

/// The whole huge pages inside `[start, start + len)`, as `(first byte, length)`; `None` when
/// there are none or the range is below [`HUGE_MIN_BYTES`].
fn whole_pages(start: usize, len: usize) -> Option<(usize, usize)> {
    if len < HUGE_MIN_BYTES {
        return None;
    }
    let first = start.checked_next_multiple_of(HUGE_PAGE)?;
    let end = start.checked_add(len)? & !(HUGE_PAGE - 1);
    (end > first).then(|| (first, end - first))
}

/// Advises the kernel to back the whole huge pages of `v`'s allocation (its capacity, written
/// or not) with huge pages: call it before the first write, as the advice applies to pages
/// faulted in afterwards. Buffers below 4 MiB are left alone. Never changes contents; a
/// failure (no transparent huge pages, another system) is ignored.
pub fn advise_huge_pages<T>(v: &mut Vec<T>) {
    if !enabled() {
        return;
    }
    let bytes = v.capacity().saturating_mul(size_of::<T>());
    let Some((first, len)) = whole_pages(v.as_mut_ptr() as usize, bytes) else {
        return;
    };
    #[cfg(target_os = "linux")]
    // SAFETY: `[first, first + len)` is whole pages inside the allocation `v` owns (its
    // capacity); MADV_HUGEPAGE only changes how the kernel backs those pages, never their
    // contents or the mapping's protection. The result is ignored: failing is harmless.
    unsafe {
        libc::madvise(first as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (first, len);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_huge_pages_inside_the_buffer_are_advised() {
        const H: usize = HUGE_PAGE;
        for (case, start, len, want) in [
            ("below the minimum", 0, HUGE_MIN_BYTES - 1, None),
            ("aligned, two pages", 4 * H, 2 * H, Some((4 * H, 2 * H))),
            ("unaligned start", 4 * H + 16, 2 * H, Some((5 * H, H))),
            (
                "unaligned both ends",
                4 * H + 16,
                3 * H + 100,
                Some((5 * H, 2 * H)),
            ),
            (
                "past the end of the address space",
                usize::MAX - H,
                2 * H,
                None,
            ),
        ] {
            assert_eq!(whole_pages(start, len), want, "{case}");
        }
    }

    /// The `VmFlags` of the mapping holding `addr`, from `/proc/self/smaps`.
    fn vm_flags(addr: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let range = line
                .split_whitespace()
                .next()
                .and_then(|r| r.split_once('-'));
            if let Some((a, b)) = range
                && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            {
                inside = (a..b).contains(&addr);
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return Some(flags.trim().to_string());
            }
        }
        None
    }

    #[test]
    fn new_large_buffers_are_advised_before_they_are_written() {
        if !cfg!(target_os = "linux") {
            return;
        }
        // a kernel without transparent huge pages has no such directory and refuses the advice
        let thp = std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists();
        let n = 8 << 20; // 8 MiB of bytes: at least three whole huge pages
        let mut by_hand = Vec::<u8>::with_capacity(n);
        advise_huge_pages(&mut by_hand);
        // int64 sizes of classes no other test takes, so the allocator makes them new
        let zeros = crate::storage::try_vec(n / 8 + 3, 0i64, "test", "n").unwrap();
        let taken = crate::storage::pool::take::<i64>(n / 8 + 5);
        for (case, at, bytes) in [
            (
                "a Vec advised by hand",
                by_hand.as_ptr() as usize,
                by_hand.capacity(),
            ),
            (
                "zeros (try_vec)",
                zeros.as_ptr() as usize,
                zeros.capacity() * 8,
            ),
            (
                "the caching allocator",
                taken.as_ptr() as usize,
                taken.capacity() * 8,
            ),
        ] {
            let (first, _) = whole_pages(at, bytes).unwrap();
            let flags = vm_flags(first).unwrap_or_else(|| panic!("{case}: no mapping"));
            // `hg`: the mapping carries MADV_HUGEPAGE
            let advised = flags.split_whitespace().any(|f| f == "hg");
            // (unless TENSORPLAY_CPU_HUGEPAGES=0)
            assert_eq!(advised, thp && enabled(), "{case}: VmFlags {flags}");
        }
    }
}
