//! The `"cpu"` backend: host buffers over TCP between processes (PyTorch's gloo).
//!
//! [`CpuBackend::new`] builds a full mesh of TCP connections between the ranks of a group,
//! rendezvousing through a [`Store`]: every rank listens on an ephemeral port of
//! [`CpuOptions::bind_host`], publishes the address under `addr/<rank>`, connects to every lower
//! rank and accepts every higher one (with a handshake naming both ends). Each connection has a
//! writer thread for large messages, so that two ranks can send to each other at the same time
//! without deadlock; small messages are written directly by the calling thread.
//!
//! Every call waits at most its `timeout` for progress from any peer; a peer that closes its
//! connection gives [`Error::PeerFailed`] naming it. After any error the backend shuts its
//! connections down (so that peers fail fast too) and every later call fails.
//!
//! Point-to-point calls lock only their direction of one connection: an `isend` and an
//! `irecv` in flight at once proceed independently. A collective waits until the
//! point-to-point calls in flight on this rank have finished (within its timeout), so wait for
//! them before the next collective, as with gloo.
//!
//! Between ranks of one host the collectives go through shared memory instead (the `shm`
//! module: co-location proved by mapping each other's segments, one-shot and two-shot
//! algorithms, futex waits); the TCP mesh stays up as the liveness channel and for
//! point-to-point calls. Groups spanning several hosts are hierarchical where it pays (the
//! `route` module). `TENSORPLAY_SHM=0` turns shared memory off.
//!
//! The TCP algorithms and their thresholds are described in the `algo` module:
//! latency-optimal direct exchanges up to 64 KiB, chunked and pipelined rings (or chains)
//! above.

mod algo;
mod buf;
mod conn;
mod route;
mod shm;
mod tcp16;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tensorplay_core::DType;

use self::algo::Ctx;
use self::buf::{Scratch, copy, reborrow};
use self::conn::{Header, Kind, NO_REDOP, Peer};
use self::route::Route;
use super::{BufMut, BufRef, HostBackend, reduce_into};
use crate::store::Store;
use crate::{Detail, Error, Part, ReduceOp, Result, detail};

/// Options of the CPU backend.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CpuOptions {
    /// The host (IP address or name) to listen on; peers connect to the address published from
    /// it, so it must be reachable by every rank. Default `"127.0.0.1"`.
    pub bind_host: String,
}

impl Default for CpuOptions {
    fn default() -> Self {
        CpuOptions {
            bind_host: "127.0.0.1".into(),
        }
    }
}

impl CpuOptions {
    /// These options with `bind_host` set.
    pub fn with_bind_host(mut self, host: impl Into<String>) -> Self {
        self.bind_host = host.into();
        self
    }
}

/// Mutable per-backend state, locked for the duration of each call.
#[derive(Debug, Default)]
struct State {
    /// Sequence number of the next collective.
    seq: u64,
    /// The timeout the sockets are set to.
    timeout: Option<Duration>,
    /// The first error, after which the backend is unusable.
    failed: Option<Detail>,
    /// Scratch memory for receives that reduce.
    scratch: Scratch,
}

/// The `"cpu"` backend over a full TCP mesh (see the [module docs](self)).
#[derive(Debug)]
pub struct CpuBackend {
    rank: usize,
    size: usize,
    peers: Vec<Option<Peer>>,
    sent: AtomicU64,
    state: Mutex<State>,
    /// Per peer, the locks of its two directions (receive, send) for point-to-point calls.
    /// A collective holds every one of them (after `state`); a send or receive holds only the
    /// one it uses, so that an `isend` and an `irecv` in flight at once never wait for each
    /// other.
    p2p: Vec<(Mutex<()>, Mutex<()>)>,
    /// The transport of collectives (shared memory, TCP or both).
    route: Route,
}

fn redop_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Product => 1,
        ReduceOp::Min => 2,
        ReduceOp::Max => 3,
        ReduceOp::Avg => 4,
        ReduceOp::BAnd => 5,
        ReduceOp::BOr => 6,
        ReduceOp::BXor => 7,
    }
}

/// Checks that `op` applies to `dtype` (the same check as [`reduce_into`], on empty buffers).
fn check_op(op: ReduceOp, dtype: DType) -> Result<()> {
    let (d, s) = match dtype {
        DType::F32 => (BufMut::F32(&mut []), BufRef::F32(&[])),
        DType::F64 => (BufMut::F64(&mut []), BufRef::F64(&[])),
        DType::BF16 => (BufMut::BF16(&mut []), BufRef::BF16(&[])),
        DType::F16 => (BufMut::F16(&mut []), BufRef::F16(&[])),
        // no host buffer holds bool (the layer above refuses bool tensors): as int64
        DType::I64 | DType::Bool => (BufMut::I64(&mut []), BufRef::I64(&[])),
    };
    let mut d = d;
    reduce_into(op, &mut d, s)
}

impl CpuBackend {
    /// Connects rank `rank` of a group of `size` ranks, rendezvousing through `store` (already
    /// prefixed for the group), with default [`CpuOptions`]. Fails with [`Error::Timeout`]
    /// naming the ranks that did not join within `timeout`.
    pub fn new(
        store: Arc<dyn Store>,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<CpuBackend> {
        CpuBackend::with_options(store, rank, size, timeout, CpuOptions::default())
    }

    /// As [`CpuBackend::new`], with options.
    pub fn with_options(
        store: Arc<dyn Store>,
        rank: usize,
        size: usize,
        timeout: Duration,
        options: CpuOptions,
    ) -> Result<CpuBackend> {
        if size == 0 || rank >= size {
            return Err(Error::invalid(
                "cpu backend init",
                rank as i64,
                "rank",
                format!("a rank below the world size {size}"),
                rank,
            ));
        }
        let mut peers = Vec::with_capacity(size);
        let mut route = Route::Tcp;
        if size > 1 {
            let streams = conn::connect_mesh(&*store, rank, size, timeout, &options.bind_host)?;
            for (p, s) in streams.into_iter().enumerate() {
                peers.push(match s {
                    Some(s) => Some(Peer::new(p, rank, s)?),
                    None => None,
                });
            }
            let (hosts, shm) =
                shm::Shm::setup(&*store, &peers, rank, size, timeout, shm::enabled())?;
            route = Route::new(hosts, shm);
            tracing::debug!(rank, size, transport = route.name(), "cpu backend ready");
        }
        Ok(CpuBackend {
            rank,
            size,
            peers,
            sent: AtomicU64::new(0),
            state: Mutex::new(State::default()),
            p2p: (0..size)
                .map(|_| (Mutex::new(()), Mutex::new(())))
                .collect(),
            route,
        })
    }

    fn invalid(
        &self,
        op: &str,
        arg: &str,
        expected: impl Into<String>,
        got: impl std::fmt::Display,
    ) -> Error {
        Error::invalid(op, self.rank as i64, arg, expected, got)
    }

    /// Whether a reduction of `dtype` takes the 16-bit TCP paths (`tcp16`): bfloat16 and
    /// float16 where the group is not all on one host's shared memory (which reduces them in
    /// float32 itself, rounding once).
    fn tcp16(&self, dtype: DType) -> bool {
        super::wide::is_16bit(dtype) && !matches!(self.route, Route::Shm(_))
    }

    fn check_root(&self, op: &str, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(self.invalid(op, "root", format!("a rank below {}", self.size), root));
        }
        Ok(())
    }

    fn check_counts(&self, op: &str, arg: &str, counts: &[usize], total: usize) -> Result<()> {
        if counts.len() != self.size {
            return Err(self.invalid(op, arg, format!("{} counts", self.size), counts.len()));
        }
        let sum: usize = counts.iter().sum();
        if sum != total {
            return Err(self.invalid(
                op,
                arg,
                format!("counts summing to the buffer length {total}"),
                format!("{counts:?} (sum {sum})"),
            ));
        }
        Ok(())
    }

    fn check_len(&self, op: &str, arg: &str, expected: usize, got: usize) -> Result<()> {
        if expected != got {
            return Err(self.invalid(op, arg, format!("{expected} elements"), got));
        }
        Ok(())
    }

    fn check_dtypes(&self, op: &str, a: DType, b: DType) -> Result<()> {
        if a != b {
            return Err(self.invalid(op, "output", format!("dtype {a} (as the input)"), b));
        }
        Ok(())
    }

    /// Checks that the backend has not failed and sets the socket timeouts.
    fn prepare(&self, st: &mut State, kind: Kind, timeout: Duration) -> Result<()> {
        if let Some(e) = &st.failed {
            return Err(Error::Backend {
                backend: "cpu".into(),
                detail: detail!(
                    "rank ",
                    Part::Rank(self.rank),
                    format!(
                        ": {} after an earlier error shut this group down: ",
                        kind.name()
                    )
                )
                .join(e.clone()),
            });
        }
        if st.timeout != Some(timeout) {
            for p in self.peers.iter().flatten() {
                p.set_timeout(timeout)?;
            }
            st.timeout = Some(timeout);
        }
        Ok(())
    }

    /// After an error: shuts every connection down (so that peers fail fast) and marks the
    /// backend failed.
    fn fail(&self, st: &mut State, e: &Error) {
        if let Some(shm) = self.route.shm() {
            shm.note_failure(e);
        }
        self.peers.iter().flatten().for_each(Peer::shutdown);
        st.failed = Some(e.message());
    }

    fn ctx(
        &self,
        kind: Kind,
        sig: (DType, u8, usize, usize),
        seq: u64,
        timeout: Duration,
    ) -> Ctx<'_> {
        Ctx {
            rank: self.rank,
            size: self.size,
            peers: &self.peers,
            sent: &self.sent,
            timeout,
            sig: Header {
                kind,
                dtype: sig.0.code(),
                redop: sig.1,
                seq,
                count: sig.2 as u64,
                aux: sig.3 as u64,
                len: 0,
            },
        }
    }

    /// Runs one collective: locks the state and every point-to-point direction, sets the
    /// socket timeouts, and on error shuts every connection down and marks the backend failed.
    fn run(
        &self,
        kind: Kind,
        sig: (DType, u8, usize, usize),
        timeout: Duration,
        f: impl FnOnce(&Ctx<'_>, &mut Scratch) -> Result<()>,
    ) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.prepare(&mut st, kind, timeout)?;
        let _directions: Vec<_> = self
            .p2p
            .iter()
            .flat_map(|(r, w)| [r, w])
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
            .collect();
        st.seq += 1;
        let cx = self.ctx(kind, sig, st.seq, timeout);
        let r = f(&cx, &mut st.scratch);
        if let Err(e) = &r {
            self.fail(&mut st, e);
        }
        r
    }

    /// Runs one send (`sending`) to or receive from `peer`: holds the state only to check it,
    /// then only the lock of that direction, so that a send and a receive in flight at once
    /// (`isend` + `irecv` around a ring) proceed independently.
    fn run_p2p(
        &self,
        peer: usize,
        sending: bool,
        sig: (DType, u8, usize, usize),
        tag: u64,
        timeout: Duration,
        f: impl FnOnce(&Ctx<'_>) -> Result<()>,
    ) -> Result<()> {
        {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            self.prepare(&mut st, Kind::P2p, timeout)?;
        }
        let (r, w) = &self.p2p[peer];
        let _direction = if sending { w } else { r }
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let r = f(&self.ctx(Kind::P2p, sig, tag, timeout));
        if let Err(e) = &r {
            self.fail(&mut self.state.lock().unwrap_or_else(|e| e.into_inner()), e);
        }
        r
    }
}

impl HostBackend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, data: BufMut<'_>, op: ReduceOp, timeout: Duration) -> Result<()> {
        check_op(op, data.dtype())?;
        if self.size == 1 {
            return Ok(());
        }
        let sig = (data.dtype(), redop_code(op), data.len(), 0);
        self.run(Kind::AllReduce, sig, timeout, |cx, sc| {
            if self.tcp16(data.dtype()) {
                tcp16::all_reduce(&self.route, cx, sc, data, op)
            } else {
                route::all_reduce(&self.route, cx, sc, data, op)
            }
        })
    }

    fn broadcast(&self, data: BufMut<'_>, root: usize, timeout: Duration) -> Result<()> {
        self.check_root("broadcast", root)?;
        if self.size == 1 {
            return Ok(());
        }
        let sig = (data.dtype(), NO_REDOP, data.len(), root);
        self.run(Kind::Broadcast, sig, timeout, |cx, _| {
            route::broadcast(&self.route, cx, data, root)
        })
    }

    fn reduce(&self, data: BufMut<'_>, op: ReduceOp, root: usize, timeout: Duration) -> Result<()> {
        self.check_root("reduce", root)?;
        check_op(op, data.dtype())?;
        if self.size == 1 {
            return Ok(());
        }
        let sig = (data.dtype(), redop_code(op), data.len(), root);
        self.run(Kind::Reduce, sig, timeout, |cx, sc| {
            if self.tcp16(data.dtype()) {
                tcp16::reduce(&self.route, cx, sc, data, op, root)
            } else {
                route::reduce(&self.route, cx, sc, data, op, root)
            }
        })
    }

    fn all_gather(
        &self,
        input: BufRef<'_>,
        mut output: BufMut<'_>,
        counts: &[usize],
        timeout: Duration,
    ) -> Result<()> {
        const OP: &str = "all_gather";
        self.check_dtypes(OP, input.dtype(), output.dtype())?;
        self.check_counts(OP, "counts", counts, output.len())?;
        self.check_len(OP, "input", counts[self.rank], input.len())?;
        if self.size == 1 {
            return copy(OP, self.rank, &mut output, input);
        }
        let sig = (input.dtype(), NO_REDOP, output.len(), 0);
        self.run(Kind::AllGather, sig, timeout, |cx, _| {
            route::all_gather(&self.route, cx, input, output, counts)
        })
    }

    fn reduce_scatter(
        &self,
        input: BufRef<'_>,
        mut output: BufMut<'_>,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter";
        self.check_dtypes(OP, input.dtype(), output.dtype())?;
        check_op(op, input.dtype())?;
        self.check_len(OP, "input", self.size * output.len(), input.len())?;
        if self.size == 1 {
            return copy(OP, self.rank, &mut output, input);
        }
        let sig = (input.dtype(), redop_code(op), output.len(), 0);
        self.run(Kind::ReduceScatter, sig, timeout, |cx, sc| {
            if self.tcp16(input.dtype()) {
                tcp16::reduce_scatter(&self.route, cx, sc, input, output, op)
            } else {
                route::reduce_scatter(&self.route, cx, sc, input, output, op)
            }
        })
    }

    fn gather(
        &self,
        input: BufRef<'_>,
        mut output: Option<BufMut<'_>>,
        counts: &[usize],
        root: usize,
        timeout: Duration,
    ) -> Result<()> {
        const OP: &str = "gather";
        self.check_root(OP, root)?;
        if counts.len() != self.size {
            return Err(self.invalid(OP, "counts", format!("{} counts", self.size), counts.len()));
        }
        let total: usize = counts.iter().sum();
        self.check_len(OP, "input", counts[self.rank], input.len())?;
        match (&output, self.rank == root) {
            (Some(out), true) => {
                self.check_dtypes(OP, input.dtype(), out.dtype())?;
                self.check_len(OP, "output", total, out.len())?;
            }
            (None, false) => {}
            (o, _) => {
                return Err(self.invalid(
                    OP,
                    "output",
                    "an output buffer exactly on the root",
                    if o.is_some() { "Some" } else { "None" },
                ));
            }
        }
        if self.size == 1 {
            return match output.as_mut() {
                Some(out) => copy(OP, self.rank, out, input),
                None => Ok(()),
            };
        }
        let sig = (input.dtype(), NO_REDOP, total, root);
        self.run(Kind::Gather, sig, timeout, |cx, _| {
            route::gather(&self.route, cx, input, output, counts, root)
        })
    }

    fn scatter(
        &self,
        input: Option<BufRef<'_>>,
        mut output: BufMut<'_>,
        counts: &[usize],
        root: usize,
        timeout: Duration,
    ) -> Result<()> {
        const OP: &str = "scatter";
        self.check_root(OP, root)?;
        if counts.len() != self.size {
            return Err(self.invalid(OP, "counts", format!("{} counts", self.size), counts.len()));
        }
        let total: usize = counts.iter().sum();
        self.check_len(OP, "output", counts[self.rank], output.len())?;
        match (&input, self.rank == root) {
            (Some(inp), true) => {
                self.check_dtypes(OP, inp.dtype(), output.dtype())?;
                self.check_len(OP, "input", total, inp.len())?;
            }
            (None, false) => {}
            (i, _) => {
                return Err(self.invalid(
                    OP,
                    "input",
                    "an input buffer exactly on the root",
                    if i.is_some() { "Some" } else { "None" },
                ));
            }
        }
        if self.size == 1 {
            return match input {
                Some(inp) => copy(OP, self.rank, &mut output, inp),
                None => Ok(()),
            };
        }
        let sig = (output.dtype(), NO_REDOP, total, root);
        self.run(Kind::Scatter, sig, timeout, |cx, _| {
            route::scatter(&self.route, cx, input, output, counts, root)
        })
    }

    fn all_to_all(
        &self,
        input: BufRef<'_>,
        send_counts: &[usize],
        mut output: BufMut<'_>,
        recv_counts: &[usize],
        timeout: Duration,
    ) -> Result<()> {
        const OP: &str = "all_to_all";
        self.check_dtypes(OP, input.dtype(), output.dtype())?;
        self.check_counts(OP, "send_counts", send_counts, input.len())?;
        self.check_counts(OP, "recv_counts", recv_counts, output.len())?;
        if self.size == 1 {
            return copy(OP, self.rank, &mut output, input);
        }
        let sig = (input.dtype(), NO_REDOP, 0, 0);
        self.run(Kind::AllToAll, sig, timeout, |cx, _| {
            route::all_to_all(&self.route, cx, input, send_counts, output, recv_counts)
        })
    }

    fn send(&self, data: BufRef<'_>, dst: usize, tag: u64, timeout: Duration) -> Result<()> {
        if dst >= self.size || dst == self.rank {
            return Err(self.invalid("send", "dst", "another rank of the group", dst));
        }
        let sig = (data.dtype(), NO_REDOP, data.len(), 0);
        self.run_p2p(dst, true, sig, tag, timeout, |cx| {
            let hdr = Header {
                len: data.as_bytes().len() as u64,
                ..cx.sig
            };
            let p = conn::peer_of(cx.peers, cx.rank, dst, "send")?;
            cx.sent.fetch_add(
                (conn::HDR + data.as_bytes().len()) as u64,
                Ordering::Relaxed,
            );
            p.write_now(&hdr, data.as_bytes())
                .map_err(|e| conn::io_err(&e, cx.rank, dst, "send", timeout, "sending to"))
        })
    }

    fn recv(&self, mut data: BufMut<'_>, src: usize, tag: u64, timeout: Duration) -> Result<()> {
        if src >= self.size || src == self.rank {
            return Err(self.invalid("recv", "src", "another rank of the group", src));
        }
        let sig = (data.dtype(), NO_REDOP, data.len(), 0);
        self.run_p2p(src, false, sig, tag, timeout, |cx| {
            let d = reborrow(&mut data);
            let mut d = d;
            let hdr = Header {
                len: d.as_bytes_mut().len() as u64,
                ..cx.sig
            };
            let p = conn::peer_of(cx.peers, cx.rank, src, "recv")?;
            p.read_into(&hdr, d.as_bytes_mut(), cx.rank, src, timeout)
        })
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        if self.size == 1 {
            return Ok(());
        }
        self.run(
            Kind::Barrier,
            (DType::F32, NO_REDOP, 0, 0),
            timeout,
            |cx, _| route::barrier(&self.route, cx),
        )
    }

    fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    fn transport(&self) -> &'static str {
        self.route.name()
    }
}
