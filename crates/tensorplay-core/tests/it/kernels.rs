//! The vectorised CPU kernels: `exp`, `tanh`, `log` and `erf` against float64 over sweeps of every kind of
//! float32 (with the ULP bound asserted) at every instruction-set level this machine has; the
//! same bits at every level and thread count; the fused row kernels and attention against
//! the composed operations; the caching allocator's statistics and reuse under threads.

use tensorplay::nn::functional as F;
use tensorplay::{self as tp, CpuCapability, Tensor};
use tensorplay_testkit::{Tol, check_close};

/// float32 values: a stride through every bit pattern (normals, subnormals, both signs) plus
/// zeros, infinities and NaN.
fn sweep() -> Vec<f32> {
    let mut v: Vec<f32> = (0..u32::MAX / 4099)
        .map(|i| f32::from_bits(i * 4099))
        .collect();
    v.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1e-45,
        -1e-45,
    ]);
    v.extend([
        88.72, 88.73, -103.9, -104.0, 0.549, 0.55, 0.551, 9.0, 9.1, -9.1,
    ]);
    // log's reduction edges and erf's pieces
    v.extend([
        f32::MIN_POSITIVE,
        f32::from_bits(0x007f_ffff),
        f32::MAX,
        std::f32::consts::FRAC_1_SQRT_2,
        std::f32::consts::SQRT_2,
        1.0,
        -1.0,
        0.999_999_94,
        1.000_000_1,
        3.92,
        3.95,
        3.96,
        -3.95,
    ]);
    v
}

/// Units in the last place between `got` and `want` (0 when both are NaN or equal
/// infinities; `u32::MAX` when only one is NaN).
fn ulps(got: f32, want: f32) -> u32 {
    if got.is_nan() || want.is_nan() {
        return if got.is_nan() && want.is_nan() {
            0
        } else {
            u32::MAX
        };
    }
    let key = |x: f32| {
        let b = x.to_bits() as i64;
        if b < 0x8000_0000 { b } else { 0x8000_0000 - b }
    };
    (key(got) - key(want)).unsigned_abs().min(u32::MAX as u64) as u32
}

/// The levels this machine can run.
fn levels() -> Vec<CpuCapability> {
    CpuCapability::ALL
        .into_iter()
        .filter(|l| l.is_supported())
        .collect()
}

#[test]
fn exp_tanh_log_erf_within_their_ulp_bounds_at_every_level() -> tp::Result<()> {
    let xs = sweep();
    let x = Tensor::from_vec(xs.clone(), &[xs.len()])?;
    type Case = (
        &'static str,
        fn(&Tensor) -> tp::Result<Tensor>,
        fn(f64) -> f64,
        u32,
        f32,
    );
    let cases: [Case; 5] = [
        ("exp", |t| t.exp(), f64::exp, 1, 0.0),
        ("tanh", |t| t.tanh(), f64::tanh, 2, 0.0),
        ("log", |t| t.log(), f64::ln, 1, 0.0),
        ("erf", |t| t.erf(), libm::erf, 1, 0.0),
        (
            "sigmoid",
            |t| t.sigmoid(),
            |v| 1.0 / (1.0 + (-v).exp()),
            3,
            1e-38,
        ),
    ];
    let before = tp::cpu_capability();
    let mut first: Vec<Vec<f32>> = Vec::new();
    for level in levels() {
        tp::set_cpu_capability(level)?;
        for (ci, (name, f, reference, bound, floor)) in cases.iter().enumerate() {
            let got = f(&x)?.to_vec::<f32>()?;
            let (worst, at) = got
                .iter()
                .zip(&xs)
                .map(|(&g, &v)| {
                    let want = reference(f64::from(v)) as f32;
                    let tiny = want.abs() < *floor && (g - want).abs() <= *floor;
                    (if tiny { 0 } else { ulps(g, want) }, v)
                })
                .max_by_key(|p| p.0)
                .unwrap_or((0, 0.0));
            assert!(
                worst <= *bound,
                "{name} at {level}: {worst} ulp at x = {at:e} (bound {bound})"
            );
            // every level gives the same bits (multiply-adds are fused at every level)
            match first.get(ci) {
                None => first.push(got),
                Some(want) => assert!(
                    want.iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{name} at {level} differs from {} bit for bit",
                    levels()[0]
                ),
            }
        }
    }
    tp::set_cpu_capability(before)
}

/// One fused-versus-composed case: a name, the fused computation and the composed one.
type Pair = (
    &'static str,
    Box<dyn Fn(&Tensor) -> tp::Result<Tensor>>,
    Box<dyn Fn(&Tensor) -> tp::Result<Tensor>>,
);

/// The composed softmax (max subtracted, exp, divided by the sum) over the last dim.
fn softmax_composed(x: &Tensor) -> tp::Result<Tensor> {
    let (m, _) = x.max_dim(-1, true)?;
    let e = x.sub(&m)?.exp()?;
    e.div(&e.sum_dims(&[-1], true)?)
}

fn check(what: &str, got: &Tensor, want: &Tensor, tol: Tol) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let g: Vec<f64> = got
        .to_dtype(tp::DType::F64)
        .and_then(|t| t.to_vec())
        .expect(what);
    let w: Vec<f64> = want
        .to_dtype(tp::DType::F64)
        .and_then(|t| t.to_vec())
        .expect(what);
    if let Err(e) = check_close(what, &g, &w, tol) {
        panic!("{e}");
    }
}

#[test]
fn fused_row_kernels_match_the_composed_operations() -> tp::Result<()> {
    tp::manual_seed(3);
    let pairs: Vec<Pair> = vec![
        (
            "softmax",
            Box::new(|x| x.softmax(-1)),
            Box::new(softmax_composed),
        ),
        (
            "log_softmax",
            Box::new(|x| x.log_softmax(-1)),
            Box::new(|x| softmax_composed(x)?.log()),
        ),
        (
            "softmax over dim 0 (composed path) vs last dim of the transpose",
            Box::new(|x| x.transpose(0, -1)?.softmax(0)?.transpose(0, -1)),
            Box::new(|x| x.softmax(-1)),
        ),
        (
            "gelu_tanh",
            Box::new(|x| x.gelu_tanh()),
            Box::new(|x| {
                let u = x
                    .pow_scalar(3.0)?
                    .mul_scalar(0.044715)?
                    .add(x)?
                    .mul_scalar(0.797_884_560_802_865_4)?;
                x.mul(&u.tanh()?.add_scalar(1.0)?)?.mul_scalar(0.5)
            }),
        ),
        (
            "gelu (erf)",
            Box::new(|x| F::gelu(x, F::Approximate::None)),
            Box::new(|x| {
                let e = x.mul_scalar(std::f64::consts::FRAC_1_SQRT_2)?.erf()?;
                x.mul(&e.add_scalar(1.0)?)?.mul_scalar(0.5)
            }),
        ),
        (
            "gelu (erf) on a strided view",
            Box::new(|x| x.transpose(0, -1)?.gelu()?.transpose(0, -1)),
            Box::new(|x| F::gelu(x, F::Approximate::None)),
        ),
        (
            "layer_norm on a strided view",
            Box::new(|x| F::layer_norm(&x.transpose(0, 1)?, &[x.shape()[2]], None, None, 1e-5)),
            Box::new(|x| {
                let x = x.transpose(0, 1)?;
                let m = x.mean_dims(&[-1], true)?;
                let d = x.sub(&m)?;
                let var = d.mul(&d)?.mean_dims(&[-1], true)?;
                d.div(&var.add_scalar(1e-5)?.sqrt()?)
            }),
        ),
    ];
    // rows across the lanes' remainder, a zero-size tensor, and an infinity
    let inputs = [
        tp::randn(&[3, 5, 37])?.mul_scalar(4.0)?,
        tp::randn(&[2, 3, 128])?,
        tp::zeros(&[2, 0, 8])?,
    ];
    for dtype in [tp::DType::F32, tp::DType::F64] {
        let tol = if dtype == tp::DType::F32 {
            Tol {
                abs: 2e-6,
                rel: 2e-5,
            }
        } else {
            Tol {
                abs: 1e-12,
                rel: 1e-11,
            }
        };
        for (i, x) in inputs.iter().enumerate() {
            let x = x.to_dtype(dtype)?;
            for (name, fused, composed) in &pairs {
                let what = format!("{name}, input {i} {:?}, {dtype}", x.shape());
                check(&what, &fused(&x)?, &composed(&x)?, tol);
            }
        }
    }
    let with_inf = Tensor::from_vec(vec![1.0f32, f32::NEG_INFINITY, 2.0, 0.5], &[1, 4])?;
    check(
        "softmax with -inf",
        &with_inf.softmax(-1)?,
        &softmax_composed(&with_inf)?,
        Tol::abs(1e-7),
    );
    Ok(())
}

/// One gradient case: a name, a function of float64 leaves, and the leaves.
type GradCase = (
    &'static str,
    Box<dyn Fn(&[Tensor]) -> tp::Result<Vec<Tensor>>>,
    Vec<Tensor>,
);

#[test]
fn fused_kernels_pass_gradcheck_and_match_the_composed_gradients() -> tp::Result<()> {
    tp::manual_seed(4);
    let leaf = |shape: &[usize], scale: f64| -> tp::Result<Tensor> {
        Ok(tp::randn(shape)?
            .mul_scalar(scale)?
            .to_dtype(tp::DType::F64)?
            .requires_grad_(true))
    };
    let gelu_composed = |x: &Tensor| -> tp::Result<Tensor> {
        let e = x.mul_scalar(std::f64::consts::FRAC_1_SQRT_2)?.erf()?;
        x.mul(&e.add_scalar(1.0)?)?.mul_scalar(0.5)
    };
    let cases: Vec<GradCase> = vec![
        (
            "gelu (erf)",
            Box::new(|xs| Ok(vec![F::gelu(&xs[0], F::Approximate::None)?])),
            vec![leaf(&[3, 7], 2.0)?],
        ),
        (
            "gelu (erf), composed",
            Box::new(move |xs| Ok(vec![gelu_composed(&xs[0])?])),
            vec![leaf(&[3, 7], 2.0)?],
        ),
    ];
    for (name, f, inputs) in &cases {
        if let Err(e) = tp::autograd::gradcheck(f, inputs, Default::default()) {
            panic!("{name}: {e}");
        }
    }
    // the fused and composed gradients of the same inputs, in float32 and float64
    let x = tp::randn(&[4, 37])?.mul_scalar(3.0)?;
    let g = tp::randn(&[4, 37])?;
    for dtype in [tp::DType::F32, tp::DType::F64] {
        let tol = if dtype == tp::DType::F32 {
            Tol {
                abs: 2e-6,
                rel: 2e-5,
            }
        } else {
            Tol {
                abs: 1e-12,
                rel: 1e-11,
            }
        };
        let x = x.to_dtype(dtype)?.requires_grad_(true);
        let g = g.to_dtype(dtype)?;
        let opts = tp::autograd::GradOptions::default();
        let fused = F::gelu(&x, F::Approximate::None)?;
        let composed = gelu_composed(&x)?;
        let a = tp::autograd::grad(&[fused], std::slice::from_ref(&x), &[Some(g.clone())], opts)?;
        let b = tp::autograd::grad(
            &[composed],
            std::slice::from_ref(&x),
            &[Some(g.clone())],
            opts,
        )?;
        let (a, b) = (a[0].as_ref().expect("grad"), b[0].as_ref().expect("grad"));
        check(&format!("gelu (erf) gradient, {dtype}"), a, b, tol);
    }
    Ok(())
}

/// Cross-entropy composed of log-softmax and the negative mean of the targets' entries.
fn cross_entropy_composed(x: &Tensor, target: &[i64]) -> tp::Result<Tensor> {
    let (n, c) = (x.shape()[0], x.shape()[1]);
    let mut onehot = vec![0.0f64; n * c];
    for (i, &t) in target.iter().enumerate() {
        onehot[i * c + t as usize] = 1.0;
    }
    let onehot = Tensor::from_vec(onehot, &[n, c])?.to_dtype(x.dtype())?;
    x.log_softmax(-1)?
        .mul(&onehot)?
        .sum()?
        .div_scalar(-(n as f64))
}

#[test]
fn fused_cross_entropy_matches_log_softmax_and_nll() -> tp::Result<()> {
    tp::manual_seed(6);
    let big = vec![1e4, 0.0, -1e4, 9999.0, -3.0, 1e4, 2.0, 1.0];
    // (name, logits, targets): rows across the lanes' remainder, pieces of rows and threads
    let cases: Vec<(&str, Tensor, Vec<i64>)> = vec![
        (
            "4 x 37",
            tp::randn(&[4, 37])?.mul_scalar(3.0)?,
            vec![0, 36, 5, 17],
        ),
        ("C = 1", tp::randn(&[5, 1])?, vec![0; 5]),
        ("logits of 1e4", Tensor::from_vec(big, &[2, 4])?, vec![2, 0]),
        (
            "300 x 130, several pieces and threads",
            tp::randn(&[300, 130])?.mul_scalar(5.0)?,
            (0..300).map(|i| (i * 7 % 130) as i64).collect(),
        ),
    ];
    for dtype in [tp::DType::F32, tp::DType::F64] {
        let tol = if dtype == tp::DType::F32 {
            Tol {
                abs: 2e-6,
                rel: 2e-5,
            }
        } else {
            Tol {
                abs: 1e-12,
                rel: 1e-11,
            }
        };
        for (name, x, target) in &cases {
            let x = x.to_dtype(dtype)?.requires_grad_(true);
            let t = Tensor::from_vec(target.clone(), &[target.len()])?;
            let fused = F::cross_entropy(&x, &t)?;
            let composed = cross_entropy_composed(&x, target)?;
            let what = format!("cross_entropy {name}, {dtype}");
            assert!(fused.item_f64()?.is_finite(), "{what}: not finite");
            check(&format!("{what}: loss"), &fused, &composed, tol);
            let g = Tensor::from_vec(vec![0.7f64], &[])?.to_dtype(dtype)?;
            let opts = tp::autograd::GradOptions::default();
            let a =
                tp::autograd::grad(&[fused], std::slice::from_ref(&x), &[Some(g.clone())], opts)?;
            let b = tp::autograd::grad(&[composed], std::slice::from_ref(&x), &[Some(g)], opts)?;
            let (a, b) = (a[0].as_ref().expect("grad"), b[0].as_ref().expect("grad"));
            check(&format!("{what}: gradient"), a, b, tol);
        }
    }
    // an empty batch: a NaN loss (as PyTorch) and an empty gradient
    let x = tp::zeros(&[0, 5])?.requires_grad_(true);
    let loss = F::cross_entropy(&x, &Tensor::from_vec(Vec::<i64>::new(), &[0])?)?;
    assert!(loss.item_f64()?.is_nan(), "N = 0: {loss:?}");
    loss.backward()?;
    assert_eq!(x.grad().expect("grad").shape(), &[0, 5]);
    // float64 gradcheck, a C = 1 case among them
    for (shape, target) in [(vec![3, 5], vec![4i64, 0, 2]), (vec![2, 1], vec![0, 0])] {
        let x = tp::randn(&shape)?
            .mul_scalar(2.0)?
            .to_dtype(tp::DType::F64)?
            .requires_grad_(true);
        let t = Tensor::from_vec(target, &[shape[0]])?;
        let f = |xs: &[Tensor]| Ok(vec![F::cross_entropy(&xs[0], &t)?]);
        if let Err(e) = tp::autograd::gradcheck(f, &[x], Default::default()) {
            panic!("cross_entropy {shape:?}: {e}");
        }
    }
    Ok(())
}

#[test]
fn fused_attention_matches_the_math_path_across_blocks() -> tp::Result<()> {
    tp::manual_seed(5);
    // (name, batch dims, L, S, E, Ev, mask): lengths cross the 32-query and 512-key blocks
    type Case = (
        &'static str,
        Vec<usize>,
        usize,
        usize,
        usize,
        usize,
        &'static str,
    );
    let cases: Vec<Case> = vec![
        ("causal, one block", vec![2, 3], 8, 8, 4, 4, "causal"),
        (
            "causal, odd lengths across blocks",
            vec![1, 2],
            70,
            70,
            5,
            3,
            "causal",
        ),
        ("causal, L < S", vec![2], 33, 130, 4, 6, "causal"),
        (
            "no mask, S across blocks",
            vec![2, 2],
            35,
            129,
            8,
            8,
            "none",
        ),
        ("bool mask", vec![2, 2], 40, 66, 4, 4, "bool"),
        ("float mask", vec![3], 17, 65, 4, 2, "float"),
        ("3-d input", vec![3], 9, 9, 4, 4, "causal"),
        (
            "causal, one key past a key block",
            vec![1],
            513,
            513,
            4,
            3,
            "causal",
        ),
        (
            "no mask, one key short of a key block",
            vec![2],
            31,
            511,
            4,
            4,
            "none",
        ),
        (
            "float mask, a whole key block",
            vec![2],
            32,
            512,
            4,
            4,
            "float",
        ),
        (
            "bool mask, keys across blocks",
            vec![1, 2],
            33,
            1030,
            3,
            5,
            "bool",
        ),
        ("causal, L > S", vec![2], 45, 20, 4, 4, "causal"),
    ];
    for (name, batch, l, s, e, ev, mask) in cases {
        let shape = |rows: usize, feats: usize| {
            let mut v = batch.clone();
            v.extend([rows, feats]);
            v
        };
        let q = tp::randn(&shape(l, e))?
            .to_dtype(tp::DType::F64)?
            .requires_grad_(true);
        let k = tp::randn(&shape(s, e))?
            .to_dtype(tp::DType::F64)?
            .requires_grad_(true);
        let v = tp::randn(&shape(s, ev))?
            .to_dtype(tp::DType::F64)?
            .requires_grad_(true);
        // about 70% of the keys, and always key 0 (no row fully masked)
        let keep: Vec<bool> = (0..l * s)
            .map(|i| i % s == 0 || (i * 7919) % 10 < 7)
            .collect();
        let keep = Tensor::from_vec(keep, &[l, s])?;
        let tri = tp::ones(&[l, s])?.tril(0)?.to_dtype(tp::DType::Bool)?;
        let additive = |m: &Tensor| -> tp::Result<Tensor> {
            tp::zeros(&[l, s])?
                .to_dtype(tp::DType::F64)?
                .masked_fill(&m.logical_not()?, f64::NEG_INFINITY)
        };
        let noise = tp::randn(&[l, s])?.to_dtype(tp::DType::F64)?;
        // the math path: an additive mask that requires grad is never fused
        let (fused_mask, math_mask) = match mask {
            "causal" => (None, additive(&tri)?),
            "none" => (None, tp::zeros(&[l, s])?.to_dtype(tp::DType::F64)?),
            "bool" => (Some(keep.clone()), additive(&keep)?),
            _ => (Some(noise.clone()), noise.clone()),
        };
        let causal = mask == "causal";
        let y =
            F::scaled_dot_product_attention(&q, &k, &v, fused_mask.as_ref(), 0.0, causal, None)?;
        let math_mask = math_mask.requires_grad_(true);
        let want = F::scaled_dot_product_attention(&q, &k, &v, Some(&math_mask), 0.0, false, None)?;
        check(
            &format!("{name}: output"),
            &y,
            &want,
            Tol {
                abs: 1e-12,
                rel: 1e-10,
            },
        );
        let g = tp::randn(y.shape())?.to_dtype(tp::DType::F64)?;
        let inputs = [q.clone(), k.clone(), v.clone()];
        let opts = tp::autograd::GradOptions::default();
        let got = tp::autograd::grad(&[y], &inputs, &[Some(g.clone())], opts)?;
        let exp = tp::autograd::grad(&[want], &inputs, &[Some(g)], opts)?;
        for (which, (a, b)) in ["dq", "dk", "dv"].iter().zip(got.iter().zip(&exp)) {
            let (a, b) = (a.as_ref().expect("grad"), b.as_ref().expect("grad"));
            check(
                &format!("{name}: {which}"),
                a,
                b,
                Tol {
                    abs: 1e-11,
                    rel: 1e-9,
                },
            );
        }
    }
    Ok(())
}

#[test]
fn linear_with_its_bias_in_the_product_matches_matmul_plus_bias() -> tp::Result<()> {
    tp::manual_seed(6);
    // (name, input shape, out features, input transposed): 3-d inputs fold into rows,
    // strided inputs, and empty products (no rows, no inner elements, no outputs)
    let cases: &[(&str, &[usize], usize, bool)] = &[
        ("2-d", &[33, 20], 7, false),
        ("3-d folded", &[4, 9, 16], 24, false),
        ("transposed input", &[20, 33], 5, true),
        ("no rows", &[0, 8], 3, false),
        ("no inner elements", &[5, 0], 3, false),
        ("no outputs", &[5, 8], 0, false),
    ];
    for &(name, shape, n, transposed) in cases {
        let x = tp::randn(shape)?;
        let x = if transposed { x.t()? } else { x };
        let k = x.shape()[x.ndim() - 1];
        let w = tp::randn(&[n, k])?.requires_grad_(true);
        let b = tp::randn(&[n])?.requires_grad_(true);
        let xr = x.detach().requires_grad_(true);
        let fused = F::linear(&xr, &w, Some(&b))?;
        let composed = xr.matmul(&w.t()?)?.add(&b)?;
        check(
            name,
            &fused,
            &composed,
            Tol {
                abs: 1e-5,
                rel: 1e-5,
            },
        );
        let g = tp::randn(fused.shape())?;
        let grads = |y: &Tensor| -> tp::Result<Vec<Tensor>> {
            for t in [&xr, &w, &b] {
                t.set_grad(None);
            }
            y.backward_with(Some(&g), false, false)?;
            Ok([&xr, &w, &b]
                .iter()
                .map(|t| t.grad().expect("a gradient"))
                .collect())
        };
        let (gf, gc) = (grads(&fused)?, grads(&composed)?);
        for (i, (a, c)) in gf.iter().zip(&gc).enumerate() {
            check(
                &format!("{name}: gradient {i}"),
                a,
                c,
                Tol {
                    abs: 1e-4,
                    rel: 1e-4,
                },
            );
        }
    }
    Ok(())
}

#[test]
fn float_sums_over_trailing_dims_match_a_float64_sum() -> tp::Result<()> {
    tp::manual_seed(4);
    // (name, shape, dims): short and long rows (a long one is cut into pieces), zero-size
    let cases: &[(&str, &[usize], &[isize])] = &[
        ("rows of 130", &[64, 130], &[-1]),
        ("two trailing dims", &[4, 5, 6], &[1, 2]),
        ("everything", &[4, 5, 6], &[]),
        ("a long row, several pieces", &[2, 100_003], &[-1]),
        ("rows of zero elements", &[7, 0], &[-1]),
        ("no rows", &[0, 5], &[-1]),
        ("one element", &[1], &[0]),
    ];
    for &(name, shape, dims) in cases {
        let x = tp::randn(shape)?;
        let got = x.sum_dims(dims, false)?;
        let v: Vec<f32> = x.to_vec()?;
        let n: usize = if dims.is_empty() {
            shape.iter().product()
        } else {
            dims.iter()
                .map(|&d| shape[(d + shape.len() as isize) as usize % shape.len()])
                .product()
        };
        let rows = got.numel();
        let want: Vec<f64> = (0..rows)
            .map(|r| v[r * n..(r + 1) * n].iter().map(|&a| f64::from(a)).sum())
            .collect();
        let got: Vec<f64> = got.to_dtype(tp::DType::F64)?.to_vec()?;
        // float32 sums of n values of about 1: a few ulps of sqrt(n)
        let tol = Tol {
            abs: 1e-6 * (n as f64).max(1.0).sqrt(),
            rel: 1e-5,
        };
        if let Err(e) = check_close(name, &got, &want, tol) {
            panic!("{e}");
        }
        let x64 = x.to_dtype(tp::DType::F64)?;
        let got64: Vec<f64> = x64.sum_dims(dims, false)?.to_vec()?;
        let tol64 = Tol {
            abs: 1e-12 * (n as f64).max(1.0),
            rel: 1e-12,
        };
        if let Err(e) = check_close(&format!("{name} (float64)"), &got64, &want, tol64) {
            panic!("{e}");
        }
    }
    Ok(())
}

#[test]
fn results_do_not_depend_on_the_thread_count() -> tp::Result<()> {
    tp::manual_seed(9);
    let x = tp::randn(&[512, 200])?;
    let q = tp::randn(&[4, 4, 70, 16])?;
    let long = tp::randn(&[300_001])?;
    // a product whose inner dimension gemm cuts into blocks
    let (ma, mb) = (tp::randn(&[300, 1500])?, tp::randn(&[1500, 200])?);
    let (lx, lw, lb) = (
        tp::randn(&[256, 300])?,
        tp::randn(&[200, 300])?,
        tp::randn(&[200])?,
    );
    let before = tp::get_num_threads();
    let run = || -> tp::Result<Vec<Vec<f32>>> {
        // linear (its bias in the product), elementwise maps, the bias gradient's column sums
        // and an AdamW step, each large enough to be split over threads
        // copies: the optimizer updates them in place
        let (lin_w, lin_b) = (
            lw.deep_clone()?.requires_grad_(true),
            lb.deep_clone()?.requires_grad_(true),
        );
        let h = F::linear(&lx, &lin_w, Some(&lin_b))?
            .relu()?
            .mul_scalar(0.5)?;
        h.mul(&h)?.sum()?.backward()?;
        let b_grad: Vec<f32> = lin_b.grad().expect("grad").to_vec()?;
        let mut opt =
            tp::optim::AdamW::new(vec![lin_w.clone(), lin_b.clone()], Default::default())?;
        tp::optim::Optimizer::step(&mut opt)?;
        let w = tp::ones(&[200])?.requires_grad_(true);
        let xr = x.detach().requires_grad_(true);
        let ln = F::layer_norm(&xr, &[200], Some(&w), None, 1e-5)?;
        let y = ln.softmax(-1)?.gelu_tanh()?.exp()?;
        y.sum()?.backward()?;
        let qr = q.detach().requires_grad_(true);
        let a = F::scaled_dot_product_attention(&qr, &qr, &qr, None, 0.0, true, None)?;
        a.mul(&a)?.sum()?.backward()?;
        Ok(vec![
            long.sum()?.to_vec()?,
            x.sum_dims(&[-1], false)?.to_vec()?,
            h.to_vec()?,
            ma.matmul(&mb)?.to_vec()?,
            b_grad,
            // the AdamW step's results (the layer norm's `w` below shadowed this once, so the
            // step went unchecked)
            lin_w.detach().to_vec()?,
            lin_b.detach().to_vec()?,
            qr.grad().expect("grad").to_vec()?,
            y.to_vec()?,
            xr.grad().expect("grad").to_vec()?,
            w.grad().expect("grad").to_vec()?,
            a.contiguous()?.to_vec()?,
        ])
    };
    tp::set_num_threads(1);
    let one = run()?;
    tp::set_num_threads(4);
    let four = run()?;
    tp::set_num_threads(before);
    for (i, (a, b)) in one.iter().zip(&four).enumerate() {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "output {i} differs between 1 and 4 threads"
        );
    }
    Ok(())
}

#[test]
fn caching_allocator_counts_and_reuses_without_sharing_live_memory() -> tp::Result<()> {
    // other tests allocate concurrently: the counts are checked on this thread's own deltas
    // with a margin, and reuse by checksums of live tensors
    let n = 1 << 20; // 4 MiB of float32
    // other tests free memory meanwhile (optimizer state is counted too): a delta lowered by
    // their frees is retried; an allocator that does not count fails every attempt
    let mut grown = 0;
    for _ in 0..20 {
        let before = tp::memory::allocated_bytes();
        let t = tp::zeros(&[n])?.add_scalar(1.0)?;
        grown = tp::memory::allocated_bytes().saturating_sub(before);
        drop(t);
        if grown >= 4 * n {
            break;
        }
    }
    assert!(
        grown >= 4 * n,
        "allocated grew by {grown} bytes for a {} byte tensor, in 20 attempts",
        4 * n
    );
    let t = tp::zeros(&[n])?.add_scalar(1.0)?;
    assert!(tp::memory::reserved_bytes() >= tp::memory::allocated_bytes());
    assert!(tp::memory::peak_allocated_bytes() >= tp::memory::allocated_bytes());
    drop(t);
    // threads make, check and drop tensors: a reused buffer never holds another live tensor's
    let workers: Vec<_> = (0..4)
        .map(|w| {
            std::thread::spawn(move || -> tp::Result<()> {
                for i in 0..200 {
                    let v = (w * 1000 + i) as f64;
                    let a = tp::zeros(&[8192 + (i % 3) * 1024])?.add_scalar(v)?;
                    let b = a.mul_scalar(2.0)?;
                    let (sa, sb) = (a.sum()?.item::<f32>()?, b.sum()?.item::<f32>()?);
                    let m = a.numel() as f32;
                    assert_eq!(
                        (sa, sb),
                        (v as f32 * m, 2.0 * v as f32 * m),
                        "worker {w} step {i}"
                    );
                }
                Ok(())
            })
        })
        .collect();
    for h in workers {
        h.join().expect("worker panicked")?;
    }
    tp::memory::empty_cache();
    assert!(tp::memory::reserved_bytes() >= tp::memory::allocated_bytes());
    Ok(())
}
