//! The stand-in for CUDA storage in builds without the `cuda` feature: the types exist but no
//! value of them can be made.

use crate::storage::CpuStorage;
use crate::{DType, Device, Error, Result};

/// No value: a build without CUDA never holds device memory.
#[derive(Debug, Clone, Copy)]
enum Never {}

/// Device memory (never present in a build without the `cuda` feature).
#[derive(Debug)]
pub struct CudaStorage(Never);

/// The typed device buffer inside a [`CudaStorage`] (never present without `cuda`).
#[derive(Debug)]
pub struct CudaData(Never);

fn unavailable() -> Error {
    Error::CudaUnavailable {
        reason: "this build of tensorplay has no CUDA support: enable the `cuda` feature of \
                 tensorplay (on by default) or of tensorplay-core"
            .into(),
    }
}

/// Whether the CUDA driver library can be loaded: never, without the `cuda` feature.
pub fn is_driver_present() -> bool {
    false
}

/// Number of CUDA devices: 0 without the `cuda` feature.
pub fn device_count() -> usize {
    0
}

impl CudaStorage {
    /// Errors: no CUDA support in this build.
    pub fn from_cpu(_src: &CpuStorage, _ordinal: usize) -> Result<CudaStorage> {
        Err(unavailable())
    }
    /// Errors: no CUDA support in this build.
    pub fn zeros(_dtype: DType, _n: usize, _ordinal: usize) -> Result<CudaStorage> {
        Err(unavailable())
    }
    /// Never called (no value exists).
    pub fn to_cpu(&self) -> Result<CpuStorage> {
        match self.0 {}
    }
    /// Never called (no value exists).
    pub fn dtype(&self) -> DType {
        match self.0 {}
    }
    /// Never called (no value exists).
    pub fn device(&self) -> Device {
        match self.0 {}
    }
    /// Never called (no value exists).
    pub fn len(&self) -> usize {
        match self.0 {}
    }
    /// Never called (no value exists).
    pub fn is_empty(&self) -> bool {
        match self.0 {}
    }
    /// Never called (no value exists).
    pub fn data(&self) -> &CudaData {
        match self.0 {}
    }
}
