//! Unary math and activations (and the scalar forms of arithmetic), with their gradients;
//! ReLU's backward as an operation of its own.

use super::{binary_map, kernel_map, unary_map};
use crate::autograd::{Context, Function, apply};
use crate::backend::{BinaryCode, DeviceStorage as _, UnaryCode};
use crate::kernels::Map;
use crate::kernels::math::Elem;
use crate::ops::{device_map, device_map2, float_dispatch};
use crate::{DType, Error, Result, Tensor};
use num_traits::{Float, Zero};

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum UnaryKind {
    Neg,
    Exp,
    Log,
    Sqrt,
    Abs,
    Relu,
    Sigmoid,
    Tanh,
    Gelu,
    Erf,
    AddScalar(f64),
    MulScalar(f64),
    DivScalar(f64),
    PowScalar(f64),
}

/// The public name of a unary operation, for error messages.
fn unary_op_name(kind: UnaryKind) -> &'static str {
    use UnaryKind::*;
    match kind {
        Neg => "neg",
        Exp => "exp",
        Log => "log",
        Sqrt => "sqrt",
        Abs => "abs",
        Relu => "relu",
        Sigmoid => "sigmoid",
        Tanh => "tanh",
        Gelu => "gelu",
        Erf => "erf",
        AddScalar(_) => "add",
        MulScalar(_) => "mul",
        DivScalar(_) => "div",
        PowScalar(_) => "pow",
    }
}

fn unary_kernel(kind: UnaryKind, x: &Tensor) -> Result<Tensor> {
    use UnaryKind::*;
    let op = unary_op_name(kind);
    if let Some(r) = device_map(x, |c, l| {
        let int_ok = matches!(kind, Neg | Abs | AddScalar(_) | MulScalar(_) | Relu);
        if !(x.dtype().is_float() || int_ok && x.dtype() == DType::I64) {
            return Err(Error::UnsupportedDType {
                op,
                dtype: x.dtype(),
                expected: "a floating dtype (float32, float64, bfloat16 or float16)",
            });
        }
        let (code, s) = match kind {
            Neg => (UnaryCode::Neg, 0.0),
            Exp => (UnaryCode::Exp, 0.0),
            Log => (UnaryCode::Log, 0.0),
            Sqrt => (UnaryCode::Sqrt, 0.0),
            Abs => (UnaryCode::Abs, 0.0),
            Relu => (UnaryCode::Relu, 0.0),
            Sigmoid => (UnaryCode::Sigmoid, 0.0),
            Tanh => (UnaryCode::Tanh, 0.0),
            Gelu => (UnaryCode::Gelu, 0.0),
            Erf => (UnaryCode::Erf, 0.0),
            AddScalar(s) => (UnaryCode::AddScalar, s),
            MulScalar(s) => (UnaryCode::MulScalar, s),
            DivScalar(s) => (UnaryCode::DivScalar, s),
            PowScalar(2.0) => (UnaryCode::Square, 0.0),
            PowScalar(1.0) => (UnaryCode::MulScalar, 1.0),
            PowScalar(p) => (UnaryCode::PowScalar, p),
        };
        c.unary(l, code, s)
    }) {
        return r;
    }
    match kind {
        Neg | Abs | AddScalar(_) | MulScalar(_) | Relu if x.dtype() == DType::I64 => {
            // int64 arithmetic wraps on overflow, as in PyTorch
            return unary_map::<i64, i64>(x, op, |v| match kind {
                Neg => v.wrapping_neg(),
                Abs => v.wrapping_abs(),
                AddScalar(c) => v.wrapping_add(c as i64),
                MulScalar(c) => v.wrapping_mul(c as i64),
                _ => v.max(0),
            });
        }
        _ => {}
    }
    float_dispatch!(x.dtype(), op, T => {
        // a scalar operand in the computing type (float32 for the 16-bit types, so that
        // `x + 0.1` rounds once, not the scalar first)
        let acc = |v: f64| <<T as Elem>::Acc as crate::Element>::from_f64(v);
        match kind {
            Neg => unary_map::<T, T>(x, op, |v| -v),
            Exp => kernel_map(x, op, Map::Exp),
            Log => kernel_map(x, op, Map::Log),
            Sqrt => unary_map::<T, T>(x, op, |v: T| v.sqrt()),
            Abs => unary_map::<T, T>(x, op, |v: T| v.abs()),
            #[allow(clippy::eq_op)]
            Relu => unary_map::<T, T>(x, op, |v: T| if v > T::zero() || v != v { v } else { T::zero() }),
            Sigmoid => kernel_map(x, op, Map::Sigmoid),
            Tanh => kernel_map(x, op, Map::Tanh),
            Gelu => kernel_map(x, op, Map::GeluErf),
            Erf => kernel_map(x, op, Map::Erf),
            AddScalar(s) => {
                let s = acc(s);
                unary_map::<T, T>(x, op, |v| T::store(v.load() + s))
            }
            MulScalar(s) => {
                let s = acc(s);
                unary_map::<T, T>(x, op, |v| T::store(v.load() * s))
            }
            DivScalar(s) => {
                let s = acc(s);
                unary_map::<T, T>(x, op, |v| T::store(v.load() / s))
            }
            PowScalar(2.0) => unary_map::<T, T>(x, op, |v| v * v),
            PowScalar(1.0) => unary_map::<T, T>(x, op, |v| v),
            PowScalar(p) => {
                let p = acc(p);
                unary_map::<T, T>(x, op, |v: T| T::store(Float::powf(v.load(), p)))
            }
        }
    })
}

struct Unary(UnaryKind);
impl Function for Unary {
    fn name(&self) -> &str {
        match self.0 {
            UnaryKind::Neg => "NegBackward",
            UnaryKind::Exp => "ExpBackward",
            UnaryKind::Log => "LogBackward",
            UnaryKind::Sqrt => "SqrtBackward",
            UnaryKind::Abs => "AbsBackward",
            UnaryKind::Relu => "ReluBackward",
            UnaryKind::Sigmoid => "SigmoidBackward",
            UnaryKind::Tanh => "TanhBackward",
            UnaryKind::Gelu => "GeluBackward",
            UnaryKind::Erf => "ErfBackward",
            UnaryKind::AddScalar(_) => "AddBackward",
            UnaryKind::MulScalar(_) => "MulBackward",
            UnaryKind::DivScalar(_) => "DivBackward",
            UnaryKind::PowScalar(_) => "PowBackward",
        }
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let x = inputs[0];
        let y = unary_kernel(self.0, x)?;
        match self.0 {
            UnaryKind::Exp | UnaryKind::Sqrt | UnaryKind::Sigmoid | UnaryKind::Tanh => {
                ctx.save_for_backward(&[&y])
            }
            UnaryKind::Neg
            | UnaryKind::AddScalar(_)
            | UnaryKind::MulScalar(_)
            | UnaryKind::DivScalar(_) => {}
            _ => ctx.save_for_backward(&[x]),
        }
        Ok(vec![y])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        use UnaryKind::*;
        let g = &g[0];
        let saved = || -> Result<Tensor> { Ok(ctx.saved_tensors()?.remove(0)) };
        let gi = match self.0 {
            Neg => g.neg()?,
            AddScalar(_) => g.clone(),
            MulScalar(c) => g.mul_scalar(c)?,
            DivScalar(c) => g.div_scalar(c)?,
            Exp => g.mul(&saved()?)?,
            Log => g.div(&saved()?)?,
            Sqrt => g.div(&saved()?.mul_scalar(2.0)?)?,
            Abs => g.mul(&saved()?.sign()?)?,
            Relu => threshold_backward(g, &saved()?)?,
            Sigmoid => {
                let y = saved()?;
                g.mul(&y.mul(&y.neg()?.add_scalar(1.0)?)?)?
            }
            Tanh => {
                let y = saved()?;
                g.mul(&y.mul(&y)?.neg()?.add_scalar(1.0)?)?
            }
            Erf => {
                let x = saved()?;
                let d = x
                    .mul(&x)?
                    .neg()?
                    .exp()?
                    .mul_scalar(2.0 / std::f64::consts::PI.sqrt())?;
                g.mul(&d)?
            }
            Gelu => g.mul(&crate::ops::gelu_erf::slope(&saved()?)?)?,
            PowScalar(p) => {
                let x = saved()?;
                if p == 0.0 {
                    g.zeros_like()?
                } else {
                    g.mul(&x.pow_scalar(p - 1.0)?.mul_scalar(p)?)?
                }
            }
        };
        Ok(vec![Some(gi)])
    }
}

/// `g` where `x > 0`, else 0: ReLU's backward in one pass. Linear in `g`, so its own
/// backward is the same operation (ReLU's second derivative is zero).
struct ThresholdBackward;
impl Function for ThresholdBackward {
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (g, x) = (inputs[0], inputs[1]);
        ctx.save_for_backward(&[x]);
        if let Some(r) = device_map2(g, x, "relu_backward", |cg, lg, cx, lx| {
            if !g.dtype().is_float() {
                return Err(Error::UnsupportedDType {
                    op: "relu_backward",
                    dtype: g.dtype(),
                    expected: "a floating dtype (float32, float64, bfloat16 or float16)",
                });
            }
            cg.binary(lg, cx, lx, BinaryCode::ReluBackward)
        }) {
            return Ok(vec![r?]);
        }
        let out = float_dispatch!(g.dtype(), "relu_backward", T => {
            binary_map::<T, T>(g, x, "relu_backward", |g, x| if x > T::zero() { g } else { T::zero() })
        })?;
        Ok(vec![out])
    }
    fn backward(&self, ctx: &Context, gg: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let x = ctx.saved_tensors()?.remove(0);
        Ok(vec![Some(threshold_backward(&gg[0], &x)?), None])
    }
}

fn threshold_backward(g: &Tensor, x: &Tensor) -> Result<Tensor> {
    if g.dtype() != x.dtype() {
        return Err(Error::DTypeMismatch {
            op: "relu_backward",
            lhs: g.dtype(),
            rhs: x.dtype(),
        });
    }
    Ok(apply(ThresholdBackward, &[g, x])?.remove(0))
}

/// `kind(x)`, promoting an integer tensor to float32 where the scalar or the operation needs
/// it.
pub(super) fn unary(kind: UnaryKind, x: &Tensor) -> Result<Tensor> {
    // an int64 tensor keeps its dtype with a whole scalar, which must then be an int64 (it was
    // saturated, then wrapped: `+ 1e20` gave -2^63; PyTorch refuses such a Python int too)
    if let UnaryKind::AddScalar(c) | UnaryKind::MulScalar(c) = kind
        && x.dtype() == DType::I64
        && c.fract() == 0.0
        && !(-(2f64.powi(63))..2f64.powi(63)).contains(&c)
    {
        return Err(Error::InvalidArgument {
            op: if matches!(kind, UnaryKind::AddScalar(_)) {
                "add_scalar"
            } else {
                "mul_scalar"
            },
            arg: "value",
            expected: "a whole number in int64's range for an int64 tensor (or convert the \
                       tensor to a float dtype first)"
                .into(),
            got: format!("{c:e}"),
        });
    }
    // integer tensors with a fractional scalar promote to float32, as in PyTorch
    if let UnaryKind::AddScalar(c) | UnaryKind::MulScalar(c) | UnaryKind::DivScalar(c) = kind
        && !x.dtype().is_float()
        && (c.fract() != 0.0 || matches!(kind, UnaryKind::DivScalar(_)))
    {
        return unary(kind, &x.to_dtype(DType::F32)?);
    }
    Ok(apply(Unary(kind), &[x])?.remove(0))
}
