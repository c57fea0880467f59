//! Binary arithmetic with broadcasting and type promotion: add, sub, mul, div, pow, maximum,
//! minimum, and their gradients.

use super::{binary_map, promote};
use crate::autograd::{Context, Function, apply};
use crate::backend::{BinaryCode, DeviceStorage as _};
use crate::ops::{WrappingArith, device_map2, float_dispatch, numeric_dispatch};
use crate::{DType, Error, Result, Tensor};
use num_traits::Float as _;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BinaryKind {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Maximum,
    Minimum,
}

fn binary_kernel(kind: BinaryKind, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    use BinaryKind::*;
    let op = match kind {
        Add => "add",
        Sub => "sub",
        Mul => "mul",
        Div => "div",
        Pow => "pow",
        Maximum => "maximum",
        Minimum => "minimum",
    };
    let code = match kind {
        Add => BinaryCode::Add,
        Sub => BinaryCode::Sub,
        Mul => BinaryCode::Mul,
        Div => BinaryCode::Div,
        Pow => BinaryCode::Pow,
        Maximum => BinaryCode::Max,
        Minimum => BinaryCode::Min,
    };
    if let Some(r) = device_map2(a, b, op, |ca, la, cb, lb| {
        match (kind, a.dtype()) {
            (_, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
            | (Add | Sub | Mul | Maximum | Minimum, DType::I64) => {}
            (Div | Pow, d @ DType::I64) | (_, d @ DType::Bool) => {
                return Err(Error::UnsupportedDType {
                    op,
                    dtype: d,
                    expected: "a numeric dtype (a floating one for div and pow)",
                });
            }
        }
        ca.binary(la, cb, lb, code)
    }) {
        return r;
    }
    match kind {
        Div => float_dispatch!(a.dtype(), op, T => binary_map::<T, T>(a, b, op, |x, y| x / y)),
        Pow => {
            float_dispatch!(a.dtype(), op, T => binary_map::<T, T>(a, b, op, |x: T, y: T| x.powf(y)))
        }
        Add => numeric_dispatch!(a.dtype(), op, T => binary_map::<T, T>(a, b, op, T::wadd)),
        Sub => numeric_dispatch!(a.dtype(), op, T => binary_map::<T, T>(a, b, op, T::wsub)),
        Mul => numeric_dispatch!(a.dtype(), op, T => binary_map::<T, T>(a, b, op, T::wmul)),
        #[allow(clippy::eq_op)]
        Maximum => numeric_dispatch!(a.dtype(), op, T => binary_map::<T, T>(a, b, op, |x, y| {
            if x >= y || x != x { x } else { y }
        })),
        #[allow(clippy::eq_op)]
        Minimum => numeric_dispatch!(a.dtype(), op, T => binary_map::<T, T>(a, b, op, |x, y| {
            if x <= y || x != x { x } else { y }
        })),
    }
}

struct Binary(BinaryKind);
impl Function for Binary {
    fn name(&self) -> &str {
        match self.0 {
            BinaryKind::Add => "AddBackward",
            BinaryKind::Sub => "SubBackward",
            BinaryKind::Mul => "MulBackward",
            BinaryKind::Div => "DivBackward",
            BinaryKind::Pow => "PowBackward",
            BinaryKind::Maximum => "MaximumBackward",
            BinaryKind::Minimum => "MinimumBackward",
        }
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (a, b) = (inputs[0], inputs[1]);
        let out = binary_kernel(self.0, a, b)?;
        match self.0 {
            BinaryKind::Add | BinaryKind::Sub => {}
            BinaryKind::Pow => ctx.save_for_backward(&[a, b, &out]),
            _ => ctx.save_for_backward(&[a, b]),
        }
        ctx.save_value((a.shape().to_vec(), b.shape().to_vec()));
        Ok(vec![out])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let (sa, sb) = ctx.get::<(Vec<usize>, Vec<usize>)>()?.clone();
        let g = &g[0];
        let (ga, gb) = match self.0 {
            BinaryKind::Add => (g.clone(), g.clone()),
            BinaryKind::Sub => (g.clone(), g.neg()?),
            BinaryKind::Mul => {
                let s = ctx.saved_tensors()?;
                (g.mul(&s[1])?, g.mul(&s[0])?)
            }
            BinaryKind::Div => {
                let s = ctx.saved_tensors()?;
                let ga = g.div(&s[1])?;
                let gb = if ctx.needs_input_grad(1) {
                    ga.mul(&s[0])?.div(&s[1])?.neg()?
                } else {
                    ga.clone()
                };
                (ga, gb)
            }
            BinaryKind::Pow => {
                let s = ctx.saved_tensors()?;
                let (a, b, y) = (&s[0], &s[1], &s[2]);
                let ga = g.mul(&b.mul(&a.pow(&b.sub_scalar(1.0)?)?)?)?;
                let gb = if ctx.needs_input_grad(1) {
                    // d a^b / db = a^b ln a, taken as 0 where a == 0 (as PyTorch does)
                    let ln = a.log()?;
                    let zero_mask = a.eq_scalar(0.0)?;
                    let ln = ln.where_(&zero_mask.logical_not()?, &ln.zeros_like()?)?;
                    g.mul(&y.mul(&ln)?)?
                } else {
                    ga.clone()
                };
                (ga, gb)
            }
            BinaryKind::Maximum | BinaryKind::Minimum => {
                let s = ctx.saved_tensors()?;
                let (a, b) = (&s[0], &s[1]);
                // ties split the gradient evenly
                let pick_a = if self.0 == BinaryKind::Maximum {
                    a.gt(b)?
                } else {
                    a.lt(b)?
                };
                let tie = a.eq(b)?;
                let dt = g.dtype();
                let wa = pick_a
                    .to_dtype(dt)?
                    .add(&tie.to_dtype(dt)?.mul_scalar(0.5)?)?;
                let wb = wa.neg()?.add_scalar(1.0)?;
                (g.mul(&wa)?, g.mul(&wb)?)
            }
        };
        Ok(vec![
            if ctx.needs_input_grad(0) {
                Some(ga.sum_to_size(&sa)?)
            } else {
                None
            },
            if ctx.needs_input_grad(1) {
                Some(gb.sum_to_size(&sb)?)
            } else {
                None
            },
        ])
    }
}

/// `kind(a, b)` after promoting both operands to one dtype (float32 at least for `div` and
/// `pow`, int64 at least for arithmetic on bools).
pub(super) fn binary(kind: BinaryKind, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let dt = promote(a.dtype(), b.dtype());
    let dt = if matches!(kind, BinaryKind::Div | BinaryKind::Pow) && !dt.is_float() {
        DType::F32
    } else {
        dt
    };
    let dt = if dt == DType::Bool { DType::I64 } else { dt };
    let a = if a.dtype() != dt {
        a.to_dtype(dt)?
    } else {
        a.clone()
    };
    let b = if b.dtype() != dt {
        b.to_dtype(dt)?
    } else {
        b.clone()
    };
    Ok(apply(Binary(kind), &[&a, &b])?.remove(0))
}
