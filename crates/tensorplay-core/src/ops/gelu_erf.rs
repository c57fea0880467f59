//! Exact GELU (`torch.nn.functional.gelu(x)`, `approximate='none'`): `x Phi(x) = 0.5 x (1 +
//! erf(x / sqrt(2)))`, with `Phi` the standard normal CDF.
//!
//! On the CPU the forward and the first-order backward are one vectorised pass each over the
//! elements (`erf` and `exp` from `kernels::math`). A backward that is itself recorded
//! (`create_graph`) is composed of differentiable operations, so second derivatives work; CUDA
//! tensors take the elementwise `gelu` operation instead of this function.

use crate::autograd::{Context, Function, apply, is_grad_enabled};
use crate::kernels::{self, Map};
use crate::ops::elementwise::{kernel_map, kernel_zip};
use crate::{Error, Result, Tensor};

/// `d gelu / dx = Phi(x) + x phi(x)` at `x`, composed of differentiable operations (also the
/// unary op's composed backward).
pub(crate) fn slope(x: &Tensor) -> Result<Tensor> {
    let cdf = x
        .mul_scalar(std::f64::consts::FRAC_1_SQRT_2)?
        .erf()?
        .add_scalar(1.0)?
        .mul_scalar(0.5)?;
    let pdf = x
        .mul(x)?
        .mul_scalar(-0.5)?
        .exp()?
        .mul_scalar(1.0 / (2.0 * std::f64::consts::PI).sqrt())?;
    cdf.add(&x.mul(&pdf)?)
}

struct GeluErf;
impl Function for GeluErf {
    fn name(&self) -> &str {
        "GeluBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        ctx.save_for_backward(&[inputs[0]]);
        Ok(vec![kernel_map(inputs[0], "gelu", Map::GeluErf)?])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let x = ctx.saved_tensors()?.remove(0);
        let g = &g[0];
        if !is_grad_enabled() && g.shape() == x.shape() && g.dtype() == x.dtype() {
            let dx = kernel_zip(
                &x.detach(),
                g,
                "gelu_backward",
                kernels::gelu_erf_backward,
                kernels::gelu_erf_backward,
            )?;
            return Ok(vec![Some(dx)]);
        }
        Ok(vec![Some(g.mul(&slope(&x)?)?)])
    }
}

/// Exact GELU of a float host tensor through the fused kernels (see the module's comment).
pub(crate) fn gelu(x: &Tensor) -> Result<Tensor> {
    if !x.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op: "gelu",
            dtype: x.dtype(),
            expected: "a floating dtype (float32, float64, bfloat16 or float16)",
        });
    }
    Ok(apply(GeluErf, &[x])?.remove(0))
}
