//! The collective algorithms of the CPU backend (world size >= 2).
//!
//! * all_reduce: up to [`SMALL`] bytes, one direct exchange (every rank sends its buffer to every
//!   other rank, then reduces locally in rank order); above, a ring reduce-scatter followed by a
//!   ring all-gather, receiving in [`CHUNK`]-byte pieces into scratch memory and reducing each
//!   piece straight into the caller's buffer while the writer threads stream the next block.
//! * broadcast: up to [`SMALL`] bytes or with two ranks, the root sends to everyone; above, a
//!   pipelined chain in [`BCAST_CHUNK`]-byte pieces.
//! * reduce: up to [`SMALL`] bytes or with two ranks, every rank sends to the root, which
//!   reduces piecewise; above, a ring reduce-scatter (on a copy for non-roots) then a gather.
//! * all_gather: direct exchange up to [`SMALL`] bytes, otherwise a ring; reduce_scatter: a ring;
//!   gather, scatter: direct; all_to_all: pairwise exchange; barrier: dissemination.

use std::ops::Range;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use super::buf::{Owned, Scratch, into_ref, reborrow, split_mut, sub_mut, two_parts};
use super::conn::{Batch, Header, Peer, peer_of, with_batch};
use crate::backend::{BufMut, BufRef, reduce_into};
use crate::{ReduceOp, Result};

/// Messages up to this many bytes use the latency-optimal (direct) algorithms.
pub(super) const SMALL: usize = 64 * 1024;
/// Bytes received and reduced per piece in the ring reduce-scatter.
pub(super) const CHUNK: usize = 256 * 1024;
/// Bytes per piece of the pipelined chain broadcast.
pub(super) const BCAST_CHUNK: usize = 512 * 1024;

/// One collective call in progress.
#[derive(Clone, Copy)]
pub(super) struct Ctx<'s> {
    /// This rank.
    pub(super) rank: usize,
    /// World size.
    pub(super) size: usize,
    /// Connections, by rank.
    pub(super) peers: &'s [Option<Peer>],
    /// The bytes-sent counter.
    pub(super) sent: &'s AtomicU64,
    /// The call's timeout.
    pub(super) timeout: Duration,
    /// The call's signature (with `len` 0).
    pub(super) sig: Header,
}

impl Ctx<'_> {
    fn hdr(&self, bytes: usize) -> Header {
        Header {
            len: bytes as u64,
            ..self.sig
        }
    }

    fn op(&self) -> &'static str {
        self.sig.kind.name()
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.size
    }

    fn prev(&self) -> usize {
        (self.rank + self.size - 1) % self.size
    }

    /// Runs `f` with a batch of sends (see [`with_batch`]).
    pub(super) fn batch<'a, R>(
        &self,
        f: impl FnOnce(&mut Batch<'a, '_>) -> Result<R>,
    ) -> Result<R> {
        with_batch(self.peers, self.rank, self.op(), self.timeout, self.sent, f)
    }

    /// Sends one message to `peer` with the call's header.
    pub(super) fn send<'a>(
        &self,
        b: &mut Batch<'a, '_>,
        peer: usize,
        data: &'a [u8],
    ) -> Result<()> {
        b.send(peer, self.hdr(data.len()), data)
    }

    /// Receives one message from `peer` into `dst`.
    pub(super) fn recv_into(&self, peer: usize, dst: &mut [u8]) -> Result<()> {
        let p = peer_of(self.peers, self.rank, peer, self.op())?;
        p.read_into(&self.hdr(dst.len()), dst, self.rank, peer, self.timeout)
    }

    /// Receives one message of `dst.len()` elements from `peer` and reduces it into `dst`,
    /// piece by piece through scratch memory.
    pub(super) fn recv_reduce(
        &self,
        peer: usize,
        sc: &mut Scratch,
        mut dst: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        let p = peer_of(self.peers, self.rank, peer, self.op())?;
        let n = dst.len();
        let piece = (CHUNK / dst.elem_size()).max(1);
        let dtype = dst.dtype();
        let hdr = self.hdr(n * dst.elem_size());
        let mut start = 0;
        loop {
            let end = (start + piece).min(n);
            let mut tmp = sc.get(dtype, end - start)?;
            if start == 0 {
                p.read_into(&hdr, tmp.as_bytes_mut(), self.rank, peer, self.timeout)?;
            } else {
                p.read_more(tmp.as_bytes_mut(), self.rank, peer, self.op(), self.timeout)?;
            }
            reduce_into(op, &mut dst.slice_mut(start..end), tmp.as_ref())?;
            start = end;
            if start >= n {
                return Ok(());
            }
        }
    }
}

/// `n` elements split into `parts` nearly equal blocks.
fn even_blocks(n: usize, parts: usize) -> Vec<Range<usize>> {
    (0..parts)
        .map(|i| (i * n / parts)..((i + 1) * n / parts))
        .collect()
}

/// Blocks of the given lengths, back to back.
pub(super) fn blocks_of(counts: &[usize]) -> Vec<Range<usize>> {
    let mut at = 0;
    counts
        .iter()
        .map(|&c| {
            at += c;
            (at - c)..at
        })
        .collect()
}

/// Ring reduce-scatter in place: afterwards block `rank` of `data` holds the reduction over all
/// ranks (other blocks hold partial results).
fn ring_reduce_scatter(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    mut data: BufMut<'_>,
    blocks: &[Range<usize>],
    op: ReduceOp,
) -> Result<()> {
    let (n, r) = (cx.size, cx.rank);
    for s in 0..n - 1 {
        let send_b = (r + 2 * n - s - 1) % n;
        let recv_b = (r + 2 * n - s - 2) % n;
        let (sbuf, rbuf) = two_parts(
            reborrow(&mut data),
            blocks[send_b].clone(),
            blocks[recv_b].clone(),
        );
        cx.batch(|b| {
            cx.send(b, cx.next(), sbuf.as_bytes())?;
            cx.recv_reduce(cx.prev(), sc, rbuf, op)
        })?;
    }
    Ok(())
}

/// Ring all-gather in place: rank `r` starts with block `r` of `data`, and ends with all.
fn ring_all_gather(cx: &Ctx<'_>, mut data: BufMut<'_>, blocks: &[Range<usize>]) -> Result<()> {
    let (n, r) = (cx.size, cx.rank);
    for s in 0..n - 1 {
        let send_b = (r + n - s) % n;
        let recv_b = (r + 2 * n - s - 1) % n;
        let (sbuf, mut rbuf) = two_parts(
            reborrow(&mut data),
            blocks[send_b].clone(),
            blocks[recv_b].clone(),
        );
        cx.batch(|b| {
            cx.send(b, cx.next(), sbuf.as_bytes())?;
            cx.recv_into(cx.prev(), rbuf.as_bytes_mut())
        })?;
    }
    Ok(())
}

/// Direct exchange: sends `data` to every peer and receives every peer's buffer; returns the
/// reduction over ranks in rank order (identical bits on every rank) in `data`.
fn direct_all_reduce(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    mut data: BufMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    let (n, r, len) = (cx.size, cx.rank, data.len());
    if n == 2 {
        // Two ranks: a op b == b op a bit for bit, so no ordering is needed.
        let peer = 1 - r;
        let mut tmp = sc.get(data.dtype(), len)?;
        cx.batch(|b| {
            cx.send(b, peer, data.as_ref().as_bytes())?;
            cx.recv_into(peer, tmp.as_bytes_mut())
        })?;
        return reduce_into(op, &mut data, tmp.as_ref());
    }
    let mut all = sc.get(data.dtype(), n * len)?;
    cx.batch(|b| {
        let bytes = data.as_ref().as_bytes();
        for k in 1..n {
            cx.send(b, (r + k) % n, bytes)?;
        }
        for k in 1..n {
            let p = (r + n - k) % n;
            cx.recv_into(p, all.slice_mut(p * len..(p + 1) * len).as_bytes_mut())?;
        }
        Ok(())
    })?;
    all.slice_mut(r * len..(r + 1) * len)
        .as_bytes_mut()
        .copy_from_slice(data.as_ref().as_bytes());
    data.as_bytes_mut()
        .copy_from_slice(all.slice_mut(0..len).as_bytes_mut());
    for p in 1..n {
        reduce_into(op, &mut data, all.as_ref().slice(p * len..(p + 1) * len))?;
    }
    Ok(())
}

/// In-place all-reduce.
pub(super) fn all_reduce(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    mut data: BufMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    if data.len() * data.elem_size() <= SMALL {
        return direct_all_reduce(cx, sc, data, op);
    }
    let blocks = even_blocks(data.len(), cx.size);
    ring_reduce_scatter(cx, sc, reborrow(&mut data), &blocks, op)?;
    ring_all_gather(cx, data, &blocks)
}

/// In-place broadcast from `root`.
pub(super) fn broadcast(cx: &Ctx<'_>, mut data: BufMut<'_>, root: usize) -> Result<()> {
    let (n, r) = (cx.size, cx.rank);
    let bytes = data.len() * data.elem_size();
    if n == 2 || bytes <= SMALL {
        if r == root {
            let d = data.as_ref().as_bytes();
            return cx.batch(|b| {
                for k in 1..n {
                    cx.send(b, (r + k) % n, d)?;
                }
                Ok(())
            });
        }
        return cx.recv_into(root, data.as_bytes_mut());
    }
    // Pipelined chain root -> root+1 -> ... -> root-1.
    let pos = (r + n - root) % n;
    let piece = (BCAST_CHUNK / data.elem_size()).max(1);
    let len = data.len();
    if pos == 0 {
        let all = into_ref(data);
        return cx.batch(|b| {
            let mut start = 0;
            while start < len {
                let end = (start + piece).min(len);
                cx.send(b, cx.next(), all.slice(start..end).as_bytes())?;
                start = end;
            }
            Ok(())
        });
    }
    let last = pos == n - 1;
    cx.batch(|b| {
        let mut rest = data;
        while !rest.is_empty() {
            let k = piece.min(rest.len());
            let (mut head, tail) = split_mut(rest, k);
            cx.recv_into(cx.prev(), head.as_bytes_mut())?;
            if !last {
                cx.send(b, cx.next(), into_ref(head).as_bytes())?;
            }
            rest = tail;
        }
        Ok(())
    })
}

/// Reduce to `root`; other ranks' `data` is unchanged.
pub(super) fn reduce(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    mut data: BufMut<'_>,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let (n, r) = (cx.size, cx.rank);
    let bytes = data.len() * data.elem_size();
    if n == 2 || bytes <= SMALL {
        if r == root {
            for k in 1..n {
                cx.recv_reduce((r + k) % n, sc, reborrow(&mut data), op)?;
            }
            return Ok(());
        }
        let d = data.as_ref().as_bytes();
        return cx.batch(|b| cx.send(b, root, d));
    }
    let blocks = even_blocks(data.len(), n);
    if r == root {
        ring_reduce_scatter(cx, sc, reborrow(&mut data), &blocks, op)?;
        for k in 1..n {
            let p = (r + k) % n;
            let mut part = sub_mut(reborrow(&mut data), blocks[p].clone());
            cx.recv_into(p, part.as_bytes_mut())?;
        }
        Ok(())
    } else {
        let mut work = Owned::copy_of(data.as_ref());
        ring_reduce_scatter(cx, sc, work.buf()?, &blocks, op)?;
        let w = into_ref(work.buf()?);
        cx.batch(|b| cx.send(b, root, w.slice(blocks[r].clone()).as_bytes()))
    }
}

/// All-gather of per-rank blocks of `counts` elements into `output`.
pub(super) fn all_gather(
    cx: &Ctx<'_>,
    input: BufRef<'_>,
    mut output: BufMut<'_>,
    counts: &[usize],
) -> Result<()> {
    let (n, r) = (cx.size, cx.rank);
    let blocks = blocks_of(counts);
    sub_mut(reborrow(&mut output), blocks[r].clone())
        .as_bytes_mut()
        .copy_from_slice(input.as_bytes());
    if output.len() * output.elem_size() <= SMALL {
        return cx.batch(|b| {
            for k in 1..n {
                cx.send(b, (r + k) % n, input.as_bytes())?;
            }
            for k in 1..n {
                let p = (r + n - k) % n;
                cx.recv_into(p, output.slice_mut(blocks[p].clone()).as_bytes_mut())?;
            }
            Ok(())
        });
    }
    ring_all_gather(cx, output, &blocks)
}

/// Reduce-scatter: block `rank` of the reduction of every rank's `input` into `output`.
pub(super) fn reduce_scatter(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    input: BufRef<'_>,
    mut output: BufMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    let m = output.len();
    let blocks = blocks_of(&vec![m; cx.size]);
    let mut work = Owned::copy_of(input);
    ring_reduce_scatter(cx, sc, work.buf()?, &blocks, op)?;
    output.as_bytes_mut().copy_from_slice(
        into_ref(work.buf()?)
            .slice(blocks[cx.rank].clone())
            .as_bytes(),
    );
    Ok(())
}

/// Gather to `root` (`output` is `Some` exactly on the root).
pub(super) fn gather(
    cx: &Ctx<'_>,
    input: BufRef<'_>,
    output: Option<BufMut<'_>>,
    counts: &[usize],
    root: usize,
) -> Result<()> {
    let (n, r) = (cx.size, cx.rank);
    match output {
        Some(mut out) => {
            let blocks = blocks_of(counts);
            out.slice_mut(blocks[r].clone())
                .as_bytes_mut()
                .copy_from_slice(input.as_bytes());
            for k in 1..n {
                let p = (r + k) % n;
                cx.recv_into(p, out.slice_mut(blocks[p].clone()).as_bytes_mut())?;
            }
            Ok(())
        }
        None => cx.batch(|b| cx.send(b, root, input.as_bytes())),
    }
}

/// Scatter from `root` (`input` is `Some` exactly on the root).
pub(super) fn scatter(
    cx: &Ctx<'_>,
    input: Option<BufRef<'_>>,
    mut output: BufMut<'_>,
    counts: &[usize],
    root: usize,
) -> Result<()> {
    let (n, r) = (cx.size, cx.rank);
    match input {
        Some(inp) => {
            let blocks = blocks_of(counts);
            output
                .as_bytes_mut()
                .copy_from_slice(inp.slice(blocks[r].clone()).as_bytes());
            cx.batch(|b| {
                for k in 1..n {
                    let p = (r + k) % n;
                    cx.send(b, p, inp.slice(blocks[p].clone()).as_bytes())?;
                }
                Ok(())
            })
        }
        None => cx.recv_into(root, output.as_bytes_mut()),
    }
}

/// Pairwise all-to-all exchange with per-rank counts.
pub(super) fn all_to_all(
    cx: &Ctx<'_>,
    input: BufRef<'_>,
    send_counts: &[usize],
    mut output: BufMut<'_>,
    recv_counts: &[usize],
) -> Result<()> {
    let (n, r) = (cx.size, cx.rank);
    let sb = blocks_of(send_counts);
    let rb = blocks_of(recv_counts);
    output
        .slice_mut(rb[r].clone())
        .as_bytes_mut()
        .copy_from_slice(input.slice(sb[r].clone()).as_bytes());
    cx.batch(|b| {
        for k in 1..n {
            let p = (r + k) % n;
            cx.send(b, p, input.slice(sb[p].clone()).as_bytes())?;
        }
        for k in 1..n {
            let p = (r + n - k) % n;
            cx.recv_into(p, output.slice_mut(rb[p].clone()).as_bytes_mut())?;
        }
        Ok(())
    })
}

/// Dissemination barrier: ceil(log2(n)) rounds of empty messages.
pub(super) fn barrier(cx: &Ctx<'_>) -> Result<()> {
    let (n, r) = (cx.size, cx.rank);
    let mut d = 1;
    while d < n {
        cx.batch(|b| {
            cx.send(b, (r + d) % n, &[])?;
            cx.recv_into((r + n - d) % n, &mut [])
        })?;
        d *= 2;
    }
    Ok(())
}
