//! The contract between the operations and a device's memory (candle's `BackendStorage` is the
//! model). The CPU's kernels are the generic closures of `ops/`; another device implements
//! [`DeviceStorage`] with kernels chosen by the operation codes below. The only `match` on a
//! tensor's device is here and in `storage.rs`: operations ask [`on_device`] /
//! [`on_device2`] for the device path and fall through to the CPU's.

use std::sync::Arc;

use crate::cuda::CudaStorage;
use crate::storage::Storage;
use crate::{DType, Layout, Result, Tensor};

/// Unary elementwise operations (the kernels' `UnaryOp` codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub(crate) enum UnaryCode {
    Neg = 0,
    Exp = 1,
    Log = 2,
    Sqrt = 3,
    Abs = 4,
    Relu = 5,
    Sigmoid = 6,
    Tanh = 7,
    Gelu = 8,
    Erf = 9,
    AddScalar = 10,
    MulScalar = 11,
    DivScalar = 12,
    PowScalar = 13,
    Sign = 14,
    Not = 15,
    Square = 16,
}

/// Binary elementwise operations (the kernels' `BinaryOp` codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub(crate) enum BinaryCode {
    Add = 0,
    Sub = 1,
    Mul = 2,
    Div = 3,
    Pow = 4,
    Max = 5,
    Min = 6,
    /// `b > 0 ? a : 0`
    ReluBackward = 7,
}

/// Comparisons (the kernels' `CmpOp` codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub(crate) enum CmpCode {
    Eq = 0,
    Ne = 1,
    Lt = 2,
    Le = 3,
    Gt = 4,
    Ge = 5,
}

/// Reductions (the kernels' `ReduceOp` codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub(crate) enum ReduceCode {
    Sum = 0,
    Max = 1,
    Min = 2,
}

/// Which index kernel (see [`DeviceStorage::index`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IndexKind {
    /// `out[o, j, i] = x[o, idx[j], i]`
    Select,
    /// `out[o, j, i] = x[o, idx[o, j, i], i]`
    Gather,
}

/// The hyperparameters of one fused optimizer update (see [`DeviceStorage::sgd_step`],
/// [`DeviceStorage::adam_step`]).
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct SgdStep {
    pub(crate) lr: f64,
    pub(crate) momentum: f64,
    pub(crate) dampening: f64,
    pub(crate) weight_decay: f64,
    pub(crate) nesterov: bool,
    /// The momentum buffer starts as the gradient.
    pub(crate) first: bool,
}

/// See [`SgdStep`].
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct AdamStep {
    pub(crate) beta1: f64,
    pub(crate) beta2: f64,
    pub(crate) eps: f64,
    pub(crate) weight_decay: f64,
    pub(crate) decoupled: bool,
    /// `1 - lr * weight_decay`
    pub(crate) decay: f64,
    /// `lr / (1 - beta1^step)`
    pub(crate) step_size: f64,
    /// `sqrt(1 - beta2^step)`
    pub(crate) bias_c2_sqrt: f64,
}

/// A device's storage and its kernels. Inputs are views (storage plus [`Layout`]); every
/// method returning `Self` returns new contiguous storage on the same device. Dtype and shape
/// checks are the callers' (the operations check once for every device).
pub(crate) trait DeviceStorage: Sized {
    /// `op(x)` elementwise (dtype kept; `Not` on bool).
    fn unary(&self, l: &Layout, op: UnaryCode, scalar: f64) -> Result<Self>;
    /// `op(a, b)` elementwise; both layouts already broadcast to the output's shape.
    fn binary(&self, l: &Layout, rhs: &Self, rl: &Layout, op: BinaryCode) -> Result<Self>;
    /// `a op b` (or `a op scalar` when `rhs` is `None`) as bool.
    fn compare(
        &self,
        l: &Layout,
        rhs: Option<(&Self, &Layout)>,
        op: CmpCode,
        scalar: f64,
    ) -> Result<Self>;
    /// `cond ? a : b` with `self` the bool condition; all broadcast to the output's shape.
    fn select(&self, l: &Layout, a: (&Self, &Layout), b: (&Self, &Layout)) -> Result<Self>;
    /// The view as new contiguous storage of dtype `to`.
    fn copy_as(&self, l: &Layout, to: DType) -> Result<Self>;
    /// Writes `src`'s view (same shape) into this storage's view `l`, converting the dtype.
    fn write(&mut self, l: &Layout, src: &Self, sl: &Layout) -> Result<()>;
    /// Reduces the view over `dims` (sorted, distinct) to `m` values in the kept dims'
    /// row-major order, and for `Max`/`Min` with `with_index` the int64 positions of the
    /// winners in the reduced dims' row-major order.
    fn reduce(
        &self,
        l: &Layout,
        dims: &[usize],
        op: ReduceCode,
        with_index: bool,
    ) -> Result<(Self, Option<Self>)>;
    /// Batched matrix product of 3-d views `[batch|1, m, k] @ [batch|1, k, n]` (float only).
    fn matmul(&self, l: &Layout, rhs: &Self, rl: &Layout, batch: usize) -> Result<Self>;
    /// `index_select`/`gather` over contiguous `self` and int64 `idx` seen as
    /// `[outer, size, inner]` around the indexed dim with `count` indices along it.
    fn index(
        &self,
        kind: IndexKind,
        idx: &Self,
        dims: (usize, usize, usize, usize),
    ) -> Result<Self>;
    /// `self[o, idx[o, j, i], i] += src[o, j, i]` in place (contiguous operands).
    fn scatter_add(
        &mut self,
        idx: &Self,
        src: &Self,
        dims: (usize, usize, usize, usize),
    ) -> Result<()>;
    /// Row-wise cross-entropy of contiguous logits `[rows, classes]` with int64 targets:
    /// (losses `[rows]`, softmax probabilities `[rows, classes]`).
    fn cross_entropy(&self, target: &Self, rows: usize, classes: usize) -> Result<(Self, Self)>;
    /// A bool keep-mask of `n` elements on this storage's device: Philox-4x32-10 uniforms at
    /// (`seed`, `offset`) at least `p`.
    fn dropout_mask(&self, n: usize, seed: u64, offset: u64, p: f64) -> Result<Self>;
    /// One fused SGD update of the first `n` elements of the parameter `self` with `grad`, and
    /// the momentum buffer when momentum is on (all contiguous from offset 0).
    fn sgd_step(
        &mut self,
        n: usize,
        grad: &Self,
        buf: Option<&mut Self>,
        h: &SgdStep,
    ) -> Result<()>;
    /// One fused Adam/AdamW update of the first `n` elements of the parameter `self`.
    fn adam_step(
        &mut self,
        n: usize,
        grad: &Self,
        m: &mut Self,
        v: &mut Self,
        vmax: Option<&mut Self>,
        h: &AdamStep,
    ) -> Result<()>;
    /// `n` zeros of `dtype` on this storage's device.
    fn zeros_like_device(&self, dtype: DType, n: usize) -> Result<Self>;
    /// A copy of host data on this storage's device.
    fn upload(&self, data: &crate::CpuStorage) -> Result<Self>;
}

/// Runs `f` on `t`'s device storage and view when `t` is not on the host; `None` for host
/// tensors (the caller's CPU path runs).
pub(crate) fn on_device<R>(
    t: &Tensor,
    f: impl FnOnce(&CudaStorage, &Layout) -> Result<R>,
) -> Option<Result<R>> {
    let g = t.0.storage.read();
    match &*g {
        // a meta tensor takes the host path, whose element access names the operation
        Storage::Cpu(_) | Storage::Meta(_) => None,
        Storage::Cuda(c) => Some(f(c, t.layout())),
    }
}

/// Like [`on_device`] for two tensors on the same device (checked by the caller); a storage
/// shared by both is locked once.
pub(crate) fn on_device2<R>(
    a: &Tensor,
    b: &Tensor,
    f: impl FnOnce(&CudaStorage, &Layout, &CudaStorage, &Layout) -> Result<R>,
) -> Option<Result<R>> {
    if Arc::ptr_eq(&a.0.storage, &b.0.storage) {
        return on_device(a, |c, la| f(c, la, c, b.layout()));
    }
    let ga = a.0.storage.read();
    let gb = b.0.storage.read();
    match (&*ga, &*gb) {
        (Storage::Cuda(ca), Storage::Cuda(cb)) => Some(f(ca, a.layout(), cb, b.layout())),
        _ => None,
    }
}

/// Runs `f` on `t`'s device storage mutably (bumping its version) when `t` is not on the
/// host; `None` for host tensors.
pub(crate) fn on_device_mut<R>(
    t: &Tensor,
    f: impl FnOnce(&mut CudaStorage, &Layout) -> Result<R>,
) -> Option<Result<R>> {
    if !t.device().is_cuda() {
        return None;
    }
    let mut g = t.0.storage.write();
    match &mut *g {
        Storage::Cpu(_) | Storage::Meta(_) => None,
        Storage::Cuda(c) => Some(f(c, t.layout())),
    }
}

/// New device storage as a contiguous tensor of `shape`.
pub(crate) fn device_tensor(s: CudaStorage, shape: &[usize]) -> Tensor {
    Tensor::from_storage(Storage::Cuda(s), shape)
}
