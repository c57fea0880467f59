//! The gradient scaler of data-parallel and fully sharded training (PyTorch's
//! `ShardedGradScaler`): the found-inf flag is all-reduced (MAX) over a process group, so a
//! step skipped on one rank is skipped on every rank and the scales stay equal.

use std::ops::{Deref, DerefMut};

use tensorplay_collectives::{self as dist, ProcessGroup, ReduceOp};
use tensorplay_core::amp::{GradScaler, GradScalerOptions};
use tensorplay_core::{Result, Tensor};

/// A [`GradScaler`] whose found-inf flag is agreed across the ranks of a process group
/// (`torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`): each
/// [`unscale_`](GradScaler::unscale_) (and each [`step`](GradScaler::step) that unscales)
/// all-reduces the flag with MAX over the group, under the group's timeout. Every rank of the
/// group must therefore unscale the same optimizers in the same order. Use it with
/// `fully_shard` (each rank holds different shards of the gradients) and with
/// `DistributedDataParallel` (where the reduced gradients already agree and the all-reduce
/// only costs one small message). Dereferences to the [`GradScaler`].
#[derive(Debug)]
pub struct ShardedGradScaler {
    inner: GradScaler,
}

impl ShardedGradScaler {
    /// A scaler over `group` (`None`: the default group, looked up at each unscale).
    ///
    /// Errors: those of [`GradScaler::new`].
    pub fn new(options: GradScalerOptions, group: Option<ProcessGroup>) -> Result<Self> {
        let mut inner = GradScaler::new(options)?;
        inner.set_found_inf_sync(Box::new(move |found: bool| -> Result<bool> {
            let _ng = tensorplay_core::no_grad();
            let t = Tensor::from_vec(vec![if found { 1.0f32 } else { 0.0 }], &[1])?;
            dist::all_reduce(&t, ReduceOp::Max, group.as_ref())?;
            Ok(t.item::<f32>()? > 0.0)
        }));
        Ok(ShardedGradScaler { inner })
    }

    /// The scaler inside.
    pub fn into_inner(self) -> GradScaler {
        self.inner
    }
}

impl Deref for ShardedGradScaler {
    type Target = GradScaler;
    fn deref(&self) -> &GradScaler {
        &self.inner
    }
}

impl DerefMut for ShardedGradScaler {
    fn deref_mut(&mut self) -> &mut GradScaler {
        &mut self.inner
    }
}
