//! CUDA storage through cudarc (feature `cuda`): the only module of the crate that calls
//! cudarc.
//!
//! cudarc is built with dynamic loading and fixed CUDA 12.8 bindings, so this compiles and links
//! on machines without a CUDA toolkit. cudarc panics when its library cannot be loaded; every
//! entry point here first checks that the driver library is present and returns
//! [`Error::CudaUnavailable`] otherwise, so user code never sees a panic.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use crate::storage::CpuStorage;
use crate::{DType, Device, Error, Result};

/// Device memory of one dtype on one CUDA device.
#[derive(Debug)]
pub struct CudaStorage {
    ordinal: usize,
    data: CudaData,
    stream: Arc<CudaStream>,
}

/// The typed device buffer inside a [`CudaStorage`].
#[derive(Debug)]
pub enum CudaData {
    /// float32 elements.
    F32(CudaSlice<f32>),
    /// float64 elements.
    F64(CudaSlice<f64>),
    /// int64 elements.
    I64(CudaSlice<i64>),
    /// bool elements.
    Bool(CudaSlice<bool>),
    /// bfloat16 elements (devices of compute capability 8.0 or newer).
    BF16(CudaSlice<crate::bf16>),
    /// float16 elements.
    F16(CudaSlice<crate::f16>),
}

fn driver_error(op: &'static str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda {
        op,
        message: format!("{e:?}"),
    }
}

/// Whether the CUDA driver library (`libcuda.so`) can be loaded on this machine.
pub fn is_driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: is_culib_present only tries to dlopen the library and reports the outcome.
    *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
}

/// Number of CUDA devices; 0 when there is no driver or no device.
pub fn device_count() -> usize {
    if !is_driver_present() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// The context of device `ordinal` (cached, shared by every tensor on that device), or a
/// clear [`Error::CudaUnavailable`] naming what is missing.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    static CTX: OnceLock<Mutex<HashMap<usize, Arc<CudaContext>>>> = OnceLock::new();
    let mut map = CTX
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(c) = map.get(&ordinal) {
        return Ok(c.clone());
    }
    if !is_driver_present() {
        return Err(Error::CudaUnavailable {
            reason: "the CUDA driver library (libcuda.so) was not found; install the NVIDIA \
                     driver (and NVRTC and cuBLAS: see the README's CUDA section) or use the \
                     cpu device"
                .into(),
        });
    }
    // a driver that fails to start says why (not "0 devices")
    let n = CudaContext::device_count().map_err(|e| Error::CudaUnavailable {
        reason: format!(
            "the CUDA driver did not start: {e:?} (does `nvidia-smi` work? is \
             CUDA_VISIBLE_DEVICES set to an empty list?)"
        ),
    })?;
    let n = n.max(0) as usize;
    if ordinal >= n {
        return Err(Error::CudaUnavailable {
            reason: format!("device cuda:{ordinal} requested but {n} CUDA device(s) are present"),
        });
    }
    let c = CudaContext::new(ordinal).map_err(|e| driver_error("CudaContext::new", e))?;
    map.insert(ordinal, c.clone());
    Ok(c)
}

/// Refuses bfloat16 on a device older than compute capability 8.0 (its kernels and cuBLAS's
/// bfloat16 GEMM need sm_80), naming the device's capability.
fn check_dtype(dtype: DType, ctx: &CudaContext, ordinal: usize) -> Result<()> {
    if dtype != DType::BF16 {
        return Ok(());
    }
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| driver_error("compute capability", e))?;
    bf16_capability(ordinal, (major, minor))
}

/// The sm_80 rule of [`check_dtype`], on a known capability.
pub(crate) fn bf16_capability(ordinal: usize, (major, minor): (i32, i32)) -> Result<()> {
    if major >= 8 {
        return Ok(());
    }
    Err(Error::NotSupported {
        op: "bfloat16 on CUDA",
        detail: format!(
            "bfloat16 needs compute capability 8.0 or newer; device {ordinal} has \
             {major}.{minor} (use float16 or float32 on this device)"
        ),
    })
}

impl CudaStorage {
    /// Copies host memory to device `ordinal`.
    pub fn from_cpu(src: &CpuStorage, ordinal: usize) -> Result<CudaStorage> {
        if src.is_empty() {
            return CudaStorage::zeros(src.dtype(), 0, ordinal);
        }
        let ctx = context(ordinal)?;
        check_dtype(src.dtype(), &ctx, ordinal)?;
        let stream = ctx.default_stream();
        let e = |e| driver_error("memcpy host to device", e);
        let data = match src {
            CpuStorage::F32(v) => CudaData::F32(stream.clone_htod(v).map_err(e)?),
            CpuStorage::F64(v) => CudaData::F64(stream.clone_htod(v).map_err(e)?),
            CpuStorage::I64(v) => CudaData::I64(stream.clone_htod(v).map_err(e)?),
            CpuStorage::Bool(v) => CudaData::Bool(stream.clone_htod(v).map_err(e)?),
            CpuStorage::BF16(v) => CudaData::BF16(stream.clone_htod(v).map_err(e)?),
            CpuStorage::F16(v) => CudaData::F16(stream.clone_htod(v).map_err(e)?),
        };
        Ok(CudaStorage {
            ordinal,
            data,
            stream,
        })
    }

    /// `n` elements of `dtype` on device `ordinal`, not initialised (for kernels that write
    /// every element).
    pub(crate) fn uninit(dtype: DType, n: usize, ordinal: usize) -> Result<CudaStorage> {
        let n = n.max(1);
        let ctx = context(ordinal)?;
        check_dtype(dtype, &ctx, ordinal)?;
        let stream = ctx.default_stream();
        let e = |e| driver_error("alloc", e);
        // SAFETY: the memory is written by a kernel before anything reads it (callers' contract).
        let data = unsafe {
            match dtype {
                DType::F32 => CudaData::F32(stream.alloc(n).map_err(e)?),
                DType::F64 => CudaData::F64(stream.alloc(n).map_err(e)?),
                DType::I64 => CudaData::I64(stream.alloc(n).map_err(e)?),
                DType::Bool => CudaData::Bool(stream.alloc(n).map_err(e)?),
                DType::BF16 => CudaData::BF16(stream.alloc(n).map_err(e)?),
                DType::F16 => CudaData::F16(stream.alloc(n).map_err(e)?),
            }
        };
        Ok(CudaStorage {
            ordinal,
            data,
            stream,
        })
    }

    /// The device's ordinal.
    pub(crate) fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// `n` zeros of `dtype` on device `ordinal` (at least one element is allocated: the
    /// driver refuses empty allocations).
    pub fn zeros(dtype: DType, n: usize, ordinal: usize) -> Result<CudaStorage> {
        let n = n.max(1);
        let ctx = context(ordinal)?;
        check_dtype(dtype, &ctx, ordinal)?;
        let stream = ctx.default_stream();
        let e = |e| driver_error("alloc_zeros", e);
        let data = match dtype {
            DType::F32 => CudaData::F32(stream.alloc_zeros(n).map_err(e)?),
            DType::F64 => CudaData::F64(stream.alloc_zeros(n).map_err(e)?),
            DType::I64 => CudaData::I64(stream.alloc_zeros(n).map_err(e)?),
            DType::Bool => CudaData::Bool(stream.alloc_zeros(n).map_err(e)?),
            DType::BF16 => CudaData::BF16(stream.alloc_zeros(n).map_err(e)?),
            DType::F16 => CudaData::F16(stream.alloc_zeros(n).map_err(e)?),
        };
        Ok(CudaStorage {
            ordinal,
            data,
            stream,
        })
    }

    /// Copies the whole buffer back to host memory (synchronising the stream).
    pub fn to_cpu(&self) -> Result<CpuStorage> {
        let e = |e| driver_error("memcpy device to host", e);
        Ok(match &self.data {
            CudaData::F32(s) => CpuStorage::F32(self.stream.clone_dtoh(s).map_err(e)?),
            CudaData::F64(s) => CpuStorage::F64(self.stream.clone_dtoh(s).map_err(e)?),
            CudaData::I64(s) => CpuStorage::I64(self.stream.clone_dtoh(s).map_err(e)?),
            CudaData::Bool(s) => CpuStorage::Bool(self.stream.clone_dtoh(s).map_err(e)?),
            CudaData::BF16(s) => CpuStorage::BF16(self.stream.clone_dtoh(s).map_err(e)?),
            CudaData::F16(s) => CpuStorage::F16(self.stream.clone_dtoh(s).map_err(e)?),
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match &self.data {
            CudaData::F32(_) => DType::F32,
            CudaData::F64(_) => DType::F64,
            CudaData::I64(_) => DType::I64,
            CudaData::Bool(_) => DType::Bool,
            CudaData::BF16(_) => DType::BF16,
            CudaData::F16(_) => DType::F16,
        }
    }

    /// The device.
    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.data {
            CudaData::F32(s) => s.len(),
            CudaData::F64(s) => s.len(),
            CudaData::I64(s) => s.len(),
            CudaData::Bool(s) => s.len(),
            CudaData::BF16(s) => s.len(),
            CudaData::F16(s) => s.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The typed device buffer (for communication backends such as NCCL).
    pub fn data(&self) -> &CudaData {
        &self.data
    }

    /// The typed device buffer, mutably.
    pub fn data_mut(&mut self) -> &mut CudaData {
        &mut self.data
    }

    /// The stream work on this buffer is ordered on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}
