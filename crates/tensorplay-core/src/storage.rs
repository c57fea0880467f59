//! Storage: the memory a tensor views.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

mod buf;
pub(crate) mod huge_pages;
pub(crate) mod pool;

pub use buf::{BufElement, HostBuf, HostBufMut};

use crate::cuda::CudaStorage;
use crate::{DType, Device, Element, Error, Result};

/// Host memory of one dtype.
#[derive(Debug, Clone)]
pub enum CpuStorage {
    /// `float32` elements.
    F32(Vec<f32>),
    /// `float64` elements.
    F64(Vec<f64>),
    /// `int64` elements.
    I64(Vec<i64>),
    /// `bool` elements.
    Bool(Vec<bool>),
    /// `bfloat16` elements.
    BF16(Vec<half::bf16>),
    /// `float16` elements.
    F16(Vec<half::f16>),
}

impl CpuStorage {
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::I64(_) => DType::I64,
            CpuStorage::Bool(_) => DType::Bool,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F16(_) => DType::F16,
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            CpuStorage::I64(v) => v.len(),
            CpuStorage::Bool(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
        }
    }
    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `n` zeros (false for bool) of `dtype`.
    pub fn zeros(dtype: DType, n: usize) -> CpuStorage {
        crate::with_dtype!(dtype, T => T::into_storage(vec![T::default(); n]))
    }
}

/// `n` copies of `value` in a buffer from the caching allocator ([`pool`]: a buffer of 16 KiB
/// or more is a cached one when the cache has it, so no page faults), or an
/// [`Error::InvalidArgument`] naming `op` and `arg` when the memory cannot be allocated
/// (instead of aborting the process).
pub(crate) fn try_vec<T: StorageElement>(
    n: usize,
    value: T,
    op: &'static str,
    arg: &'static str,
) -> Result<Vec<T>> {
    pool::try_take_filled(n, value).map_err(|_| {
        Error::invalid(
            op,
            arg,
            "a tensor that fits in memory",
            format!("{n} elements of {} bytes", size_of::<T>().max(1)),
        )
    })
}

/// Conversion between a typed `Vec`/slice and [`CpuStorage`].
pub trait StorageElement: Element {
    /// Wraps a vector.
    fn into_storage(v: Vec<Self>) -> CpuStorage;
    /// Borrows the elements when the dtype matches.
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    /// Mutably borrows the elements when the dtype matches.
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
    /// Unwraps the vector when the dtype matches; gives the storage back otherwise.
    fn into_vec(s: CpuStorage) -> std::result::Result<Vec<Self>, CpuStorage>;
}

macro_rules! impl_storage_element {
    ($t:ty, $v:ident, $($other:ident),*) => {
        impl StorageElement for $t {
            fn into_storage(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$v(v)
            }
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$v(v) => Some(v),
                    $(CpuStorage::$other(_))|* => None,
                }
            }
            fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$v(v) => Some(v),
                    $(CpuStorage::$other(_))|* => None,
                }
            }
            fn into_vec(s: CpuStorage) -> std::result::Result<Vec<Self>, CpuStorage> {
                match s {
                    CpuStorage::$v(v) => Ok(v),
                    other @ ($(CpuStorage::$other(_))|*) => Err(other),
                }
            }
        }
    };
}
impl_storage_element!(f32, F32, F64, I64, Bool, BF16, F16);
impl_storage_element!(f64, F64, F32, I64, Bool, BF16, F16);
impl_storage_element!(i64, I64, F32, F64, Bool, BF16, F16);
impl_storage_element!(bool, Bool, F32, F64, I64, BF16, F16);
impl_storage_element!(half::bf16, BF16, F32, F64, I64, Bool, F16);
impl_storage_element!(half::f16, F16, F32, F64, I64, Bool, BF16);

/// The storage of a tensor on the meta device: how many elements of which dtype it would
/// hold, and no memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaStorage {
    /// The dtype of the elements it stands for.
    pub dtype: DType,
    /// How many elements it stands for.
    pub len: usize,
}

/// Memory on some device.
#[derive(Debug)]
pub enum Storage {
    /// Host memory.
    Cpu(CpuStorage),
    /// CUDA device memory.
    Cuda(CudaStorage),
    /// No memory: the meta device ([`Device::Meta`]).
    Meta(MetaStorage),
}

impl Storage {
    /// The device this storage lives on.
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Cuda(c) => c.device(),
            Storage::Meta(_) => Device::Meta,
        }
    }
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(c) => c.dtype(),
            Storage::Cuda(c) => c.dtype(),
            Storage::Meta(m) => m.dtype,
        }
    }
    /// Number of elements (those a meta storage stands for).
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(c) => c.len(),
            Storage::Cuda(c) => c.len(),
            Storage::Meta(m) => m.len,
        }
    }
    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The bytes the allocator's statistics count for `s`: a host buffer's capacity; nothing for
/// device memory or the meta device.
fn counted_bytes(s: &Storage) -> usize {
    match s {
        Storage::Cpu(c) => pool::capacity_bytes(c),
        Storage::Cuda(_) | Storage::Meta(_) => 0,
    }
}

/// A [`Device`] as one word, so that a storage can change device in place
/// ([`StorageCell::materialize`]) while every tensor viewing it reads the new one.
fn device_code(d: Device) -> u64 {
    match d {
        Device::Cpu => 0,
        Device::Meta => 1,
        Device::Cuda(i) => 2 + i as u64,
    }
}

fn device_of_code(c: u64) -> Device {
    match c {
        0 => Device::Cpu,
        1 => Device::Meta,
        i => Device::Cuda((i - 2) as usize),
    }
}

/// A storage shared by all views of it, with the version counter that in-place writes bump
/// (autograd uses it to detect that a saved tensor was modified).
#[derive(Debug)]
pub(crate) struct StorageCell {
    data: RwLock<Storage>,
    /// The host bytes counted as allocated for the cell's buffer (uncounted at drop, whatever
    /// `with_storage_mut` put in the cell meanwhile); [`StorageCell::resize`] recounts.
    counted: AtomicUsize,
    version: AtomicU64,
    /// [`device_code`] of the storage's device.
    device: AtomicU64,
}

impl Drop for StorageCell {
    fn drop(&mut self) {
        let s = std::mem::replace(
            self.data.get_mut().unwrap_or_else(|e| e.into_inner()),
            Storage::Cpu(CpuStorage::Bool(Vec::new())),
        );
        pool::on_free(
            match s {
                Storage::Cpu(c) => Some(c),
                Storage::Cuda(_) | Storage::Meta(_) => None,
            },
            *self.counted.get_mut(),
        );
    }
}

impl StorageCell {
    pub(crate) fn new(s: Storage) -> Self {
        let counted = counted_bytes(&s);
        pool::on_alloc(counted);
        StorageCell {
            device: AtomicU64::new(device_code(s.device())),
            counted: AtomicUsize::new(counted),
            data: RwLock::new(s),
            version: AtomicU64::new(0),
        }
    }
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, Storage> {
        self.data.read().unwrap_or_else(|e| e.into_inner())
    }
    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, Storage> {
        self.version.fetch_add(1, Ordering::Relaxed);
        self.data.write().unwrap_or_else(|e| e.into_inner())
    }
    pub(crate) fn read_len(&self) -> usize {
        self.read().len()
    }
    /// The device of the storage (without locking it).
    pub(crate) fn device(&self) -> Device {
        device_of_code(self.device.load(Ordering::Relaxed))
    }
    /// Gives a meta storage memory on `device`: zeros of its dtype and length (a no-op for
    /// storage that has memory already). Every tensor viewing the cell moves with it; the
    /// version is not bumped (there were no values to invalidate).
    pub(crate) fn materialize(&self, device: Device) -> Result<()> {
        let mut g = self.data.write().unwrap_or_else(|e| e.into_inner());
        let Storage::Meta(m) = &*g else {
            return Ok(());
        };
        let m = *m;
        let cpu = || -> Result<CpuStorage> {
            Ok(crate::with_dtype!(m.dtype, T => T::into_storage(
                try_vec(m.len, T::default(), "Module::to_empty", "module")?
            )))
        };
        let fresh = match device {
            Device::Meta => return Ok(()),
            Device::Cpu => Storage::Cpu(cpu()?),
            Device::Cuda(i) => Storage::Cuda(CudaStorage::from_cpu(&cpu()?, i)?),
        };
        let counted = counted_bytes(&fresh);
        pool::on_alloc(counted);
        self.counted.store(counted, Ordering::Relaxed);
        *g = fresh;
        self.device.store(device_code(device), Ordering::Relaxed);
        Ok(())
    }
    pub(crate) fn version(&self) -> u64 {
        self.version.load(Ordering::Relaxed)
    }
    /// Puts the version counter back to `v` (after a write that must not invalidate the
    /// tensors autograd saved, such as refilling a gathered parameter with the same values).
    pub(crate) fn set_version(&self, v: u64) {
        self.version.store(v, Ordering::Relaxed);
    }
    /// Replaces the host buffer by one of `n` elements of the same dtype (values unspecified
    /// until written; the old ones are gone), without bumping the version: `n = 0` frees the
    /// memory while the tensors over it live on. The allocator's statistics follow.
    pub(crate) fn resize(&self, n: usize) -> Result<()> {
        let mut g = self.data.write().unwrap_or_else(|e| e.into_inner());
        if let Storage::Meta(m) = &mut *g {
            m.len = n;
            return Ok(());
        }
        let Storage::Cpu(c) = &mut *g else {
            return Err(Error::NotSupported {
                op: "resize_storage_",
                detail: "on CUDA tensors yet".into(),
            });
        };
        if c.len() == n {
            return Ok(());
        }
        let fresh = if n == 0 {
            CpuStorage::zeros(c.dtype(), 0)
        } else {
            crate::with_dtype!(c.dtype(), T => T::into_storage(pool::take::<T>(n)))
        };
        let old = std::mem::replace(c, fresh);
        let now = pool::capacity_bytes(c);
        pool::on_alloc(now);
        let before = self.counted.swap(now, Ordering::Relaxed);
        drop(g);
        pool::on_free(Some(old), before);
        Ok(())
    }
}
