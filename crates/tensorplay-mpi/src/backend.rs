//! The `"mpi"` backend: a [`HostBackend`] over one MPI communicator per group (a duplicate of
//! `MPI_COMM_WORLD` for the default group, `MPI_Comm_create_group` of the members for the
//! others). Data that is only moved travels as bytes; reductions run on MPI's own datatypes
//! (float32, float64, int64), bfloat16 and float16 widened to float32 and rounded once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use mpi::collective::SystemOperation;
use mpi::datatype::{Partition, PartitionMut};
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, Group, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Equivalence, Root};
use tensorplay_collectives::backend::{BackendContext, BufMut, BufRef, HostBackend};
use tensorplay_collectives::{Error, ReduceOp, Result};

use crate::runtime::{Comm, runtime};
use crate::watchdog::watch_call;

/// The `"mpi"` backend of one group on this rank.
pub struct MpiBackend {
    comm: Comm,
    rank: usize,
    size: usize,
    /// The group's global ranks, for the watchdog's report.
    ranks: Vec<usize>,
    sent: AtomicU64,
}

impl std::fmt::Debug for MpiBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiBackend")
            .field("rank", &self.rank)
            .field("ranks", &self.ranks)
            .finish_non_exhaustive()
    }
}

fn backend_error(detail: String) -> Error {
    Error::Backend {
        backend: "mpi".into(),
        detail: detail.into(),
    }
}

/// MPI's element count for `n`, refused beyond `i32::MAX` (MPI's `int` counts).
fn count(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| {
        backend_error(format!(
            "{what}: {n} bytes or elements; one MPI call moves at most {} (split the tensor)",
            i32::MAX
        ))
    })
}

/// Counts and displacements (prefix sums) in bytes for blocks of `counts` elements of
/// `elem` bytes.
fn layout(counts: &[usize], elem: usize, what: &str) -> Result<(Vec<i32>, Vec<i32>)> {
    let mut c = Vec::with_capacity(counts.len());
    let mut d = Vec::with_capacity(counts.len());
    let mut at = 0usize;
    for &n in counts {
        d.push(count(at, what)?);
        c.push(count(n * elem, what)?);
        at += n * elem;
    }
    Ok((c, d))
}

fn mpi_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => SystemOperation::sum(),
        ReduceOp::Product => SystemOperation::product(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
        ReduceOp::BAnd => SystemOperation::bitwise_and(),
        ReduceOp::BOr => SystemOperation::bitwise_or(),
        ReduceOp::BXor => SystemOperation::bitwise_xor(),
    }
}

/// MPI's tag for `tag` (Open MPI's tags reach `i32::MAX`; the standard only promises 32767).
fn mpi_tag(tag: u64) -> Result<i32> {
    i32::try_from(tag).map_err(|_| {
        Error::invalid(
            "send/recv",
            -1,
            "tag",
            format!("a tag the mpi backend carries (0..={})", i32::MAX),
            tag,
        )
    })
}

/// A 16-bit float widened to float32 for MPI's reductions and rounded back once.
trait Half: Copy {
    fn widen(self) -> f32;
    fn narrow(x: f32) -> Self;
}

impl Half for half::bf16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
}

impl Half for half::f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(x: f32) -> Self {
        half::f16::from_f32(x)
    }
}

fn widen<H: Half>(d: &[H]) -> Vec<f32> {
    d.iter().map(|x| x.widen()).collect()
}

/// Rounds `w` into `d` once, after dividing by `avg` (the group size, for `Avg`).
fn narrow<H: Half>(w: &[f32], d: &mut [H], avg: Option<usize>) {
    let k = avg.map_or(1.0, |n| n as f32);
    for (o, &x) in d.iter_mut().zip(w) {
        *o = H::narrow(if avg.is_some() { x / k } else { x });
    }
}

/// Runs `$body` with `$send` a copy of `$data` and `$recv` its elements (native dtypes) or
/// a float32 buffer rounded back into them when `$write` (16-bit dtypes; `Avg` divided by
/// `$avg` first).
macro_rules! in_place {
    ($data:expr, $avg:expr, $write:expr, |$send:ident, $recv:ident| $body:expr) => {
        match $data {
            BufMut::F32(d) => {
                let $send = d.to_vec();
                let $recv = d;
                $body
            }
            BufMut::F64(d) => {
                let $send = d.to_vec();
                let $recv = d;
                $body
            }
            BufMut::I64(d) => {
                let $send = d.to_vec();
                let $recv = d;
                $body
            }
            BufMut::BF16(d) => {
                let $send = widen(d);
                let mut w = vec![0f32; d.len()];
                {
                    let $recv = &mut w[..];
                    $body
                }
                if $write {
                    narrow(&w, d, $avg);
                }
            }
            BufMut::F16(d) => {
                let $send = widen(d);
                let mut w = vec![0f32; d.len()];
                {
                    let $recv = &mut w[..];
                    $body
                }
                if $write {
                    narrow(&w, d, $avg);
                }
            }
        }
    };
}

impl MpiBackend {
    /// The backend of the group `ctx` describes: its communicator over the group's global
    /// ranks, which must be this job's MPI ranks (the job started by `mpirun`/`srun` and
    /// `init_process_group("mpi", ..)` given no rank of its own).
    ///
    /// # Errors
    /// MPI cannot be initialised ([`runtime`]); this process's MPI rank is not the group's
    /// global rank for it, or a group rank is outside MPI's world.
    pub fn new(ctx: &BackendContext) -> Result<MpiBackend> {
        let rt = runtime()?;
        let world = &rt.world.0;
        let (me, n) = (world.rank() as usize, world.size() as usize);
        let mine = ctx.ranks.get(ctx.rank).copied().unwrap_or(usize::MAX);
        if mine != me || ctx.ranks.iter().any(|&r| r >= n) {
            return Err(backend_error(format!(
                "this process is MPI rank {me} of {n}, but tensorplay gives it global rank \
                 {mine} of a group over global ranks {:?}: start the job with mpirun or \
                 srun and call init_process_group(\"mpi\", ..) without a rank (neither in \
                 its options nor in RANK), so that it takes MPI's",
                ctx.ranks
            )));
        }
        let what = format!(
            "creating the communicator of group {:?} on rank {}",
            ctx.ranks, ctx.rank
        );
        let comm = {
            let _g = watch_call(what.clone(), ctx.timeout);
            if ctx.ranks.iter().copied().eq(0..n) {
                world.duplicate()
            } else {
                let ranks: Vec<i32> = ctx.ranks.iter().map(|&r| r as i32).collect();
                world
                    .split_by_subgroup(&world.group().include(&ranks))
                    .ok_or_else(|| backend_error(format!("{what}: not a member")))?
            }
        };
        Ok(MpiBackend {
            comm: Comm(comm),
            rank: ctx.rank,
            size: ctx.size,
            ranks: ctx.ranks.clone(),
            sent: AtomicU64::new(0),
        })
    }

    /// Runs `f` on the communicator, watched by the watchdog for `timeout`.
    fn call<R>(&self, op: &str, timeout: Duration, f: impl FnOnce(&SimpleCommunicator) -> R) -> R {
        let _g = watch_call(
            format!(
                "{op} on rank {} of the group of global ranks {:?}",
                self.rank, self.ranks
            ),
            timeout,
        );
        f(&self.comm.0)
    }

    fn count_sent(&self, bytes: usize) {
        self.sent.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

impl HostBackend for MpiBackend {
    fn name(&self) -> &'static str {
        "mpi"
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, mut data: BufMut<'_>, op: ReduceOp, timeout: Duration) -> Result<()> {
        count(data.len(), "all_reduce")?;
        self.count_sent(data.as_bytes_mut().len());
        let avg = (op == ReduceOp::Avg).then_some(self.size);
        let o = mpi_op(op);
        self.call("all_reduce", timeout, |c| {
            in_place!(data, avg, true, |send, recv| c.all_reduce_into(
                &send[..],
                &mut recv[..],
                o
            ))
        });
        Ok(())
    }

    fn broadcast(&self, mut data: BufMut<'_>, root: usize, timeout: Duration) -> Result<()> {
        let bytes = data.as_bytes_mut();
        count(bytes.len(), "broadcast")?;
        if root == self.rank {
            self.count_sent(bytes.len() * (self.size - 1));
        }
        self.call("broadcast", timeout, |c| {
            c.process_at_rank(root as i32)
                .broadcast_into(&mut bytes[..])
        });
        Ok(())
    }

    fn reduce(
        &self,
        mut data: BufMut<'_>,
        op: ReduceOp,
        root: usize,
        timeout: Duration,
    ) -> Result<()> {
        count(data.len(), "reduce")?;
        self.count_sent(data.as_bytes_mut().len());
        let is_root = root == self.rank;
        let avg = (op == ReduceOp::Avg).then_some(self.size);
        let o = mpi_op(op);
        self.call("reduce", timeout, |c| {
            let p = c.process_at_rank(root as i32);
            in_place!(data, avg, is_root, |send, recv| if is_root {
                p.reduce_into_root(&send[..], &mut recv[..], o)
            } else {
                p.reduce_into(&send[..], o)
            })
        });
        Ok(())
    }

    fn all_gather(
        &self,
        input: BufRef<'_>,
        mut output: BufMut<'_>,
        counts: &[usize],
        timeout: Duration,
    ) -> Result<()> {
        let (c, d) = layout(counts, input.elem_size(), "all_gather")?;
        let send = input.as_bytes();
        self.count_sent(send.len() * (self.size - 1));
        let out = output.as_bytes_mut();
        self.call("all_gather", timeout, |comm| {
            let mut part = PartitionMut::new(&mut out[..], &c[..], &d[..]);
            comm.all_gather_varcount_into(send, &mut part)
        });
        Ok(())
    }

    fn reduce_scatter(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        count(input.len(), "reduce_scatter")?;
        self.count_sent(input.as_bytes().len());
        let avg = (op == ReduceOp::Avg).then_some(self.size);
        let o = mpi_op(op);
        let mismatch = backend_error(format!(
            "reduce_scatter: input of {} and output of {} differ in dtype",
            input.dtype(),
            output.dtype()
        ));
        self.call("reduce_scatter", timeout, |c| -> Result<()> {
            match (input, output) {
                (BufRef::F32(i), BufMut::F32(out)) => c.reduce_scatter_block_into(i, out, o),
                (BufRef::F64(i), BufMut::F64(out)) => c.reduce_scatter_block_into(i, out, o),
                (BufRef::I64(i), BufMut::I64(out)) => c.reduce_scatter_block_into(i, out, o),
                (BufRef::BF16(i), BufMut::BF16(out)) => {
                    let mut w = vec![0f32; out.len()];
                    c.reduce_scatter_block_into(&widen(i)[..], &mut w[..], o);
                    narrow(&w, out, avg);
                }
                (BufRef::F16(i), BufMut::F16(out)) => {
                    let mut w = vec![0f32; out.len()];
                    c.reduce_scatter_block_into(&widen(i)[..], &mut w[..], o);
                    narrow(&w, out, avg);
                }
                _ => return Err(mismatch),
            }
            Ok(())
        })
    }

    fn gather(
        &self,
        input: BufRef<'_>,
        output: Option<BufMut<'_>>,
        counts: &[usize],
        root: usize,
        timeout: Duration,
    ) -> Result<()> {
        let (c, d) = layout(counts, input.elem_size(), "gather")?;
        let send = input.as_bytes();
        if root != self.rank {
            self.count_sent(send.len());
        }
        self.call("gather", timeout, |comm| -> Result<()> {
            let p = comm.process_at_rank(root as i32);
            match output {
                Some(mut out) if root == self.rank => {
                    let out = out.as_bytes_mut();
                    let mut part = PartitionMut::new(&mut out[..], &c[..], &d[..]);
                    p.gather_varcount_into_root(send, &mut part);
                }
                None if root != self.rank => p.gather_varcount_into(send),
                _ => {
                    return Err(backend_error(
                        "gather: the output is given on the root, and only there".into(),
                    ));
                }
            }
            Ok(())
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
        let elem = output.as_ref().elem_size();
        let (c, d) = layout(counts, elem, "scatter")?;
        let out = output.as_bytes_mut();
        self.call("scatter", timeout, |comm| -> Result<()> {
            let p = comm.process_at_rank(root as i32);
            match input {
                Some(i) if root == self.rank => {
                    let send = i.as_bytes();
                    self.count_sent(send.len() - out.len());
                    let part = Partition::new(send, &c[..], &d[..]);
                    p.scatter_varcount_into_root(&part, &mut out[..]);
                }
                None if root != self.rank => p.scatter_varcount_into(&mut out[..]),
                _ => {
                    return Err(backend_error(
                        "scatter: the input is given on the root, and only there".into(),
                    ));
                }
            }
            Ok(())
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
        let elem = input.elem_size();
        let (sc, sd) = layout(send_counts, elem, "all_to_all")?;
        let (rc, rd) = layout(recv_counts, elem, "all_to_all")?;
        let send = input.as_bytes();
        let mine = send_counts.get(self.rank).copied().unwrap_or(0) * elem;
        self.count_sent(send.len() - mine);
        let out = output.as_bytes_mut();
        self.call("all_to_all", timeout, |comm| {
            let part = Partition::new(send, &sc[..], &sd[..]);
            let mut into = PartitionMut::new(&mut out[..], &rc[..], &rd[..]);
            comm.all_to_all_varcount_into(&part, &mut into)
        });
        Ok(())
    }

    fn send(&self, data: BufRef<'_>, dst: usize, tag: u64, timeout: Duration) -> Result<()> {
        let tag = mpi_tag(tag)?;
        let bytes = data.as_bytes();
        count(bytes.len(), "send")?;
        self.count_sent(bytes.len());
        self.call("send", timeout, |c| {
            c.process_at_rank(dst as i32).send_with_tag(bytes, tag)
        });
        Ok(())
    }

    fn recv(&self, mut data: BufMut<'_>, src: usize, tag: u64, timeout: Duration) -> Result<()> {
        let tag = mpi_tag(tag)?;
        let buf = data.as_bytes_mut();
        count(buf.len(), "recv")?;
        self.call("recv", timeout, |c| -> Result<()> {
            // probe first: a message of another size is an error, not MPI's fatal truncation
            let (msg, status) = c.process_at_rank(src as i32).matched_probe_with_tag(tag);
            let n = status.count(u8::equivalent_datatype()) as usize;
            if n == buf.len() {
                msg.matched_receive_into(&mut buf[..]);
                return Ok(());
            }
            let mut other = vec![0u8; n];
            msg.matched_receive_into(&mut other[..]);
            Err(Error::invalid(
                "recv",
                self.rank as i64,
                "tensor",
                format!("{} bytes, the size of the message from rank {src}", n),
                format!("{} bytes", buf.len()),
            ))
        })
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        self.call("barrier", timeout, |c| c.barrier());
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    fn transport(&self) -> &'static str {
        "mpi"
    }
}
