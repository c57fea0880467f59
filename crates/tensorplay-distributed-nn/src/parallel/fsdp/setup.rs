//! What `fully_shard` does once: find the group's parameters, check that every rank has the
//! same ones, cut this rank's shards, free the unsharded storage and install the hooks.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use tensorplay_collectives::{self as dist, Error as DistError, ProcessGroup};
use tensorplay_core::nn::Module;
use tensorplay_core::{DType, Result, Tensor, TensorId};

use super::FsdpOptions;
use super::param::ShardSpec;
use super::state::{FsdpState, Managed};
use crate::checkpoint::state_dict::TensorPlacement;

const OP: &str = "fully_shard";

/// `fully_shard` calls made by this process so far.
static CALLS: AtomicUsize = AtomicUsize::new(0);

/// Which call claimed each unsharded parameter, with the parameter's name there: a
/// parameter claimed by one call and reachable from a sibling's module is an error.
/// Tensor ids are never reused, so entries of dropped models are only stale, never wrong.
static CLAIMED: Mutex<BTreeMap<TensorId, (usize, String)>> = Mutex::new(BTreeMap::new());

/// The shards of every call, with their group's process group and the full parameter's shape
/// (for gradient clipping and `full_tensor`).
static SHARDS: Mutex<BTreeMap<TensorId, (ProcessGroup, Vec<usize>)>> = Mutex::new(BTreeMap::new());

/// The shards whose unsharded parameter is itself a tensor-parallel piece (2-D), with that
/// piece's placement in the whole tensor: their own placement composes the two splits.
static OVER_TP: Mutex<BTreeMap<TensorId, TensorPlacement>> = Mutex::new(BTreeMap::new());

/// Where the unsharded parameter of shard `t` lies in the whole tensor, if tensor parallelism
/// had split it before `fully_shard` did (2-D).
pub(crate) fn tp_piece_of_shard(t: &Tensor) -> Option<TensorPlacement> {
    OVER_TP
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&t.id())
        .cloned()
}

/// The process group `t` is a shard over, if it is a fully sharded parameter's shard.
pub(super) fn group_of_shard(t: &Tensor) -> Option<ProcessGroup> {
    shard_info(t).map(|(g, _)| g)
}

/// The process group `t` is a shard over and the full parameter's shape.
pub(super) fn shard_info(t: &Tensor) -> Option<(ProcessGroup, Vec<usize>)> {
    let shards = SHARDS.lock().unwrap_or_else(PoisonError::into_inner);
    shards.get(&t.id()).cloned()
}

fn invalid(
    rank: usize,
    arg: &str,
    expected: impl Into<String>,
    got: impl std::fmt::Display,
) -> tensorplay_core::Error {
    DistError::invalid(OP, rank as i64, arg, expected, got).into()
}

/// The ranks that share the shards, and those that hold replicas of them (HSDP): the default
/// group, a 1-D mesh's group, or a 2-D mesh's dimension 1 and dimension 0.
fn groups_of(options: &FsdpOptions) -> Result<(ProcessGroup, Option<ProcessGroup>)> {
    match &options.mesh {
        None => Ok((dist::default_group(OP)?, None)),
        Some(m) if m.ndim() == 1 => Ok((m.get_group(0)?.clone(), None)),
        Some(m) if m.ndim() == 2 => Ok((m.get_group(1)?.clone(), Some(m.get_group(0)?.clone()))),
        Some(m) => Err(invalid(
            m.get_rank(),
            "mesh",
            "a 1-D mesh (the ranks that share the shards) or a 2-D mesh (replicate, shard) for \
             HSDP",
            format!("a mesh of shape {:?}", m.shape()),
        )),
    }
}

/// Shards `module` as `fully_shard` describes: returns the attached state.
pub(super) fn shard_module(
    module: &mut dyn Module,
    options: &FsdpOptions,
) -> Result<Arc<FsdpState>> {
    let (group, replicate) = groups_of(options)?;
    let rank = dist::get_rank(Some(&group))?;
    let world = dist::get_world_size(Some(&group))?;
    let me = group.my_global_rank();
    if let Some(a) = module.core().attached() {
        return Err(invalid(
            me,
            "module",
            "a module not fully sharded yet (call fully_shard once per module)",
            format!("a module {} was applied to already", a.kind()),
        ));
    }
    let policy = options.mp_policy;
    if let Some((field, d)) = policy.non_float() {
        return Err(invalid(me, field, "a floating-point dtype", d));
    }
    let ignored: HashSet<TensorId> = options.ignored_params.iter().map(Tensor::id).collect();
    let (params, below) = collect(module, &ignored, me)?;
    check_ignored(module, &options.ignored_params, me)?;
    match &replicate {
        None => agree(&params, options, &group, me)?,
        Some(r) => {
            // HSDP: the replicas of a shard hold the same weights too. Each check fails alike
            // across its own group only, so the verdicts then go round both groups: a failure
            // anywhere on the mesh reaches every rank, without the others waiting in vain
            let shard_check = agree(&params, options, &group, me);
            let replica_check = agree(&params, options, r, me);
            let mine = shard_check.and(replica_check);
            let mut heard = mine.as_ref().err().map(|e| (me, e.to_string()));
            for g in [&group, r, &group] {
                heard = spread(heard, g)?;
            }
            mine?;
            if let Some((rank, why)) = heard {
                return Err(invalid(
                    me,
                    "module",
                    "every rank of the mesh passing fully_shard's checks",
                    format!("rank {rank} failed them: {why}"),
                ));
            }
        }
    }
    let param_dtype = group_dtype(&params, policy.param_dtype, me)?;
    let reduce_dtype = policy.reduce_dtype.unwrap_or(param_dtype);
    let index = CALLS.fetch_add(1, Ordering::Relaxed);
    let mut managed = Vec::with_capacity(params.len());
    let mut recast = BTreeMap::new();
    let all_params = module.parameters();
    for (name, old) in params {
        let shard = shard_of(&old, rank, world)?;
        if let Some(tp) = crate::parallel::tensor::tp_placement(&old) {
            OVER_TP
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(shard.id(), tp);
        }
        old.set_grad(None);
        // a parameter that views part of a storage (a transposed weight, rows of a bigger
        // tensor, a piece of a fused weight another module uses) keeps its storage: the module
        // gets a new parameter of its own, as when the dtype changes
        let owns = owns_storage(&old, &all_params);
        if owns {
            old.resize_storage_(0)?;
        }
        // the module computes with `param_dtype` tensors; the shard keeps the master's dtype
        let full = if owns && old.dtype() == param_dtype {
            old
        } else {
            let full = Tensor::zeros(old.shape(), (param_dtype, old.device()))?;
            full.resize_storage_(0)?;
            full.set_requires_grad(old.requires_grad())?;
            recast.insert(old.id(), full.clone());
            full
        };
        // initialisation and `to_empty` reach the shard through the module's tensor
        full.set_local_shard(Some(shard.clone()));
        managed.push(Managed { name, full, shard });
    }
    if !recast.is_empty() {
        replace_slots(module, &recast);
    }
    {
        let mut claimed = CLAIMED.lock().unwrap_or_else(PoisonError::into_inner);
        for m in &managed {
            claimed.insert(m.full.id(), (index, m.name.clone()));
        }
    }
    {
        let mut shards = SHARDS.lock().unwrap_or_else(PoisonError::into_inner);
        for m in &managed {
            shards.insert(m.shard.id(), (group.clone(), m.full.shape().to_vec()));
        }
    }
    let state = Arc::new_cyclic(|me| {
        FsdpState::new(
            index,
            (group, replicate),
            (rank, world),
            (param_dtype, reduce_dtype),
            managed,
            options,
            me.clone(),
        )
    });
    for s in below.iter().filter_map(Weak::upgrade) {
        s.set_has_parent();
    }
    state.set_below(below);
    state.sync_trainable()?;
    let core = module.core_mut();
    let pre = Arc::downgrade(&state);
    core.push_pre_hook(Box::new(move |input| match pre.upgrade() {
        Some(s) => {
            s.pre_forward()?;
            s.policy.cast_input(input)
        }
        None => Ok(None),
    }));
    let post = Arc::downgrade(&state);
    core.push_hook(Box::new(move |_, out| match post.upgrade() {
        Some(s) => {
            s.post_forward(out)?;
            s.policy.cast_output(out)
        }
        None => Ok(None),
    }));
    core.attach(state.clone())?;
    Ok(state)
}

/// The group's parameters with their names: those of `module` and its descendants that no
/// nested `fully_shard` call took and that are not ignored, each once (tied weights under their first name); and the
/// nested calls' groups.
type Collected = (Vec<(String, Tensor)>, Vec<Weak<FsdpState>>);

fn collect(module: &dyn Module, ignored: &HashSet<TensorId>, me: usize) -> Result<Collected> {
    // the unsharded parameters of nested calls below this module
    let mut nested: HashSet<TensorId> = HashSet::new();
    let mut below = Vec::new();
    for (path, m) in module.named_modules().into_iter().skip(1) {
        if let Some(s) = m
            .core()
            .attached()
            .and_then(|a| a.as_any().downcast_ref::<FsdpState>())
        {
            nested.extend(s.full_ids());
            s.set_path(&path);
            below.push(s.me());
        }
    }
    let nested_paths: Vec<String> = module
        .named_modules()
        .into_iter()
        .skip(1)
        .filter(|(_, m)| {
            m.core()
                .attached()
                .is_some_and(|a| a.as_any().is::<FsdpState>())
        })
        .map(|(p, _)| p)
        .collect();
    let inside = |path: &str| {
        nested_paths
            .iter()
            .any(|n| path == n || path.starts_with(&format!("{n}.")))
    };
    let claimed = CLAIMED.lock().unwrap_or_else(PoisonError::into_inner);
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (path, m) in module.named_modules() {
        for (n, p) in m.local_parameters() {
            let name = if path.is_empty() {
                n
            } else {
                format!("{path}.{n}")
            };
            if ignored.contains(&p.id()) {
                continue;
            }
            if nested.contains(&p.id()) && !inside(&path) {
                let (call, there) = claimed.get(&p.id()).cloned().unwrap_or_default();
                return Err(invalid(
                    me,
                    "module",
                    "a parameter used only inside the fully sharded module that holds it (a \
                     weight tied across modules belongs to the smallest module holding every \
                     user: wrap that one, or leave the inner ones unwrapped)",
                    format!(
                        "parameter {name:?} is also {there:?} of the inner fully_shard call \
                         {call}, whose parameters are freed outside its forward"
                    ),
                ));
            }
            if nested.contains(&p.id()) || !seen.insert(p.id()) {
                continue;
            }
            if let Some((call, there)) = claimed.get(&p.id()) {
                return Err(invalid(
                    me,
                    "module",
                    "parameters no other fully_shard call took: call fully_shard bottom-up \
                     (inner modules first, the root last), and give a parameter two modules \
                     share to the smallest module holding both",
                    format!(
                        "parameter {name:?} is {there:?} of fully_shard call {call}, on a \
                         module that contains this one or sits beside it"
                    ),
                ));
            }
            out.push((name, p));
        }
    }
    Ok((out, below))
}

/// Replaces every slot of `module`'s tree holding a tensor of `by` (by id) with its
/// replacement (a tied weight's slots all get the one replacement).
fn replace_slots(module: &mut dyn Module, by: &BTreeMap<TensorId, Tensor>) {
    for (_, slot) in module.local_parameters_mut() {
        if let Some(t) = by.get(&slot.id()) {
            *slot = t.clone();
        }
    }
    for (_, child) in module.named_children_mut() {
        replace_slots(child, by);
    }
}

/// The dtype the group's parameters are gathered in: `param_dtype` when the policy sets it
/// (the parameters must be floating point), else their one floating dtype.
fn group_dtype(
    params: &[(String, Tensor)],
    param_dtype: Option<DType>,
    me: usize,
) -> Result<DType> {
    let Some((first, p0)) = params.first() else {
        return Ok(param_dtype.unwrap_or(DType::F32));
    };
    let dtype = p0.dtype();
    for (name, p) in params {
        if !p.dtype().is_float() || (param_dtype.is_none() && p.dtype() != dtype) {
            return Err(invalid(
                me,
                "module",
                match param_dtype {
                    Some(_) => "floating-point parameters".to_string(),
                    None => format!(
                        "floating-point parameters of one dtype ({first:?} is {dtype}; set \
                         mp_policy.param_dtype to gather parameters of several dtypes in one)"
                    ),
                },
                format!("parameter {name:?} of dtype {}", p.dtype()),
            ));
        }
    }
    Ok(param_dtype.unwrap_or(dtype))
}

/// Every rank of `group` has the same parameters (names, shapes, dtypes, trainability) in
/// this call; else an error on every rank naming the first rank and parameter that differ.
fn agree(
    params: &[(String, Tensor)],
    options: &FsdpOptions,
    group: &ProcessGroup,
    me: usize,
) -> Result<()> {
    type Entry = (String, Vec<usize>, String, bool);
    let mine: Vec<Entry> = params
        .iter()
        .map(|(n, p)| {
            (
                n.clone(),
                p.shape().to_vec(),
                format!("{} on {}", p.dtype(), p.device()),
                p.requires_grad(),
            )
        })
        .collect();
    // the sum of each parameter's values, as bits: ranks must hold the same weights (nothing
    // is broadcast), and the same module (on the meta device, the same shapes only)
    let _g = tensorplay_core::no_grad();
    let sums: Vec<u64> = params
        .iter()
        .map(|(_, p)| {
            if p.device().is_meta() {
                // no weights yet: each rank initialises its shards after `to_empty`
                return Ok(0);
            }
            let v = p.detach().to_dtype(DType::F64)?.sum()?.item::<f64>()?;
            Ok(v.to_bits())
        })
        .collect::<Result<_>>()?;
    // options that change the collectives' number or sizes must agree too
    let settings = format!(
        "reshard_after_forward: {}, mp_policy: {:?}",
        options.reshard_after_forward, options.mp_policy
    );
    // a parameter computed from other tensors would get its gradient in the shard, never
    // in what it was computed from: refused on every rank before anything changes
    let problem: Option<String> = params.iter().find(|(_, p)| !p.is_leaf()).map(|(n, _)| {
        format!(
            "parameter {n:?} is not a leaf (it is computed from other tensors, so its \
             gradient would never reach them; pass a leaf, e.g. `.detach().requires_grad_(true)`)"
        )
    });
    let all = dist::all_gather_object(&(mine, sums, settings, problem), Some(group))?;
    let mut all_settings = Vec::with_capacity(all.len());
    let mut problems = Vec::with_capacity(all.len());
    let (all, all_sums): (Vec<Vec<Entry>>, Vec<Vec<u64>>) = all
        .into_iter()
        .map(|(m, s, o, p)| {
            all_settings.push(o);
            problems.push(p);
            (m, s)
        })
        .unzip();
    if let Some((r, why)) = problems
        .iter()
        .enumerate()
        .find_map(|(r, p)| p.as_ref().map(|p| (r, p)))
    {
        return Err(invalid(
            me,
            "module",
            "leaf parameters on every rank (nothing was changed on any rank)",
            format!("rank {}: {why}", group.ranks()[r]),
        ));
    }
    if let Some(r) = (1..all_settings.len()).find(|&r| all_settings[r] != all_settings[0]) {
        return Err(invalid(
            me,
            "options",
            format!(
                "the same fully_shard options on every rank (rank {}'s: {})",
                group.ranks()[0],
                all_settings[0]
            ),
            format!("rank {}'s: {}", group.ranks()[r], all_settings[r]),
        ));
    }
    let show = |e: Option<&Entry>| match e {
        Some((n, s, d, g)) => format!("{n:?} {s:?} {d}{}", if *g { "" } else { " (frozen)" }),
        None => "no parameter".to_string(),
    };
    for (r, list) in all.iter().enumerate().skip(1) {
        let n = list.len().max(all[0].len());
        if let Some(i) = (0..n).find(|&i| list.get(i) != all[0].get(i)) {
            return Err(invalid(
                me,
                "module",
                format!(
                    "the same parameters on every rank, in the same fully_shard order (rank \
                     {}'s parameter {i}: {})",
                    group.ranks()[0],
                    show(all[0].get(i))
                ),
                format!("rank {}'s: {}", group.ranks()[r], show(list.get(i))),
            ));
        }
        if let Some(i) = (0..all_sums[r].len()).find(|&i| all_sums[r][i] != all_sums[0][i]) {
            return Err(invalid(
                me,
                "module",
                format!(
                    "the same weights on every rank (build the model from the same seed: \
                     fully_shard broadcasts nothing); rank {}'s {:?} sums to {}",
                    group.ranks()[0],
                    all[0][i].0,
                    f64::from_bits(all_sums[0][i])
                ),
                format!(
                    "rank {}'s sums to {}",
                    group.ranks()[r],
                    f64::from_bits(all_sums[r][i])
                ),
            ));
        }
    }
    Ok(())
}

/// A failed check, as one rank knows of it: the rank that failed, and why.
type Failure = Option<(usize, String)>;

/// Tells every rank of `group` of a failure this rank knows of, and returns the first one
/// any of them knew of.
fn spread(known: Failure, group: &ProcessGroup) -> Result<Failure> {
    let all: Vec<Failure> = dist::all_gather_object(&known, Some(group))?;
    Ok(all.into_iter().flatten().next())
}

/// Every tensor of `ignored_params` is a parameter of `module`.
fn check_ignored(module: &dyn Module, ignored: &[Tensor], me: usize) -> Result<()> {
    let mut ids = HashSet::new();
    for (_, m) in module.named_modules() {
        ids.extend(m.local_parameters().into_iter().map(|(_, p)| p.id()));
    }
    match ignored.iter().position(|t| !ids.contains(&t.id())) {
        Some(i) => Err(invalid(
            me,
            "ignored_params",
            "parameters of the module fully_shard is called on",
            format!(
                "ignored_params[{i}] (shape {:?}) is not one of them",
                ignored[i].shape()
            ),
        )),
        None => Ok(()),
    }
}

/// Whether `p` is the only view of its whole storage among `params` (a contiguous tensor from
/// the storage's first element to its last): then freeing the storage frees nothing another
/// tensor of the model reads.
fn owns_storage(p: &Tensor, params: &[Tensor]) -> bool {
    p.device().is_meta()
        || (p.is_contiguous()
            && p.layout().offset() == 0
            && p.storage_numel() == p.numel()
            && !params
                .iter()
                .any(|q| q.id() != p.id() && q.shares_storage_with(p)))
}

/// This rank's rows of `full` as a new leaf with `full`'s `requires_grad`.
fn shard_of(full: &Tensor, rank: usize, world: usize) -> Result<Tensor> {
    let spec = ShardSpec::new(full.shape(), world);
    let rows = spec.rows_of(rank);
    let local = spec.local_shape(full.shape(), rank);
    let s = if full.device().is_meta() {
        // deferred initialisation: a shape, memory comes with `to_empty`
        Tensor::empty(&local, (full.dtype(), full.device()))?
    } else {
        full.detach()
            .reshape(&[spec.rows, spec.row_numel])?
            .narrow(0, rows.start, rows.len())?
            .reshape(&local)?
            .deep_clone()?
    };
    s.mark_sharded("fully_shard");
    s.mark_rows_of(full.shape(), rows.start);
    Ok(if full.requires_grad() {
        s.requires_grad_(true)
    } else {
        s
    })
}
