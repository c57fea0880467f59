//! Finite-difference checks (float64) of every differentiable op, second-order checks of a
//! representative subset, forward values against hand-computed numbers, and error cases.

use tensorplay_core::autograd::{GradcheckOptions, gradcheck, gradgradcheck};
use tensorplay_core::{self as tp, DType, Error, Tensor};

type F = fn(&[Tensor]) -> tp::Result<Vec<Tensor>>;

/// Distinct, non-zero values (distinct for up to 29 elements), offset by `k`.
fn vals(n: usize, k: usize) -> Vec<f64> {
    (0..n)
        .map(|i| ((i * 7 + k * 5) % 29) as f64 / 5.0 - 2.9)
        .collect()
}

/// A float64 leaf requiring grad with distinct non-zero values.
fn x(shape: &[usize], k: usize) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(vals(n, k), shape)
        .unwrap()
        .requires_grad_(true)
}

/// Like [`x`] but with values in (0.2, 3.2).
fn pos(shape: &[usize], k: usize) -> Tensor {
    let n = shape.iter().product();
    let v = vals(n, k).into_iter().map(|v| v + 3.1).collect();
    Tensor::from_vec(v, shape).unwrap().requires_grad_(true)
}

fn idx(v: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape).unwrap()
}

fn check(name: &str, f: impl Fn(&[Tensor]) -> tp::Result<Vec<Tensor>>, inputs: &[Tensor]) {
    if let Err(e) = gradcheck(f, inputs, GradcheckOptions::default()) {
        panic!("gradcheck of {name} failed: {e}");
    }
}

fn check2(name: &str, f: impl Fn(&[Tensor]) -> tp::Result<Vec<Tensor>>, inputs: &[Tensor]) {
    let opts = GradcheckOptions {
        atol: 1e-4,
        ..Default::default()
    };
    if let Err(e) = gradgradcheck(f, inputs, opts) {
        panic!("gradgradcheck of {name} failed: {e}");
    }
}

fn close(a: &[f64], b: &[f64]) {
    tensorplay_testkit::assert_close("gradient", a, b, tensorplay_testkit::Tol::scaled(1e-9));
}

// ---------------------------------------------------------------------------------------------
// elementwise

#[test]
fn gradcheck_binary_with_broadcasting() {
    let cases: [(&str, F); 7] = [
        ("add", |a| Ok(vec![a[0].add(&a[1])?])),
        ("sub", |a| Ok(vec![a[0].sub(&a[1])?])),
        ("mul", |a| Ok(vec![a[0].mul(&a[1])?])),
        ("div", |a| Ok(vec![a[0].div(&a[1])?])),
        ("pow", |a| Ok(vec![a[0].pow(&a[1])?])),
        ("maximum", |a| Ok(vec![a[0].maximum(&a[1])?])),
        ("minimum", |a| Ok(vec![a[0].minimum(&a[1])?])),
    ];
    for (name, f) in cases {
        // same shape, and broadcasting both ways ([2,3] with [3], [2,1] with [1,3])
        check(name, f, &[pos(&[2, 3], 0), pos(&[2, 3], 1)]);
        check(name, f, &[pos(&[2, 3], 2), pos(&[3], 3)]);
        check(name, f, &[pos(&[2, 1], 4), pos(&[1, 3], 5)]);
        check(name, f, &[pos(&[], 6), pos(&[2, 2], 7)]);
    }
    // signs matter for add/sub/mul/maximum: also mixed-sign inputs
    check(
        "mul mixed",
        |a| Ok(vec![a[0].mul(&a[1])?]),
        &[x(&[2, 3], 0), x(&[3], 1)],
    );
    check(
        "maximum mixed",
        |a| Ok(vec![a[0].maximum(&a[1])?]),
        &[x(&[4], 0), x(&[4], 3)],
    );
    // only one side requires grad
    let c = Tensor::from_vec(vals(3, 2), &[3]).unwrap();
    check(
        "div const",
        |a| Ok(vec![a[0].div(&a[1])?]),
        &[x(&[2, 3], 0), c],
    );
}

#[test]
fn gradcheck_unary_and_scalar_ops() {
    let cases: [(&str, F, bool); 16] = [
        ("neg", |a| Ok(vec![a[0].neg()?]), false),
        ("exp", |a| Ok(vec![a[0].exp()?]), false),
        ("log", |a| Ok(vec![a[0].log()?]), true),
        ("sqrt", |a| Ok(vec![a[0].sqrt()?]), true),
        ("abs", |a| Ok(vec![a[0].abs()?]), false),
        ("relu", |a| Ok(vec![a[0].relu()?]), false),
        ("sigmoid", |a| Ok(vec![a[0].sigmoid()?]), false),
        ("tanh", |a| Ok(vec![a[0].tanh()?]), false),
        ("gelu", |a| Ok(vec![a[0].gelu()?]), false),
        ("erf", |a| Ok(vec![a[0].erf()?]), false),
        ("add_scalar", |a| Ok(vec![a[0].add_scalar(1.5)?]), false),
        ("sub_scalar", |a| Ok(vec![a[0].sub_scalar(1.5)?]), false),
        ("mul_scalar", |a| Ok(vec![a[0].mul_scalar(-2.5)?]), false),
        ("div_scalar", |a| Ok(vec![a[0].div_scalar(4.0)?]), false),
        ("pow_scalar 3", |a| Ok(vec![a[0].pow_scalar(3.0)?]), false),
        ("pow_scalar 0.5", |a| Ok(vec![a[0].pow_scalar(0.5)?]), true),
    ];
    for (name, f, positive) in cases {
        let input = if positive {
            pos(&[2, 3], 1)
        } else {
            x(&[2, 3], 1)
        };
        check(name, f, &[input]);
    }
    check(
        "pow_scalar 2",
        |a| Ok(vec![a[0].pow_scalar(2.0)?]),
        &[x(&[5], 0)],
    );
    check(
        "pow_scalar -1.5",
        |a| Ok(vec![a[0].pow_scalar(-1.5)?]),
        &[pos(&[5], 0)],
    );
    check(
        "pow_scalar 0",
        |a| Ok(vec![a[0].pow_scalar(0.0)?]),
        &[x(&[5], 0)],
    );
}

#[test]
fn gradcheck_where_and_casts() {
    let c2 = Tensor::from_slice(&[true, false, true], &[3]).unwrap();
    check(
        "where",
        move |a| Ok(vec![a[0].where_(&c2, &a[1])?]),
        &[x(&[2, 3], 0), x(&[2, 1], 1)],
    );
    // through float32: a coarser step, the function is linear
    gradcheck(
        |a| {
            Ok(vec![
                a[0].to_dtype(DType::F32)?
                    .mul_scalar(2.0)?
                    .to_dtype(DType::F64)?,
            ])
        },
        &[Tensor::from_slice(&[0.5f64, 1.25, -2.0], &[3])
            .unwrap()
            .requires_grad_(true)],
        GradcheckOptions {
            eps: 1e-3,
            ..Default::default()
        },
    )
    .unwrap();
    check(
        "to_dtype f64 no-op",
        |a| Ok(vec![a[0].to_dtype(DType::F64)?]),
        &[x(&[3], 0)],
    );
    // to_dtype is exact through f32 for these values: check the gradient value directly
    let t = Tensor::from_slice(&[0.5f64, 1.25], &[2])
        .unwrap()
        .requires_grad_(true);
    t.to_dtype(DType::F32)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(t.grad().unwrap().to_vec::<f64>().unwrap(), vec![1.0, 1.0]);
    assert_eq!(t.grad().unwrap().dtype(), DType::F64);
}

// ---------------------------------------------------------------------------------------------
// views

#[test]
fn gradcheck_views() {
    let cases: [(&str, F); 18] = [
        ("reshape", |a| Ok(vec![a[0].reshape(&[3usize, 2])?])),
        // a view without a copy: the narrowed columns split in two
        ("reshape of narrowed", |a| {
            Ok(vec![a[0].narrow(1, 1, 2)?.reshape(&[2usize, 2, 1])?])
        }),
        ("view of transposed", |a| {
            Ok(vec![a[0].t()?.view(&[3usize, 2, 1])?])
        }),
        ("reshape -1", |a| Ok(vec![a[0].reshape(&[-1isize, 6])?])),
        ("view", |a| Ok(vec![a[0].view(&[6usize])?])),
        ("permute", |a| {
            Ok(vec![a[0].reshape(&[1usize, 2, 3])?.permute(&[2, 0, 1])?])
        }),
        ("transpose", |a| Ok(vec![a[0].transpose(0, -1)?])),
        ("t", |a| Ok(vec![a[0].t()?])),
        ("narrow", |a| Ok(vec![a[0].narrow(1, 1, 2)?])),
        ("select", |a| Ok(vec![a[0].select(1, -1)?])),
        ("squeeze", |a| {
            Ok(vec![a[0].reshape(&[2usize, 1, 3])?.squeeze()?])
        }),
        ("squeeze_dim", |a| {
            Ok(vec![a[0].reshape(&[2usize, 1, 3])?.squeeze_dim(1)?])
        }),
        ("unsqueeze", |a| Ok(vec![a[0].unsqueeze(-1)?])),
        ("expand", |a| {
            Ok(vec![a[0].narrow(0, 0, 1)?.expand(&[4, 2, 3])?])
        }),
        ("contiguous", |a| Ok(vec![a[0].t()?.contiguous()?])),
        ("flatten", |a| Ok(vec![a[0].t()?.flatten()?])),
        ("reshape of transposed", |a| {
            Ok(vec![a[0].t()?.reshape(&[6usize])?])
        }),
        ("view chain", |a| {
            Ok(vec![
                a[0].t()?
                    .narrow(0, 1, 2)?
                    .select(1, 0)?
                    .mul(&a[0].select(0, 1)?.narrow(0, 0, 2)?)?,
            ])
        }),
    ];
    for (name, f) in cases {
        check(name, f, &[x(&[2, 3], 0)]);
    }
}

// ---------------------------------------------------------------------------------------------
// reductions

#[test]
fn gradcheck_reductions() {
    let cases: [(&str, F); 11] = [
        ("sum", |a| Ok(vec![a[0].sum()?])),
        ("sum_dims keep", |a| Ok(vec![a[0].sum_dims(&[1], true)?])),
        ("sum_dims", |a| Ok(vec![a[0].sum_dims(&[0, 2], false)?])),
        ("sum_dims neg", |a| Ok(vec![a[0].sum_dims(&[-1], false)?])),
        ("mean", |a| Ok(vec![a[0].mean()?])),
        ("mean_dims keep", |a| Ok(vec![a[0].mean_dims(&[0], true)?])),
        ("mean_dims", |a| Ok(vec![a[0].mean_dims(&[1, 2], false)?])),
        ("sum_to_size", |a| Ok(vec![a[0].sum_to_size(&[3, 1])?])),
        ("sum_to_size lead", |a| Ok(vec![a[0].sum_to_size(&[1])?])),
        ("sum of transposed", |a| {
            Ok(vec![a[0].transpose(0, 2)?.sum_dims(&[0], true)?])
        }),
        ("sum_dims of 0-d", |a| {
            Ok(vec![a[0].sum()?.sum_dims(&[0], true)?])
        }),
    ];
    for (name, f) in cases {
        check(name, f, &[x(&[2, 3, 2], 0)]);
    }
}

#[test]
fn gradcheck_max_min() {
    let cases: [(&str, F); 9] = [
        ("max_dim", |a| Ok(vec![a[0].max_dim(1, false)?.0])),
        ("max_dim keep", |a| Ok(vec![a[0].max_dim(-1, true)?.0])),
        ("min_dim", |a| Ok(vec![a[0].min_dim(0, false)?.0])),
        ("min_dim keep", |a| Ok(vec![a[0].min_dim(2, true)?.0])),
        ("max", |a| Ok(vec![a[0].max()?])),
        ("min", |a| Ok(vec![a[0].min()?])),
        ("max_dim strided", |a| {
            Ok(vec![a[0].transpose(0, 2)?.max_dim(0, false)?.0])
        }),
        // both outputs: the indices carry no gradient
        ("max_dim pair", |a| {
            let (v, i) = a[0].max_dim(1, false)?;
            Ok(vec![v, i])
        }),
        ("max of expression", |a| Ok(vec![a[0].mul(&a[0])?.max()?])),
    ];
    for (name, f) in cases {
        check(name, f, &[x(&[2, 3, 2], 0)]);
    }
}

#[test]
fn gradcheck_softmax() {
    let cases: [(&str, F); 5] = [
        ("softmax -1", |a| Ok(vec![a[0].softmax(-1)?])),
        ("softmax 0", |a| Ok(vec![a[0].softmax(0)?])),
        ("log_softmax -1", |a| Ok(vec![a[0].log_softmax(-1)?])),
        ("log_softmax 1", |a| Ok(vec![a[0].log_softmax(1)?])),
        ("softmax of transposed", |a| {
            Ok(vec![a[0].transpose(0, 1)?.softmax(1)?])
        }),
    ];
    for (name, f) in cases {
        check(name, f, &[x(&[2, 3, 2], 0)]);
    }
}

#[test]
fn gradcheck_indexing() {
    check(
        "index_select",
        |a| Ok(vec![a[0].index_select(1, &idx(&[2, 0, 2, 1], &[4]))?]),
        &[x(&[2, 3], 0)],
    );
    check(
        "index_select 0",
        |a| Ok(vec![a[0].index_select(0, &idx(&[1, 1], &[2]))?]),
        &[x(&[2, 3], 0)],
    );
    check(
        "gather",
        |a| Ok(vec![a[0].gather(1, &idx(&[2, 2, 0, 1, 0, 0], &[2, 3]))?]),
        &[x(&[2, 3], 0)],
    );
    check(
        "gather smaller index",
        |a| Ok(vec![a[0].gather(0, &idx(&[1, 0, 1, 1], &[2, 2]))?]),
        &[x(&[3, 3], 0)],
    );
    check(
        "gather of transposed",
        |a| Ok(vec![a[0].t()?.gather(0, &idx(&[2, 0], &[1, 2]))?]),
        &[x(&[2, 3], 0)],
    );
    check(
        "scatter_add",
        |a| {
            Ok(vec![a[0].scatter_add(
                0,
                &idx(&[1, 0, 1, 1, 1, 0], &[2, 3]),
                &a[1],
            )?])
        },
        &[x(&[2, 3], 0), x(&[2, 3], 1)],
    );
    check(
        "scatter_add smaller index",
        |a| {
            Ok(vec![a[0].scatter_add(
                1,
                &idx(&[0, 0, 2, 1], &[2, 2]),
                &a[1],
            )?])
        },
        &[x(&[2, 3], 0), x(&[3, 4], 1)],
    );
}

#[test]
fn gradcheck_cat_stack_split() {
    check(
        "cat",
        |a| {
            Ok(vec![Tensor::cat(
                &[a[0].clone(), a[1].clone(), a[2].clone()],
                1,
            )?])
        },
        &[x(&[2, 1], 0), x(&[2, 3], 1), x(&[2, 2], 2)],
    );
    check(
        "cat 0 of views",
        |a| Ok(vec![tp::cat(&[a[0].t()?, a[1].narrow(0, 1, 1)?], 0)?]),
        &[x(&[2, 3], 0), x(&[2, 2], 1)],
    );
    check(
        "cat 1 with an empty part and a transposed one",
        |a| {
            let parts = [a[0].narrow(1, 0, 0)?, a[1].t()?, a[0].clone()];
            Ok(vec![tp::cat(&parts, 1)?])
        },
        &[x(&[2, 3], 0), x(&[3, 2], 1)],
    );
    check(
        "stack",
        |a| Ok(vec![tp::stack(&[a[0].clone(), a[1].clone()], -1)?]),
        &[x(&[2, 3], 0), x(&[2, 3], 1)],
    );
    check(
        "split",
        |a| {
            a[0].split(2, 1).map(|v| {
                v.into_iter()
                    .map(|t| t.mul_scalar(2.0))
                    .collect::<tp::Result<Vec<_>>>()
            })?
        },
        &[x(&[2, 5], 0)],
    );
    check(
        "split_with_sizes",
        |a| a[0].split_with_sizes(&[1, 3, 1], -1),
        &[x(&[2, 5], 0)],
    );
    check("chunk", |a| a[0].chunk(2, 0), &[x(&[3, 2], 0)]);
    check(
        "split of a transposed view, an empty part, one part unused",
        |a| {
            let parts = a[0].t()?.split_with_sizes(&[0, 2, 1], 0)?;
            Ok(vec![parts[0].clone(), parts[1].mul(&parts[1])?])
        },
        &[x(&[4, 3], 0)],
    );
    check(
        "cat of splits",
        |a| {
            let parts = a[0].chunk(3, 1)?;
            Ok(vec![Tensor::cat(&[parts[2].clone(), parts[0].exp()?], 1)?])
        },
        &[x(&[2, 6], 0)],
    );
}

// ---------------------------------------------------------------------------------------------
// matmul

#[test]
fn gradcheck_matmul() {
    let mm: F = |a| Ok(vec![a[0].matmul(&a[1])?]);
    check("dot", mm, &[x(&[3], 0), x(&[3], 1)]);
    check("mm", mm, &[x(&[2, 3], 0), x(&[3, 4], 1)]);
    check("vec x mat", mm, &[x(&[3], 0), x(&[3, 2], 1)]);
    check("mat x vec", mm, &[x(&[2, 3], 0), x(&[3], 1)]);
    check("batched", mm, &[x(&[2, 2, 3], 0), x(&[2, 3, 2], 1)]);
    check(
        "broadcast batch",
        mm,
        &[x(&[2, 1, 2, 3], 0), x(&[3, 3, 2], 1)],
    );
    check("batched x vec", mm, &[x(&[2, 2, 3], 0), x(&[3], 1)]);
    check("vec x batched", mm, &[x(&[2], 0), x(&[3, 2, 2], 1)]);
    check(
        "transposed inputs",
        |a| Ok(vec![a[0].t()?.matmul(&a[1].t()?)?]),
        &[x(&[3, 2], 0), x(&[4, 3], 1)],
    );
    check(
        "narrowed inputs",
        |a| {
            Ok(vec![
                a[0].narrow(1, 1, 3)?.matmul(&a[1].narrow(0, 1, 3)?.t()?)?,
            ])
        },
        &[x(&[2, 5], 0), x(&[5, 3], 1)],
    );
    check(
        "mm alias",
        |a| Ok(vec![a[0].mm(&a[1])?]),
        &[x(&[2, 2], 0), x(&[2, 3], 1)],
    );
    check("x @ x", |a| Ok(vec![a[0].matmul(&a[0])?]), &[x(&[3, 3], 0)]);
}

// ---------------------------------------------------------------------------------------------
// second order

#[test]
fn gradgradcheck_subset() {
    let cases: [(&str, F, Vec<Tensor>); 14] = [
        (
            "mul",
            |a| Ok(vec![a[0].mul(&a[1])?]),
            vec![x(&[2, 3], 0), x(&[3], 1)],
        ),
        (
            "div",
            |a| Ok(vec![a[0].div(&a[1])?]),
            vec![x(&[2, 2], 0), pos(&[2, 2], 1)],
        ),
        ("exp", |a| Ok(vec![a[0].exp()?]), vec![x(&[4], 0)]),
        ("tanh", |a| Ok(vec![a[0].tanh()?]), vec![x(&[4], 0)]),
        ("sigmoid", |a| Ok(vec![a[0].sigmoid()?]), vec![x(&[4], 0)]),
        ("gelu", |a| Ok(vec![a[0].gelu()?]), vec![x(&[4], 0)]),
        (
            "matmul",
            |a| Ok(vec![a[0].matmul(&a[1])?]),
            vec![x(&[2, 3], 0), x(&[3, 2], 1)],
        ),
        (
            "softmax",
            |a| Ok(vec![a[0].softmax(-1)?]),
            vec![x(&[2, 3], 0)],
        ),
        (
            "log_softmax",
            |a| Ok(vec![a[0].log_softmax(0)?]),
            vec![x(&[2, 3], 0)],
        ),
        (
            "sum",
            |a| Ok(vec![a[0].mul(&a[0])?.sum_dims(&[1], false)?]),
            vec![x(&[2, 3], 0)],
        ),
        (
            "expand",
            |a| Ok(vec![a[0].expand(&[2, 3])?.mul(&a[0])?]),
            vec![x(&[3], 0)],
        ),
        (
            "gather",
            |a| {
                Ok(vec![
                    a[0].mul(&a[0])?.gather(1, &idx(&[2, 0, 1, 1], &[2, 2]))?,
                ])
            },
            vec![x(&[2, 3], 0)],
        ),
        (
            "max_dim",
            |a| Ok(vec![a[0].mul(&a[0])?.max_dim(1, false)?.0]),
            vec![x(&[2, 3], 0)],
        ),
        (
            "cat",
            |a| Ok(vec![Tensor::cat(&[a[0].mul(&a[0])?, a[0].exp()?], 0)?]),
            vec![x(&[2, 2], 0)],
        ),
    ];
    for (name, f, inputs) in cases {
        check2(name, f, &inputs);
    }
}

// ---------------------------------------------------------------------------------------------
// forward values

#[test]
fn max_min_values() -> tp::Result<()> {
    let t = Tensor::from_slice(&[1.0f64, 5.0, 3.0, 7.0, 2.0, 7.0], &[2, 3])?;
    let (v, i) = t.max_dim(1, false)?;
    assert_eq!(v.to_vec::<f64>()?, vec![5.0, 7.0]);
    assert_eq!(i.to_vec::<i64>()?, vec![1, 0]); // first of the tie
    assert_eq!(i.dtype(), DType::I64);
    let (v, i) = t.min_dim(0, true)?;
    assert_eq!(v.shape(), &[1, 3]);
    assert_eq!(v.to_vec::<f64>()?, vec![1.0, 2.0, 3.0]);
    assert_eq!(i.to_vec::<i64>()?, vec![0, 1, 0]);
    assert_eq!(t.max()?.shape(), &[] as &[usize]);
    assert_eq!(t.max()?.item::<f64>()?, 7.0);
    assert_eq!(t.min()?.item::<f64>()?, 1.0);
    assert_eq!(t.argmax(None, false)?.item::<i64>()?, 3);
    assert_eq!(t.argmin(None, true)?.item::<i64>()?, 0);
    assert_eq!(t.argmax(Some(0), false)?.to_vec::<i64>()?, vec![1, 0, 1]);
    let a = t.argmin(Some(-1), true)?;
    assert_eq!(a.shape(), &[2, 1]);
    assert_eq!(a.to_vec::<i64>()?, vec![0, 1]);
    // int64 works too
    let ti = Tensor::from_slice(&[3i64, -2, 9], &[3])?;
    assert_eq!(ti.max()?.item::<i64>()?, 9);
    assert_eq!(ti.min_dim(0, false)?.1.item::<i64>()?, 1);
    // 0-d
    let s = Tensor::scalar(4.0f64);
    let (v, i) = s.max_dim(0, false)?;
    assert_eq!((v.item::<f64>()?, i.item::<i64>()?), (4.0, 0));
    // on a transposed view
    let (v, _) = t.t()?.max_dim(1, false)?;
    assert_eq!(v.to_vec::<f64>()?, vec![7.0, 5.0, 7.0]);
    Ok(())
}

#[test]
fn max_min_nan_propagates() -> tp::Result<()> {
    let t = Tensor::from_slice(&[1.0f64, f64::NAN, 3.0, 4.0], &[2, 2])?;
    let (v, i) = t.max_dim(1, false)?;
    let v = v.to_vec::<f64>()?;
    assert!(v[0].is_nan() && v[1] == 4.0);
    assert_eq!(i.to_vec::<i64>()?, vec![1, 1]);
    let (v, i) = t.min_dim(1, false)?;
    assert!(v.to_vec::<f64>()?[0].is_nan());
    assert_eq!(i.to_vec::<i64>()?, vec![1, 0]);
    assert!(t.max()?.item::<f64>()?.is_nan());
    assert!(t.min()?.item::<f64>()?.is_nan());
    assert_eq!(t.argmax(None, false)?.item::<i64>()?, 1);
    assert_eq!(t.argmin(None, false)?.item::<i64>()?, 1);
    // gradient of max() goes to the NaN
    let t = t.requires_grad_(true);
    t.max()?.backward()?;
    assert_eq!(t.grad().unwrap().to_vec::<f64>()?, vec![0.0, 1.0, 0.0, 0.0]);
    Ok(())
}

#[test]
fn max_gradients_with_ties() -> tp::Result<()> {
    let t = Tensor::from_slice(&[2.0f64, 5.0, 5.0, 1.0], &[2, 2])?.requires_grad_(true);
    // full reduction: split evenly among ties
    t.max()?.backward()?;
    assert_eq!(t.grad().unwrap().to_vec::<f64>()?, vec![0.0, 0.5, 0.5, 0.0]);
    t.set_grad(None);
    // over a dim: only the selected (first) index
    t.max_dim(0, false)?.0.sum()?.backward()?;
    assert_eq!(t.grad().unwrap().to_vec::<f64>()?, vec![0.0, 1.0, 1.0, 0.0]);
    t.set_grad(None);
    t.min()?.mul_scalar(3.0)?.backward()?;
    assert_eq!(t.grad().unwrap().to_vec::<f64>()?, vec![0.0, 0.0, 0.0, 3.0]);
    Ok(())
}

#[test]
fn softmax_values() -> tp::Result<()> {
    let t = Tensor::from_slice(&[1.0f64, 2.0, 3.0, 0.0, 0.0, 0.0], &[2, 3])?;
    let y = t.softmax(1)?.to_vec::<f64>()?;
    let z: f64 = [1f64, 2.0, 3.0].iter().map(|v| v.exp()).sum();
    close(
        &y,
        &[
            1f64.exp() / z,
            2f64.exp() / z,
            3f64.exp() / z,
            1.0 / 3.0,
            1.0 / 3.0,
            1.0 / 3.0,
        ],
    );
    let ly = t.log_softmax(1)?.to_vec::<f64>()?;
    close(&ly[..3], &[1.0 - z.ln(), 2.0 - z.ln(), 3.0 - z.ln()]);
    // stable for large inputs
    let big = Tensor::from_slice(&[1000.0f64, 1000.0, -1000.0], &[3])?;
    close(&big.softmax(0)?.to_vec::<f64>()?, &[0.5, 0.5, 0.0]);
    close(
        &big.log_softmax(0)?.to_vec::<f64>()?[..2],
        &[-(2f64.ln()), -(2f64.ln())],
    );
    // float32 works and sums to one along the dim
    let f = tp::randn(&[3, 4])?.softmax(0)?.sum_dims(&[0], false)?;
    for v in f.to_vec::<f32>()? {
        assert!((v - 1.0).abs() < 1e-6);
    }
    Ok(())
}

#[test]
fn index_values() -> tp::Result<()> {
    let t = Tensor::from_slice(&[1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    let s = t.index_select(1, &idx(&[2, 0, 2], &[3]))?;
    assert_eq!(s.shape(), &[2, 3]);
    assert_eq!(s.to_vec::<f64>()?, vec![3.0, 1.0, 3.0, 6.0, 4.0, 6.0]);
    assert_eq!(
        t.index_select(0, &idx(&[1], &[1]))?.to_vec::<f64>()?,
        vec![4.0, 5.0, 6.0]
    );
    assert_eq!(t.index_select(0, &idx(&[], &[0]))?.shape(), &[0, 3]);
    let g = t.gather(1, &idx(&[0, 0, 1, 0], &[2, 2]))?;
    assert_eq!(g.to_vec::<f64>()?, vec![1.0, 1.0, 5.0, 4.0]);
    let g = t.gather(0, &idx(&[1, 0, 1], &[1, 3]))?;
    assert_eq!(g.to_vec::<f64>()?, vec![4.0, 2.0, 6.0]);
    let z = Tensor::zeros(&[2, 3], DType::F64)?;
    let src = Tensor::from_slice(&[1.0f64, 2.0, 3.0, 10.0, 20.0, 30.0], &[2, 3])?;
    let r = z.scatter_add(1, &idx(&[0, 0, 2, 1, 1, 1], &[2, 3]), &src)?;
    assert_eq!(r.to_vec::<f64>()?, vec![3.0, 0.0, 3.0, 0.0, 60.0, 0.0]);
    assert_eq!(z.to_vec::<f64>()?, vec![0.0; 6]); // out of place
    z.scatter_add_(0, &idx(&[1, 0, 1], &[1, 3]), &src)?;
    assert_eq!(z.to_vec::<f64>()?, vec![0.0, 2.0, 0.0, 1.0, 0.0, 3.0]);
    // int64 gather and scatter_add
    let ti = Tensor::from_slice(&[5i64, 6, 7], &[3])?;
    assert_eq!(
        ti.gather(0, &idx(&[2, 2], &[2]))?.to_vec::<i64>()?,
        vec![7, 7]
    );
    let r = ti.scatter_add(
        0,
        &idx(&[0, 0], &[2]),
        &Tensor::from_slice(&[1i64, 1], &[2])?,
    )?;
    assert_eq!(r.to_vec::<i64>()?, vec![7, 6, 7]);
    Ok(())
}

#[test]
fn index_select_gradient_accumulates_repeats() -> tp::Result<()> {
    let t = Tensor::from_slice(&[1.0f64, 2.0, 3.0], &[3])?.requires_grad_(true);
    t.index_select(0, &idx(&[2, 2, 0], &[3]))?
        .sum()?
        .backward()?;
    assert_eq!(t.grad().unwrap().to_vec::<f64>()?, vec![1.0, 0.0, 2.0]);
    Ok(())
}

#[test]
fn cat_stack_split_values() -> tp::Result<()> {
    let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
    let b = Tensor::from_slice(&[5.0f32, 6.0], &[2, 1])?;
    let c = Tensor::cat(&[a.clone(), b.clone()], 1)?;
    assert_eq!(c.shape(), &[2, 3]);
    assert_eq!(c.to_vec::<f32>()?, vec![1.0, 2.0, 5.0, 3.0, 4.0, 6.0]);
    let c = tp::cat(&[a.t()?, b.t()?], 0)?;
    assert_eq!(c.to_vec::<f32>()?, vec![1.0, 3.0, 2.0, 4.0, 5.0, 6.0]);
    let s = tp::stack(&[a.clone(), a.mul_scalar(10.0)?], 1)?;
    assert_eq!(s.shape(), &[2, 2, 2]);
    assert_eq!(
        s.to_vec::<f32>()?,
        vec![1.0, 2.0, 10.0, 20.0, 3.0, 4.0, 30.0, 40.0]
    );
    assert_eq!(tp::stack(std::slice::from_ref(&a), 0)?.shape(), &[1, 2, 2]);
    // a one-element cat is a copy, not an alias
    let one = tp::cat(std::slice::from_ref(&a), 0)?;
    assert!(!one.shares_storage_with(&a));
    let r = Tensor::arange(0.0, 7.0, 1.0, DType::I64)?;
    let parts = r.split(3, 0)?;
    let got: Vec<Vec<i64>> = parts
        .iter()
        .map(|p| p.to_vec())
        .collect::<tp::Result<_>>()?;
    assert_eq!(got, vec![vec![0, 1, 2], vec![3, 4, 5], vec![6]]);
    assert!(parts.iter().all(|p| p.shares_storage_with(&r)));
    let got: Vec<usize> = r
        .split_with_sizes(&[2, 0, 5], 0)?
        .iter()
        .map(|p| p.numel())
        .collect();
    assert_eq!(got, vec![2, 0, 5]);
    let got: Vec<usize> = r.chunk(3, 0)?.iter().map(|p| p.numel()).collect();
    assert_eq!(got, vec![3, 3, 1]);
    let got: Vec<usize> = r
        .narrow(0, 0, 6)?
        .chunk(4, -1)?
        .iter()
        .map(|p| p.numel())
        .collect();
    assert_eq!(got, vec![2, 2, 2]); // fewer chunks than asked, as in PyTorch
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// errors

#[test]
fn errors_not_panics() -> tp::Result<()> {
    let t = Tensor::from_slice(&[1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    let i = idx(&[0, 1], &[2]);
    // bad dims
    assert!(matches!(
        t.max_dim(2, false),
        Err(Error::DimOutOfRange { op: "max", .. })
    ));
    assert!(matches!(
        t.min_dim(-3, false),
        Err(Error::DimOutOfRange { .. })
    ));
    assert!(matches!(
        t.argmax(Some(5), false),
        Err(Error::DimOutOfRange { .. })
    ));
    assert!(matches!(t.softmax(2), Err(Error::DimOutOfRange { .. })));
    assert!(matches!(
        t.log_softmax(-3),
        Err(Error::DimOutOfRange { .. })
    ));
    assert!(matches!(
        t.index_select(2, &i),
        Err(Error::DimOutOfRange { .. })
    ));
    assert!(matches!(t.gather(-3, &i), Err(Error::DimOutOfRange { .. })));
    assert!(matches!(
        tp::cat(std::slice::from_ref(&t), 2),
        Err(Error::DimOutOfRange { .. })
    ));
    assert!(matches!(
        tp::stack(std::slice::from_ref(&t), 3),
        Err(Error::DimOutOfRange { .. })
    ));
    assert!(matches!(t.split(1, 2), Err(Error::DimOutOfRange { .. })));
    assert!(matches!(
        t.sum_dims(&[0, 0], false),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        t.narrow(1, 2, 2),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        t.select(0, 2),
        Err(Error::IndexOutOfBounds { .. })
    ));
    assert!(t.permute(&[0, 0]).is_err());
    assert!(t.reshape(&[4usize]).is_err());
    assert!(t.t()?.view(&[6usize]).is_err());
    // a strided view reshaped without a copy shares the storage; across a gap it copies
    let n = t.narrow(1, 0, 2)?;
    assert!(n.reshape(&[2usize, 2, 1])?.shares_storage_with(&t));
    assert!(!n.reshape(&[4usize])?.shares_storage_with(&t));
    assert!(n.view(&[4usize]).is_err());
    assert!(t.expand(&[3, 3]).is_err());
    // shapes
    assert!(matches!(
        t.add(&Tensor::zeros(&[2], DType::F64)?),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        t.matmul(&t),
        Err(Error::InvalidArgument {
            op: "matmul",
            arg: "other",
            ..
        })
    ));
    assert!(t.matmul(&Tensor::scalar(1.0f64)).is_err());
    assert!(t.mm(&Tensor::zeros(&[3], DType::F64)?).is_err());
    assert!(matches!(
        tp::cat(&[t.clone(), Tensor::zeros(&[2, 2, 1], DType::F64)?], 0),
        Err(Error::ShapeMismatch { op: "cat", .. })
    ));
    assert!(matches!(
        tp::cat(&[t.clone(), Tensor::zeros(&[3, 3], DType::F64)?], 1),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        tp::stack(&[t.clone(), t.t()?], 0),
        Err(Error::ShapeMismatch { op: "stack", .. })
    ));
    assert!(matches!(
        tp::cat(&[], 0),
        Err(Error::InvalidArgument { op: "cat", .. })
    ));
    assert!(matches!(
        tp::stack(&[], 0),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(tp::cat(&[Tensor::scalar(1.0f64)], 0).is_err());
    assert!(matches!(t.split(0, 1), Err(Error::InvalidArgument { .. })));
    assert!(matches!(
        t.split_with_sizes(&[1, 1], 1),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(t.chunk(0, 1), Err(Error::InvalidArgument { .. })));
    assert!(Tensor::scalar(1.0f64).split(1, 0).is_err());
    assert!(matches!(
        t.gather(1, &idx(&[0, 0, 0], &[3, 1])),
        Err(Error::ShapeMismatch { op: "gather", .. })
    ));
    assert!(matches!(
        t.gather(1, &i),
        Err(Error::InvalidArgument { .. })
    )); // ndim differs
    assert!(t.index_select(0, &idx(&[0, 1], &[1, 2])).is_err()); // index not 1-d
    assert!(
        t.scatter_add(0, &idx(&[0, 0], &[1, 2]), &t.narrow(1, 0, 1)?)
            .is_err()
    );
    // dtypes
    let ii = Tensor::from_slice(&[1i64, 2], &[2])?;
    let fi = Tensor::from_slice(&[0.0f64, 1.0], &[2])?;
    assert!(matches!(
        t.index_select(0, &fi),
        Err(Error::UnsupportedDType { .. })
    ));
    assert!(matches!(
        t.gather(0, &fi.reshape(&[1usize, 2])?),
        Err(Error::UnsupportedDType { .. })
    ));
    assert!(matches!(
        ii.softmax(0),
        Err(Error::UnsupportedDType { op: "softmax", .. })
    ));
    assert!(matches!(
        ii.log_softmax(0),
        Err(Error::UnsupportedDType { .. })
    ));
    assert!(matches!(ii.mean(), Err(Error::UnsupportedDType { .. })));
    assert!(matches!(ii.exp(), Err(Error::UnsupportedDType { .. })));
    assert!(ii.gt_scalar(1.0)?.max().is_err()); // bool
    assert!(matches!(
        tp::cat(&[fi.clone(), ii.clone()], 0),
        Err(Error::DTypeMismatch { op: "cat", .. })
    ));
    assert!(matches!(
        t.scatter_add(
            1,
            &idx(&[0, 0], &[1, 2]),
            &Tensor::zeros(&[1, 2], DType::F32)?
        ),
        Err(Error::DTypeMismatch { .. })
    ));
    assert!(matches!(
        fi.matmul(&fi.to_dtype(DType::F32)?),
        Err(Error::DTypeMismatch { .. }) | Err(Error::UnsupportedDType { .. })
    ));
    // out-of-range and negative indices
    assert!(matches!(
        t.index_select(1, &idx(&[0, 3], &[2])),
        Err(Error::IndexOutOfBounds {
            op: "index_select",
            index: 3,
            dim: 1,
            size: 3
        })
    ));
    assert!(matches!(
        t.index_select(0, &idx(&[-1], &[1])),
        Err(Error::IndexOutOfBounds { index: -1, .. })
    ));
    assert!(matches!(
        t.gather(0, &idx(&[0, 2], &[1, 2])),
        Err(Error::IndexOutOfBounds {
            op: "gather",
            index: 2,
            dim: 0,
            size: 2
        })
    ));
    assert!(matches!(
        t.gather(1, &idx(&[-1], &[1, 1])),
        Err(Error::IndexOutOfBounds { .. })
    ));
    assert!(matches!(
        t.scatter_add(1, &idx(&[3], &[1, 1]), &t),
        Err(Error::IndexOutOfBounds {
            op: "scatter_add",
            ..
        })
    ));
    // empty reductions
    let e = Tensor::zeros(&[0, 3], DType::F64)?;
    assert!(e.max().is_err());
    assert!(e.max_dim(0, false).is_err());
    assert!(e.argmin(None, false).is_err());
    assert_eq!(e.max_dim(1, false)?.0.shape(), &[0]);
    // in-place on a leaf that requires grad
    let l = x(&[2, 3], 0);
    assert!(l.scatter_add_(0, &idx(&[0], &[1, 1]), &t).is_err());
    // the error text names the op and argument
    let msg = t.index_select(1, &idx(&[7], &[1])).unwrap_err().to_string();
    assert!(msg.contains("index_select") && msg.contains('7'), "{msg}");
    Ok(())
}
