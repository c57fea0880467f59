//! Atomic replacement of a file: write a temporary file beside it, flush it to disk, rename it
//! over the target, then flush the folder, so that a reader (or a process restarted after a
//! crash) sees either the previous file whole or the new one whole, never a prefix.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The temporary file a save of `path` writes first: same folder (so that the rename stays on
/// one file system), a name no checkpoint has (`.name.tmp-<pid>-<n>`), unique per process and
/// call.
fn temporary_for(path: &Path) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}-{n}", std::process::id()))
}

/// Removes the temporary files that saves of `path` by processes that no longer run left
/// behind (a process killed mid-save); a live process's are kept (it may be saving now). Best
/// effort: where `/proc` is absent nothing is removed.
fn remove_stale_temporaries(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    if !Path::new("/proc/self").exists() {
        return;
    }
    let prefix = format!(".{}.tmp-", name.to_string_lossy());
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let f = e.file_name().to_string_lossy().into_owned();
        let pid = f
            .strip_prefix(&prefix)
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = fs::remove_file(e.path());
        }
    }
}

/// `path` as an error names it.
pub(crate) fn shown(path: &Path) -> String {
    path.display().to_string()
}

/// A [`Error::Checkpoint`] about `path`.
pub(crate) fn problem(path: &Path, what: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: shown(path),
        problem: what.into(),
    }
}

/// Writes `bytes` to `path` atomically: temporary file, `fsync`, `rename`, `fsync` of the
/// folder. On any error the temporary file is removed and `path` is untouched.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    if path.file_name().is_none() {
        return Err(problem(path, "not a file name (it ends in `..` or `/`)"));
    }
    remove_stale_temporaries(path);
    let tmp = temporary_for(path);
    let written = (|| -> std::io::Result<()> {
        let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    if let Err(e) = written.and_then(|()| fs::rename(&tmp, path)) {
        let _ = fs::remove_file(&tmp);
        return Err(problem(path, format!("could not write it: {e}")));
    }
    // the rename itself is durable once the folder's entry is on disk; a folder that cannot be
    // opened for sync (some file systems) still has the new file, so this is best effort
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}
