//! The tanh approximation of GELU (`torch.nn.functional.gelu(x, approximate='tanh')`, the form
//! GPT-2 uses): `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
//!
//! On the CPU forward and backward are one vectorised pass each over the elements (the gate
//! `0.5 (1 + tanh(u))` computed as `1 / (1 + e^(-2u))`, one `exp`); on other devices they are
//! composed of the elementwise operations (so they run wherever those run).

use crate::autograd::{Context, Function, apply};
use crate::kernels::{self, Map};
use crate::ops::elementwise::{kernel_map, kernel_zip};
use crate::{Error, Result, Tensor};

/// `sqrt(2 / pi)`.
const K: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient.
const C: f64 = 0.044_715;

/// The forward on any device: one pass on the CPU, composed elsewhere.
fn forward(x: &Tensor) -> Result<Tensor> {
    if !x.device().is_cuda() {
        return kernel_map(x, "gelu_tanh", Map::GeluTanh);
    }
    let inner = x.pow_scalar(3.0)?.mul_scalar(C)?.add(x)?.mul_scalar(K)?;
    x.mul(&inner.tanh()?.add_scalar(1.0)?)?.mul_scalar(0.5)
}

/// `d gelu_tanh / dx` at `x`, elementwise, composed of the elementwise operations (the
/// CPU's backward is one fused kernel instead).
fn slope(x: &Tensor) -> Result<Tensor> {
    let t = x
        .pow_scalar(3.0)?
        .mul_scalar(C)?
        .add(x)?
        .mul_scalar(K)?
        .tanh()?;
    let left = t.add_scalar(1.0)?.mul_scalar(0.5)?;
    let sech2 = t.mul(&t)?.neg()?.add_scalar(1.0)?;
    let poly = x
        .mul(x)?
        .mul_scalar(3.0 * C)?
        .add_scalar(1.0)?
        .mul_scalar(K)?;
    left.add(&x.mul(&sech2)?.mul(&poly)?.mul_scalar(0.5)?)
}

struct GeluTanh;
impl Function for GeluTanh {
    fn name(&self) -> &str {
        "GeluTanhBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        ctx.save_for_backward(&[inputs[0]]);
        Ok(vec![forward(inputs[0])?])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        // the slope is computed without recording: first derivatives only (second-order
        // gradients through this op are zero, documented on `gelu_tanh`)
        let x = ctx.saved_tensors()?.remove(0).detach();
        let g = &g[0];
        if !x.device().is_cuda() && g.shape() == x.shape() && g.dtype() == x.dtype() {
            let dx = kernel_zip(
                &x,
                g,
                "gelu_tanh_backward",
                kernels::gelu_tanh_backward,
                kernels::gelu_tanh_backward,
            )?;
            return Ok(vec![Some(dx)]);
        }
        Ok(vec![Some(g.mul(&slope(&x)?)?)])
    }
}

impl Tensor {
    /// GELU with the tanh approximation, elementwise (`torch.nn.functional.gelu(x,
    /// approximate='tanh')`, GPT-2's activation): `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715
    /// x^3)))`. It differs from the exact [`Tensor::gelu`] by less than `5e-4`.
    ///
    /// Float input of any shape and device; the output has the same shape and dtype.
    /// Differentiable once (the backward's own gradient is not recorded, so a second-order
    /// gradient through it sees only `g`'s path). Errors with [`Error::UnsupportedDType`] on a
    /// non-float input.
    ///
    /// ```
    /// use tensorplay::Tensor;
    /// let x = Tensor::from_vec(vec![0.0f64, 1.0, -2.0], &[3])?;
    /// let y = x.gelu_tanh()?.to_vec::<f64>()?;
    /// assert_eq!(y[0], 0.0);
    /// assert!((y[1] - 0.841_191_990_608_276_8).abs() < 1e-12);
    /// assert!((y[2] + 0.045_402_305_912_224_94).abs() < 1e-12);
    /// # Ok::<(), tensorplay::Error>(())
    /// ```
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "gelu_tanh",
                dtype: self.dtype(),
                expected: "a floating dtype (float32, float64, bfloat16 or float16)",
            });
        }
        Ok(apply(GeluTanh, &[self])?.remove(0))
    }
}
