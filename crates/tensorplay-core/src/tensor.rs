//! The tensor handle.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::autograd::graph::{Edge, Node};
use crate::layout::Layout;
use crate::storage::{CpuStorage, Storage, StorageCell, StorageElement};
use crate::{DType, Device, Error, Result};

static NEXT_TENSOR_ID: AtomicU64 = AtomicU64::new(1);

/// A process-unique identifier of a tensor handle (views and aliases get their own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(u64);

impl TensorId {
    pub(crate) fn next() -> TensorId {
        TensorId(NEXT_TENSOR_ID.fetch_add(1, Ordering::Relaxed))
    }
    /// The raw number.
    pub fn as_u64(self) -> u64 {
        self.0
    }
}

/// An n-dimensional array with autograd, like `torch.Tensor`.
///
/// `Tensor` is a cheap-to-clone shared handle (`Arc` inside): cloning shares the storage and the
/// autograd identity, exactly as binding a Python name does. It is `Send + Sync`.
///
/// ```
/// use tensorplay as tp;
/// let x = tp::Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3])?.requires_grad_(true);
/// let y = x.mul(&x)?.sum()?;          // y = sum(x^2)
/// y.backward()?;
/// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![2.0, 4.0, 6.0]);
/// # Ok::<(), tp::Error>(())
/// ```
#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<TensorImpl>);

pub(crate) struct TensorImpl {
    pub(crate) id: TensorId,
    pub(crate) storage: Arc<StorageCell>,
    pub(crate) layout: Layout,
    pub(crate) dtype: DType,
    pub(crate) meta: Mutex<AutogradMeta>,
}

#[derive(Default)]
pub(crate) struct AutogradMeta {
    /// Leaf flag: set by `requires_grad_`.
    pub(crate) requires_grad: bool,
    pub(crate) grad: Option<Tensor>,
    /// The node that produced this tensor, and which of its outputs it is.
    pub(crate) grad_fn: Option<Edge>,
    /// Cached accumulate-grad node of a leaf.
    pub(crate) grad_accumulator: Weak<Node>,
    pub(crate) retains_grad: bool,
    /// Hooks registered on this leaf: kept here because the accumulate-grad node is only
    /// held weakly, and given to every accumulator created for the leaf.
    pub(crate) leaf_hooks: Vec<crate::autograd::Hook>,
    /// Hooks run after a backward pass accumulated into this leaf's `.grad`, with their ids.
    pub(crate) post_accumulate_hooks: Vec<(u64, crate::autograd::PostAccumulateGradHook)>,
    /// Set by [`Tensor::mark_sharded`]: the API whose shard this tensor is.
    pub(crate) sharded_by: Option<&'static str>,
    /// Set by [`Tensor::mark_grad_pending`]: why `.grad` is not complete yet.
    pub(crate) grad_pending: Option<&'static str>,
    /// Set by [`Tensor::mark_rows_of`]: the whole tensor's shape and this one's first row.
    pub(crate) rows_of: Option<(Vec<usize>, usize)>,
    /// Set by [`Tensor::set_local_shard`]: the tensor holding this one's values on this rank.
    pub(crate) local_shard: Option<Tensor>,
}

impl Tensor {
    pub(crate) fn from_cell(storage: Arc<StorageCell>, layout: Layout, dtype: DType) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            id: TensorId::next(),
            storage,
            layout,
            dtype,
            meta: Mutex::new(AutogradMeta::default()),
        }))
    }

    /// A contiguous tensor over new storage.
    pub(crate) fn from_storage(storage: Storage, shape: &[usize]) -> Tensor {
        let dtype = storage.dtype();
        Tensor::from_cell(
            Arc::new(StorageCell::new(storage)),
            Layout::contiguous(shape),
            dtype,
        )
    }

    pub(crate) fn from_cpu(storage: CpuStorage, shape: &[usize]) -> Tensor {
        Tensor::from_storage(Storage::Cpu(storage), shape)
    }

    /// A tensor of `shape` holding `data` in row-major order; errors when the lengths differ.
    pub fn from_vec<T: StorageElement>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        let n = crate::layout::checked_numel(shape, "from_vec")?;
        if n != data.len() {
            return Err(Error::invalid(
                "from_vec",
                "shape",
                format!("a shape with {} elements", data.len()),
                format!("{shape:?} ({n} elements)"),
            ));
        }
        Ok(Tensor::from_cpu(T::into_storage(data), shape))
    }

    /// Like [`Tensor::from_vec`], copying from a slice.
    pub fn from_slice<T: StorageElement>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        Tensor::from_vec(data.to_vec(), shape)
    }

    /// A 0-dimensional tensor holding `v`.
    pub fn scalar<T: StorageElement>(v: T) -> Tensor {
        Tensor::from_cpu(T::into_storage(vec![v]), &[])
    }

    /// A new handle viewing the same storage with another layout; carries no autograd history.
    pub(crate) fn view_with_layout(&self, layout: Layout) -> Tensor {
        Tensor::from_cell(self.0.storage.clone(), layout, self.0.dtype)
    }

    /// The process-unique id of this handle.
    pub fn id(&self) -> TensorId {
        self.0.id
    }
    /// The shape (`torch.Tensor.shape`).
    pub fn shape(&self) -> &[usize] {
        &self.0.layout.shape
    }
    /// Alias of [`Tensor::shape`].
    pub fn dims(&self) -> &[usize] {
        self.shape()
    }
    /// The size of dimension `dim` (negative counts from the end).
    pub fn size(&self, dim: isize) -> Result<usize> {
        let d = crate::layout::normalize_dim(dim, self.ndim(), "size")?;
        Ok(self.shape().get(d).copied().unwrap_or(1))
    }
    /// Strides in elements.
    pub fn strides(&self) -> &[usize] {
        &self.0.layout.strides
    }
    /// The layout (shape, strides, offset).
    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }
    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.0.layout.shape.len()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }
    /// The device the storage lives on.
    pub fn device(&self) -> Device {
        self.0.storage.device()
    }
    /// Whether the elements are row-major without gaps.
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }
    /// Whether `self` and `other` view the same storage.
    pub fn shares_storage_with(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }
    /// The storage's version counter (bumped by every in-place write).
    pub fn version(&self) -> u64 {
        self.0.storage.version()
    }

    /// Runs `f` and then puts the storage's version counter back to what it was, so that the
    /// writes `f` makes do not invalidate the tensors autograd saved for backward (PyTorch's
    /// `torch.autograd._unsafe_preserve_version_counter`). For writes that restore the values
    /// autograd saw, such as fully sharded data parallelism refilling a gathered parameter;
    /// anything else makes backward silently use the new values.
    pub fn preserve_version_counter<R>(&self, f: impl FnOnce() -> R) -> R {
        let v = self.0.storage.version();
        let r = f();
        self.0.storage.set_version(v);
        r
    }

    /// Resizes the host storage this tensor views to `numel` elements of its dtype
    /// (`tensor.untyped_storage().resize_(numel * itemsize)`): `0` frees the memory while the
    /// tensor, its views and the tensors autograd saved live on; resizing back gives new
    /// memory whose values are unspecified until written. Every view of the storage sees the
    /// change; reading or writing one whose elements lie past the new end is an
    /// [`Error::InvalidArgument`] saying the storage was freed, never a read of other memory.
    /// The version counter is not bumped. [`crate::memory::allocated_bytes`] follows.
    ///
    /// Fully sharded data parallelism frees the unsharded parameters this way between uses.
    ///
    /// Errors: [`Error::NotSupported`] for a CUDA tensor.
    pub fn resize_storage_(&self, numel: usize) -> Result<()> {
        self.0.storage.resize(numel)
    }

    /// Marks this tensor as one rank's shard of a larger tensor, made by `by` (`"fully_shard"`),
    /// so that whole-tensor operations that would silently give a per-rank answer refuse it:
    /// [`crate::nn::utils::clip_grad_norm_`] errors and names the sharded counterpart.
    pub fn mark_sharded(&self, by: &'static str) {
        self.meta().sharded_by = Some(by);
    }

    /// The API whose shard this tensor is ([`Tensor::mark_sharded`]), if any.
    pub fn sharded_by(&self) -> Option<&'static str> {
        self.meta().sharded_by
    }

    /// Records that this tensor holds rows `first_row..first_row + self.shape()[0]` of a
    /// tensor of shape `whole` (a dimension-0 shard, as `fully_shard` cuts them), so that
    /// [`crate::nn::init`] fills it with exactly the values those rows of the whole tensor
    /// would get. A 0-d whole tensor is seen as one row of one element.
    pub fn mark_rows_of(&self, whole: &[usize], first_row: usize) {
        self.meta().rows_of = Some((whole.to_vec(), first_row));
    }

    /// What [`Tensor::mark_rows_of`] recorded: the whole tensor's shape and the first row.
    pub fn rows_of(&self) -> Option<(Vec<usize>, usize)> {
        self.meta().rows_of.clone()
    }

    /// Records that this tensor's values live in `shard` on this rank (a fully sharded
    /// module's parameter, whose own storage is freed between uses, and its shard marked with
    /// [`Tensor::mark_rows_of`]): [`crate::nn::init`] and [`crate::nn::Module::to_empty`]
    /// reach the shard through it. `None` removes the link.
    pub fn set_local_shard(&self, shard: Option<Tensor>) {
        self.meta().local_shard = shard;
    }

    /// The tensor [`Tensor::set_local_shard`] recorded, if any.
    pub fn local_shard(&self) -> Option<Tensor> {
        self.meta().local_shard.clone()
    }

    /// Gives this tensor's storage memory on `device` if it is on the meta device: zeros,
    /// in place, so every handle and view of it (and a fully sharded module's bookkeeping)
    /// sees the same tensor, now with elements. A no-op for a tensor that has memory.
    /// [`crate::nn::Module::to_empty`] calls it on every parameter and buffer.
    ///
    /// Errors when the memory cannot be allocated or a CUDA device cannot be used.
    pub(crate) fn materialize(&self, device: Device) -> Result<()> {
        self.0.storage.materialize(device)
    }

    /// Marks this tensor's `.grad` as not complete yet (`Some(why)`: a reduction still in
    /// flight, such as fully_shard's after `set_is_last_backward(false)`), or complete again
    /// (`None`). [`crate::optim::Optimizer::step`] refuses parameters so marked, naming `why`,
    /// instead of stepping without their gradient.
    pub fn mark_grad_pending(&self, why: Option<&'static str>) {
        self.meta().grad_pending = why;
    }

    /// Why this tensor's `.grad` is not complete yet ([`Tensor::mark_grad_pending`]), if so.
    pub fn grad_pending(&self) -> Option<&'static str> {
        self.meta().grad_pending
    }

    /// Elements of the storage this tensor views (all of it, not only this view's).
    pub fn storage_numel(&self) -> usize {
        self.0.storage.read_len()
    }

    pub(crate) fn meta(&self) -> MutexGuard<'_, AutogradMeta> {
        self.0.meta.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the elements (as stored, with this view's layout). CPU only.
    pub(crate) fn with_slice<T: StorageElement, R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&[T], &Layout) -> R,
    ) -> Result<R> {
        let guard = self.0.storage.read();
        match &*guard {
            Storage::Cpu(c) => {
                check_extent(c.len(), &self.0.layout, op)?;
                let s = T::slice(c).ok_or_else(|| Error::UnsupportedDType {
                    op,
                    dtype: c.dtype(),
                    expected: "the dtype the operation was dispatched on",
                })?;
                Ok(f(s, &self.0.layout))
            }
            other => Err(not_on_host(op, other)),
        }
    }

    /// Runs `f` on mutable elements; bumps the version counter. CPU only.
    pub(crate) fn with_slice_mut<T: StorageElement, R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut [T], &Layout) -> R,
    ) -> Result<R> {
        let mut guard = self.0.storage.write();
        match &mut *guard {
            Storage::Cpu(c) => {
                check_extent(c.len(), &self.0.layout, op)?;
                let dt = c.dtype();
                let s = T::slice_mut(c).ok_or(Error::UnsupportedDType {
                    op,
                    dtype: dt,
                    expected: "the dtype the operation was dispatched on",
                })?;
                Ok(f(s, &self.0.layout))
            }
            other => Err(not_on_host(op, other)),
        }
    }

    /// Low-level access for communication layers: runs `f` on the host elements as stored
    /// (`f` receives the whole storage slice and this view's [`Layout`]; the view's elements
    /// are at `layout.for_each_offset`). Errors with `UnsupportedDType` when `T` is not the
    /// dtype and `NotSupported` for CUDA tensors. Holds a read lock on the storage while `f`
    /// runs; does not record autograd history.
    pub fn with_cpu_data<T: StorageElement, R>(
        &self,
        f: impl FnOnce(&[T], &Layout) -> R,
    ) -> Result<R> {
        self.with_slice("with_cpu_data", f)
    }

    /// Like [`Tensor::with_cpu_data`] with mutable elements, for in-place collectives. Holds
    /// the storage's write lock while `f` runs and bumps the version counter, so tensors saved
    /// for backward notice the write. `f` must only write inside this view's elements.
    pub fn with_cpu_data_mut<T: StorageElement, R>(
        &self,
        f: impl FnOnce(&mut [T], &Layout) -> R,
    ) -> Result<R> {
        self.with_slice_mut("with_cpu_data_mut", f)
    }

    /// Low-level access to the storage of any device (the NCCL backend's entry point):
    /// runs `f` with the storage and this view's layout under the storage's read lock.
    pub fn with_storage<R>(&self, f: impl FnOnce(&Storage, &Layout) -> R) -> R {
        let g = self.0.storage.read();
        f(&g, &self.0.layout)
    }

    /// Like [`Tensor::with_storage`] with the write lock; bumps the version counter.
    pub fn with_storage_mut<R>(&self, f: impl FnOnce(&mut Storage, &Layout) -> R) -> R {
        let mut g = self.0.storage.write();
        f(&mut g, &self.0.layout)
    }

    /// A contiguous tensor over the given storage (all of it, row-major with `shape`); errors
    /// when the storage's length is not the product of `shape`.
    pub fn from_storage_checked(storage: Storage, shape: &[usize]) -> Result<Tensor> {
        let len = storage.len();
        let n: usize = shape.iter().product();
        if n != len {
            return Err(Error::invalid(
                "from_storage",
                "shape",
                format!("a shape with {len} elements"),
                format!("{shape:?}"),
            ));
        }
        Ok(Tensor::from_storage(storage, shape))
    }

    /// The elements in row-major order as a `Vec<T>`; errors when `T` is not the dtype.
    /// CUDA tensors are copied to the host first.
    pub fn to_vec<T: StorageElement>(&self) -> Result<Vec<T>> {
        if self.dtype() != T::DTYPE {
            return Err(Error::DTypeMismatch {
                op: "to_vec",
                lhs: self.dtype(),
                rhs: T::DTYPE,
            });
        }
        if self.device().is_cuda() {
            return self.to_device(Device::Cpu)?.to_vec();
        }
        self.with_slice("to_vec", |s: &[T], l| {
            if let Some(r) = l.contiguous_range() {
                s[r].to_vec()
            } else {
                let mut v = Vec::with_capacity(l.numel());
                l.for_each_offset(|o| v.push(s[o]));
                v
            }
        })
    }

    /// The elements converted to `f64` in row-major order (any dtype).
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        self.to_dtype(DType::F64)?.to_vec::<f64>()
    }

    /// The single element of a one-element tensor (`torch.Tensor.item`), converted to `T`
    /// when the dtype differs (`x.item::<f64>()` works on a float32 tensor).
    pub fn item<T: StorageElement>(&self) -> Result<T> {
        if self.numel() != 1 {
            return Err(Error::invalid(
                "item",
                "self",
                "a tensor with exactly one element",
                format!("shape {:?}", self.shape()),
            ));
        }
        if self.dtype() == T::DTYPE {
            return Ok(self.to_vec::<T>()?[0]);
        }
        // like Python's `tensor.item()`, any dtype converts to the requested number type
        Ok(T::from_f64(self.to_dtype(DType::F64)?.to_vec::<f64>()?[0]))
    }

    /// The single element converted to `f64`.
    pub fn item_f64(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::invalid(
                "item",
                "self",
                "a tensor with exactly one element",
                format!("shape {:?}", self.shape()),
            ));
        }
        Ok(self.to_vec_f64()?[0])
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tensor(shape={:?}, dtype={}, device={}",
            self.shape(),
            self.dtype(),
            self.device()
        )?;
        if self.numel() <= 16
            && self.device() == Device::Cpu
            && let Ok(v) = self.to_vec_f64()
        {
            write!(f, ", data={v:?}")?;
        }
        if self.requires_grad() {
            write!(f, ", requires_grad=true")?;
        }
        write!(f, ")")
    }
}

/// An error when a view's elements reach past its storage's `len` elements (the storage was
/// shrunk by [`Tensor::resize_storage_`]): kernels index the storage by the layout's offsets.
/// The error of an operation that needs host elements and got `s`, which is not host memory.
pub(crate) fn not_on_host(op: &'static str, s: &Storage) -> Error {
    match s {
        Storage::Meta(_) => Error::MetaTensor { op },
        Storage::Cpu(_) | Storage::Cuda(_) => Error::NotSupported {
            op,
            detail: "on CUDA tensors yet (move the tensor to the CPU with .to(\"cpu\"))".into(),
        },
    }
}

pub(crate) fn check_extent(len: usize, layout: &Layout, op: &'static str) -> Result<()> {
    let need = layout.storage_extent();
    if need > len {
        return Err(Error::invalid(
            op,
            "tensor",
            format!("a tensor whose storage holds its elements ({need} needed)"),
            format!(
                "a storage of {len} elements: it was freed or shrunk by resize_storage_ (a fully \
                 sharded parameter is freed between uses: run the module with `call`, whose \
                 hooks gather it, not `forward`; read it inside unshard(); or use the shard that \
                 parameters() lists)"
            ),
        ));
    }
    Ok(())
}
