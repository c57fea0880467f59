//! An optimizer's state (`optimizer.state_dict()`): per-parameter buffers and step counts, and
//! the parameter groups' hyperparameters; saved to and loaded from a safetensors file.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Value, json};

use super::{Buf, Counted};
use crate::serialize::{load_with_metadata, problem, save_with_metadata};
use crate::{DType, Error, Result, Tensor};

/// The header key naming the optimizer of a saved [`OptimizerState`].
const KIND_KEY: &str = "tensorplay.optimizer";
/// The header key of the parameter groups (JSON, as PyTorch's `state_dict()["param_groups"]`).
const GROUPS_KEY: &str = "param_groups";

/// The hyperparameters of one parameter group as saved (`state_dict()["param_groups"][i]`):
/// those that change while training and those fixed at construction. Fields an optimizer does
/// not have are `None`.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupState {
    /// Learning rate.
    pub lr: f64,
    /// Weight decay.
    pub weight_decay: f64,
    /// SGD's momentum factor.
    pub momentum: Option<f64>,
    /// SGD's dampening.
    pub dampening: Option<f64>,
    /// SGD's Nesterov flag.
    pub nesterov: Option<bool>,
    /// Adam's and AdamW's `(beta1, beta2)`.
    pub betas: Option<(f64, f64)>,
    /// Adam's and AdamW's `eps`.
    pub eps: Option<f64>,
    /// Adam's and AdamW's AMSGrad flag.
    pub amsgrad: Option<bool>,
    /// The indices of the group's parameters in the optimizer's `params()`.
    pub params: Vec<usize>,
}

/// An optimizer's whole state (`optimizer.state_dict()`), from
/// [`Optimizer::state_dict`](super::Optimizer::state_dict), restored by
/// [`Optimizer::load_state_dict`](super::Optimizer::load_state_dict): loading it into an
/// optimizer over the same parameters makes its next steps bit-identical to the original's.
///
/// Per parameter (by index in `params()`), the tensors of the optimizer's running state, each of
/// the parameter's shape and dtype, on the CPU: SGD `momentum_buffer`; Adam and AdamW `step` (a
/// 0-d float32 as PyTorch's, or int64 past 2^24 steps where float32 would round it; a load
/// accepts float32, float64 or int64), `exp_avg`, `exp_avg_sq` and, with AMSGrad,
/// `max_exp_avg_sq`, as PyTorch names them. Parameters never stepped have no entry.
///
/// [`save`](OptimizerState::save) writes a safetensors file: tensors named
/// `state.<index>.<name>`, and in the header `tensorplay.optimizer` (the kind) and
/// `param_groups` (the groups as JSON, as PyTorch lists them).
#[derive(Debug, Clone)]
pub struct OptimizerState {
    /// The optimizer's name: `"SGD"`, `"Adam"` or `"AdamW"`.
    pub kind: String,
    /// Per parameter index, its state tensors by name.
    pub state: BTreeMap<usize, BTreeMap<String, Tensor>>,
    /// The parameter groups, in order.
    pub param_groups: Vec<GroupState>,
}

impl OptimizerState {
    /// Writes this state to the safetensors file `path`, atomically (see [`crate::save`]).
    ///
    /// Errors: [`Error::Checkpoint`] naming the file when it cannot be written.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        for (i, g) in self.param_groups.iter().enumerate() {
            let values = [
                Some(g.lr),
                Some(g.weight_decay),
                g.momentum,
                g.dampening,
                g.eps,
            ]
            .into_iter()
            .flatten()
            .chain(g.betas.map(|b| [b.0, b.1]).into_iter().flatten());
            if values.clone().any(|v| !v.is_finite()) {
                return Err(Error::invalid(
                    "OptimizerState::save",
                    "param_groups",
                    "finite hyperparameters",
                    format!("a value that is not finite in param_groups[{i}]"),
                ));
            }
        }
        let (tensors, metadata) = self.to_tensors();
        save_with_metadata(&tensors, &metadata, path)
    }

    /// Reads a state written by [`save`](OptimizerState::save).
    ///
    /// Errors: [`Error::Checkpoint`] naming the file: those of [`crate::load`], and a file that
    /// is not an optimizer's state (no `tensorplay.optimizer` key; a model's weights, say), or
    /// whose groups or tensor names do not parse.
    pub fn load(path: impl AsRef<Path>) -> Result<OptimizerState> {
        let path = path.as_ref();
        let (tensors, metadata) = load_with_metadata(path)?;
        OptimizerState::from_tensors(tensors, &metadata).map_err(|m| problem(path, m))
    }

    /// The tensors and header of this state's file.
    pub fn to_tensors(&self) -> (BTreeMap<String, Tensor>, BTreeMap<String, String>) {
        let mut tensors = BTreeMap::new();
        for (i, named) in &self.state {
            for (k, t) in named {
                tensors.insert(format!("state.{i}.{k}"), t.clone());
            }
        }
        let groups: Vec<Value> = self.param_groups.iter().map(group_json).collect();
        let metadata = BTreeMap::from([
            (KIND_KEY.to_string(), self.kind.clone()),
            (GROUPS_KEY.to_string(), Value::Array(groups).to_string()),
        ]);
        (tensors, metadata)
    }

    /// The state held by `tensors` and `metadata` (as [`to_tensors`](Self::to_tensors) made
    /// them); the error says what does not fit.
    pub fn from_tensors(
        tensors: BTreeMap<String, Tensor>,
        metadata: &BTreeMap<String, String>,
    ) -> std::result::Result<OptimizerState, String> {
        let kind = metadata.get(KIND_KEY).cloned().ok_or_else(|| {
            format!("not an optimizer's state: its header has no `{KIND_KEY}` (a model's weights?)")
        })?;
        let groups = metadata
            .get(GROUPS_KEY)
            .ok_or_else(|| format!("no `{GROUPS_KEY}` in its header"))?;
        let groups: Value = serde_json::from_str(groups)
            .map_err(|e| format!("`{GROUPS_KEY}` in its header is not JSON: {e}"))?;
        let param_groups = groups
            .as_array()
            .ok_or_else(|| format!("`{GROUPS_KEY}` is not a list"))?
            .iter()
            .enumerate()
            .map(|(i, g)| group_from_json(g).map_err(|e| format!("{GROUPS_KEY}[{i}]: {e}")))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let mut state: BTreeMap<usize, BTreeMap<String, Tensor>> = BTreeMap::new();
        for (name, t) in tensors {
            let parsed = name
                .strip_prefix("state.")
                .and_then(|r| r.split_once('.'))
                .and_then(|(i, k)| Some((i.parse::<usize>().ok()?, k.to_string())));
            let (i, k) = parsed.ok_or_else(|| {
                format!("tensor `{name}` is not named `state.<parameter index>.<name>`")
            })?;
            state.entry(i).or_default().insert(k, t);
        }
        Ok(OptimizerState {
            kind,
            state,
            param_groups,
        })
    }
}

fn group_json(g: &GroupState) -> Value {
    let mut m = serde_json::Map::new();
    m.insert("lr".into(), json!(g.lr));
    m.insert("weight_decay".into(), json!(g.weight_decay));
    if let Some(v) = g.momentum {
        m.insert("momentum".into(), json!(v));
    }
    if let Some(v) = g.dampening {
        m.insert("dampening".into(), json!(v));
    }
    if let Some(v) = g.nesterov {
        m.insert("nesterov".into(), json!(v));
    }
    if let Some((b1, b2)) = g.betas {
        m.insert("betas".into(), json!([b1, b2]));
    }
    if let Some(v) = g.eps {
        m.insert("eps".into(), json!(v));
    }
    if let Some(v) = g.amsgrad {
        m.insert("amsgrad".into(), json!(v));
    }
    m.insert("params".into(), json!(g.params));
    Value::Object(m)
}

fn group_from_json(v: &Value) -> std::result::Result<GroupState, String> {
    let num = |k: &str| -> std::result::Result<Option<f64>, String> {
        match v.get(k) {
            None => Ok(None),
            Some(x) => x
                .as_f64()
                .map(Some)
                .ok_or_else(|| format!("`{k}` is not a number")),
        }
    };
    let flag = |k: &str| -> std::result::Result<Option<bool>, String> {
        match v.get(k) {
            None => Ok(None),
            Some(x) => x
                .as_bool()
                .map(Some)
                .ok_or_else(|| format!("`{k}` is not a boolean")),
        }
    };
    let betas = match v.get("betas") {
        None => None,
        Some(b) => match b
            .as_array()
            .map(|a| a.iter().map(Value::as_f64).collect::<Vec<_>>())
        {
            Some(a) if a.len() == 2 && a.iter().all(Option::is_some) => {
                Some((a[0].unwrap_or(0.0), a[1].unwrap_or(0.0)))
            }
            _ => return Err("`betas` is not a list of two numbers".into()),
        },
    };
    let params = v
        .get("params")
        .and_then(Value::as_array)
        .ok_or("no `params` list")?
        .iter()
        .map(|p| p.as_u64().and_then(|p| usize::try_from(p).ok()))
        .collect::<Option<Vec<usize>>>()
        .ok_or("`params` holds something other than parameter indices")?;
    Ok(GroupState {
        lr: num("lr")?.ok_or("no `lr`")?,
        weight_decay: num("weight_decay")?.unwrap_or(0.0),
        momentum: num("momentum")?,
        dampening: num("dampening")?,
        nesterov: flag("nesterov")?,
        betas,
        eps: num("eps")?,
        amsgrad: flag("amsgrad")?,
        params,
    })
}

/// `buf` (the state of `param`) as a tensor of the parameter's shape.
pub(crate) fn buf_tensor(buf: &Buf, param: &Tensor) -> Result<Tensor> {
    match buf {
        Buf::F32(v) => Tensor::from_slice(v, param.shape()),
        Buf::F64(v) => Tensor::from_slice(v, param.shape()),
        Buf::Device(t) => t.detach().deep_clone(),
    }
}

/// The state tensor `name` of parameter `i` as a buffer, checked against the parameter's
/// shape and dtype.
pub(crate) fn tensor_buf(
    op: &'static str,
    i: usize,
    name: &str,
    t: &Tensor,
    param: &Tensor,
) -> Result<Buf> {
    if t.shape() != param.shape() || t.dtype() != param.dtype() {
        return Err(Error::invalid(
            op,
            "state",
            format!(
                "state.{i}.{name} of shape {:?} and dtype {} (parameter {i}'s)",
                param.shape(),
                param.dtype()
            ),
            format!("shape {:?} and dtype {}", t.shape(), t.dtype()),
        ));
    }
    Ok(match t.dtype() {
        DType::F32 => Buf::F32(Counted::new(t.to_vec()?)),
        DType::F64 | DType::I64 | DType::Bool | DType::BF16 | DType::F16 => {
            Buf::F64(Counted::new(t.to_dtype(DType::F64)?.to_vec()?))
        }
    })
}

/// Checks that `state` is `kind`'s, with the group layout `groups` (the parameter index ranges
/// of this optimizer) and no state for a parameter index beyond `n`.
pub(crate) fn check_layout(
    op: &'static str,
    kind: &str,
    state: &OptimizerState,
    groups: &[std::ops::Range<usize>],
    n: usize,
) -> Result<()> {
    if state.kind != kind {
        return Err(Error::invalid(
            op,
            "state",
            format!("the state of {kind}"),
            format!("the state of {}", state.kind),
        ));
    }
    let saved: Vec<Vec<usize>> = state
        .param_groups
        .iter()
        .map(|g| g.params.clone())
        .collect();
    let own: Vec<Vec<usize>> = groups.iter().map(|r| r.clone().collect()).collect();
    if saved != own {
        return Err(Error::invalid(
            op,
            "state",
            format!("parameter groups holding parameters {own:?} (this optimizer's)"),
            format!("groups holding {saved:?}"),
        ));
    }
    if let Some((&i, _)) = state.state.iter().next_back().filter(|(i, _)| **i >= n) {
        return Err(Error::invalid(
            op,
            "state",
            format!("state for parameters 0..{n}"),
            format!("state for parameter {i}"),
        ));
    }
    Ok(())
}

/// The state tensor `name` of parameter `i`, if saved, as a buffer.
pub(crate) fn saved_buf(
    op: &'static str,
    state: &OptimizerState,
    i: usize,
    name: &str,
    param: &Tensor,
) -> Result<Option<Buf>> {
    state
        .state
        .get(&i)
        .and_then(|m| m.get(name))
        .map(|t| tensor_buf(op, i, name, t, param))
        .transpose()
}

/// Checks that every saved state tensor has one of the names `allowed` (another optimizer's
/// state, or a corrupt name, is refused before anything changes).
pub(crate) fn check_names(
    op: &'static str,
    state: &OptimizerState,
    allowed: &[&str],
) -> Result<()> {
    for (i, m) in &state.state {
        if let Some(k) = m.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(Error::invalid(
                op,
                "state",
                format!("state tensors named {allowed:?}"),
                format!("state.{i}.{k}"),
            ));
        }
    }
    Ok(())
}
/// The largest step count a float32 holds exactly (2^24).
const F32_EXACT_STEPS: u64 = 1 << 24;

/// A parameter's step count as its state dict holds it: a 0-d float32 as PyTorch's Adam and
/// AdamW save it (4 bytes, loadable by either), or a 0-d int64 past 2^24 steps, where float32
/// would round the count.
pub(super) fn step_tensor(step: u64) -> Tensor {
    if step <= F32_EXACT_STEPS {
        // exact: a whole number of at most 2^24
        Tensor::scalar(step as f32)
    } else {
        Tensor::scalar(i64::try_from(step).unwrap_or(i64::MAX))
    }
}

/// The step count in a saved `step`: a 0-d float32 or float64 (PyTorch's) or int64 (ours past
/// 2^24, and older tensorplay checkpoints) holding a whole number >= 0; `None` for anything else.
pub(super) fn read_step(t: &Tensor) -> Option<u64> {
    if !t.shape().is_empty() {
        return None;
    }
    let whole = |x: f64| x.is_finite() && x >= 0.0 && x.fract() == 0.0 && x < 2f64.powi(63);
    match t.dtype() {
        DType::I64 => u64::try_from(t.to_vec::<i64>().ok()?[0]).ok(),
        DType::F32 | DType::F64 => {
            let x = t.to_vec_f64().ok()?[0];
            // a whole number below 2^63, so the conversion is exact
            whole(x).then_some(x as u64)
        }
        DType::Bool | DType::BF16 | DType::F16 => None,
    }
}
