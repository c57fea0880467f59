//! [`HostBuf`] and [`HostBufMut`]: borrowed contiguous host elements of a dtype whose bytes
//! may be written directly (`float32`, `float64`, `int64`, `bfloat16`, `float16`), with byte
//! views. What byte movers
//! (the collectives' host backends) take and give.

use std::ops::Range;

use super::{CpuStorage, StorageElement};
use crate::DType;
use crate::bytes::{self, PlainElement};

/// A read-only contiguous host buffer of `float32`, `float64`, `int64`, `bfloat16` or
/// `float16` elements.
#[derive(Debug, Clone, Copy)]
pub enum HostBuf<'a> {
    /// float32 elements.
    F32(&'a [f32]),
    /// float64 elements.
    F64(&'a [f64]),
    /// int64 elements.
    I64(&'a [i64]),
    /// bfloat16 elements.
    BF16(&'a [half::bf16]),
    /// float16 elements.
    F16(&'a [half::f16]),
}

/// A writable contiguous host buffer of `float32`, `float64`, `int64`, `bfloat16` or
/// `float16` elements.
#[derive(Debug)]
pub enum HostBufMut<'a> {
    /// float32 elements.
    F32(&'a mut [f32]),
    /// float64 elements.
    F64(&'a mut [f64]),
    /// int64 elements.
    I64(&'a mut [i64]),
    /// bfloat16 elements.
    BF16(&'a mut [half::bf16]),
    /// float16 elements.
    F16(&'a mut [half::f16]),
}

/// `$e` with `$s` bound to the slice of whichever variant `$b` is, rewrapped by `$wrap` where
/// the result is a buffer again.
macro_rules! each {
    ($b:expr, $t:ident, $s:ident => $wrap:ident($e:expr)) => {
        match $b {
            $t::F32($s) => $wrap::F32($e),
            $t::F64($s) => $wrap::F64($e),
            $t::I64($s) => $wrap::I64($e),
            $t::BF16($s) => $wrap::BF16($e),
            $t::F16($s) => $wrap::F16($e),
        }
    };
    ($b:expr, $t:ident, $s:ident => $e:expr) => {
        match $b {
            $t::F32($s) => $e,
            $t::F64($s) => $e,
            $t::I64($s) => $e,
            $t::BF16($s) => $e,
            $t::F16($s) => $e,
        }
    };
}

/// The element types of [`HostBuf`]: conversions between their slices and the buffers.
pub trait BufElement: PlainElement + StorageElement {
    /// `s` as a buffer.
    fn buf(s: &[Self]) -> HostBuf<'_>;
    /// `s` as a writable buffer.
    fn buf_mut(s: &mut [Self]) -> HostBufMut<'_>;
    /// The elements of `b` when its dtype is this type's.
    fn of_buf(b: HostBuf<'_>) -> Option<&[Self]>;
    /// The elements of `b` when its dtype is this type's.
    fn of_buf_mut(b: HostBufMut<'_>) -> Option<&mut [Self]>;
}

macro_rules! buf_element {
    ($t:ty, $v:ident, $($other:ident),*) => {
        impl BufElement for $t {
            fn buf(s: &[Self]) -> HostBuf<'_> {
                HostBuf::$v(s)
            }
            fn buf_mut(s: &mut [Self]) -> HostBufMut<'_> {
                HostBufMut::$v(s)
            }
            fn of_buf(b: HostBuf<'_>) -> Option<&[Self]> {
                match b {
                    HostBuf::$v(s) => Some(s),
                    $(HostBuf::$other(_))|* => None,
                }
            }
            fn of_buf_mut(b: HostBufMut<'_>) -> Option<&mut [Self]> {
                match b {
                    HostBufMut::$v(s) => Some(s),
                    $(HostBufMut::$other(_))|* => None,
                }
            }
        }
    };
}
buf_element!(f32, F32, F64, I64, BF16, F16);
buf_element!(f64, F64, F32, I64, BF16, F16);
buf_element!(i64, I64, F32, F64, BF16, F16);
buf_element!(half::bf16, BF16, F32, F64, I64, F16);
buf_element!(half::f16, F16, F32, F64, I64, BF16);

macro_rules! buf_common {
    ($t:ident) => {
        impl $t<'_> {
            /// Number of elements.
            pub fn len(&self) -> usize {
                each!(self, $t, s => s.len())
            }
            /// Whether there are no elements.
            pub fn is_empty(&self) -> bool {
                self.len() == 0
            }
            /// The dtype of the elements.
            pub fn dtype(&self) -> DType {
                match self {
                    $t::F32(_) => DType::F32,
                    $t::F64(_) => DType::F64,
                    $t::I64(_) => DType::I64,
                    $t::BF16(_) => DType::BF16,
                    $t::F16(_) => DType::F16,
                }
            }
            /// Size of one element in bytes (the dtype's [`DType::size_in_bytes`]).
            pub fn elem_size(&self) -> usize {
                self.dtype().size_in_bytes()
            }
        }
    };
}
buf_common!(HostBuf);
buf_common!(HostBufMut);

impl<'a> HostBuf<'a> {
    /// The elements as bytes (native endianness), `len() * elem_size()` of them.
    pub fn as_bytes(&self) -> &'a [u8] {
        each!(*self, HostBuf, s => bytes::as_bytes(s))
    }
    /// Elements `range`. Panics when `range` is out of bounds, as slicing does.
    pub fn slice(&self, range: Range<usize>) -> HostBuf<'a> {
        each!(*self, HostBuf, s => HostBuf(&s[range]))
    }
    /// `b` read as `n = b.len() / dtype.size_in_bytes()` elements of `dtype`; `None` when
    /// `dtype` is not one a buffer holds (`bool`), or `b` is not aligned for it or not a whole
    /// number of its elements.
    pub fn from_bytes(dtype: DType, b: &'a [u8]) -> Option<HostBuf<'a>> {
        match dtype {
            DType::F32 => bytes::from_bytes(b).map(HostBuf::F32),
            DType::F64 => bytes::from_bytes(b).map(HostBuf::F64),
            DType::I64 => bytes::from_bytes(b).map(HostBuf::I64),
            DType::BF16 => bytes::from_bytes(b).map(HostBuf::BF16),
            DType::F16 => bytes::from_bytes(b).map(HostBuf::F16),
            DType::Bool => None,
        }
    }
    /// An owned copy of the elements.
    pub fn to_storage(&self) -> CpuStorage {
        each!(*self, HostBuf, s => StorageElement::into_storage(s.to_vec()))
    }
}

impl<'a> HostBufMut<'a> {
    /// The elements as writable bytes (native endianness).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        each!(self, HostBufMut, s => bytes::as_bytes_mut(s))
    }
    /// A read-only view of the elements.
    pub fn as_ref(&self) -> HostBuf<'_> {
        each!(self, HostBufMut, s => HostBuf(&s[..]))
    }
    /// Elements `range`, borrowed from `self`. Panics when `range` is out of bounds.
    pub fn slice_mut(&mut self, range: Range<usize>) -> HostBufMut<'_> {
        each!(self, HostBufMut, s => HostBufMut(&mut s[range]))
    }
    /// A shorter-lived reborrow of all the elements.
    pub fn reborrow(&mut self) -> HostBufMut<'_> {
        each!(self, HostBufMut, s => HostBufMut(&mut s[..]))
    }
    /// A read-only view that keeps the buffer's lifetime.
    pub fn into_ref(self) -> HostBuf<'a> {
        each!(self, HostBufMut, s => HostBuf(&s[..]))
    }
    /// Elements `range`, keeping the buffer's lifetime. Panics when `range` is out of bounds.
    pub fn into_slice(self, range: Range<usize>) -> HostBufMut<'a> {
        each!(self, HostBufMut, s => HostBufMut(&mut s[range]))
    }
    /// The buffer split at element `mid` into two disjoint buffers that keep its lifetime.
    /// Panics when `mid > len()`, as `split_at_mut` does.
    pub fn split_at(self, mid: usize) -> (HostBufMut<'a>, HostBufMut<'a>) {
        match self {
            HostBufMut::F32(s) => {
                let (x, y) = s.split_at_mut(mid);
                (HostBufMut::F32(x), HostBufMut::F32(y))
            }
            HostBufMut::F64(s) => {
                let (x, y) = s.split_at_mut(mid);
                (HostBufMut::F64(x), HostBufMut::F64(y))
            }
            HostBufMut::I64(s) => {
                let (x, y) = s.split_at_mut(mid);
                (HostBufMut::I64(x), HostBufMut::I64(y))
            }
            HostBufMut::BF16(s) => {
                let (x, y) = s.split_at_mut(mid);
                (HostBufMut::BF16(x), HostBufMut::BF16(y))
            }
            HostBufMut::F16(s) => {
                let (x, y) = s.split_at_mut(mid);
                (HostBufMut::F16(x), HostBufMut::F16(y))
            }
        }
    }
}

impl CpuStorage {
    /// The elements as bytes (native endianness), for every dtype (a `bool` is the byte 0 or
    /// 1).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            CpuStorage::F32(v) => bytes::as_bytes(v),
            CpuStorage::F64(v) => bytes::as_bytes(v),
            CpuStorage::I64(v) => bytes::as_bytes(v),
            CpuStorage::Bool(v) => bytes::as_bytes(v),
            CpuStorage::BF16(v) => bytes::as_bytes(v),
            CpuStorage::F16(v) => bytes::as_bytes(v),
        }
    }
    /// The elements as a buffer; `None` for `bool` storage.
    pub fn as_buf(&self) -> Option<HostBuf<'_>> {
        match self {
            CpuStorage::F32(v) => Some(HostBuf::F32(v)),
            CpuStorage::F64(v) => Some(HostBuf::F64(v)),
            CpuStorage::I64(v) => Some(HostBuf::I64(v)),
            CpuStorage::BF16(v) => Some(HostBuf::BF16(v)),
            CpuStorage::F16(v) => Some(HostBuf::F16(v)),
            CpuStorage::Bool(_) => None,
        }
    }
    /// The elements as a writable buffer; `None` for `bool` storage (whose bytes must stay 0
    /// or 1).
    pub fn as_buf_mut(&mut self) -> Option<HostBufMut<'_>> {
        match self {
            CpuStorage::F32(v) => Some(HostBufMut::F32(v)),
            CpuStorage::F64(v) => Some(HostBufMut::F64(v)),
            CpuStorage::I64(v) => Some(HostBufMut::I64(v)),
            CpuStorage::BF16(v) => Some(HostBufMut::BF16(v)),
            CpuStorage::F16(v) => Some(HostBufMut::F16(v)),
            CpuStorage::Bool(_) => None,
        }
    }
}

#[cfg(test)]
mod tests;
