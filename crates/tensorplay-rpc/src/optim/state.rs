//! The state of a [`DistributedOptimizer`]: each owner's local optimizer state, fetched and
//! restored by RPC, or saved and loaded by the owners themselves (each on its own disk).

use std::collections::BTreeMap;

use tensorplay_core::Tensor;
use tensorplay_core::optim::OptimizerState;

use super::{DistributedOptimizer, local, lock};
use crate::{Error, Result};

const STATE: &str = "tensorplay::dist_optim::state";
const LOAD_STATE: &str = "tensorplay::dist_optim::load_state";
const SAVE: &str = "tensorplay::dist_optim::save";
const LOAD: &str = "tensorplay::dist_optim::load";

/// An optimizer state as it crosses the wire: its file's tensors and header.
type Flat = (Vec<(String, Tensor)>, Vec<(String, String)>);

fn flatten(s: &OptimizerState) -> Flat {
    let (t, m) = s.to_tensors();
    (t.into_iter().collect(), m.into_iter().collect())
}

fn unflatten(op: &'static str, (t, m): Flat) -> tensorplay_core::Result<OptimizerState> {
    OptimizerState::from_tensors(t.into_iter().collect(), &m.into_iter().collect())
        .map_err(|e| Error::invalid(op, "state", "an optimizer's state", e).into())
}

/// Registers the messages (at `init_rpc`, with the other messages of the optimizer).
pub(super) fn register_builtins() {
    crate::register(STATE, |id: u64| {
        let l = local("DistributedOptimizer::state_dict", id)?;
        let s = lock(&l).optimizer.state_dict()?;
        Ok(flatten(&s))
    });
    crate::register(LOAD_STATE, |(id, flat): (u64, Flat)| {
        const OP: &str = "DistributedOptimizer::load_state_dict";
        let s = unflatten(OP, flat)?;
        let l = local(OP, id)?;
        lock(&l).optimizer.load_state_dict(&s)
    });
    crate::register(SAVE, |(id, path): (u64, String)| {
        let l = local("DistributedOptimizer::save_on_owners", id)?;
        let s = lock(&l).optimizer.state_dict()?;
        s.save(&path)
    });
    crate::register(LOAD, |(id, path): (u64, String)| {
        const OP: &str = "DistributedOptimizer::load_on_owners";
        let s = OptimizerState::load(&path)?;
        let l = local(OP, id)?;
        lock(&l).optimizer.load_state_dict(&s)
    });
}

/// Waits for every owner's future (all are waited for); the results by owner, or the first
/// error.
fn all<R: crate::Wire + Send + 'static>(
    futures: Vec<(String, crate::RpcFuture<R>)>,
) -> Result<Vec<(String, R)>> {
    let (owners, futures): (Vec<String>, Vec<_>) = futures.into_iter().unzip();
    Ok(owners.into_iter().zip(crate::wait_all(futures)?).collect())
}

impl DistributedOptimizer {
    /// The owners' names, with their local optimizer ids.
    fn owners(&self) -> Result<Vec<(String, usize, u64)>> {
        self.parts
            .iter()
            .map(|&(owner, id)| Ok((crate::get_worker_info(owner)?.name, owner, id)))
            .collect()
    }

    /// Every owner's local optimizer state (its [`Optimizer::state_dict`]), by owner name,
    /// fetched by RPC, all owners at once. Each owner's parameter indices are those of the
    /// parameters it owns, in the order given to [`new`](DistributedOptimizer::new).
    ///
    /// [`Optimizer::state_dict`]: tensorplay_core::optim::Optimizer::state_dict
    ///
    /// # Errors
    /// The first error of any owner (unreachable, or shut down), after every owner answered.
    pub fn state_dict(&self) -> Result<BTreeMap<String, OptimizerState>> {
        let futures = self
            .owners()?
            .into_iter()
            .map(|(w, owner, id)| Ok((w, crate::rpc_async::<_, Flat>(owner, STATE, id, None)?)))
            .collect::<Result<Vec<_>>>()?;
        all(futures)?
            .into_iter()
            .map(|(w, flat)| Ok((w, unflatten("DistributedOptimizer::state_dict", flat)?)))
            .collect()
    }

    /// Restores every owner's state from [`state_dict`](Self::state_dict) of an optimizer
    /// with the same owners and parameters, by RPC, all at once; the learning rate kept here
    /// becomes the restored one.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `states` names other owners than this optimizer's
    /// (nothing is sent); the first error of any owner (a state of another layout, as
    /// [`Optimizer::load_state_dict`] names it), after every owner answered.
    ///
    /// [`Optimizer::load_state_dict`]: tensorplay_core::optim::Optimizer::load_state_dict
    pub fn load_state_dict(&self, states: &BTreeMap<String, OptimizerState>) -> Result<()> {
        let owners = self.owners()?;
        let names: Vec<&String> = owners.iter().map(|(w, ..)| w).collect();
        if names.len() != states.len() || names.iter().any(|w| !states.contains_key(*w)) {
            return Err(Error::invalid(
                "DistributedOptimizer::load_state_dict",
                "states",
                format!("the states of owners {names:?}"),
                format!("the states of {:?}", states.keys().collect::<Vec<_>>()),
            ));
        }
        let futures = owners
            .iter()
            .map(|(w, owner, id)| {
                let flat = flatten(&states[w]);
                Ok((
                    w.clone(),
                    crate::rpc_async::<_, ()>(*owner, LOAD_STATE, (*id, flat), None)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        all(futures)?;
        self.take_lr(states.values().next());
        Ok(())
    }

    /// Asks every owner to save its own local optimizer state to `{dir}/{prefix}.{owner
    /// name}.safetensors` on its own file system ([`OptimizerState::save`]: atomic), all at
    /// once; returns the paths, by owner name.
    ///
    /// # Errors
    /// The first error of any owner (a folder it cannot write, as
    /// [`tensorplay_core::Error::Checkpoint`] names it), after every owner answered.
    pub fn save_on_owners(&self, dir: &str, prefix: &str) -> Result<BTreeMap<String, String>> {
        let futures = self
            .owners()?
            .into_iter()
            .map(|(w, owner, id)| {
                let path = format!("{dir}/{prefix}.{w}.safetensors");
                let f = crate::rpc_async::<_, ()>(owner, SAVE, (id, path.clone()), None)?;
                Ok(((w, path), f))
            })
            .collect::<Result<Vec<_>>>()?;
        let (paths, futures): (Vec<_>, Vec<_>) = futures.into_iter().unzip();
        all(paths.iter().map(|(w, _)| w.clone()).zip(futures).collect())?;
        Ok(paths.into_iter().collect())
    }

    /// Asks every owner to load its state from the file [`save_on_owners`] wrote with the same
    /// `dir` and `prefix`, all at once. The learning rate kept here is then read back from the
    /// owners.
    ///
    /// # Errors
    /// The first error of any owner (a missing, truncated or corrupt file, named; a state of
    /// another layout), after every owner answered.
    ///
    /// [`save_on_owners`]: Self::save_on_owners
    pub fn load_on_owners(&self, dir: &str, prefix: &str) -> Result<()> {
        let futures = self
            .owners()?
            .into_iter()
            .map(|(w, owner, id)| {
                let path = format!("{dir}/{prefix}.{w}.safetensors");
                Ok((w, crate::rpc_async::<_, ()>(owner, LOAD, (id, path), None)?))
            })
            .collect::<Result<Vec<_>>>()?;
        all(futures)?;
        let states = self.state_dict()?;
        self.take_lr(states.values().next());
        Ok(())
    }

    /// Keeps the learning rate of a restored state (its first group's).
    fn take_lr(&self, state: Option<&OptimizerState>) {
        if let Some(g) = state.and_then(|s| s.param_groups.first()) {
            *lock(&self.lr) = g.lr;
        }
    }
}
