//! [`NcclBackend`]: the collective contract over an NCCL communicator, for CUDA tensors on
//! this rank's GPU. Collectives NCCL has map one to one; the list forms and all-to-all are NCCL
//! groups of broadcasts, reduces, sends and receives (copies to self are device copies).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cudarc::driver::CudaStream;
use tensorplay_collectives::backend::{Backend, BackendContext};
use tensorplay_collectives::{Error, ReduceOp, Result};
use tensorplay_core::{DType, Device, Tensor};

use crate::comm::{Communicator, unique_id};
use crate::device::{Dev, bad, dev, device_for, nccl_op};
use crate::ffi::{self, NcclResult, SUCCESS, UniqueId};

/// The `"nccl"` backend of one group on this rank's GPU.
pub struct NcclBackend {
    comm: Communicator,
    device: Device,
    rank: usize,
    size: usize,
    sent: AtomicU64,
}

impl NcclBackend {
    /// Creates the communicator of `ctx.rank` of `ctx.size` on `cuda:ctx.local_rank`,
    /// exchanging the unique id through `ctx.store`.
    ///
    /// # Errors
    /// No CUDA driver, fewer GPUs than `local_rank + 1`, no NCCL library (naming where it
    /// looked), an NCCL failure, or ranks that do not join within `ctx.timeout`
    /// ([`Error::Timeout`]).
    pub fn new(ctx: &BackendContext) -> Result<NcclBackend> {
        if !tensorplay_core::cuda::is_driver_present() {
            return Err(bad(
                "the CUDA driver library (libcuda.so) was not found on this machine; use the \"cpu\" backend",
            ));
        }
        let ordinal = device_for(
            ctx.rank,
            ctx.local_rank,
            tensorplay_core::cuda::device_count(),
        )?;
        let nccl = ffi::nccl().map_err(bad)?;
        let cuda = tensorplay_core::cuda::context(ordinal)?;
        cuda.bind_to_thread()
            .map_err(|e| bad(format!("could not bind cuda:{ordinal}: {e:?}")))?;
        let id = if ctx.rank == 0 {
            let id = unique_id(nccl)?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            ctx.store.set("unique_id", &bytes)?;
            id
        } else {
            let bytes = ctx.store.get("unique_id")?;
            let arr: [u8; 128] = bytes.as_slice().try_into().map_err(|_| {
                Error::Store(format!(
                    "the NCCL unique id has {} bytes, expected 128",
                    bytes.len()
                ))
            })?;
            UniqueId {
                internal: arr.map(|b| b as std::ffi::c_char),
            }
        };
        let comm = Communicator::init(nccl, cuda, id, ctx.rank, ctx.size, ctx.timeout)?;
        Ok(NcclBackend {
            comm,
            device: Device::Cuda(ordinal),
            rank: ctx.rank,
            size: ctx.size,
            sent: AtomicU64::new(0),
        })
    }

    /// The version of the NCCL library in use and where it was loaded from.
    pub fn library(&self) -> String {
        format!(
            "NCCL {} ({})",
            self.comm.nccl().version(),
            self.comm.nccl().path
        )
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.comm.stream()
    }

    fn dev(&self, t: &Tensor) -> Result<Dev> {
        dev(t, self.stream())
    }

    fn devs(&self, ts: &[Tensor]) -> Result<Vec<Dev>> {
        ts.iter().map(|t| self.dev(t)).collect()
    }

    fn count(&self, bytes: usize) {
        self.sent.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Group calls: each closure result that is not success stops the enqueueing.
    fn group(
        &self,
        call: &str,
        timeout: Duration,
        f: impl FnOnce(&Communicator) -> NcclResult,
    ) -> Result<()> {
        self.comm.run(call, timeout, true, f)
    }

    fn single(
        &self,
        call: &str,
        timeout: Duration,
        f: impl FnOnce(&Communicator) -> NcclResult,
    ) -> Result<()> {
        self.comm.run(call, timeout, false, f)
    }
}

/// Runs `f` for each item until one fails; the first failure.
fn each<T>(items: impl IntoIterator<Item = T>, mut f: impl FnMut(T) -> NcclResult) -> NcclResult {
    for i in items {
        let r = f(i);
        if r != SUCCESS {
            return r;
        }
    }
    SUCCESS
}

impl Backend for NcclBackend {
    fn name(&self) -> &str {
        "nccl"
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn device(&self) -> Device {
        self.device
    }
    fn dtypes(&self) -> &'static [DType] {
        &[DType::F32, DType::F64, DType::I64, DType::Bool]
    }
    fn check_op(&self, op: ReduceOp, dt: DType) -> std::result::Result<(), String> {
        match op {
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => Err(
                "Sum, Product, Min, Max or Avg (NCCL has no bitwise reductions; use the cpu backend)".into(),
            ),
            ReduceOp::Avg if !dt.is_float() => {
                Err("Sum, Product, Min or Max for integer and bool tensors".into())
            }
            _ => Ok(()),
        }
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp, timeout: Duration) -> Result<()> {
        let (d, o) = (self.dev(t)?, nccl_op(op, t.dtype())?);
        self.single("all_reduce", timeout, |c| c.all_reduce(d, o))?;
        self.count(d.bytes);
        Ok(())
    }

    fn broadcast(&self, t: &Tensor, root: usize, timeout: Duration) -> Result<()> {
        let d = self.dev(t)?;
        self.single("broadcast", timeout, |c| c.broadcast(d, d, root))?;
        self.count(if self.rank == root { d.bytes } else { 0 });
        Ok(())
    }

    fn reduce(&self, t: &Tensor, op: ReduceOp, root: usize, timeout: Duration) -> Result<()> {
        let (d, o) = (self.dev(t)?, nccl_op(op, t.dtype())?);
        self.single("reduce", timeout, |c| c.reduce(d, d, o, root))?;
        self.count(d.bytes);
        Ok(())
    }

    fn all_gather(&self, outputs: &[Tensor], input: &Tensor, timeout: Duration) -> Result<()> {
        let (i, outs) = (self.dev(input)?, self.devs(outputs)?);
        let me = self.rank;
        // one broadcast per rank, rooted there, into that rank's output block
        self.group("all_gather", timeout, |c| {
            each(outs.iter().enumerate(), |(r, &o)| {
                c.broadcast(if r == me { i } else { o }, o, r)
            })
        })?;
        self.count(i.bytes);
        Ok(())
    }

    fn all_gather_into_tensor(
        &self,
        output: &Tensor,
        input: &Tensor,
        timeout: Duration,
    ) -> Result<()> {
        let (i, o) = (self.dev(input)?, self.dev(output)?);
        self.single("all_gather_into_tensor", timeout, |c| c.all_gather(i, o))?;
        self.count(i.bytes);
        Ok(())
    }

    fn reduce_scatter(
        &self,
        output: &Tensor,
        inputs: &[Tensor],
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        let (o, ins, op) = (
            self.dev(output)?,
            self.devs(inputs)?,
            nccl_op(op, output.dtype())?,
        );
        let me = self.rank;
        // one reduce per rank, rooted there; the receive buffer is used on the root only
        self.group("reduce_scatter", timeout, |c| {
            each(ins.iter().enumerate(), |(r, &i)| {
                c.reduce(i, if r == me { o } else { i }, op, r)
            })
        })?;
        self.count(ins.iter().map(|d| d.bytes).sum());
        Ok(())
    }

    fn reduce_scatter_tensor(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        let (o, i, op) = (
            self.dev(output)?,
            self.dev(input)?,
            nccl_op(op, output.dtype())?,
        );
        self.single("reduce_scatter_tensor", timeout, |c| {
            c.reduce_scatter(i, o, op)
        })?;
        self.count(i.bytes);
        Ok(())
    }

    fn gather(
        &self,
        input: &Tensor,
        outputs: Option<&[Tensor]>,
        _counts: &[usize],
        root: usize,
        timeout: Duration,
    ) -> Result<()> {
        let i = self.dev(input)?;
        let outs = outputs.map(|o| self.devs(o)).transpose()?;
        let me = self.rank;
        self.group("gather", timeout, |c| match &outs {
            Some(outs) => each(outs.iter().enumerate(), |(r, &o)| {
                if r == me { c.copy(o, i) } else { c.recv(o, r) }
            }),
            None => c.send(i, root),
        })?;
        self.count(if me == root { 0 } else { i.bytes });
        Ok(())
    }

    fn scatter(
        &self,
        inputs: Option<&[Tensor]>,
        output: &Tensor,
        _counts: &[usize],
        root: usize,
        timeout: Duration,
    ) -> Result<()> {
        let o = self.dev(output)?;
        let ins = inputs.map(|i| self.devs(i)).transpose()?;
        let me = self.rank;
        self.group("scatter", timeout, |c| match &ins {
            Some(ins) => each(ins.iter().enumerate(), |(r, &i)| {
                if r == me { c.copy(o, i) } else { c.send(i, r) }
            }),
            None => c.recv(o, root),
        })?;
        self.count(ins.map_or(0, |i| i.iter().map(|d| d.bytes).sum()));
        Ok(())
    }

    fn all_to_all(&self, outputs: &[Tensor], inputs: &[Tensor], timeout: Duration) -> Result<()> {
        let (outs, ins) = (self.devs(outputs)?, self.devs(inputs)?);
        self.exchange("all_to_all", &outs, &ins, timeout)
    }

    fn all_to_all_single(
        &self,
        output: &Tensor,
        input: &Tensor,
        send_counts: &[usize],
        recv_counts: &[usize],
        timeout: Duration,
    ) -> Result<()> {
        let (o, i) = (self.dev(output)?, self.dev(input)?);
        self.exchange(
            "all_to_all_single",
            &o.blocks(recv_counts),
            &i.blocks(send_counts),
            timeout,
        )
    }

    fn send(&self, t: &Tensor, dst: usize, _tag: u64, timeout: Duration) -> Result<()> {
        let d = self.dev(t)?;
        self.single("send", timeout, |c| c.send(d, dst))?;
        self.count(d.bytes);
        Ok(())
    }

    fn recv(&self, t: &Tensor, src: usize, _tag: u64, timeout: Duration) -> Result<()> {
        let d = self.dev(t)?;
        self.single("recv", timeout, |c| c.recv(d, src))
    }

    fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
    fn transport(&self) -> &'static str {
        "nccl"
    }
}

impl NcclBackend {
    /// Block `p` of `ins` to rank `p` and block `p` of `outs` from rank `p`, in one NCCL group
    /// (a device copy for this rank's own block).
    fn exchange(&self, call: &str, outs: &[Dev], ins: &[Dev], timeout: Duration) -> Result<()> {
        let me = self.rank;
        self.group(call, timeout, |c| {
            each(0..self.size, |p| {
                let (o, i) = (outs[p], ins[p]);
                if p == me {
                    return c.copy(o, i);
                }
                let r = if i.count > 0 { c.send(i, p) } else { SUCCESS };
                if r == SUCCESS && o.count > 0 {
                    c.recv(o, p)
                } else {
                    r
                }
            })
        })?;
        self.count(
            ins.iter()
                .enumerate()
                .filter(|(p, _)| *p != me)
                .map(|(_, d)| d.bytes)
                .sum(),
        );
        Ok(())
    }
}
