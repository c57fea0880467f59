//! The NCCL C API, loaded at run time: our own small table of the entry points the backend
//! uses, opened from `libnccl.so.2` (the name NCCL ships under, which cudarc's loader does not
//! try) or `libnccl.so`, by name or from the folders of [`search_dirs`]. Nothing links NCCL, so
//! every build runs where NCCL is absent, and says so when the backend is asked for.

use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

/// `ncclResult_t`.
pub(crate) type NcclResult = c_int;
/// `ncclSuccess`.
pub(crate) const SUCCESS: NcclResult = 0;
/// `ncclInProgress` (a non-blocking call still running).
pub(crate) const IN_PROGRESS: NcclResult = 7;
/// `ncclComm_t`.
pub(crate) type Comm = *mut c_void;
/// `cudaStream_t` (the driver's `CUstream`).
pub(crate) type Stream = *mut c_void;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId {
    pub(crate) internal: [c_char; 128],
}

/// `ncclDataType_t` values.
pub(crate) mod dtype {
    pub(crate) const UINT8: i32 = 1;
    pub(crate) const INT64: i32 = 4;
    /// `ncclFloat16` (IEEE half).
    pub(crate) const FLOAT16: i32 = 6;
    pub(crate) const FLOAT32: i32 = 7;
    pub(crate) const FLOAT64: i32 = 8;
    /// `ncclBfloat16` (NCCL 2.10 and newer).
    pub(crate) const BFLOAT16: i32 = 9;
}

/// `ncclRedOp_t` values.
pub(crate) mod redop {
    pub(crate) const SUM: i32 = 0;
    pub(crate) const PROD: i32 = 1;
    pub(crate) const MAX: i32 = 2;
    pub(crate) const MIN: i32 = 3;
    pub(crate) const AVG: i32 = 4;
}

type Buf = *const c_void;
type BufMut = *mut c_void;

/// The entry points, resolved once.
pub(crate) struct Nccl {
    /// Keeps the library mapped for as long as the function pointers live (the process).
    _lib: libloading::Library,
    /// Where it was loaded from.
    pub(crate) path: String,
    pub(crate) get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    pub(crate) get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    pub(crate) comm_init_rank:
        unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> NcclResult,
    pub(crate) comm_abort: unsafe extern "C" fn(Comm) -> NcclResult,
    pub(crate) comm_destroy: unsafe extern "C" fn(Comm) -> NcclResult,
    pub(crate) comm_get_async_error: unsafe extern "C" fn(Comm, *mut NcclResult) -> NcclResult,
    pub(crate) get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    pub(crate) all_reduce:
        unsafe extern "C" fn(Buf, BufMut, usize, i32, i32, Comm, Stream) -> NcclResult,
    pub(crate) broadcast:
        unsafe extern "C" fn(Buf, BufMut, usize, i32, c_int, Comm, Stream) -> NcclResult,
    pub(crate) reduce:
        unsafe extern "C" fn(Buf, BufMut, usize, i32, i32, c_int, Comm, Stream) -> NcclResult,
    pub(crate) all_gather:
        unsafe extern "C" fn(Buf, BufMut, usize, i32, Comm, Stream) -> NcclResult,
    pub(crate) reduce_scatter:
        unsafe extern "C" fn(Buf, BufMut, usize, i32, i32, Comm, Stream) -> NcclResult,
    pub(crate) send: unsafe extern "C" fn(Buf, usize, i32, c_int, Comm, Stream) -> NcclResult,
    pub(crate) recv: unsafe extern "C" fn(BufMut, usize, i32, c_int, Comm, Stream) -> NcclResult,
    pub(crate) group_start: unsafe extern "C" fn() -> NcclResult,
    pub(crate) group_end: unsafe extern "C" fn() -> NcclResult,
}

/// Folders searched for `libnccl.so.2` after the dynamic loader's own path, in order: the
/// system's library folders, CUDA's, and pip's `nvidia-nccl-cu*` package inside the active
/// virtual environment (`VIRTUAL_ENV`) or the benchmarks' PyTorch environment (`ANCHOR_VENV`).
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .collect();
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/local/cuda/lib64",
        "/usr/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    for var in ["VIRTUAL_ENV", "ANCHOR_VENV"] {
        if let Ok(v) = std::env::var(var)
            && let Ok(rd) = std::fs::read_dir(PathBuf::from(v).join("lib"))
        {
            for e in rd.flatten() {
                dirs.push(e.path().join("site-packages/nvidia/nccl/lib"));
            }
        }
    }
    dirs
}

/// The candidates tried, in order: the bare names (the loader's path), then full paths.
fn candidates(dirs: &[PathBuf]) -> Vec<String> {
    let mut c = vec!["libnccl.so.2".to_string(), "libnccl.so".to_string()];
    for d in dirs {
        for name in ["libnccl.so.2", "libnccl.so"] {
            let p = d.join(name);
            if p.exists() {
                c.push(p.display().to_string());
            }
        }
    }
    c
}

/// Resolves one symbol as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the C signature of `name` in the NCCL API.
unsafe fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, String> {
    // SAFETY: the caller guarantees `T` is the symbol's signature.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("the NCCL library has no {name}: {e}"))
}

fn open(dirs: &[PathBuf]) -> Result<Nccl, String> {
    let tried = candidates(dirs);
    let mut last = String::new();
    for c in &tried {
        // SAFETY: loading NCCL runs its initialisers, which only set up its own state; it is
        // the library the NCCL backend exists to call.
        let lib = match unsafe { libloading::Library::new(c) } {
            Ok(l) => l,
            Err(e) => {
                last = e.to_string();
                continue;
            }
        };
        // SAFETY: each signature below is the NCCL 2.x C prototype of that symbol (nccl.h).
        unsafe {
            return Ok(Nccl {
                path: c.clone(),
                get_version: sym(&lib, "ncclGetVersion")?,
                get_unique_id: sym(&lib, "ncclGetUniqueId")?,
                comm_init_rank: sym(&lib, "ncclCommInitRank")?,
                comm_abort: sym(&lib, "ncclCommAbort")?,
                comm_destroy: sym(&lib, "ncclCommDestroy")?,
                comm_get_async_error: sym(&lib, "ncclCommGetAsyncError")?,
                get_error_string: sym(&lib, "ncclGetErrorString")?,
                all_reduce: sym(&lib, "ncclAllReduce")?,
                broadcast: sym(&lib, "ncclBroadcast")?,
                reduce: sym(&lib, "ncclReduce")?,
                all_gather: sym(&lib, "ncclAllGather")?,
                reduce_scatter: sym(&lib, "ncclReduceScatter")?,
                send: sym(&lib, "ncclSend")?,
                recv: sym(&lib, "ncclRecv")?,
                group_start: sym(&lib, "ncclGroupStart")?,
                group_end: sym(&lib, "ncclGroupEnd")?,
                _lib: lib,
            });
        }
    }
    Err(format!(
        "the NCCL library (libnccl.so.2) was not found: tried {} on the loader's path and in {} \
         (last error: {last}). Install NCCL (for example the pip package nvidia-nccl-cu12) and \
         add its lib folder to LD_LIBRARY_PATH",
        tried
            .iter()
            .take(2)
            .cloned()
            .collect::<Vec<_>>()
            .join(" and "),
        dirs.iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// The loaded library, or why it could not be loaded (looked up once per process).
pub(crate) fn nccl() -> Result<&'static Nccl, String> {
    static LIB: OnceLock<Result<Nccl, String>> = OnceLock::new();
    LIB.get_or_init(|| open(&search_dirs()))
        .as_ref()
        .map_err(Clone::clone)
}

/// Whether NCCL can be loaded here, and from where (or why not).
pub fn library() -> Result<String, String> {
    nccl().map(|n| n.path.clone())
}

/// [`library`] over explicit folders instead of [`search_dirs`] (not cached): for tests and
/// diagnostics.
pub fn library_in(dirs: &[PathBuf]) -> Result<String, String> {
    open(dirs).map(|n| n.path)
}

impl Nccl {
    /// NCCL's text for `r`.
    pub(crate) fn error_string(&self, r: NcclResult) -> String {
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let p = unsafe { (self.get_error_string)(r) };
        if p.is_null() {
            return format!("ncclResult_t {r}");
        }
        // SAFETY: non-null and NUL-terminated, as above; copied out at once.
        let s = unsafe { std::ffi::CStr::from_ptr(p) };
        format!("{} (ncclResult_t {r})", s.to_string_lossy())
    }

    /// The library's version as `major.minor.patch`.
    pub(crate) fn version(&self) -> String {
        let mut v: c_int = 0;
        // SAFETY: writes one int.
        if unsafe { (self.get_version)(&mut v) } != SUCCESS {
            return "unknown".into();
        }
        format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
    }
}
