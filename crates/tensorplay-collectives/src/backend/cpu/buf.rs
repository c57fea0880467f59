//! Typed-buffer helpers for the CPU backend: splitting borrowed buffers into disjoint parts
//! with their full lifetime, copies, and a reusable typed scratch area.

use tensorplay_core::DType;

use crate::backend::{BufMut, BufRef};
use crate::{Error, Result};

/// Splits `b` at element `mid` into two disjoint buffers that keep `b`'s lifetime.
pub(super) fn split_mut(b: BufMut<'_>, mid: usize) -> (BufMut<'_>, BufMut<'_>) {
    match b {
        BufMut::F32(s) => {
            let (x, y) = s.split_at_mut(mid);
            (BufMut::F32(x), BufMut::F32(y))
        }
        BufMut::F64(s) => {
            let (x, y) = s.split_at_mut(mid);
            (BufMut::F64(x), BufMut::F64(y))
        }
        BufMut::I64(s) => {
            let (x, y) = s.split_at_mut(mid);
            (BufMut::I64(x), BufMut::I64(y))
        }
    }
}

/// Elements `range` of `b`, keeping `b`'s lifetime.
pub(super) fn sub_mut(b: BufMut<'_>, range: std::ops::Range<usize>) -> BufMut<'_> {
    let (_, tail) = split_mut(b, range.start);
    split_mut(tail, range.end - range.start).0
}

/// A read-only view of `b` with `b`'s lifetime.
pub(super) fn into_ref(b: BufMut<'_>) -> BufRef<'_> {
    match b {
        BufMut::F32(s) => BufRef::F32(s),
        BufMut::F64(s) => BufRef::F64(s),
        BufMut::I64(s) => BufRef::I64(s),
    }
}

/// A shorter-lived reborrow of all of `b`.
pub(super) fn reborrow<'b>(b: &'b mut BufMut<'_>) -> BufMut<'b> {
    let n = b.len();
    b.slice_mut(0..n)
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

/// Reusable typed scratch memory (one growable vector per dtype), so that receives that reduce
/// do not allocate per call.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    f32: Vec<f32>,
    f64: Vec<f64>,
    i64: Vec<i64>,
}

impl Scratch {
    /// A buffer of `n` elements of `dtype` (contents unspecified).
    pub(super) fn get(&mut self, dtype: DType, n: usize) -> BufMut<'_> {
        fn grow<T: Default + Clone>(v: &mut Vec<T>, n: usize) -> &mut [T] {
            if v.len() < n {
                v.resize(n, T::default());
            }
            &mut v[..n]
        }
        match dtype {
            DType::F64 => BufMut::F64(grow(&mut self.f64, n)),
            DType::I64 => BufMut::I64(grow(&mut self.i64, n)),
            _ => BufMut::F32(grow(&mut self.f32, n)),
        }
    }
}

/// An owned copy of `src` (used where the algorithm must not touch the caller's buffer).
#[derive(Debug)]
pub(super) enum Owned {
    /// float32.
    F32(Vec<f32>),
    /// float64.
    F64(Vec<f64>),
    /// int64.
    I64(Vec<i64>),
}

impl Owned {
    /// A copy of `src`.
    pub(super) fn copy_of(src: BufRef<'_>) -> Owned {
        match src {
            BufRef::F32(s) => Owned::F32(s.to_vec()),
            BufRef::F64(s) => Owned::F64(s.to_vec()),
            BufRef::I64(s) => Owned::I64(s.to_vec()),
        }
    }
    /// The elements as a mutable buffer.
    pub(super) fn buf(&mut self) -> BufMut<'_> {
        match self {
            Owned::F32(v) => BufMut::F32(v),
            Owned::F64(v) => BufMut::F64(v),
            Owned::I64(v) => BufMut::I64(v),
        }
    }
}
