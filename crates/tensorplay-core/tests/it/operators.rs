//! The arithmetic operators on `Tensor` (`&a + &b`, `a * 2.0`, `2.0 / &a`, `-a`, ...) against
//! their named methods: the same values, dtypes and gradients, and a panic naming both operands
//! where the named method returns an error.

use std::panic::{AssertUnwindSafe, catch_unwind};
use tensorplay_core::{self as tp, DType, Tensor};

/// An operator applied to two inputs (the second unused by scalar and unary cases).
type Op = fn(&Tensor, &Tensor) -> Tensor;
/// The named method the operator must equal.
type Named = fn(&Tensor, &Tensor) -> tp::Result<Tensor>;

const S: f64 = 2.5;

/// The four owned/borrowed forms of a tensor-tensor operator, each named.
macro_rules! tensor_tensor {
    ($sym:tt, $named:ident) => {{
        let forms: [(&'static str, Op, Named); 4] = [
            (
                concat!("&a ", stringify!($sym), " &b"),
                |a, b| a $sym b,
                |a, b| a.$named(b),
            ),
            (
                concat!("a ", stringify!($sym), " b"),
                |a, b| a.clone() $sym b.clone(),
                |a, b| a.$named(b),
            ),
            (
                concat!("&a ", stringify!($sym), " b"),
                |a, b| a $sym b.clone(),
                |a, b| a.$named(b),
            ),
            (
                concat!("a ", stringify!($sym), " &b"),
                |a, b| a.clone() $sym b,
                |a, b| a.$named(b),
            ),
        ];
        forms
    }};
}

/// The four forms of a tensor-scalar operator: the scalar on the right and on the left, the
/// tensor borrowed and owned, with the named method of each side.
macro_rules! tensor_scalar {
    ($sym:tt, $right:expr, $left:expr) => {{
        let forms: [(&'static str, Op, Named); 4] = [
            (concat!("&a ", stringify!($sym), " 2.5"), |a, _| a $sym S, $right),
            (concat!("a ", stringify!($sym), " 2.5"), |a, _| a.clone() $sym S, $right),
            (concat!("2.5 ", stringify!($sym), " &a"), |a, _| S $sym a, $left),
            (concat!("2.5 ", stringify!($sym), " a"), |a, _| S $sym a.clone(), $left),
        ];
        forms
    }};
}

fn cases() -> Vec<(&'static str, Op, Named)> {
    let mut v: Vec<(&'static str, Op, Named)> = Vec::new();
    v.extend(tensor_tensor!(+, add));
    v.extend(tensor_tensor!(-, sub));
    v.extend(tensor_tensor!(*, mul));
    v.extend(tensor_tensor!(/, div));
    v.extend(tensor_scalar!(+, |a, _| a.add_scalar(S), |a, _| a.add_scalar(S)));
    v.extend(tensor_scalar!(-, |a, _| a.sub_scalar(S), |a, _| a.neg()?.add_scalar(S)));
    v.extend(tensor_scalar!(*, |a, _| a.mul_scalar(S), |a, _| a.mul_scalar(S)));
    // true division of the scalar by the tensor (not a multiplication by the reciprocal)
    v.extend(
        tensor_scalar!(/, |a, _| a.div_scalar(S), |a, _| Tensor::full(&[], S, DType::F64)?.div(a)),
    );
    v.push(("-&a", |a, _| -a, |a, _| a.neg()));
    v.push(("-a", |a, _| -a.clone(), |a, _| a.neg()));
    v
}

/// Fresh leaves `a` (2 x 3) and `b` (`b_shape`), float64, requiring grad.
fn inputs(b_shape: &[usize]) -> tp::Result<(Tensor, Tensor)> {
    let a = Tensor::from_vec(vec![1.5f64, -2.0, 3.25, 0.5, -4.0, 6.0], &[2, 3])?;
    let n: usize = b_shape.iter().product();
    let b: Vec<f64> = (0..n).map(|i| 0.75 + i as f64 * 1.25).collect();
    let b = Tensor::from_vec(b, b_shape)?;
    Ok((a.requires_grad_(true), b.requires_grad_(true)))
}

/// The output's values and the gradients of `a` and `b` after a backward of `(y * w).sum()`
/// (a non-uniform upstream gradient); `None` for an input that got none.
type Outcome = (Vec<f64>, Option<Vec<f64>>, Option<Vec<f64>>);

fn run(
    b_shape: &[usize],
    f: impl Fn(&Tensor, &Tensor) -> tp::Result<Tensor>,
) -> tp::Result<Outcome> {
    let (a, b) = inputs(b_shape)?;
    let y = f(&a, &b)?;
    assert_eq!(y.shape(), &[2, 3]);
    let w = Tensor::from_vec(vec![1.0f64, -0.5, 2.0, 0.25, 3.0, -1.5], &[2, 3])?;
    y.mul(&w)?.sum()?.backward()?;
    let grad = |t: &Tensor| t.grad().map(|g| g.to_vec::<f64>()).transpose();
    Ok((y.to_vec::<f64>()?, grad(&a)?, grad(&b)?))
}

#[test]
fn tensor_operators_match_named_methods() -> tp::Result<()> {
    let mut failures = Vec::new();
    let mut check = |case: String, ok: bool, detail: String| {
        if !ok {
            failures.push(format!("{case}: {detail}"));
        }
    };

    // every operator x every owned/borrowed form x scalar side; same shapes and b broadcast
    // over a's rows: values, dtype and both gradients equal to the named method's
    for (name, op, named) in cases() {
        for b_shape in [&[2usize, 3][..], &[3]] {
            let case = format!("{name} with b of shape {b_shape:?}");
            let got = run(b_shape, |a, b| Ok(op(a, b)))?;
            let want = run(b_shape, named)?;
            check(case, got == want, format!("{got:?} != {want:?}"));
        }
    }

    // the scalar on the left against closed forms (the gradient of 2.5 / a is -2.5 / a²)
    let (a, _) = inputs(&[3])?;
    let av = a.to_vec::<f64>()?;
    type Closed = (&'static str, Op, fn(f64) -> f64, fn(f64) -> f64);
    let closed: [Closed; 4] = [
        ("2.5 + &a", |a, _| S + a, |x| S + x, |_| 1.0),
        ("2.5 - &a", |a, _| S - a, |x| S - x, |_| -1.0),
        ("2.5 * &a", |a, _| S * a, |x| S * x, |_| S),
        ("2.5 / &a", |a, _| S / a, |x| S / x, |x| -S / (x * x)),
    ];
    for (name, op, value, slope) in closed {
        let (y, ga, _) = run(&[3], |a, b| Ok(op(a, b)))?;
        let want: Vec<f64> = av.iter().map(|&x| value(x)).collect();
        check(
            format!("{name} values"),
            y == want,
            format!("{y:?} != {want:?}"),
        );
        let w = [1.0f64, -0.5, 2.0, 0.25, 3.0, -1.5];
        let want: Vec<f64> = av.iter().zip(w).map(|(&x, w)| w * slope(x)).collect();
        let ga = ga.unwrap_or_default();
        let close = ga.len() == 6
            && ga
                .iter()
                .zip(&want)
                .all(|(g, w)| (g - w).abs() <= 1e-12 * w.abs());
        check(
            format!("{name} gradient"),
            close,
            format!("{ga:?} != {want:?}"),
        );
    }

    // the f64 scalar is a Python float (PyTorch's rule): float32 and float64 stay, int64 and
    // bool become float32 (1e20 too: the named int64 method refuses it, it wrapped once); two
    // tensors promote
    let f32s = Tensor::from_vec(vec![1.0f32, 2.0, 4.0], &[3])?;
    let f64s = Tensor::from_vec(vec![1.0f64, 2.0, 4.0], &[3])?;
    let i64s = Tensor::from_vec(vec![1i64, 2, 4], &[3])?;
    let flags = Tensor::from_vec(vec![true, false], &[2])?;
    let dtypes: [(&str, Tensor, DType, Vec<f64>); 15] = [
        ("f32 * 2.0", &f32s * 2.0, DType::F32, vec![2.0, 4.0, 8.0]),
        ("2.0 - f32", 2.0 - &f32s, DType::F32, vec![1.0, 0.0, -2.0]),
        ("2.0 / f32", 2.0 / &f32s, DType::F32, vec![2.0, 1.0, 0.5]),
        ("f64 + 2.0", &f64s + 2.0, DType::F64, vec![3.0, 4.0, 6.0]),
        (
            "2.0 / f64",
            2.0 / f64s.clone(),
            DType::F64,
            vec![2.0, 1.0, 0.5],
        ),
        ("-f32", -&f32s, DType::F32, vec![-1.0, -2.0, -4.0]),
        ("i64 * 2.0", &i64s * 2.0, DType::F32, vec![2.0, 4.0, 8.0]),
        ("2.0 - i64", 2.0 - &i64s, DType::F32, vec![1.0, 0.0, -2.0]),
        (
            "i64 + 1e20",
            &i64s + 1e20,
            DType::F32,
            vec![1e20f32 as f64; 3],
        ),
        ("bool * 2.0", &flags * 2.0, DType::F32, vec![2.0, 0.0]),
        ("2.0 - bool", 2.0 - &flags, DType::F32, vec![1.0, 2.0]),
        ("i64 + 0.5", &i64s + 0.5, DType::F32, vec![1.5, 2.5, 4.5]),
        ("i64 / 2.0", &i64s / 2.0, DType::F32, vec![0.5, 1.0, 2.0]),
        ("2.0 / i64", 2.0 / &i64s, DType::F32, vec![2.0, 1.0, 0.5]),
        ("f32 + f64", &f32s + &f64s, DType::F64, vec![2.0, 4.0, 8.0]),
    ];
    for (name, t, dtype, values) in dtypes {
        let got = t.to_vec_f64()?;
        let ok = t.dtype() == dtype && got == values;
        check(
            name.into(),
            ok,
            format!("{} {got:?}, expected {dtype} {values:?}", t.dtype()),
        );
    }
    // the named int64 methods keep int64 for a whole scalar in range and refuse one outside it
    // (case, the method's result, the int64 values it must give, None: it must refuse)
    type Named<'a> = (&'a str, tp::Result<Tensor>, Option<Vec<i64>>);
    let named: [Named; 5] = [
        (
            "i64.add_scalar(2.0)",
            i64s.add_scalar(2.0),
            Some(vec![3, 4, 6]),
        ),
        (
            "i64.mul_scalar(-3.0)",
            i64s.mul_scalar(-3.0),
            Some(vec![-3, -6, -12]),
        ),
        ("i64.add_scalar(1e20)", i64s.add_scalar(1e20), None),
        ("i64.mul_scalar(-1e19)", i64s.mul_scalar(-1e19), None),
        ("i64.sub_scalar(9.3e18)", i64s.sub_scalar(9.3e18), None),
    ];
    for (name, r, want) in named {
        let ok = match (&r, &want) {
            (Ok(t), Some(w)) => t.dtype() == DType::I64 && t.to_vec::<i64>()? == *w,
            (Err(e), None) => e.to_string().contains("int64's range"),
            _ => false,
        };
        check(name.into(), ok, format!("{r:?}, expected {want:?}"));
    }

    // where the named method returns an error the operator panics, naming the operator and
    // both operands' shapes and dtypes
    let a = Tensor::ones(&[2, 3], DType::F32)?;
    let b = Tensor::ones(&[4], DType::F32)?;
    // (case, the operator, the named method, words the message must contain)
    type Bad = fn(&Tensor, &Tensor, &Tensor) -> Tensor;
    type BadNamed = fn(&Tensor, &Tensor, &Tensor) -> tp::Result<Tensor>;
    let panics: [(&str, Bad, BadNamed, [&str; 3]); 4] = [
        (
            "&a + &b",
            |a, b, _| a + b,
            |a, b, _| a.add(b),
            [
                "`+`",
                "lhs tensor of shape [2, 3] (float32)",
                "rhs tensor of shape [4] (float32)",
            ],
        ),
        (
            "a * b",
            |a, b, _| a.clone() * b.clone(),
            |a, b, _| a.mul(b),
            [
                "`*`",
                "lhs tensor of shape [2, 3] (float32)",
                "rhs tensor of shape [4] (float32)",
            ],
        ),
        (
            "&b - a",
            |a, b, _| b - a.clone(),
            |a, b, _| b.sub(a),
            [
                "`-`",
                "lhs tensor of shape [4] (float32)",
                "rhs tensor of shape [2, 3] (float32)",
            ],
        ),
        (
            "-bool",
            |_, _, f| -f,
            |_, _, f| f.neg(),
            ["`-`", "operand tensor of shape [2] (bool)", "neg"],
        ),
    ];
    for (name, op, named, words) in panics {
        let named_errs = named(&a, &b, &flags).is_err();
        let r = catch_unwind(AssertUnwindSafe(|| op(&a, &b, &flags)));
        let msg = match &r {
            Ok(t) => format!("no panic: {:?}", t.shape()),
            Err(p) => p
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_else(|| "a panic without a message".into()),
        };
        let ok = r.is_err() && named_errs && words.iter().all(|w| msg.contains(w));
        check(
            format!("{name} panics"),
            ok,
            format!("named method errs: {named_errs}; message {msg:?} should name {words:?}"),
        );
    }

    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    Ok(())
}
