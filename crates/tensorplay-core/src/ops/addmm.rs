//! `linear`'s product with its bias added inside the matrix product (`addmm`): the output
//! rows start as the bias and `gemm` accumulates the product onto them, one pass over the
//! output instead of a product and then a broadcast add.

use super::float_dispatch;
use super::matmul::gemm_into;
use crate::autograd::{Context, Function, apply};
use crate::storage::StorageElement;
use crate::storage::pool::take;
use crate::{Device, Result, Tensor};

/// `x @ weight^T + bias` for a 2-d `x` `[M, K]`, `weight` `[N, K]` and `bias` `[N]` on the
/// CPU, all of one float dtype (the caller, `linear`, checked the shapes and dtypes).
struct Addmm;

impl Function for Addmm {
    fn name(&self) -> &str {
        "AddmmBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (x, w, b) = (inputs[0], inputs[1], inputs[2].contiguous()?);
        ctx.save_for_backward(&[x, w]);
        let (m, k, n) = (x.shape()[0], x.shape()[1], w.shape()[0]);
        let (lx, lw) = (x.layout().clone(), w.layout().clone());
        float_dispatch!(x.dtype(), "linear", T => {
            let bias: Vec<T> = b.to_vec()?;
            let v = super::with_two(x, w, "linear", |sx: &[T], _, sw: &[T], _| {
                let mut out = take::<T>(m * n);
                // whole rows per piece, on the intra-op threads for large outputs
                if let Some(per) = crate::kernels::ELEMENTWISE_CHUNK.checked_div(n) {
                    crate::kernels::for_each_chunk(&mut out, per.max(1) * n, m * n, |_, rows| {
                        for row in rows.chunks_exact_mut(n) {
                            row.copy_from_slice(&bias);
                        }
                    });
                }
                // the weight's transpose: (k, n) walked by (column, row) strides of [N, K]
                gemm_into(
                    &mut out,
                    (m, n, k),
                    (&sx[lx.offset..], lx.strides[0] as isize, lx.strides[1] as isize),
                    (&sw[lw.offset..], lw.strides[1] as isize, lw.strides[0] as isize),
                    true,
                );
                out
            })?;
            Ok(vec![Tensor::from_cpu(T::into_storage(v), &[m, n])])
        })
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let s = ctx.saved_tensors()?;
        let (x, w, g) = (&s[0], &s[1], &g[0]);
        let gx = if ctx.needs_input_grad(0) {
            Some(g.matmul(w)?)
        } else {
            None
        };
        // `(g^T x)`: the weight's gradient comes out contiguous, `[N, K]`
        let gw = if ctx.needs_input_grad(1) {
            Some(g.t()?.matmul(x)?)
        } else {
            None
        };
        let gb = if ctx.needs_input_grad(2) {
            Some(g.sum_dims(&[0], false)?)
        } else {
            None
        };
        Ok(vec![gx, gw, gb])
    }
}

/// `x @ weight^T + bias` in one product when every operand is a float CPU tensor and `x` is
/// 2-d; `None` for the composed path (other devices).
pub(crate) fn addmm(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Option<Tensor>> {
    let cpu = [x, weight, bias].iter().all(|t| t.device() == Device::Cpu);
    if !cpu || x.ndim() != 2 || !x.dtype().is_float() {
        return Ok(None);
    }
    Ok(Some(apply(Addmm, &[x, weight, bias])?.remove(0)))
}
