//! The reduce-scatter of a group's gradients: packed from the unsharded gradients once they
//! are all in, issued while backward goes on (one group in flight at a time), and finished
//! into the shards' `.grad`.

use std::cell::RefCell;
use std::sync::{Arc, Weak};

use tensorplay_collectives::{self as dist, ReduceOp};
use tensorplay_core::{Result, Tensor, no_grad};

use super::state::{FsdpEvent, FsdpState, REDUCE, REPLICATE, Runtime, record};

thread_local! {
    /// The group whose reduce-scatter was issued last on this thread (finished before the
    /// next is issued: one in flight at a time, so that its buffers go before the next's are
    /// made).
    static IN_FLIGHT: RefCell<Option<Weak<FsdpState>>> = const { RefCell::new(None) };
}

impl FsdpState {
    /// Packs the unsharded gradients (zeros for those missing) into the reduce-scatter's
    /// input, frees them, issues the reduce-scatter and frees the unsharded parameters
    /// (`reshard_after_backward`).
    pub(super) fn start_reduce_locked(self: &Arc<Self>, rt: &mut Runtime) -> Result<()> {
        if let Some(prev) = IN_FLIGHT.take().and_then(|w| w.upgrade())
            && !Arc::ptr_eq(&prev, self)
        {
            prev.finish_reduce()?;
        }
        // this group's own, left in flight by a backward that was not the last
        self.finish_reduce_locked(rt)?;
        let _g = no_grad();
        let l = &self.layout;
        let input = Tensor::zeros(&[l.total_numel()], (self.reduce_dtype, self.device()))?;
        for (i, p) in self.params.iter().enumerate() {
            let Some(g) = p.full.grad() else { continue };
            let g = g.detach().reshape(&[p.full.numel()])?;
            for (dst, src) in l.pieces(i) {
                input.narrow(0, dst.start, dst.len())?.copy_(&g.narrow(
                    0,
                    src.start,
                    src.len(),
                )?)?;
            }
            p.full.set_grad(None);
        }
        let output = Tensor::zeros(&[l.block_numel()], (self.reduce_dtype, self.device()))?;
        record(rt, FsdpEvent::ReduceScatter);
        let work =
            dist::reduce_scatter_tensor_async(&output, &input, ReduceOp::Sum, Some(&self.group))
                .map_err(self.failed(REDUCE))?;
        rt.reduce = Some((work, output, input, self.shard_versions()));
        IN_FLIGHT.set(Some(Arc::downgrade(self)));
        rt.ready = 0;
        // every use of the parameters in this backward is done (their gradients are
        // accumulated): free them now, not at the end of backward, so that the groups are
        // not all whole at once
        if rt.reshard_after_backward {
            self.reshard_locked(rt)?;
        }
        Ok(())
    }

    pub(super) fn finish_reduce(&self) -> Result<()> {
        let mut rt = self.rt();
        self.finish_reduce_locked(&mut rt)
    }

    /// Waits for the group's reduce-scatter, if one is in flight, and adds its averaged
    /// block, cast to each shard's dtype, to the shards' `.grad`; its buffers go.
    pub(super) fn finish_reduce_locked(&self, rt: &mut Runtime) -> Result<()> {
        if let Some((work, output, _input, versions)) = rt.reduce.take() {
            for p in &self.params {
                p.shard.mark_grad_pending(None);
            }
            work.wait(None).map_err(self.failed(REDUCE))?;
            if versions != self.shard_versions() {
                // a step while this reduce-scatter was in flight (after a backward marked not
                // the last) went without these rows: adding them now would be silently wrong
                let name = self.params.first().map_or("", |p| p.name.as_str());
                return Err(tensorplay_core::Error::Autograd(format!(
                    "fully_shard on rank {}: group {}: the shards (such as {name:?}) were \
                     written while their gradients were still being reduce-scattered: an \
                     optimizer step after a backward marked set_is_last_backward(false) ran \
                     without this group's gradients; call set_is_last_backward(true) before \
                     the backward of the last micro-batch",
                    self.group.my_global_rank(),
                    self.label()
                )));
            }
            let _g = no_grad();
            let mut ranks = self.world;
            if let Some(r) = &self.replicate {
                // HSDP: the replicas' sums of the same rows are added up
                dist::all_reduce(&output, ReduceOp::Sum, Some(r))
                    .map_err(self.failed(REPLICATE))?;
                ranks *= r.size();
            }
            output.mul_scalar_(1.0 / ranks as f64)?;
            for (i, p) in self.params.iter().enumerate() {
                if !p.shard.requires_grad() {
                    continue;
                }
                let r = self.layout.in_block(i, self.rank);
                let g = output
                    .narrow(0, r.start, r.len())?
                    .reshape(p.shard.shape())?;
                // the master's dtype (`reduce_dtype` may differ): a cast copies already
                let g = if g.dtype() == p.shard.dtype() {
                    g.deep_clone()?
                } else {
                    g.to_dtype(p.shard.dtype())?
                };
                match p.shard.grad() {
                    Some(old) => old.add_(&g)?,
                    None => p.shard.set_grad(Some(g)),
                }
            }
        }
        Ok(())
    }
}
