//! Compiled kernels kept on disk: NVRTC takes seconds for `tensorplay.cu`, and every process of
//! a job would pay it. The PTX is stored under the cache folder by a name that carries the
//! source's checksum, the architecture and NVRTC's version, so a changed kernel, device or
//! compiler never reads a stale file. Failures to read or write the cache only cost a compile.
//!
//! The folder: `TENSORPLAY_KERNEL_CACHE` (`off` disables the cache), else
//! `$XDG_CACHE_HOME/tensorplay`, else `$HOME/.cache/tensorplay`.

use std::path::{Path, PathBuf};

use crate::Result;

/// The cache folder, or `None` when disabled or no home is known.
pub(crate) fn folder() -> Option<PathBuf> {
    match std::env::var_os("TENSORPLAY_KERNEL_CACHE") {
        Some(v) if v == "off" || v.is_empty() => None,
        Some(v) => Some(PathBuf::from(v)),
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|d| d.join("tensorplay")),
    }
}

/// The file for `source` compiled by NVRTC `version` for `sm_XY` (`cubin`) or `compute_XY`.
pub(crate) fn file_name(
    source: &str,
    (major, minor): (u32, u32),
    version: (i32, i32),
    cubin: bool,
) -> String {
    let (arch, ext) = if cubin {
        ("sm", "cubin")
    } else {
        ("compute", "ptx")
    };
    format!(
        "kernels-{:08x}-{arch}_{major}{minor}-nvrtc{}.{}.{ext}",
        crc32fast::hash(source.as_bytes()),
        version.0,
        version.1
    )
}

/// The end marker of a whole cache file.
const END: &[u8] = b"\n// tensorplay: end of kernels\n";
/// The most a cache file may hold (the kernels are a few MiB).
const MAX_BYTES: u64 = 64 << 20;

/// The code in `dir/name` when it is a regular file of sensible size that is whole (it ends
/// with the marker this function adds), else `compile()`'s, which is then stored (written to
/// a temporary file and renamed, so concurrent processes never read half a file).
pub(crate) fn load_or_compile(
    dir: Option<&Path>,
    name: &str,
    compile: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    let Some(dir) = dir else {
        return compile();
    };
    let path = dir.join(name);
    let regular =
        std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_file() && m.len() <= MAX_BYTES);
    if regular
        && let Ok(bytes) = std::fs::read(&path)
        && let Some(code) = bytes.strip_suffix(END)
        && !code.is_empty()
    {
        return Ok(code.to_vec());
    }
    let code = compile()?;
    let tmp = dir.join(format!("{name}.{}.tmp", std::process::id()));
    let stored = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&tmp, [code.as_slice(), END].concat()))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if stored.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    Ok(code)
}

/// Removes `dir/name` (a cached file the driver refused), so that the next use compiles.
pub(crate) fn forget(dir: Option<&Path>, name: &str) {
    if let Some(dir) = dir {
        let _ = std::fs::remove_file(dir.join(name));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Scratch(PathBuf);
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_stored_compile_is_reused_and_a_torn_file_is_not() {
        let d = Scratch(std::env::temp_dir().join(format!("tp-kcache-{}", std::process::id())));
        let name = file_name("src", (9, 0), (13, 0), true);
        assert!(
            name.contains("sm_90") && name.contains("nvrtc13.0"),
            "{name}"
        );
        assert_ne!(
            name,
            file_name("src2", (9, 0), (13, 0), true),
            "the source is in the name"
        );
        assert_ne!(
            name,
            file_name("src", (9, 0), (13, 0), false),
            "PTX and cubin differ"
        );
        // a FIFO or other non-regular file is not read (it could block)
        let fifo = file_name("fifo", (9, 0), (13, 0), true);
        std::fs::create_dir_all(&d.0).unwrap();
        std::os::unix::fs::symlink("/dev/zero", d.0.join(&fifo)).unwrap();
        assert_eq!(
            load_or_compile(Some(&d.0), &fifo, || Ok(b"fresh".to_vec())).unwrap(),
            b"fresh"
        );
        let mut calls = 0;
        let mut compile = |s: &str| {
            calls += 1;
            let s = s.as_bytes().to_vec();
            move || Ok(s)
        };
        assert_eq!(
            load_or_compile(Some(&d.0), &name, compile("ptx one")).unwrap(),
            b"ptx one"
        );
        // the second time the file answers, not the compiler
        assert_eq!(
            load_or_compile(Some(&d.0), &name, || panic!("compiled again")).unwrap(),
            b"ptx one"
        );
        // a torn file (no end marker) is compiled again and replaced
        std::fs::write(d.0.join(&name), "ptx o").unwrap();
        assert_eq!(
            load_or_compile(Some(&d.0), &name, compile("ptx two")).unwrap(),
            b"ptx two"
        );
        assert_eq!(
            load_or_compile(Some(&d.0), &name, || panic!("compiled again")).unwrap(),
            b"ptx two"
        );
        // an unusable folder costs a compile, not an error
        let file = d.0.join("not-a-folder");
        std::fs::write(&file, "x").unwrap();
        assert_eq!(
            load_or_compile(Some(&file), &name, compile("ptx three")).unwrap(),
            b"ptx three"
        );
        assert_eq!(calls, 3);
        let left: Vec<_> = std::fs::read_dir(&d.0)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left.len(), 3, "no temporary files are left: {left:?}");
    }
}
