//! The distributed optimizer (`torch.distributed.optim.DistributedOptimizer`): one local
//! optimizer per owner of the parameters, stepped with the gradients of a distributed autograd
//! context.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use tensorplay_core::optim::lr_scheduler::LrGroups;
use tensorplay_core::optim::{Adam, AdamOptions, AdamW, AdamWOptions, Optimizer, SGD, SgdOptions};
use tensorplay_core::{Tensor, TensorId};

use crate::autograd::{ContextId, get_gradients, is_valid_context};
use crate::wire::{Decoder, Encoder, Wire};
use crate::{Error, RRef, Result};

const CREATE: &str = "tensorplay::dist_optim::create";
const STEP: &str = "tensorplay::dist_optim::step";
const DROP: &str = "tensorplay::dist_optim::drop";
const SET_LR: &str = "tensorplay::dist_optim::set_lr";

mod state;

/// Which local optimizer each owner runs, with its hyperparameters (the `optimizer_class`
/// and arguments of PyTorch's constructor).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerKind {
    /// [`SGD`] (momentum, dampening, weight decay, Nesterov).
    Sgd(SgdOptions),
    /// [`Adam`].
    Adam(AdamOptions),
    /// [`AdamW`].
    AdamW(AdamWOptions),
}

impl OptimizerKind {
    /// The learning rate these options start with.
    fn lr(&self) -> f64 {
        match self {
            OptimizerKind::Sgd(o) => o.lr,
            OptimizerKind::Adam(o) => o.lr,
            OptimizerKind::AdamW(o) => o.lr,
        }
    }

    fn build(self, params: Vec<Tensor>) -> tensorplay_core::Result<Box<dyn Optimizer>> {
        Ok(match self {
            OptimizerKind::Sgd(o) => Box::new(SGD::new(params, o)?),
            OptimizerKind::Adam(o) => Box::new(Adam::new(params, o)?),
            OptimizerKind::AdamW(o) => Box::new(AdamW::new(params, o)?),
        })
    }
}

impl Wire for OptimizerKind {
    fn encode(&self, e: &mut Encoder) -> Result<()> {
        match *self {
            OptimizerKind::Sgd(o) => {
                0u8.encode(e)?;
                (o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov).encode(e)
            }
            OptimizerKind::Adam(o) => {
                1u8.encode(e)?;
                (o.lr, o.betas.0, o.betas.1, o.eps, o.weight_decay, o.amsgrad).encode(e)
            }
            OptimizerKind::AdamW(o) => {
                2u8.encode(e)?;
                (o.lr, o.betas.0, o.betas.1, o.eps, o.weight_decay, o.amsgrad).encode(e)
            }
        }
    }

    fn decode(d: &mut Decoder) -> Result<Self> {
        Ok(match u8::decode(d)? {
            0 => {
                let (lr, momentum, dampening, weight_decay, nesterov) = Wire::decode(d)?;
                OptimizerKind::Sgd(SgdOptions {
                    lr,
                    momentum,
                    dampening,
                    weight_decay,
                    nesterov,
                })
            }
            k @ (1 | 2) => {
                let (lr, b0, b1, eps, weight_decay, amsgrad): (f64, f64, f64, f64, f64, bool) =
                    Wire::decode(d)?;
                if k == 1 {
                    OptimizerKind::Adam(AdamOptions {
                        lr,
                        betas: (b0, b1),
                        eps,
                        weight_decay,
                        amsgrad,
                    })
                } else {
                    OptimizerKind::AdamW(AdamWOptions {
                        lr,
                        betas: (b0, b1),
                        eps,
                        weight_decay,
                        amsgrad,
                    })
                }
            }
            k => {
                return Err(Error::Serialization(format!(
                    "unknown optimizer kind {k} (expected 0 SGD, 1 Adam, 2 AdamW)"
                )));
            }
        })
    }
}

/// A local optimizer created for a [`DistributedOptimizer`], with its parameters.
struct Local {
    params: Vec<Tensor>,
    optimizer: Box<dyn Optimizer>,
}

/// The local optimizers this worker runs for distributed optimizers, by id. Each is locked
/// while it steps, so concurrent `step`s on one worker are serialised, as in PyTorch.
static LOCALS: LazyLock<Mutex<HashMap<u64, Arc<Mutex<Local>>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));
static NEXT_LOCAL: AtomicU64 = AtomicU64::new(1);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Forgets every local optimizer (at `init_rpc` and `shutdown`).
pub(crate) fn reset() {
    lock(&LOCALS).clear();
}

fn create(kind: OptimizerKind, params: Vec<RRef<Tensor>>) -> tensorplay_core::Result<u64> {
    let params = params
        .iter()
        .map(RRef::local_value)
        .collect::<Result<Vec<Tensor>>>()?;
    // hyperparameters and dtypes first
    let optimizer = kind.build(params.clone())?;
    let mut seen: HashMap<TensorId, usize> = HashMap::new();
    for (i, p) in params.iter().enumerate() {
        // a duplicate would be stepped twice with the same gradient
        if let Some(j) = seen.insert(p.id(), i) {
            return Err(Error::invalid(
                "DistributedOptimizer::new",
                "params",
                "distinct parameters",
                format!("a duplicate parameter: parameters {j} and {i} of this owner are the same tensor"),
            )
            .into());
        }
        // it would never get a gradient, so never be stepped
        if !p.requires_grad() {
            return Err(Error::invalid(
                "DistributedOptimizer::new",
                "params",
                "tensors that require grad",
                format!("parameter {i} of this owner has requires_grad=false"),
            )
            .into());
        }
    }

    let id = NEXT_LOCAL.fetch_add(1, Ordering::Relaxed);
    lock(&LOCALS).insert(id, Arc::new(Mutex::new(Local { params, optimizer })));
    Ok(id)
}

/// The local optimizer `id` of this worker; `op` names the caller in the error when it was
/// dropped.
fn local(op: &'static str, id: u64) -> Result<Arc<Mutex<Local>>> {
    lock(&LOCALS).get(&id).cloned().ok_or_else(|| {
        Error::invalid(
            op,
            "optimizer",
            "a live optimizer",
            format!("local optimizer {id}, which was dropped"),
        )
    })
}

fn step(id: u64, context_id: ContextId) -> tensorplay_core::Result<()> {
    let local = local("DistributedOptimizer::step", id)?;
    // an owner the context never reached has no gradients: nothing to apply
    if !is_valid_context(context_id) {
        return Ok(());
    }
    let grads = get_gradients(context_id)?;
    let mut l = lock(&local);
    // parameters without a gradient in this context are skipped
    let g: Vec<Option<Tensor>> = l.params.iter().map(|p| grads.get(p).cloned()).collect();
    l.optimizer.step_with_grads(&g)
}

/// Registers the messages of the distributed optimizer (at `init_rpc`).
pub(crate) fn register_builtins() {
    crate::register(
        CREATE,
        |(kind, params): (OptimizerKind, Vec<RRef<Tensor>>)| create(kind, params),
    );
    crate::register(STEP, |(id, ctx): (u64, ContextId)| step(id, ctx));
    crate::register(SET_LR, |(id, lr): (u64, f64)| {
        let local = local("DistributedOptimizer::set_lr", id)?;
        lock(&local).optimizer.set_lr(lr)
    });
    state::register_builtins();
    crate::register(DROP, |id: u64| {
        lock(&LOCALS).remove(&id);
        Ok(())
    });
}

/// Trains parameters that live on several workers (`DistributedOptimizer`): holds one local
/// optimizer on each owner of the given parameter RRefs, created by RPC; [`step`] applies each
/// owner's gradients from a distributed autograd context, on all owners at once.
///
/// [`step`]: DistributedOptimizer::step
///
/// ```no_run
/// use tensorplay as tp;
/// use tp::{Tensor, TensorId};
/// use tp::optim::SgdOptions;
/// use tp::distributed::optim::{DistributedOptimizer, OptimizerKind};
/// use tp::distributed::rpc::{self, RRef};
/// use tp::distributed::autograd;
///
/// # fn demo(params: Vec<RRef<Tensor>>, x: Tensor) -> rpc::Result<()> {
/// let opt = DistributedOptimizer::new(
///     OptimizerKind::Sgd(SgdOptions { lr: 0.05, ..Default::default() }),
///     &params,
/// )?;
/// let ctx = autograd::context()?;
/// let y: Tensor = rpc::rpc_sync("ps", "forward", x, None)?;
/// autograd::backward(ctx.id(), &[y.sum()?], false)?;
/// opt.step(ctx.id())?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct DistributedOptimizer {
    /// (owner rank, local optimizer id) per owner.
    parts: Vec<(usize, u64)>,
    /// The learning rate every owner's optimizer has (this handle is the only one that sets
    /// it).
    lr: Mutex<f64>,
}

impl DistributedOptimizer {
    /// Groups `params` by owner and creates one `kind` optimizer on each owner over its
    /// parameters (in the order given), all at once.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no parameters; the first error of any owner (a bad
    /// hyperparameter, an RRef whose value is not a float tensor that requires grad, the same
    /// parameter twice, which would be stepped twice...), after every
    /// creation finished (the ones that succeeded are dropped again).
    pub fn new(kind: OptimizerKind, params: &[RRef<Tensor>]) -> Result<DistributedOptimizer> {
        if params.is_empty() {
            return Err(Error::invalid(
                "DistributedOptimizer::new",
                "params",
                "at least one parameter RRef",
                "an empty list",
            ));
        }
        let mut by_owner: BTreeMap<usize, Vec<RRef<Tensor>>> = BTreeMap::new();
        for p in params {
            by_owner.entry(p.owner().id).or_default().push(p.clone());
        }
        let futures = by_owner
            .into_iter()
            .map(|(owner, ps)| {
                crate::rpc_async::<_, u64>(owner, CREATE, (kind, ps), None).map(|f| (owner, f))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut parts = Vec::new();
        let mut first_err = None;
        for (owner, f) in futures {
            match f.wait() {
                Ok(id) => parts.push((owner, id)),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        let opt = DistributedOptimizer {
            parts,
            lr: Mutex::new(kind.lr()),
        };
        match first_err {
            Some(e) => Err(e),
            None => Ok(opt),
        }
    }

    /// Applies the gradients that context `context_id` accumulated on each owner
    /// ([`get_gradients`](crate::autograd::get_gradients) there) with that owner's optimizer,
    /// on all owners at once; parameters without a gradient in the context are left alone.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the context is not open on this worker; the first error
    /// of any owner, after every owner finished.
    pub fn step(&self, context_id: ContextId) -> Result<()> {
        if !is_valid_context(context_id) {
            return Err(Error::invalid(
                "DistributedOptimizer::step",
                "context_id",
                "the id of a context open on this worker",
                format!("{context_id}: could not find autograd context with id {context_id}"),
            ));
        }
        let futures = self
            .parts
            .iter()
            .map(|&(owner, id)| crate::rpc_async::<_, ()>(owner, STEP, (id, context_id), None))
            .collect::<Result<Vec<_>>>()?;
        let mut first_err = None;
        for f in futures {
            if let Err(e) = f.wait() {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl DistributedOptimizer {
    /// The learning rate of every owner's optimizer (`param_groups[0]["lr"]`).
    pub fn lr(&self) -> f64 {
        *lock(&self.lr)
    }

    /// Sets the learning rate of every owner's optimizer, one RPC per owner, all at once
    /// (what a learning-rate scheduler does through [`LrGroups`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a rate that is negative or not finite (nothing is sent);
    /// the first error of any owner, after every owner answered (the rate kept here is then
    /// unchanged, though the owners that answered have the new one).
    pub fn set_lr(&self, lr: f64) -> Result<()> {
        if !(lr >= 0.0 && lr.is_finite()) {
            return Err(Error::invalid(
                "DistributedOptimizer::set_lr",
                "lr",
                "a finite learning rate >= 0",
                lr,
            ));
        }
        let futures = self
            .parts
            .iter()
            .map(|&(owner, id)| crate::rpc_async::<_, ()>(owner, SET_LR, (id, lr), None))
            .collect::<Result<Vec<_>>>()?;
        let mut first_err = None;
        for f in futures {
            if let Err(e) = f.wait() {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => {
                *lock(&self.lr) = lr;
                Ok(())
            }
        }
    }
}

/// A distributed optimizer has one parameter group (every owner's optimizer has the same
/// options), so a scheduler of `tensorplay::optim::lr_scheduler` drives it as it drives a
/// local optimizer.
impl LrGroups for DistributedOptimizer {
    fn group_lrs(&self) -> Vec<f64> {
        vec![self.lr()]
    }

    fn set_group_lrs(&mut self, lrs: &[f64]) -> tensorplay_core::Result<()> {
        let [lr] = lrs else {
            return Err(Error::invalid(
                "DistributedOptimizer::set_group_lrs",
                "lrs",
                "1 rate (a distributed optimizer has one parameter group)",
                lrs.len(),
            )
            .into());
        };
        self.set_lr(*lr).map_err(tensorplay_core::Error::from)
    }
}

impl Drop for DistributedOptimizer {
    fn drop(&mut self) {
        for &(owner, id) in &self.parts {
            // best effort: after a shutdown the owners have forgotten it already
            let _ = crate::rpc_async::<u64, ()>(owner, DROP, id, None);
        }
    }
}
