//! Hostile input: every public entry point fed shapes, dtypes, indices and hyperparameters it
//! must refuse. Each case asserts the specific [`Error`] variant (never a panic, a hang, an
//! attempt to allocate petabytes, or a silently wrong value). Every test's work is small.

#![allow(clippy::cloned_ref_to_slice_refs)]

use std::collections::BTreeMap;
use std::sync::Arc;

use tensorplay_core::autograd::{self, GradOptions};
use tensorplay_core::nn::{self, Module, functional as F};
use tensorplay_core::optim::{Adam, AdamOptions, AdamW, AdamWOptions, Optimizer, SGD, SgdOptions};
use tensorplay_core::{self as tp, DType, Device, Error, Tensor};

/// Asserts that `$e` is an `Err` matching `$p`, printing the error otherwise.
macro_rules! assert_err {
    ($e:expr, $p:pat) => {{
        match $e {
            Err(e) => assert!(matches!(e, $p), "wrong error: {e:?} ({e})"),
            Ok(v) => panic!("expected an error, got Ok({v:?})"),
        }
    }};
}

/// Asserts an `InvalidArgument` naming `$op` and `$arg`.
macro_rules! assert_invalid {
    ($e:expr, $op:expr, $arg:expr) => {{
        match $e {
            Err(Error::InvalidArgument { op, arg, .. }) => {
                assert_eq!((op, arg), ($op, $arg));
            }
            Err(e) => panic!("expected InvalidArgument({}, {}), got {e:?}", $op, $arg),
            Ok(v) => panic!("expected an error, got Ok({v:?})"),
        }
    }};
}

fn f32s(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape).unwrap()
}

fn f64s(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape).unwrap()
}

fn i64s(v: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape).unwrap()
}

fn empty(shape: &[usize]) -> Tensor {
    tp::zeros(shape).unwrap()
}

// ---------------------------------------------------------------------------------------------
// creation: lengths, overflowing and enormous shapes, arange, randint

#[test]
fn from_vec_wrong_length() {
    assert_invalid!(
        Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[2, 2]),
        "from_vec",
        "shape"
    );
    assert_invalid!(
        Tensor::from_vec(Vec::<f32>::new(), &[]),
        "from_vec",
        "shape"
    );
    assert_invalid!(Tensor::from_slice(&[1i64], &[0]), "from_vec", "shape");
}

#[test]
fn shapes_whose_product_overflows_are_errors() {
    let big = [usize::MAX, 2];
    assert_invalid!(Tensor::from_vec(vec![0.0f32; 2], &big), "from_vec", "shape");
    assert_invalid!(tp::zeros(&big), "zeros", "shape");
    assert_invalid!(tp::ones(&big), "full", "shape");
    assert_invalid!(tp::full(&big, 1.0), "full", "shape");
    assert_invalid!(tp::rand(&big), "rand", "shape");
    assert_invalid!(tp::randn(&big), "randn", "shape");
    assert_invalid!(tp::randint(0, 3, &big), "randint", "shape");
    // a zero dim does not make the strides of the other dims fit
    assert_invalid!(tp::zeros(&[0, usize::MAX, 2]), "zeros", "shape");
    assert_invalid!(
        Tensor::from_vec(Vec::<f32>::new(), &[0, usize::MAX, usize::MAX]),
        "from_vec",
        "shape"
    );
}

#[test]
fn enormous_allocations_are_errors_not_aborts() {
    // 2^50 float32 elements: 4 PiB, more than any address space holds
    let huge = [1usize << 25, 1 << 25];
    assert_invalid!(tp::zeros(&huge), "zeros", "shape");
    // element counts that fit a usize whose bytes do not
    assert_invalid!(tp::zeros(&[1usize << 62]), "zeros", "shape");
    assert_invalid!(tp::rand(&[(1usize << 60) + 1]), "rand", "shape");
    assert_invalid!(tp::full(&huge, 2.0), "full", "shape");
    assert_invalid!(Tensor::zeros(&huge, DType::Bool), "zeros", "shape");
    assert_invalid!(tp::rand(&huge), "rand", "shape");
    assert_invalid!(tp::randint(0, 2, &huge), "randint", "shape");
    assert_invalid!(tp::arange(0.0, 1e18, 1.0), "arange", "end");
}

#[test]
fn arange_rejects_nan_inf_and_zero_steps() {
    assert_invalid!(tp::arange(0.0, 5.0, 0.0), "arange", "step");
    assert_invalid!(tp::arange(0.0, 5.0, f64::NAN), "arange", "step");
    assert_invalid!(tp::arange(0.0, 5.0, f64::INFINITY), "arange", "step");
    assert_invalid!(tp::arange(0.0, 5.0, -1.0), "arange", "step");
    // NaN or infinite bounds must not silently give an empty tensor or a huge one
    assert_invalid!(tp::arange(f64::NAN, 5.0, 1.0), "arange", "start");
    assert_invalid!(tp::arange(0.0, f64::NAN, 1.0), "arange", "end");
    assert_invalid!(tp::arange(0.0, f64::INFINITY, 1.0), "arange", "end");
    assert_invalid!(tp::arange(f64::NEG_INFINITY, 0.0, 1.0), "arange", "start");
    // the empty range is fine
    assert_eq!(tp::arange(3.0, 3.0, 1.0).unwrap().shape(), &[0]);
}

#[test]
fn randint_needs_high_above_low() {
    assert_invalid!(tp::randint(3, 3, &[2]), "randint", "high");
    assert_invalid!(tp::randint(5, -5, &[2]), "randint", "high");
    // the full i64 range works
    let t = tp::randint(i64::MIN, i64::MAX, &[4]).unwrap();
    assert_eq!(t.shape(), &[4]);
}

#[test]
fn rand_rejects_integer_dtypes() {
    assert_err!(
        Tensor::rand(&[2], DType::I64),
        Error::UnsupportedDType { op: "rand", .. }
    );
    assert_err!(
        Tensor::randn(&[2], DType::Bool),
        Error::UnsupportedDType { op: "randn", .. }
    );
}

#[test]
fn full_rejects_values_an_integer_dtype_cannot_hold() {
    assert_invalid!(Tensor::full(&[2], f64::NAN, DType::I64), "full", "value");
    assert_invalid!(
        Tensor::full(&[2], f64::INFINITY, DType::I64),
        "full",
        "value"
    );
    assert_invalid!(Tensor::full(&[2], 1e30, DType::I64), "full", "value");
    let t = Tensor::full(&[2], -7.0, DType::I64).unwrap();
    assert_eq!(t.to_vec::<i64>().unwrap(), vec![-7, -7]);
    let x = i64s(&[1, 2], &[2]);
    assert_invalid!(x.fill_(f64::NAN), "fill_", "value");
}

// ---------------------------------------------------------------------------------------------
// reshape / view / expand / narrow / select / permute

#[test]
fn reshape_errors() {
    let x = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    assert_invalid!(x.reshape(&[-1isize, -1]), "reshape", "shape");
    assert_invalid!(x.reshape(&[4usize]), "reshape", "shape");
    assert_invalid!(x.reshape(&[-2isize, 3]), "reshape", "shape");
    assert_invalid!(x.reshape(&[4isize, -1]), "reshape", "shape");
    // a huge usize size is not a -1 in disguise
    assert_invalid!(x.reshape(&[usize::MAX, 6]), "reshape", "shape");
    assert_invalid!(x.reshape(&[usize::MAX - 1, 3]), "reshape", "shape");
    // products that overflow
    assert_invalid!(x.reshape(&[usize::MAX / 2, 4, 0]), "reshape", "shape");
    let e = empty(&[0]);
    assert_invalid!(e.reshape(&[0usize, 1 << 40, 1 << 40]), "reshape", "shape");
    assert_invalid!(e.reshape(&[0isize, -1]), "reshape", "shape");
    // view refuses non-contiguous tensors, reshape copies
    let t = x.t().unwrap();
    assert_invalid!(t.view(&[6usize]), "view", "self");
    assert_eq!(
        t.reshape(&[6usize]).unwrap().to_vec::<f32>().unwrap(),
        vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
    );
    // -1 among zero sizes is ambiguous (PyTorch refuses it too); explicit sizes are fine
    assert_invalid!(empty(&[0, 3]).reshape(&[3isize, 0, -1]), "reshape", "shape");
    assert_eq!(
        empty(&[0, 3]).reshape(&[3usize, 0, 5]).unwrap().shape(),
        &[3, 0, 5]
    );
}

#[test]
fn expand_errors() {
    let x = f32s(&[1.0, 2.0], &[1, 2]);
    assert_err!(x.expand(&[3, 3]), Error::ShapeMismatch { op: "expand", .. });
    assert_err!(x.expand(&[2]), Error::ShapeMismatch { op: "expand", .. });
    assert_invalid!(x.expand(&[usize::MAX, 2]), "expand", "shape");
    assert_invalid!(
        x.expand(&[usize::MAX / 2, usize::MAX / 2, 2]),
        "expand",
        "shape"
    );
    assert_eq!(x.expand(&[0, 2]).unwrap().numel(), 0);
}

#[test]
fn narrow_select_permute_errors() {
    let x = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    assert_invalid!(x.narrow(1, 2, 2), "narrow", "start + length");
    assert_invalid!(x.narrow(1, usize::MAX, 2), "narrow", "start + length");
    assert_invalid!(x.narrow(0, 3, 0), "narrow", "start + length");
    assert_err!(x.narrow(2, 0, 1), Error::DimOutOfRange { op: "narrow", .. });
    assert_err!(x.narrow(isize::MIN, 0, 1), Error::DimOutOfRange { .. });
    assert_invalid!(Tensor::scalar(1.0f32).narrow(0, 0, 1), "narrow", "self");
    assert_err!(
        x.select(1, 3),
        Error::IndexOutOfBounds {
            op: "select",
            index: 3,
            ..
        }
    );
    assert_err!(
        x.select(1, -4),
        Error::IndexOutOfBounds {
            op: "select",
            index: -4,
            ..
        }
    );
    assert_err!(
        x.select(0, isize::MIN),
        Error::IndexOutOfBounds { op: "select", .. }
    );
    assert_err!(
        empty(&[0, 2]).select(0, 0),
        Error::IndexOutOfBounds { op: "select", .. }
    );
    assert_invalid!(Tensor::scalar(1.0f32).select(0, 0), "select", "self");
    assert_invalid!(x.permute(&[0, 0]), "permute", "dims");
    assert_invalid!(x.permute(&[0]), "permute", "dims");
    assert_invalid!(x.permute(&[0, 7]), "permute", "dims");
    assert_err!(
        x.transpose(0, 5),
        Error::DimOutOfRange {
            op: "transpose",
            ..
        }
    );
    assert_err!(
        x.unsqueeze(4),
        Error::DimOutOfRange {
            op: "unsqueeze",
            ..
        }
    );
    assert_invalid!(empty(&[1, 1, 1]).t(), "t", "self");
}

#[test]
fn split_chunk_errors() {
    let x = f32s(&[1.0, 2.0, 3.0], &[3]);
    assert_invalid!(x.split(0, 0), "split", "split_size");
    assert_invalid!(x.chunk(0, 0), "chunk", "chunks");
    assert_invalid!(
        x.split_with_sizes(&[1, 1], 0),
        "split_with_sizes",
        "split_sizes"
    );
    // a sum that overflows is an error, not a panic
    assert_invalid!(
        x.split_with_sizes(&[usize::MAX, 4], 0),
        "split_with_sizes",
        "split_sizes"
    );
    assert_eq!(x.split(usize::MAX, 0).unwrap().len(), 1);
}

#[test]
fn cat_and_stack_errors() {
    let a = f32s(&[1.0, 2.0], &[1, 2]);
    assert_invalid!(tp::cat(&[], 0), "cat", "tensors");
    assert_invalid!(tp::cat(&[Tensor::scalar(1.0f32)], 0), "cat", "tensors");
    assert_err!(
        tp::cat(&[a.clone(), f32s(&[1.0, 2.0, 3.0], &[1, 3])], 0),
        Error::ShapeMismatch { op: "cat", .. }
    );
    assert_err!(
        tp::cat(&[a.clone(), f32s(&[1.0, 2.0], &[2])], 0),
        Error::ShapeMismatch { op: "cat", .. }
    );
    assert_err!(
        tp::cat(&[a.clone(), f64s(&[1.0, 2.0], &[1, 2])], 0),
        Error::DTypeMismatch { op: "cat", .. }
    );
    assert_err!(
        tp::cat(&[a.clone(), a.clone()], 2),
        Error::DimOutOfRange { op: "cat", .. }
    );
    assert_invalid!(tp::stack(&[], 0), "stack", "tensors");
    assert_err!(
        tp::stack(&[a.clone(), a.t().unwrap()], 0),
        Error::ShapeMismatch { op: "stack", .. }
    );
    assert_err!(
        tp::stack(&[a.clone()], 3),
        Error::DimOutOfRange { op: "stack", .. }
    );
    // zero-size pieces are fine
    let c = tp::cat(&[empty(&[0, 2]), a.clone(), empty(&[0, 2])], 0).unwrap();
    assert_eq!(c.to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
}

// ---------------------------------------------------------------------------------------------
// reductions and softmax on empty and 0-d tensors, bad dims

#[test]
fn reductions_on_empty_tensors() {
    let e = empty(&[0, 3]);
    assert_eq!(e.sum().unwrap().item::<f32>().unwrap(), 0.0);
    assert_eq!(
        e.sum_dims(&[0], false).unwrap().to_vec::<f32>().unwrap(),
        vec![0.0; 3]
    );
    assert!(e.mean().unwrap().item::<f32>().unwrap().is_nan());
    assert_invalid!(e.max(), "max", "self");
    assert_invalid!(e.min(), "min", "self");
    assert_invalid!(e.max_dim(0, false), "max", "self");
    assert_eq!(e.max_dim(1, false).unwrap().0.shape(), &[0]);
    assert_invalid!(e.argmax(None, false), "argmax", "self");
    assert_invalid!(e.argmin(Some(0), false), "argmin", "self");
    assert_eq!(e.softmax(0).unwrap().shape(), &[0, 3]);
    assert_eq!(e.log_softmax(1).unwrap().shape(), &[0, 3]);
}

#[test]
fn reductions_with_bad_dims() {
    let x = f32s(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    assert_err!(
        x.sum_dims(&[2], false),
        Error::DimOutOfRange { op: "sum", .. }
    );
    assert_err!(
        x.sum_dims(&[-3], false),
        Error::DimOutOfRange { op: "sum", .. }
    );
    assert_invalid!(x.sum_dims(&[0, -2], false), "sum", "dims");
    assert_err!(
        x.mean_dims(&[5], false),
        Error::DimOutOfRange { op: "mean", .. }
    );
    assert_err!(x.max_dim(2, false), Error::DimOutOfRange { op: "max", .. });
    assert_err!(
        x.argmax(Some(-3), false),
        Error::DimOutOfRange { op: "argmax", .. }
    );
    assert_err!(x.softmax(2), Error::DimOutOfRange { op: "softmax", .. });
    assert_err!(
        x.log_softmax(-3),
        Error::DimOutOfRange {
            op: "log_softmax",
            ..
        }
    );
}

#[test]
fn reductions_of_a_0d_tensor_over_dim_0() {
    let s = Tensor::scalar(3.0f32);
    assert_eq!(s.sum_dims(&[0], false).unwrap().item::<f32>().unwrap(), 3.0);
    assert_eq!(
        s.mean_dims(&[0], false).unwrap().item::<f32>().unwrap(),
        3.0
    );
    assert_eq!(
        s.mean_dims(&[-1], true).unwrap().item::<f32>().unwrap(),
        3.0
    );
    assert_eq!(s.softmax(0).unwrap().item::<f32>().unwrap(), 1.0);
    assert_err!(
        s.sum_dims(&[1], false),
        Error::DimOutOfRange { op: "sum", .. }
    );
}

#[test]
fn float_only_ops_reject_integers_and_bools_naming_the_op() {
    let i = i64s(&[1, 2], &[2]);
    let b = Tensor::from_slice(&[true, false], &[2]).unwrap();
    assert_err!(i.mean(), Error::UnsupportedDType { op: "mean", .. });
    assert_err!(i.softmax(0), Error::UnsupportedDType { op: "softmax", .. });
    assert_err!(i.exp(), Error::UnsupportedDType { op: "exp", .. });
    assert_err!(i.log(), Error::UnsupportedDType { op: "log", .. });
    assert_err!(i.sqrt(), Error::UnsupportedDType { op: "sqrt", .. });
    assert_err!(i.tanh(), Error::UnsupportedDType { op: "tanh", .. });
    assert_err!(i.sigmoid(), Error::UnsupportedDType { op: "sigmoid", .. });
    assert_err!(i.pow_scalar(2.0), Error::UnsupportedDType { op: "pow", .. });
    assert_err!(b.neg(), Error::UnsupportedDType { op: "neg", .. });
    assert_err!(b.max(), Error::UnsupportedDType { op: "max", .. });
    assert_err!(
        b.argmax(None, false),
        Error::UnsupportedDType { op: "argmax", .. }
    );
    assert_err!(i.matmul(&i), Error::UnsupportedDType { op: "matmul", .. });
    assert_err!(
        f32s(&[1.0], &[1]).logical_not(),
        Error::UnsupportedDType {
            op: "logical_not",
            ..
        }
    );
}

#[test]
fn integer_requires_grad_is_refused() {
    let i = i64s(&[1, 2], &[2]);
    assert_err!(
        i.set_requires_grad(true),
        Error::UnsupportedDType {
            op: "requires_grad_",
            ..
        }
    );
    let b = Tensor::from_slice(&[true], &[1]).unwrap();
    assert_err!(b.set_requires_grad(true), Error::UnsupportedDType { .. });
    assert!(!i.requires_grad_(true).requires_grad());
}

#[test]
fn integer_arithmetic_wraps_instead_of_panicking() {
    let x = i64s(&[i64::MAX, i64::MIN], &[2]);
    assert_eq!(
        x.add(&i64s(&[1, -1], &[2]))
            .unwrap()
            .to_vec::<i64>()
            .unwrap(),
        vec![i64::MIN, i64::MAX]
    );
    assert_eq!(
        x.sub(&i64s(&[-1, 1], &[2]))
            .unwrap()
            .to_vec::<i64>()
            .unwrap(),
        vec![i64::MIN, i64::MAX]
    );
    assert_eq!(
        x.mul(&i64s(&[2, 2], &[2]))
            .unwrap()
            .to_vec::<i64>()
            .unwrap(),
        vec![-2, 0]
    );
    assert_eq!(
        x.neg().unwrap().to_vec::<i64>().unwrap(),
        vec![i64::MIN + 1, i64::MIN]
    );
    assert_eq!(x.abs().unwrap().to_vec::<i64>().unwrap()[1], i64::MIN);
    assert_eq!(
        x.add_scalar(1.0).unwrap().to_vec::<i64>().unwrap()[0],
        i64::MIN
    );
    assert_eq!(
        x.mul_scalar(2.0).unwrap().to_vec::<i64>().unwrap(),
        vec![-2, 0]
    );
    assert_eq!(x.sum().unwrap().item::<i64>().unwrap(), -1);
}

// ---------------------------------------------------------------------------------------------
// binary ops: shapes, devices, aliasing

#[test]
fn binary_ops_reject_unbroadcastable_shapes() {
    let a = f32s(&[1.0, 2.0, 3.0], &[3]);
    let b = f32s(&[1.0, 2.0], &[2]);
    assert_err!(a.add(&b), Error::ShapeMismatch { op: "add", .. });
    assert_err!(a.mul(&b), Error::ShapeMismatch { op: "mul", .. });
    assert_err!(a.div(&b), Error::ShapeMismatch { op: "div", .. });
    assert_err!(a.pow(&b), Error::ShapeMismatch { op: "pow", .. });
    assert_err!(a.maximum(&b), Error::ShapeMismatch { op: "maximum", .. });
    assert_err!(a.eq(&b), Error::ShapeMismatch { op: "eq", .. });
    assert_err!(a.add(&empty(&[0])), Error::ShapeMismatch { op: "add", .. });
    assert_eq!(empty(&[0, 3]).add(&a).unwrap().shape(), &[0, 3]);
    // broadcasting two huge expanded views into a shape whose size overflows
    let c = f32s(&[1.0], &[1, 1]).expand(&[1 << 40, 1]).unwrap();
    let d = f32s(&[1.0], &[1, 1]).expand(&[1, 1 << 40]).unwrap();
    assert_invalid!(c.add(&d), "add", "shape");
}

#[test]
fn mixed_dtypes_promote() {
    let a = f32s(&[1.0, 2.0], &[2]);
    let b = i64s(&[1, 2], &[2]);
    assert_eq!(a.add(&b).unwrap().dtype(), DType::F32);
    assert_eq!(b.div(&b).unwrap().dtype(), DType::F32);
    assert_eq!(f64s(&[1.0], &[1]).mul(&a).unwrap().dtype(), DType::F64);
}

#[test]
fn binary_ops_on_tensors_sharing_storage_do_not_deadlock() {
    let x = f32s(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let t = x.t().unwrap();
    assert_eq!(
        x.add(&t).unwrap().to_vec::<f32>().unwrap(),
        vec![2.0, 5.0, 5.0, 8.0]
    );
    assert_eq!(
        x.matmul(&t).unwrap().to_vec::<f32>().unwrap(),
        vec![5.0, 11.0, 11.0, 25.0]
    );
    let mask = x.gt_scalar(2.0).unwrap();
    assert_eq!(
        x.where_(&mask, &t).unwrap().to_vec::<f32>().unwrap(),
        vec![1.0, 3.0, 3.0, 4.0]
    );
    x.add_(&t).unwrap();
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![2.0, 5.0, 5.0, 8.0]);
}

#[test]
fn where_errors() {
    let a = f32s(&[1.0, 2.0], &[2]);
    let b = f32s(&[3.0, 4.0], &[2]);
    assert_err!(
        a.where_(&f32s(&[1.0, 0.0], &[2]), &b),
        Error::UnsupportedDType { op: "where", .. }
    );
    assert_err!(
        a.where_(&i64s(&[1, 0], &[2]), &b),
        Error::UnsupportedDType { op: "where", .. }
    );
    let c = Tensor::from_slice(&[true, false, true], &[3]).unwrap();
    assert_err!(a.where_(&c, &b), Error::ShapeMismatch { op: "where", .. });
}

// ---------------------------------------------------------------------------------------------
// matmul

#[test]
fn matmul_errors() {
    let a = f32s(&[1.0; 6], &[2, 3]);
    assert_invalid!(a.matmul(&Tensor::scalar(1.0f32)), "matmul", "operands");
    assert_invalid!(Tensor::scalar(1.0f32).matmul(&a), "matmul", "operands");
    assert_invalid!(a.matmul(&a), "matmul", "other");
    assert_invalid!(a.matmul(&f32s(&[1.0; 2], &[2])), "matmul", "other");
    assert_err!(
        a.matmul(&f64s(&[1.0; 3], &[3, 1])),
        Error::DTypeMismatch { op: "matmul", .. }
    );
    assert_err!(
        empty(&[2, 2, 3]).matmul(&empty(&[3, 3, 1])),
        Error::ShapeMismatch { op: "matmul", .. }
    );
    assert_invalid!(a.mm(&f32s(&[1.0; 3], &[3])), "mm", "operands");
    // zero-size dims give zeros of the right shape
    assert_eq!(
        empty(&[2, 0])
            .matmul(&empty(&[0, 3]))
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        vec![0.0; 6]
    );
    assert_eq!(
        empty(&[0, 3]).matmul(&empty(&[3, 4])).unwrap().shape(),
        &[0, 4]
    );
    assert_eq!(
        empty(&[0])
            .matmul(&empty(&[0]))
            .unwrap()
            .item::<f32>()
            .unwrap(),
        0.0
    );
}

// ---------------------------------------------------------------------------------------------
// indexing

#[test]
fn index_select_errors() {
    let x = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]);
    assert_err!(
        x.index_select(0, &i64s(&[3], &[1])),
        Error::IndexOutOfBounds {
            op: "index_select",
            index: 3,
            ..
        }
    );
    assert_err!(
        x.index_select(0, &i64s(&[-1], &[1])),
        Error::IndexOutOfBounds {
            op: "index_select",
            index: -1,
            ..
        }
    );
    assert_err!(
        x.index_select(1, &i64s(&[i64::MAX], &[1])),
        Error::IndexOutOfBounds {
            op: "index_select",
            ..
        }
    );
    assert_err!(
        x.index_select(0, &f32s(&[0.0], &[1])),
        Error::UnsupportedDType {
            op: "index_select",
            ..
        }
    );
    assert_invalid!(
        x.index_select(0, &i64s(&[0, 1], &[1, 2])),
        "index_select",
        "index"
    );
    assert_err!(
        x.index_select(2, &i64s(&[0], &[1])),
        Error::DimOutOfRange {
            op: "index_select",
            ..
        }
    );
    assert_err!(
        empty(&[0, 2]).index_select(0, &i64s(&[0], &[1])),
        Error::IndexOutOfBounds { .. }
    );
    assert_eq!(
        x.index_select(0, &i64s(&[], &[0])).unwrap().shape(),
        &[0, 2]
    );
    assert_eq!(
        empty(&[3, 0])
            .index_select(0, &i64s(&[2, 0], &[2]))
            .unwrap()
            .shape(),
        &[2, 0]
    );
}

#[test]
fn gather_and_scatter_add_errors() {
    let x = f32s(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    assert_err!(
        x.gather(1, &i64s(&[0, 2, 1, 0], &[2, 2])),
        Error::IndexOutOfBounds {
            op: "gather",
            index: 2,
            ..
        }
    );
    assert_err!(
        x.gather(1, &i64s(&[0, -1, 1, 0], &[2, 2])),
        Error::IndexOutOfBounds {
            op: "gather",
            index: -1,
            ..
        }
    );
    assert_err!(
        x.gather(1, &f32s(&[0.0; 4], &[2, 2])),
        Error::UnsupportedDType { op: "gather", .. }
    );
    assert_err!(
        x.gather(1, &Tensor::from_slice(&[true; 4], &[2, 2]).unwrap()),
        Error::UnsupportedDType { op: "gather", .. }
    );
    assert_invalid!(x.gather(0, &i64s(&[0, 1], &[2])), "gather", "index");
    assert_err!(
        x.gather(1, &i64s(&[0; 6], &[3, 2])),
        Error::ShapeMismatch { op: "gather", .. }
    );
    let src = f32s(&[1.0; 4], &[2, 2]);
    assert_err!(
        x.scatter_add(0, &i64s(&[0, 5, 1, 0], &[2, 2]), &src),
        Error::IndexOutOfBounds {
            op: "scatter_add",
            index: 5,
            ..
        }
    );
    assert_err!(
        x.scatter_add(0, &i64s(&[0, -2, 1, 0], &[2, 2]), &src),
        Error::IndexOutOfBounds {
            op: "scatter_add",
            ..
        }
    );
    assert_err!(
        x.scatter_add(0, &i64s(&[0, 1, 1, 0], &[2, 2]), &f64s(&[1.0; 4], &[2, 2])),
        Error::DTypeMismatch {
            op: "scatter_add",
            ..
        }
    );
    assert_err!(
        x.scatter_add(0, &i64s(&[0, 1, 1, 0], &[2, 2]), &f32s(&[1.0; 2], &[1, 2])),
        Error::ShapeMismatch {
            op: "scatter_add",
            ..
        }
    );
    assert_err!(
        x.scatter_add(0, &i64s(&[0, 1, 1, 0], &[2, 2]), &f32s(&[1.0; 4], &[4])),
        Error::ShapeMismatch {
            op: "scatter_add",
            ..
        }
    );
    assert_err!(
        Tensor::from_slice(&[true; 4], &[2, 2])
            .unwrap()
            .scatter_add(
                0,
                &i64s(&[0; 4], &[2, 2]),
                &Tensor::from_slice(&[true; 4], &[2, 2]).unwrap()
            ),
        Error::UnsupportedDType {
            op: "scatter_add",
            ..
        }
    );
    // nothing was written by the failed calls
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
}

// ---------------------------------------------------------------------------------------------
// in-place operations

#[test]
fn inplace_on_leaf_requiring_grad_is_refused() {
    let w = f32s(&[1.0, 2.0], &[2]).requires_grad_(true);
    let one = f32s(&[1.0, 1.0], &[2]);
    assert_err!(w.add_(&one), Error::Autograd(_));
    assert_err!(w.mul_scalar_(2.0), Error::Autograd(_));
    assert_err!(w.copy_(&one), Error::Autograd(_));
    assert_err!(w.fill_(0.0), Error::Autograd(_));
    assert_err!(w.zero_(), Error::Autograd(_));
    assert_eq!(w.to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
    // allowed under no_grad
    {
        let _g = tp::no_grad();
        w.fill_(3.0).unwrap();
    }
    assert_eq!(w.to_vec::<f32>().unwrap(), vec![3.0, 3.0]);
}

#[test]
fn inplace_shape_and_dtype_errors() {
    let x = f32s(&[1.0, 2.0], &[2]);
    assert_err!(
        x.add_(&f32s(&[1.0; 4], &[2, 2])),
        Error::ShapeMismatch { op: "add_", .. }
    );
    assert_err!(x.copy_(&f32s(&[1.0; 3], &[3])), Error::ShapeMismatch { .. });
    let i = i64s(&[1, 2], &[2]);
    assert_err!(i.add_(&x), Error::DTypeMismatch { op: "add_", .. });
    assert_err!(i.div_(&i), Error::DTypeMismatch { op: "div_", .. });
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![1, 2]);
}

#[test]
fn copy_from_an_aliasing_view_reads_before_writing() {
    let x = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], &[3, 3]);
    x.copy_(&x.t().unwrap()).unwrap();
    assert_eq!(
        x.to_vec::<f32>().unwrap(),
        vec![1.0, 4.0, 7.0, 2.0, 5.0, 8.0, 3.0, 6.0, 9.0]
    );
    let y = f32s(&[1.0, 2.0, 3.0], &[3]);
    y.add_(&y).unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![2.0, 4.0, 6.0]);
    y.mul_(&y).unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![4.0, 16.0, 36.0]);
    // overlapping shifted views of one storage
    let z = f32s(&[1.0, 2.0, 3.0, 4.0], &[4]);
    z.narrow(0, 1, 3)
        .unwrap()
        .copy_(&z.narrow(0, 0, 3).unwrap())
        .unwrap();
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![1.0, 1.0, 2.0, 3.0]);
}

#[test]
fn writing_into_an_expanded_view_is_refused() {
    let base = f32s(&[0.0, 0.0], &[1, 2]);
    let e = base.expand(&[3, 2]).unwrap();
    assert_invalid!(
        e.copy_(&f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2])),
        "copy_",
        "self"
    );
    assert_invalid!(e.add_scalar_(1.0), "add_", "self");
    assert_eq!(base.to_vec::<f32>().unwrap(), vec![0.0, 0.0]);
}

#[test]
fn copy_from_a_leaf_keeps_the_gradient_path() {
    let w = f32s(&[1.0, 2.0], &[2]).requires_grad_(true);
    let x = empty(&[2]);
    x.copy_(&w).unwrap();
    assert!(x.requires_grad());
    x.mul_scalar(3.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(w.grad().unwrap().to_vec::<f32>().unwrap(), vec![3.0, 3.0]);
}

#[test]
fn overwriting_a_recorded_tensor_cuts_the_old_gradient() {
    // y = 2x, then y is overwritten with constants: x gets no gradient through y
    let x = f32s(&[1.0, 2.0], &[2]).requires_grad_(true);
    let y = x.mul_scalar(2.0).unwrap();
    y.fill_(5.0).unwrap();
    y.sum().unwrap().backward().unwrap();
    let g = x.grad().map(|g| g.to_vec::<f32>().unwrap());
    assert!(g.as_ref().is_none_or(|g| *g == vec![0.0, 0.0]), "{g:?}");

    let x = f32s(&[1.0, 2.0], &[2]).requires_grad_(true);
    let y = x.mul_scalar(2.0).unwrap();
    y.copy_(&f32s(&[7.0, 7.0], &[2])).unwrap();
    y.sum().unwrap().backward().unwrap();
    let g = x.grad().map(|g| g.to_vec::<f32>().unwrap());
    assert!(g.as_ref().is_none_or(|g| *g == vec![0.0, 0.0]), "{g:?}");
}

#[test]
fn inplace_after_save_is_detected() {
    let x = f32s(&[1.0, 2.0], &[2]).requires_grad_(true);
    let y = x.exp().unwrap();
    let z = y.sum().unwrap();
    {
        let _g = tp::no_grad();
        y.add_scalar_(1.0).unwrap();
    }
    assert_err!(z.backward(), Error::Autograd(_));
}

// ---------------------------------------------------------------------------------------------
// autograd

#[test]
fn backward_errors() {
    let x = f32s(&[1.0, 2.0], &[2]);
    assert_err!(x.sum().unwrap().backward(), Error::Autograd(_));
    let w = f32s(&[1.0, 2.0], &[2]).requires_grad_(true);
    let y = w.mul_scalar(2.0).unwrap();
    assert_err!(y.backward(), Error::Autograd(_));
    assert_err!(
        y.backward_with(Some(&f32s(&[1.0; 3], &[3])), false, false),
        Error::ShapeMismatch { .. }
    );
    assert_err!(
        autograd::backward(&[y.clone()], &[None, None], false, false),
        Error::InvalidArgument { op: "backward", .. }
    );
    // a gradient of another dtype
    assert_err!(
        y.backward_with(Some(&i64s(&[1, 1], &[2])), false, false),
        Error::DTypeMismatch { .. }
    );
    assert!(w.grad().is_none());
    // empty: nothing to do
    let e = empty(&[0]).requires_grad_(true);
    assert_err!(
        e.sum().unwrap().mul(&e).unwrap().backward(),
        Error::Autograd(_)
    );
}

#[test]
fn grad_errors() {
    let x = f64s(&[1.0, 2.0], &[2]).requires_grad_(true);
    let u = f64s(&[1.0], &[1]).requires_grad_(true);
    let y = x.mul(&x).unwrap();
    let s = y.sum().unwrap();
    let o = GradOptions {
        retain_graph: Some(true),
        ..Default::default()
    };
    assert_err!(
        autograd::grad(&[y.clone()], &[x.clone()], &[], o),
        Error::Autograd(_)
    );
    assert_err!(
        autograd::grad(&[s.clone()], &[x.clone()], &[None, None], o),
        Error::InvalidArgument {
            arg: "grad_tensors",
            ..
        }
    );
    assert_err!(
        autograd::grad(&[y.clone()], &[x.clone()], &[Some(f64s(&[1.0], &[1]))], o),
        Error::ShapeMismatch { .. }
    );
    assert_err!(
        autograd::grad(&[s.clone()], &[f64s(&[1.0], &[1])], &[], o),
        Error::Autograd(_)
    );
    assert_err!(
        autograd::grad(&[s.clone()], &[u.clone()], &[], o),
        Error::Autograd(_)
    );
    let g = autograd::grad(
        &[s.clone()],
        &[u.clone()],
        &[],
        GradOptions {
            allow_unused: true,
            ..o
        },
    )
    .unwrap();
    assert!(g[0].is_none());
}

#[test]
fn hook_registered_on_a_leaf_before_use_runs() {
    let x = f32s(&[1.0, 2.0], &[2]).requires_grad_(true);
    x.register_hook(|g| Ok(Some(g.mul_scalar(10.0)?))).unwrap();
    x.mul_scalar(2.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![20.0, 20.0]);
    // and again through a new graph
    x.sum().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![30.0, 30.0]);
}

#[test]
fn hooks_returning_wrong_gradients_are_errors() {
    let x = f32s(&[1.0, 2.0], &[2]).requires_grad_(true);
    x.register_hook(|_| Ok(Some(tp::ones(&[3])?))).unwrap();
    assert_err!(
        x.mul_scalar(2.0).unwrap().sum().unwrap().backward(),
        Error::Autograd(_)
    );
    assert!(x.grad().is_none());

    let x = f32s(&[1.0, 2.0], &[2]).requires_grad_(true);
    let y = x.mul_scalar(2.0).unwrap();
    y.register_hook(|_| Ok(Some(tp::ones(&[2, 2])?))).unwrap();
    assert_err!(y.sum().unwrap().backward(), Error::Autograd(_));

    let x = f32s(&[1.0, 2.0], &[2]).requires_grad_(true);
    x.register_hook(|g| Ok(Some(g.to_dtype(DType::F64)?)))
        .unwrap();
    assert_err!(x.sum().unwrap().backward(), Error::Autograd(_));

    // a failing hook's error comes back
    let x = f32s(&[1.0], &[1]).requires_grad_(true);
    x.register_hook(|_| Err(Error::Autograd("hook says no".into())))
        .unwrap();
    assert_err!(x.sum().unwrap().backward(), Error::Autograd(_));

    assert_err!(
        f32s(&[1.0], &[1]).register_hook(|_| Ok(None)),
        Error::Autograd(_)
    );
}

#[test]
fn run_backward_checks_root_gradients() {
    let x = f32s(&[1.0, 2.0], &[2]).requires_grad_(true);
    let y = x.mul_scalar(2.0).unwrap();
    let e = y.gradient_edge().unwrap();
    let opts = autograd::ExecuteOptions::default();
    assert_err!(
        autograd::run_backward(&[(e.clone(), tp::ones(&[3]).unwrap())], &[], opts),
        Error::Autograd(_)
    );
    assert_err!(
        autograd::run_backward(&[(e.clone(), i64s(&[1, 1], &[2]))], &[], opts),
        Error::Autograd(_)
    );
    assert!(x.grad().is_none());
}

#[test]
fn custom_function_returning_wrong_gradients() {
    use tensorplay_core::autograd::{Context, Function, apply};
    struct WrongCount;
    impl Function for WrongCount {
        fn forward(&self, _c: &mut Context, i: &[&Tensor]) -> tp::Result<Vec<Tensor>> {
            Ok(vec![i[0].mul_scalar(1.0)?])
        }
        fn backward(&self, _c: &Context, g: &[Tensor]) -> tp::Result<Vec<Option<Tensor>>> {
            Ok(vec![Some(g[0].clone()), Some(g[0].clone())])
        }
    }
    struct WrongShape;
    impl Function for WrongShape {
        fn forward(&self, _c: &mut Context, i: &[&Tensor]) -> tp::Result<Vec<Tensor>> {
            Ok(vec![i[0].sum()?])
        }
        fn backward(&self, _c: &Context, g: &[Tensor]) -> tp::Result<Vec<Option<Tensor>>> {
            Ok(vec![Some(g[0].clone())])
        }
    }
    let x = f32s(&[1.0, 2.0], &[2]).requires_grad_(true);
    let y = apply(WrongCount, &[&x]).unwrap().remove(0);
    assert_err!(y.sum().unwrap().backward(), Error::Autograd(_));
    let y = apply(WrongShape, &[&x]).unwrap().remove(0);
    assert_err!(y.backward(), Error::Autograd(_));
}

// ---------------------------------------------------------------------------------------------
// nn

#[test]
fn linear_errors() {
    let l = nn::Linear::new(3, 2, true).unwrap();
    assert_err!(
        l.forward(&tp::ones(&[4, 2]).unwrap()),
        Error::ShapeMismatch { op: "linear", .. }
    );
    assert_err!(
        l.forward(&Tensor::scalar(1.0f32)),
        Error::ShapeMismatch { op: "linear", .. }
    );
    assert_err!(
        l.forward(&Tensor::ones(&[4, 3], DType::F64).unwrap()),
        Error::DTypeMismatch { op: "linear", .. }
    );
    assert_err!(
        l.forward(&Tensor::ones(&[4, 3], DType::I64).unwrap()),
        Error::DTypeMismatch { op: "linear", .. }
    );
    assert_eq!(l.forward(&empty(&[0, 3])).unwrap().shape(), &[0, 2]);
    assert_invalid!(
        nn::Linear::from_weights(tp::ones(&[3]).unwrap(), None),
        "Linear::from_weights",
        "weight"
    );
    assert_err!(
        nn::Linear::from_weights(tp::ones(&[2, 3]).unwrap(), Some(tp::ones(&[3]).unwrap())),
        Error::ShapeMismatch { .. }
    );
    assert_err!(
        nn::Linear::from_weights(
            tp::ones(&[2, 3]).unwrap(),
            Some(Tensor::ones(&[2], DType::F64).unwrap())
        ),
        Error::DTypeMismatch { .. }
    );
    assert_err!(
        F::linear(
            &tp::ones(&[1, 3]).unwrap(),
            &tp::ones(&[2, 3]).unwrap(),
            Some(&Tensor::ones(&[2], DType::F64).unwrap())
        ),
        Error::DTypeMismatch { op: "linear", .. }
    );
    assert_invalid!(nn::Linear::new(usize::MAX, 2, true), "Linear::new", "shape");
    assert_invalid!(
        nn::Linear::new(1 << 40, 1 << 20, false),
        "Linear::new",
        "shape"
    );
}

#[test]
fn embedding_errors() {
    let e = nn::Embedding::new(4, 2).unwrap();
    assert_err!(
        e.forward(&i64s(&[0, 4], &[2])),
        Error::IndexOutOfBounds {
            op: "embedding",
            index: 4,
            ..
        }
    );
    assert_err!(
        e.forward(&i64s(&[-1], &[1])),
        Error::IndexOutOfBounds {
            op: "embedding",
            index: -1,
            ..
        }
    );
    assert_err!(
        e.forward(&f32s(&[0.0], &[1])),
        Error::UnsupportedDType {
            op: "embedding",
            ..
        }
    );
    assert_eq!(e.forward(&i64s(&[], &[0, 3])).unwrap().shape(), &[0, 3, 2]);
    assert_invalid!(
        F::embedding(&i64s(&[0], &[1]), &tp::ones(&[4]).unwrap()),
        "embedding",
        "weight"
    );
    assert_err!(
        F::embedding(
            &i64s(&[0], &[1]),
            &Tensor::ones(&[4, 2], DType::I64).unwrap()
        ),
        Error::UnsupportedDType { .. }
    );
    assert_err!(
        nn::Embedding::new(usize::MAX, 2),
        Error::InvalidArgument { .. }
    );
}

#[test]
fn dropout_errors() {
    for p in [-0.1, 1.0, 1.5, f64::NAN, f64::INFINITY] {
        assert_invalid!(nn::Dropout::new(p), "dropout", "p");
        assert_invalid!(
            F::dropout(&tp::ones(&[2]).unwrap(), p, true),
            "dropout",
            "p"
        );
    }
    assert_err!(
        F::dropout(&i64s(&[1, 2], &[2]), 0.5, true),
        Error::UnsupportedDType { op: "dropout", .. }
    );
    assert_eq!(F::dropout(&empty(&[0]), 0.5, true).unwrap().shape(), &[0]);
}

#[test]
fn cross_entropy_errors() {
    let ce = nn::CrossEntropyLoss::new();
    let x = tp::zeros(&[2, 3]).unwrap();
    assert_err!(
        ce.forward(&x, &i64s(&[0, 3], &[2])),
        Error::IndexOutOfBounds {
            op: "cross_entropy",
            index: 3,
            size: 3,
            ..
        }
    );
    assert_err!(
        ce.forward(&x, &i64s(&[0, -1], &[2])),
        Error::IndexOutOfBounds {
            op: "cross_entropy",
            index: -1,
            ..
        }
    );
    assert_err!(
        ce.forward(&x, &i64s(&[0], &[1])),
        Error::ShapeMismatch {
            op: "cross_entropy",
            ..
        }
    );
    assert_err!(
        ce.forward(&x, &i64s(&[0, 1], &[2, 1])),
        Error::ShapeMismatch {
            op: "cross_entropy",
            ..
        }
    );
    assert_err!(
        ce.forward(&x, &f32s(&[0.0, 1.0], &[2])),
        Error::UnsupportedDType {
            op: "cross_entropy",
            ..
        }
    );
    assert_err!(
        ce.forward(
            &Tensor::zeros(&[2, 3], DType::I64).unwrap(),
            &i64s(&[0, 1], &[2])
        ),
        Error::UnsupportedDType {
            op: "cross_entropy",
            ..
        }
    );
    assert_invalid!(
        ce.forward(&tp::zeros(&[3]).unwrap(), &i64s(&[0], &[1])),
        "cross_entropy",
        "input"
    );
    assert_err!(
        ce.forward(&tp::zeros(&[2, 0]).unwrap(), &i64s(&[0, 0], &[2])),
        Error::IndexOutOfBounds {
            op: "cross_entropy",
            size: 0,
            ..
        }
    );
    // an empty batch is NaN, as in PyTorch
    let l = ce
        .forward(&tp::zeros(&[0, 3]).unwrap(), &i64s(&[], &[0]))
        .unwrap();
    assert!(l.item::<f32>().unwrap().is_nan());
}

#[test]
fn mse_errors() {
    let m = nn::MSELoss::new();
    assert_err!(
        m.forward(&tp::zeros(&[2]).unwrap(), &tp::zeros(&[3]).unwrap()),
        Error::ShapeMismatch { op: "mse_loss", .. }
    );
    assert_err!(
        m.forward(&i64s(&[1], &[1]), &i64s(&[1], &[1])),
        Error::UnsupportedDType { op: "mse_loss", .. }
    );
}

#[test]
fn load_state_dict_errors() {
    let mut l = nn::Linear::new(3, 2, true).unwrap();
    let before = l.weight.to_vec::<f32>().unwrap();
    let mut sd: BTreeMap<String, Tensor> = BTreeMap::new();
    sd.insert("weight".into(), tp::ones(&[2, 3]).unwrap());
    assert_invalid!(
        l.load_state_dict(&sd, true),
        "load_state_dict",
        "state_dict"
    );
    sd.insert("bias".into(), tp::ones(&[2]).unwrap());
    sd.insert("extra".into(), tp::ones(&[2]).unwrap());
    assert_invalid!(
        l.load_state_dict(&sd, true),
        "load_state_dict",
        "state_dict"
    );
    sd.remove("extra");
    sd.insert("bias".into(), tp::ones(&[3]).unwrap());
    assert_invalid!(
        l.load_state_dict(&sd, false),
        "load_state_dict",
        "state_dict"
    );
    sd.insert("bias".into(), tp::ones(&[1, 2]).unwrap());
    assert_invalid!(
        l.load_state_dict(&sd, false),
        "load_state_dict",
        "state_dict"
    );
    // nothing was copied by the failed loads
    assert_eq!(l.weight.to_vec::<f32>().unwrap(), before);
    // a value that is the parameter's own transpose-view still loads correctly
    let mut sq = nn::Linear::new(2, 2, false).unwrap();
    let w = sq.weight.to_vec::<f32>().unwrap();
    let mut sd = BTreeMap::new();
    sd.insert("weight".into(), sq.weight.t().unwrap());
    sq.load_state_dict(&sd, true).unwrap();
    assert_eq!(
        sq.weight.to_vec::<f32>().unwrap(),
        vec![w[0], w[2], w[1], w[3]]
    );
}

// ---------------------------------------------------------------------------------------------
// optimizers

#[test]
fn optimizer_hyperparameter_errors() {
    let p = || vec![tp::ones(&[2]).unwrap().requires_grad_(true)];
    for lr in [f64::NAN, -1.0, f64::INFINITY] {
        let o = SgdOptions {
            lr,
            ..Default::default()
        };
        assert_invalid!(SGD::new(p(), o), "SGD", "lr");
        let o = AdamOptions {
            lr,
            ..Default::default()
        };
        assert_invalid!(Adam::new(p(), o), "Adam", "lr");
        let o = AdamWOptions {
            lr,
            ..Default::default()
        };
        assert_invalid!(AdamW::new(p(), o), "AdamW", "lr");
    }
    assert_invalid!(
        SGD::new(
            p(),
            SgdOptions {
                momentum: f64::NAN,
                ..Default::default()
            }
        ),
        "SGD",
        "momentum"
    );
    assert_invalid!(
        SGD::new(
            p(),
            SgdOptions {
                nesterov: true,
                ..Default::default()
            }
        ),
        "SGD",
        "nesterov"
    );
    for betas in [(1.0, 0.9), (0.9, f64::NAN), (-0.1, 0.9)] {
        assert_invalid!(
            Adam::new(
                p(),
                AdamOptions {
                    betas,
                    ..Default::default()
                }
            ),
            "Adam",
            "betas"
        );
    }
    assert_invalid!(
        Adam::new(
            p(),
            AdamOptions {
                eps: -1.0,
                ..Default::default()
            }
        ),
        "Adam",
        "eps"
    );
    assert_invalid!(
        AdamW::new(
            p(),
            AdamWOptions {
                weight_decay: f64::NAN,
                ..Default::default()
            }
        ),
        "AdamW",
        "weight_decay"
    );
    assert_invalid!(
        SGD::new(vec![i64s(&[1], &[1])], SgdOptions::default()),
        "SGD",
        "params"
    );
    let mut opt = SGD::new(p(), SgdOptions::default()).unwrap();
    assert_invalid!(opt.set_lr(f64::NAN), "SGD.set_lr", "lr");
    assert_invalid!(opt.set_lr(-0.5), "SGD.set_lr", "lr");
}

#[test]
fn optimizer_gradient_errors() {
    let w = tp::ones(&[2]).unwrap().requires_grad_(true);
    let mut sgd = SGD::new(vec![w.clone()], SgdOptions::default()).unwrap();
    let mut adam = Adam::new(vec![w.clone()], AdamOptions::default()).unwrap();
    let bad_shape = Some(tp::ones(&[3]).unwrap());
    let bad_dtype = Some(Tensor::ones(&[2], DType::F64).unwrap());
    assert_invalid!(
        sgd.step_with_grads(&[bad_shape.clone()]),
        "SGD.step",
        "grads"
    );
    assert_invalid!(
        sgd.step_with_grads(&[bad_dtype.clone()]),
        "SGD.step",
        "grads"
    );
    assert_invalid!(sgd.step_with_grads(&[]), "SGD.step", "grads");
    assert_invalid!(adam.step_with_grads(&[bad_shape]), "Adam.step", "grads");
    assert_invalid!(
        adam.step_with_grads(&[bad_dtype.clone()]),
        "Adam.step",
        "grads"
    );
    // a wrong .grad set by hand is caught by step()
    w.set_grad(bad_dtype);
    assert_invalid!(sgd.step(), "SGD.step", "grads");
    assert_eq!(w.to_vec::<f32>().unwrap(), vec![1.0, 1.0]);
    // a gradient aliasing the parameter is read before the update
    w.set_grad(Some(w.detach()));
    let mut sgd = SGD::new(
        vec![w.clone()],
        SgdOptions {
            lr: 0.5,
            ..Default::default()
        },
    )
    .unwrap();
    sgd.step().unwrap();
    assert_eq!(w.to_vec::<f32>().unwrap(), vec![0.5, 0.5]);
}

// ---------------------------------------------------------------------------------------------
// threads

#[test]
fn concurrent_backward_into_one_leaf_loses_no_gradient() {
    let w = Arc::new(f64s(&[1.0, 2.0], &[2]).requires_grad_(true));
    let threads = 8;
    let rounds = 50;
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let w = w.clone();
            std::thread::spawn(move || {
                for _ in 0..rounds {
                    w.mul_scalar(1.0)
                        .unwrap()
                        .sum()
                        .unwrap()
                        .backward()
                        .unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let n = (threads * rounds) as f64;
    assert_eq!(w.grad().unwrap().to_vec::<f64>().unwrap(), vec![n, n]);
}

#[test]
fn concurrent_ops_and_inplace_writes_on_shared_storage() {
    let x = Arc::new(f32s(&[1.0; 16], &[4, 4]));
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let x = x.clone();
            std::thread::spawn(move || {
                for _ in 0..50 {
                    if i % 2 == 0 {
                        let t = x.t().unwrap();
                        let _ = x.add(&t).unwrap();
                        let _ = x.matmul(&t).unwrap();
                    } else {
                        x.mul_scalar_(1.0).unwrap();
                        x.copy_(&x.t().unwrap()).unwrap();
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![1.0; 16]);
}

// ---------------------------------------------------------------------------------------------
// devices

#[test]
fn device_strings_and_cuda_without_a_device() {
    assert_err!(Device::parse("cuda:"), Error::InvalidDevice { .. });
    assert_err!(Device::parse("cuda:-1"), Error::InvalidDevice { .. });
    assert_err!(
        Device::parse("cuda:99999999999999999999999"),
        Error::InvalidDevice { .. }
    );
    assert_err!(Device::parse("gpu"), Error::InvalidDevice { .. });
    assert_err!(
        tp::ones(&[2]).unwrap().to("tpu"),
        Error::InvalidDevice { .. }
    );
    if !tp::cuda::is_available() {
        assert_err!(
            tp::ones(&[2]).unwrap().to("cuda:0"),
            Error::CudaUnavailable { .. }
        );
        assert_err!(
            Tensor::zeros(&[2], Device::Cuda(0)),
            Error::CudaUnavailable { .. }
        );
    }
}
