//! CUDA devices and storage.
//!
//! With the `cuda` feature (the facade's default) this is cudarc-backed device memory; without
//! it, the same items exist as a stand-in (candle's dummy backend is the model): no CUDA
//! device is ever present, [`is_available`] is `false`, and creating CUDA storage returns
//! [`Error::CudaUnavailable`](crate::Error::CudaUnavailable) saying the build lacks the
//! feature. Code above the core compiles the same either way.
//!
//! Every core operation runs on CUDA tensors: kernels in CUDA C (`kernels/tensorplay.cu`)
//! compiled at run time by NVRTC for the device, matrix products by cuBLAS; both libraries
//! are loaded at run time (CUDA 13 or 12) and a missing one is reported as
//! [`Error::CudaUnavailable`](crate::Error::CudaUnavailable) naming what to install. The
//! operations reach the device through the backend contract (`backend.rs`); see
//! docs/cuda.md.

#[cfg(feature = "cuda")]
mod cublas;
#[cfg(not(feature = "cuda"))]
mod dummy;
#[cfg(all(test, feature = "cuda-emulator"))]
mod emulator;
#[cfg(feature = "cuda")]
mod kernel_cache;
#[cfg(feature = "cuda")]
mod library;
#[cfg(feature = "cuda")]
mod nvrtc;
#[cfg(feature = "cuda")]
mod ops;
#[cfg(any(feature = "cuda", all(test, feature = "cuda-emulator")))]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod plan;
#[cfg(feature = "cuda")]
mod real;
#[cfg(feature = "cuda")]
mod runtime;

#[cfg(not(feature = "cuda"))]
pub use dummy::{CudaData, CudaStorage, device_count, is_driver_present};
#[cfg(feature = "cuda")]
pub use nvrtc::{KERNELS, compile_kernels, compile_kernels_binary, nvrtc_version};
#[cfg(feature = "cuda")]
pub use real::{CudaData, CudaStorage, context, device_count, is_driver_present};

/// Whether this build has CUDA support (the core's `cuda` feature).
pub const COMPILED: bool = cfg!(feature = "cuda");

/// Compiles (once) and loads tensorplay's kernels on device `ordinal`, returning what the
/// NVRTC compiled them for, e.g. `"sm_90 by libnvrtc.so.13 (NVRTC 13.0)"`. The CUDA
/// operations do this on first use; calling it first moves that cost (about a second) and
/// reports a missing NVRTC early.
///
/// # Errors
/// [`crate::Error::CudaUnavailable`] naming what is missing (driver, device, NVRTC), or the
/// compiler's log when a kernel does not compile.
#[cfg(feature = "cuda")]
pub fn load_kernels(ordinal: usize) -> crate::Result<String> {
    let rt = runtime::runtime(&context(ordinal)?, ordinal)?;
    let (major, minor) = nvrtc_version()?;
    let file = nvrtc::Nvrtc::get_for(runtime::driver_version().map(|v| v.0))?
        .file
        .clone();
    Ok(format!("{} by {file} (NVRTC {major}.{minor})", rt.arch))
}

/// Without the `cuda` feature: always [`crate::Error::CudaUnavailable`].
///
/// # Errors
/// Always: this build has no CUDA support.
#[cfg(not(feature = "cuda"))]
pub fn load_kernels(ordinal: usize) -> crate::Result<String> {
    CudaStorage::zeros(crate::DType::F32, 1, ordinal).map(|_| String::new())
}

/// Waits until the work queued on device `ordinal` has finished (`torch.cuda.synchronize`);
/// CUDA operations run asynchronously, so timings need this.
///
/// # Errors
/// [`crate::Error::CudaUnavailable`] without a driver or device; [`crate::Error::Cuda`] when
/// an earlier kernel failed.
#[cfg(feature = "cuda")]
pub fn synchronize(ordinal: usize) -> crate::Result<()> {
    context(ordinal)?
        .synchronize()
        .map_err(|e| crate::Error::Cuda {
            op: "synchronize",
            message: format!("{e:?}"),
        })
}

/// Without the `cuda` feature: always [`crate::Error::CudaUnavailable`].
///
/// # Errors
/// Always: this build has no CUDA support.
#[cfg(not(feature = "cuda"))]
pub fn synchronize(ordinal: usize) -> crate::Result<()> {
    load_kernels(ordinal).map(|_| ())
}

/// Whether CUDA can be used (`torch.cuda.is_available`): compiled in, a driver, a device.
pub fn is_available() -> bool {
    device_count() > 0
}
