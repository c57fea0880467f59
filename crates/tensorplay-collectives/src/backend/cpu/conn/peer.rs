//! One peer connection of the CPU backend: the socket, its writer thread (which writes large
//! messages in order, reading the data through a raw view the posting batch keeps borrowed),
//! and the reads of incoming messages.

use std::io;
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam::channel::{Receiver, Sender, unbounded};

use super::frame::{io_err, read_full, read_msg, write_msg};
use super::header::{HDR, Header};
use crate::{Error, Result};

/// A raw view of a borrowed byte slice handed to a writer thread.
pub(super) struct RawSlice {
    pub(super) ptr: *const u8,
    pub(super) len: usize,
}

// SAFETY: the slice is only read, and `Batch` keeps it borrowed until the writer reports done.
unsafe impl Send for RawSlice {}

/// One message for a writer thread.
pub(super) struct Job {
    pub(super) header: [u8; HDR],
    pub(super) data: RawSlice,
    pub(super) done: Sender<(usize, io::Result<()>)>,
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
pub(in crate::backend::cpu) struct Peer {
    stream: Arc<TcpStream>,
    pub(super) jobs: Option<Sender<Job>>,
    writer: Option<JoinHandle<()>>,
}

impl Peer {
    /// Wraps a connected stream and starts its writer thread.
    pub(in crate::backend::cpu) fn new(
        peer: usize,
        rank: usize,
        stream: TcpStream,
    ) -> Result<Peer> {
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
    pub(in crate::backend::cpu) fn set_timeout(&self, t: Duration) -> io::Result<()> {
        let t = t.max(Duration::from_millis(1));
        self.stream.set_read_timeout(Some(t))?;
        self.stream.set_write_timeout(Some(t))
    }

    /// Shuts the socket down (wakes up blocked reads and writes on both ends).
    pub(in crate::backend::cpu) fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// Whether the peer has closed its end (it died, or failed and shut the group down): a
    /// non-blocking peek that sees end-of-file or a reset. Data waiting to be read means alive.
    pub(in crate::backend::cpu) fn is_gone(&self) -> bool {
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
    pub(in crate::backend::cpu) fn write_now(&self, hdr: &Header, data: &[u8]) -> io::Result<()> {
        write_msg(&self.stream, &hdr.encode(), data)
    }

    /// Reads one message whose header must equal `expect`, with its payload into `dst`.
    pub(in crate::backend::cpu) fn read_into(
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
    pub(in crate::backend::cpu) fn read_more(
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

/// The connection to `p`, or an error naming it.
pub(in crate::backend::cpu) fn peer_of<'p>(
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
