//! The batch of sends in flight during one step of an algorithm: small messages are written
//! right away, large ones on the peers' writer threads, and [`with_batch`] waits for all of
//! them before the borrowed data is released.

use std::io;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crossbeam::channel::{Receiver, Sender, unbounded};

use super::frame::io_err;
use super::header::{HDR, Header};
use super::peer::{Job, Peer, RawSlice, peer_of};
use crate::{Error, Result};

/// Sends with at most this many payload bytes are written by the calling thread (they fit in
/// the kernel's socket buffers, so they cannot block on a peer that is itself sending).
const INLINE_MAX: usize = 32 * 1024;

/// Sends in flight during one step of an algorithm. Created only by [`with_batch`], which does
/// not return before every posted send is finished.
pub(in crate::backend::cpu) struct Batch<'a, 'p> {
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
    pub(in crate::backend::cpu) fn send(
        &mut self,
        peer: usize,
        hdr: Header,
        data: &'a [u8],
    ) -> Result<()> {
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

/// Runs `f` with a fresh [`Batch`], then waits until every send it posted has finished, also
/// when `f` fails (the connections are shut down first then, so that the wait is short).
pub(in crate::backend::cpu) fn with_batch<'a, R>(
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
