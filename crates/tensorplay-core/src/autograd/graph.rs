//! Graph nodes, edges and the context a [`Function`] saves into.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::function::Function;
use super::saved_hooks::{PackedTensor, SavedTensorHooks};
use crate::storage::StorageCell;
use crate::{DType, Device, Error, Result, Tensor};

static NEXT_SEQ: AtomicU64 = AtomicU64::new(0);

/// Shape, dtype and device of a tensor, kept by nodes to build zero gradients and check the
/// shapes of returned gradients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    /// Shape.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// Device.
    pub device: Device,
}

impl TensorMeta {
    pub(crate) fn of(t: &Tensor) -> TensorMeta {
        TensorMeta {
            shape: t.shape().to_vec(),
            dtype: t.dtype(),
            device: t.device(),
        }
    }
    pub(crate) fn zeros(&self) -> Result<Tensor> {
        Tensor::zeros(&self.shape, (self.dtype, self.device))
    }
}

/// A gradient hook: sees the gradient flowing into a tensor and may replace it.
pub type Hook = Arc<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;

pub(crate) enum NodeKind {
    Function {
        func: Box<dyn Function>,
        ctx: Mutex<Context>,
    },
    AccumulateGrad {
        leaf: Tensor,
    },
}

/// A node of the backward graph: the backward of one [`Function`] application, or the
/// accumulation of a leaf's gradient.
pub struct Node {
    pub(crate) seq: u64,
    pub(crate) kind: NodeKind,
    /// One edge per forward input; `None` where the input needs no gradient.
    pub(crate) next_edges: Vec<Option<Edge>>,
    /// Metadata of the forward inputs (checks the shapes backward returns).
    pub(crate) input_meta: Vec<TensorMeta>,
    /// Metadata of the forward outputs (zero gradients for unused outputs).
    pub(crate) output_meta: Vec<TensorMeta>,
    pub(crate) pre_hooks: Mutex<Vec<(usize, Hook)>>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Node({}, seq={})", self.name(), self.seq)
    }
}

impl Node {
    pub(crate) fn next_seq() -> u64 {
        NEXT_SEQ.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn accumulate_grad(leaf: &Tensor) -> Arc<Node> {
        let meta = TensorMeta::of(leaf);
        Arc::new(Node {
            seq: u64::MAX,
            kind: NodeKind::AccumulateGrad { leaf: leaf.clone() },
            next_edges: vec![],
            input_meta: vec![meta.clone()],
            output_meta: vec![meta],
            pre_hooks: Mutex::new(vec![]),
        })
    }

    /// The name of the function (for example `"MulBackward"`) or `"AccumulateGrad"`.
    pub fn name(&self) -> &str {
        match &self.kind {
            NodeKind::Function { func, .. } => func.name(),
            NodeKind::AccumulateGrad { .. } => "AccumulateGrad",
        }
    }

    /// The edges to the nodes of the forward inputs (`grad_fn.next_functions`).
    pub fn next_functions(&self) -> Vec<Option<GradientEdge>> {
        self.next_edges
            .iter()
            .map(|e| e.as_ref().map(|e| GradientEdge(e.clone())))
            .collect()
    }

    /// Number of forward outputs, which is the number of gradients this node takes.
    pub fn num_outputs(&self) -> usize {
        self.output_meta.len()
    }

    /// For an accumulate-grad node, the leaf it accumulates into.
    pub fn leaf(&self) -> Option<&Tensor> {
        match &self.kind {
            NodeKind::AccumulateGrad { leaf } => Some(leaf),
            NodeKind::Function { .. } => None,
        }
    }

    pub(crate) fn add_pre_hook(&self, input_nr: usize, h: Hook) {
        self.pre_hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((input_nr, h));
    }
}

/// An edge into the backward graph: a node and which of its gradient inputs is meant.
#[derive(Clone)]
pub(crate) struct Edge {
    pub(crate) node: Arc<Node>,
    pub(crate) input_nr: usize,
}

/// A public handle on a graph edge (`torch.autograd.graph.get_gradient_edge`): where a
/// gradient for a tensor enters the backward graph. Used as a root or capture point by the
/// lower-level engine entry [`crate::autograd::run_backward`].
#[derive(Clone)]
pub struct GradientEdge(pub(crate) Edge);

impl GradientEdge {
    /// The node.
    pub fn node(&self) -> &Arc<Node> {
        &self.0.node
    }
    /// Which gradient input of the node.
    pub fn input_nr(&self) -> usize {
        self.0.input_nr
    }
    /// Whether two edges point at the same node input.
    pub fn same_as(&self, other: &GradientEdge) -> bool {
        Arc::ptr_eq(&self.0.node, &other.0.node) && self.0.input_nr == other.0.input_nr
    }
}

impl std::fmt::Debug for GradientEdge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GradientEdge({:?}, {})", self.0.node, self.0.input_nr)
    }
}

pub(crate) enum SavedTensor {
    /// An input or unrelated tensor: kept by a strong handle.
    Plain { tensor: Tensor, version: u64 },
    /// One of the node's own outputs: kept without its grad_fn (which is this node) to avoid
    /// a reference cycle; rebuilt from the weak node reference on unpack.
    Output {
        data: Tensor,
        output_nr: usize,
        version: u64,
    },
    /// Packed by saved-tensor hooks: the graph keeps what the pack hook returned and the
    /// hooks themselves (captured when saving, so unpacking works on any thread). The
    /// storage is watched weakly: while it lives, its version is checked on unpack.
    Packed {
        packed: PackedTensor,
        hooks: Arc<dyn SavedTensorHooks>,
        output_nr: Option<usize>,
        storage: Weak<StorageCell>,
        version: u64,
    },
}

/// What a [`Function`] keeps between forward and backward: saved tensors (checked against
/// in-place modification), arbitrary values, and which inputs need gradients.
pub struct Context {
    pub(crate) saved: Vec<SavedTensor>,
    pub(crate) pending: Vec<Tensor>,
    pub(crate) values: Vec<Box<dyn Any + Send + Sync>>,
    pub(crate) needs_input_grad: Vec<bool>,
    pub(crate) non_differentiable: Vec<Tensor>,
    pub(crate) node: Weak<Node>,
    pub(crate) released: bool,
    /// During a split backward ([`crate::autograd::backward_input`]): the inputs whose
    /// gradients this call computes (the others are computed by another call).
    pub(crate) mask: Option<Vec<bool>>,
}

impl Context {
    pub(crate) fn new(needs_input_grad: Vec<bool>) -> Context {
        Context {
            saved: vec![],
            pending: vec![],
            values: vec![],
            needs_input_grad,
            non_differentiable: vec![],
            node: Weak::new(),
            released: false,
            mask: None,
        }
    }

    /// Saves tensors for backward (`ctx.save_for_backward`). Saving again replaces the list.
    /// If a saved tensor is modified in place before backward runs, backward fails with
    /// [`Error::Autograd`].
    pub fn save_for_backward(&mut self, tensors: &[&Tensor]) {
        self.pending = tensors.iter().map(|t| (*t).clone()).collect();
    }

    /// The saved tensors, in the order they were saved.
    ///
    /// Errors when the graph was already freed by a backward without `retain_graph`, or when a
    /// saved tensor was modified in place after it was saved.
    pub fn saved_tensors(&self) -> Result<Vec<Tensor>> {
        if self.released {
            return Err(Error::Autograd(
                "trying to backward through the graph a second time (or to access saved \
                 tensors after they have been freed); pass retain_graph=true to the first \
                 backward if you need to"
                    .into(),
            ));
        }
        if !self.pending.is_empty() {
            // forward is still running or the node was never built: hand back as is
            return Ok(self.pending.clone());
        }
        let mut out = Vec::with_capacity(self.saved.len());
        for (i, s) in self.saved.iter().enumerate() {
            let (t, v) = match s {
                SavedTensor::Plain { tensor, version } => (tensor.clone(), *version),
                SavedTensor::Output {
                    data,
                    output_nr,
                    version,
                } => (self.as_output(data, *output_nr), *version),
                SavedTensor::Packed {
                    packed,
                    hooks,
                    output_nr,
                    storage,
                    version,
                } => {
                    if let Some(cell) = storage.upgrade()
                        && cell.version() != *version
                    {
                        return Err(self.modified_error(i, None, cell.version(), *version));
                    }
                    let t = hooks.unpack(packed)?;
                    let t = match output_nr {
                        Some(nr) => self.as_output(&t, *nr),
                        None => t,
                    };
                    out.push(t);
                    continue;
                }
            };
            if t.version() != v {
                return Err(self.modified_error(i, Some(t.shape()), t.version(), v));
            }
            out.push(t);
        }
        Ok(out)
    }

    /// A saved output of this node: a new handle whose `grad_fn` is this node again.
    fn as_output(&self, data: &Tensor, output_nr: usize) -> Tensor {
        let t = data.view_with_layout(data.layout().clone());
        if let Some(node) = self.node.upgrade() {
            t.meta().grad_fn = Some(Edge {
                node,
                input_nr: output_nr,
            });
        }
        t
    }

    fn modified_error(&self, i: usize, shape: Option<&[usize]>, now: u64, saved: u64) -> Error {
        let name = self.node.upgrade().map(|n| n.name().to_string());
        let shape = shape
            .map(|s| format!(" with shape {s:?}"))
            .unwrap_or_default();
        Error::Autograd(format!(
            "one of the variables needed for gradient computation has been modified by an \
             in-place operation: saved tensor {i} of {}{shape} is at version {now}; expected \
             version {saved}",
            name.as_deref().unwrap_or("a function"),
        ))
    }

    /// Stores a value for backward. Values are retrieved by type with [`Context::get`]; to keep
    /// several values of one type, store a tuple or struct.
    pub fn save_value<T: Any + Send + Sync>(&mut self, value: T) {
        self.values.retain(|v| !v.is::<T>());
        self.values.push(Box::new(value));
    }

    /// The value of type `T` stored with [`Context::save_value`].
    pub fn get<T: Any + Send + Sync>(&self) -> Result<&T> {
        self.values
            .iter()
            .find_map(|v| v.downcast_ref::<T>())
            .ok_or_else(|| {
                Error::Autograd(format!(
                    "no value of type {} was saved in the context",
                    std::any::type_name::<T>()
                ))
            })
    }

    /// Whether forward input `i` needs a gradient (`ctx.needs_input_grad[i]`): it required
    /// grad at forward time and, in a split backward, this call computes its gradient.
    pub fn needs_input_grad(&self, i: usize) -> bool {
        self.needs_input_grad.get(i).copied().unwrap_or(false)
            && self
                .mask
                .as_ref()
                .is_none_or(|m| m.get(i).copied().unwrap_or(false))
    }

    /// Marks an output as not differentiable (`ctx.mark_non_differentiable`): it will not
    /// require grad and its gradient is always zero.
    pub fn mark_non_differentiable(&mut self, t: &Tensor) {
        self.non_differentiable.push(t.clone());
    }
}
