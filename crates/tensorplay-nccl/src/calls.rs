//! The NCCL calls the backend makes, typed over [`Dev`] buffers: each is enqueued on the
//! communicator's stream and returns NCCL's result (the caller waits through
//! [`Communicator::run`]).

use crate::comm::Communicator;
use crate::device::Dev;
use crate::ffi::NcclResult;

impl Communicator {
    /// `ncclAllReduce` in place on `d`.
    pub(crate) fn all_reduce(&self, d: Dev, op: i32) -> NcclResult {
        let n = self.nccl();
        // SAFETY: `d` is the live device memory of a tensor held by the caller for the whole
        // call (which waits for the work), `d.count` elements of `d.dtype`.
        unsafe {
            (n.all_reduce)(
                d.buf(),
                d.buf_mut(),
                d.count,
                d.dtype,
                op,
                self.raw(),
                self.raw_stream(),
            )
        }
    }

    /// `ncclBroadcast` from group rank `root`: `src` is read on root only, `dst` written on
    /// every rank (they may be the same buffer).
    pub(crate) fn broadcast(&self, src: Dev, dst: Dev, root: usize) -> NcclResult {
        let n = self.nccl();
        // SAFETY: as in `all_reduce`; `dst` holds `dst.count` elements (the sizes were agreed
        // across ranks above the backend).
        unsafe {
            (n.broadcast)(
                src.buf(),
                dst.buf_mut(),
                dst.count,
                dst.dtype,
                root as i32,
                self.raw(),
                self.raw_stream(),
            )
        }
    }

    /// `ncclReduce` of `src` into `dst` on group rank `root` (`dst` is used on root only).
    pub(crate) fn reduce(&self, src: Dev, dst: Dev, op: i32, root: usize) -> NcclResult {
        let n = self.nccl();
        // SAFETY: as in `broadcast`.
        unsafe {
            (n.reduce)(
                src.buf(),
                dst.buf_mut(),
                src.count,
                src.dtype,
                op,
                root as i32,
                self.raw(),
                self.raw_stream(),
            )
        }
    }

    /// `ncclAllGather` of `src` into `dst` (`size * src.count` elements).
    pub(crate) fn all_gather(&self, src: Dev, dst: Dev) -> NcclResult {
        let n = self.nccl();
        // SAFETY: as in `all_reduce`; `dst` holds `size * src.count` elements and does not
        // overlap `src` (checked and staged above the backend).
        unsafe {
            (n.all_gather)(
                src.buf(),
                dst.buf_mut(),
                src.count,
                src.dtype,
                self.raw(),
                self.raw_stream(),
            )
        }
    }

    /// `ncclReduceScatter` of `src` (`size * dst.count` elements) into `dst`.
    pub(crate) fn reduce_scatter(&self, src: Dev, dst: Dev, op: i32) -> NcclResult {
        let n = self.nccl();
        // SAFETY: as in `all_gather`, with the sizes the other way round.
        unsafe {
            (n.reduce_scatter)(
                src.buf(),
                dst.buf_mut(),
                dst.count,
                dst.dtype,
                op,
                self.raw(),
                self.raw_stream(),
            )
        }
    }

    /// `ncclSend` of `d` to group rank `peer`.
    pub(crate) fn send(&self, d: Dev, peer: usize) -> NcclResult {
        let n = self.nccl();
        // SAFETY: as in `all_reduce`; the receiver expects `d.count` elements.
        unsafe {
            (n.send)(
                d.buf(),
                d.count,
                d.dtype,
                peer as i32,
                self.raw(),
                self.raw_stream(),
            )
        }
    }

    /// `ncclRecv` into `d` from group rank `peer`.
    pub(crate) fn recv(&self, d: Dev, peer: usize) -> NcclResult {
        let n = self.nccl();
        // SAFETY: as in `all_reduce`; the sender sends `d.count` elements.
        unsafe {
            (n.recv)(
                d.buf_mut(),
                d.count,
                d.dtype,
                peer as i32,
                self.raw(),
                self.raw_stream(),
            )
        }
    }

    /// A device-to-device copy of `src` into `dst` (a rank's own block).
    pub(crate) fn copy(&self, dst: Dev, src: Dev) -> NcclResult {
        if src.bytes == 0 {
            return crate::ffi::SUCCESS;
        }
        // SAFETY: both are live device memory of at least `src.bytes` bytes (sizes agreed
        // above the backend) that do not overlap (inputs never share storage with outputs).
        let r = unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst.ptr,
                src.ptr,
                src.bytes,
                self.stream().cu_stream(),
            )
        };
        match r {
            Ok(()) => crate::ffi::SUCCESS,
            Err(_) => 1, // ncclUnhandledCudaError
        }
    }
}
