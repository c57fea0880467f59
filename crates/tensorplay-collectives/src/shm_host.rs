//! Same-host proof by capability: the helpers that the `"cpu"` backend's shared-memory
//! transport and the RPC layer's shared-memory path both use to decide that two processes
//! share memory.
//!
//! Neither hostnames nor `LOCAL_WORLD_SIZE` prove that two processes can map each other's
//! memory: ranks in different network namespaces of one machine may share `/dev/shm`, and two
//! containers with one hostname may not. So each process creates an object under
//! `/dev/shm` whose name it publishes through the job's store together with a random token
//! written inside it; a peer that can open that object (checked with [`check_name`] and
//! [`open_owned`]) and read the same token shares the host's `/dev/shm`.
//!
//! Object names are `<prefix><pid-namespace>-<pid>-<random>` ([`object_name`]), so a later
//! process of the same user and pid namespace can remove the objects of a process that died
//! before cleaning up ([`sweep`]).
//!
//! Both transports map their objects with [`Mmap`].

mod mmap;

pub use mmap::{MapMode, Mmap};

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

/// Where shared-memory objects live.
pub const SHM_ROOT: &str = "/dev/shm";

/// The effective user id of this process.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// `n` random bytes from the kernel, as `2n` lowercase hex digits. Errors when the kernel's
/// generator fails (it does not block once the system has booted).
pub fn random_hex(n: usize) -> std::io::Result<String> {
    let mut b = vec![0u8; n];
    let mut filled = 0;
    while filled < n {
        // SAFETY: the pointer and length describe the unfilled tail of `b`, which we own.
        let got = unsafe { libc::getrandom(b[filled..].as_mut_ptr().cast(), n - filled, 0) };
        if got < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        filled += got as usize;
    }
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// The inode number of this process's pid namespace (`None` without `/proc`): objects are
/// swept only by processes that see the same pids.
pub fn pid_namespace() -> Option<u64> {
    let l = std::fs::read_link("/proc/self/ns/pid").ok()?;
    let s = l.to_str()?;
    s.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

/// A fresh object name for this process: `<prefix><pid-namespace>-<pid>-<16 random hex>`.
pub fn object_name(prefix: &str) -> std::io::Result<String> {
    Ok(format!(
        "{prefix}{}-{}-{}",
        pid_namespace().unwrap_or(0),
        std::process::id(),
        random_hex(8)?
    ))
}

/// Whether `path` names an object directly under `root`, with `prefix`, made only of ASCII
/// letters, digits and `-` (so a name received from a peer cannot point anywhere else).
pub fn check_name(root: &Path, path: &Path, prefix: &str) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    path.parent() == Some(root)
        && name.starts_with(prefix)
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// Opens `path` for reading (and writing when `write`) if it is a regular file owned by this
/// user and not a symlink; `O_NONBLOCK`, so that a FIFO planted under the name cannot block.
pub fn open_owned(path: &Path, write: bool) -> Option<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let m = f.metadata().ok()?;
    (m.is_file() && m.uid() == euid()).then_some(f)
}

/// Whether process `pid` of this pid namespace exists: `kill(pid, 0)` (asks the kernel in our
/// own namespace; `/proc` may be another namespace's). Only ESRCH means gone.
fn alive(pid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if p <= 0 {
        return true;
    }
    // SAFETY: signal 0 only checks that the process exists and may be signalled; it sends
    // nothing.
    let r = unsafe { libc::kill(p, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Removes the objects (files or directories) under `root` named with `prefix` by a process of
/// this pid namespace that no longer exists, owned by this user: what a process killed before
/// its cleanup left behind. Returns how many it removed.
pub fn sweep(root: &Path, prefix: &str) -> usize {
    let Some(ns) = pid_namespace() else {
        return 0;
    };
    let Ok(entries) = std::fs::read_dir(root) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let mut parts = rest.split('-');
        let (Some(obj_ns), Some(pid)) = (
            parts.next().and_then(|p| p.parse::<u64>().ok()),
            parts.next().and_then(|p| p.parse::<u32>().ok()),
        ) else {
            continue;
        };
        let Ok(meta) = e.path().symlink_metadata() else {
            continue;
        };
        if obj_ns != ns || meta.uid() != euid() || alive(pid) {
            continue;
        }
        tracing::debug!(path = %e.path().display(), "removing a shared-memory object of a dead process");
        let gone = if meta.is_dir() {
            std::fs::remove_dir_all(e.path())
        } else {
            std::fs::remove_file(e.path())
        };
        removed += usize::from(gone.is_ok());
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_dead_objects_swept() {
        let root = std::env::temp_dir().join(format!("tp-shm-host-{}", random_hex(4).unwrap()));
        std::fs::create_dir_all(&root).unwrap();
        let name = object_name("tp-x-").unwrap();
        assert!(check_name(&root, &root.join(&name), "tp-x-"));
        assert!(!check_name(&root, &root.join("tp-x-a/../../etc"), "tp-x-"));
        assert!(!check_name(&root, &root.join("other"), "tp-x-"));
        assert!(!check_name(
            Path::new("/elsewhere"),
            &root.join(&name),
            "tp-x-"
        ));
        assert_eq!(random_hex(5).unwrap().len(), 10);
        let Some(ns) = pid_namespace() else {
            let _ = std::fs::remove_dir_all(&root);
            return;
        };
        // pid 0x7fffffff never exists; our own pid does
        let dead = root.join(format!("tp-x-{ns}-2147483647-00"));
        let alive = root.join(format!("tp-x-{ns}-{}-00", std::process::id()));
        let other_ns = root.join(format!("tp-x-{}-2147483647-00", ns + 1));
        std::fs::write(&dead, b"x").unwrap();
        std::fs::create_dir(root.join(format!("tp-x-{ns}-2147483647-01"))).unwrap();
        std::fs::write(&alive, b"x").unwrap();
        std::fs::write(&other_ns, b"x").unwrap();
        assert_eq!(sweep(&root, "tp-x-"), 2);
        assert!(!dead.exists() && alive.exists() && other_ns.exists());
        assert!(open_owned(&alive, false).is_some());
        let link = root.join("tp-x-link");
        std::os::unix::fs::symlink(&alive, &link).unwrap();
        assert!(open_owned(&link, false).is_none(), "symlinks are refused");
        let _ = std::fs::remove_dir_all(&root);
    }
}
