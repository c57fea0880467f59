//! Objects that take part in a checkpoint whole (PyTorch's `Stateful`): [`save_state`] asks
//! each for its [`StateDict`], [`load_state`] asks each where to load (given what the
//! checkpoint holds) and hands it the loaded entries. [`AppState`] is a model with its
//! optimizer, as PyTorch's checkpoint tutorial writes it.

use std::collections::BTreeMap;
use std::path::Path;

use tensorplay_collectives::ProcessGroup;
use tensorplay_core::nn::Module;
use tensorplay_core::optim::Optimizer;
use tensorplay_core::{Device, Error, Result, Tensor};

use super::load::load_after;
use super::metadata::Metadata;
use super::save_with;
use super::state::{StateDict, StateValue, join, model_state, strip_prefix};
use super::state_dict::{
    OptimizerStateDict, StateDictOptions, TensorPlacement, get_optimizer_state_dict,
    model_state_dict_placements, set_model_state_dict, set_optimizer_state_dict,
};
use super::storage::{FileSystemReader, FileSystemWriter, StorageReader};

/// Something a checkpoint saves and restores whole (`torch.distributed.checkpoint.stateful.Stateful`).
pub trait Stateful {
    /// What to save, by name (without the object's prefix).
    ///
    /// # Errors
    /// The object's own (a collective that gathers it, say).
    fn state_dict(&self) -> Result<StateDict>;

    /// Where to load, given the checkpoint's `saved` metadata (whose names carry `prefix.`):
    /// entries whose tensors [`load`](super::load) fills in place. By default
    /// [`state_dict`](Stateful::state_dict); an object whose state is created lazily (an
    /// optimizer that has not stepped) builds its entries from `saved`.
    ///
    /// # Errors
    /// The object's own.
    fn state_dict_to_load(&self, saved: &Metadata, prefix: &str) -> Result<StateDict> {
        let _ = (saved, prefix);
        self.state_dict()
    }

    /// Takes the loaded entries (those [`state_dict_to_load`](Stateful::state_dict_to_load)
    /// gave, filled).
    ///
    /// # Errors
    /// The object's own; it should change nothing when it fails.
    fn load_state_dict(&mut self, state: StateDict) -> Result<()>;
}

impl Stateful for StateDict {
    fn state_dict(&self) -> Result<StateDict> {
        Ok(self.clone())
    }
    fn load_state_dict(&mut self, state: StateDict) -> Result<()> {
        *self = state;
        Ok(())
    }
}

/// Saves every object under its name (`("app", &app)` gives `"app.model.0.weight"`, ...) as
/// one checkpoint in `checkpoint_dir`: [`save`](super::save) of their entries together.
///
/// # Errors
/// As [`save`](super::save); the objects' own.
pub fn save_state(
    objects: &[(&str, &dyn Stateful)],
    checkpoint_dir: impl AsRef<Path>,
    group: Option<&ProcessGroup>,
) -> Result<Metadata> {
    let mut all = StateDict::new();
    for (name, o) in objects {
        for (k, v) in o.state_dict()? {
            all.insert(join(name, &k), v);
        }
    }
    save_with(&all, &mut FileSystemWriter::new(checkpoint_dir), group)
}

/// Loads the checkpoint in `checkpoint_dir` into every object (as [`save_state`] saved
/// them): each says where to load, [`load`](super::load) fills those entries on every rank
/// (all or nothing), then each object takes its own.
///
/// # Errors
/// As [`load`](super::load); the objects' own.
pub fn load_state(
    objects: &mut [(&str, &mut dyn Stateful)],
    checkpoint_dir: impl AsRef<Path>,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let mut reader = FileSystemReader::new(checkpoint_dir);
    // a rank that cannot read the metadata still joins the load, which reports it everywhere
    let saved = reader.read_metadata();
    let mut all = StateDict::new();
    // a rank whose objects cannot say where to load still joins the load, which reports it
    // on every rank
    let mut prior = Ok(());
    if let Ok(saved) = &saved {
        for (name, o) in objects.iter() {
            match o.state_dict_to_load(saved, name) {
                Ok(entries) => {
                    for (k, v) in entries {
                        all.insert(join(name, &k), v);
                    }
                }
                Err(e) => {
                    prior = Err(e);
                    break;
                }
            }
        }
    }
    load_after(&mut all, &mut reader, group, prior)?;
    for (name, o) in objects.iter_mut() {
        o.load_state_dict(strip_prefix(&all, name))?;
    }
    Ok(())
}

/// A model and its optimizer as one [`Stateful`] (PyTorch's tutorial `AppState`): entries
/// `model.<name>` (the model's local tensors: a load writes into the model in place),
/// `optim.state.<name>.<state>` (each split as its parameter, or whole) and `optim.header`
/// (the optimizer's kind and parameter groups). Works for plain, DDP, tensor-parallel, fully
/// sharded and 2-D models. A `Partial` parameter's state (a row-parallel bias: rank 0 of its
/// group trains it, the others hold frozen zeros and no state) is rank 0's: the other ranks
/// save zeros for its moments and rank 0's step, so every rank saves the same names.
pub struct AppState<'a, M: Module + ?Sized> {
    /// The model.
    pub model: &'a mut M,
    /// Its optimizer (over `model.parameters()`), if saved with it.
    pub optimizer: Option<&'a mut dyn Optimizer>,
}

const HEADER: &str = "optim.header";
const STATE: &str = "optim.state.";

/// Where state tensor `k` of parameter `p` lives: as its parameter when it is the parameter's
/// piece (a moment), else whole on every rank (a step count).
fn state_placement(k: &str, t: &Tensor, p: Option<&TensorPlacement>) -> TensorPlacement {
    match p {
        Some(p) if k != "step" && p.is_sharded() && t.shape() == p.local_shape.as_slice() => {
            p.clone()
        }
        _ => TensorPlacement::replicated(t),
    }
}

/// One optimizer state tensor as rank 0 of a `Partial` group sends it: name, dtype, shape and
/// values.
type WireState = (String, String, Vec<usize>, Vec<f64>);

/// Makes `state[fqn]` of `Partial` parameter `fqn` on every rank of its group what rank 0's
/// is, the moments (split as the parameter) as zeros elsewhere so their sum is rank 0's.
/// Collective over the group; nothing for other placements.
fn partial_state_of_rank_0(
    state: &mut BTreeMap<String, BTreeMap<String, Tensor>>,
    fqn: &str,
    p: &TensorPlacement,
) -> Result<()> {
    let Some((group, rank)) = p.partial_over() else {
        return Ok(());
    };
    let mine: Option<Vec<WireState>> = if rank == 0 {
        let wire = |(k, t): (&String, &Tensor)| -> Result<WireState> {
            let dtype = tensorplay_core::serialize::dtype_name(t.dtype()).to_string();
            Ok((k.clone(), dtype, t.shape().to_vec(), t.to_vec_f64()?))
        };
        state
            .get(fqn)
            .map(|m| m.iter().map(wire).collect::<Result<_>>())
            .transpose()?
    } else {
        None
    };
    let all = tensorplay_collectives::all_gather_object(&mine, Some(group))?;
    if rank == 0 {
        return Ok(());
    }
    let Some(Some(first)) = all.into_iter().next() else {
        state.remove(fqn);
        return Ok(());
    };
    let mut m = BTreeMap::new();
    for (k, dtype, shape, values) in first {
        let dtype = tensorplay_core::serialize::dtype_from_name(&dtype).ok_or_else(|| {
            Error::Checkpoint {
                path: format!("{fqn}.{k}"),
                problem: format!("rank 0 sent dtype {dtype:?}"),
            }
        })?;
        let t = Tensor::from_vec(values, &shape)?.to_dtype(dtype)?;
        let t = if state_placement(&k, &t, Some(p)).is_sharded() {
            t.zeros_like()?
        } else {
            t
        };
        m.insert(k, t);
    }
    state.insert(fqn.to_string(), m);
    Ok(())
}

/// Refuses, before anything is loaded, an optimizer header `key` of `saved` that `opt` cannot
/// take: another optimizer's state, or other parameter groups (the load would otherwise have
/// written the model before the optimizer refused).
fn check_header(saved: &Metadata, key: &str, opt: Option<&dyn Optimizer>) -> Result<()> {
    let Some(opt) = opt else {
        return Ok(());
    };
    let bad = |problem: String| Error::Checkpoint {
        path: key.to_string(),
        problem,
    };
    let header: BTreeMap<String, String> = saved
        .values
        .get(key)
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .ok_or_else(|| bad("the optimizer header is not one AppState wrote".into()))?;
    let osd = OptimizerStateDict::from_tensors(&BTreeMap::new(), &header)?;
    if !opt.kind().is_empty() && osd.kind != opt.kind() {
        return Err(bad(format!(
            "the checkpoint holds the state of {}; the optimizer is {} (nothing was loaded)",
            osd.kind,
            opt.kind()
        )));
    }
    let want: Vec<usize> = opt
        .param_groups()
        .iter()
        .map(|g| g.params().count())
        .collect();
    let got: Vec<usize> = osd.param_groups.iter().map(|g| g.params.len()).collect();
    if want != got {
        return Err(bad(format!(
            "the checkpoint's optimizer has parameter groups of {got:?} parameters; this one's \
             has {want:?} (nothing was loaded)"
        )));
    }
    Ok(())
}

impl<M: Module + ?Sized> Stateful for AppState<'_, M> {
    fn state_dict(&self) -> Result<StateDict> {
        let mut out = model_state(&*self.model, "model")?;
        let Some(opt) = self.optimizer.as_deref() else {
            return Ok(out);
        };
        let placements = model_state_dict_placements(&*self.model)?;
        let mut osd = get_optimizer_state_dict(&*self.model, opt, StateDictOptions::default())?;
        for (fqn, p) in &placements {
            partial_state_of_rank_0(&mut osd.state, fqn, p)?;
        }
        for (fqn, m) in &osd.state {
            for (k, t) in m {
                let p = state_placement(k, t, placements.get(fqn));
                out.insert(
                    format!("{STATE}{fqn}.{k}"),
                    StateValue::sharded(t.clone(), p),
                );
            }
        }
        let (_, header) = osd.to_tensors();
        out.insert(HEADER.into(), StateValue::Value(serde_json::json!(header)));
        Ok(out)
    }

    fn state_dict_to_load(&self, saved: &Metadata, prefix: &str) -> Result<StateDict> {
        let mut out = model_state(&*self.model, "model")?;
        if self.optimizer.is_none() {
            return Ok(out);
        }
        let header = join(prefix, HEADER);
        if !saved.values.contains_key(&header) {
            return Err(Error::Checkpoint {
                path: header,
                problem: "the checkpoint has no optimizer state here (saved without its \
                          optimizer?); load the model alone with `optimizer: None`"
                    .into(),
            });
        }
        check_header(saved, &header, self.optimizer.as_deref())?;
        let placements = model_state_dict_placements(&*self.model)?;
        let ours = if prefix.is_empty() {
            STATE.to_string()
        } else {
            format!("{prefix}.{STATE}")
        };
        for (key, t) in &saved.tensors {
            let Some(rest) = key.strip_prefix(&ours) else {
                continue;
            };
            let Some((fqn, k)) = rest.rsplit_once('.') else {
                continue;
            };
            let dtype = t.dtype().ok_or_else(|| Error::Checkpoint {
                path: key.clone(),
                problem: format!("dtype {:?}", t.dtype),
            })?;
            let p = placements.get(fqn);
            let (shape, placement) = match p {
                Some(p) if k != "step" && p.is_sharded() && t.size == p.global_shape => {
                    (p.local_shape.clone(), Some(p.clone()))
                }
                _ => (t.size.clone(), None),
            };
            let local = Tensor::zeros(&shape, (dtype, Device::Cpu))?;
            let placement = placement.unwrap_or_else(|| TensorPlacement::replicated(&local));
            out.insert(
                format!("{STATE}{rest}"),
                StateValue::sharded(local, placement),
            );
        }
        out.insert(HEADER.into(), StateValue::Value(serde_json::Value::Null));
        Ok(out)
    }

    fn load_state_dict(&mut self, state: StateDict) -> Result<()> {
        let model: BTreeMap<String, Tensor> = strip_prefix(&state, "model")
            .into_iter()
            .filter_map(|(k, v)| v.as_tensor().map(|t| (k, t.clone())))
            .collect();
        set_model_state_dict(&mut *self.model, &model, StateDictOptions::default())?;
        let Some(opt) = self.optimizer.as_deref_mut() else {
            return Ok(());
        };
        let header: BTreeMap<String, String> = state
            .get(HEADER)
            .and_then(StateValue::as_value)
            .and_then(|v| serde_json::from_value(v.clone()).ok())
            .ok_or_else(|| Error::Checkpoint {
                path: HEADER.into(),
                problem: "no optimizer header in the checkpoint (saved without its optimizer?)"
                    .into(),
            })?;
        let tensors: BTreeMap<String, Tensor> = state
            .iter()
            .filter_map(|(k, v)| {
                let rest = k.strip_prefix("optim.")?;
                rest.starts_with("state.")
                    .then(|| v.as_tensor().map(|t| (rest.to_string(), t.clone())))
                    .flatten()
            })
            .collect();
        let osd = OptimizerStateDict::from_tensors(&tensors, &header)?;
        set_optimizer_state_dict(&*self.model, opt, &osd, StateDictOptions::default())
    }
}

/// Each rank's default random generator ([`tensorplay_core::get_rng_state`]) as a
/// [`Stateful`]: entry `rng`, a per-rank value. A load gives rank `r` saved rank `r`'s state
/// (at another world size, saved rank `r mod N`'s), so a resumed run at the same size draws
/// what the uninterrupted one would.
#[derive(Debug, Clone, Copy, Default)]
pub struct RandomState;

impl Stateful for RandomState {
    fn state_dict(&self) -> Result<StateDict> {
        let mut out = StateDict::new();
        out.insert(
            "rng".into(),
            StateValue::RankValue(serde_json::json!(tensorplay_core::get_rng_state())),
        );
        Ok(out)
    }

    fn load_state_dict(&mut self, state: StateDict) -> Result<()> {
        let bytes: Vec<u8> = state
            .get("rng")
            .ok_or_else(|| Error::Checkpoint {
                path: "rng".into(),
                problem: "no random state in the checkpoint".into(),
            })?
            .to()?;
        tensorplay_core::set_rng_state(&bytes)
    }
}
