//! [`Mmap`]: a shared memory mapping of a file, the one mapping type of both shared-memory
//! transports (the `"cpu"` backend's segments and the RPC layer's tensor segments).

use std::fs::File;
use std::os::fd::AsRawFd;

/// How a file is mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapMode {
    /// Readable and writable, pages faulted in as they are touched.
    ReadWrite,
    /// Read-only, every page populated at once (`MAP_POPULATE`): one call instead of a page
    /// fault per few pages, for a mapping that is read entirely right away.
    ReadPopulate,
}

/// A shared (`MAP_SHARED`) mapping of the first `len` bytes of a file, unmapped on drop.
/// Other processes that map the same file see the same memory; who may read or write which
/// bytes when is the business of the protocol that uses the mapping.
pub struct Mmap {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value (no thread-local state); concurrent
// access to its bytes is coordinated by the protocol that hands out its raw pointer.
unsafe impl Send for Mmap {}
// SAFETY: as above: shared references only read the pointer and the length.
unsafe impl Sync for Mmap {}

impl std::fmt::Debug for Mmap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mmap").field("len", &self.len).finish()
    }
}

impl Mmap {
    /// Maps the first `len` bytes of `file` (opened for reading, and for writing with
    /// [`MapMode::ReadWrite`]). Errors when `len` is 0 or the kernel refuses the mapping.
    pub fn map(file: &File, len: usize, mode: MapMode) -> std::io::Result<Mmap> {
        if len == 0 {
            return Err(std::io::Error::other("empty mapping"));
        }
        let (prot, flags) = match mode {
            MapMode::ReadWrite => (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED),
            MapMode::ReadPopulate => (libc::PROT_READ, libc::MAP_SHARED | libc::MAP_POPULATE),
        };
        // SAFETY: a fresh mapping placed by the kernel (null hint) of an open file descriptor
        // that outlives the call; the result is checked for MAP_FAILED before use.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, file.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mmap { ptr: p.cast(), len })
    }

    /// The first byte of the mapping (page aligned). Writing through it is allowed only for
    /// a [`MapMode::ReadWrite`] mapping, within `len()` bytes.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The length of the mapping in bytes (never 0).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: a mapping has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Drop for Mmap {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly what mmap returned; borrows of the memory never outlive
        // the value that owns the mapping.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_mapping_sees_writes_through_another() {
        let path =
            std::env::temp_dir().join(format!("tp-mmap-{}", super::super::random_hex(4).unwrap()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        file.set_len(4096).unwrap();
        let w = Mmap::map(&file, 4096, MapMode::ReadWrite).unwrap();
        // SAFETY: inside the writable mapping.
        unsafe { w.as_ptr().add(10).write(42) };
        let r = Mmap::map(&file, 16, MapMode::ReadPopulate).unwrap();
        // SAFETY: inside the mapping.
        assert_eq!(unsafe { r.as_ptr().add(10).read() }, 42);
        assert_eq!((w.len(), r.len()), (4096, 16));
        assert!(
            Mmap::map(&file, 0, MapMode::ReadWrite).is_err(),
            "empty mappings are refused"
        );
        let _ = std::fs::remove_file(&path);
    }
}
