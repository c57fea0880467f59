//! CUDA devices and storage.
//!
//! With the `cuda` feature (the facade's default) this is cudarc-backed device memory; without
//! it, the same items exist as a stand-in (candle's dummy backend is the model): no CUDA
//! device is ever present, [`is_available`] is `false`, and creating CUDA storage returns
//! [`Error::CudaUnavailable`](crate::Error::CudaUnavailable) saying the build lacks the
//! feature. Code above the core compiles the same either way.
//!
//! Supported so far: allocation, host-to-device and device-to-host copies (`Tensor::to`).
//! Arithmetic on CUDA tensors returns [`Error::NotSupported`](crate::Error::NotSupported).

#[cfg(not(feature = "cuda"))]
mod dummy;
#[cfg(all(test, feature = "cuda-emulator"))]
mod emulator;
#[cfg(any(feature = "cuda", all(test, feature = "cuda-emulator")))]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod plan;
#[cfg(feature = "cuda")]
mod real;

#[cfg(not(feature = "cuda"))]
pub use dummy::{CudaData, CudaStorage, device_count, is_driver_present};
#[cfg(feature = "cuda")]
pub use real::{CudaData, CudaStorage, context, device_count, is_driver_present};

/// Whether this build has CUDA support (the core's `cuda` feature).
pub const COMPILED: bool = cfg!(feature = "cuda");

/// Whether CUDA can be used (`torch.cuda.is_available`): compiled in, a driver, a device.
pub fn is_available() -> bool {
    device_count() > 0
}
