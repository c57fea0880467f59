//! The public elementwise methods of [`Tensor`] that return a new tensor: casts, arithmetic,
//! unary math, comparisons and `where`.

use super::binary::{BinaryKind, binary};
use super::cast::Cast;
use super::unary::{UnaryKind, unary};
use super::where_::Where;
use super::{binary_map, promote, unary_map};
use crate::autograd::apply;
use crate::backend::{CmpCode, DeviceStorage as _, UnaryCode};
use crate::ops::{any_dispatch, device_map, device_map2, numeric_dispatch};
use crate::{DType, Error, Result, Tensor};

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
    /// handle when the dtype already matches. On the meta device, a new meta tensor of
    /// `dtype` without history (there is nothing to convert).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if self.dtype() == dtype {
            return Ok(self.clone());
        }
        if self.device().is_meta() {
            return crate::ops::creation::meta("to_dtype", self.shape(), dtype);
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

    /// `self` as `bfloat16` (`torch.Tensor.bfloat16`): [`to_dtype`](Tensor::to_dtype)`(DType::BF16)`,
    /// rounding to nearest even.
    pub fn bfloat16(&self) -> Result<Tensor> {
        self.to_dtype(DType::BF16)
    }
    /// `self` as `float16` (`torch.Tensor.half`): [`to_dtype`](Tensor::to_dtype)`(DType::F16)`,
    /// rounding to nearest even (beyond 65504 to infinity).
    pub fn half(&self) -> Result<Tensor> {
        self.to_dtype(DType::F16)
    }
    /// `self` as `float32` (`torch.Tensor.float`).
    pub fn float(&self) -> Result<Tensor> {
        self.to_dtype(DType::F32)
    }
    /// `self` as `float64` (`torch.Tensor.double`).
    pub fn double(&self) -> Result<Tensor> {
        self.to_dtype(DType::F64)
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
        if let Some(x) = crate::amp::to_fp32(&[self, other])? {
            return x[0].pow(&x[1]);
        }
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
        if let Some(x) = crate::amp::to_fp32(&[self])? {
            return x[0].pow_scalar(exponent);
        }
        unary(UnaryKind::PowScalar(exponent), self)
    }
    /// `e ** self` (float only).
    pub fn exp(&self) -> Result<Tensor> {
        if let Some(x) = crate::amp::to_fp32(&[self])? {
            return x[0].exp();
        }
        unary(UnaryKind::Exp, self)
    }
    /// Natural logarithm (float only).
    pub fn log(&self) -> Result<Tensor> {
        if let Some(x) = crate::amp::to_fp32(&[self])? {
            return x[0].log();
        }
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
    ///
    /// On the CPU the forward and the first-order backward are one fused pass each (erf
    /// within 1 ULP in float32); a recorded backward (`create_graph`) is composed, so second
    /// derivatives work.
    pub fn gelu(&self) -> Result<Tensor> {
        if self.device().is_cuda() {
            return unary(UnaryKind::Gelu, self);
        }
        crate::ops::gelu_erf::gelu(self)
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
            if v > z { <T as crate::Element>::from_f64(1.0) } else if v < z { <T as crate::Element>::from_f64(-1.0) } else { v }
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
}
