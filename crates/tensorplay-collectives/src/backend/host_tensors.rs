//! [`HostTensors`]: any [`HostBackend`] as a [`Backend`] for CPU tensors (the `"cpu"` backend
//! is a `HostTensors` over the group's control channel).

use std::sync::Arc;
use std::time::Duration;

use tensorplay_core::{BufElement, DType, Device, Tensor};

use super::{Backend, BufRef, HostBackend};
use crate::{Error, ReduceOp, Result};

/// Element types a host backend moves: core's buffer elements, and how `Avg` divides them.
trait CommElem: BufElement {
    /// Divides by `n` (for `Avg`, reduced as a sum); integers are left alone.
    fn div(s: &mut [Self], n: usize);
}
impl CommElem for f32 {
    fn div(s: &mut [Self], n: usize) {
        s.iter_mut().for_each(|x| *x /= n as f32)
    }
}
impl CommElem for f64 {
    fn div(s: &mut [Self], n: usize) {
        s.iter_mut().for_each(|x| *x /= n as f64)
    }
}
impl CommElem for i64 {
    fn div(_s: &mut [Self], _n: usize) {}
}
// bfloat16 and float16: host backends divide an `Avg` themselves, in float32 before their
// one rounding (see [`HostBackend`]), so nothing is left to divide here.
impl CommElem for tensorplay_core::bf16 {
    fn div(_s: &mut [Self], _n: usize) {}
}
impl CommElem for tensorplay_core::f16 {
    fn div(_s: &mut [Self], _n: usize) {}
}

/// `$body` with `$T` bound to the element type of `$dt`; an error naming backend `$b` for a
/// dtype host buffers do not hold.
macro_rules! dispatch {
    ($b:expr, $dt:expr, $T:ident => $body:expr) => {
        tensorplay_core::with_numeric_dtype!($dt, $T => $body, d => Err(Error::Backend {
            backend: $b.name.to_string(),
            detail: format!("{d} tensors are not supported; use a numeric dtype")
                .into(),
        }))
    };
}

/// Runs `f` on the elements of the contiguous tensor `t`.
fn read<T: CommElem, R>(t: &Tensor, f: impl FnOnce(BufRef<'_>) -> Result<R>) -> Result<R> {
    let r = range(t)?;
    t.with_cpu_data(|s: &[T], _| f(T::buf(&s[r])))?
}

/// Runs `f` on the elements of the contiguous tensor `t`, mutably.
fn write<T: CommElem, R>(t: &Tensor, f: impl FnOnce(&mut [T]) -> Result<R>) -> Result<R> {
    let r = range(t)?;
    t.with_cpu_data_mut(|s: &mut [T], _| f(&mut s[r]))?
}

fn range(t: &Tensor) -> Result<std::ops::Range<usize>> {
    if t.numel() == 0 {
        return Ok(0..0);
    }
    t.layout().contiguous_range().ok_or_else(|| Error::Backend {
        backend: "cpu".into(),
        detail: "a strided tensor reached the backend (the layer above stages views)".into(),
    })
}

/// Copies of the contiguous tensors `ts`, concatenated.
fn concat<T: CommElem>(ts: &[Tensor]) -> Result<Vec<T>> {
    let mut v = Vec::with_capacity(ts.iter().map(Tensor::numel).sum());
    for t in ts {
        let r = range(t)?;
        t.with_cpu_data(|s: &[T], _| v.extend_from_slice(&s[r]))?;
    }
    Ok(v)
}

/// Writes consecutive blocks of `flat` into `ts`.
fn split<T: CommElem>(flat: &[T], ts: &[Tensor]) -> Result<()> {
    let mut off = 0;
    for t in ts {
        let n = t.numel();
        write::<T, ()>(t, |d| {
            d.copy_from_slice(&flat[off..off + n]);
            Ok(())
        })?;
        off += n;
    }
    Ok(())
}

/// A [`HostBackend`] moving CPU tensors: the tensors' host memory is handed to it directly
/// (no copy for in-place collectives; list collectives go through one flat buffer).
pub struct HostTensors {
    name: &'static str,
    host: Arc<dyn HostBackend>,
}

impl HostTensors {
    /// `host` as a backend named `name` for CPU tensors.
    pub fn new(name: &'static str, host: Arc<dyn HostBackend>) -> HostTensors {
        HostTensors { name, host }
    }
}

impl Backend for HostTensors {
    fn name(&self) -> &str {
        self.name
    }
    fn rank(&self) -> usize {
        self.host.rank()
    }
    fn size(&self) -> usize {
        self.host.size()
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn dtypes(&self) -> &'static [DType] {
        &[DType::F32, DType::F64, DType::I64, DType::BF16, DType::F16]
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp, timeout: Duration) -> Result<()> {
        let n = self.size();
        dispatch!(self, t.dtype(), T => write::<T, ()>(t, |s| {
            self.host.all_reduce(T::buf_mut(s), op, timeout)?;
            if op == ReduceOp::Avg {
                T::div(s, n);
            }
            Ok(())
        }))
    }
    fn broadcast(&self, t: &Tensor, root: usize, timeout: Duration) -> Result<()> {
        dispatch!(self, t.dtype(), T => write::<T, ()>(t, |s| self.host.broadcast(T::buf_mut(s), root, timeout)))
    }
    fn reduce(&self, t: &Tensor, op: ReduceOp, root: usize, timeout: Duration) -> Result<()> {
        let (n, me) = (self.size(), self.rank());
        dispatch!(self, t.dtype(), T => write::<T, ()>(t, |s| {
            self.host.reduce(T::buf_mut(s), op, root, timeout)?;
            if op == ReduceOp::Avg && me == root {
                T::div(s, n);
            }
            Ok(())
        }))
    }
    fn all_gather(&self, outputs: &[Tensor], input: &Tensor, timeout: Duration) -> Result<()> {
        let counts: Vec<usize> = outputs.iter().map(Tensor::numel).collect();
        dispatch!(self, input.dtype(), T => {
            let mut flat = vec![T::default(); counts.iter().sum()];
            read::<T, ()>(input, |inp| self.host.all_gather(inp, T::buf_mut(&mut flat), &counts, timeout))?;
            split(&flat, outputs)
        })
    }
    fn all_gather_into_tensor(
        &self,
        output: &Tensor,
        input: &Tensor,
        timeout: Duration,
    ) -> Result<()> {
        let counts = vec![input.numel(); self.size()];
        dispatch!(self, input.dtype(), T => write::<T, ()>(output, |out| {
            read::<T, ()>(input, |inp| self.host.all_gather(inp, T::buf_mut(out), &counts, timeout))
        }))
    }
    fn reduce_scatter(
        &self,
        output: &Tensor,
        inputs: &[Tensor],
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        dispatch!(self, output.dtype(), T => {
            let flat = concat::<T>(inputs)?;
            self.rs(output, T::buf(&flat), op, timeout, T::div)
        })
    }
    fn reduce_scatter_tensor(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        dispatch!(self, output.dtype(), T => read::<T, ()>(input, |inp| self.rs(output, inp, op, timeout, T::div)))
    }
    fn gather(
        &self,
        input: &Tensor,
        outputs: Option<&[Tensor]>,
        counts: &[usize],
        root: usize,
        timeout: Duration,
    ) -> Result<()> {
        dispatch!(self, input.dtype(), T => match outputs {
            Some(outs) => {
                let mut flat = vec![T::default(); counts.iter().sum()];
                read::<T, ()>(input, |inp| self.host.gather(inp, Some(T::buf_mut(&mut flat)), counts, root, timeout))?;
                split(&flat, outs)
            }
            None => read::<T, ()>(input, |inp| self.host.gather(inp, None, counts, root, timeout)),
        })
    }
    fn scatter(
        &self,
        inputs: Option<&[Tensor]>,
        output: &Tensor,
        counts: &[usize],
        root: usize,
        timeout: Duration,
    ) -> Result<()> {
        dispatch!(self, output.dtype(), T => {
            let flat = inputs.map(concat::<T>).transpose()?;
            write::<T, ()>(output, |out| {
                self.host.scatter(flat.as_deref().map(T::buf), T::buf_mut(out), counts, root, timeout)
            })
        })
    }
    fn all_to_all(&self, outputs: &[Tensor], inputs: &[Tensor], timeout: Duration) -> Result<()> {
        let send: Vec<usize> = inputs.iter().map(Tensor::numel).collect();
        let recv: Vec<usize> = outputs.iter().map(Tensor::numel).collect();
        dispatch!(self, outputs.first().map_or(DType::F32, Tensor::dtype), T => {
            let flat = concat::<T>(inputs)?;
            let mut out = vec![T::default(); recv.iter().sum()];
            self.host.all_to_all(T::buf(&flat), &send, T::buf_mut(&mut out), &recv, timeout)?;
            split(&out, outputs)
        })
    }
    fn all_to_all_single(
        &self,
        output: &Tensor,
        input: &Tensor,
        send_counts: &[usize],
        recv_counts: &[usize],
        timeout: Duration,
    ) -> Result<()> {
        dispatch!(self, input.dtype(), T => write::<T, ()>(output, |out| {
            read::<T, ()>(input, |inp| self.host.all_to_all(inp, send_counts, T::buf_mut(out), recv_counts, timeout))
        }))
    }
    fn send(&self, t: &Tensor, dst: usize, tag: u64, timeout: Duration) -> Result<()> {
        dispatch!(self, t.dtype(), T => read::<T, ()>(t, |b| self.host.send(b, dst, tag, timeout)))
    }
    fn recv(&self, t: &Tensor, src: usize, tag: u64, timeout: Duration) -> Result<()> {
        dispatch!(self, t.dtype(), T => write::<T, ()>(t, |s| self.host.recv(T::buf_mut(s), src, tag, timeout)))
    }
    fn bytes_sent(&self) -> u64 {
        self.host.bytes_sent()
    }
    fn transport(&self) -> &'static str {
        self.host.transport()
    }
}

impl HostTensors {
    fn rs<T: CommElem>(
        &self,
        output: &Tensor,
        input: BufRef<'_>,
        op: ReduceOp,
        timeout: Duration,
        div: fn(&mut [T], usize),
    ) -> Result<()> {
        let n = self.size();
        write::<T, ()>(output, |out| {
            self.host
                .reduce_scatter(input, T::buf_mut(out), op, timeout)?;
            if op == ReduceOp::Avg {
                div(out, n);
            }
            Ok(())
        })
    }
}
