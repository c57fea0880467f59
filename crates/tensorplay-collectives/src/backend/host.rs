//! Host backends: byte movers over contiguous host buffers ([`BufMut`], [`BufRef`]) and
//! group-local ranks. The `"cpu"` backend is one; every group's control channel (the cross-rank
//! argument checks, barriers) is one; [`HostTensors`](super::HostTensors) makes any of them a
//! [`Backend`](super::Backend) for CPU tensors.

use std::time::Duration;

use crate::{ReduceOp, Result};

use tensorplay_core::BufElement;
/// A read-only contiguous host buffer (core's [`HostBuf`](tensorplay_core::HostBuf)).
pub use tensorplay_core::HostBuf as BufRef;
/// A mutable contiguous host buffer of a dtype collectives move: float32, float64, int64,
/// bfloat16 or float16,
/// with a byte view (core's [`HostBufMut`](tensorplay_core::HostBufMut)).
pub use tensorplay_core::HostBufMut as BufMut;

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
    let (dt, st) = (dst.dtype(), src.dtype());
    let mismatch =
        || crate::Error::invalid("reduce", -1, "buffers", format!("one dtype ({dt})"), st);
    fn int(op: ReduceOp, d: &mut [i64], s: &[i64]) {
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
    }
    match dst.reborrow() {
        BufMut::F32(d) => float(op, d, f32::of_buf(src).ok_or_else(mismatch)?),
        BufMut::F64(d) => float(op, d, f64::of_buf(src).ok_or_else(mismatch)?),
        // 16-bit: each pair added in float32 and rounded once
        BufMut::BF16(d) => float(
            op,
            d,
            tensorplay_core::bf16::of_buf(src).ok_or_else(mismatch)?,
        ),
        BufMut::F16(d) => float(
            op,
            d,
            tensorplay_core::f16::of_buf(src).ok_or_else(mismatch)?,
        ),
        BufMut::I64(d) => {
            int(op, d, i64::of_buf(src).ok_or_else(mismatch)?);
            Ok(())
        }
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
    /// In-place all-reduce of `data` (every rank passes the same length). `Avg` of float32,
    /// float64 and int64 reduces as `Sum` (the caller divides); `Avg` of bfloat16 and float16
    /// is divided by the group size here, in float32 before the one rounding (as are
    /// `reduce`'s and `reduce_scatter`'s).
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
