//! Buffer helpers for the CPU backend: splitting borrowed buffers into disjoint parts with
//! their full lifetime, copies, and a reusable scratch area.

use tensorplay_core::{CpuStorage, DType};

use crate::backend::{BufMut, BufRef};
use crate::{Error, Result};

/// Splits `b` at element `mid` into two disjoint buffers that keep `b`'s lifetime.
pub(super) fn split_mut(b: BufMut<'_>, mid: usize) -> (BufMut<'_>, BufMut<'_>) {
    b.split_at(mid)
}

/// Elements `range` of `b`, keeping `b`'s lifetime.
pub(super) fn sub_mut(b: BufMut<'_>, range: std::ops::Range<usize>) -> BufMut<'_> {
    b.into_slice(range)
}

/// A read-only view of `b` with `b`'s lifetime.
pub(super) fn into_ref(b: BufMut<'_>) -> BufRef<'_> {
    b.into_ref()
}

/// A shorter-lived reborrow of all of `b`.
pub(super) fn reborrow<'b>(b: &'b mut BufMut<'_>) -> BufMut<'b> {
    b.reborrow()
}

/// Two disjoint parts of `b`: `send` read-only and `recv` writable.
pub(super) fn two_parts(
    b: BufMut<'_>,
    send: std::ops::Range<usize>,
    recv: std::ops::Range<usize>,
) -> (BufRef<'_>, BufMut<'_>) {
    if send.end <= recv.start {
        let (lo, hi) = split_mut(b, recv.start);
        (
            into_ref(sub_mut(lo, send)),
            sub_mut(hi, 0..recv.end - recv.start),
        )
    } else {
        let (lo, hi) = split_mut(b, send.start);
        (
            into_ref(sub_mut(hi, 0..send.end - send.start)),
            sub_mut(lo, recv),
        )
    }
}

/// `dst.copy_from_slice(src)`, checking dtypes and lengths.
pub(super) fn copy(op: &str, rank: usize, dst: &mut BufMut<'_>, src: BufRef<'_>) -> Result<()> {
    if dst.dtype() != src.dtype() || dst.len() != src.len() {
        return Err(Error::invalid(
            op,
            rank as i64,
            "output",
            format!("{} elements of {}", src.len(), src.dtype()),
            format!("{} elements of {}", dst.len(), dst.dtype()),
        ));
    }
    dst.as_bytes_mut().copy_from_slice(src.as_bytes());
    Ok(())
}

/// `s` as a writable buffer: host storage of a dtype the backend moves (scratch and copies
/// are only ever made of such buffers, so the error is a bug's).
fn plain(s: &mut CpuStorage) -> Result<BufMut<'_>> {
    let dtype = s.dtype();
    s.as_buf_mut().ok_or_else(|| Error::Backend {
        backend: "cpu".into(),
        detail: format!("internal: a {dtype} scratch buffer").into(),
    })
}

/// Reusable scratch memory (one growable storage per dtype), so that receives that reduce
/// do not allocate per call.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    stores: Vec<CpuStorage>,
}

impl Scratch {
    /// A buffer of `n` elements of `dtype` (contents unspecified). Errors for a dtype that
    /// buffers do not hold (bool).
    pub(super) fn get(&mut self, dtype: DType, n: usize) -> Result<BufMut<'_>> {
        let i = match self.stores.iter().position(|s| s.dtype() == dtype) {
            Some(i) => i,
            None => {
                self.stores.push(CpuStorage::zeros(dtype, 0));
                self.stores.len() - 1
            }
        };
        let s = &mut self.stores[i];
        if s.len() < n {
            *s = CpuStorage::zeros(dtype, n);
        }
        Ok(plain(s)?.into_slice(0..n))
    }
}

/// An owned copy of a buffer (used where the algorithm must not touch the caller's buffer).
#[derive(Debug)]
pub(super) struct Owned(CpuStorage);

impl Owned {
    /// A copy of `src`.
    pub(super) fn copy_of(src: BufRef<'_>) -> Owned {
        Owned(src.to_storage())
    }
    /// The elements as a mutable buffer.
    pub(super) fn buf(&mut self) -> Result<BufMut<'_>> {
        plain(&mut self.0)
    }
}
