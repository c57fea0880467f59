//! In-place updates of [`Tensor`] (`add_`, `copy_`, `fill_`, ...): the write through a view's
//! layout and the autograd history the overwritten tensor takes.

use crate::autograd::{Context, Function, apply, is_grad_enabled};
use crate::backend::DeviceStorage as _;
use crate::layout::Layout;
use crate::ops::{any_dispatch, gather_strided, same_device};
use crate::{Error, Result, Tensor};

/// The history an overwritten tensor takes when the new values do not require grad: the
/// identity forward, and a zero gradient for the old values (PyTorch's `FillBackward` /
/// `CopyBackwards`).
struct DiscardHistory;
impl Function for DiscardHistory {
    fn name(&self) -> &str {
        "CopyBackwards"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![inputs[0].detach()])
    }
    fn backward(&self, _ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(g[0].zeros_like()?)])
    }
}

impl Tensor {
    /// Writes `value` (already of `self`'s shape and dtype) into `self`'s storage through its
    /// layout, and, when recording, makes `self` take `value`'s autograd history (or, when
    /// `value` has none but `self` had one, a history that sends zero gradient to the
    /// overwritten values).
    ///
    /// `value` is read completely before `self` is written, so sources that alias `self`
    /// (`x.copy_(&x.t())`) give the right result. Errors when `self` is a leaf that requires
    /// grad (while recording), or when several of its elements share one memory location (an
    /// expanded view).
    fn assign_inplace(&self, op: &'static str, value: Tensor) -> Result<()> {
        let recording = is_grad_enabled();
        if recording && self.requires_grad() && self.is_leaf() {
            return Err(Error::Autograd(format!(
                "{op}: a leaf tensor that requires grad is being used in an in-place \
                 operation; wrap it in no_grad() or use an out-of-place operation"
            )));
        }
        let l = self.layout();
        if l.shape
            .iter()
            .zip(&l.strides)
            .any(|(&n, &st)| n > 1 && st == 0)
        {
            return Err(Error::invalid(
                op,
                "self",
                "a tensor whose elements do not share memory (not an expanded view; \
                 clone it first)",
                format!("strides {:?} for shape {:?}", l.strides, l.shape),
            ));
        }
        let value = value.expand(self.shape())?;
        // a leaf source gets a node of its own, so that `self` does not share the leaf's
        // accumulator as its grad_fn
        let value = if recording && value.requires_grad() && value.is_leaf() {
            value.deep_clone()?
        } else {
            value
        };
        let history = if !recording {
            None
        } else if value.requires_grad() {
            Some(value.meta().grad_fn.clone())
        } else if self.requires_grad() {
            let cut = apply(DiscardHistory, &[self])?.remove(0);
            let edge = cut.meta().grad_fn.clone();
            Some(edge)
        } else {
            None
        };
        same_device(op, self, &value)?;
        // the source is copied out first: it may alias `self`
        let staged = crate::backend::on_device(&value, |c, l| c.copy_as(l, self.dtype()));
        if let Some(staged) = staged {
            let staged = staged?;
            let sl = Layout::contiguous(self.shape());
            crate::backend::on_device_mut(self, |d, l| d.write(l, &staged, &sl)).unwrap_or_else(
                || {
                    Err(Error::DeviceMismatch {
                        op,
                        lhs: self.device(),
                        rhs: value.device(),
                    })
                },
            )?;
            if let Some(edge) = history {
                self.meta().grad_fn = edge;
            }
            return Ok(());
        }
        any_dispatch!(self.dtype(), T => {
            let src: Vec<T> = value.with_slice(op, |s: &[T], l| gather_strided(s, l))?;
            self.with_slice_mut(op, |d: &mut [T], l: &Layout| {
                if let Some(r) = l.contiguous_range() {
                    d[r].copy_from_slice(&src);
                } else {
                    let mut it = src.iter();
                    l.for_each_offset(|o| {
                        if let Some(v) = it.next() { d[o] = *v; }
                    });
                }
            })?;
            crate::storage::pool::give_back(src);
        });
        if let Some(edge) = history {
            self.meta().grad_fn = edge;
        }
        Ok(())
    }

    fn inplace_result(&self, op: &'static str, r: Tensor) -> Result<()> {
        if r.shape() != self.shape() {
            return Err(Error::ShapeMismatch {
                op,
                lhs: self.shape().to_vec(),
                rhs: r.shape().to_vec(),
            });
        }
        let r = if r.dtype() != self.dtype() {
            if !self.dtype().is_float() && r.dtype().is_float() {
                return Err(Error::DTypeMismatch {
                    op,
                    lhs: self.dtype(),
                    rhs: r.dtype(),
                });
            }
            r.to_dtype(self.dtype())?
        } else {
            r
        };
        self.assign_inplace(op, r)
    }

    /// In-place `self += other` (broadcast to `self`'s shape). Bumps the version counter.
    pub fn add_(&self, other: &Tensor) -> Result<()> {
        self.inplace_result("add_", self.add(other)?)
    }
    /// In-place `self -= other`.
    pub fn sub_(&self, other: &Tensor) -> Result<()> {
        self.inplace_result("sub_", self.sub(other)?)
    }
    /// In-place `self *= other`.
    pub fn mul_(&self, other: &Tensor) -> Result<()> {
        self.inplace_result("mul_", self.mul(other)?)
    }
    /// In-place `self /= other`.
    pub fn div_(&self, other: &Tensor) -> Result<()> {
        self.inplace_result("div_", self.div(other)?)
    }
    /// In-place `self *= value`.
    pub fn mul_scalar_(&self, value: f64) -> Result<()> {
        self.inplace_result("mul_", self.mul_scalar(value)?)
    }
    /// In-place `self += value`.
    pub fn add_scalar_(&self, value: f64) -> Result<()> {
        self.inplace_result("add_", self.add_scalar(value)?)
    }
    /// Copies `src` into `self` (`copy_`), broadcasting `src` to `self`'s shape and converting
    /// its dtype; errors if the shapes do not broadcast.
    pub fn copy_(&self, src: &Tensor) -> Result<()> {
        let s = src.to_dtype(self.dtype())?;
        let s = if s.device() != self.device() {
            s.to_device(self.device())?
        } else {
            s
        };
        self.assign_inplace("copy_", s)
    }
    /// Sets every element to `value` (`fill_`). Errors like the other in-place operations,
    /// and when `value` does not fit an int64 tensor (NaN, infinite, out of range).
    pub fn fill_(&self, value: f64) -> Result<()> {
        crate::ops::creation::check_fill_value("fill_", value, self.dtype())?;
        let v = Tensor::full(&[], value, (self.dtype(), self.device()))?;
        self.assign_inplace("fill_", v)
    }
    /// Sets every element to zero (`zero_`).
    pub fn zero_(&self) -> Result<()> {
        self.fill_(0.0)
    }
}
