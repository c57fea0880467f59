//! Communication hooks (`DistributedDataParallel.register_comm_hook`): the bucket a hook is
//! given, the future it returns, and PyTorch's default hooks.

use std::sync::Arc;

use tensorplay_collectives::{ProcessGroup, ReduceOp, Work};
use tensorplay_core::{Result, Tensor};

/// One bucket of gradients, as a communication hook sees it (`torch.distributed.GradBucket`).
///
/// [`GradBucket::buffer`] is the bucket's flat 1-D tensor (one dtype, the parameters' gradients
/// back to back in the bucket's parameter order), **not divided by the world size** when a hook
/// is installed. The hook may communicate it in place or return another tensor of the same
/// length and dtype; what its future resolves to is averaged into nothing further: it is
/// written to the parameters' `.grad` as is.
pub struct GradBucket {
    pub(crate) index: usize,
    pub(crate) count: usize,
    pub(crate) buffer: Tensor,
    pub(crate) parameters: Vec<Tensor>,
    pub(crate) offsets: Vec<usize>,
}

impl GradBucket {
    /// The bucket's index: buckets are launched in index order on every rank, 0 first.
    pub fn index(&self) -> usize {
        self.index
    }
    /// Whether this is the last bucket of the backward pass (`is_last`).
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }
    /// The flat gradient buffer: shape `[numel]`, the parameters' dtype (`buffer()`).
    pub fn buffer(&self) -> &Tensor {
        &self.buffer
    }
    /// The parameters whose gradients the buffer holds, in buffer order (`parameters()`).
    pub fn parameters(&self) -> &[Tensor] {
        &self.parameters
    }
    /// Each parameter's gradient as a view into the buffer, shaped like the parameter
    /// (`gradients()`).
    pub fn gradients(&self) -> Result<Vec<Tensor>> {
        self.parameters
            .iter()
            .zip(&self.offsets)
            .map(|(p, &o)| self.buffer.narrow(0, o, p.numel())?.reshape(p.shape()))
            .collect()
    }
}

impl std::fmt::Debug for GradBucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradBucket")
            .field("index", &self.index)
            .field("numel", &self.buffer.numel())
            .field("parameters", &self.parameters.len())
            .finish()
    }
}

/// The future a communication hook returns (`torch.futures.Future[Tensor]`): waiting on it
/// yields the tensor whose values become the bucket's gradients.
pub struct CommFuture {
    work: Option<Arc<Work>>,
    finish: Box<dyn FnOnce() -> Result<Tensor> + Send>,
}

impl CommFuture {
    /// A future that is already complete with `tensor`.
    pub fn ready(tensor: Tensor) -> CommFuture {
        CommFuture {
            work: None,
            finish: Box::new(move || Ok(tensor)),
        }
    }

    /// The future of an asynchronous collective that writes `tensor` in place
    /// (`dist.all_reduce(t, async_op=True).get_future()`): waits for `work`, then yields
    /// `tensor`. Its start and end times count in the overlap statistics.
    pub fn from_work(work: Work, tensor: Tensor) -> CommFuture {
        let work = Arc::new(work);
        let w = work.clone();
        CommFuture {
            work: Some(work),
            finish: Box::new(move || {
                w.wait(None)?;
                Ok(tensor)
            }),
        }
    }

    /// A future completed by running `f` when waited on (for communication the hook drives
    /// itself).
    pub fn new(f: impl FnOnce() -> Result<Tensor> + Send + 'static) -> CommFuture {
        CommFuture {
            work: None,
            finish: Box::new(f),
        }
    }

    /// Chains `f` onto the result (`fut.then(...)`), for example a division after a SUM.
    pub fn then(self, f: impl FnOnce(Tensor) -> Result<Tensor> + Send + 'static) -> CommFuture {
        let prev = self.finish;
        CommFuture {
            work: self.work,
            finish: Box::new(move || f(prev()?)),
        }
    }

    /// Waits and returns the tensor (`fut.wait()`).
    pub fn wait(self) -> Result<Tensor> {
        (self.finish)()
    }

    /// The collective behind the future, when it was made by [`CommFuture::from_work`].
    pub(crate) fn work(&self) -> Option<&Arc<Work>> {
        self.work.as_ref()
    }
}

impl std::fmt::Debug for CommFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommFuture")
            .field("has_work", &self.work.is_some())
            .finish()
    }
}

/// A communication hook: gets the process group and a bucket, communicates, and returns the
/// future of the bucket's new gradients. Called on the thread running backward, once per
/// bucket per synced step, in bucket order on every rank.
pub type CommHook = dyn Fn(&ProcessGroup, &GradBucket) -> Result<CommFuture> + Send + Sync;

/// PyTorch's `torch.distributed.algorithms.ddp_comm_hooks.default_hooks`.
pub mod default_hooks {
    use super::*;

    /// What DDP does without a hook (`allreduce_hook`): an asynchronous SUM all-reduce of the
    /// bucket, then a division by the group's size.
    pub fn allreduce_hook(group: &ProcessGroup, bucket: &GradBucket) -> Result<CommFuture> {
        let t = bucket.buffer().clone();
        let work = tensorplay_collectives::all_reduce_async(&t, ReduceOp::Sum, Some(group))?;
        let size = group.size() as f64;
        Ok(CommFuture::from_work(work, t).then(move |t| {
            t.mul_scalar_(1.0 / size)?;
            Ok(t)
        }))
    }

    /// `bf16_compress_hook`: the bucket cast to bfloat16 (one rounding per element) and
    /// divided by the group's size (in float32, rounding once more), SUM all-reduced
    /// asynchronously in bfloat16 (the cpu backend sums the ranks' values in float32 and
    /// rounds once; NCCL reduces in bfloat16), then cast back to the bucket's dtype. Half the
    /// bytes of a float32 bucket; each gradient carries bfloat16's relative error (about
    /// 2^-8 per rounding). Errors as `all_reduce`.
    pub fn bf16_compress_hook(group: &ProcessGroup, bucket: &GradBucket) -> Result<CommFuture> {
        compress_hook(tensorplay_core::DType::BF16, group, bucket)
    }

    /// `fp16_compress_hook`: as [`bf16_compress_hook`] in float16 (about 2^-11 relative error
    /// per rounding, but float16's range: gradients above 65,504 become infinite, below about
    /// 6e-8 zero).
    pub fn fp16_compress_hook(group: &ProcessGroup, bucket: &GradBucket) -> Result<CommFuture> {
        compress_hook(tensorplay_core::DType::F16, group, bucket)
    }

    fn compress_hook(
        dtype: tensorplay_core::DType,
        group: &ProcessGroup,
        bucket: &GradBucket,
    ) -> Result<CommFuture> {
        let buffer = bucket.buffer().clone();
        let compressed = buffer.to_dtype(dtype)?.div_scalar(group.size() as f64)?;
        let work =
            tensorplay_collectives::all_reduce_async(&compressed, ReduceOp::Sum, Some(group))?;
        Ok(CommFuture::from_work(work, compressed).then(move |c| {
            buffer.copy_(&c)?;
            Ok(buffer)
        }))
    }
}
