//! Loading NVIDIA's user-space libraries at run time: whichever supported major version is
//! present (CUDA 13, then 12), or the file an environment variable names. Errors name every
//! file tried and what to install.

use libloading::Library;

use crate::{Error, Result};

/// A library to load: its name in messages, the environment variable that can name its file,
/// the file names tried in order, and what to install when none loads.
pub(crate) struct Wanted {
    pub(crate) what: &'static str,
    pub(crate) env: &'static str,
    pub(crate) files: &'static [&'static str],
    pub(crate) install: &'static str,
}

/// Loads `w`: the file `$w.env` names when set (and nothing else), else the first of `w.files`
/// the dynamic loader finds.
///
/// # Errors
/// [`Error::CudaUnavailable`] naming the library, every file tried with the loader's reason,
/// and what to install.
pub(crate) fn load(w: &Wanted) -> Result<(Library, String)> {
    load_preferring(w, w.files)
}

/// [`load`] trying `files` (instead of `w.files`) when the environment names none.
pub(crate) fn load_preferring(w: &Wanted, files: &[&str]) -> Result<(Library, String)> {
    match std::env::var(w.env).ok().filter(|s| !s.is_empty()) {
        Some(f) => load_from(w, &[f], true),
        None => load_from(
            w,
            &files.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            false,
        ),
    }
}

/// [`load`] over the given files (`named`: the user named the file in `w.env`).
pub(crate) fn load_from(w: &Wanted, files: &[String], named: bool) -> Result<(Library, String)> {
    let mut tried = Vec::new();
    for f in files {
        // SAFETY: loading a library runs its initialisers; these are NVIDIA's libraries (or
        // the file the user named for one), whose initialisers only set up their own state.
        match unsafe { Library::new(f) } {
            Ok(lib) => return Ok((lib, f.clone())),
            // libloading's own text is only "dlopen failed": the loader's reason is its source
            Err(e) => match std::error::Error::source(&e) {
                Some(why) => tried.push(format!("{f}: {why}")),
                None => tried.push(format!("{f}: {e}")),
            },
        }
    }
    let how = if named {
        format!("{} names it", w.env)
    } else {
        format!("or set {} to the library's file", w.env)
    };
    Err(Error::CudaUnavailable {
        reason: format!(
            "{} could not be loaded (tried {}); {} ({how})",
            w.what,
            tried.join("; "),
            w.install
        ),
    })
}

/// Looks up symbol `name` (NUL-terminated) of type `T` (a function pointer type).
///
/// # Safety
/// `T` must be the symbol's true C signature.
pub(crate) unsafe fn symbol<T: Copy>(lib: &Library, what: &str, name: &[u8]) -> Result<T> {
    // SAFETY: the caller guarantees the type; the pointer is used only while `lib` lives
    // (the loaders keep the Library beside the pointers).
    unsafe { lib.get::<T>(name) }
        .map(|s| *s)
        .map_err(|e| Error::CudaUnavailable {
            reason: format!(
                "{what} lacks {}: {e} (a CUDA 12 or 13 library is needed)",
                String::from_utf8_lossy(name.strip_suffix(b"\0").unwrap_or(name))
            ),
        })
}
