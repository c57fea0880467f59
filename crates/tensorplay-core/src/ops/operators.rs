//! Arithmetic operators on tensors (`std::ops`): `+ - * /` between two tensors, owned or
//! borrowed in any combination (`&a + &b`, `a + b`, `&a + b`, `a + &b`), and with an `f64`
//! scalar on either side (`&a * 2.0`, `2.0 * &a`, `2.0 - &a`, `2.0 / &a`), and unary `-`.
//!
//! Each operator is its named method: `&a + &b` is [`Tensor::add`], `&a * 2.0` is
//! [`Tensor::mul_scalar`], `-&a` is [`Tensor::neg`], with the same broadcasting, type promotion
//! and autograd history. A scalar on the left: `2.0 + a` and `2.0 * a` are `a.add_scalar(2.0)` and
//! `a.mul_scalar(2.0)`; `2.0 - a` is `a.neg().add_scalar(2.0)`; `2.0 / a` is a true division of
//! a 0-dim tensor holding 2.0 by `a` (`Tensor::div`), so its gradient is `-2 / a²`. The `f64`
//! scalar is a Python float in PyTorch's promotion rule: a float tensor keeps its dtype (a
//! float32 tensor times `2.0` is float32, not float64), and an int64 or bool tensor becomes
//! float32 first (`int64 + 2.0` is float32, as `torch.tensor([1]) + 2.0`). For int64 arithmetic that stays int64, call the named
//! method: `a.add_scalar(2.0)` keeps int64 for a whole scalar in int64's range and refuses one
//! outside it.
//!
//! An operator cannot return a `Result`, so where the named method returns an error (shapes
//! that do not broadcast, a dtype the operation does not take, operands on two devices) the
//! operator **panics**, naming the operator and both operands' shapes and dtypes, then the
//! method's error. Call the named method to handle the error instead. Compound assignment
//! (`+=`) is not provided; use the in-place methods (`add_`, `mul_scalar_`, ...).
//!
//! ```
//! use tensorplay_core::{self as tp, Tensor};
//!
//! let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?.requires_grad_(true);
//! let b = Tensor::from_vec(vec![10.0f32, 20.0], &[2])?;
//! let y = (&a * 2.0 + &b) / 2.0 - 1.0; // broadcasts b over the rows
//! assert_eq!(y.to_vec::<f32>()?, vec![5.0, 11.0, 7.0, 13.0]);
//! assert_eq!(y.to_vec::<f32>()?, a.mul_scalar(2.0)?.add(&b)?.div_scalar(2.0)?.sub_scalar(1.0)?.to_vec::<f32>()?);
//! (-&y).sum()?.backward()?;
//! assert_eq!(a.grad().unwrap().to_vec::<f32>()?, vec![-1.0; 4]);
//! // the named methods return the error the operators panic with
//! assert!(a.add(&Tensor::ones(&[3], tp::DType::F32)?).is_err());
//! # Ok::<(), tp::Error>(())
//! ```

use crate::{DType, Result, Tensor};
use std::ops::{Add, Div, Mul, Neg, Sub};

/// The result of a named method, or the operator's panic naming both operands.
fn or_panic(sym: &str, operands: impl FnOnce() -> String, r: Result<Tensor>) -> Tensor {
    match r {
        Ok(t) => t,
        Err(e) => panic!(
            "tensor operator `{sym}`: {}: {e} (the named method returns this error as a Result)",
            operands()
        ),
    }
}

/// A tensor operand as the panic names it: `tensor of shape [2, 3] (float32)`.
fn describe(t: &Tensor) -> String {
    format!("tensor of shape {:?} ({})", t.shape(), t.dtype())
}

/// `a <op> b` through the named method `f`.
fn tensor_tensor(
    sym: &str,
    a: &Tensor,
    b: &Tensor,
    f: fn(&Tensor, &Tensor) -> Result<Tensor>,
) -> Tensor {
    or_panic(
        sym,
        || format!("lhs {}, rhs {}", describe(a), describe(b)),
        f(a, b),
    )
}

/// `a`, or `a` as float32 when it is an integer or bool tensor: an `f64` operand is a Python
/// float, which promotes those to the default float dtype in PyTorch.
fn as_float(a: &Tensor) -> Result<Tensor> {
    if a.dtype().is_float() {
        Ok(a.clone())
    } else {
        a.to_dtype(DType::F32)
    }
}

/// `a <op> s` through the named scalar method `f`.
fn tensor_scalar(sym: &str, a: &Tensor, s: f64, f: fn(&Tensor, f64) -> Result<Tensor>) -> Tensor {
    or_panic(
        sym,
        || format!("lhs {}, rhs scalar {s:?}", describe(a)),
        as_float(a).and_then(|a| f(&a, s)),
    )
}

/// `s <op> a` through `f(a, s)`.
fn scalar_tensor(sym: &str, s: f64, a: &Tensor, f: fn(&Tensor, f64) -> Result<Tensor>) -> Tensor {
    or_panic(
        sym,
        || format!("lhs scalar {s:?}, rhs {}", describe(a)),
        as_float(a).and_then(|a| f(&a, s)),
    )
}

/// `s - a` as `a.neg().add_scalar(s)`: exact in IEEE arithmetic (negation is exact) and
/// differentiable (gradient -1).
fn rsub(a: &Tensor, s: f64) -> Result<Tensor> {
    Tensor::add_scalar(&Tensor::neg(a)?, s)
}

/// `s / a` as a true division of a 0-dim tensor holding `s` by `a` (gradient `-s / a²`; `a`
/// is a float tensor: [`scalar_tensor`] converts the others).
fn rdiv(a: &Tensor, s: f64) -> Result<Tensor> {
    // (the path, not `.div`: with `std::ops::Div` in scope an owned receiver picks the operator)
    Tensor::div(&Tensor::full(&[], s, (a.dtype(), a.device()))?, a)
}

/// Every owned/borrowed combination of two tensors and of a tensor and an `f64` scalar, for
/// one operator trait.
macro_rules! operator {
    ($Trait:ident, $method:ident, $sym:literal, $named:ident, $scalar:expr, $rscalar:expr,
     $rname:literal) => {
        #[doc = concat!("`&a ", $sym, " &b` is [`Tensor::", stringify!($named), "`] (broadcasting, ",
            "type promotion, autograd). Panics where that method returns an error (shapes that do ",
            "not broadcast, an unsupported dtype, two devices), naming the operator and both ",
            "operands' shapes and dtypes; call the method to get the error instead.")]
        impl $Trait<&Tensor> for &Tensor {
            type Output = Tensor;
            fn $method(self, rhs: &Tensor) -> Tensor {
                tensor_tensor($sym, self, rhs, Tensor::$named)
            }
        }
        #[doc = concat!("`a ", $sym, " b`, as `&a ", $sym, " &b`; panics as it does.")]
        impl $Trait<Tensor> for Tensor {
            type Output = Tensor;
            fn $method(self, rhs: Tensor) -> Tensor {
                tensor_tensor($sym, &self, &rhs, Tensor::$named)
            }
        }
        #[doc = concat!("`a ", $sym, " &b`, as `&a ", $sym, " &b`; panics as it does.")]
        impl $Trait<&Tensor> for Tensor {
            type Output = Tensor;
            fn $method(self, rhs: &Tensor) -> Tensor {
                tensor_tensor($sym, &self, rhs, Tensor::$named)
            }
        }
        #[doc = concat!("`&a ", $sym, " b`, as `&a ", $sym, " &b`; panics as it does.")]
        impl $Trait<Tensor> for &Tensor {
            type Output = Tensor;
            fn $method(self, rhs: Tensor) -> Tensor {
                tensor_tensor($sym, self, &rhs, Tensor::$named)
            }
        }
        #[doc = concat!("`&a ", $sym, " s` with an `f64` scalar (a Python float: a float tensor ",
            "keeps its dtype, an int64 or bool tensor becomes float32 first), through the named ",
            "scalar method. Panics where that method returns an error, naming the operator, the ",
            "shape and dtype.")]
        impl $Trait<f64> for &Tensor {
            type Output = Tensor;
            fn $method(self, rhs: f64) -> Tensor {
                tensor_scalar($sym, self, rhs, $scalar)
            }
        }
        #[doc = concat!("`a ", $sym, " s`, as `&a ", $sym, " s`; panics as it does.")]
        impl $Trait<f64> for Tensor {
            type Output = Tensor;
            fn $method(self, rhs: f64) -> Tensor {
                tensor_scalar($sym, &self, rhs, $scalar)
            }
        }
        #[doc = concat!("`s ", $sym, " &a` with an `f64` scalar on the left: ", $rname,
            " (see the `operators` module notes). Panics where that returns an error, naming the ",
            "operator, the shape and dtype.")]
        impl $Trait<&Tensor> for f64 {
            type Output = Tensor;
            fn $method(self, rhs: &Tensor) -> Tensor {
                scalar_tensor($sym, self, rhs, $rscalar)
            }
        }
        #[doc = concat!("`s ", $sym, " a`, as `s ", $sym, " &a`; panics as it does.")]
        impl $Trait<Tensor> for f64 {
            type Output = Tensor;
            fn $method(self, rhs: Tensor) -> Tensor {
                scalar_tensor($sym, self, &rhs, $rscalar)
            }
        }
    };
}

operator!(
    Add,
    add,
    "+",
    add,
    Tensor::add_scalar,
    Tensor::add_scalar,
    "`a.add_scalar(s)`"
);
operator!(
    Sub,
    sub,
    "-",
    sub,
    Tensor::sub_scalar,
    rsub,
    "`a.neg().add_scalar(s)`"
);
operator!(
    Mul,
    mul,
    "*",
    mul,
    Tensor::mul_scalar,
    Tensor::mul_scalar,
    "`a.mul_scalar(s)`"
);
operator!(
    Div,
    div,
    "/",
    div,
    Tensor::div_scalar,
    rdiv,
    "a true division of a 0-dim tensor holding `s` by `a` (gradient `-s / a²`)"
);

/// `-&a` is [`Tensor::neg`] (autograd recorded; int64 wraps as in PyTorch). Panics where that
/// method returns an error (a bool tensor), naming the shape and dtype.
impl Neg for &Tensor {
    type Output = Tensor;
    fn neg(self) -> Tensor {
        or_panic(
            "-",
            || format!("operand {}", describe(self)),
            Tensor::neg(self),
        )
    }
}

/// `-a`, as `-&a`; panics as it does.
impl Neg for Tensor {
    type Output = Tensor;
    fn neg(self) -> Tensor {
        -&self
    }
}
