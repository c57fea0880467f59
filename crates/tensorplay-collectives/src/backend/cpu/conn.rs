//! Peer connections of the CPU backend: the full TCP mesh, message framing, the per-peer
//! writer threads and the batch of in-flight sends.
//!
//! Every message is a 40-byte header followed by its payload. The header carries the kind of
//! call (collective or point-to-point), the collective's sequence number (or the p2p tag), the
//! call's signature (dtype, reduce op, element count, root) and the payload length; the
//! receiver checks all of them, so ranks that call different collectives, or the same one with
//! different arguments, get [`Error::Mismatch`] instead of garbage.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::marker::PhantomData;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, Sender, unbounded};

use crate::store::Store;
use crate::{Error, Result};

/// Magic number at the start of every header ("TPC1").
const MAGIC: u32 = 0x3143_5054;
/// Magic number of the connection handshake.
const HELLO: u64 = 0x5450_4c41_5943_5055;
/// Header size in bytes.
pub(super) const HDR: usize = 40;
/// Sends with at most this many payload bytes are written by the calling thread (they fit in
/// the kernel's socket buffers, so they cannot block on a peer that is itself sending).
const INLINE_MAX: usize = 32 * 1024;
/// "No reduce op" in a header.
pub(super) const NO_REDOP: u8 = 255;

/// The kind of call a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Kind {
    /// all_reduce.
    AllReduce = 1,
    /// broadcast.
    Broadcast = 2,
    /// reduce.
    Reduce = 3,
    /// all_gather.
    AllGather = 4,
    /// reduce_scatter.
    ReduceScatter = 5,
    /// gather.
    Gather = 6,
    /// scatter.
    Scatter = 7,
    /// all_to_all.
    AllToAll = 8,
    /// barrier.
    Barrier = 9,
    /// send/recv.
    P2p = 10,
}

impl Kind {
    /// The operation's name.
    pub(super) fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all_reduce",
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::AllGather => "all_gather",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::Gather => "gather",
            Kind::Scatter => "scatter",
            Kind::AllToAll => "all_to_all",
            Kind::Barrier => "barrier",
            Kind::P2p => "send/recv",
        }
    }
    pub(super) fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::AllReduce,
            2 => Kind::Broadcast,
            3 => Kind::Reduce,
            4 => Kind::AllGather,
            5 => Kind::ReduceScatter,
            6 => Kind::Gather,
            7 => Kind::Scatter,
            8 => Kind::AllToAll,
            9 => Kind::Barrier,
            10 => Kind::P2p,
            _ => return None,
        })
    }
}

/// A message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    /// The call.
    pub(super) kind: Kind,
    /// Element dtype code (0 f32, 1 f64, 2 i64).
    pub(super) dtype: u8,
    /// Reduce op code, or [`NO_REDOP`].
    pub(super) redop: u8,
    /// Collective sequence number, or the p2p tag.
    pub(super) seq: u64,
    /// The call's total element count (0 where ranks legitimately differ).
    pub(super) count: u64,
    /// The root, or 0.
    pub(super) aux: u64,
    /// Payload bytes of this message.
    pub(super) len: u64,
}

impl Header {
    fn encode(&self) -> [u8; HDR] {
        let mut b = [0u8; HDR];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.dtype;
        b[6] = self.redop;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.aux.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HDR]) -> Option<Header> {
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let mut m = [0u8; 4];
        m.copy_from_slice(&b[0..4]);
        if u32::from_le_bytes(m) != MAGIC {
            return None;
        }
        Some(Header {
            kind: Kind::from_u8(b[4])?,
            dtype: b[5],
            redop: b[6],
            seq: u64_at(8),
            count: u64_at(16),
            aux: u64_at(24),
            len: u64_at(32),
        })
    }

    pub(super) fn describe(&self) -> String {
        let dt = match self.dtype {
            0 => "float32",
            1 => "float64",
            2 => "int64",
            _ => "?",
        };
        match self.kind {
            Kind::P2p => format!("send(tag={}, {} elements of {dt})", self.seq, self.count),
            k => format!(
                "{} #{} ({} elements of {dt}{}{})",
                k.name(),
                self.seq,
                self.count,
                if self.redop == NO_REDOP {
                    String::new()
                } else {
                    format!(", op {}", redop_name(self.redop))
                },
                if matches!(
                    k,
                    Kind::Broadcast | Kind::Reduce | Kind::Gather | Kind::Scatter
                ) {
                    format!(", root {}", self.aux)
                } else {
                    String::new()
                }
            ),
        }
    }

    /// Checks a received header against the expected one.
    pub(super) fn check(&self, got: &Header, rank: usize, peer: usize) -> Result<()> {
        if self == got {
            return Ok(());
        }
        let same_call = Header { len: 0, ..*self } == Header { len: 0, ..*got };
        let detail = if same_call {
            format!(
                "rank {peer} sent {} bytes but rank {rank} expected {} bytes in {}",
                got.len,
                self.len,
                self.describe()
            )
        } else if self.kind == Kind::P2p && got.kind == Kind::P2p && self.seq != got.seq {
            format!(
                "rank {rank} called recv(src={peer}, tag={}) but the next message from rank \
                 {peer} has tag {} (messages from one peer arrive in order)",
                self.seq, got.seq
            )
        } else {
            format!(
                "rank {rank} called {} but rank {peer} called {}",
                self.describe(),
                got.describe()
            )
        };
        Err(Error::Mismatch {
            op: self.kind.name().into(),
            detail,
        })
    }
}

/// The name of a reduce-op code.
fn redop_name(c: u8) -> &'static str {
    ["Sum", "Product", "Min", "Max", "Avg", "BAnd", "BOr", "BXor"]
        .get(c as usize)
        .copied()
        .unwrap_or("?")
}

/// Maps an I/O error on the connection to `peer` to the crate's error.
pub(super) fn io_err(
    e: &io::Error,
    rank: usize,
    peer: usize,
    op: &str,
    timeout: Duration,
    what: &str,
) -> Error {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::Timeout {
            op: op.into(),
            rank: rank as i64,
            timeout,
            detail: format!("no progress {what} rank {peer}"),
        },
        io::ErrorKind::UnexpectedEof => Error::PeerFailed {
            rank,
            peer,
            op: op.into(),
            detail: format!(
                "connection closed by rank {peer} while {what} it (did it exit or fail?)"
            ),
        },
        _ => Error::PeerFailed {
            rank,
            peer,
            op: op.into(),
            detail: format!("{what} it: {e}"),
        },
    }
}

/// Writes `hdr` then `data` completely.
fn write_msg(mut s: &TcpStream, hdr: &[u8], data: &[u8]) -> io::Result<()> {
    let mut storage = [IoSlice::new(hdr), IoSlice::new(data)];
    let mut bufs: &mut [IoSlice<'_>] = &mut storage;
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match s.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads one header and then exactly `dst.len()` payload bytes (in the same system calls when
/// possible), calling `check` as soon as the header is complete.
fn read_msg(
    mut s: &TcpStream,
    dst: &mut [u8],
    mut check: impl FnMut(Option<Header>) -> Result<()>,
    on_io: impl Fn(&io::Error) -> Error,
) -> Result<()> {
    let mut hdr = [0u8; HDR];
    let mut got = 0usize;
    let total = HDR + dst.len();
    let mut checked = false;
    while got < total {
        let r = if got < HDR {
            let (h, d) = (&mut hdr[got..], &mut dst[..]);
            s.read_vectored(&mut [IoSliceMut::new(h), IoSliceMut::new(d)])
        } else {
            s.read(&mut dst[got - HDR..])
        };
        match r {
            Ok(0) => return Err(on_io(&io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(on_io(&e)),
        }
        if !checked && got >= HDR {
            checked = true;
            check(Header::decode(&hdr))?;
        }
    }
    Ok(())
}

/// Reads exactly `dst.len()` bytes (a continuation of a message's payload).
fn read_full(mut s: &TcpStream, dst: &mut [u8], on_io: impl Fn(&io::Error) -> Error) -> Result<()> {
    s.read_exact(dst).map_err(|e| on_io(&e))
}

/// A raw view of a borrowed byte slice handed to a writer thread.
struct RawSlice {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the slice is only read, and `Batch` keeps it borrowed until the writer reports done.
unsafe impl Send for RawSlice {}

/// One message for a writer thread.
struct Job {
    header: [u8; HDR],
    data: RawSlice,
    done: Sender<(usize, io::Result<()>)>,
}

/// The writer thread of one peer connection: writes messages in order and reports each.
fn writer_loop(peer: usize, stream: Arc<TcpStream>, jobs: Receiver<Job>) {
    for job in jobs.iter() {
        // SAFETY: the `Batch` that posted this job borrows the slice for its whole lifetime and
        // does not end (not even when unwinding) before it has received this job's completion
        // below; the memory is plain bytes that nobody mutates meanwhile.
        let data = unsafe { std::slice::from_raw_parts(job.data.ptr, job.data.len) };
        let r = write_msg(&stream, &job.header, data);
        // The receiver only disappears together with the batch, which waits for us first.
        let _ = job.done.send((peer, r));
    }
}

/// A connection to one peer: the socket (read by the calling thread, written by the caller for
/// small messages and by the writer thread for large ones).
#[derive(Debug)]
pub(super) struct Peer {
    stream: Arc<TcpStream>,
    jobs: Option<Sender<Job>>,
    writer: Option<JoinHandle<()>>,
}

impl Peer {
    /// Wraps a connected stream and starts its writer thread.
    pub(super) fn new(peer: usize, rank: usize, stream: TcpStream) -> Result<Peer> {
        let stream = Arc::new(stream);
        let (tx, rx) = unbounded::<Job>();
        let s2 = Arc::clone(&stream);
        let writer = std::thread::Builder::new()
            .name(format!("tp-cpu-w{rank}->{peer}"))
            .spawn(move || writer_loop(peer, s2, rx))
            .map_err(|e| Error::Io(format!("spawning a writer thread: {e}")))?;
        Ok(Peer {
            stream,
            jobs: Some(tx),
            writer: Some(writer),
        })
    }

    /// Sets the socket's read and write timeouts.
    pub(super) fn set_timeout(&self, t: Duration) -> io::Result<()> {
        let t = t.max(Duration::from_millis(1));
        self.stream.set_read_timeout(Some(t))?;
        self.stream.set_write_timeout(Some(t))
    }

    /// Shuts the socket down (wakes up blocked reads and writes on both ends).
    pub(super) fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// Whether the peer has closed its end (it died, or failed and shut the group down): a
    /// non-blocking peek that sees end-of-file or a reset. Data waiting to be read means alive.
    pub(super) fn is_gone(&self) -> bool {
        use std::os::fd::AsRawFd;
        let mut b = [0u8; 1];
        // SAFETY: a one-byte peek into a local buffer on a socket we own; MSG_DONTWAIT makes
        // it non-blocking without changing the socket's mode (the writer thread shares it).
        let r = unsafe {
            libc::recv(
                self.stream.as_raw_fd(),
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        if r == 0 {
            return true;
        }
        r < 0
            && !matches!(
                io::Error::last_os_error().raw_os_error(),
                Some(libc::EAGAIN) | Some(libc::EINTR)
            )
    }

    /// Writes one message from the calling thread.
    pub(super) fn write_now(&self, hdr: &Header, data: &[u8]) -> io::Result<()> {
        write_msg(&self.stream, &hdr.encode(), data)
    }

    /// Reads one message whose header must equal `expect`, with its payload into `dst`.
    pub(super) fn read_into(
        &self,
        expect: &Header,
        dst: &mut [u8],
        rank: usize,
        peer: usize,
        timeout: Duration,
    ) -> Result<()> {
        let op = expect.kind.name();
        read_msg(
            &self.stream,
            dst,
            |h| match h {
                Some(h) => expect.check(&h, rank, peer),
                None => Err(Error::PeerFailed {
                    rank,
                    peer,
                    op: op.into(),
                    detail: "protocol error: received an invalid message header".into(),
                }),
            },
            |e| io_err(e, rank, peer, op, timeout, "receiving from"),
        )
    }

    /// Reads `dst.len()` more payload bytes of the current message.
    pub(super) fn read_more(
        &self,
        dst: &mut [u8],
        rank: usize,
        peer: usize,
        op: &str,
        timeout: Duration,
    ) -> Result<()> {
        read_full(&self.stream, dst, |e| {
            io_err(e, rank, peer, op, timeout, "receiving from")
        })
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.shutdown();
        self.jobs = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// Sends in flight during one step of an algorithm. Created only by [`with_batch`], which does
/// not return before every posted send is finished.
pub(super) struct Batch<'a, 'p> {
    peers: &'p [Option<Peer>],
    rank: usize,
    op: &'static str,
    timeout: Duration,
    sent: &'p AtomicU64,
    done_tx: Sender<(usize, io::Result<()>)>,
    done_rx: Receiver<(usize, io::Result<()>)>,
    pending: usize,
    queued: Vec<bool>,
    _data: PhantomData<&'a [u8]>,
}

impl<'a> Batch<'a, '_> {
    fn peer(&self, p: usize) -> Result<&Peer> {
        peer_of(self.peers, self.rank, p, self.op)
    }

    /// Sends one message to `peer`: small ones right away, large ones on the peer's writer
    /// thread (messages to one peer keep their order).
    pub(super) fn send(&mut self, peer: usize, hdr: Header, data: &'a [u8]) -> Result<()> {
        let conn = self.peer(peer)?;
        self.sent
            .fetch_add((HDR + data.len()) as u64, Ordering::Relaxed);
        if data.len() <= INLINE_MAX && !self.queued[peer] {
            return conn
                .write_now(&hdr, data)
                .map_err(|e| io_err(&e, self.rank, peer, self.op, self.timeout, "sending to"));
        }
        let job = Job {
            header: hdr.encode(),
            data: RawSlice {
                ptr: data.as_ptr(),
                len: data.len(),
            },
            done: self.done_tx.clone(),
        };
        let sent = conn.jobs.as_ref().map(|j| j.send(job).is_ok());
        if sent != Some(true) {
            return Err(Error::PeerFailed {
                rank: self.rank,
                peer,
                op: self.op.into(),
                detail: "the writer thread of this connection is gone".into(),
            });
        }
        self.queued[peer] = true;
        self.pending += 1;
        Ok(())
    }

    /// Waits for every posted send; the first error wins.
    fn wait_all(&mut self) -> Result<()> {
        let mut first = None;
        while self.pending > 0 {
            match self.done_rx.recv() {
                Ok((peer, r)) => {
                    self.pending -= 1;
                    if let (Err(e), None) = (r, &first) {
                        first = Some(io_err(
                            &e,
                            self.rank,
                            peer,
                            self.op,
                            self.timeout,
                            "sending to",
                        ));
                    }
                }
                // Unreachable while we hold `done_tx`; stop waiting rather than hang.
                Err(_) => break,
            }
        }
        self.pending = 0;
        first.map_or(Ok(()), Err)
    }
}

impl Drop for Batch<'_, '_> {
    fn drop(&mut self) {
        if self.pending > 0 {
            // Only reached when unwinding: make the writers fail fast, then wait for them so
            // that no writer touches the borrowed data after it is released.
            self.peers.iter().flatten().for_each(Peer::shutdown);
            let _ = self.wait_all();
        }
    }
}

/// The connection to `p`, or an error naming it.
pub(super) fn peer_of<'p>(
    peers: &'p [Option<Peer>],
    rank: usize,
    p: usize,
    op: &str,
) -> Result<&'p Peer> {
    peers
        .get(p)
        .and_then(Option::as_ref)
        .ok_or_else(|| Error::invalid(op, rank as i64, "peer", "another rank of the group", p))
}

/// Runs `f` with a fresh [`Batch`], then waits until every send it posted has finished, also
/// when `f` fails (the connections are shut down first then, so that the wait is short).
pub(super) fn with_batch<'a, R>(
    peers: &[Option<Peer>],
    rank: usize,
    op: &'static str,
    timeout: Duration,
    sent: &AtomicU64,
    f: impl FnOnce(&mut Batch<'a, '_>) -> Result<R>,
) -> Result<R> {
    let (done_tx, done_rx) = unbounded();
    let mut b = Batch {
        peers,
        rank,
        op,
        timeout,
        sent,
        done_tx,
        done_rx,
        pending: 0,
        queued: vec![false; peers.len()],
        _data: PhantomData,
    };
    let r = f(&mut b);
    if r.is_err() {
        peers.iter().flatten().for_each(Peer::shutdown);
    }
    let w = b.wait_all();
    let v = r?;
    w?;
    Ok(v)
}

/// Connects the full mesh: publishes this rank's listening address as `addr/<rank>`, connects
/// to every lower rank and accepts every higher one, with a handshake naming both ends.
/// Returns one stream per rank (`None` at this rank).
pub(super) fn connect_mesh(
    store: &dyn Store,
    rank: usize,
    size: usize,
    timeout: Duration,
    bind_host: &str,
) -> Result<Vec<Option<TcpStream>>> {
    const OP: &str = "cpu backend init";
    let deadline = Instant::now() + timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    let tmo = |detail: String| Error::Timeout {
        op: OP.into(),
        rank: rank as i64,
        timeout,
        detail,
    };
    let listener = TcpListener::bind((bind_host, 0))
        .map_err(|e| Error::Io(format!("binding a listener on {bind_host}: {e}")))?;
    let addr = listener.local_addr()?;
    store.set(&format!("addr/{rank}"), addr.to_string().as_bytes())?;

    let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    // Lower ranks: wait for their addresses, connect, handshake.
    let keys: Vec<String> = (0..rank).map(|j| format!("addr/{j}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    if !refs.is_empty()
        && let Err(e) = store.wait(&refs, left().max(Duration::from_millis(1)))
    {
        let missing: Vec<usize> = (0..rank)
            .filter(|j| !store.check(&[&format!("addr/{j}")]).unwrap_or(false))
            .collect();
        return Err(match e {
            Error::Timeout { .. } => tmo(format!(
                "ranks {missing:?} of {size} never joined (no address published)"
            )),
            e => e,
        });
    }
    for (j, key) in keys.iter().enumerate() {
        let v = store.get(key)?;
        let text = String::from_utf8_lossy(&v).into_owned();
        let target: SocketAddr = text
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| Error::Store(format!("rank {j} published a bad address {text:?}")))?;
        let s = loop {
            match TcpStream::connect_timeout(&target, left().max(Duration::from_millis(1))) {
                Ok(s) => break s,
                Err(e) if left().is_zero() => {
                    return Err(tmo(format!(
                        "could not connect to rank {j} at {target}: {e}"
                    )));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        let fail = |e: io::Error| Error::PeerFailed {
            rank,
            peer: j,
            op: OP.into(),
            detail: format!("handshake with {target}: {e}"),
        };
        s.set_nodelay(true).map_err(fail)?;
        s.set_read_timeout(Some(left().max(Duration::from_millis(1))))
            .map_err(fail)?;
        let mut hello = Vec::with_capacity(24);
        hello.extend_from_slice(&HELLO.to_le_bytes());
        hello.extend_from_slice(&(rank as u64).to_le_bytes());
        hello.extend_from_slice(&(size as u64).to_le_bytes());
        (&s).write_all(&hello).map_err(fail)?;
        let mut reply = [0u8; 16];
        (&s).read_exact(&mut reply).map_err(fail)?;
        if reply[..8] != HELLO.to_le_bytes() || reply[8..] != (j as u64).to_le_bytes() {
            return Err(Error::PeerFailed {
                rank,
                peer: j,
                op: OP.into(),
                detail: format!("{target} is not rank {j} of this group (bad handshake)"),
            });
        }
        streams[j] = Some(s);
    }
    // Higher ranks connect to us.
    listener.set_nonblocking(true)?;
    let mut waiting = size - rank - 1;
    while waiting > 0 {
        match listener.accept() {
            Ok((s, from)) => {
                s.set_nonblocking(false)?;
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(left().max(Duration::from_millis(1))))?;
                let mut hello = [0u8; 24];
                if (&s).read_exact(&mut hello).is_err() || hello[..8] != HELLO.to_le_bytes() {
                    tracing::warn!(
                        "cpu backend rank {rank}: ignoring a bad connection from {from}"
                    );
                    continue;
                }
                let mut w = [0u8; 8];
                w.copy_from_slice(&hello[8..16]);
                let j = u64::from_le_bytes(w) as usize;
                w.copy_from_slice(&hello[16..24]);
                let their_size = u64::from_le_bytes(w) as usize;
                if their_size != size || j <= rank || j >= size || streams[j].is_some() {
                    return Err(Error::Mismatch {
                        op: OP.into(),
                        detail: format!(
                            "rank {rank} (world size {size}) got a connection from a process \
                             claiming rank {j} of world size {their_size}"
                        ),
                    });
                }
                let mut reply = [0u8; 16];
                reply[..8].copy_from_slice(&HELLO.to_le_bytes());
                reply[8..].copy_from_slice(&(rank as u64).to_le_bytes());
                (&s).write_all(&reply).map_err(|e| Error::PeerFailed {
                    rank,
                    peer: j,
                    op: OP.into(),
                    detail: format!("handshake: {e}"),
                })?;
                streams[j] = Some(s);
                waiting -= 1;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if left().is_zero() {
                    let missing: Vec<usize> =
                        (rank + 1..size).filter(|&j| streams[j].is_none()).collect();
                    return Err(tmo(format!(
                        "ranks {missing:?} of {size} never joined (never connected to rank {rank})"
                    )));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::Io(format!("accepting connections: {e}"))),
        }
    }
    Ok(streams)
}
