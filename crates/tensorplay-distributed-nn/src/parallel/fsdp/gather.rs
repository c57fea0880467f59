//! Filling and freeing a group's unsharded parameters: the all-gather (issued by the group's
//! own hook, or ahead of use by the group before it: prefetching, in the order learnt from the
//! first forward), the copy-out into the module's tensors, and freeing them again.

use std::sync::{Arc, PoisonError, Weak};

use tensorplay_collectives::{self as dist, Work};
use tensorplay_core::{Result, Tensor, no_grad};

use super::state::{FsdpEvent, FsdpState, GATHER, Runtime, record};

impl FsdpState {
    /// Fills the unsharded parameters from every rank's shards (one all-gather); nothing
    /// when they are filled already.
    pub(crate) fn unshard(&self) -> Result<()> {
        let mut rt = self.rt();
        self.unshard_locked(&mut rt)
    }

    pub(super) fn unshard_locked(&self, rt: &mut Runtime) -> Result<()> {
        if rt.unsharded {
            if rt.gathered_versions == self.shard_versions() {
                return Ok(());
            }
            // kept gathered (the root, `reshard_after_forward = false`, `unshard()`) while an
            // optimizer step wrote the shards: gather again
            rt.unsharded = false;
        }
        if self.params.is_empty() {
            // a module without parameters of its own: nothing to gather (on every rank alike)
            rt.unsharded = true;
            return Ok(());
        }
        let (work, all) = match rt.pending.take() {
            Some((work, all, versions)) if versions == self.shard_versions() => (work, all),
            stale => {
                if let Some((work, ..)) = stale {
                    work.wait(None).map_err(self.failed(GATHER))?;
                }
                self.issue_gather(rt)?
            }
        };
        work.wait(None).map_err(self.failed(GATHER))?;
        let _g = no_grad();
        let l = &self.layout;
        for (i, p) in self.params.iter().enumerate() {
            let numel = p.full.numel();
            p.full.resize_storage_(numel)?;
            let flat = p.full.detach().reshape(&[numel])?;
            p.full.preserve_version_counter(|| -> Result<()> {
                for (src, dst) in l.pieces(i) {
                    flat.narrow(0, dst.start, dst.len())?.copy_(&all.narrow(
                        0,
                        src.start,
                        src.len(),
                    )?)?;
                }
                Ok(())
            })?;
        }
        rt.unsharded = true;
        rt.gathered_versions = self.shard_versions();
        Ok(())
    }

    /// Packs this rank's shards into its block and issues the all-gather of every rank's
    /// block (asynchronously: the caller waits).
    pub(super) fn issue_gather(&self, rt: &mut Runtime) -> Result<(Work, Tensor)> {
        let _g = no_grad();
        let l = &self.layout;
        let block = Tensor::zeros(&[l.block_numel()], (self.param_dtype, self.device()))?;
        for (i, p) in self.params.iter().enumerate() {
            let r = l.in_block(i, self.rank);
            if !r.is_empty() {
                block
                    .narrow(0, r.start, r.len())?
                    .copy_(&p.shard.detach().reshape(&[r.len()])?)?;
            }
        }
        let all = Tensor::zeros(&[l.total_numel()], (self.param_dtype, self.device()))?;
        record(rt, FsdpEvent::AllGather);
        let work = dist::all_gather_into_tensor_async(&all, &block, Some(&self.group))
            .map_err(self.failed(GATHER))?;
        Ok((work, all))
    }

    /// Issues this group's all-gather ahead of its use, unless its parameters are gathered
    /// or being gathered.
    pub(super) fn prefetch(&self) -> Result<()> {
        let mut rt = self.rt();
        if rt.unsharded || rt.pending.is_some() || self.params.is_empty() {
            return Ok(());
        }
        let (work, all) = self.issue_gather(&mut rt)?;
        rt.pending = Some((work, all, self.shard_versions()));
        Ok(())
    }

    pub(super) fn shard_versions(&self) -> Vec<u64> {
        self.params.iter().map(|p| p.shard.version()).collect()
    }

    /// Waits for a prefetched all-gather nobody used and drops it.
    pub(super) fn drop_pending(&self, rt: &mut Runtime) -> Result<()> {
        if let Some((work, ..)) = rt.pending.take() {
            work.wait(None).map_err(self.failed(GATHER))?;
        }
        Ok(())
    }

    /// Prefetches the groups set by `set_modules_to_forward_prefetch` (`backward == false`)
    /// or `set_modules_to_backward_prefetch`, else the group after this one in forward or
    /// backward order, as learnt from the first forward.
    pub(super) fn prefetch_next(self: &Arc<Self>, backward: bool) -> Result<()> {
        let next: Vec<Arc<FsdpState>> = {
            let l = self.links.lock().unwrap_or_else(PoisonError::into_inner);
            let (explicit, implicit) = if backward {
                (&l.explicit_backward, &l.next_backward)
            } else {
                (&l.explicit_forward, &l.next_forward)
            };
            match explicit {
                Some(list) => list.iter().filter_map(Weak::upgrade).collect(),
                None => implicit.iter().filter_map(Weak::upgrade).collect(),
            }
        };
        for n in next.iter().filter(|n| !Arc::ptr_eq(n, self)) {
            n.prefetch()?;
        }
        Ok(())
    }

    /// Sets the groups to prefetch explicitly in forward (`backward == false`) or backward,
    /// once every rank of the group was found to set the same (by their calls' numbers).
    pub(crate) fn set_explicit_prefetch<'a>(
        &self,
        backward: bool,
        groups: impl Iterator<Item = &'a Arc<FsdpState>>,
    ) -> Result<()> {
        let groups: Vec<&Arc<FsdpState>> = groups.collect();
        let mine: Vec<usize> = groups.iter().map(|g| g.index).collect();
        let all: Vec<Vec<usize>> = dist::all_gather_object(&mine, Some(&self.group))
            .map_err(tensorplay_core::Error::from)?;
        if let Some(r) = all.iter().position(|l| *l != all[0]) {
            let which = if backward { "backward" } else { "forward" };
            return Err(dist::Error::invalid(
                "set_modules_to_prefetch",
                self.group.my_global_rank() as i64,
                "modules",
                format!(
                    "the same {which} prefetch list on every rank of group {} (rank {}'s: \
                     fully_shard calls {:?})",
                    self.label(),
                    self.group.ranks()[0],
                    all[0]
                ),
                format!("rank {}'s: calls {:?}", self.group.ranks()[r], all[r]),
            )
            .into());
        }
        let list = Some(groups.into_iter().map(Arc::downgrade).collect());
        let mut l = self.links.lock().unwrap_or_else(PoisonError::into_inner);
        if backward {
            l.explicit_backward = list;
        } else {
            l.explicit_forward = list;
        }
        Ok(())
    }

    /// Frees the unsharded parameters' storage.
    pub(crate) fn reshard(&self) -> Result<()> {
        let mut rt = self.rt();
        self.reshard_locked(&mut rt)
    }

    pub(super) fn reshard_locked(&self, rt: &mut Runtime) -> Result<()> {
        if !rt.unsharded {
            return Ok(());
        }
        for p in &self.params {
            p.full.resize_storage_(0)?;
        }
        rt.unsharded = false;
        record(rt, FsdpEvent::Reshard);
        Ok(())
    }

    /// Links the groups of the root's first forward (`order`, the root first) for
    /// prefetching: each to the next in forward order; in backward the root to the last
    /// group, and each group to the one before it.
    pub(super) fn learn_order(order: Vec<Weak<FsdpState>>) {
        let order: Vec<Arc<FsdpState>> = order.iter().filter_map(Weak::upgrade).collect();
        for (i, g) in order.iter().enumerate() {
            let next_backward = match i {
                0 if order.len() > 1 => order.last(),
                0 | 1 => None,
                _ => order.get(i - 1),
            };
            let mut l = g.links.lock().unwrap_or_else(PoisonError::into_inner);
            l.next_forward = order.get(i + 1).map(Arc::downgrade);
            l.next_backward = next_backward.map(Arc::downgrade);
        }
    }
}
