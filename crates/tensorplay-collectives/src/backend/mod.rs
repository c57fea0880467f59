//! The backend contract: what every process-group backend implements, and the registry that
//! maps a backend's name (`"cpu"`, `"nccl"`, a test double) to the factory that builds it.
//!
//! A backend moves tensors between the group-local ranks `0..size` of one group. Everything a
//! backend should not have to get right on its own is done once, above this trait, for every
//! backend (the `ops` module): resolving the group and this rank in it, refusing tensors on
//! the wrong device or of a dtype the backend lacks, the cross-rank check that every rank
//! passed agreeing dtypes, shapes, roots and ops (over the group's cpu control channel, before
//! any data moves), staging strided views and aliased inputs, running calls in issue order,
//! translating the group ranks in errors into the global ranks users know, and the barrier.
//!
//! So a backend only ever sees arguments that passed those checks on every rank: contiguous
//! tensors (possibly views at an offset into their storage: use
//! `layout().contiguous_range()`), on [`Backend::device`], of one of [`Backend::dtypes`], with
//! element counts that match across ranks, no input that shares storage with an output, and
//! `root`s that are group ranks. It must honour `timeout` (return [`Error::Timeout`] naming
//! the call rather than hang), report a dead peer as [`Error::PeerFailed`], and after an
//! error of its own transport fail every later call at once. Its errors name ranks as
//! fields in its group numbering: `rank`, `peer`, and in a [`Detail`](crate::Detail) each rank
//! as [`Part::Rank`](crate::Part::Rank) (or a list as [`Part::Ranks`](crate::Part::Ranks)),
//! never as a number inside the words: the group maps those fields to global ranks, and the
//! words are shown as written.
//!
//! A third backend is a crate: implement [`Backend`] and call [`register_backend`] before
//! `init_process_group`/`new_group` name it (PyTorch's `Backend.register_backend`). The NCCL
//! backend (crate `tensorplay-nccl`) is registered this way by the facade.
//!
//! [`Error::Timeout`]: crate::Error::Timeout
//! [`Error::PeerFailed`]: crate::Error::PeerFailed

pub mod cpu;
mod host;
mod host_tensors;
mod registry;
pub(crate) mod wide;

use std::time::Duration;

use tensorplay_core::{DType, Device, Tensor};

pub use host::{BufMut, BufRef, HostBackend, reduce_into};
pub use host_tensors::HostTensors;
pub(crate) use registry::make_backend;
pub use registry::{BackendContext, BackendFactory, register_backend, registered_backends};

use crate::{ReduceOp, Result};

/// A process-group backend over tensors (see the [module docs](self) for what the layer above
/// guarantees and what a backend must do). Calls on one backend are made one at a time, in the
/// group's issue order, except `send`/`recv`, which may run beside each other and beside a
/// collective. Every tensor argument is contiguous, on [`device`](Backend::device), of one of
/// [`dtypes`](Backend::dtypes); outputs are written in place.
pub trait Backend: Send + Sync {
    /// The name it was registered under, for errors (`"cpu"`, `"nccl"`).
    fn name(&self) -> &str;
    /// This process's rank in the group, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// The device whose tensors this backend moves on this rank (`cpu`, or `cuda:LOCAL_RANK`
    /// for NCCL).
    fn device(&self) -> Device;
    /// The dtypes it moves.
    fn dtypes(&self) -> &'static [DType] {
        &[DType::F32, DType::F64, DType::I64]
    }
    /// Whether reduction `op` applies to `dtype`; `Err` says what would (for the error the
    /// layer above raises on every rank). The default is PyTorch's: bitwise ops for integers,
    /// `Avg` for floating dtypes.
    fn check_op(&self, op: ReduceOp, dtype: DType) -> std::result::Result<(), String> {
        let ok = match op {
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => dtype == DType::I64,
            ReduceOp::Avg => dtype.is_float(),
            _ => true,
        };
        if ok {
            Ok(())
        } else if dtype.is_float() {
            Err("Sum, Product, Min, Max or Avg for floating tensors".into())
        } else {
            Err("Sum, Product, Min, Max, BAnd, BOr or BXor for int64 tensors".into())
        }
    }

    /// In-place all-reduce of `tensor` (every rank passes the same shape); `Avg` divides by
    /// the group size.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp, timeout: Duration) -> Result<()>;
    /// In-place broadcast from group rank `root`.
    fn broadcast(&self, tensor: &Tensor, root: usize, timeout: Duration) -> Result<()>;
    /// Reduces into `root`'s `tensor`; the other ranks' tensors are left unchanged.
    fn reduce(&self, tensor: &Tensor, op: ReduceOp, root: usize, timeout: Duration) -> Result<()>;
    /// Rank `r`'s `input` lands in `outputs[r]` on every rank (`outputs[r].numel()` is rank
    /// `r`'s input size, which may differ per rank).
    fn all_gather(&self, outputs: &[Tensor], input: &Tensor, timeout: Duration) -> Result<()>;
    /// Every rank's `input` (one size on all ranks) concatenated in rank order into `output`
    /// (`size * input.numel()` elements).
    fn all_gather_into_tensor(
        &self,
        output: &Tensor,
        input: &Tensor,
        timeout: Duration,
    ) -> Result<()>;
    /// `inputs[r]` reduced over ranks lands in rank `r`'s `output` (all of one shape).
    fn reduce_scatter(
        &self,
        output: &Tensor,
        inputs: &[Tensor],
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()>;
    /// `input` (`size * output.numel()` elements, blocks in rank order) reduced over ranks;
    /// block `rank` lands in `output`.
    fn reduce_scatter_tensor(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()>;
    /// Every rank's `input` lands in `outputs[r]` on `root` (`outputs` is `None` elsewhere);
    /// `counts[r]` is rank `r`'s input size, known on every rank.
    fn gather(
        &self,
        input: &Tensor,
        outputs: Option<&[Tensor]>,
        counts: &[usize],
        root: usize,
        timeout: Duration,
    ) -> Result<()>;
    /// `root`'s `inputs[r]` lands in rank `r`'s `output` (`inputs` is `None` elsewhere);
    /// `counts[r]` is rank `r`'s output size, known on every rank.
    fn scatter(
        &self,
        inputs: Option<&[Tensor]>,
        output: &Tensor,
        counts: &[usize],
        root: usize,
        timeout: Duration,
    ) -> Result<()>;
    /// `inputs[s]` goes to rank `s`, which receives it into its `outputs[r]` (sizes agree
    /// between each sender and receiver).
    fn all_to_all(&self, outputs: &[Tensor], inputs: &[Tensor], timeout: Duration) -> Result<()>;
    /// `input`'s elements `send_counts` (prefix sums are the offsets) go to ranks `0..size` in
    /// order; what rank `r` sends lands in `output` at `recv_counts`' offset `r`.
    fn all_to_all_single(
        &self,
        output: &Tensor,
        input: &Tensor,
        send_counts: &[usize],
        recv_counts: &[usize],
        timeout: Duration,
    ) -> Result<()>;
    /// Sends `tensor` to group rank `dst` with `tag` (a backend without tags may ignore it:
    /// then messages between two ranks match in order).
    fn send(&self, tensor: &Tensor, dst: usize, tag: u64, timeout: Duration) -> Result<()>;
    /// Receives into `tensor` from group rank `src` with `tag`.
    fn recv(&self, tensor: &Tensor, src: usize, tag: u64, timeout: Duration) -> Result<()>;

    /// Bytes this backend has sent so far (for summaries and benchmarks).
    fn bytes_sent(&self) -> u64 {
        0
    }
    /// How collectives move between this group's ranks: `"shm"`, `"tcp"`, `"shm+tcp"` for the
    /// cpu backend, or the backend's name where it has a single transport.
    fn transport(&self) -> &'static str {
        "other"
    }
}
