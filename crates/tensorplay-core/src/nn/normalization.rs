//! Layer normalisation (`torch.nn.LayerNorm`, Ba et al. 2016): the functional form and the
//! module.
//!
//! On the CPU forward and backward are fused row kernels (statistics in the computing type,
//! two passes, sums over fixed lanes), reading rows in place when they are contiguous; on other
//! devices the same formula is composed of the elementwise operations.

use std::fmt;

use super::{Module, ModuleCore};
use crate::autograd::{Context, Function, apply};
use crate::kernels::{self, math::Elem};
use crate::ops::float_dispatch;
use crate::{DType, Error, Layout, Result, Tensor};

/// The offsets of the rows of `n` elements of a view, when each row (its trailing dimensions
/// of `n` elements) is contiguous; `None` otherwise.
fn row_offsets(l: &Layout, n: usize) -> Option<Vec<usize>> {
    let mut d = l.shape.len();
    let mut size = 1;
    while size < n && d > 0 {
        d -= 1;
        if l.shape[d] > 1 && l.strides[d] != size {
            return None;
        }
        size *= l.shape[d];
    }
    (size == n).then(|| {
        Layout {
            shape: l.shape[..d].to_vec(),
            strides: l.strides[..d].to_vec(),
            offset: l.offset,
        }
        .offsets()
    })
}

struct LayerNormFn {
    /// Elements per normalised row.
    n: usize,
    eps: f64,
    has_weight: bool,
    has_bias: bool,
}

impl Function for LayerNormFn {
    fn name(&self) -> &str {
        "NativeLayerNormBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        // rows contiguous within are read in place; any other view is copied once
        let (x, offsets) = match row_offsets(inputs[0].layout(), self.n) {
            Some(o) => (inputs[0].clone(), o),
            None => {
                let x = inputs[0].contiguous()?;
                let o = row_offsets(x.layout(), self.n).unwrap_or_default();
                (x, o)
            }
        };
        let w = self
            .has_weight
            .then(|| inputs[1].contiguous())
            .transpose()?;
        let b = self
            .has_bias
            .then(|| inputs[1 + self.has_weight as usize].contiguous())
            .transpose()?;
        let rows = x.numel().checked_div(self.n).unwrap_or(0);
        let (y, mean, rstd) = float_dispatch!(x.dtype(), "layer_norm", T => {
            let (y, m, r) = x.with_slice("layer_norm", |xs: &[T], _| {
                let param = |p: &Option<Tensor>| -> Result<Option<Vec<T>>> {
                    p.as_ref().map(|p| p.to_vec::<T>()).transpose()
                };
                Ok::<_, Error>(kernels::layer_norm(
                    xs,
                    &offsets,
                    self.n,
                    param(&w)?.as_deref(),
                    param(&b)?.as_deref(),
                    self.eps,
                ))
            })??;
            // the statistics stay in the computing type (float32 for the 16-bit types, as
            // PyTorch saves them)
            (
                Tensor::from_vec(y, x.shape())?,
                Tensor::from_vec(m, &[rows])?,
                Tensor::from_vec(r, &[rows])?,
            )
        });
        match &w {
            Some(w) => ctx.save_for_backward(&[&x, &mean, &rstd, w]),
            None => ctx.save_for_backward(&[&x, &mean, &rstd]),
        }
        Ok(vec![y])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let saved = ctx.saved_tensors()?;
        let (x, mean, rstd) = (&saved[0], &saved[1], &saved[2]);
        let w = saved.get(3);
        let g = g[0].contiguous()?;
        let wshape = w
            .map(|w| w.shape().to_vec())
            .unwrap_or_else(|| vec![self.n]);
        let x = x.contiguous()?;
        let (dx, dw, db) = float_dispatch!(x.dtype(), "layer_norm", T => {
            let ws = w.map(|w| w.to_vec::<T>()).transpose()?;
            let stat = |t: &Tensor| -> Result<Vec<<T as Elem>::Acc>> { t.to_vec() };
            let (mean, rstd) = (stat(mean)?, stat(rstd)?);
            // both contiguous: read in place, not copied out
            let (dx, dw, db) = crate::ops::with_two(&x, &g, "layer_norm", |xs: &[T], lx, gs: &[T], lg| {
                match (lx.contiguous_range(), lg.contiguous_range()) {
                    (Some(rx), Some(rg)) => Ok(kernels::layer_norm_backward(
                        &xs[rx],
                        &gs[rg],
                        ws.as_deref(),
                        &mean,
                        &rstd,
                        self.n,
                    )),
                    _ => Err(Error::Autograd(
                        "layer_norm backward: the input or gradient is not contiguous".into(),
                    )),
                }
            })??;
            (
                Tensor::from_vec(dx, x.shape())?,
                Tensor::from_vec(dw.into_iter().map(T::store).collect::<Vec<T>>(), &wshape)?,
                Tensor::from_vec(db.into_iter().map(T::store).collect::<Vec<T>>(), &wshape)?,
            )
        });
        let mut out = vec![Some(dx)];
        if self.has_weight {
            out.push(Some(dw));
        }
        if self.has_bias {
            out.push(Some(db));
        }
        Ok(out)
    }
}

/// The same formula from differentiable operations (any device).
fn composed(
    x: &Tensor,
    dims: &[isize],
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    let mean = x.mean_dims(dims, true)?;
    let d = x.sub(&mean)?;
    let var = d.mul(&d)?.mean_dims(dims, true)?;
    let mut y = d.div(&var.add_scalar(eps)?.sqrt()?)?;
    if let Some(w) = weight {
        y = y.mul(w)?;
    }
    if let Some(b) = bias {
        y = y.add(b)?;
    }
    Ok(y)
}

/// Layer normalisation over the trailing dimensions `normalized_shape`
/// (`torch.nn.functional.layer_norm`): each slice `x[..., :]` of `prod(normalized_shape)`
/// elements is shifted to mean 0 and scaled to variance 1 (the biased variance, as PyTorch),
/// `y = (x - mean) / sqrt(var + eps) * weight + bias`.
///
/// - `input`: float, shape `[.., *normalized_shape]`; the output has its shape and dtype.
/// - `weight`, `bias`: optional, of shape `normalized_shape` and the input's dtype and device.
/// - `eps`: added to the variance, `1e-5` in PyTorch's default.
///
/// Differentiable in the input, weight and bias (once: on the CPU the backward is a fused pass
/// that is not itself recorded).
///
/// Errors: [`Error::UnsupportedDType`] for a non-float input; [`Error::InvalidArgument`] when
/// `normalized_shape` is empty, is not the input's trailing shape, or `eps` is negative or NaN;
/// [`Error::ShapeMismatch`] / [`Error::DTypeMismatch`] for a weight or bias of another shape or
/// dtype.
///
/// ```
/// use tensorplay::{Tensor, nn::functional::layer_norm};
/// let x = Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0, 4.0, 4.0], &[2, 3])?;
/// let y = layer_norm(&x, &[3], None, None, 0.0)?.to_vec::<f64>()?;
/// let s = (1.5f64).sqrt(); // 1 / the standard deviation of [1, 2, 3]
/// assert!((y[0] + s).abs() < 1e-12 && y[1].abs() < 1e-12 && (y[2] - s).abs() < 1e-12);
/// # Ok::<(), tensorplay::Error>(())
/// ```
pub fn layer_norm(
    input: &Tensor,
    normalized_shape: &[usize],
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    const OP: &str = "layer_norm";
    let inputs: Vec<&Tensor> = [input].into_iter().chain(weight).chain(bias).collect();
    if let Some(x) = crate::amp::to_fp32(&inputs)? {
        let (w, b) = match (weight, bias) {
            (Some(_), Some(_)) => (x.get(1), x.get(2)),
            (Some(_), None) => (x.get(1), None),
            (None, Some(_)) => (None, x.get(1)),
            (None, None) => (None, None),
        };
        return layer_norm(&x[0], normalized_shape, w, b, eps);
    }
    if !input.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype: input.dtype(),
            expected: "a floating dtype (float32, float64, bfloat16 or float16)",
        });
    }
    let k = normalized_shape.len();
    if k == 0 || k > input.ndim() || input.shape()[input.ndim() - k..] != *normalized_shape {
        return Err(Error::invalid(
            OP,
            "normalized_shape",
            "the input's trailing dimensions (non-empty)",
            format!(
                "normalized_shape {normalized_shape:?} for an input of shape {:?}",
                input.shape()
            ),
        ));
    }
    if eps.is_nan() || eps < 0.0 {
        return Err(Error::invalid(OP, "eps", "a number >= 0", format!("{eps}")));
    }
    for (name, p) in [("weight", weight), ("bias", bias)] {
        let Some(p) = p else { continue };
        if p.shape() != normalized_shape {
            return Err(Error::ShapeMismatch {
                op: if name == "weight" {
                    "layer_norm (weight must have normalized_shape)"
                } else {
                    "layer_norm (bias must have normalized_shape)"
                },
                lhs: normalized_shape.to_vec(),
                rhs: p.shape().to_vec(),
            });
        }
        if p.dtype() != input.dtype() {
            return Err(Error::DTypeMismatch {
                op: OP,
                lhs: input.dtype(),
                rhs: p.dtype(),
            });
        }
    }
    if input.device().is_cuda() || input.numel() == 0 {
        let dims: Vec<isize> = (input.ndim() - k..input.ndim())
            .map(|d| d as isize)
            .collect();
        return composed(input, &dims, weight, bias, eps);
    }
    let f = LayerNormFn {
        n: normalized_shape.iter().product(),
        eps,
        has_weight: weight.is_some(),
        has_bias: bias.is_some(),
    };
    let mut inputs = vec![input];
    inputs.extend(weight);
    inputs.extend(bias);
    Ok(apply(f, &inputs)?.remove(0))
}

/// Layer normalisation with a learned elementwise affine map (`torch.nn.LayerNorm`).
///
/// Parameters `weight` (ones) and `bias` (zeros) of shape `normalized_shape`, float32 unless
/// built with [`LayerNorm::with_dtype`]; the input is `[.., *normalized_shape]`. See
/// [`layer_norm`](crate::nn::functional::layer_norm) for the formula and errors.
///
/// ```
/// use tensorplay::{self as tp, nn::{self, Module}};
/// let ln = nn::LayerNorm::new(&[4], 1e-5)?;
/// let y = ln.call(&tp::randn(&[2, 3, 4])?)?;
/// assert_eq!(y.shape(), [2, 3, 4]);
/// let names: Vec<String> = ln.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["weight", "bias"]);
/// # Ok::<(), tp::Error>(())
/// ```
#[derive(Module)]
pub struct LayerNorm {
    /// The scale, `normalized_shape`, initialised to ones.
    pub weight: Tensor,
    /// The shift, `normalized_shape`, initialised to zeros.
    pub bias: Tensor,
    normalized_shape: Vec<usize>,
    eps: f64,
    core: ModuleCore,
}

impl LayerNorm {
    /// A float32 layer over the trailing dims `normalized_shape` (non-empty) with `eps`
    /// (PyTorch's default is `1e-5`). Errors when `normalized_shape` is empty or `eps` is
    /// negative or NaN.
    pub fn new(normalized_shape: &[usize], eps: f64) -> Result<LayerNorm> {
        LayerNorm::with_dtype(normalized_shape, eps, DType::F32)
    }

    /// [`LayerNorm::new`] with parameters of `dtype` (float32 or float64).
    pub fn with_dtype(normalized_shape: &[usize], eps: f64, dtype: DType) -> Result<LayerNorm> {
        if normalized_shape.is_empty() {
            return Err(Error::invalid(
                "LayerNorm::new",
                "normalized_shape",
                "at least one dimension",
                "[]",
            ));
        }
        if eps.is_nan() || eps < 0.0 {
            return Err(Error::invalid(
                "LayerNorm::new",
                "eps",
                "a number >= 0",
                format!("{eps}"),
            ));
        }
        if !dtype.is_float() {
            return Err(Error::UnsupportedDType {
                op: "LayerNorm::new",
                dtype,
                expected: "a floating dtype (float32, float64, bfloat16 or float16)",
            });
        }
        Ok(LayerNorm {
            weight: Tensor::ones(normalized_shape, dtype)?.requires_grad_(true),
            bias: Tensor::zeros(normalized_shape, dtype)?.requires_grad_(true),
            normalized_shape: normalized_shape.to_vec(),
            eps,
            core: ModuleCore::new(),
        })
    }

    /// The normalised trailing shape.
    pub fn normalized_shape(&self) -> &[usize] {
        &self.normalized_shape
    }

    /// The `eps` added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }
}

impl fmt::Debug for LayerNorm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "LayerNorm({:?}, eps={}, elementwise_affine=True)",
            self.normalized_shape, self.eps
        )
    }
}

impl Module for LayerNorm {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        layer_norm(
            input,
            &self.normalized_shape,
            Some(&self.weight),
            Some(&self.bias),
            self.eps,
        )
    }
    /// Weight ones, bias zeros.
    fn reset_parameters(&mut self) -> Result<()> {
        super::init::ones_(&self.weight)?;
        super::init::zeros_(&self.bias)
    }
}
