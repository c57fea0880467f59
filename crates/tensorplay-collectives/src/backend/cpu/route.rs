//! Which transport each collective of the CPU backend takes.
//!
//! The choice is made once per group, from the host ids every rank agreed on at setup (see
//! `shm`), so it is the same on every rank:
//!
//! * every rank on one host: the shared-memory algorithms (`shm::algo`), for every collective;
//!   large reduce_scatter (and all_gather and gather where asked for) read peers' memory
//!   directly (`shm::cma`) where every rank of the host can;
//! * every rank alone on its host (or the transport off): the TCP algorithms (`algo`);
//! * mixed: all_reduce, broadcast, reduce and barrier are hierarchical (shared memory inside
//!   each host, TCP between one representative per host: its lowest rank, or the root where
//!   the root is); all_gather, reduce_scatter, gather, scatter and all_to_all take TCP.

use super::algo::{self, Ctx};
use super::buf::{Owned, Scratch, into_ref, reborrow};
use super::shm::{self, Shm, ShmCtx};
use crate::backend::{BufMut, BufRef, reduce_into};
use crate::{ReduceOp, Result};

/// The transport of a group's collectives.
#[derive(Debug)]
pub(super) enum Route {
    /// TCP only.
    Tcp,
    /// Every rank on this host.
    Shm(Shm),
    /// Several hosts, some with several ranks: host ids by rank, and this host's segments
    /// when it has more than this rank.
    Hier(Vec<usize>, Option<Shm>),
}

impl Route {
    /// The route for the host ids of a group's ranks.
    pub(super) fn new(hosts: Vec<usize>, shm: Option<Shm>) -> Route {
        let n = hosts.len();
        let alone = |h: usize| hosts.iter().filter(|&&x| x == h).count() == 1;
        if hosts.iter().all(|&h| alone(h)) {
            Route::Tcp
        } else if hosts.iter().all(|&h| h == hosts[0]) && n > 0 {
            match shm {
                Some(s) => Route::Shm(s),
                None => Route::Tcp,
            }
        } else {
            Route::Hier(hosts, shm)
        }
    }

    /// This host's shared-memory state, if any.
    pub(super) fn shm(&self) -> Option<&Shm> {
        match self {
            Route::Tcp => None,
            Route::Shm(s) => Some(s),
            Route::Hier(_, s) => s.as_ref(),
        }
    }

    /// The name of the transport, for logs and `Debug`.
    pub(super) fn name(&self) -> &'static str {
        match self {
            Route::Tcp => "tcp",
            Route::Shm(_) => "shm",
            Route::Hier(..) => "shm+tcp",
        }
    }
}

fn scx<'a>(s: &'a Shm, cx: &Ctx<'a>, part: u8) -> ShmCtx<'a> {
    ShmCtx::new(s, cx.peers, &cx.sig, part, cx.rank, cx.timeout, cx.sent)
}

/// Whether a call moving `bytes` (the same on every rank) reads peers' memory directly
/// (`gathers`: an all_gather or gather). Such calls sign their rounds as a part of their
/// own, so that ranks that disagreed on the path would fail with a mismatch.
fn use_cma(s: &Shm, bytes: usize, gathers: bool) -> bool {
    s.cma(gathers) && bytes >= shm::cma::CMA_MIN
}

/// The part that calls reading peers' memory directly sign (see [`use_cma`]).
const CMA_PART: u8 = 0x40;

/// The representative of each host for a call rooted at `root` (or the lowest rank), by host.
fn rep(hosts: &[usize], h: usize, root: Option<usize>) -> usize {
    match root {
        Some(r) if hosts[r] == h => r,
        _ => h,
    }
}

/// The distinct host ids, ascending (each is the host's lowest rank).
fn host_ids(hosts: &[usize]) -> Vec<usize> {
    let mut v = hosts.to_vec();
    v.sort_unstable();
    v.dedup();
    v
}

/// This rank's local index of group rank `r` (on this host).
fn local(s: &Shm, r: usize) -> usize {
    s.local_index(r).unwrap_or(0)
}

/// In-place all-reduce.
pub(super) fn all_reduce(
    route: &Route,
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    mut data: BufMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    match route {
        Route::Tcp => algo::all_reduce(cx, sc, data, op),
        Route::Shm(s) => shm::all_reduce(&mut scx(s, cx, 0), data, op),
        Route::Hier(hosts, s) => {
            if let Some(s) = s {
                shm::reduce(&mut scx(s, cx, 1), reborrow(&mut data), op, 0)?;
            }
            if hosts[cx.rank] == cx.rank {
                leaders_all_reduce(cx, sc, &host_ids(hosts), reborrow(&mut data), op)?;
            }
            match s {
                Some(s) => shm::broadcast(&mut scx(s, cx, 2), data, 0),
                None => Ok(()),
            }
        }
    }
}

/// All-reduce among the host leaders over TCP: each sends its value to every other leader, and
/// every leader reduces in leader order (identical bits on every leader).
fn leaders_all_reduce(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    leaders: &[usize],
    mut data: BufMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    let me = cx.rank;
    let mut mine = Owned::copy_of(data.as_ref());
    let mine = into_ref(mine.buf()?);
    cx.batch(|b| {
        for &l in leaders.iter().filter(|&&l| l != me) {
            cx.send(b, l, mine.as_bytes())?;
        }
        if leaders[0] != me {
            cx.recv_into(leaders[0], data.as_bytes_mut())?;
        }
        for &l in &leaders[1..] {
            if l == me {
                reduce_into(op, &mut data, mine)?;
            } else {
                cx.recv_reduce(l, sc, reborrow(&mut data), op)?;
            }
        }
        Ok(())
    })
}

/// In-place broadcast from `root`.
pub(super) fn broadcast(
    route: &Route,
    cx: &Ctx<'_>,
    mut data: BufMut<'_>,
    root: usize,
) -> Result<()> {
    match route {
        Route::Tcp => algo::broadcast(cx, data, root),
        Route::Shm(s) => shm::broadcast(&mut scx(s, cx, 0), data, root),
        Route::Hier(hosts, s) => {
            let my_rep = rep(hosts, hosts[cx.rank], Some(root));
            if cx.rank == root {
                let d = data.as_ref().as_bytes();
                cx.batch(|b| {
                    for h in host_ids(hosts).into_iter().filter(|&h| h != hosts[root]) {
                        cx.send(b, rep(hosts, h, Some(root)), d)?;
                    }
                    Ok(())
                })?;
            } else if cx.rank == my_rep {
                cx.recv_into(root, data.as_bytes_mut())?;
            }
            match s {
                Some(s) => shm::broadcast(&mut scx(s, cx, 1), data, local(s, my_rep)),
                None => Ok(()),
            }
        }
    }
}

/// Reduce to `root`; other ranks' `data` is unchanged.
pub(super) fn reduce(
    route: &Route,
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    mut data: BufMut<'_>,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    match route {
        Route::Tcp => algo::reduce(cx, sc, data, op, root),
        Route::Shm(s) => shm::reduce(&mut scx(s, cx, 0), data, op, root_local(s, root)),
        Route::Hier(hosts, s) => {
            let my_rep = rep(hosts, hosts[cx.rank], Some(root));
            if cx.rank == root {
                if let Some(s) = s {
                    shm::reduce(&mut scx(s, cx, 1), reborrow(&mut data), op, local(s, root))?;
                }
                for h in host_ids(hosts).into_iter().filter(|&h| h != hosts[root]) {
                    cx.recv_reduce(rep(hosts, h, Some(root)), sc, reborrow(&mut data), op)?;
                }
                Ok(())
            } else if cx.rank == my_rep {
                // the host's partial result goes to the root; our own data stays as it was
                let mut work = Owned::copy_of(data.as_ref());
                if let Some(s) = s {
                    shm::reduce(&mut scx(s, cx, 1), work.buf()?, op, local(s, my_rep))?;
                }
                let w = into_ref(work.buf()?);
                cx.batch(|b| cx.send(b, root, w.as_bytes()))
            } else {
                match s {
                    Some(s) => shm::reduce(&mut scx(s, cx, 1), data, op, local(s, my_rep)),
                    None => Ok(()),
                }
            }
        }
    }
}

fn root_local(s: &Shm, root: usize) -> usize {
    local(s, root)
}

/// Barrier.
pub(super) fn barrier(route: &Route, cx: &Ctx<'_>) -> Result<()> {
    match route {
        Route::Tcp => algo::barrier(cx),
        Route::Shm(s) => shm::barrier(&mut scx(s, cx, 0)),
        Route::Hier(hosts, s) => {
            if let Some(s) = s {
                shm::barrier(&mut scx(s, cx, 1))?;
            }
            if hosts[cx.rank] == cx.rank {
                let leaders = host_ids(hosts);
                cx.batch(|b| {
                    for &l in leaders.iter().filter(|&&l| l != cx.rank) {
                        cx.send(b, l, &[])?;
                    }
                    for &l in leaders.iter().filter(|&&l| l != cx.rank) {
                        cx.recv_into(l, &mut [])?;
                    }
                    Ok(())
                })?;
            }
            match s {
                Some(s) => shm::barrier(&mut scx(s, cx, 2)),
                None => Ok(()),
            }
        }
    }
}

/// All-gather of per-rank blocks.
pub(super) fn all_gather(
    route: &Route,
    cx: &Ctx<'_>,
    input: BufRef<'_>,
    output: BufMut<'_>,
    counts: &[usize],
) -> Result<()> {
    match route {
        Route::Shm(s) => {
            if use_cma(s, counts.iter().sum::<usize>() * input.elem_size(), true) {
                shm::cma::gather(&mut scx(s, cx, CMA_PART), input, Some(output), counts, None)
            } else {
                shm::gather(&mut scx(s, cx, 0), input, Some(output), counts, None)
            }
        }
        _ => algo::all_gather(cx, input, output, counts),
    }
}

/// Reduce-scatter.
pub(super) fn reduce_scatter(
    route: &Route,
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    input: BufRef<'_>,
    output: BufMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    match route {
        Route::Shm(s) => {
            if use_cma(s, input.len() * input.elem_size(), false) {
                shm::cma::reduce_scatter(&mut scx(s, cx, CMA_PART), sc, input, output, op)
            } else {
                shm::reduce_scatter(&mut scx(s, cx, 0), input, output, op)
            }
        }
        _ => algo::reduce_scatter(cx, sc, input, output, op),
    }
}

/// Gather to `root`.
pub(super) fn gather(
    route: &Route,
    cx: &Ctx<'_>,
    input: BufRef<'_>,
    output: Option<BufMut<'_>>,
    counts: &[usize],
    root: usize,
) -> Result<()> {
    match route {
        Route::Shm(s) => {
            let root = Some(root_local(s, root));
            if use_cma(s, counts.iter().sum::<usize>() * input.elem_size(), true) {
                shm::cma::gather(&mut scx(s, cx, CMA_PART), input, output, counts, root)
            } else {
                shm::gather(&mut scx(s, cx, 0), input, output, counts, root)
            }
        }
        _ => algo::gather(cx, input, output, counts, root),
    }
}

/// Scatter from `root`.
pub(super) fn scatter(
    route: &Route,
    cx: &Ctx<'_>,
    input: Option<BufRef<'_>>,
    output: BufMut<'_>,
    counts: &[usize],
    root: usize,
) -> Result<()> {
    match route {
        Route::Shm(s) => shm::scatter(
            &mut scx(s, cx, 0),
            input,
            output,
            counts,
            root_local(s, root),
        ),
        _ => algo::scatter(cx, input, output, counts, root),
    }
}

/// All-to-all.
pub(super) fn all_to_all(
    route: &Route,
    cx: &Ctx<'_>,
    input: BufRef<'_>,
    send_counts: &[usize],
    output: BufMut<'_>,
    recv_counts: &[usize],
) -> Result<()> {
    match route {
        Route::Shm(s) => {
            shm::all_to_all(&mut scx(s, cx, 0), input, send_counts, output, recv_counts)
        }
        _ => algo::all_to_all(cx, input, send_counts, output, recv_counts),
    }
}
