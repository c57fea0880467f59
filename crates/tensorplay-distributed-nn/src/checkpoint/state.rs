//! What a distributed checkpoint holds: a [`StateDict`] of tensors (each rank's local piece
//! with its placement) and JSON values, under dotted names.

use std::collections::BTreeMap;

use tensorplay_core::nn::Module;
use tensorplay_core::{Result, Tensor};

use super::state_dict::{TensorPlacement, model_state_dict_placements};

/// One entry of a [`StateDict`].
#[derive(Debug, Clone)]
pub enum StateValue {
    /// A tensor: this rank's local tensor and where it lies in the whole (a shard, a
    /// tensor-parallel piece, or the whole when replicated). A load writes into `local` in
    /// place.
    Tensor {
        /// This rank's tensor (of `placement.local_shape`).
        local: Tensor,
        /// Where it lies in the whole.
        placement: TensorPlacement,
    },
    /// A value every rank shares (a step count, a data position, a scheduler's state): rank
    /// 0's is saved; a load gives it to every rank.
    Value(serde_json::Value),
    /// A value each rank has its own of (its random state): every rank's is saved; a load
    /// gives rank `r` saved rank `r`'s, or at another world size saved rank `r mod N`'s.
    RankValue(serde_json::Value),
}

impl StateValue {
    /// A tensor every rank holds whole (a DDP parameter, a plain model's).
    pub fn tensor(t: &Tensor) -> StateValue {
        StateValue::Tensor {
            local: t.clone(),
            placement: TensorPlacement::replicated(t),
        }
    }

    /// This rank's piece `local` of a split tensor, placed by `placement` (from
    /// [`model_state_dict_placements`]).
    pub fn sharded(local: Tensor, placement: TensorPlacement) -> StateValue {
        StateValue::Tensor { local, placement }
    }

    /// A shared value from anything serde writes (a [`SamplerState`](crate::data::SamplerState),
    /// a scheduler's settings).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](tensorplay_core::Error::InvalidArgument) when serde cannot
    /// write it as JSON.
    pub fn value<T: serde::Serialize>(v: &T) -> Result<StateValue> {
        serde_json::to_value(v).map(StateValue::Value).map_err(|e| {
            tensorplay_core::Error::InvalidArgument {
                op: "StateValue::value",
                arg: "v",
                expected: "a value serde writes as JSON".into(),
                got: e.to_string(),
            }
        })
    }

    /// The JSON value read back as `T`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](tensorplay_core::Error::InvalidArgument) when this is a
    /// tensor or its JSON is not a `T`.
    pub fn to<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        let bad = |got: String| tensorplay_core::Error::InvalidArgument {
            op: "StateValue::to",
            arg: "self",
            expected: format!("a value holding a {}", std::any::type_name::<T>()),
            got,
        };
        let v = self.as_value().ok_or_else(|| bad("a tensor".into()))?;
        serde_json::from_value(v.clone()).map_err(|e| bad(e.to_string()))
    }

    /// The tensor, if this is one.
    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            StateValue::Tensor { local, .. } => Some(local),
            StateValue::Value(_) | StateValue::RankValue(_) => None,
        }
    }

    /// The JSON value, if this is one (shared or per rank).
    pub fn as_value(&self) -> Option<&serde_json::Value> {
        match self {
            StateValue::Value(v) | StateValue::RankValue(v) => Some(v),
            StateValue::Tensor { .. } => None,
        }
    }
}

/// A checkpoint's content on one rank: entries by dotted name (`"model.0.weight"`,
/// `"optim.state.0.weight.exp_avg"`, `"step"`), as PyTorch's DCP flattens its nested state
/// dicts. Every rank passes the same names.
pub type StateDict = BTreeMap<String, StateValue>;

/// `model`'s parameters and buffers under `prefix` (`"model"` gives `"model.0.weight"`), each
/// this rank's local tensor (sharing storage with the model: a load writes straight into it)
/// with its placement; the names are those of
/// [`get_model_state_dict`](super::state_dict::get_model_state_dict), the same for plain, DDP,
/// tensor-parallel and fully sharded models.
///
/// # Errors
/// The group's errors when asking this rank's coordinate in a mesh.
pub fn model_state<M: Module + ?Sized>(model: &M, prefix: &str) -> Result<StateDict> {
    let placements = model_state_dict_placements(model)?;
    let locals = super::state_dict::entries(model.as_module());
    let mut out = StateDict::new();
    for e in locals {
        if let Some(p) = placements.get(&e.fqn) {
            out.insert(
                join(prefix, &e.fqn),
                StateValue::sharded(e.tensor, p.clone()),
            );
        }
    }
    Ok(out)
}

/// `prefix.name`, or `name` when `prefix` is empty.
pub(crate) fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// The entries of `state` under `prefix.`, with the prefix taken off.
pub fn strip_prefix(state: &StateDict, prefix: &str) -> StateDict {
    let p = format!("{prefix}.");
    state
        .iter()
        .filter_map(|(k, v)| k.strip_prefix(&p).map(|k| (k.to_string(), v.clone())))
        .collect()
}

/// Whether the placement is `Partial` over more than one rank (the whole is the ranks' sum).
pub(crate) fn is_partial(placement: &TensorPlacement) -> bool {
    placement.partial_over().is_some()
}
