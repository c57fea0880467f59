//! The wire format of one message (one QUIC stream direction carries exactly one):
//!
//! ```text
//! [magic "TPR1": u32 LE][header length: u32 LE][body length: u64 LE]
//! [header: the rkyv archive of an Envelope]
//! [body: the tensors' bytes, row-major, little-endian, one after another]
//! ```
//!
//! The header is validated by rkyv before use (`from_bytes` checks every pointer and length),
//! and its lengths are checked against limits and against the body length before anything is
//! allocated, so malformed or hostile bytes give an error, never a panic or a huge allocation.
//! Tensor bytes never pass through rkyv: they are read straight into the new tensor's storage.

use rkyv::{Archive, Deserialize, Serialize};
use tensorplay_core::{DType, StorageElement, Tensor};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::wire::{dtype_code, dtype_from};
use crate::{Error, Result};

/// `"TPR1"`: tensorplay RPC, format version 1.
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"TPR1");
/// Largest header accepted (the payload of scalars and containers lives there).
pub(crate) const MAX_HEADER: usize = 256 << 20;
/// Largest body accepted (the sum of the tensors' bytes).
pub(crate) const MAX_BODY: u64 = 1 << 40;

/// Message kinds.
pub(crate) mod kind {
    /// Call a registered function; the response carries its result.
    pub(crate) const CALL: u8 = 1;
    /// Call a function and keep the result on the callee as an RRef's value.
    pub(crate) const REMOTE: u8 = 2;
    /// Fetch an RRef's value (`to_here`).
    pub(crate) const FETCH: u8 = 3;
    /// A user RRef was dropped.
    pub(crate) const USER_DELETE: u8 = 4;
    /// A user that received an RRef from another user asks the owner to register its fork.
    pub(crate) const FORK_REQUEST: u8 = 5;
    /// The child of a fork tells its parent it was confirmed.
    pub(crate) const CHILD_ACCEPT: u8 = 6;
    /// Run a registered method on an RRef's value on its owner.
    pub(crate) const METHOD: u8 = 7;
    /// A response.
    pub(crate) const RESPONSE: u8 = 100;
}

/// One tensor of the body.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub(crate) struct TensorDesc {
    pub(crate) dtype: u8,
    pub(crate) shape: Vec<u64>,
}

/// An error travelling back to the caller.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub(crate) struct RemoteErr {
    pub(crate) worker: String,
    pub(crate) kind: String,
    pub(crate) message: String,
}

/// The header of every message.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
pub(crate) struct Envelope {
    /// One of [`kind`].
    pub(crate) kind: u8,
    /// The sender's rank.
    pub(crate) sender: u32,
    /// The function or method name.
    pub(crate) func: String,
    /// The argument and result types, checked by the callee.
    pub(crate) sig: String,
    /// RRef ids: `[owner, rref created_on, rref local_id, fork created_on, fork local_id,
    /// parent]` where the message concerns an RRef.
    pub(crate) ids: Vec<u64>,
    /// The encoded arguments or result ([`crate::Wire`]).
    pub(crate) payload: Vec<u8>,
    /// The tensors of the body.
    pub(crate) tensors: Vec<TensorDesc>,
    /// Set on a response when the call failed.
    pub(crate) error: Option<RemoteErr>,
    /// Distributed-autograd context and message ids (0 when none).
    pub(crate) autograd: Vec<u64>,
}

fn elem_size(d: DType) -> usize {
    d.size_in_bytes()
}

fn bytes_of<T: StorageElement>(v: &[T]) -> &[u8] {
    // SAFETY: T is one of f32, f64, i64, bool: plain data without padding; any initialized
    // value is a valid sequence of bytes, and the length is the slice's size in bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), size_of_val(v)) }
}

/// The row-major bytes of a CPU tensor.
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.contiguous()?;
    Ok(match t.dtype() {
        DType::F32 => t.with_cpu_data::<f32, _>(|v, l| {
            bytes_of(&v[l.offset()..l.offset() + t.numel()]).to_vec()
        })?,
        DType::F64 => t.with_cpu_data::<f64, _>(|v, l| {
            bytes_of(&v[l.offset()..l.offset() + t.numel()]).to_vec()
        })?,
        DType::I64 => t.with_cpu_data::<i64, _>(|v, l| {
            bytes_of(&v[l.offset()..l.offset() + t.numel()]).to_vec()
        })?,
        DType::Bool => t.with_cpu_data::<bool, _>(|v, l| {
            bytes_of(&v[l.offset()..l.offset() + t.numel()]).to_vec()
        })?,
    })
}

/// Writes one message: prefix, header, tensor bytes.
pub(crate) async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    env: &mut Envelope,
    tensors: &[Tensor],
) -> Result<u64> {
    env.tensors = tensors
        .iter()
        .map(|t| TensorDesc {
            dtype: dtype_code(t.dtype()),
            shape: t.shape().iter().map(|&d| d as u64).collect(),
        })
        .collect();
    let body: u64 = tensors
        .iter()
        .map(|t| (t.numel() * elem_size(t.dtype())) as u64)
        .sum();
    let header = rkyv::to_bytes::<rkyv::rancor::Error>(env)
        .map_err(|e| Error::Serialization(format!("envelope: {e}")))?;
    if header.len() > MAX_HEADER {
        return Err(Error::Serialization(format!(
            "message header of {} bytes exceeds the limit of {MAX_HEADER} (send large data as tensors)",
            header.len()
        )));
    }
    let mut prefix = [0u8; 16];
    prefix[..4].copy_from_slice(&MAGIC.to_le_bytes());
    prefix[4..8].copy_from_slice(&(header.len() as u32).to_le_bytes());
    prefix[8..].copy_from_slice(&body.to_le_bytes());
    w.write_all(&prefix).await.map_err(io)?;
    w.write_all(&header).await.map_err(io)?;
    for t in tensors {
        let b = tensor_bytes(t)?;
        w.write_all(&b).await.map_err(io)?;
    }
    Ok(16 + header.len() as u64 + body)
}

fn io(e: std::io::Error) -> Error {
    Error::Transport(e.to_string())
}

/// Reads one message written by [`write_frame`]. Every length is checked before it is used.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<(Envelope, Vec<Tensor>)> {
    let mut prefix = [0u8; 16];
    r.read_exact(&mut prefix).await.map_err(io)?;
    let magic = u32::from_le_bytes(prefix[..4].try_into().unwrap_or_default());
    if magic != MAGIC {
        return Err(Error::Serialization(format!(
            "not a tensorplay RPC message (magic {magic:#010x}, expected {MAGIC:#010x}): a peer of another version or protocol"
        )));
    }
    let hlen = u32::from_le_bytes(prefix[4..8].try_into().unwrap_or_default()) as usize;
    let blen = u64::from_le_bytes(prefix[8..].try_into().unwrap_or_default());
    if hlen > MAX_HEADER || blen > MAX_BODY {
        return Err(Error::Serialization(format!(
            "message lengths out of range (header {hlen} bytes, body {blen} bytes)"
        )));
    }
    let mut header = rkyv::util::AlignedVec::<16>::with_capacity(hlen);
    header.resize(hlen, 0);
    r.read_exact(&mut header).await.map_err(io)?;
    let env = rkyv::from_bytes::<Envelope, rkyv::rancor::Error>(&header)
        .map_err(|e| Error::Serialization(format!("malformed message header: {e}")))?;
    // the body must be exactly the tensors the header describes
    let mut sizes = Vec::with_capacity(env.tensors.len());
    let mut total: u64 = 0;
    for d in &env.tensors {
        let dt = dtype_from(d.dtype)?;
        let mut n: u64 = 1;
        for &s in &d.shape {
            n = n
                .checked_mul(s)
                .ok_or_else(|| Error::Serialization("tensor size overflows".into()))?;
        }
        let bytes = n
            .checked_mul(elem_size(dt) as u64)
            .ok_or_else(|| Error::Serialization("tensor size overflows".into()))?;
        total = total
            .checked_add(bytes)
            .ok_or_else(|| Error::Serialization("body size overflows".into()))?;
        sizes.push((dt, n as usize));
    }
    if total != blen {
        return Err(Error::Serialization(format!(
            "the body holds {blen} bytes but the header describes {total}"
        )));
    }
    let mut tensors = Vec::with_capacity(sizes.len());
    for (d, (dt, n)) in env.tensors.iter().zip(sizes) {
        let shape: Vec<usize> = d.shape.iter().map(|&s| s as usize).collect();
        let t = match dt {
            DType::F32 => Tensor::from_vec(read_into::<f32, R>(r, n).await?, &shape)?,
            DType::F64 => Tensor::from_vec(read_into::<f64, R>(r, n).await?, &shape)?,
            DType::I64 => Tensor::from_vec(read_into::<i64, R>(r, n).await?, &shape)?,
            DType::Bool => {
                let v = read_into::<u8, R>(r, n).await?;
                if v.iter().any(|&b| b > 1) {
                    return Err(Error::Serialization(
                        "a bool tensor with bytes other than 0 and 1".into(),
                    ));
                }
                Tensor::from_vec(v.into_iter().map(|b| b == 1).collect::<Vec<bool>>(), &shape)?
            }
        };
        tensors.push(t);
    }
    Ok((env, tensors))
}

/// Element types read straight from the stream: plain data, any bit pattern valid, no padding.
trait Plain: Default + Clone {}
impl Plain for u8 {}
impl Plain for f32 {}
impl Plain for f64 {}
impl Plain for i64 {}

/// Memory allocated ahead of the bytes that arrive: a header's claim alone never makes the
/// receiver allocate more than this (the sender has to send the bytes).
const READ_AHEAD: usize = 64 << 20;

/// Reads `n` elements straight into a new vector. Up to [`READ_AHEAD`] bytes are allocated at
/// once; a larger tensor grows as its bytes arrive, so a hostile length claim fails at the
/// end of the stream instead of allocating what it claims.
async fn read_into<T: Plain, R: AsyncRead + Unpin>(r: &mut R, n: usize) -> Result<Vec<T>> {
    let size = size_of::<T>().max(1);
    let step = (READ_AHEAD / size).max(1);
    let mut v: Vec<T> = Vec::new();
    while v.len() < n {
        let start = v.len();
        // one step at first, then doubling (amortised copies)
        let grow = (n - start).min(step.max(start));
        v.resize(start + grow, T::default());
        // SAFETY: T is `Plain` (u8, f32, f64 or i64): every bit pattern is a valid value, no padding;
        // the byte slice covers exactly the initialized elements `start..start + grow`.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(v[start..].as_mut_ptr().cast::<u8>(), grow * size)
        };
        r.read_exact(bytes).await.map_err(io)?;
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
    }

    #[test]
    fn a_message_round_trips_with_its_tensors() {
        let rt = rt();
        let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
        let b = Tensor::from_vec(vec![7i64, 8], &[2]).unwrap();
        let c = Tensor::from_vec(vec![true, false], &[2]).unwrap();
        let at = a.t().unwrap(); // a transposed view travels as its logical values
        let mut env = Envelope {
            kind: kind::CALL,
            sender: 3,
            func: "f".into(),
            payload: vec![1, 2, 3],
            ..Envelope::default()
        };
        let mut buf = Vec::new();
        rt.block_on(write_frame(&mut buf, &mut env, &[at.clone(), b, c]))
            .unwrap();
        let (got, ts) = rt.block_on(read_frame(&mut &buf[..])).unwrap();
        assert_eq!(got, env);
        assert_eq!(ts[0].shape(), &[3, 2]);
        assert_eq!(ts[0].to_vec::<f32>().unwrap(), at.to_vec::<f32>().unwrap());
        assert_eq!(ts[1].to_vec::<i64>().unwrap(), vec![7, 8]);
        assert_eq!(ts[2].to_vec::<bool>().unwrap(), vec![true, false]);
    }

    #[test]
    fn malformed_frames_are_errors() {
        let rt = rt();
        let mut env = Envelope::default();
        let mut buf = Vec::new();
        let t = Tensor::from_vec(vec![1.0f64; 4], &[4]).unwrap();
        rt.block_on(write_frame(&mut buf, &mut env, &[t])).unwrap();
        // wrong magic
        let mut bad = buf.clone();
        bad[0] ^= 0xff;
        assert!(rt.block_on(read_frame(&mut &bad[..])).is_err());
        // body shorter than the header says
        let bad = &buf[..buf.len() - 1];
        assert!(rt.block_on(read_frame(&mut &bad[..])).is_err());
        // body length disagreeing with the tensors
        let mut bad = buf.clone();
        bad[8] = bad[8].wrapping_add(8);
        assert!(rt.block_on(read_frame(&mut &bad[..])).is_err());
        // absurd header length
        let mut bad = buf.clone();
        bad[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(rt.block_on(read_frame(&mut &bad[..])).is_err());
    }
}
