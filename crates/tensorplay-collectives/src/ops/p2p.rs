//! Point-to-point calls (`send`, `recv`, `isend`, `irecv`) and `barrier`.

use tensorplay_core::Tensor;

use super::stage::{self, Out};
use super::translate::to_global;
use super::{blocking, call, check_writable, resolve};
use crate::group::ProcessGroup;
use crate::work::Work;
use crate::{Error, Result};

/// Blocks until every rank of the group has called it (`dist.barrier`). It runs over the
/// group's cpu control channel for every backend, after the group's earlier operations (which
/// are complete when they return).
///
/// # Errors
/// Not initialised, not a member, a timeout naming the ranks that did not arrive, a failed
/// peer.
#[track_caller]
pub fn barrier(group: Option<&ProcessGroup>) -> Result<()> {
    let site = std::panic::Location::caller();
    let g = resolve(group, "barrier")?;
    blocking(&g, "barrier", site, None, || {
        let c = call(&g, "barrier")?;
        c.ctl()?
            .barrier(c.timeout())
            .map_err(|e| match to_global(g.ranks(), e) {
                Error::Mismatch { op, detail } => Error::Mismatch {
                    op,
                    detail: super::check::in_user_terms(detail, "barrier"),
                },
                other => other,
            })
    })
}

/// Sends `tensor` to global rank `dst` (`dist.send`); `tag` must match the receiver's.
///
/// # Errors
/// Not initialised, not a member, `dst` outside the group or this rank, a tensor the group's
/// backend does not move, a timeout or a failed peer.
pub fn send(tensor: &Tensor, dst: usize, group: Option<&ProcessGroup>, tag: u64) -> Result<()> {
    let g = resolve(group, "send")?;
    send_impl(&g, tensor, dst, tag)
}

fn send_impl(g: &ProcessGroup, tensor: &Tensor, dst: usize, tag: u64) -> Result<()> {
    let c = call(g, "send")?;
    let peer = c.root("dst", dst)?;
    if peer == c.rank {
        return Err(c.err("dst", "a rank other than this one", dst));
    }
    c.accept("tensor", tensor)?;
    let t = stage::input(tensor, None)?;
    c.run(|b| b.send(&t, peer, tag, c.timeout()))
}

/// Receives into `tensor` from global rank `src` (`dist.recv`); the sender's tensor must have
/// as many elements and the same `tag`. Returns `src`.
///
/// # Errors
/// As [`send`], and a sender whose tensor has another size.
pub fn recv(tensor: &Tensor, src: usize, group: Option<&ProcessGroup>, tag: u64) -> Result<usize> {
    let g = resolve(group, "recv")?;
    recv_impl(&g, tensor, src, tag)?;
    Ok(src)
}

fn recv_impl(g: &ProcessGroup, tensor: &Tensor, src: usize, tag: u64) -> Result<()> {
    let c = call(g, "recv")?;
    let peer = c.root("src", src)?;
    if peer == c.rank {
        return Err(c.err("src", "a rank other than this one", src));
    }
    c.accept("tensor", tensor)?;
    check_writable(&c, "tensor", tensor)?;
    let out = Out::new(tensor)?;
    c.run(|b| b.recv(out.t(), peer, tag, c.timeout()))?;
    out.finish()
}

/// Non-blocking [`send`] (`dist.isend`): returns a [`Work`]; the tensor must not be modified
/// until it completes.
pub fn isend(tensor: &Tensor, dst: usize, group: Option<&ProcessGroup>, tag: u64) -> Result<Work> {
    let g = resolve(group, "isend")?;
    let (t, g2) = (tensor.clone(), g.clone());
    p2p_thread("isend", &g, move || send_impl(&g2, &t, dst, tag))
}

/// Non-blocking [`recv`] (`dist.irecv`).
pub fn irecv(tensor: &Tensor, src: usize, group: Option<&ProcessGroup>, tag: u64) -> Result<Work> {
    let g = resolve(group, "irecv")?;
    let (t, g2) = (tensor.clone(), g.clone());
    p2p_thread("irecv", &g, move || recv_impl(&g2, &t, src, tag))
}

/// Point-to-point operations do not take a turn in the group's sequence (a rank may post a
/// receive and a send to different peers at once); each runs on its own thread.
fn p2p_thread(
    op: &str,
    g: &ProcessGroup,
    f: impl FnOnce() -> Result<()> + Send + 'static,
) -> Result<Work> {
    let (tx, work) = Work::pending(op, g.my_global_rank(), g.ranks());
    std::thread::Builder::new()
        .name(format!("tensorplay-{op}"))
        .spawn(move || {
            let started = Some(std::time::Instant::now());
            let _ = tx.send(crate::work::Done::now(f(), started));
        })
        .map_err(|e| Error::Io(format!("could not start a thread for {op}: {e}")))?;
    Ok(work)
}
