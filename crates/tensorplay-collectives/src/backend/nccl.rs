//! The `"nccl"` backend: CUDA tensors through cudarc's NCCL bindings. The only module of this
//! crate that calls cudarc.
//!
//! One communicator per group on a dedicated stream of the process's GPU (`cuda:LOCAL_RANK`);
//! the 128-byte unique id travels through the group's store as bytes. Calls are enqueued on the
//! communicator's stream and then synchronised, so they are blocking like the CPU backend's.
//! Metadata checks and barriers go through a small CPU backend beside the communicator.
//!
//! Nothing here runs without a driver: [`NcclBackend::new`] first checks for `libcuda`, for
//! enough GPUs, and for the NCCL library, and returns an error naming what is missing and where
//! it looked (cudarc looks for `libnccl.so`, but NCCL ships as `libnccl.so.2`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cudarc::driver::CudaStream;
use cudarc::nccl::safe::{Comm, Id, ReduceOp as NcclOp};
use tensorplay_core::cuda::CudaData;
use tensorplay_core::{Device, Storage, Tensor};

use crate::backend::Backend;
use crate::backend::cpu::{CpuBackend, CpuOptions};
use crate::store::{PrefixStore, Store};
use crate::{Error, ReduceOp, Result};

fn nccl_err(op: &str, e: cudarc::nccl::result::NcclError) -> Error {
    Error::Backend {
        backend: "nccl".into(),
        detail: format!("{op} failed with ncclResult_t {:?}", e.0),
    }
}

/// Folders searched for `libnccl.so.2`, in order.
pub fn nccl_search_dirs() -> Vec<PathBuf> {
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
    // pip's nvidia-nccl-cu* package inside a virtual environment
    let mut venvs: Vec<PathBuf> = Vec::new();
    if let Ok(v) = std::env::var("VIRTUAL_ENV") {
        venvs.push(PathBuf::from(v));
    }
    // the benchmarks' PyTorch environment (`ANCHOR_VENV`, as the anchors' setup.sh uses it)
    if let Ok(v) = std::env::var("ANCHOR_VENV") {
        venvs.push(PathBuf::from(v));
    }
    for v in venvs {
        if let Ok(rd) = std::fs::read_dir(v.join("lib")) {
            for e in rd.flatten() {
                dirs.push(e.path().join("site-packages/nvidia/nccl/lib"));
            }
        }
    }
    dirs
}

/// Where a loadable NCCL is, or where we looked.
fn locate_nccl() -> std::result::Result<(), String> {
    // SAFETY: only tries to dlopen the library names cudarc knows and reports the outcome.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Ok(());
    }
    let dirs = nccl_search_dirs();
    let found = dirs
        .iter()
        .map(|d| d.join("libnccl.so.2"))
        .find(|p| p.exists());
    match found {
        Some(p) => {
            let shim = link_dir(&p);
            Err(format!(
                "NCCL is installed at {} but cudarc loads it as `libnccl.so`, which is not on the \
                 library path. {}Run with LD_LIBRARY_PATH={}:$LD_LIBRARY_PATH (spawn sets it \
                 for its children).",
                p.display(),
                match &shim {
                    Ok(d) => format!(
                        "A link libnccl.so -> libnccl.so.2 is ready in {}. ",
                        d.display()
                    ),
                    Err(e) => format!("(Could not create a libnccl.so link: {e}.) "),
                },
                shim.as_ref().map_or_else(
                    |_| p
                        .parent()
                        .unwrap_or_else(|| Path::new("."))
                        .display()
                        .to_string(),
                    |d| d.display().to_string()
                )
            ))
        }
        None => Err(format!(
            "the NCCL library (libnccl.so or libnccl.so.2) was not found; looked in {}. Install \
             NCCL (for example the pip package nvidia-nccl-cu12) and add its lib folder to \
             LD_LIBRARY_PATH",
            dirs.iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// Creates `<tmp>/tensorplay-nccl/libnccl.so -> lib` and returns the folder.
pub fn link_dir(lib: &Path) -> std::io::Result<PathBuf> {
    let dir = std::env::temp_dir().join("tensorplay-nccl");
    std::fs::create_dir_all(&dir)?;
    let link = dir.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    #[cfg(unix)]
    std::os::unix::fs::symlink(lib, &link)?;
    Ok(dir)
}

fn to_nccl(op: ReduceOp) -> Result<NcclOp> {
    Ok(match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Product => NcclOp::Prod,
        ReduceOp::Min => NcclOp::Min,
        ReduceOp::Max => NcclOp::Max,
        ReduceOp::Avg => NcclOp::Avg,
        other => {
            return Err(Error::Backend {
                backend: "nccl".into(),
                detail: format!(
                    "{other:?} is not supported by NCCL; use the cpu backend for bitwise reductions"
                ),
            });
        }
    })
}

/// The NCCL communicator of one group on this process's GPU.
pub struct NcclBackend {
    comm: Comm,
    stream: Arc<CudaStream>,
    device: Device,
    meta: CpuBackend,
    rank: usize,
    size: usize,
    sent: AtomicU64,
}

// SAFETY: a Comm is used by one thread at a time (the group's sequencer serialises every
// call), and NCCL communicators may be used from any thread once created.
unsafe impl Send for NcclBackend {}
// SAFETY: as above: all access goes through the group's sequencer.
unsafe impl Sync for NcclBackend {}

impl NcclBackend {
    /// Creates the communicator of rank `rank` of `size` on `cuda:local_rank`, exchanging the
    /// unique id through `store`. Errors: no CUDA driver, fewer GPUs than `local_rank + 1`, no
    /// NCCL library (naming where it looked), or ranks that do not join within `timeout`.
    pub fn new(
        store: Arc<dyn Store>,
        rank: usize,
        size: usize,
        local_rank: usize,
        timeout: Duration,
    ) -> Result<NcclBackend> {
        if !tensorplay_core::cuda::is_driver_present() {
            return Err(Error::Backend {
                backend: "nccl".into(),
                detail: "the CUDA driver library (libcuda.so) was not found on this machine; use the \"cpu\" backend".into(),
            });
        }
        let gpus = tensorplay_core::cuda::device_count();
        if local_rank >= gpus {
            return Err(Error::Backend {
                backend: "nccl".into(),
                detail: format!(
                    "NCCL needs one GPU per process: rank {rank} (local rank {local_rank}) wants cuda:{local_rank}, but this machine has {gpus} GPU(s); run at most {gpus} process(es) per machine"
                ),
            });
        }
        locate_nccl().map_err(|detail| Error::Backend {
            backend: "nccl".into(),
            detail,
        })?;
        let meta_store: Arc<dyn Store> = Arc::new(PrefixStore::new("meta", store.clone()));
        let meta =
            CpuBackend::with_options(meta_store, rank, size, timeout, CpuOptions::default())?;
        let ctx = tensorplay_core::cuda::context(local_rank)?;
        let stream = ctx.new_stream().map_err(|e| Error::Backend {
            backend: "nccl".into(),
            detail: format!("could not create a stream: {e:?}"),
        })?;
        let id = if rank == 0 {
            let id = Id::new().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            store.set("nccl_unique_id", &bytes)?;
            id
        } else {
            let bytes = store.get("nccl_unique_id")?;
            let arr: [u8; 128] = bytes.as_slice().try_into().map_err(|_| {
                Error::Store(format!(
                    "the NCCL unique id has {} bytes, expected 128",
                    bytes.len()
                ))
            })?;
            Id::uninit(arr.map(|b| b as std::ffi::c_char))
        };
        // ncclCommInitRank blocks until every rank joins: watch it with the timeout
        let (tx, rx) = crossbeam::channel::bounded(1);
        let s2 = stream.clone();
        std::thread::spawn(move || {
            let r = Comm::from_rank(s2, rank, size, id);
            let _ = tx.send(r.map(SendComm));
        });
        let comm = match rx.recv_timeout(timeout) {
            Ok(Ok(c)) => c.0,
            Ok(Err(e)) => return Err(nccl_err("ncclCommInitRank", e)),
            Err(_) => {
                return Err(Error::Timeout {
                    op: "nccl init".into(),
                    rank: rank as i64,
                    timeout,
                    detail: "not every rank joined the NCCL communicator".into(),
                });
            }
        };
        Ok(NcclBackend {
            comm,
            stream,
            device: Device::Cuda(local_rank),
            meta,
            rank,
            size,
            sent: AtomicU64::new(0),
        })
    }

    /// The CPU backend used for metadata checks and barriers.
    pub(crate) fn meta(&self) -> &dyn Backend {
        &self.meta
    }

    /// Bytes handed to NCCL by this rank.
    pub fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    fn check(&self, grank: &i64, arg: &str, t: &Tensor) -> Result<std::ops::Range<usize>> {
        if t.device() != self.device {
            return Err(Error::invalid(
                "nccl collective",
                *grank,
                arg,
                format!(
                    "a tensor on {} (NCCL works on this rank's GPU; use the \"cpu\" backend for host tensors)",
                    self.device
                ),
                format!("a tensor on {}", t.device()),
            ));
        }
        t.layout().contiguous_range().ok_or_else(|| {
            Error::invalid(
                "nccl collective",
                *grank,
                arg,
                "a contiguous CUDA tensor (call contiguous() on the host first)",
                "a strided view",
            )
        })
    }

    fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| Error::Backend {
            backend: "nccl".into(),
            detail: format!("stream synchronize failed: {e:?}"),
        })
    }

    fn count(&self, t: &Tensor) {
        self.sent.fetch_add(
            (t.numel() * t.dtype().size_in_bytes()) as u64,
            Ordering::Relaxed,
        );
    }
}

struct SendComm(Comm);
// SAFETY: the communicator is handed from the init thread to its single owner.
unsafe impl Send for SendComm {}

macro_rules! on_cuda_mut {
    ($t:expr, $range:expr, |$s:ident| $body:expr) => {
        $t.with_storage_mut(|st, _| -> Result<()> {
            let Storage::Cuda(c) = st else {
                return Err(Error::Backend {
                    backend: "nccl".into(),
                    detail: "expected CUDA storage".into(),
                });
            };
            match c.data_mut() {
                CudaData::F32(x) => {
                    #[allow(unused_mut)]
                    let mut $s = x.slice_mut($range);
                    $body
                }
                CudaData::F64(x) => {
                    #[allow(unused_mut)]
                    let mut $s = x.slice_mut($range);
                    $body
                }
                CudaData::I64(x) => {
                    #[allow(unused_mut)]
                    let mut $s = x.slice_mut($range);
                    $body
                }
                CudaData::Bool(_) => Err(Error::Backend {
                    backend: "nccl".into(),
                    detail: "bool tensors are not supported; use int64".into(),
                }),
            }
        })
    };
}

/// Runs `$body` with the input view `$x` and the output view `$o` of one dtype.
macro_rules! two_buf {
    ($out:expr, $ci:expr, $ro:expr, $ri:expr, |$x:ident, $o:ident| $body:expr) => {
        $out.with_storage_mut(|st, _| -> Result<()> {
            let Storage::Cuda(c) = st else {
                return Err(Error::Backend {
                    backend: "nccl".into(),
                    detail: "expected CUDA storage".into(),
                });
            };
            match ($ci, c.data_mut()) {
                (CudaData::F32(xi), CudaData::F32(xo)) => {
                    let $x = xi.slice($ri);
                    let mut $o = xo.slice_mut($ro);
                    $body
                }
                (CudaData::F64(xi), CudaData::F64(xo)) => {
                    let $x = xi.slice($ri);
                    let mut $o = xo.slice_mut($ro);
                    $body
                }
                (CudaData::I64(xi), CudaData::I64(xo)) => {
                    let $x = xi.slice($ri);
                    let mut $o = xo.slice_mut($ro);
                    $body
                }
                _ => Err(Error::Backend {
                    backend: "nccl".into(),
                    detail: "input and output must be float32, float64 or int64 of one dtype"
                        .into(),
                }),
            }
        })
    };
}

impl NcclBackend {
    pub(crate) fn all_reduce(
        &self,
        grank: &i64,
        t: &Tensor,
        op: ReduceOp,
        _timeout: Duration,
    ) -> Result<()> {
        let r = self.check(grank, "tensor", t)?;
        let op = to_nccl(op)?;
        on_cuda_mut!(t, r, |s| self
            .comm
            .all_reduce_in_place(&mut s, &op)
            .map(|_| ())
            .map_err(|e| nccl_err("all_reduce", e)))?;
        self.count(t);
        self.sync()
    }

    pub(crate) fn broadcast(
        &self,
        grank: &i64,
        t: &Tensor,
        root: usize,
        _timeout: Duration,
    ) -> Result<()> {
        let r = self.check(grank, "tensor", t)?;
        on_cuda_mut!(t, r, |s| self
            .comm
            .broadcast_in_place(&mut s, root as i32)
            .map(|_| ())
            .map_err(|e| nccl_err("broadcast", e)))?;
        self.count(t);
        self.sync()
    }

    pub(crate) fn reduce(
        &self,
        grank: &i64,
        t: &Tensor,
        op: ReduceOp,
        root: usize,
        _timeout: Duration,
    ) -> Result<()> {
        let r = self.check(grank, "tensor", t)?;
        let op = to_nccl(op)?;
        on_cuda_mut!(t, r, |s| self
            .comm
            .reduce_in_place(&mut s, &op, root as i32)
            .map(|_| ())
            .map_err(|e| nccl_err("reduce", e)))?;
        self.count(t);
        self.sync()
    }

    pub(crate) fn send(
        &self,
        grank: &i64,
        t: &Tensor,
        peer: usize,
        _timeout: Duration,
    ) -> Result<()> {
        let r = self.check(grank, "tensor", t)?;
        on_cuda_mut!(t, r, |s| self
            .comm
            .send(&s, peer as i32)
            .map_err(|e| nccl_err("send", e)))?;
        self.count(t);
        self.sync()
    }

    pub(crate) fn recv(
        &self,
        grank: &i64,
        t: &Tensor,
        peer: usize,
        _timeout: Duration,
    ) -> Result<()> {
        let r = self.check(grank, "tensor", t)?;
        on_cuda_mut!(t, r, |s| self
            .comm
            .recv(&mut s, peer as i32)
            .map(|_| ())
            .map_err(|e| nccl_err("recv", e)))?;
        self.sync()
    }

    /// Two-tensor collectives copy the input to a fresh device buffer first when it shares
    /// storage with the output (an in-place all-gather), so that the two locks never nest.
    fn staged_input(&self, grank: &i64, output: &Tensor, input: &Tensor) -> Result<Tensor> {
        self.check(grank, "input", input)?;
        if input.shares_storage_with(output) {
            return Ok(input.cpu()?.to_device(self.device)?);
        }
        Ok(input.clone())
    }

    pub(crate) fn all_gather_into_tensor(
        &self,
        grank: &i64,
        output: &Tensor,
        input: &Tensor,
        _timeout: Duration,
    ) -> Result<()> {
        let ro = self.check(grank, "output", output)?;
        if output.numel() != input.numel() * self.size || output.dtype() != input.dtype() {
            return Err(Error::invalid(
                "all_gather_into_tensor",
                *grank,
                "output",
                format!(
                    "{} elements of {}",
                    input.numel() * self.size,
                    input.dtype()
                ),
                format!("{} elements of {}", output.numel(), output.dtype()),
            ));
        }
        let input = self.staged_input(grank, output, input)?;
        let ri = input.layout().contiguous_range().unwrap_or(0..0);
        input.with_storage(|si, _| -> Result<()> {
            let Storage::Cuda(ci) = si else {
                return Err(Error::Backend {
                    backend: "nccl".into(),
                    detail: "expected CUDA storage".into(),
                });
            };
            let ci = ci.data();
            two_buf!(output, ci, ro.clone(), ri.clone(), |x, o| self
                .comm
                .all_gather(&x, &mut o)
                .map(|_| ())
                .map_err(|e| nccl_err("all_gather", e)))
        })?;
        self.count(&input);
        self.sync()
    }

    pub(crate) fn reduce_scatter_tensor(
        &self,
        grank: &i64,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
        _timeout: Duration,
    ) -> Result<()> {
        let ro = self.check(grank, "output", output)?;
        if input.numel() != output.numel() * self.size || output.dtype() != input.dtype() {
            return Err(Error::invalid(
                "reduce_scatter_tensor",
                *grank,
                "input",
                format!(
                    "{} elements of {}",
                    output.numel() * self.size,
                    output.dtype()
                ),
                format!("{} elements of {}", input.numel(), input.dtype()),
            ));
        }
        let op = to_nccl(op)?;
        let input = self.staged_input(grank, output, input)?;
        let ri = input.layout().contiguous_range().unwrap_or(0..0);
        input.with_storage(|si, _| -> Result<()> {
            let Storage::Cuda(ci) = si else {
                return Err(Error::Backend {
                    backend: "nccl".into(),
                    detail: "expected CUDA storage".into(),
                });
            };
            let ci = ci.data();
            two_buf!(output, ci, ro.clone(), ri.clone(), |x, o| self
                .comm
                .reduce_scatter(&x, &mut o, &op)
                .map(|_| ())
                .map_err(|e| nccl_err("reduce_scatter", e)))
        })?;
        self.count(&input);
        self.sync()
    }

    /// This rank in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }
}
