//! Staging of tensors for a backend, which only ever sees contiguous tensors and inputs that
//! do not share storage with outputs: strided outputs get a contiguous stand-in whose values
//! are written back into the view, strided inputs a contiguous copy, aliased inputs (an
//! in-place all-gather) a copy of their own.

use tensorplay_core::{Device, StorageElement, Tensor};

use crate::Result;

/// An output as the backend sees it: the tensor itself when contiguous, otherwise a
/// contiguous copy that [`Out::finish`] writes back into the view (only the view's elements).
pub(super) struct Out {
    view: Tensor,
    work: Option<Tensor>,
}

impl Out {
    pub(super) fn new(t: &Tensor) -> Result<Out> {
        if t.numel() == 0 || t.layout().contiguous_range().is_some() {
            return Ok(Out {
                view: t.clone(),
                work: None,
            });
        }
        let _g = tensorplay_core::autograd::no_grad();
        Ok(Out {
            view: t.clone(),
            work: Some(t.detach().contiguous()?),
        })
    }

    /// The contiguous tensor to hand to the backend.
    pub(super) fn t(&self) -> &Tensor {
        self.work.as_ref().unwrap_or(&self.view)
    }

    /// Writes the stand-in's values back into the view.
    pub(super) fn finish(self) -> Result<()> {
        let Some(w) = self.work else { return Ok(()) };
        fn back<T: StorageElement>(view: &Tensor, w: &Tensor) -> Result<()> {
            let v: Vec<T> = w.to_vec()?;
            view.with_cpu_data_mut(|s: &mut [T], l| {
                let mut it = v.iter();
                l.for_each_offset(|o| {
                    if let Some(x) = it.next() {
                        s[o] = *x;
                    }
                });
            })?;
            Ok(())
        }
        match self.view.device() {
            // the meta device has no elements: the host path's access says so
            Device::Cpu | Device::Meta => {
                tensorplay_core::with_dtype!(self.view.dtype(), T => back::<T>(&self.view, &w))
            }
            Device::Cuda(_) => {
                let _g = tensorplay_core::autograd::no_grad();
                Ok(self.view.copy_(&w)?)
            }
        }
    }
}

/// Stages each of `ts` as an [`Out`].
pub(super) fn outs(ts: &[Tensor]) -> Result<Vec<Out>> {
    ts.iter().map(Out::new).collect()
}

/// Writes every stand-in of `outs` back.
pub(super) fn finish_all(outs: Vec<Out>) -> Result<()> {
    outs.into_iter().try_for_each(Out::finish)
}

/// The tensors the backend writes, for a list of staged outputs.
pub(super) fn views(outs: &[Out]) -> Vec<Tensor> {
    outs.iter().map(|o| o.t().clone()).collect()
}

/// An input as the backend sees it: contiguous and not sharing storage with `output` (a copy
/// when it does, or when it is a strided view).
pub(super) fn input(t: &Tensor, output: Option<&Tensor>) -> Result<Tensor> {
    let aliased = output.is_some_and(|o| t.shares_storage_with(o));
    let contiguous = t.numel() == 0 || t.layout().contiguous_range().is_some();
    if contiguous && !aliased {
        return Ok(t.clone());
    }
    let _g = tensorplay_core::autograd::no_grad();
    let t = t.detach();
    if t.device().is_cuda() {
        // no device-side copy kernels yet: a round trip through the host
        return Ok(t.cpu()?.to_device(t.device())?);
    }
    if contiguous {
        Ok(t.deep_clone()?)
    } else {
        Ok(t.contiguous()?)
    }
}

/// [`input`] for each of `ts`.
pub(super) fn inputs(ts: &[Tensor]) -> Result<Vec<Tensor>> {
    ts.iter().map(|t| input(t, None)).collect()
}
