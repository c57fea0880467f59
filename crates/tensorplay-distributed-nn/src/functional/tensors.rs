//! The tensors a differentiable collective moves: argument checks, row-major copies, and
//! failing together (a rank whose own arguments are bad still joins the collective, so that
//! every rank fails the call instead of hanging).

use super::MAX_DIMS;
use super::group::Grp;
use tensorplay_collectives as coll;
use tensorplay_core::{DType, Device, Result, Tensor, TensorOptions};

/// Checks a tensor argument: a dtype the collectives move and at most [`MAX_DIMS`](super::MAX_DIMS) dims.
pub(super) fn check_tensor(gp: &Grp, op: &str, arg: &str, t: &Tensor) -> coll::Result<()> {
    if !matches!(
        t.dtype(),
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 | DType::I64
    ) {
        return Err(gp.err(
            op,
            arg,
            "a float32, float64, bfloat16, float16 or int64 tensor",
            t.dtype(),
        ));
    }
    if t.ndim() > MAX_DIMS {
        return Err(gp.err(
            op,
            arg,
            format!("a tensor of at most {MAX_DIMS} dimensions"),
            format!("shape {:?}", t.shape()),
        ));
    }
    Ok(())
}

/// This rank's own work before a blocking collective that has no exchange of its own here
/// failed (`r` is an error: a bad argument, a tensor too big to copy): `run` joins that
/// collective with a tensor it refuses, so that its cross-rank check fails the call on every
/// rank (the others naming this one) and the ranks stay in step. Returns `r`.
pub(super) fn joined<T>(r: Result<T>, run: impl FnOnce(&Tensor) -> coll::Result<()>) -> Result<T> {
    if r.is_err() {
        let _ng = tensorplay_core::no_grad();
        if let Ok(refused) = Tensor::zeros(&[0], (DType::Bool, Device::Cpu)) {
            let _ = run(&refused);
        }
    }
    r
}

/// [`joined`] for this rank's own argument error `e`.
pub(super) fn fail_together(
    e: coll::Error,
    run: impl FnOnce(&Tensor) -> coll::Result<()>,
) -> Result<Tensor> {
    joined(Err(e.into()), run)
}

/// A row-major copy with its own storage (logical order, whatever `t`'s strides).
pub(super) fn fresh(t: &Tensor) -> Result<Tensor> {
    if t.device().is_cuda() || t.is_contiguous() {
        // on a device the copy is one kernel, and an allocation too large fails as an error
        t.detach().deep_clone()
    } else {
        // an expanded view may stand for more elements than fit in memory: allocate the copy
        // first, which fails with an error (the core's strided copy would abort the process)
        let y = zeros(t.shape(), t.dtype(), t.device())?;
        y.copy_(&t.detach())?;
        Ok(y)
    }
}

pub(super) fn zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    Tensor::zeros(shape, TensorOptions { dtype, device })
}

pub(super) fn fmt_shape(s: &[usize]) -> String {
    format!("{s:?}")
}
