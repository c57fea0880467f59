//! The wire format of one message (one QUIC stream direction carries exactly one):
//!
//! ```text
//! [magic "TPR3": u32 LE][header length: u32 LE][body length: u64 LE]
//! [header: the rkyv archive of an Envelope]
//! [body: the inline tensors' bytes, row-major, little-endian, one after another]
//! ```
//!
//! The header is validated by rkyv before use (`from_bytes` checks every pointer and length),
//! and its lengths are checked against limits and against the body length before anything is
//! allocated, so malformed or hostile bytes give an error, never a panic or a huge allocation.
//! Tensor bytes never pass through rkyv: they are read straight into the new tensor's storage.
//!
//! The header's [`Message`] is the protocol core's typed message (`crate::proto::message`):
//! an unknown variant fails validation like a bad length. Format 2 (`TPR2`) added
//! shared-memory tensors: a tensor whose [`TensorDesc::shm`] is set is
//! not in the body but in a segment of the sender's shared-memory directory
//! ([`crate::shm`]); only a receiver that confirmed that directory at `init_rpc` accepts
//! such a reference, and it builds the file name from the two numbers itself.

use std::future::Future;
use std::mem::MaybeUninit;
use std::path::Path;

use bytes::{Bytes, BytesMut};
use rkyv::{Archive, Deserialize, Serialize};
use tensorplay_core::bytes::as_bytes;
use tensorplay_core::{DType, Tensor, with_dtype};
use tokio::io::{AsyncRead, AsyncReadExt, ReadBuf};

use crate::proto::message::{AutogradHeader, Message};
use crate::shm::{self, Claim, ShmDir};
use crate::wire::{dtype_code, dtype_from};
use crate::{Error, Result};

/// `"TPR3"`: tensorplay RPC, format version 3 (version 1 had no shared-memory tensors, version
/// 2 an untyped `kind` byte and positional RRef ids instead of [`Message`]).
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"TPR3");
/// Largest header accepted (the payload of scalars and containers lives there).
pub(crate) const MAX_HEADER: usize = 256 << 20;
/// Largest body accepted (the sum of the tensors' bytes).
pub(crate) const MAX_BODY: u64 = 1 << 40;
/// The size of the chunks handed to the stream.
const CHUNK: usize = 1 << 20;
/// Copies of at least this many bytes leave the runtime's thread free while they run (a
/// hand-off costs a thread wake-up, about what copying a few MiB costs).
const OFFLOAD_BYTES: usize = 4 << 20;

/// Where a tensor's bytes are when they are not in the body: a segment of the sender's
/// shared-memory directory, owned by one transfer.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub(crate) struct ShmRef {
    pub(crate) segment: u64,
    pub(crate) transfer: u64,
}

/// One tensor of the message.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub(crate) struct TensorDesc {
    pub(crate) dtype: u8,
    pub(crate) shape: Vec<u64>,
    /// Set when the bytes are in shared memory instead of the body.
    pub(crate) shm: Option<ShmRef>,
}

/// The header of every message: what it is ([`Message`], from the protocol core), who sent
/// it, and what rides with it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub(crate) struct Envelope {
    /// What the message is.
    pub(crate) message: Message,
    /// The sender's rank (checked against the connection's certificate).
    pub(crate) sender: u32,
    /// The encoded arguments or result ([`crate::Wire`]).
    pub(crate) payload: Vec<u8>,
    /// The tensors of the message.
    pub(crate) tensors: Vec<TensorDesc>,
    /// The distributed-autograd header of a message sent within a context.
    pub(crate) autograd: Option<AutogradHeader>,
}

impl Envelope {
    /// An envelope for `message` with nothing riding with it yet.
    pub(crate) fn new(message: Message) -> Envelope {
        Envelope {
            message,
            sender: 0,
            payload: Vec::new(),
            tensors: Vec::new(),
            autograd: None,
        }
    }
}

fn elem_size(d: DType) -> usize {
    d.size_in_bytes()
}

/// Runs a long copy without holding up the transport: on the agent's multi-threaded runtime
/// through `block_in_place` (the runtime's other tasks move to another thread meanwhile),
/// inline elsewhere.
fn offload<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Where a frame is written: a QUIC stream takes the chunks as they are (no second copy).
pub(crate) trait FrameSink: Send {
    /// Writes one chunk.
    fn put(&mut self, chunk: Bytes) -> impl Future<Output = std::io::Result<()>> + Send;
}

impl FrameSink for quinn::SendStream {
    async fn put(&mut self, chunk: Bytes) -> std::io::Result<()> {
        self.write_chunk(chunk).await.map_err(std::io::Error::from)
    }
}

impl FrameSink for Vec<u8> {
    fn put(&mut self, chunk: Bytes) -> impl Future<Output = std::io::Result<()>> + Send {
        self.extend_from_slice(&chunk);
        std::future::ready(Ok(()))
    }
}

/// Gathers small pieces into chunks of about [`CHUNK`] bytes.
struct Chunks<'a, W> {
    w: &'a mut W,
    buf: BytesMut,
}

impl<W: FrameSink> Chunks<'_, W> {
    async fn flush(&mut self) -> Result<()> {
        if !self.buf.is_empty() {
            let c = self.buf.split().freeze();
            self.w.put(c).await.map_err(io)?;
        }
        Ok(())
    }

    /// Appends a tensor's row-major bytes, copied from its storage a chunk at a time.
    async fn tensor(&mut self, t: &Tensor) -> Result<()> {
        let t = t.contiguous()?;
        let n = t.numel();
        let per = (CHUNK / elem_size(t.dtype())).max(1);
        let mut i = 0;
        while i < n {
            let m = per.min(n - i);
            self.buf.reserve(m * elem_size(t.dtype()));
            append(&t, i, m, &mut self.buf)?;
            i += m;
            if self.buf.len() >= CHUNK {
                self.flush().await?;
            }
        }
        Ok(())
    }
}

/// Appends elements `start..start+m` of a contiguous tensor to `buf`.
fn append(t: &Tensor, start: usize, m: usize, buf: &mut BytesMut) -> Result<()> {
    with_dtype!(t.dtype(), T => t.with_cpu_data::<T, _>(|v, l| {
        let o = l.offset() + start;
        buf.extend_from_slice(as_bytes(&v[o..o + m]));
    }))?;
    Ok(())
}

/// Writes one message: prefix, header, inline tensor bytes. With `shm` (the receiver can read
/// this worker's shared-memory directory), tensors of at least its threshold go through
/// segments instead of the stream. Returns the bytes the message carried.
pub(crate) async fn write_frame<W: FrameSink>(
    w: &mut W,
    env: &mut Envelope,
    tensors: &[Tensor],
    shm: Option<&ShmDir>,
) -> Result<u64> {
    let sizes: Vec<usize> = tensors
        .iter()
        .map(|t| t.numel() * elem_size(t.dtype()))
        .collect();
    let mut claims: Vec<Option<Claim>> = sizes
        .iter()
        .map(|&b| shm.filter(|d| d.wants(b)).and_then(|d| d.claim(b)))
        .collect();
    let shm_bytes: usize = claims
        .iter()
        .zip(&sizes)
        .filter(|(c, _)| c.is_some())
        .map(|(_, &b)| b)
        .sum();
    if shm_bytes > 0 {
        let copy = || -> Result<()> {
            for (c, t) in claims.iter().zip(tensors) {
                if let Some(c) = c {
                    c.write_tensor(t)?;
                }
            }
            Ok(())
        };
        if shm_bytes >= OFFLOAD_BYTES {
            offload(copy)?;
        } else {
            copy()?;
        }
    }
    env.tensors = tensors
        .iter()
        .zip(&claims)
        .map(|(t, c)| TensorDesc {
            dtype: dtype_code(t.dtype()),
            shape: t.shape().iter().map(|&d| d as u64).collect(),
            shm: c.as_ref().map(|c| {
                let (segment, transfer) = c.reference();
                ShmRef { segment, transfer }
            }),
        })
        .collect();
    let body: u64 = sizes
        .iter()
        .zip(&claims)
        .filter(|(_, c)| c.is_none())
        .map(|(&b, _)| b as u64)
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
    let mut out = Chunks {
        w,
        buf: BytesMut::with_capacity(16 + header.len() + (body as usize).min(CHUNK)),
    };
    out.buf.extend_from_slice(&prefix);
    out.buf.extend_from_slice(&header);
    for (t, c) in tensors.iter().zip(&claims) {
        if c.is_none() {
            out.tensor(t).await?;
        }
    }
    out.flush().await?;
    // sent: from now on the receiver gives the segments back
    for c in claims.iter_mut().filter_map(Option::take) {
        c.commit();
    }
    Ok(16 + header.len() as u64 + body + shm_bytes as u64)
}

fn io(e: std::io::Error) -> Error {
    Error::Transport(e.to_string())
}

/// The shared-memory references of a message being read: released when reading fails before
/// they were consumed.
struct PendingRefs<'a> {
    dir: Option<&'a Path>,
    refs: Vec<Option<ShmRef>>,
}

impl Drop for PendingRefs<'_> {
    fn drop(&mut self) {
        if let Some(dir) = self.dir {
            for r in self.refs.iter().flatten() {
                shm::release(dir, r.segment, r.transfer);
            }
        }
    }
}

/// Reads one message written by [`write_frame`]. Every length is checked before it is used.
/// `shm`: the sender's shared-memory directory when this worker confirmed it at `init_rpc`;
/// without it a message referring to shared memory is an error.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    shm: Option<&Path>,
) -> Result<(Envelope, Vec<Tensor>)> {
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
    let header = read_header(r, hlen).await?;
    let env = rkyv::from_bytes::<Envelope, rkyv::rancor::Error>(&header)
        .map_err(|e| Error::Serialization(format!("malformed message header: {e}")))?;
    let mut pending = PendingRefs {
        dir: shm,
        refs: env.tensors.iter().map(|d| d.shm).collect(),
    };
    if shm.is_none() && pending.refs.iter().any(Option::is_some) {
        return Err(Error::Serialization(
            "a message refers to shared memory, but its sender is not a confirmed worker of this host"
                .into(),
        ));
    }
    // the body must be exactly the inline tensors the header describes
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
        if bytes > MAX_BODY {
            return Err(Error::Serialization(format!(
                "a tensor of {bytes} bytes exceeds the limit of {MAX_BODY}"
            )));
        }
        if d.shm.is_none() {
            total = total
                .checked_add(bytes)
                .ok_or_else(|| Error::Serialization("body size overflows".into()))?;
        }
        sizes.push((dt, n as usize, bytes as usize));
    }
    if total != blen {
        return Err(Error::Serialization(format!(
            "the body holds {blen} bytes but the header describes {total}"
        )));
    }
    let shapes: Vec<Vec<usize>> = env
        .tensors
        .iter()
        .map(|d| d.shape.iter().map(|&s| s as usize).collect())
        .collect();
    let mut tensors: Vec<Option<Tensor>> = vec![None; sizes.len()];
    for (i, &(dt, n, _)) in sizes.iter().enumerate() {
        if pending.refs[i].is_none() {
            tensors[i] = Some(read_inline(r, dt, n, &shapes[i]).await?);
        }
    }
    if let Some(dir) = shm {
        let shm_bytes: usize = sizes
            .iter()
            .zip(&pending.refs)
            .filter(|(_, s)| s.is_some())
            .map(|(s, _)| s.2)
            .sum();
        let mut copy = || -> Result<()> {
            for (i, &(dt, n, _)) in sizes.iter().enumerate() {
                if let Some(s) = pending.refs[i].take() {
                    tensors[i] = Some(shm::read_tensor(
                        dir, s.segment, s.transfer, dt, n, &shapes[i],
                    )?);
                }
            }
            Ok(())
        };
        if shm_bytes >= OFFLOAD_BYTES {
            offload(copy)?;
        } else if shm_bytes > 0 {
            copy()?;
        }
    }
    let tensors = tensors
        .into_iter()
        .map(|t| t.ok_or_else(|| Error::Serialization("a tensor of the message is missing".into())))
        .collect::<Result<Vec<_>>>()?;
    Ok((env, tensors))
}

/// Reads a header of `hlen` bytes into aligned memory that grows only as the bytes arrive: a
/// prefix that claims a large header costs nothing until the peer actually sends it.
async fn read_header<R: AsyncRead + Unpin>(
    r: &mut R,
    hlen: usize,
) -> Result<rkyv::util::AlignedVec<16>> {
    const PIECE: usize = 64 << 10;
    let mut header = rkyv::util::AlignedVec::<16>::with_capacity(hlen.min(PIECE));
    let mut piece = vec![0u8; hlen.min(PIECE)];
    while header.len() < hlen {
        let want = (hlen - header.len()).min(PIECE);
        let n = r.read(&mut piece[..want]).await.map_err(io)?;
        if n == 0 {
            return Err(Error::Transport(
                "the message ended before its header did".into(),
            ));
        }
        header.extend_from_slice(&piece[..n]);
    }
    Ok(header)
}

/// Reads a tensor's bytes from the stream straight into new (uninitialised) storage.
async fn read_inline<R: AsyncRead + Unpin>(
    r: &mut R,
    dt: DType,
    n: usize,
    shape: &[usize],
) -> Result<Tensor> {
    Ok(match dt {
        DType::F32 => Tensor::from_vec(read_vec::<f32, R>(r, n).await?, shape)?,
        DType::F64 => Tensor::from_vec(read_vec::<f64, R>(r, n).await?, shape)?,
        DType::I64 => Tensor::from_vec(read_vec::<i64, R>(r, n).await?, shape)?,
        DType::BF16 => Tensor::from_vec(read_vec::<tensorplay_core::bf16, R>(r, n).await?, shape)?,
        DType::F16 => Tensor::from_vec(read_vec::<tensorplay_core::f16, R>(r, n).await?, shape)?,
        DType::Bool => {
            let v = read_vec::<u8, R>(r, n).await?;
            if v.iter().any(|&b| b > 1) {
                return Err(Error::Serialization(
                    "a bool tensor with bytes other than 0 and 1".into(),
                ));
            }
            Tensor::from_vec(v.into_iter().map(|b| b == 1).collect::<Vec<bool>>(), shape)?
        }
    })
}

/// Reads `n` elements of `T` (f32, f64, i64, bf16, f16 or u8: every bit pattern valid) into a new
/// vector, without zeroing it first. The vector is allocated only as the bytes arrive in
/// pieces of at most 64 MiB, so a header that lies about a size cannot make us allocate much
/// more than the peer actually sends.
async fn read_vec<T: Copy, R: AsyncRead + Unpin>(r: &mut R, n: usize) -> Result<Vec<T>> {
    const STEP: usize = 64 << 20;
    let total = n * size_of::<T>();
    let mut v: Vec<T> = Vec::new();
    let mut filled = 0usize; // bytes
    while filled < total {
        let want = (total - filled).min(STEP);
        let elems_needed = (filled + want).div_ceil(size_of::<T>());
        if v.capacity() < elems_needed {
            v.try_reserve_exact(elems_needed - v.len())
                .map_err(|e| shm::oom(elems_needed * size_of::<T>(), e))?;
            tensorplay_core::memory::advise_huge_pages(&mut v);
        }
        let cap_bytes = v.capacity() * size_of::<T>();
        // SAFETY: the allocation holds `cap_bytes` bytes; viewing them as MaybeUninit<u8> is
        // always sound, and bytes before `filled` are initialised.
        let all = unsafe {
            std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<MaybeUninit<u8>>(), cap_bytes)
        };
        let mut rb = ReadBuf::uninit(&mut all[filled..filled + want]);
        while rb.remaining() > 0 {
            let before = rb.filled().len();
            std::future::poll_fn(|cx| std::pin::Pin::new(&mut *r).poll_read(cx, &mut rb))
                .await
                .map_err(io)?;
            if rb.filled().len() == before {
                return Err(Error::Transport(
                    "the message ended before its tensors did".into(),
                ));
            }
        }
        filled += want;
        // SAFETY: `filled` bytes are initialised; set_len only counts whole elements, and every
        // bit pattern is a valid T.
        unsafe { v.set_len(filled / size_of::<T>()) };
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::message::Target;

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
        let mut env = Envelope::new(Message::Call(Target {
            func: "f".into(),
            sig: "(f32) -> ()".into(),
        }));
        env.sender = 3;
        env.payload = vec![1, 2, 3];
        env.autograd = Some(AutogradHeader {
            context: 7,
            message: 9,
            requires_grad: vec![0, 2],
        });
        let mut buf = Vec::new();
        rt.block_on(write_frame(&mut buf, &mut env, &[at.clone(), b, c], None))
            .unwrap();
        let (got, ts) = rt.block_on(read_frame(&mut &buf[..], None)).unwrap();
        assert_eq!(got, env);
        assert_eq!(ts[0].shape(), &[3, 2]);
        assert_eq!(ts[0].to_vec::<f32>().unwrap(), at.to_vec::<f32>().unwrap());
        assert_eq!(ts[1].to_vec::<i64>().unwrap(), vec![7, 8]);
        assert_eq!(ts[2].to_vec::<bool>().unwrap(), vec![true, false]);
    }

    #[test]
    fn large_tensors_go_through_shared_memory_and_small_ones_inline() {
        let rt = rt();
        let root = std::env::temp_dir().join(format!("tp-frame-shm-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let dir = ShmDir::create(&root, 1024, 1 << 30).unwrap();
        let peer = shm::confirm_peer(&root, dir.advert().as_bytes()).unwrap();
        let big = Tensor::from_vec(
            (0..5000).map(|i| i as f64).collect::<Vec<f64>>(),
            &[50, 100],
        )
        .unwrap();
        let small = Tensor::from_vec(vec![1i64, 2, 3], &[3]).unwrap();
        let mut env = Envelope::new(Message::Response(None));
        let mut buf = Vec::new();
        let sent = rt
            .block_on(write_frame(
                &mut buf,
                &mut env,
                &[small.clone(), big.t().unwrap()],
                Some(&dir),
            ))
            .unwrap();
        assert!(env.tensors[0].shm.is_none());
        let r = env.tensors[1]
            .shm
            .expect("the large tensor went through shared memory");
        assert!(buf.len() < 40_000 && sent > 40_000, "{} {sent}", buf.len());
        // a receiver that did not confirm the sender's directory refuses the reference
        assert!(rt.block_on(read_frame(&mut &buf[..], None)).is_err());
        let (_, ts) = rt.block_on(read_frame(&mut &buf[..], Some(&peer))).unwrap();
        assert_eq!(ts[0].to_vec::<i64>().unwrap(), vec![1, 2, 3]);
        assert_eq!(ts[1].shape(), &[100, 50]);
        assert_eq!(
            ts[1].to_vec::<f64>().unwrap(),
            big.t().unwrap().to_vec::<f64>().unwrap()
        );
        // the segment was given back: a second read of the same frame finds no transfer
        assert!(rt.block_on(read_frame(&mut &buf[..], Some(&peer))).is_err());
        // a truncated frame gives its segments back too
        let mut env = Envelope::new(Message::Response(None));
        let mut buf = Vec::new();
        rt.block_on(write_frame(
            &mut buf,
            &mut env,
            &[big.clone(), small],
            Some(&dir),
        ))
        .unwrap();
        let r2 = env.tensors[0].shm.unwrap();
        assert_eq!(r2.segment, r.segment, "the free segment is reused");
        assert!(
            rt.block_on(read_frame(&mut &buf[..buf.len() - 1], Some(&peer)))
                .is_err()
        );
        assert!(peer.join(format!("{:016x}.free", r2.segment)).exists());
        drop(dir);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn malformed_frames_are_errors() {
        let rt = rt();
        let mut env = Envelope::new(Message::Response(None));
        let mut buf = Vec::new();
        let t = Tensor::from_vec(vec![1.0f64; 4], &[4]).unwrap();
        rt.block_on(write_frame(&mut buf, &mut env, &[t], None))
            .unwrap();
        // wrong magic
        let mut bad = buf.clone();
        bad[0] ^= 0xff;
        assert!(rt.block_on(read_frame(&mut &bad[..], None)).is_err());
        // body shorter than the header says
        let bad = &buf[..buf.len() - 1];
        assert!(rt.block_on(read_frame(&mut &bad[..], None)).is_err());
        // body length disagreeing with the tensors
        let mut bad = buf.clone();
        bad[8] = bad[8].wrapping_add(8);
        assert!(rt.block_on(read_frame(&mut &bad[..], None)).is_err());
        // absurd header length
        let mut bad = buf.clone();
        bad[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(rt.block_on(read_frame(&mut &bad[..], None)).is_err());
    }

    /// A reader that yields `data` and then never anything more (a peer that stopped sending).
    struct Stalled(Vec<u8>);

    impl AsyncRead for Stalled {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            if self.0.is_empty() {
                return std::task::Poll::Pending;
            }
            let n = self.0.len().min(buf.remaining());
            buf.put_slice(&self.0[..n]);
            self.0.drain(..n);
            std::task::Poll::Ready(Ok(()))
        }
    }

    fn resident_bytes() -> usize {
        tensorplay_core::memory::process_resident_bytes().unwrap_or(0) as usize
    }

    /// Found by the hostile trial of issue 18: a prefix claiming a 255 MiB header made the
    /// reader allocate (and zero) all of it before a byte of the header arrived; 8 such
    /// streams held 2 GiB. Now memory grows only with the bytes received.
    #[test]
    fn a_claimed_header_length_allocates_nothing_before_the_bytes_arrive() {
        let mut prefix = Vec::new();
        prefix.extend_from_slice(&MAGIC.to_le_bytes());
        prefix.extend_from_slice(&(255u32 << 20).to_le_bytes());
        prefix.extend_from_slice(&0u64.to_le_bytes());
        prefix.extend_from_slice(&[7u8; 100]);
        let before = resident_bytes();
        let mut readers: Vec<Stalled> = (0..8).map(|_| Stalled(prefix.clone())).collect();
        let mut futs: Vec<_> = readers
            .iter_mut()
            .map(|r| Box::pin(read_frame(r, None)))
            .collect();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        for f in &mut futs {
            assert!(f.as_mut().poll(&mut cx).is_pending());
        }
        let grown = resident_bytes().saturating_sub(before);
        assert!(
            grown < 64 << 20,
            "8 stalled headers made the process grow by {} MiB",
            grown >> 20
        );
        drop(futs);
    }
}
