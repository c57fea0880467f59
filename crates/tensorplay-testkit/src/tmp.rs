//! Temporary folders for tests.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A folder under `std::env::temp_dir()` (CI gives each run an empty one), unique per process,
/// tag and instance, created empty and removed with its contents on drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates `TMPDIR/tp-TAG-PID-N`.
    ///
    /// # Panics
    /// When the folder cannot be created (a test's environment is broken).
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("tp-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d)
            .unwrap_or_else(|e| panic!("cannot create the test folder {}: {e}", d.display()));
        TempDir(d)
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.0
    }

    /// `name` inside the folder.
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_empty_unique_and_removed() {
        let (a, b) = (TempDir::new("kit"), TempDir::new("kit"));
        assert_ne!(a.dir(), b.dir());
        assert!(a.dir().is_dir());
        std::fs::write(a.path("f"), b"x").unwrap();
        let p = a.dir().to_path_buf();
        drop(a);
        assert!(!p.exists(), "{} left behind", p.display());
    }
}
