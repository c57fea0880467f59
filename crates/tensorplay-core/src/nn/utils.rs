//! Gradient clipping (`torch.nn.utils`): [`clip_grad_norm_`] (and its halves
//! [`get_total_norm`] and [`clip_grads_with_norm_`]) and [`clip_grad_value_`].
//!
//! Both run between `loss.backward()` and `optimizer.step()` and change the `.grad` of the
//! parameters they are given; parameters without a `.grad` are skipped.
//!
//! ```
//! use tensorplay::{self as tp, nn::{self, Module}};
//!
//! tp::manual_seed(0);
//! let model = nn::Sequential::new()
//!     .add(nn::Linear::new(4, 8, true)?)
//!     .add(nn::ReLU::new())
//!     .add(nn::Linear::new(8, 1, true)?);
//! let loss = model.call(&tp::randn(&[16, 4])?)?.mul_scalar(1000.0)?.sum()?;
//! loss.backward()?;
//! let before = nn::utils::clip_grad_norm_(&model.parameters(), 1.0, 2.0, false)?;
//! assert!(before > 1.0);
//! // the gradients now have a total 2-norm of (about) 1
//! let after = nn::utils::clip_grad_norm_(&model.parameters(), f64::INFINITY, 2.0, false)?;
//! assert!((after - 1.0).abs() < 1e-4);
//! # Ok::<(), tp::Error>(())
//! ```

use crate::{Device, Error, Result, Tensor};

/// Added to the total norm in the clip coefficient `max_norm / (total_norm + EPS)`, as in
/// PyTorch.
const EPS: f64 = 1e-6;

/// Scales the gradients of `parameters` so that their total `norm_type`-norm is at most
/// `max_norm` (`torch.nn.utils.clip_grad_norm_`), and returns the total norm they had
/// before.
///
/// The total norm is taken over all gradients as if they were concatenated into one vector:
/// `(sum |g|^p)^(1/p)` for `norm_type = p > 0`, `max |g|` for `norm_type = f64::INFINITY`.
/// It is computed in float64 whatever the gradients' dtype. When the clip coefficient
/// `max_norm / (total_norm + 1e-6)` is below 1, every gradient is multiplied by it; otherwise
/// they are left as they are. Parameters without a `.grad` are skipped; with no gradients at
/// all the total norm is 0.
///
/// `parameters` is what [`crate::nn::Module::parameters`] returns (pass
/// `&model.parameters()`), or any slice of tensors. Gradients may have any shape, be float32
/// or float64, and live on any device; a clipped gradient keeps its shape, dtype and device.
/// The clipped gradient is a new tensor set as the parameter's `.grad` (so `p.grad()` returns
/// the clipped values afterwards), computed without recording autograd history; a handle to
/// the old gradient taken before the call keeps the old values.
///
/// A NaN total norm (a NaN in some gradient) leaves the gradients unchanged, and an infinite
/// one multiplies them by 0; check the returned value, or pass `error_if_nonfinite = true`.
///
/// # Errors
///
/// [`Error::InvalidArgument`], before any gradient changes:
/// - `max_norm` is negative or NaN (`f64::INFINITY` is allowed and never clips);
/// - `norm_type` is NaN or not positive;
/// - a gradient is not float32 or float64 (`parameters`);
/// - `error_if_nonfinite` is true and the total norm is NaN or infinite (`parameters`).
///
/// ```
/// use tensorplay::{self as tp, nn, Tensor};
///
/// let w = Tensor::from_vec(vec![0.0f32, 0.0], &[2])?.requires_grad_(true);
/// w.set_grad(Some(Tensor::from_vec(vec![3.0f32, 4.0], &[2])?));
/// let total = nn::utils::clip_grad_norm_(&[w.clone()], 1.0, 2.0, false)?;
/// assert_eq!(total, 5.0);
/// let g = w.grad().unwrap().to_vec::<f32>()?;
/// assert!((g[0] - 0.6).abs() < 1e-6 && (g[1] - 0.8).abs() < 1e-6);
/// # Ok::<(), tp::Error>(())
/// ```
pub fn clip_grad_norm_(
    parameters: &[Tensor],
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
) -> Result<f64> {
    const OP: &str = "clip_grad_norm_";
    check_max_norm(OP, max_norm)?;
    if norm_type.is_nan() || norm_type <= 0.0 {
        return Err(Error::invalid(
            OP,
            "norm_type",
            "a positive number p (or f64::INFINITY for the largest absolute value)",
            norm_type,
        ));
    }
    if let Some((i, by)) = parameters
        .iter()
        .enumerate()
        .find_map(|(i, p)| p.sharded_by().map(|by| (i, by)))
    {
        return Err(Error::invalid(
            OP,
            "parameters",
            "whole parameters (for shards use tp::distributed::fsdp::clip_grad_norm_, which \
             adds the norms across ranks)",
            format!("parameter {i}, a shard made by {by}: its norm here would be this rank's only"),
        ));
    }
    let grads = float_grads(OP, parameters)?;
    let total = total_norm(&grads, norm_type)?;
    if error_if_nonfinite && !total.is_finite() {
        return Err(Error::invalid(
            OP,
            "parameters",
            format!(
                "gradients with a finite total norm of order {norm_type} \
                 (error_if_nonfinite=true; pass false to clip anyway)"
            ),
            format!("a total norm of {total}"),
        ));
    }
    scale_grads(&grads, max_norm, total)?;
    Ok(total)
}

/// An error naming `op` unless `max_norm` is a non-negative number (infinity allowed).
fn check_max_norm(op: &'static str, max_norm: f64) -> Result<()> {
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(Error::invalid(
            op,
            "max_norm",
            "a non-negative number (or f64::INFINITY)",
            max_norm,
        ));
    }
    Ok(())
}

/// Multiplies every gradient by `max_norm / (total + 1e-6)` when that is below 1.
fn scale_grads(grads: &[(&Tensor, Tensor)], max_norm: f64, total: f64) -> Result<()> {
    let coef = max_norm / (total + EPS);
    if coef < 1.0 {
        for (p, g) in grads {
            p.set_grad(Some(map_values(g, |x| x * coef)?));
        }
    }
    Ok(())
}

/// The total `norm_type`-norm of `tensors` as if concatenated into one vector, in float64
/// (`torch.nn.utils.get_total_norm`): the first half of [`clip_grad_norm_`], for callers that
/// combine norms themselves (fully sharded data parallelism sums the shards' across ranks).
/// NaN when an element is NaN; 0 for no tensors.
///
/// Errors ([`Error::InvalidArgument`]): `norm_type` NaN or not positive; a tensor that is not
/// float32 or float64.
pub fn get_total_norm(tensors: &[Tensor], norm_type: f64) -> Result<f64> {
    const OP: &str = "get_total_norm";
    if norm_type.is_nan() || norm_type <= 0.0 {
        return Err(Error::invalid(
            OP,
            "norm_type",
            "a positive number p (or f64::INFINITY for the largest absolute value)",
            norm_type,
        ));
    }
    let mut pairs = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if !t.dtype().is_float() {
            return Err(Error::invalid(
                OP,
                "tensors",
                "float32 or float64 tensors",
                format!("a tensor of dtype {} (tensor {i})", t.dtype()),
            ));
        }
        pairs.push((t, t.clone()));
    }
    total_norm(&pairs, norm_type)
}

/// Scales the gradients of `parameters` by `max_norm / (total_norm + 1e-6)` when that is below
/// 1 (`torch.nn.utils.clip_grads_with_norm_`): the second half of [`clip_grad_norm_`], given
/// the total norm from elsewhere. Parameters without a `.grad` are skipped.
///
/// Errors ([`Error::InvalidArgument`]): `max_norm` negative or NaN; a gradient that is not
/// float32 or float64.
pub fn clip_grads_with_norm_(parameters: &[Tensor], max_norm: f64, total_norm: f64) -> Result<()> {
    const OP: &str = "clip_grads_with_norm_";
    check_max_norm(OP, max_norm)?;
    let grads = float_grads(OP, parameters)?;
    scale_grads(&grads, max_norm, total_norm)
}

/// Clamps every element of the gradients of `parameters` into `[-clip_value, clip_value]`
/// (`torch.nn.utils.clip_grad_value_`). Parameters without a `.grad` are skipped; NaN
/// elements stay NaN.
///
/// `parameters` is what [`crate::nn::Module::parameters`] returns (pass
/// `&model.parameters()`), or any slice of tensors. Gradients may have any shape, be float32
/// or float64, and live on any device; a clamped gradient keeps its shape, dtype and device.
/// It is a new tensor set as the parameter's `.grad` (so `p.grad()` returns the clamped
/// values afterwards), computed without recording autograd history.
///
/// # Errors
///
/// [`Error::InvalidArgument`], before any gradient changes: `clip_value` is negative or NaN
/// (`f64::INFINITY` is allowed and changes nothing), or a gradient is not float32 or float64
/// (`parameters`).
///
/// ```
/// use tensorplay::{self as tp, nn, Tensor};
///
/// let w = Tensor::from_vec(vec![0.0f64; 3], &[3])?.requires_grad_(true);
/// w.set_grad(Some(Tensor::from_vec(vec![-2.0f64, 0.25, 7.0], &[3])?));
/// nn::utils::clip_grad_value_(&[w.clone()], 0.5)?;
/// assert_eq!(w.grad().unwrap().to_vec::<f64>()?, vec![-0.5, 0.25, 0.5]);
/// # Ok::<(), tp::Error>(())
/// ```
pub fn clip_grad_value_(parameters: &[Tensor], clip_value: f64) -> Result<()> {
    const OP: &str = "clip_grad_value_";
    if clip_value.is_nan() || clip_value < 0.0 {
        return Err(Error::invalid(
            OP,
            "clip_value",
            "a non-negative number (or f64::INFINITY)",
            clip_value,
        ));
    }
    let grads = float_grads(OP, parameters)?;
    for (p, g) in &grads {
        // `clip_value` is neither NaN nor negative, so `-clip_value <= clip_value`
        p.set_grad(Some(map_values(g, |x| x.clamp(-clip_value, clip_value))?));
    }
    Ok(())
}

/// The parameters that have a `.grad`, with it; errors when a gradient is not a float.
fn float_grads<'a>(
    op: &'static str,
    parameters: &'a [Tensor],
) -> Result<Vec<(&'a Tensor, Tensor)>> {
    let mut out = Vec::with_capacity(parameters.len());
    for (i, p) in parameters.iter().enumerate() {
        let Some(g) = p.grad() else { continue };
        if !g.dtype().is_float() {
            return Err(Error::invalid(
                op,
                "parameters",
                "parameters whose gradients are of a floating dtype",
                format!("a gradient of dtype {} (parameter {i})", g.dtype()),
            ));
        }
        out.push((p, g));
    }
    Ok(out)
}

/// Calls `f` on every element of the float tensor `g`, as `f64`, in row-major order.
fn for_each_value(g: &Tensor, mut f: impl FnMut(f64)) -> Result<()> {
    crate::ops::float_dispatch!(g.dtype(), "nn::utils", T => {
        g.to_vec::<T>()?.into_iter().for_each(|x| f(crate::Element::to_f64(x)))
    });
    Ok(())
}

/// A new tensor of `g`'s shape, dtype and device holding `f` of each element (computed in
/// `f64`, rounded once to `g`'s dtype). Records no autograd history.
fn map_values(g: &Tensor, f: impl Fn(f64) -> f64) -> Result<Tensor> {
    let t = crate::ops::float_dispatch!(g.dtype(), "nn::utils", T => {
        let v: Vec<T> = g
            .to_vec::<T>()?
            .into_iter()
            .map(|x| <T as crate::Element>::from_f64(f(crate::Element::to_f64(x))))
            .collect();
        Tensor::from_vec(v, g.shape())?
    });
    if g.device() == Device::Cpu {
        Ok(t)
    } else {
        let _no_grad = crate::no_grad();
        t.to_device(g.device())
    }
}

/// The `p`-norm (`p > 0` or infinite) of all elements of `grads` as one vector, in `f64`;
/// NaN when an element is NaN. Sums that overflow or underflow are redone with the elements
/// divided by the largest absolute value.
fn total_norm(grads: &[(&Tensor, Tensor)], p: f64) -> Result<f64> {
    let mut max = 0.0f64;
    let mut nan = false;
    let mut sum = 0.0f64;
    let power = |a: f64| -> f64 {
        if p == 1.0 {
            a
        } else if p == 2.0 {
            a * a
        } else {
            a.powf(p)
        }
    };
    let root = |s: f64| -> f64 {
        if p == 1.0 {
            s
        } else if p == 2.0 {
            s.sqrt()
        } else {
            s.powf(1.0 / p)
        }
    };
    for (_, g) in grads {
        for_each_value(g, |x| {
            let a = x.abs();
            if a.is_nan() {
                nan = true;
            } else {
                max = max.max(a);
                if p.is_finite() {
                    sum += power(a);
                }
            }
        })?;
    }
    if nan {
        return Ok(f64::NAN);
    }
    if p.is_infinite() || max == 0.0 || max.is_infinite() {
        // the largest absolute value; 0 for no (or all-zero) gradients; an infinite element
        // makes any p-norm infinite
        return Ok(if p.is_infinite() { max } else { root(sum) });
    }
    if sum.is_finite() && sum >= f64::MIN_POSITIVE {
        return Ok(root(sum));
    }
    // |g|^p overflowed or underflowed: norm = max * norm(g / max)
    let mut scaled = 0.0f64;
    for (_, g) in grads {
        for_each_value(g, |x| scaled += power(x.abs() / max))?;
    }
    Ok(max * root(scaled))
}
