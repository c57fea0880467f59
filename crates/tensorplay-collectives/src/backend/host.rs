//! Host backends: byte movers over contiguous host buffers ([`BufMut`], [`BufRef`]) and
//! group-local ranks. The `"cpu"` backend is one; every group's control channel (the cross-rank
//! argument checks, barriers) is one; [`HostTensors`](super::HostTensors) makes any of them a
//! [`Backend`](super::Backend) for CPU tensors.

use std::time::Duration;

use crate::{ReduceOp, Result};

/// A mutable contiguous buffer of one of the dtypes collectives support.
#[derive(Debug)]
pub enum BufMut<'a> {
    /// float32 elements.
    F32(&'a mut [f32]),
    /// float64 elements.
    F64(&'a mut [f64]),
    /// int64 elements.
    I64(&'a mut [i64]),
}

/// A read-only contiguous buffer of one of the dtypes collectives support.
#[derive(Debug, Clone, Copy)]
pub enum BufRef<'a> {
    /// float32 elements.
    F32(&'a [f32]),
    /// float64 elements.
    F64(&'a [f64]),
    /// int64 elements.
    I64(&'a [i64]),
}

macro_rules! buf_common {
    ($t:ident) => {
        impl $t<'_> {
            /// Number of elements.
            pub fn len(&self) -> usize {
                match self {
                    $t::F32(s) => s.len(),
                    $t::F64(s) => s.len(),
                    $t::I64(s) => s.len(),
                }
            }
            /// Whether there are no elements.
            pub fn is_empty(&self) -> bool {
                self.len() == 0
            }
            /// Size of one element in bytes.
            pub fn elem_size(&self) -> usize {
                match self {
                    $t::F32(_) => 4,
                    $t::F64(_) | $t::I64(_) => 8,
                }
            }
            /// The dtype.
            pub fn dtype(&self) -> tensorplay_core::DType {
                match self {
                    $t::F32(_) => tensorplay_core::DType::F32,
                    $t::F64(_) => tensorplay_core::DType::F64,
                    $t::I64(_) => tensorplay_core::DType::I64,
                }
            }
        }
    };
}
buf_common!(BufMut);
buf_common!(BufRef);

impl BufMut<'_> {
    /// The elements as bytes (native endianness).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: f32, f64 and i64 have no padding and every bit pattern is valid for them, so
        // viewing their memory as bytes (and writing any bytes) is sound; the length is the
        // byte size of the same allocation.
        unsafe {
            match self {
                BufMut::F32(s) => {
                    std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), s.len() * 4)
                }
                BufMut::F64(s) => {
                    std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), s.len() * 8)
                }
                BufMut::I64(s) => {
                    std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), s.len() * 8)
                }
            }
        }
    }
    /// A read-only view.
    pub fn as_ref(&self) -> BufRef<'_> {
        match self {
            BufMut::F32(s) => BufRef::F32(s),
            BufMut::F64(s) => BufRef::F64(s),
            BufMut::I64(s) => BufRef::I64(s),
        }
    }
    /// Elements `range` as a buffer.
    pub fn slice_mut(&mut self, range: std::ops::Range<usize>) -> BufMut<'_> {
        match self {
            BufMut::F32(s) => BufMut::F32(&mut s[range]),
            BufMut::F64(s) => BufMut::F64(&mut s[range]),
            BufMut::I64(s) => BufMut::I64(&mut s[range]),
        }
    }
}

impl<'a> BufRef<'a> {
    /// The elements as bytes (native endianness).
    pub fn as_bytes(&self) -> &'a [u8] {
        // SAFETY: as in `BufMut::as_bytes_mut`; reading plain numbers as bytes is sound.
        unsafe {
            match *self {
                BufRef::F32(s) => std::slice::from_raw_parts(s.as_ptr().cast(), s.len() * 4),
                BufRef::F64(s) => std::slice::from_raw_parts(s.as_ptr().cast(), s.len() * 8),
                BufRef::I64(s) => std::slice::from_raw_parts(s.as_ptr().cast(), s.len() * 8),
            }
        }
    }
    /// Elements `range` as a buffer.
    pub fn slice(&self, range: std::ops::Range<usize>) -> BufRef<'a> {
        match *self {
            BufRef::F32(s) => BufRef::F32(&s[range]),
            BufRef::F64(s) => BufRef::F64(&s[range]),
            BufRef::I64(s) => BufRef::I64(&s[range]),
        }
    }
}

/// `dst[i] = op(dst[i], src[i])` elementwise. `Avg` reduces as `Sum` (the caller divides);
/// bitwise ops apply to int64 only. Errors when the dtypes differ or the op does not apply.
pub fn reduce_into(op: ReduceOp, dst: &mut BufMut<'_>, src: BufRef<'_>) -> Result<()> {
    fn float<T: Copy + PartialOrd + std::ops::Add<Output = T> + std::ops::Mul<Output = T>>(
        op: ReduceOp,
        d: &mut [T],
        s: &[T],
    ) -> Result<()> {
        #[allow(clippy::eq_op)]
        let nan = |x: T| x != x;
        match op {
            ReduceOp::Sum | ReduceOp::Avg => d.iter_mut().zip(s).for_each(|(a, &b)| *a = *a + b),
            ReduceOp::Product => d.iter_mut().zip(s).for_each(|(a, &b)| *a = *a * b),
            ReduceOp::Max => d.iter_mut().zip(s).for_each(|(a, &b)| {
                if b > *a || nan(b) {
                    *a = b
                }
            }),
            ReduceOp::Min => d.iter_mut().zip(s).for_each(|(a, &b)| {
                if b < *a || nan(b) {
                    *a = b
                }
            }),
            _ => {
                return Err(crate::Error::invalid(
                    "reduce",
                    -1,
                    "op",
                    "Sum, Product, Min, Max or Avg for floating tensors",
                    format!("{op:?}"),
                ));
            }
        }
        Ok(())
    }
    match (dst, src) {
        (BufMut::F32(d), BufRef::F32(s)) => float(op, d, s),
        (BufMut::F64(d), BufRef::F64(s)) => float(op, d, s),
        (BufMut::I64(d), BufRef::I64(s)) => {
            let z = d.iter_mut().zip(s);
            match op {
                ReduceOp::Sum | ReduceOp::Avg => z.for_each(|(a, &b)| *a = a.wrapping_add(b)),
                ReduceOp::Product => z.for_each(|(a, &b)| *a = a.wrapping_mul(b)),
                ReduceOp::Max => z.for_each(|(a, &b)| *a = (*a).max(b)),
                ReduceOp::Min => z.for_each(|(a, &b)| *a = (*a).min(b)),
                ReduceOp::BAnd => z.for_each(|(a, &b)| *a &= b),
                ReduceOp::BOr => z.for_each(|(a, &b)| *a |= b),
                ReduceOp::BXor => z.for_each(|(a, &b)| *a ^= b),
            }
            Ok(())
        }
        (d, s) => Err(crate::Error::invalid(
            "reduce",
            -1,
            "buffers",
            format!("one dtype ({})", d.dtype()),
            s.dtype(),
        )),
    }
}

/// A backend over host buffers and group-local ranks `0..size`. All buffers are contiguous;
/// every call blocks until done or until `timeout`, and fails with a clear error when a peer
/// dies. Calls on one backend object are made from one thread at a time, in issue order.
pub trait HostBackend: Send + Sync {
    /// `"cpu"` or `"nccl"`.
    fn name(&self) -> &'static str;
    /// This process's rank in the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// In-place all-reduce of `data` (every rank passes the same length).
    fn all_reduce(&self, data: BufMut<'_>, op: ReduceOp, timeout: Duration) -> Result<()>;
    /// In-place broadcast from `root`.
    fn broadcast(&self, data: BufMut<'_>, root: usize, timeout: Duration) -> Result<()>;
    /// Reduces into `root`'s `data`; other ranks' `data` is left unchanged.
    fn reduce(&self, data: BufMut<'_>, op: ReduceOp, root: usize, timeout: Duration) -> Result<()>;
    /// Concatenates every rank's `input` into `output` in rank order; `counts[r]` is the length
    /// of rank `r`'s input and `output.len() == counts.iter().sum()`.
    fn all_gather(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        counts: &[usize],
        timeout: Duration,
    ) -> Result<()>;
    /// Reduces `input` (`size * n` elements) across ranks and leaves block `rank` (n elements)
    /// in `output`.
    fn reduce_scatter(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()>;
    /// Gathers every rank's `input` into `root`'s `output` (`counts` as in `all_gather`);
    /// `output` is `None` on other ranks.
    fn gather(
        &self,
        input: BufRef<'_>,
        output: Option<BufMut<'_>>,
        counts: &[usize],
        root: usize,
        timeout: Duration,
    ) -> Result<()>;
    /// Sends block `r` of `root`'s `input` (split by `counts`) to rank `r`'s `output`.
    fn scatter(
        &self,
        input: Option<BufRef<'_>>,
        output: BufMut<'_>,
        counts: &[usize],
        root: usize,
        timeout: Duration,
    ) -> Result<()>;
    /// Sends `input[send_offsets[r]..][..send_counts[r]]` to rank `r` and receives rank `r`'s
    /// block into `output[recv_offsets[r]..][..recv_counts[r]]` (offsets are prefix sums).
    fn all_to_all(
        &self,
        input: BufRef<'_>,
        send_counts: &[usize],
        output: BufMut<'_>,
        recv_counts: &[usize],
        timeout: Duration,
    ) -> Result<()>;
    /// Sends `data` to `dst` with `tag`.
    fn send(&self, data: BufRef<'_>, dst: usize, tag: u64, timeout: Duration) -> Result<()>;
    /// Receives into `data` from `src` with `tag`.
    fn recv(&self, data: BufMut<'_>, src: usize, tag: u64, timeout: Duration) -> Result<()>;
    /// Waits until every rank has entered the barrier.
    fn barrier(&self, timeout: Duration) -> Result<()>;
    /// Bytes this backend has sent so far (for summaries).
    fn bytes_sent(&self) -> u64 {
        0
    }
    /// How collectives move between this group's ranks: `"shm"` (shared memory, every rank
    /// on one host), `"tcp"`, `"shm+tcp"` (several hosts), or the backend's name where it
    /// has a single transport.
    fn transport(&self) -> &'static str {
        self.name()
    }
}
