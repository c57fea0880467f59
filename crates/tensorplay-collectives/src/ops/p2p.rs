//! Point-to-point calls (`send`, `recv`, `isend`, `irecv`, `batch_isend_irecv`) and
//! `barrier`. Every point-to-point operation runs on the group's lane for its peer and
//! direction ([`super::lanes`]), in posting order, and is recorded by the flight recorder
//! with its peer, tag and label.

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
/// Messages to one rank arrive in the order they are sent (blocking or not).
///
/// # Errors
/// Not initialised, not a member, `dst` outside the group or this rank, a tensor the group's
/// backend does not move, a timeout or a failed peer.
#[track_caller]
pub fn send(tensor: &Tensor, dst: usize, group: Option<&ProcessGroup>, tag: u64) -> Result<()> {
    let site = std::panic::Location::caller();
    let mut works = post(
        vec![P2POp::isend(tensor, dst, group, tag)],
        site,
        Some("send"),
    )?;
    works.remove(0).wait(None)
}

/// Receives into `tensor` from global rank `src` (`dist.recv`); the sender's tensor must have
/// as many elements and the same `tag`. Returns `src`.
///
/// # Errors
/// As [`send`], and a sender whose tensor has another size.
#[track_caller]
pub fn recv(tensor: &Tensor, src: usize, group: Option<&ProcessGroup>, tag: u64) -> Result<usize> {
    let site = std::panic::Location::caller();
    let mut works = post(
        vec![P2POp::irecv(tensor, src, group, tag)],
        site,
        Some("recv"),
    )?;
    works.remove(0).wait(None)?;
    Ok(src)
}

/// Non-blocking [`send`] (`dist.isend`): returns a [`Work`]; the tensor must not be modified
/// until it completes.
///
/// # Errors
/// As [`send`], for what can be checked before it starts; the rest through the `Work`.
#[track_caller]
pub fn isend(tensor: &Tensor, dst: usize, group: Option<&ProcessGroup>, tag: u64) -> Result<Work> {
    let site = std::panic::Location::caller();
    Ok(post(
        vec![P2POp::isend(tensor, dst, group, tag)],
        site,
        Some("isend"),
    )?
    .remove(0))
}

/// Non-blocking [`recv`] (`dist.irecv`).
///
/// # Errors
/// As [`isend`].
#[track_caller]
pub fn irecv(tensor: &Tensor, src: usize, group: Option<&ProcessGroup>, tag: u64) -> Result<Work> {
    let site = std::panic::Location::caller();
    Ok(post(
        vec![P2POp::irecv(tensor, src, group, tag)],
        site,
        Some("irecv"),
    )?
    .remove(0))
}

/// One operation of [`batch_isend_irecv`] (`torch.distributed.P2POp`): a send of `tensor` to,
/// or a receive into it from, global rank `peer` of `group` (the default group for `None`)
/// with `tag`, and an optional label that the flight recorder keeps with it.
#[derive(Debug, Clone)]
pub struct P2POp {
    sending: bool,
    tensor: Tensor,
    peer: usize,
    group: Option<ProcessGroup>,
    tag: u64,
    label: Option<String>,
}

impl P2POp {
    /// A send of `tensor` to global rank `peer` (`P2POp(dist.isend, ...)`).
    pub fn isend(tensor: &Tensor, peer: usize, group: Option<&ProcessGroup>, tag: u64) -> P2POp {
        P2POp {
            sending: true,
            tensor: tensor.clone(),
            peer,
            group: group.cloned(),
            tag,
            label: None,
        }
    }

    /// A receive into `tensor` from global rank `peer` (`P2POp(dist.irecv, ...)`).
    pub fn irecv(tensor: &Tensor, peer: usize, group: Option<&ProcessGroup>, tag: u64) -> P2POp {
        P2POp {
            sending: false,
            ..P2POp::isend(tensor, peer, group, tag)
        }
    }

    /// Says what the message is, for the flight recorder's dumps and diagnosis (for example
    /// `"stage 1 micro-batch 3 activation"`).
    pub fn with_label(mut self, label: impl Into<String>) -> P2POp {
        self.label = Some(label.into());
        self
    }

    /// True for a send.
    pub fn is_send(&self) -> bool {
        self.sending
    }

    /// The other rank (global).
    pub fn peer(&self) -> usize {
        self.peer
    }
}

/// Starts every operation of `ops` (`dist.batch_isend_irecv`) and returns one [`Work`] per
/// operation, in order. Operations to one peer run in list order after that peer's earlier
/// ones (one lane per peer and direction; no thread per operation); sends and receives with
/// different peers, and the two directions with one peer, run at once, so a ring of sends
/// and receives posted together cannot deadlock. Every operation is checked before any
/// starts: all or none are posted.
///
/// # Errors
/// An empty list; operations on different groups; for any operation, the errors of [`send`]
/// and [`recv`] that can be checked before it runs (each naming the operation's index).
/// Errors while running come through the operation's `Work` (a timeout names the peer).
#[track_caller]
pub fn batch_isend_irecv(ops: Vec<P2POp>) -> Result<Vec<Work>> {
    post(ops, std::panic::Location::caller(), None)
}

/// A checked operation, ready to post, with its peer's group rank.
struct Ready {
    op: P2POp,
    peer: usize,
}

/// Checks and posts `ops`; `single` is the caller's name when it is `send`, `recv`, `isend` or
/// `irecv` (for its errors).
fn post(
    ops: Vec<P2POp>,
    site: &'static std::panic::Location<'static>,
    single: Option<&'static str>,
) -> Result<Vec<Work>> {
    let batch = "batch_isend_irecv";
    let op_name = |sending: bool| single.unwrap_or(if sending { "isend" } else { "irecv" });
    let Some(first) = ops.first() else {
        return Err(Error::invalid(
            batch,
            -1,
            "p2p_op_list",
            "at least one P2POp",
            "an empty list",
        ));
    };
    let g = resolve(first.group.as_ref(), op_name(first.sending))?;
    let many = ops.len() > 1;
    let mut ready = Vec::with_capacity(ops.len());
    for (i, op) in ops.into_iter().enumerate() {
        let name = op_name(op.sending);
        let mine = resolve(op.group.as_ref(), name)?;
        if !std::sync::Arc::ptr_eq(&mine.inner, &g.inner) {
            return Err(Error::invalid(
                batch,
                g.my_global_rank() as i64,
                format!("p2p_op_list[{i}].group"),
                format!("the group of p2p_op_list[0] ({:?})", g.ranks()),
                format!("{:?}", mine.ranks()),
            ));
        }
        let c = call(&g, name)?;
        let arg = match (many, op.sending) {
            (true, _) => format!("p2p_op_list[{i}].peer"),
            (false, true) => "dst".to_string(),
            (false, false) => "src".to_string(),
        };
        let peer = c.root(&arg, op.peer)?;
        if peer == c.rank {
            return Err(c.err(&arg, "a rank other than this one", op.peer));
        }
        c.accept("tensor", &op.tensor)?;
        if !op.sending {
            check_writable(&c, "tensor", &op.tensor)?;
        }
        ready.push(Ready { op, peer });
    }
    let mut works = Vec::with_capacity(ready.len());
    for Ready { op, peer } in ready {
        let name = if op.sending { "send" } else { "recv" };
        let rec = g.inner.recorder.clone();
        let id = rec.issued_p2p(name, site, &op.tensor, op.peer, op.tag, op.label.clone());
        let (tx, work) = Work::pending(name, g.my_global_rank(), g.ranks());
        let g2 = g.clone();
        let job = Box::new(move || {
            let started = Some(std::time::Instant::now());
            rec.started(id);
            let r = if op.sending {
                send_impl(&g2, &op.tensor, op.peer, op.tag)
            } else {
                recv_impl(&g2, &op.tensor, op.peer, op.tag)
            };
            rec.finished(id, &r);
            let r = r.map_err(crate::recorder::on_failure);
            let _ = tx.send(crate::work::Done::now(r, started));
        });
        g.inner.lanes.post(peer, op.sending, job)?;
        works.push(work);
    }
    Ok(works)
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
