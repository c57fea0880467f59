//! The optimizer's state keyed by parameter name: [`OptimizerStateDict`],
//! [`get_optimizer_state_dict`] and [`set_optimizer_state_dict`].

use std::collections::{BTreeMap, HashMap};

use tensorplay_collectives as dist;
use tensorplay_core::nn::Module;
use tensorplay_core::optim::{GroupState, Optimizer, OptimizerState};
use tensorplay_core::{DType, Result, Tensor, TensorId};

use super::{
    StateDictOptions, TensorPlacement, agree, entries, invalid, my_rank, placement_of, verdict,
    world_group,
};

const GET: &str = "get_optimizer_state_dict";
const SET: &str = "set_optimizer_state_dict";

/// The header key of the groups' parameter names in [`OptimizerStateDict::to_tensors`].
const NAMES_KEY: &str = "param_names";

/// One parameter group of an [`OptimizerStateDict`]: its hyperparameters and its parameters'
/// fully qualified names, in the group's order (PyTorch lists the names in
/// `param_groups[i]["params"]`).
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroupState {
    /// The hyperparameters; its `params` are the indices in the optimizer that saved it (the
    /// names below are what loading goes by).
    pub hyper: GroupState,
    /// The group's parameters by fully qualified name.
    pub params: Vec<String>,
}

/// An optimizer's state keyed by parameter name instead of index (what
/// `get_optimizer_state_dict` returns in PyTorch): the same for plain, DDP, tensor-parallel
/// and fully sharded models. Each state tensor with its parameter's (local) shape is sharded
/// as the parameter is (or whole, from `full_state_dict`); the others (Adam's `step`, a 0-d
/// float32) are the same on every rank.
#[derive(Debug, Clone)]
pub struct OptimizerStateDict {
    /// The optimizer's name: `"SGD"`, `"Adam"`, `"AdamW"`.
    pub kind: String,
    /// Per parameter name, its state tensors by name (`exp_avg`, `exp_avg_sq`, `step`,
    /// `momentum_buffer`); parameters never stepped have no entry.
    pub state: BTreeMap<String, BTreeMap<String, Tensor>>,
    /// The parameter groups, in order.
    pub param_groups: Vec<ParamGroupState>,
}

impl OptimizerStateDict {
    /// The tensors and header of a safetensors file (for
    /// [`save_sharded`](crate::checkpoint::save_sharded)): tensors `state.<name>.<state
    /// name>`, the header as [`OptimizerState::to_tensors`] writes it plus `param_names` (the
    /// groups' names, JSON).
    pub fn to_tensors(&self) -> (BTreeMap<String, Tensor>, BTreeMap<String, String>) {
        let groups = OptimizerState {
            kind: self.kind.clone(),
            state: BTreeMap::new(),
            param_groups: self.param_groups.iter().map(|g| g.hyper.clone()).collect(),
        };
        let (_, mut metadata) = groups.to_tensors();
        let names: Vec<&Vec<String>> = self.param_groups.iter().map(|g| &g.params).collect();
        metadata.insert(NAMES_KEY.into(), serde_json::json!(names).to_string());
        let mut tensors = BTreeMap::new();
        for (fqn, m) in &self.state {
            for (k, t) in m {
                tensors.insert(format!("state.{fqn}.{k}"), t.clone());
            }
        }
        (tensors, metadata)
    }

    /// The state held by `tensors` and `metadata` as [`to_tensors`](Self::to_tensors) made
    /// them (what [`load_sharded`](crate::checkpoint::load_sharded) returns).
    ///
    /// Errors: [`Error::InvalidArgument`](tensorplay_core::Error::InvalidArgument) saying what
    /// does not fit: no optimizer header, names that do not parse.
    pub fn from_tensors(
        tensors: &BTreeMap<String, Tensor>,
        metadata: &BTreeMap<String, String>,
    ) -> Result<OptimizerStateDict> {
        let bad = |got: String| tensorplay_core::Error::InvalidArgument {
            op: "OptimizerStateDict::from_tensors",
            arg: "metadata",
            expected: "what OptimizerStateDict::to_tensors wrote".into(),
            got,
        };
        let groups = OptimizerState::from_tensors(BTreeMap::new(), metadata).map_err(bad)?;
        let names: Vec<Vec<String>> = metadata
            .get(NAMES_KEY)
            .ok_or_else(|| bad(format!("no `{NAMES_KEY}` in the header")))
            .and_then(|s| {
                serde_json::from_str(s).map_err(|e| bad(format!("`{NAMES_KEY}`: {e}")))
            })?;
        if names.len() != groups.param_groups.len() {
            return Err(bad(format!(
                "{} groups of names for {} groups",
                names.len(),
                groups.param_groups.len()
            )));
        }
        let mut state: BTreeMap<String, BTreeMap<String, Tensor>> = BTreeMap::new();
        for (key, t) in tensors {
            let (fqn, k) = key
                .strip_prefix("state.")
                .and_then(|r| r.rsplit_once('.'))
                .ok_or_else(|| bad(format!("tensor {key:?} is not `state.<name>.<state>`")))?;
            state
                .entry(fqn.to_string())
                .or_default()
                .insert(k.to_string(), t.clone());
        }
        Ok(OptimizerStateDict {
            kind: groups.kind,
            state,
            param_groups: groups
                .param_groups
                .into_iter()
                .zip(names)
                .map(|(hyper, params)| ParamGroupState { hyper, params })
                .collect(),
        })
    }
}

/// The module's parameters by tensor id: name and placement.
fn by_id(module: &dyn Module) -> Result<HashMap<TensorId, (String, TensorPlacement)>> {
    entries(module)
        .into_iter()
        .filter(|e| e.is_param)
        .map(|e| Ok((e.tensor.id(), (e.fqn, placement_of(&e.tensor)?))))
        .collect()
}

/// The optimizer's parameters' names and placements, in its order.
fn names_of(
    op: &str,
    module: &dyn Module,
    optim: &dyn Optimizer,
    rank: usize,
) -> Result<Vec<(String, TensorPlacement)>> {
    let own = by_id(module)?;
    optim
        .params()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            own.get(&p.id()).cloned().ok_or_else(|| {
                invalid(
                    op,
                    rank,
                    "optimizer",
                    "an optimizer over the model's parameters (built from model.parameters() \
                     after wrapping or sharding it)",
                    format!("parameter {i} of shape {:?} is not one of them", p.shape()),
                )
            })
        })
        .collect()
}

/// Whether state tensor `t` is split as its parameter (of placement `p`) is.
fn follows_param(k: &str, t: &Tensor, p: &TensorPlacement) -> bool {
    k != "step" && p.is_sharded() && t.shape() == p.local_shape.as_slice()
}

/// The optimizer's state keyed by parameter name
/// (`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`): `optim` must be over
/// `module`'s parameters (as `module.parameters()` lists them: shards for a split model).
/// Each state tensor of a split parameter is this rank's piece, or with `full_state_dict` the
/// whole (gathered over the parameter's mesh, a collective on every rank); with
/// `cpu_offload` values move to the CPU, and with both only rank 0 of the default group
/// returns the state (the others an empty `state`, the groups still listed).
///
/// # Errors
/// [`Error::InvalidArgument`](tensorplay_core::Error::InvalidArgument) naming the rank: a
/// parameter of the optimizer that is not the model's; with `full_state_dict`, ranks whose
/// state lists other parameters or names (every rank fails alike). Collective errors.
pub fn get_optimizer_state_dict<M: Module + ?Sized>(
    module: &M,
    optim: &dyn Optimizer,
    options: StateDictOptions,
) -> Result<OptimizerStateDict> {
    let module = module.as_module();
    let group = world_group();
    let rank = my_rank(group.as_ref());
    let names = names_of(GET, module, optim, rank);
    let os = optim.state_dict();
    let layout: Vec<(usize, Vec<String>)> = match &os {
        Ok(os) => os
            .state
            .iter()
            .map(|(i, m)| (*i, m.keys().cloned().collect()))
            .collect(),
        Err(_) => Vec::new(),
    };
    let all = if options.full_state_dict {
        let v = verdict(&names).or_else(|| verdict(&os));
        agree(GET, v, layout.clone(), group.as_ref())?
    } else {
        Vec::new()
    };
    let (names, os) = (names?, os?);
    if let Some(r) = all.iter().position(|l| *l != layout) {
        return Err(invalid(
            GET,
            rank,
            "optimizer",
            format!("the same state layout on every rank (this rank's: {layout:?})"),
            format!("rank {r}'s: {:?}", all[r]),
        ));
    }
    let offload_all = options.full_state_dict && options.cpu_offload && rank != 0;
    let mut state = BTreeMap::new();
    for (i, m) in &os.state {
        let (fqn, p) = &names[*i];
        let mut out = BTreeMap::new();
        for (k, t) in m {
            let mut v = if options.full_state_dict && follows_param(k, t, p) {
                p.gather(t)?
            } else {
                t.clone()
            };
            if options.cpu_offload {
                v = v.cpu()?;
            }
            out.insert(k.clone(), v);
        }
        if !offload_all {
            state.insert(fqn.clone(), out);
        }
    }
    let param_groups = os
        .param_groups
        .into_iter()
        .map(|hyper| ParamGroupState {
            params: hyper.params.iter().map(|&i| names[i].0.clone()).collect(),
            hyper,
        })
        .collect();
    Ok(OptimizerStateDict {
        kind: os.kind,
        state,
        param_groups,
    })
}

/// `state` keyed by this optimizer's indices, each tensor this rank's piece; checked.
fn by_index(
    state: &OptimizerStateDict,
    names: &[(String, TensorPlacement)],
    optim: &dyn Optimizer,
    options: StateDictOptions,
    rank: usize,
) -> Result<OptimizerState> {
    let index: HashMap<&str, usize> = names
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (n.as_str(), i))
        .collect();
    let own_groups: Vec<Vec<&str>> = optim
        .param_groups()
        .iter()
        .map(|g| g.params().map(|i| names[i].0.as_str()).collect())
        .collect();
    let given: Vec<Vec<&str>> = state
        .param_groups
        .iter()
        .map(|g| g.params.iter().map(String::as_str).collect())
        .collect();
    if given != own_groups {
        return Err(invalid(
            SET,
            rank,
            "state",
            format!("parameter groups of the parameters {own_groups:?} (this optimizer's)"),
            format!("groups of {given:?}"),
        ));
    }
    let mut out = BTreeMap::new();
    for (fqn, m) in &state.state {
        let Some(&i) = index.get(fqn.as_str()) else {
            return Err(invalid(
                SET,
                rank,
                "state",
                "state for the optimizer's parameters only",
                format!("state for {fqn:?}, which is not one of them (unexpected key)"),
            ));
        };
        let p = &names[i].1;
        let param = &optim.params()[i];
        let mut local = BTreeMap::new();
        for (k, t) in m {
            let sized_like_param = if options.full_state_dict {
                t.shape() == p.global_shape.as_slice()
            } else {
                t.shape() == param.shape()
            };
            // a step count is never split, even beside a 0-d parameter of the same shape
            let v = if options.full_state_dict && sized_like_param && k != "step" {
                p.slice(&t.to_dtype(param.dtype())?)?
            } else if k == "step" || sized_like_param {
                t.clone()
            } else {
                let want = if options.full_state_dict {
                    p.global_shape.clone()
                } else {
                    param.shape().to_vec()
                };
                let what = if options.full_state_dict {
                    "the whole parameter's: full_state_dict is set"
                } else {
                    "this rank's shard of the parameter: full_state_dict is not set"
                };
                return Err(invalid(
                    SET,
                    rank,
                    "state",
                    format!("state {fqn:?}.{k} of shape {want:?} ({what})"),
                    format!("shape {:?}", t.shape()),
                ));
            };
            local.insert(k.clone(), v);
        }
        out.insert(i, local);
    }
    let mut param_groups = Vec::new();
    for (g, own) in state.param_groups.iter().zip(optim.param_groups()) {
        let mut hyper = g.hyper.clone();
        hyper.params = own.params().collect();
        param_groups.push(hyper);
    }
    Ok(OptimizerState {
        kind: state.kind.clone(),
        state: out,
        param_groups,
    })
}

/// The state rank 0 holds, received by every rank: its layout as an object, then each tensor
/// by broadcast.
fn receive(state: &OptimizerStateDict, rank: usize) -> Result<OptimizerStateDict> {
    let group = world_group();
    type Layout = (
        Vec<(String, String, Vec<usize>, String)>,
        BTreeMap<String, String>,
    );
    let (tensors, metadata) = state.to_tensors();
    let mine: Layout = (
        tensors
            .iter()
            .map(|(k, t)| {
                let (fqn, name) = k
                    .strip_prefix("state.")
                    .and_then(|r| r.rsplit_once('.'))
                    .unwrap_or((k.as_str(), ""));
                (
                    fqn.into(),
                    name.into(),
                    t.shape().to_vec(),
                    t.dtype().to_string(),
                )
            })
            .collect(),
        metadata,
    );
    let mut objs = vec![mine];
    dist::broadcast_object_list(&mut objs, 0, group.as_ref())?;
    let (layout, metadata) = objs.pop().unwrap_or_default();
    let mut got = BTreeMap::new();
    for (fqn, name, shape, dtype) in layout {
        let key = format!("state.{fqn}.{name}");
        let t = match tensors.get(&key).filter(|_| rank == 0) {
            Some(t) => t.contiguous()?.deep_clone()?,
            None => {
                let dtype = DType::ALL
                    .into_iter()
                    .find(|d| d.to_string() == dtype)
                    .unwrap_or(DType::F32);
                Tensor::zeros(&shape, (dtype, tensorplay_core::Device::Cpu))?
            }
        };
        dist::broadcast(&t, 0, group.as_ref())?;
        got.insert(key, t);
    }
    OptimizerStateDict::from_tensors(&got, &metadata)
}

/// Loads `state` (keyed by parameter name, from [`get_optimizer_state_dict`] on this rank, or
/// whole with `full_state_dict`) into `optim`, an optimizer over `module`'s parameters
/// (`torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`). With
/// `full_state_dict` each rank cuts its piece of every state tensor the size of its whole
/// parameter; with `broadcast_from_rank0` too, only rank 0 of the default group needs the
/// state (the others pass any, an empty one say). The groups must list the same parameter
/// names as `optim`'s; the hyperparameters are replaced by the saved ones (PyTorch's rule).
/// The ranks agree before anything changes: an error on one rank is an error on all.
///
/// # Errors
/// [`Error::InvalidArgument`](tensorplay_core::Error::InvalidArgument) naming the rank: a
/// parameter of `optim` that is not the model's; groups of other names; state for a name
/// `optim` lacks; a state tensor of another shape than the parameter's piece (or whole, with
/// `full_state_dict`); those of [`Optimizer::load_state_dict`]. Collective errors.
pub fn set_optimizer_state_dict<M: Module + ?Sized>(
    module: &M,
    optim: &mut dyn Optimizer,
    state: &OptimizerStateDict,
    options: StateDictOptions,
) -> Result<()> {
    let module = module.as_module();
    let group = world_group();
    let rank = my_rank(group.as_ref());
    let received;
    let state = if options.broadcast_from_rank0 && options.full_state_dict && group.is_some() {
        received = receive(state, rank)?;
        &received
    } else {
        state
    };
    let prepared = if let Err(e) = options.check_broadcast(SET, rank) {
        Err(e)
    } else {
        names_of(SET, module, optim, rank)
            .and_then(|names| by_index(state, &names, optim, options, rank))
    };
    agree(SET, verdict(&prepared), (), group.as_ref())?;
    let prepared = prepared?;
    // the optimizer's own checks (dtype, names) may refuse it still: agree on that too
    let mut backup = None;
    let loaded = match optim.state_dict() {
        Ok(old) => {
            backup = Some(old);
            optim.load_state_dict(&prepared)
        }
        Err(e) => Err(e),
    };
    let agreed = agree(SET, verdict(&loaded), (), group.as_ref());
    loaded?;
    if agreed.is_err()
        && let Some(old) = backup
    {
        optim.load_state_dict(&old)?;
    }
    agreed.map(|_| ())
}
