//! The shared-memory algorithms, over the `w` ranks of one host (local indices `0..w`).
//!
//! Every algorithm streams its data through the slots in rounds of at most one slot per rank
//! (any size goes through bounded segments), at least one round per call (so that every call
//! exchanges signatures). Per round:
//!
//! * all_reduce, up to [`one_shot_max`] bytes (one-shot): every rank copies its chunk into its
//!   slot and publishes; every rank then reduces all slots in local rank order (identical bits
//!   everywhere). One step per round.
//! * all_reduce above (two-shot): every rank copies its chunk in, except its own slice `i`,
//!   and publishes; rank `i` reduces slice `i` of the chunk in the caller's buffer (its own
//!   value first, then the others' slots in local rank order), copies the result into its
//!   slot and publishes again; every rank then copies the others' reduced slices out. Two
//!   steps per round; each byte is reduced once, on one rank; about 4 bytes of memory traffic
//!   per byte reduced with two ranks.
//! * broadcast: the root copies in; the others copy out. reduce: everyone copies in; the root
//!   reduces all slots in rank order. all_gather, gather: everyone copies its piece in; every
//!   rank (the root) copies its own piece from its input (still in cache) and the peers'
//!   pieces from their slots straight into the output. reduce_scatter: a slot is cut into
//!   `w - 1` sub-slots, one per peer; every rank reduces its own block's piece straight into
//!   the output from its own input and the peers' sub-slots, in local rank order (each input
//!   byte is read once). scatter, all_to_all: a slot is cut
//!   into `w` sub-slots, sub-slot `j` holding the piece for local rank `j`; all_to_all first
//!   exchanges every rank's send counts (one round), so that all agree on the number of rounds
//!   and a count that disagrees with a peer's is a [`crate::Error::Mismatch`].
//! * barrier: one signed step, then a wait for every peer.
//!
//! Every rank writes its signature in every round, also where it sends no data, and in the
//! first round of every call every rank waits for every peer and checks its signature: ranks
//! in different collectives, or in the same one with another root, count or op, all get
//! [`crate::Error::Mismatch`], whichever side of the call they are on.

use std::ops::Range;

use tensorplay_core::DType;

use super::ShmCtx;
use crate::backend::wide::{is_16bit, reduce_many};
use crate::backend::{BufMut, BufRef};
use crate::{Error, ReduceOp, Result};

/// All-reduces of at most this many bytes are one-shot: the smaller of 256 KiB and four slots.
pub(in crate::backend::cpu) fn one_shot_max(slot: usize) -> usize {
    (256 << 10).min(4 * slot)
}

/// A typed read-only view of `n` elements of `dtype` at `p`: `n * dtype.size_in_bytes()`
/// bytes, read as `dtype`'s own element type. Errors for a dtype host buffers do not hold
/// (bool) or a misaligned `p` (a bug of the slot layout).
///
/// # Safety
/// `p` must be valid for `n * dtype.size_in_bytes()` bytes, and nobody may write them while
/// the view lives (the step protocol guarantees it for published data).
unsafe fn view<'x>(dtype: DType, p: *const u8, n: usize) -> Result<BufRef<'x>> {
    // SAFETY: forwarded from the caller; u8 has no alignment or validity requirement.
    let bytes = unsafe { std::slice::from_raw_parts(p, n * dtype.size_in_bytes()) };
    BufRef::from_bytes(dtype, bytes).ok_or_else(|| Error::Backend {
        backend: "cpu".into(),
        detail: format!("shared memory cannot hold {dtype} elements at {p:p}").into(),
    })
}

/// Copies `src` into this rank's slot `s` at byte offset `at` (the caller opened the slot for
/// writing, and `at + src bytes <= slot`).
fn put(cx: &ShmCtx<'_>, s: usize, at: usize, src: BufRef<'_>) {
    let b = src.as_bytes();
    debug_assert!(at + b.len() <= cx.slot());
    cx.count_sent(b.len());
    // SAFETY: inside our own slot (bounds above), which no peer reads until we publish it;
    // the source is caller memory and cannot overlap shared memory it does not own.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), cx.my_slot(s).add(at), b.len()) }
}

/// Copies `dst.len()` elements from local rank `li`'s slot `s` at byte offset `at` into `dst`
/// (after seeing `li` publish that data).
fn get(cx: &ShmCtx<'_>, li: usize, s: usize, at: usize, dst: &mut BufMut<'_>) {
    let d = dst.as_bytes_mut();
    debug_assert!(at + d.len() <= cx.slot());
    // SAFETY: inside the peer's slot, which it published and does not rewrite until we publish
    // a later step; `dst` is caller memory.
    unsafe {
        let src = cx.slot_of(li, s).add(at);
        if cx.streaming() {
            copy_streaming(src, d.as_mut_ptr(), d.len());
        } else {
            std::ptr::copy_nonoverlapping(src, d.as_mut_ptr(), d.len());
        }
    }
}

/// Calls moving at least this many bytes through one rank copy out with non-temporal stores.
pub(in crate::backend::cpu) const STREAM_MIN: usize = 8 << 20;

/// Copies `n` bytes with non-temporal stores (x86-64; a plain copy elsewhere): for large
/// results that will not be read again soon, writing around the cache saves the read of each
/// destination line before it is overwritten (a third of the copy's memory traffic), which is
/// what a large `memcpy` does too.
///
/// # Safety
/// As `copy_nonoverlapping`: `src` valid for `n` reads, `dst` for `n` writes, no overlap.
pub(super) unsafe fn copy_streaming(src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of x86-64; every access is inside [src, src+n) or [dst, dst+n):
    // the head up to 16-byte alignment of `dst` and the tail are plain copies, the middle is
    // whole 16-byte blocks (unaligned loads, aligned streaming stores), then a store fence
    // orders the streaming stores before anything we publish afterwards.
    unsafe {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let head = dst.align_offset(16).min(n);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let blocks = (n - head) / 16;
        let (s, d) = (src.add(head), dst.add(head));
        for i in 0..blocks {
            let v = _mm_loadu_si128(s.add(16 * i).cast::<__m128i>());
            _mm_stream_si128(d.add(16 * i).cast::<__m128i>(), v);
        }
        let done = head + 16 * blocks;
        std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), n - done);
        _mm_sfence();
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: forwarded from the caller.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, n)
    }
}

/// Reduces the published slots `s` of local ranks `from` (in that order; this rank's own
/// slot among them is read too), `dst.len()` elements at byte offset `at`, into `dst` in one
/// pass: 16-bit dtypes in float32, divided for `Avg`, rounded once (see
/// [`reduce_many`]).
fn reduce_slots(
    cx: &ShmCtx<'_>,
    s: usize,
    at: usize,
    dst: &mut BufMut<'_>,
    from: Vec<usize>,
    op: ReduceOp,
) -> Result<()> {
    let mut srcs = Vec::with_capacity(from.len());
    for li in from {
        // SAFETY: published data of a peer (see `get`), or our own published slot, which
        // nobody writes until we publish again; aligned: slots are 64-byte aligned and `at` is
        // a multiple of the element size.
        srcs.push(unsafe { view(dst.dtype(), cx.slot_of(li, s).add(at), dst.len())? });
    }
    let avg = avg_of(op, dst.dtype(), cx.w());
    reduce_many(op, dst, &srcs, avg)
}

/// The divisor a 16-bit `Avg` over `w` ranks applies before its one rounding (other dtypes
/// and ops: none; their callers divide).
pub(in crate::backend::cpu) fn avg_of(op: ReduceOp, dtype: DType, w: usize) -> Option<usize> {
    (op == ReduceOp::Avg && is_16bit(dtype)).then_some(w)
}

/// Rounds needed to stream `n` elements through pieces of `per` elements (at least one).
fn rounds(n: usize, per: usize) -> usize {
    n.div_ceil(per.max(1)).max(1)
}

/// Piece `k` of `n` elements cut into pieces of `per`: possibly empty.
fn piece(k: usize, per: usize, n: usize) -> Range<usize> {
    (k * per).min(n)..((k + 1) * per).min(n)
}

/// Elements per sub-slot when a slot is cut in `w` (64-byte aligned sub-slots).
fn sub_elems(cx: &ShmCtx<'_>, es: usize) -> (usize, usize) {
    let sub = (cx.slot() / cx.w()) & !63;
    (sub, sub / es)
}

/// In-place all-reduce over this host's ranks.
pub(in crate::backend::cpu) fn all_reduce(
    cx: &mut ShmCtx<'_>,
    mut data: BufMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    cx.set_streaming(data.len() * data.elem_size() >= STREAM_MIN);
    let (es, n) = (data.elem_size(), data.len());
    let per = cx.slot() / es;
    let (w, me) = (cx.w(), cx.li());
    if n * es <= one_shot_max(cx.slot()) {
        for k in 0..rounds(n, per) {
            let r = piece(k, per, n);
            let mut d = data.slice_mut(r);
            let s = cx.open_slot(true)?;
            put(cx, s, 0, d.as_ref());
            cx.write_sig(s, k as u64);
            let x = cx.publish(Some(s));
            cx.wait_all(x)?;
            for p in 0..w {
                cx.check_sig(p, s, k as u64)?;
            }
            if me != 0 {
                get(cx, 0, s, 0, &mut d);
            }
            reduce_slots(cx, s, 0, &mut d, (1..w).collect(), op)?;
        }
        return Ok(());
    }
    for k in 0..rounds(n, per) {
        let r = piece(k, per, n);
        let m = r.len();
        let mut d = data.slice_mut(r);
        let slices: Vec<Range<usize>> = (0..w).map(|i| (i * m / w)..((i + 1) * m / w)).collect();
        let s = cx.open_slot(true)?;
        let mine = slices[me].clone();
        // the peers' slices only: our own is reduced straight from `d`
        put(cx, s, 0, d.as_ref().slice(0..mine.start));
        put(cx, s, mine.end * es, d.as_ref().slice(mine.end..m));
        cx.write_sig(s, k as u64);
        let x = cx.publish(Some(s));
        cx.wait_all(x)?;
        for p in 0..w {
            cx.check_sig(p, s, k as u64)?;
        }
        {
            let mut acc = d.slice_mut(mine.clone());
            let peers = (1..w).map(|j| (me + j) % w).collect();
            reduce_slots(cx, s, mine.start * es, &mut acc, peers, op)?;
            // slice `me` of our own slot is read by nobody until we publish again
            put(cx, s, mine.start * es, acc.as_ref());
        }
        let x = cx.publish(Some(s));
        cx.wait_all(x)?;
        for j in 1..w {
            let p = (me + j) % w;
            let sl = slices[p].clone();
            get(cx, p, s, sl.start * es, &mut d.slice_mut(sl));
        }
    }
    Ok(())
}

/// In-place broadcast from local rank `root`.
pub(in crate::backend::cpu) fn broadcast(
    cx: &mut ShmCtx<'_>,
    mut data: BufMut<'_>,
    root: usize,
) -> Result<()> {
    cx.set_streaming(data.len() * data.elem_size() >= STREAM_MIN);
    let (es, n) = (data.elem_size(), data.len());
    let per = cx.slot() / es;
    let me = cx.li();
    for k in 0..rounds(n, per) {
        let mut d = data.slice_mut(piece(k, per, n));
        let s = cx.open_slot(true)?;
        if me == root {
            put(cx, s, 0, d.as_ref());
        }
        cx.write_sig(s, k as u64);
        let x = cx.publish(Some(s));
        if k == 0 {
            cx.check_all(s, x, 0)?;
        }
        if me != root {
            cx.wait_one(root, x)?;
            cx.check_sig(root, s, k as u64)?;
            get(cx, root, s, 0, &mut d);
        }
    }
    Ok(())
}

/// Reduce to local rank `root` (in local rank order); other ranks' `data` is unchanged.
pub(in crate::backend::cpu) fn reduce(
    cx: &mut ShmCtx<'_>,
    mut data: BufMut<'_>,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let (es, n) = (data.elem_size(), data.len());
    let per = cx.slot() / es;
    let (w, me) = (cx.w(), cx.li());
    for k in 0..rounds(n, per) {
        let mut d = data.slice_mut(piece(k, per, n));
        let s = cx.open_slot(true)?;
        put(cx, s, 0, d.as_ref());
        cx.write_sig(s, k as u64);
        let x = cx.publish(Some(s));
        if me != root {
            if k == 0 {
                cx.check_all(s, x, 0)?;
            }
            continue;
        }
        cx.wait_all(x)?;
        for p in 0..w {
            cx.check_sig(p, s, k as u64)?;
        }
        if me != 0 {
            get(cx, 0, s, 0, &mut d);
        }
        reduce_slots(cx, s, 0, &mut d, (1..w).collect(), op)?;
    }
    Ok(())
}

/// Blocks of the given lengths, back to back.
fn blocks_of(counts: &[usize]) -> Vec<Range<usize>> {
    super::super::algo::blocks_of(counts)
}

/// All-gather (`root` `None`) or gather to local rank `root` of per-rank blocks of `counts`
/// elements; `output` is `None` exactly on the ranks that receive nothing.
///
/// Per round every rank copies its next piece into its slot and publishes at once; a
/// receiving rank then copies the same piece of its own input into its output while the
/// input is still in cache (one read of the input for both copies), and copies the peers'
/// pieces straight from their slots into its output: each byte crosses memory once into
/// shared memory and once out, with no staging buffer and no separate pass for its own block.
pub(in crate::backend::cpu) fn gather(
    cx: &mut ShmCtx<'_>,
    input: BufRef<'_>,
    mut output: Option<BufMut<'_>>,
    counts: &[usize],
    root: Option<usize>,
) -> Result<()> {
    cx.set_streaming(output.as_ref().map_or(0, |o| o.len() * o.elem_size()) >= STREAM_MIN);
    let es = input.elem_size();
    let per = cx.slot() / es;
    let (w, me) = (cx.w(), cx.li());
    let blocks = blocks_of(counts);
    let n_rounds = counts.iter().map(|&c| rounds(c, per)).max().unwrap_or(1);
    let receives = root.is_none_or(|r| r == me);
    for k in 0..n_rounds {
        let s = cx.open_slot(true)?;
        let mine = piece(k, per, input.len());
        put(cx, s, 0, input.slice(mine.clone()));
        cx.write_sig(s, k as u64);
        let x = cx.publish(Some(s));
        if !receives {
            if k == 0 {
                cx.check_all(s, x, 0)?;
            }
            continue;
        }
        let Some(out) = output.as_mut() else {
            continue;
        };
        let b = blocks[me].start;
        copy_local(
            cx,
            input.slice(mine.clone()),
            &mut out.slice_mut(b + mine.start..b + mine.end),
        );
        cx.wait_all(x)?;
        for j in 1..w {
            let p = (me + j) % w;
            cx.check_sig(p, s, k as u64)?;
            let r = piece(k, per, counts[p]);
            let b = blocks[p].start;
            get(cx, p, s, 0, &mut out.slice_mut(b + r.start..b + r.end));
        }
    }
    Ok(())
}

/// Copies caller memory `src` into caller memory `dst` (as many elements), streaming when the
/// call does.
fn copy_local(cx: &ShmCtx<'_>, src: BufRef<'_>, dst: &mut BufMut<'_>) {
    let (s, d) = (src.as_bytes(), dst.as_bytes_mut());
    debug_assert_eq!(s.len(), d.len());
    let n = s.len().min(d.len());
    if cx.streaming() {
        // SAFETY: two distinct caller buffers (a shared and a mutable borrow cannot overlap),
        // `n` bytes valid in each.
        unsafe { copy_streaming(s.as_ptr(), d.as_mut_ptr(), n) }
    } else {
        d[..n].copy_from_slice(&s[..n]);
    }
}

/// Scatter from local rank `root` (`input` is `Some` exactly there) of blocks of `counts`.
pub(in crate::backend::cpu) fn scatter(
    cx: &mut ShmCtx<'_>,
    input: Option<BufRef<'_>>,
    mut output: BufMut<'_>,
    counts: &[usize],
    root: usize,
) -> Result<()> {
    let es = output.elem_size();
    let (sub, per) = sub_elems(cx, es);
    let (w, me) = (cx.w(), cx.li());
    let blocks = blocks_of(counts);
    if let Some(inp) = input {
        output
            .as_bytes_mut()
            .copy_from_slice(inp.slice(blocks[me].clone()).as_bytes());
    }
    let n_rounds = counts.iter().map(|&c| rounds(c, per)).max().unwrap_or(1);
    for k in 0..n_rounds {
        let s = cx.open_slot(true)?;
        if let Some(inp) = input {
            for p in 0..w {
                let r = piece(k, per, counts[p]);
                let b = blocks[p].start;
                put(cx, s, p * sub, inp.slice(b + r.start..b + r.end));
            }
        }
        cx.write_sig(s, k as u64);
        let x = cx.publish(Some(s));
        if k == 0 {
            cx.check_all(s, x, 0)?;
        }
        if input.is_none() {
            cx.wait_one(root, x)?;
            cx.check_sig(root, s, k as u64)?;
            let r = piece(k, per, counts[me]);
            get(cx, root, s, me * sub, &mut output.slice_mut(r));
        }
    }
    Ok(())
}

/// Reduce-scatter: block `me` (of `output.len()` elements) of the reduction of every rank's
/// `input` (`w` blocks), reduced in local rank order.
///
/// A slot is cut into `w - 1` sub-slots, one per peer (see [`peer_sub`]): per round every rank
/// copies the next piece of each peer's block into that peer's sub-slot and publishes; then
/// it reduces its own block's piece straight into `output`, reading its own input directly
/// and each peer's piece from the peer's slot, each once, in local rank order (identical bits
/// on every rank whatever the order of arrival).
pub(in crate::backend::cpu) fn reduce_scatter(
    cx: &mut ShmCtx<'_>,
    input: BufRef<'_>,
    mut output: BufMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    let (es, m) = (input.elem_size(), output.len());
    let (w, me) = (cx.w(), cx.li());
    let (sub, per) = peer_sub_elems(cx, es);
    for k in 0..rounds(m, per) {
        let r = piece(k, per, m);
        let s = cx.open_slot(true)?;
        for p in (0..w).filter(|&p| p != me) {
            let at = peer_sub(me, p, w) * sub;
            put(cx, s, at, input.slice(p * m + r.start..p * m + r.end));
        }
        cx.write_sig(s, k as u64);
        let x = cx.publish(Some(s));
        cx.wait_all(x)?;
        for p in (0..w).filter(|&p| p != me) {
            cx.check_sig(p, s, k as u64)?;
        }
        let own = input.slice(me * m + r.start..me * m + r.end);
        let mut d = output.slice_mut(r);
        if me == 0 {
            d.as_bytes_mut().copy_from_slice(own.as_bytes());
        } else {
            get(cx, 0, s, peer_sub(0, me, w) * sub, &mut d);
        }
        let mut srcs = Vec::with_capacity(w - 1);
        for p in 1..w {
            srcs.push(if p == me {
                own
            } else {
                // SAFETY: published data of a peer (see `get`), aligned (64-byte sub-slots).
                unsafe {
                    view(
                        d.dtype(),
                        cx.slot_of(p, s).add(peer_sub(p, me, w) * sub),
                        d.len(),
                    )?
                }
            });
        }
        let avg = avg_of(op, d.dtype(), w);
        reduce_many(op, &mut d, &srcs, avg)?;
    }
    Ok(())
}

/// The sub-slot of its slot where local rank `from` puts the piece for local rank `to`
/// (`to != from`): the peers after `from` in ring order, `0..w - 1`.
fn peer_sub(from: usize, to: usize, w: usize) -> usize {
    (to + w - from - 1) % w
}

/// Bytes and elements per sub-slot when a slot is cut in `w - 1` (64-byte aligned, at least
/// one element).
fn peer_sub_elems(cx: &ShmCtx<'_>, es: usize) -> (usize, usize) {
    let sub = ((cx.slot() / (cx.w() - 1).max(1)) & !63).max(es);
    (sub, sub / es)
}

/// All-to-all with per-rank counts (see [`crate::backend::Backend::all_to_all`]).
pub(in crate::backend::cpu) fn all_to_all(
    cx: &mut ShmCtx<'_>,
    input: BufRef<'_>,
    send_counts: &[usize],
    mut output: BufMut<'_>,
    recv_counts: &[usize],
) -> Result<()> {
    let es = input.elem_size();
    let (w, me) = (cx.w(), cx.li());
    // round 0: everyone's send counts, so that all agree on the rounds
    let s = cx.open_slot(true)?;
    let mine: Vec<u8> = send_counts
        .iter()
        .flat_map(|&c| (c as u64).to_le_bytes())
        .collect();
    if mine.len() > cx.slot() {
        return Err(Error::invalid(
            "all_to_all",
            cx.rank() as i64,
            "group size",
            format!(
                "at most {} ranks for the shared-memory slot size",
                cx.slot() / 8
            ),
            w,
        ));
    }
    // SAFETY: the first w*8 bytes of our own slot, opened for writing (checked above).
    unsafe { std::ptr::copy_nonoverlapping(mine.as_ptr(), cx.my_slot(s), mine.len()) };
    cx.write_sig(s, u64::MAX);
    let x = cx.publish(Some(s));
    cx.wait_all(x)?;
    let mut matrix = vec![vec![0usize; w]; w];
    for (p, row) in matrix.iter_mut().enumerate() {
        cx.check_sig(p, s, u64::MAX)?;
        let mut b = vec![0u8; w * 8];
        // SAFETY: the first w*8 bytes of a published slot.
        unsafe { std::ptr::copy_nonoverlapping(cx.slot_of(p, s), b.as_mut_ptr(), b.len()) };
        for (q, c) in row.iter_mut().enumerate() {
            let mut v = [0u8; 8];
            v.copy_from_slice(&b[q * 8..q * 8 + 8]);
            *c = u64::from_le_bytes(v) as usize;
        }
    }
    for p in 0..w {
        if matrix[p][me] != recv_counts[p] {
            return Err(Error::Mismatch {
                op: "all_to_all".into(),
                detail: crate::detail!(
                    "rank ",
                    crate::Part::Rank(cx.rank_of(p)),
                    format!(" sends {} elements to rank ", matrix[p][me]),
                    crate::Part::Rank(cx.rank()),
                    " but rank ",
                    crate::Part::Rank(cx.rank()),
                    format!(" expects {} from it (recv_counts)", recv_counts[p])
                ),
            });
        }
    }
    let (sub, per) = sub_elems(cx, es);
    let sb = blocks_of(send_counts);
    let rb = blocks_of(recv_counts);
    output
        .slice_mut(rb[me].clone())
        .as_bytes_mut()
        .copy_from_slice(input.slice(sb[me].clone()).as_bytes());
    let n_rounds = matrix
        .iter()
        .flatten()
        .map(|&c| rounds(c, per))
        .max()
        .unwrap_or(1);
    for k in 0..n_rounds {
        let s = cx.open_slot(true)?;
        for q in 0..w {
            let r = piece(k, per, send_counts[q]);
            let b = sb[q].start;
            put(cx, s, q * sub, input.slice(b + r.start..b + r.end));
        }
        cx.write_sig(s, k as u64);
        let x = cx.publish(Some(s));
        cx.wait_all(x)?;
        for j in 1..w {
            let p = (me + j) % w;
            cx.check_sig(p, s, k as u64)?;
            let r = piece(k, per, recv_counts[p]);
            let b = rb[p].start;
            get(
                cx,
                p,
                s,
                me * sub,
                &mut output.slice_mut(b + r.start..b + r.end),
            );
        }
    }
    Ok(())
}

/// Barrier over this host's ranks.
pub(in crate::backend::cpu) fn barrier(cx: &mut ShmCtx<'_>) -> Result<()> {
    let s = cx.open_slot(true)?;
    cx.write_sig(s, 0);
    let x = cx.publish(Some(s));
    cx.check_all(s, x, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One dtype's view of shared memory: `Some(bytes)` when it is read as its own type.
    struct Case {
        dtype: DType,
        bytes: Option<usize>,
    }

    fn check(c: Case) {
        let mem = [0x0101_0101_0101_0101u64; 8];
        let p = mem.as_ptr().cast::<u8>();
        // SAFETY: `mem` holds 64 bytes, at least 3 elements of any dtype, and is not written.
        let got = unsafe { view(c.dtype, p, 3) };
        let got = got.ok().map(|b| {
            assert_eq!(
                (b.dtype(), b.len()),
                (c.dtype, 3),
                "{}: type and length",
                c.dtype
            );
            b.as_bytes().len()
        });
        assert_eq!(got, c.bytes, "{}: bytes viewed", c.dtype);
    }

    #[test]
    fn reduce_scatter_sub_slots_give_each_peer_its_own() {
        // for every sender, the receivers' sub-slots are 0..w-1, each once; one world per case
        for w in [2usize, 3, 4, 7] {
            for from in 0..w {
                let mut subs: Vec<usize> = (0..w)
                    .filter(|&to| to != from)
                    .map(|to| peer_sub(from, to, w))
                    .collect();
                subs.sort_unstable();
                let want: Vec<usize> = (0..w - 1).collect();
                assert_eq!(subs, want, "world {w}, sender {from}");
            }
        }
    }

    #[test]
    fn slots_are_read_with_each_dtypes_own_element_size() {
        // before, every dtype but float32/float64 was read as int64: 3 bools as 24 bytes
        let cases = [
            Case {
                dtype: DType::F32,
                bytes: Some(12),
            },
            Case {
                dtype: DType::F64,
                bytes: Some(24),
            },
            Case {
                dtype: DType::I64,
                bytes: Some(24),
            },
            Case {
                dtype: DType::Bool,
                bytes: None,
            },
            Case {
                dtype: DType::BF16,
                bytes: Some(6),
            },
            Case {
                dtype: DType::F16,
                bytes: Some(6),
            },
        ];
        assert_eq!(cases.len(), DType::ALL.len(), "a case per dtype");
        for c in cases {
            check(c);
        }
    }
}
