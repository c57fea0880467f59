//! Elementwise operations with broadcasting: arithmetic, unary math, activations,
//! comparisons, `where`, dtype casts and in-place updates.

use super::{
    WrappingArith, any_dispatch, device_map, device_map2, float_dispatch, numeric_dispatch,
    same_device, with_two,
};
use crate::autograd::{Context, Function, apply, is_grad_enabled};
use crate::backend::{BinaryCode, CmpCode, DeviceStorage as _, UnaryCode};
use crate::layout::{Layout, broadcast_shapes};
use crate::storage::StorageElement;
use crate::{DType, Element, Error, FloatElement, Result, Tensor};
use num_traits::{Float, One, Zero};

// ---------------------------------------------------------------------------------------------
// kernels

/// `f(a, b)` elementwise with broadcasting, into a new contiguous tensor.
///
/// Rows of the last dimension are processed with tight loops specialised for unit and zero
/// strides (same-shape operands, a broadcast bias row, a broadcast scalar column), so the
/// common cases vectorise.
pub(crate) fn binary_map<T: StorageElement, R: StorageElement>(
    a: &Tensor,
    b: &Tensor,
    op: &'static str,
    f: impl Fn(T, T) -> R,
) -> Result<Tensor> {
    same_device(op, a, b)?;
    let shape = broadcast_shapes(a.shape(), b.shape(), op)?;
    let la = a.layout().broadcast_to(&shape, op)?;
    let lb = b.layout().broadcast_to(&shape, op)?;
    let v = with_two(a, b, op, |sa: &[T], _, sb: &[T], _| {
        let n: usize = shape.iter().product();
        if let (Some(ra), Some(rb)) = (la.contiguous_range(), lb.contiguous_range()) {
            return sa[ra].iter().zip(&sb[rb]).map(|(&x, &y)| f(x, y)).collect();
        }
        let mut out: Vec<R> = Vec::with_capacity(n);
        if n == 0 {
            return out;
        }
        let nd = shape.len();
        let inner = shape[nd - 1];
        let (ia, ib) = (la.strides[nd - 1], lb.strides[nd - 1]);
        let rows = |l: &Layout| Layout {
            shape: shape[..nd - 1].to_vec(),
            strides: l.strides[..nd - 1].to_vec(),
            offset: l.offset,
        };
        let (ra, rb) = (rows(&la), rows(&lb));
        let (oa, ob) = (ra.offsets(), rb.offsets());
        for (&a0, &b0) in oa.iter().zip(&ob) {
            match (ia, ib) {
                (1, 1) => out.extend(
                    sa[a0..a0 + inner]
                        .iter()
                        .zip(&sb[b0..b0 + inner])
                        .map(|(&x, &y)| f(x, y)),
                ),
                (1, 0) => {
                    let y = sb[b0];
                    out.extend(sa[a0..a0 + inner].iter().map(|&x| f(x, y)))
                }
                (0, 1) => {
                    let x = sa[a0];
                    out.extend(sb[b0..b0 + inner].iter().map(|&y| f(x, y)))
                }
                _ => out.extend((0..inner).map(|j| f(sa[a0 + j * ia], sb[b0 + j * ib]))),
            }
        }
        out
    })?;
    Ok(Tensor::from_cpu(R::into_storage(v), &shape))
}

/// `f(x)` elementwise into a new contiguous tensor.
pub(crate) fn unary_map<T: StorageElement, R: StorageElement>(
    x: &Tensor,
    op: &'static str,
    f: impl Fn(T) -> R,
) -> Result<Tensor> {
    let v = x.with_slice(op, |s: &[T], l| match l.contiguous_range() {
        Some(r) => s[r].iter().map(|&v| f(v)).collect::<Vec<R>>(),
        None => {
            let mut out = Vec::with_capacity(l.numel());
            l.for_each_offset(|o| out.push(f(s[o])));
            out
        }
    })?;
    Ok(Tensor::from_cpu(R::into_storage(v), x.shape()))
}

fn promote(a: DType, b: DType) -> DType {
    fn rank(d: DType) -> u8 {
        match d {
            DType::Bool => 0,
            DType::I64 => 1,
            DType::F32 => 2,
            DType::F64 => 3,
        }
    }
    if rank(a) >= rank(b) { a } else { b }
}

// ---------------------------------------------------------------------------------------------
// casts

fn cast_kernel(x: &Tensor, to: DType) -> Result<Tensor> {
    if let Some(r) = device_map(x, |c, l| c.copy_as(l, to)) {
        return r;
    }
    any_dispatch!(x.dtype(), S => {
        any_dispatch!(to, D => {
            unary_map::<S, D>(x, "to_dtype", |v| D::from_f64(Element::to_f64(v)))
        })
    })
}

struct Cast {
    from: DType,
    to: DType,
}
impl Function for Cast {
    fn name(&self) -> &str {
        "ToCopyBackward"
    }
    fn forward(&self, _ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![cast_kernel(inputs[0], self.to)?])
    }
    fn backward(&self, _ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(g[0].to_dtype(self.from)?)])
    }
}

// ---------------------------------------------------------------------------------------------
// binary arithmetic

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BinaryKind {
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
            (Div | Pow, DType::F32 | DType::F64) | (_, DType::F32 | DType::F64 | DType::I64) => {}
            (_, d) => {
                return Err(Error::UnsupportedDType {
                    op,
                    dtype: d,
                    expected: "float32, float64 or int64 (float for div and pow)",
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

fn binary(kind: BinaryKind, a: &Tensor, b: &Tensor) -> Result<Tensor> {
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

// ---------------------------------------------------------------------------------------------
// unary

#[derive(Clone, Copy, Debug, PartialEq)]
enum UnaryKind {
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

fn gelu<T: FloatElement>(x: T) -> T {
    let half = T::from(0.5).unwrap_or_else(T::zero);
    let inv_sqrt2 = T::from(std::f64::consts::FRAC_1_SQRT_2).unwrap_or_else(T::zero);
    x * half * (T::one() + FloatElement::erf(x * inv_sqrt2))
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
                expected: "float32 or float64",
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
        let c = |v: f64| <T as num_traits::NumCast>::from(v).unwrap_or_else(T::nan);
        match kind {
            Neg => unary_map::<T, T>(x, op, |v| -v),
            Exp => unary_map::<T, T>(x, op, |v: T| v.exp()),
            Log => unary_map::<T, T>(x, op, |v: T| v.ln()),
            Sqrt => unary_map::<T, T>(x, op, |v: T| v.sqrt()),
            Abs => unary_map::<T, T>(x, op, |v: T| v.abs()),
            #[allow(clippy::eq_op)]
            Relu => unary_map::<T, T>(x, op, |v: T| if v > T::zero() || v != v { v } else { T::zero() }),
            Sigmoid => unary_map::<T, T>(x, op, |v: T| T::one() / (T::one() + (-v).exp())),
            Tanh => unary_map::<T, T>(x, op, |v: T| v.tanh()),
            Gelu => unary_map::<T, T>(x, op, gelu::<T>),
            Erf => unary_map::<T, T>(x, op, FloatElement::erf),
            AddScalar(s) => {
                let s = c(s);
                unary_map::<T, T>(x, op, |v| v + s)
            }
            MulScalar(s) => {
                let s = c(s);
                unary_map::<T, T>(x, op, |v| v * s)
            }
            DivScalar(s) => {
                let s = c(s);
                unary_map::<T, T>(x, op, |v| v / s)
            }
            PowScalar(2.0) => unary_map::<T, T>(x, op, |v| v * v),
            PowScalar(1.0) => unary_map::<T, T>(x, op, |v| v),
            PowScalar(p) => {
                let p = c(p);
                unary_map::<T, T>(x, op, |v: T| v.powf(p))
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
            Gelu => {
                // d/dx x Phi(x) = Phi(x) + x phi(x)
                let x = saved()?;
                let cdf = x
                    .mul_scalar(std::f64::consts::FRAC_1_SQRT_2)?
                    .erf()?
                    .add_scalar(1.0)?
                    .mul_scalar(0.5)?;
                let pdf = x
                    .mul(&x)?
                    .mul_scalar(-0.5)?
                    .exp()?
                    .mul_scalar(1.0 / (2.0 * std::f64::consts::PI).sqrt())?;
                g.mul(&cdf.add(&x.mul(&pdf)?)?)?
            }
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
                    expected: "float32 or float64",
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

fn unary(kind: UnaryKind, x: &Tensor) -> Result<Tensor> {
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

// ---------------------------------------------------------------------------------------------
// where

struct Where;
impl Function for Where {
    fn name(&self) -> &str {
        "WhereBackward"
    }
    fn forward(&self, ctx: &mut Context, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (c, a, b) = (inputs[0], inputs[1], inputs[2]);
        same_device("where", a, b)?;
        let shape = broadcast_shapes(
            &broadcast_shapes(c.shape(), a.shape(), "where")?,
            b.shape(),
            "where",
        )?;
        let lc = c.layout().broadcast_to(&shape, "where")?;
        let ab = binary_map_where(a, b, c, &lc, &shape)?;
        ctx.save_for_backward(&[c]);
        ctx.save_value((a.shape().to_vec(), b.shape().to_vec()));
        Ok(vec![ab])
    }
    fn backward(&self, ctx: &Context, g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let c = ctx.saved_tensors()?.remove(0);
        let (sa, sb) = ctx.get::<(Vec<usize>, Vec<usize>)>()?.clone();
        let z = g[0].zeros_like()?;
        Ok(vec![
            None,
            Some(g[0].where_(&c, &z)?.sum_to_size(&sa)?),
            Some(z.where_(&c, &g[0])?.sum_to_size(&sb)?),
        ])
    }
}

fn binary_map_where(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    lc: &Layout,
    shape: &[usize],
) -> Result<Tensor> {
    if let Some(r) = crate::backend::on_device2(a, b, |ca, la, cb, lb| {
        let (la, lb) = (
            la.broadcast_to(shape, "where")?,
            lb.broadcast_to(shape, "where")?,
        );
        let Some(r) = crate::backend::on_device(c, |cc, _| cc.select(lc, (ca, &la), (cb, &lb)))
        else {
            return Err(Error::DeviceMismatch {
                op: "where",
                lhs: c.device(),
                rhs: a.device(),
            });
        };
        Ok(crate::backend::device_tensor(r?, shape))
    }) {
        return r;
    }
    let mask: Vec<bool> = c.with_slice("where", |s: &[bool], _| super::gather_strided(s, lc))?;
    let ae = a.expand(shape)?;
    let be = b.expand(shape)?;
    any_dispatch!(a.dtype(), T => {
        let av: Vec<T> = ae.with_slice("where", |s: &[T], l| super::gather_strided(s, l))?;
        let bv: Vec<T> = be.with_slice("where", |s: &[T], l| super::gather_strided(s, l))?;
        let v: Vec<T> = mask.iter().zip(av.into_iter().zip(bv)).map(|(&m, (x, y))| if m { x } else { y }).collect();
        Ok(Tensor::from_cpu(T::into_storage(v), shape))
    })
}

// ---------------------------------------------------------------------------------------------
// public API

macro_rules! cmp_methods {
    ($($name:ident, $sname:ident, $op:tt, $code:ident, $doc:literal;)*) => {
        $(
            #[doc = concat!("Elementwise `self ", stringify!($op), " other` with broadcasting, as a bool tensor (", $doc, "). Not differentiable.")]
            pub fn $name(&self, other: &Tensor) -> Result<Tensor> {
                let dt = promote(self.dtype(), other.dtype());
                let a = self.to_dtype(dt)?.detach();
                let b = other.to_dtype(dt)?.detach();
                if let Some(r) = device_map2(&a, &b, stringify!($name), |ca, la, cb, lb| {
                    ca.compare(la, Some((cb, lb)), CmpCode::$code, 0.0)
                }) {
                    return r;
                }
                any_dispatch!(dt, T => binary_map::<T, bool>(&a, &b, stringify!($name), |x, y| x $op y))
            }
            #[doc = concat!("Elementwise `self ", stringify!($op), " value`, as a bool tensor. Not differentiable.")]
            pub fn $sname(&self, value: f64) -> Result<Tensor> {
                if let Some(r) = device_map(self, |c, l| c.compare(l, None, CmpCode::$code, value)) {
                    return r;
                }
                any_dispatch!(self.dtype(), T => unary_map::<T, bool>(self, stringify!($sname), |x| crate::Element::to_f64(x) $op value))
            }
        )*
    };
}

impl Tensor {
    /// Converts to `dtype` (a copy; differentiable between float types). Returns the same
    /// handle when the dtype already matches.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if self.dtype() == dtype {
            return Ok(self.clone());
        }
        Ok(apply(
            Cast {
                from: self.dtype(),
                to: dtype,
            },
            &[self],
        )?
        .remove(0))
    }

    /// `self + other` with broadcasting and type promotion (`torch.add`).
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        binary(BinaryKind::Add, self, other)
    }
    /// `self - other` with broadcasting (`torch.sub`).
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        binary(BinaryKind::Sub, self, other)
    }
    /// `self * other` with broadcasting (`torch.mul`).
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        binary(BinaryKind::Mul, self, other)
    }
    /// `self / other` with broadcasting; true division, so integer inputs give float32.
    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        binary(BinaryKind::Div, self, other)
    }
    /// `self ** other` with broadcasting (`torch.pow`); float only.
    pub fn pow(&self, other: &Tensor) -> Result<Tensor> {
        binary(BinaryKind::Pow, self, other)
    }
    /// Elementwise maximum (`torch.maximum`); NaN propagates; ties split the gradient.
    pub fn maximum(&self, other: &Tensor) -> Result<Tensor> {
        binary(BinaryKind::Maximum, self, other)
    }
    /// Elementwise minimum (`torch.minimum`); NaN propagates; ties split the gradient.
    pub fn minimum(&self, other: &Tensor) -> Result<Tensor> {
        binary(BinaryKind::Minimum, self, other)
    }
    /// `-self`.
    pub fn neg(&self) -> Result<Tensor> {
        unary(UnaryKind::Neg, self)
    }
    /// `self + value`.
    pub fn add_scalar(&self, value: f64) -> Result<Tensor> {
        unary(UnaryKind::AddScalar(value), self)
    }
    /// `self - value`.
    pub fn sub_scalar(&self, value: f64) -> Result<Tensor> {
        unary(UnaryKind::AddScalar(-value), self)
    }
    /// `self * value`.
    pub fn mul_scalar(&self, value: f64) -> Result<Tensor> {
        unary(UnaryKind::MulScalar(value), self)
    }
    /// `self / value`.
    pub fn div_scalar(&self, value: f64) -> Result<Tensor> {
        unary(UnaryKind::DivScalar(value), self)
    }
    /// `self ** exponent` (float only).
    pub fn pow_scalar(&self, exponent: f64) -> Result<Tensor> {
        unary(UnaryKind::PowScalar(exponent), self)
    }
    /// `e ** self` (float only).
    pub fn exp(&self) -> Result<Tensor> {
        unary(UnaryKind::Exp, self)
    }
    /// Natural logarithm (float only).
    pub fn log(&self) -> Result<Tensor> {
        unary(UnaryKind::Log, self)
    }
    /// Square root (float only).
    pub fn sqrt(&self) -> Result<Tensor> {
        unary(UnaryKind::Sqrt, self)
    }
    /// Absolute value; the gradient at 0 is 0, as in PyTorch.
    pub fn abs(&self) -> Result<Tensor> {
        unary(UnaryKind::Abs, self)
    }
    /// `max(self, 0)`; the gradient at 0 is 0, as in PyTorch.
    pub fn relu(&self) -> Result<Tensor> {
        unary(UnaryKind::Relu, self)
    }
    /// Logistic sigmoid `1 / (1 + e^-x)` (float only).
    pub fn sigmoid(&self) -> Result<Tensor> {
        unary(UnaryKind::Sigmoid, self)
    }
    /// Hyperbolic tangent (float only).
    pub fn tanh(&self) -> Result<Tensor> {
        unary(UnaryKind::Tanh, self)
    }
    /// Exact GELU `x * Phi(x)` with the erf-based normal CDF (PyTorch's default
    /// `approximate='none'`).
    pub fn gelu(&self) -> Result<Tensor> {
        unary(UnaryKind::Gelu, self)
    }
    /// The error function (float only).
    pub fn erf(&self) -> Result<Tensor> {
        unary(UnaryKind::Erf, self)
    }
    /// The sign (-1, 0 or 1) in this dtype; not differentiable (zero gradient).
    pub fn sign(&self) -> Result<Tensor> {
        let t = self.detach();
        if let Some(r) = device_map(&t, |c, l| {
            if t.dtype() == DType::Bool {
                return Err(Error::UnsupportedDType {
                    op: "sign",
                    dtype: DType::Bool,
                    expected: "float32, float64 or int64",
                });
            }
            c.unary(l, UnaryCode::Sign, 0.0)
        }) {
            return r;
        }
        numeric_dispatch!(t.dtype(), "sign", T => unary_map::<T, T>(&t, "sign", |v| {
            let z = T::default();
            if v > z { T::from_f64(1.0) } else if v < z { T::from_f64(-1.0) } else { v }
        }))
    }
    /// Elementwise logical not of a bool tensor.
    pub fn logical_not(&self) -> Result<Tensor> {
        if self.dtype() != DType::Bool {
            return Err(Error::UnsupportedDType {
                op: "logical_not",
                dtype: self.dtype(),
                expected: "bool",
            });
        }
        if let Some(r) = device_map(self, |c, l| c.unary(l, UnaryCode::Not, 0.0)) {
            return r;
        }
        unary_map::<bool, bool>(self, "logical_not", |v| !v)
    }

    cmp_methods! {
        eq, eq_scalar, ==, Eq, "`torch.eq`";
        ne, ne_scalar, !=, Ne, "`torch.ne`";
        lt, lt_scalar, <, Lt, "`torch.lt`";
        le, le_scalar, <=, Le, "`torch.le`";
        gt, gt_scalar, >, Gt, "`torch.gt`";
        ge, ge_scalar, >=, Ge, "`torch.ge`";
    }

    /// `condition ? self : other` elementwise with broadcasting (`torch.where(condition,
    /// self, other)`); `condition` must be bool. Differentiable in `self` and `other`.
    pub fn where_(&self, condition: &Tensor, other: &Tensor) -> Result<Tensor> {
        if condition.dtype() != DType::Bool {
            return Err(Error::UnsupportedDType {
                op: "where",
                dtype: condition.dtype(),
                expected: "bool for the condition",
            });
        }
        let dt = promote(self.dtype(), other.dtype());
        let a = self.to_dtype(dt)?;
        let b = other.to_dtype(dt)?;
        Ok(apply(Where, &[condition, &a, &b])?.remove(0))
    }

    // -----------------------------------------------------------------------------------------
    // in-place

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
            let src: Vec<T> = value.with_slice(op, |s: &[T], l| super::gather_strided(s, l))?;
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
        super::creation::check_fill_value("fill_", value, self.dtype())?;
        let v = Tensor::full(&[], value, (self.dtype(), self.device()))?;
        self.assign_inplace("fill_", v)
    }
    /// Sets every element to zero (`zero_`).
    pub fn zero_(&self) -> Result<()> {
        self.fill_(0.0)
    }
}
