//! The stand-in for CUDA storage in builds without the `cuda` feature: the types exist but no
//! value of them can be made.

use crate::Layout;
use crate::backend::{
    AdamStep, BinaryCode, CmpCode, DeviceStorage, IndexKind, ReduceCode, SgdStep, UnaryCode,
};
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

// No value exists: none of these can be called.
impl DeviceStorage for CudaStorage {
    fn unary(&self, _: &Layout, _: UnaryCode, _: f64) -> Result<Self> {
        match self.0 {}
    }
    fn binary(&self, _: &Layout, _: &Self, _: &Layout, _: BinaryCode) -> Result<Self> {
        match self.0 {}
    }
    fn compare(&self, _: &Layout, _: Option<(&Self, &Layout)>, _: CmpCode, _: f64) -> Result<Self> {
        match self.0 {}
    }
    fn select(&self, _: &Layout, _: (&Self, &Layout), _: (&Self, &Layout)) -> Result<Self> {
        match self.0 {}
    }
    fn copy_as(&self, _: &Layout, _: DType) -> Result<Self> {
        match self.0 {}
    }
    fn write(&mut self, _: &Layout, _: &Self, _: &Layout) -> Result<()> {
        match self.0 {}
    }
    fn reduce(
        &self,
        _: &Layout,
        _: &[usize],
        _: ReduceCode,
        _: bool,
    ) -> Result<(Self, Option<Self>)> {
        match self.0 {}
    }
    fn matmul(&self, _: &Layout, _: &Self, _: &Layout, _: usize) -> Result<Self> {
        match self.0 {}
    }
    fn index(&self, _: IndexKind, _: &Self, _: (usize, usize, usize, usize)) -> Result<Self> {
        match self.0 {}
    }
    fn scatter_add(&mut self, _: &Self, _: &Self, _: (usize, usize, usize, usize)) -> Result<()> {
        match self.0 {}
    }
    fn cross_entropy(&self, _: &Self, _: usize, _: usize) -> Result<(Self, Self)> {
        match self.0 {}
    }
    fn dropout_mask(&self, _: usize, _: u64, _: u64, _: f64) -> Result<Self> {
        match self.0 {}
    }
    fn sgd_step(&mut self, _: usize, _: &Self, _: Option<&mut Self>, _: &SgdStep) -> Result<()> {
        match self.0 {}
    }
    fn adam_step(
        &mut self,
        _: usize,
        _: &Self,
        _: &mut Self,
        _: &mut Self,
        _: Option<&mut Self>,
        _: &AdamStep,
    ) -> Result<()> {
        match self.0 {}
    }
    fn zeros_like_device(&self, _: DType, _: usize) -> Result<Self> {
        match self.0 {}
    }
    fn upload(&self, _: &CpuStorage) -> Result<Self> {
        match self.0 {}
    }
}
