//! The sender's side: this worker's directory, its reusable segments, and the claims that
//! carry one tensor each.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tensorplay_collectives::shm_host::{self, MapMode, Mmap};
use tensorplay_core::bytes::as_bytes;
use tensorplay_core::{Tensor, with_dtype};

use super::{HOST_FILE, MIN_SEGMENT, PREFIX, busy_name, free_name, random_hex, shm_err};
use crate::Result;

pub(super) struct Segment {
    id: u64,
    pub(super) cap: usize,
    map: Mmap,
}

/// This worker's shared-memory directory: the segments it sends from.
pub(crate) struct ShmDir {
    path: PathBuf,
    pub(super) token: String,
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
                Mmap::map(&f, cap, MapMode::ReadWrite)
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
    pub(super) seg: Arc<Segment>,
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
        let dst = self.seg.map.as_ptr();
        with_dtype!(t.dtype(), T => t.with_cpu_data::<T, _>(|v, l| {
            let src = as_bytes(&v[l.offset()..l.offset() + n]);
            // SAFETY: the segment holds at least `src.len()` bytes (checked above), this claim
            // owns the segment (the rename protocol), and the source is a live slice that
            // cannot overlap a shared mapping.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
        }))?;
        Ok(())
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
