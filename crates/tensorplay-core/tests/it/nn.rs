//! `nn`: layers, module machinery (names, state_dict, train/eval, hooks, devices) and losses,
//! checked against hand-computed values and finite differences.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tensorplay_core::autograd::{GradcheckOptions, gradcheck, gradgradcheck};
use tensorplay_core::nn::{self, Module, ModuleFields, functional as F};
use tensorplay_core::{self as tp, DType, Device, Error, Tensor};

fn t64(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape).unwrap()
}

fn close(a: &[f64], b: &[f64], tol: f64) {
    tensorplay_testkit::assert_close("values", a, b, tensorplay_testkit::Tol::abs(tol));
}

fn mlp() -> tp::Result<nn::Sequential> {
    Ok(nn::Sequential::new()
        .add(nn::Linear::new(3, 4, true)?)
        .add(nn::ReLU::new())
        .add(nn::Linear::new(4, 2, false)?))
}

#[test]
fn linear_forward_matches_hand_computation() -> tp::Result<()> {
    let w = t64(&[1.0, 2.0, 3.0, -1.0, 0.5, 0.0], &[2, 3]);
    let b = t64(&[0.1, -0.2], &[2]);
    let lin = nn::Linear::from_weights(w, Some(b))?;
    let x = t64(&[1.0, 1.0, 1.0, 2.0, 0.0, -1.0], &[2, 3]);
    let y = lin.call(&x)?;
    assert_eq!(y.shape(), &[2, 2]);
    // row 0: [1+2+3+0.1, -1+0.5+0-0.2], row 1: [2+0-3+0.1, -2+0+0-0.2]
    close(&y.to_vec::<f64>()?, &[6.1, -0.7, -0.9, -2.2], 1e-12);
    // batched input [2, 1, 3] and 1-d input
    let y3 = lin.call(&x.reshape(&[2usize, 1, 3])?)?;
    assert_eq!(y3.shape(), &[2, 1, 2]);
    close(&y3.to_vec::<f64>()?, &[6.1, -0.7, -0.9, -2.2], 1e-12);
    let y1 = lin.call(&t64(&[1.0, 1.0, 1.0], &[3]))?;
    close(&y1.to_vec::<f64>()?, &[6.1, -0.7], 1e-12);
    // wrong feature count
    assert!(matches!(
        lin.call(&t64(&[1.0, 2.0], &[1, 2])),
        Err(Error::ShapeMismatch { .. })
    ));
    // without bias
    let nb = nn::Linear::from_weights(t64(&[1.0, 2.0], &[1, 2]), None)?;
    close(
        &nb.call(&t64(&[3.0, 4.0], &[1, 2]))?.to_vec::<f64>()?,
        &[11.0],
        0.0,
    );
    Ok(())
}

#[test]
fn linear_init_bounds_and_shapes() -> tp::Result<()> {
    tp::manual_seed(7);
    let lin = nn::Linear::new(16, 32, true)?;
    assert_eq!(lin.weight.shape(), &[32, 16]);
    assert_eq!(lin.weight.dtype(), DType::F32);
    assert!(lin.weight.requires_grad() && lin.weight.is_leaf());
    let bound = 1.0 / 16f64.sqrt();
    let w = lin.weight.to_vec_f64()?;
    let b = lin.bias.as_ref().unwrap().to_vec_f64()?;
    assert_eq!(b.len(), 32);
    assert!(w.iter().chain(&b).all(|v| v.abs() <= bound));
    // spread over the interval, not a constant
    let (mn, mx) = w
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
    assert!(mn < -0.8 * bound && mx > 0.8 * bound, "{mn} {mx}");
    let mean = w.iter().sum::<f64>() / w.len() as f64;
    assert!(mean.abs() < 0.05, "{mean}");
    // same seed, same weights
    tp::manual_seed(7);
    let again = nn::Linear::new(16, 32, true)?;
    assert_eq!(again.weight.to_vec_f64()?, w);
    Ok(())
}

#[test]
fn sequential_parameter_names_and_children() -> tp::Result<()> {
    let m = mlp()?;
    let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["0.weight", "0.bias", "2.weight"]);
    let children: Vec<String> = m.named_children().into_iter().map(|(n, _)| n).collect();
    assert_eq!(children, ["0", "1", "2"]);
    assert_eq!(m.parameters().len(), 3);
    assert!(m.named_buffers().is_empty());
    // nested containers give nested dotted names
    let outer = nn::Sequential::from_vec(vec![Box::new(mlp()?), Box::new(nn::Tanh::new())]);
    let names: Vec<String> = outer
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, ["0.0.weight", "0.0.bias", "0.2.weight"]);
    let y = outer.call(&tp::randn(&[5, 3])?)?;
    assert_eq!(y.shape(), &[5, 2]);
    assert!(y.to_vec::<f32>()?.iter().all(|v| v.abs() < 1.0));
    Ok(())
}

#[test]
fn state_dict_round_trip_and_strict_errors() -> tp::Result<()> {
    tp::manual_seed(1);
    let a = mlp()?;
    let mut b = mlp()?;
    let x = tp::randn(&[4, 3])?;
    assert_ne!(a.call(&x)?.to_vec::<f32>()?, b.call(&x)?.to_vec::<f32>()?);
    let sd = a.state_dict()?;
    assert_eq!(
        sd.keys().cloned().collect::<Vec<_>>(),
        ["0.bias", "0.weight", "2.weight"]
    );
    assert!(sd.values().all(|t| !t.requires_grad()));
    let before = b.parameters()[0].clone();
    b.load_state_dict(&sd, true)?;
    assert_eq!(a.call(&x)?.to_vec::<f32>()?, b.call(&x)?.to_vec::<f32>()?);
    // copied in place: same tensors, still leaves requiring grad
    assert!(b.parameters()[0].shares_storage_with(&before));
    assert!(
        b.parameters()
            .iter()
            .all(|p| p.requires_grad() && p.is_leaf())
    );
    // ... and not aliasing the source
    assert!(!b.parameters()[0].shares_storage_with(&a.parameters()[0]));

    // missing key
    let mut partial: BTreeMap<String, Tensor> = sd.clone();
    partial.remove("0.bias");
    let e = b.load_state_dict(&partial, true).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("0.bias"),
        "{e}"
    );
    b.load_state_dict(&partial, false)?; // fine when not strict
    // unexpected key
    let mut extra = sd.clone();
    extra.insert("3.weight".into(), tp::zeros(&[1])?);
    let e = b.load_state_dict(&extra, true).unwrap_err();
    assert!(e.to_string().contains("3.weight"), "{e}");
    b.load_state_dict(&extra, false)?;
    // shape mismatch, strict or not, names the key and copies nothing
    let mut bad = sd.clone();
    bad.insert("2.weight".into(), tp::zeros(&[2, 5])?);
    let snapshot = b.parameters()[0].to_vec::<f32>()?;
    let e = b.load_state_dict(&bad, false).unwrap_err();
    assert!(e.to_string().contains("2.weight"), "{e}");
    assert_eq!(b.parameters()[0].to_vec::<f32>()?, snapshot);
    Ok(())
}

#[test]
fn train_eval_switches_dropout() -> tp::Result<()> {
    let mut m = nn::Sequential::new().add(nn::Dropout::new(0.5)?);
    assert!(m.is_training());
    let x = tp::ones(&[1000])?;
    let y = m.call(&x)?.to_vec::<f32>()?;
    assert!(y.contains(&0.0) && y.contains(&2.0));
    m.eval()?;
    assert!(!m.is_training());
    assert!(!m.get(0).unwrap().is_training());
    assert_eq!(m.call(&x)?.to_vec::<f32>()?, vec![1.0; 1000]);
    m.train(true)?;
    assert!(m.get(0).unwrap().is_training());
    Ok(())
}

#[test]
fn dropout_statistics_with_fixed_seed() -> tp::Result<()> {
    let n = 100_000;
    let x = Tensor::ones(&[n], DType::F64)?.requires_grad_(true);
    tp::manual_seed(42);
    let y = F::dropout(&x, 0.3, true)?;
    let v = y.to_vec::<f64>()?;
    let kept = v.iter().filter(|&&e| e != 0.0).count();
    assert!(v.iter().all(|&e| e == 0.0 || (e - 1.0 / 0.7).abs() < 1e-12));
    let frac = kept as f64 / n as f64;
    // binomial std is ~0.0014; allow 5 sigma
    assert!((frac - 0.7).abs() < 0.008, "{frac}");
    let mean = v.iter().sum::<f64>() / n as f64;
    assert!((mean - 1.0).abs() < 0.012, "{mean}");
    // the gradient is the same mask
    y.sum()?.backward()?;
    assert_eq!(x.grad().unwrap().to_vec::<f64>()?, v);
    // same seed, same mask
    tp::manual_seed(42);
    assert_eq!(F::dropout(&x.detach(), 0.3, true)?.to_vec::<f64>()?, v);
    // p = 0 and eval are the identity; p outside [0, 1) errors
    assert_eq!(F::dropout(&x, 0.0, true)?.to_vec::<f64>()?, vec![1.0; n]);
    assert!(matches!(
        nn::Dropout::new(1.0),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        nn::Dropout::new(-0.1),
        Err(Error::InvalidArgument { .. })
    ));
    Ok(())
}

#[test]
fn embedding_forward_backward_values() -> tp::Result<()> {
    let w = t64(&[0.0, 1.0, 10.0, 11.0, 20.0, 21.0], &[3, 2]).requires_grad_(true);
    let emb = nn::Embedding::from_weights(w.clone())?;
    let idx = Tensor::from_vec(vec![2i64, 0, 2, 1], &[2, 2])?;
    let y = emb.call(&idx)?;
    assert_eq!(y.shape(), &[2, 2, 2]);
    assert_eq!(
        y.to_vec::<f64>()?,
        vec![20.0, 21.0, 0.0, 1.0, 20.0, 21.0, 10.0, 11.0]
    );
    let g = t64(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], &[2, 2, 2]);
    y.backward_with(Some(&g), false, false)?;
    // row 0 <- [3, 4]; row 1 <- [7, 8]; row 2 <- [1, 2] + [5, 6]
    assert_eq!(
        w.grad().unwrap().to_vec::<f64>()?,
        vec![3.0, 4.0, 7.0, 8.0, 6.0, 8.0]
    );
    // errors
    let bad = Tensor::from_vec(vec![3i64], &[1])?;
    match emb.call(&bad) {
        Err(Error::IndexOutOfBounds {
            index: 3, size: 3, ..
        }) => {}
        r => panic!("{r:?}"),
    }
    assert!(matches!(
        emb.call(&Tensor::from_vec(vec![-1i64], &[1])?),
        Err(Error::IndexOutOfBounds { .. })
    ));
    assert!(matches!(
        emb.call(&t64(&[0.0], &[1])),
        Err(Error::UnsupportedDType { .. })
    ));
    // default init and gradcheck of the weight (first and second order)
    tp::manual_seed(3);
    let e = nn::Embedding::new(10, 4)?;
    assert_eq!(e.weight.shape(), &[10, 4]);
    let idx = Tensor::from_vec(vec![1i64, 1, 4], &[3])?;
    let w = t64(&[0.5, -0.25, 1.0, 2.0, 0.0, 3.0], &[3, 2]).requires_grad_(true);
    let i2 = Tensor::from_vec(vec![1i64, 1, 0], &[3])?;
    gradcheck(
        |xs| Ok(vec![F::embedding(&i2, &xs[0])?.tanh()?]),
        std::slice::from_ref(&w),
        GradcheckOptions::default(),
    )?;
    gradgradcheck(
        |xs| {
            Ok(vec![
                F::embedding(&i2, &xs[0])?.mul(&F::embedding(&i2, &xs[0])?)?,
            ])
        },
        &[w],
        GradcheckOptions::default(),
    )?;
    assert_eq!(e.call(&idx)?.shape(), &[3, 4]);
    Ok(())
}

/// `logsumexp(x) - x[t]` per row, averaged, in plain f64.
fn reference_ce(x: &[f64], c: usize, t: &[i64]) -> f64 {
    let mut total = 0.0;
    for (i, row) in x.chunks(c).enumerate() {
        let m = row.iter().cloned().fold(f64::MIN, f64::max);
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        total += lse - row[t[i] as usize];
    }
    total / t.len() as f64
}

#[test]
fn cross_entropy_value_and_gradient() -> tp::Result<()> {
    let xv = [1.0, 2.0, 0.5, -1.0, 0.0, 3.0, 2.0, 2.0, 2.0];
    let tv = [1i64, 2, 0];
    let x = t64(&xv, &[3, 3]).requires_grad_(true);
    let t = Tensor::from_vec(tv.to_vec(), &[3])?;
    let loss = nn::CrossEntropyLoss::new().forward(&x, &t)?;
    assert_eq!(loss.shape(), &[] as &[usize]);
    let expected = reference_ce(&xv, 3, &tv);
    assert!(
        (loss.item::<f64>()? - expected).abs() < 1e-14,
        "{} {expected}",
        loss.item::<f64>()?
    );
    // hand check of one row: row 2 is uniform, so its loss is ln 3
    let one = F::cross_entropy(
        &t64(&[2.0, 2.0, 2.0], &[1, 3]),
        &Tensor::from_vec(vec![0i64], &[1])?,
    )?;
    assert!((one.item::<f64>()? - 3f64.ln()).abs() < 1e-15);
    // gradient = (softmax - onehot) / N
    loss.backward()?;
    let g = x.grad().unwrap().to_vec::<f64>()?;
    for (i, row) in xv.chunks(3).enumerate() {
        let z: f64 = row.iter().map(|v| v.exp()).sum();
        for k in 0..3 {
            let want = (row[k].exp() / z - if tv[i] as usize == k { 1.0 } else { 0.0 }) / 3.0;
            assert!((g[i * 3 + k] - want).abs() < 1e-15);
        }
    }
    // numerically stable for huge logits
    let big = F::cross_entropy(
        &t64(&[1000.0, 0.0], &[1, 2]),
        &Tensor::from_vec(vec![1i64], &[1])?,
    )?;
    assert!((big.item::<f64>()? - 1000.0).abs() < 1e-9);
    // float32 works too
    let l32 = F::cross_entropy(&x.to_dtype(DType::F32)?, &t)?;
    assert!((l32.item_f64()? - expected).abs() < 1e-6);
    Ok(())
}

#[test]
fn cross_entropy_gradcheck_and_double_backward() -> tp::Result<()> {
    let x = t64(&[0.3, -1.2, 2.0, 0.7, 0.1, 0.0, -0.5, 1.5], &[2, 4]).requires_grad_(true);
    let t = Tensor::from_vec(vec![3i64, 0], &[2])?;
    gradcheck(
        |xs| Ok(vec![F::cross_entropy(&xs[0], &t)?]),
        std::slice::from_ref(&x),
        GradcheckOptions::default(),
    )?;
    gradgradcheck(
        |xs| Ok(vec![F::cross_entropy(&xs[0], &t)?]),
        std::slice::from_ref(&x),
        GradcheckOptions::default(),
    )?;
    // through a Linear layer: weight, bias and input together
    let w = t64(
        &[
            0.2, -0.3, 0.5, 0.1, 0.0, 0.4, -0.6, 0.9, 0.3, 0.3, -0.1, 0.2,
        ],
        &[3, 4],
    )
    .requires_grad_(true);
    let b = t64(&[0.1, -0.1, 0.05], &[3]).requires_grad_(true);
    let t3 = Tensor::from_vec(vec![2i64, 1], &[2])?;
    gradcheck(
        |xs| {
            Ok(vec![F::cross_entropy(
                &F::linear(&xs[0], &xs[1], Some(&xs[2]))?,
                &t3,
            )?])
        },
        &[x, w, b],
        GradcheckOptions::default(),
    )?;
    Ok(())
}

#[test]
fn cross_entropy_errors() -> tp::Result<()> {
    let x = t64(&[0.0; 6], &[2, 3]);
    let e = F::cross_entropy(&x, &Tensor::from_vec(vec![0i64, 3], &[2])?).unwrap_err();
    assert!(
        matches!(
            e,
            Error::IndexOutOfBounds {
                index: 3,
                size: 3,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("size 3"), "{e}");
    assert!(matches!(
        F::cross_entropy(&x, &Tensor::from_vec(vec![-1i64, 0], &[2])?),
        Err(Error::IndexOutOfBounds { .. })
    ));
    assert!(matches!(
        F::cross_entropy(&x, &Tensor::from_vec(vec![0i64], &[1])?),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        F::cross_entropy(&x, &t64(&[0.0, 1.0], &[2])),
        Err(Error::UnsupportedDType { .. })
    ));
    assert!(matches!(
        F::cross_entropy(&t64(&[0.0; 3], &[3]), &Tensor::from_vec(vec![0i64], &[1])?),
        Err(Error::InvalidArgument { .. })
    ));
    Ok(())
}

#[test]
fn linear_and_mse_gradcheck() -> tp::Result<()> {
    let x = t64(&[0.5, -1.0, 2.0, 0.25, 0.0, 1.5], &[2, 3]).requires_grad_(true);
    let w = t64(&[0.2, -0.3, 0.5, 0.1, 0.7, -0.4], &[2, 3]).requires_grad_(true);
    let b = t64(&[0.1, -0.2], &[2]).requires_grad_(true);
    let target = t64(&[1.0, 0.0, -1.0, 0.5], &[2, 2]);
    gradcheck(
        |xs| Ok(vec![F::linear(&xs[0], &xs[1], Some(&xs[2]))?]),
        &[x.clone(), w.clone(), b.clone()],
        GradcheckOptions::default(),
    )?;
    gradcheck(
        |xs| {
            Ok(vec![nn::MSELoss::new().forward(
                &F::linear(&xs[0], &xs[1], Some(&xs[2]))?,
                &target,
            )?])
        },
        &[x, w, b],
        GradcheckOptions::default(),
    )?;
    // MSE value by hand
    let l = F::mse_loss(&t64(&[1.0, 2.0, 4.0], &[3]), &t64(&[0.0, 2.0, 1.0], &[3]))?;
    assert!((l.item::<f64>()? - 10.0 / 3.0).abs() < 1e-15);
    assert!(matches!(
        F::mse_loss(&t64(&[1.0], &[1]), &t64(&[1.0, 2.0], &[2])),
        Err(Error::ShapeMismatch { .. })
    ));
    Ok(())
}

#[test]
fn forward_hooks_see_and_replace_output() -> tp::Result<()> {
    let mut lin = nn::Linear::from_weights(t64(&[2.0], &[1, 1]), None)?;
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    lin.register_forward_hook(Box::new(move |input, output| {
        c.fetch_add(1, Ordering::SeqCst);
        assert_eq!(input.to_vec::<f64>()?, vec![3.0]);
        assert_eq!(output.to_vec::<f64>()?, vec![6.0]);
        Ok(None)
    }))?;
    lin.register_forward_hook(Box::new(|_, output| Ok(Some(output.add_scalar(1.0)?))))?;
    let x = t64(&[3.0], &[1, 1]);
    assert_eq!(lin.call(&x)?.to_vec::<f64>()?, vec![7.0]);
    assert_eq!(lin.forward(&x)?.to_vec::<f64>()?, vec![6.0]); // forward alone skips hooks
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // hooks of layers inside a Sequential run too, and errors propagate
    let mut seq = nn::Sequential::new().add(lin).add(nn::ReLU::new());
    assert_eq!(seq.call(&x)?.to_vec::<f64>()?, vec![7.0]);
    seq.register_forward_hook(Box::new(|_, _| {
        Err(Error::Custom {
            context: "hook".into(),
            message: "no".into(),
        })
    }))?;
    assert!(matches!(seq.call(&x), Err(Error::Custom { .. })));
    Ok(())
}

#[test]
fn zero_grad_requires_grad_and_devices() -> tp::Result<()> {
    let mut m = mlp()?;
    let loss = m.call(&tp::randn(&[2, 3])?)?.sum()?;
    loss.backward()?;
    assert!(m.parameters().iter().all(|p| p.grad().is_some()));
    m.zero_grad()?;
    assert!(m.parameters().iter().all(|p| p.grad().is_none()));
    m.requires_grad_(false)?;
    assert!(m.parameters().iter().all(|p| !p.requires_grad()));
    m.requires_grad_(true)?;
    // cpu() keeps everything as it is
    let before = m.state_dict()?;
    m.cpu()?;
    assert!(
        m.parameters()
            .iter()
            .all(|p| p.device() == Device::Cpu && p.requires_grad() && p.is_leaf())
    );
    for (k, v) in m.state_dict()? {
        assert_eq!(v.to_vec::<f32>()?, before[&k].to_vec::<f32>()?);
    }
    if !tp::cuda::is_available() {
        let e = m.cuda(0).unwrap_err();
        assert!(matches!(e, Error::CudaUnavailable { .. }), "{e}");
        // nothing moved
        assert!(m.parameters().iter().all(|p| p.device() == Device::Cpu));
    } else {
        m.cuda(0)?;
        assert!(
            m.parameters()
                .iter()
                .all(|p| p.device() == Device::Cuda(0) && p.requires_grad())
        );
        m.to(Device::Cpu)?;
        for (k, v) in m.state_dict()? {
            assert_eq!(v.to_vec::<f32>()?, before[&k].to_vec::<f32>()?);
        }
    }
    Ok(())
}

#[test]
fn boxed_modules_are_object_safe() -> tp::Result<()> {
    let layers: Vec<Box<dyn Module>> = vec![
        Box::new(nn::Linear::new(2, 2, true)?),
        Box::new(nn::Tanh::new()),
        Box::new(nn::Dropout::new(0.1)?),
    ];
    let mut m = nn::Sequential::from_vec(layers);
    m.eval()?;
    let y = m.call(&tp::ones(&[1, 2])?)?;
    assert_eq!(y.shape(), &[1, 2]);
    assert_eq!(m.len(), 3);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// nn::utils: gradient clipping

/// A leaf parameter with `.grad` set to `grad` (float64).
fn param_with_grad(grad: &[f64], shape: &[usize]) -> Tensor {
    let p = tp::zeros(shape).unwrap().to_dtype(DType::F64).unwrap();
    let p = p.requires_grad_(true);
    p.set_grad(Some(t64(grad, shape)));
    p
}

fn grad_f64(p: &Tensor) -> Vec<f64> {
    p.grad().unwrap().to_vec_f64().unwrap()
}

#[test]
fn clip_grad_norm_values_for_each_norm_type() -> tp::Result<()> {
    // grads [3, 4] and [[1, -2], [2, 0]]: 2-norm sqrt(34), 1-norm 12, inf-norm 4, 3-norm 108^(1/3)
    let cases = [
        (2.0, 34f64.sqrt()),
        (1.0, 12.0),
        (f64::INFINITY, 4.0),
        (3.0, 108f64.powf(1.0 / 3.0)),
    ];
    for (norm_type, expected) in cases {
        let a = param_with_grad(&[3.0, 4.0], &[2]);
        let b = param_with_grad(&[1.0, -2.0, 2.0, 0.0], &[2, 2]);
        let no_grad = tp::zeros(&[3])?.requires_grad_(true);
        let params = [a.clone(), no_grad.clone(), b.clone()];
        let total = nn::utils::clip_grad_norm_(&params, 1.0, norm_type, false)?;
        assert!((total - expected).abs() < 1e-12, "{norm_type}: {total}");
        let coef = 1.0 / (expected + 1e-6);
        close(&grad_f64(&a), &[3.0 * coef, 4.0 * coef], 1e-12);
        close(&grad_f64(&b), &[coef, -2.0 * coef, 2.0 * coef, 0.0], 1e-12);
        // the parameter without a grad is skipped
        assert!(no_grad.grad().is_none());
        // the clipped grads have (about) max_norm as their norm
        let after = nn::utils::clip_grad_norm_(&params, f64::INFINITY, norm_type, false)?;
        assert!((after - 1.0).abs() < 1e-6, "{norm_type}: {after}");
        // shape and dtype are kept
        assert_eq!(b.grad().unwrap().shape(), &[2, 2]);
        assert_eq!(b.grad().unwrap().dtype(), DType::F64);
    }
    Ok(())
}

#[test]
fn clip_grad_norm_leaves_small_grads_alone() -> tp::Result<()> {
    let a = param_with_grad(&[0.3, -0.4], &[2]);
    let before = a.grad().unwrap();
    let total = nn::utils::clip_grad_norm_(std::slice::from_ref(&a), 1.0, 2.0, false)?;
    assert!((total - 0.5).abs() < 1e-15);
    assert_eq!(grad_f64(&a), vec![0.3, -0.4]);
    assert_eq!(a.grad().unwrap().id(), before.id(), "not even replaced");
    // exactly at the max: coef = 0.5 / (0.5 + 1e-6) < 1, scaled a hair
    let total = nn::utils::clip_grad_norm_(std::slice::from_ref(&a), 0.5, 2.0, false)?;
    assert!((total - 0.5).abs() < 1e-15);
    let c = 0.5 / (0.5 + 1e-6);
    close(&grad_f64(&a), &[0.3 * c, -0.4 * c], 1e-15);
    // no grads at all: total norm 0, nothing happens
    let bare = tp::zeros(&[2])?.requires_grad_(true);
    assert_eq!(
        nn::utils::clip_grad_norm_(std::slice::from_ref(&bare), 1.0, 2.0, false)?,
        0.0
    );
    assert_eq!(nn::utils::clip_grad_norm_(&[], 1.0, 2.0, false)?, 0.0);
    assert!(bare.grad().is_none());
    // max_norm = 0 zeroes the grads
    let z = param_with_grad(&[1.0, 2.0], &[2]);
    nn::utils::clip_grad_norm_(std::slice::from_ref(&z), 0.0, 2.0, false)?;
    assert_eq!(grad_f64(&z), vec![0.0, 0.0]);
    Ok(())
}

#[test]
fn clip_grad_norm_after_backward_on_a_model_f32() -> tp::Result<()> {
    tp::manual_seed(3);
    let model = mlp()?;
    let loss = model.call(&tp::randn(&[8, 3])?)?.mul_scalar(100.0)?.sum()?;
    loss.backward()?;
    let params = model.parameters();
    let grads: Vec<Vec<f64>> = params.iter().map(grad_f64).collect();
    let expected = grads.iter().flatten().map(|g| g * g).sum::<f64>().sqrt();
    assert!(expected > 1.0, "{expected}");
    let total = nn::utils::clip_grad_norm_(&model.parameters(), 1.0, 2.0, false)?;
    assert!(
        (total - expected).abs() <= 1e-9 * expected,
        "{total} vs {expected}"
    );
    let coef = 1.0 / (expected + 1e-6);
    for (p, g) in params.iter().zip(&grads) {
        assert_eq!(p.grad().unwrap().dtype(), DType::F32);
        let want: Vec<f64> = g.iter().map(|x| x * coef).collect();
        close(&grad_f64(p), &want, 1e-6);
    }
    let after = nn::utils::clip_grad_norm_(&params, f64::INFINITY, 2.0, false)?;
    assert!((after - 1.0).abs() < 1e-5, "{after}");
    // an optimizer step uses the clipped grads
    let w = params[0].to_vec_f64()?;
    let mut opt = tp::optim::SGD::new(
        params.clone(),
        tp::optim::SgdOptions {
            lr: 1.0,
            ..Default::default()
        },
    )?;
    tp::optim::Optimizer::step(&mut opt)?;
    let moved: f64 = params[0]
        .to_vec_f64()?
        .iter()
        .zip(&w)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f64>()
        .sqrt();
    assert!(moved <= 1.0 + 1e-5, "{moved}");
    Ok(())
}

#[test]
fn clip_grad_scales_grads_that_share_storage_once() -> tp::Result<()> {
    // the gradients of `a + b` reach both leaves as one tensor, so `a.grad` and `b.grad`
    // share storage (with the gradient passed to backward, even); each is clipped exactly
    // once and the tensor given to backward is left alone
    let a = t64(&[1.0, 2.0], &[2]).requires_grad_(true);
    let b = t64(&[5.0, 6.0], &[2]).requires_grad_(true);
    a.add(&b)?.mul_scalar(3.0)?.sum()?.backward()?;
    assert_eq!(grad_f64(&a), vec![3.0, 3.0]);
    assert_eq!(grad_f64(&b), vec![3.0, 3.0]);
    let total = nn::utils::clip_grad_norm_(&[a.clone(), b.clone()], 3.0, 2.0, false)?;
    assert!((total - 6.0).abs() < 1e-12);
    let c = 3.0 * (3.0 / (6.0 + 1e-6));
    close(&grad_f64(&a), &[c, c], 1e-12);
    close(&grad_f64(&b), &[c, c], 1e-12);
    nn::utils::clip_grad_value_(&[a.clone(), b.clone()], 1.0)?;
    assert_eq!(grad_f64(&a), vec![1.0, 1.0]);
    assert_eq!(grad_f64(&b), vec![1.0, 1.0]);
    let upstream = t64(&[2.0, -2.0], &[2]);
    let x = t64(&[1.0, 2.0], &[2]).requires_grad_(true);
    let y = t64(&[3.0, 4.0], &[2]).requires_grad_(true);
    x.add(&y)?.backward_with(Some(&upstream), false, false)?;
    let total = nn::utils::clip_grad_norm_(&[x.clone(), y.clone()], 2.0, 2.0, false)?;
    assert!((total - 4.0).abs() < 1e-12);
    let c = 2.0 * (2.0 / (4.0 + 1e-6));
    close(&grad_f64(&x), &[c, -c], 1e-12);
    close(&grad_f64(&y), &[c, -c], 1e-12);
    assert_eq!(upstream.to_vec::<f64>()?, vec![2.0, -2.0]);
    // the gradient of a sum reaches the leaf as a broadcast scalar
    let s = t64(&[1.0, 2.0, 3.0, 4.0], &[2, 2]).requires_grad_(true);
    s.sum()?.mul_scalar(2.0)?.backward()?;
    let total = nn::utils::clip_grad_norm_(std::slice::from_ref(&s), 1.0, 1.0, false)?;
    assert!((total - 8.0).abs() < 1e-12);
    let c = 2.0 / (8.0 + 1e-6);
    close(&grad_f64(&s), &[c; 4], 1e-12);
    nn::utils::clip_grad_value_(std::slice::from_ref(&s), 0.1)?;
    close(&grad_f64(&s), &[0.1; 4], 1e-15);
    Ok(())
}

#[test]
fn clip_grad_norm_overflow_underflow_and_nonfinite() -> tp::Result<()> {
    // |g|^2 overflows and underflows float64; the norm does not
    let big = param_with_grad(&[3e200, 4e200], &[2]);
    let total = nn::utils::clip_grad_norm_(std::slice::from_ref(&big), f64::INFINITY, 2.0, false)?;
    assert!((total / 5e200 - 1.0).abs() < 1e-12, "{total}");
    let tiny = param_with_grad(&[3e-200, 4e-200], &[2]);
    let total = nn::utils::clip_grad_norm_(std::slice::from_ref(&tiny), f64::INFINITY, 2.0, false)?;
    assert!((total / 5e-200 - 1.0).abs() < 1e-12, "{total}");
    // NaN: returned, grads untouched (or an error with error_if_nonfinite)
    let n = param_with_grad(&[f64::NAN, 1.0], &[2]);
    for norm_type in [1.0, 2.0, f64::INFINITY] {
        let total = nn::utils::clip_grad_norm_(std::slice::from_ref(&n), 1.0, norm_type, false)?;
        assert!(total.is_nan());
        let e =
            nn::utils::clip_grad_norm_(std::slice::from_ref(&n), 1.0, norm_type, true).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    arg: "parameters",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("error_if_nonfinite"), "{e}");
    }
    let g = grad_f64(&n);
    assert!(g[0].is_nan() && g[1] == 1.0);
    // inf: an error with error_if_nonfinite, grads untouched
    let i = param_with_grad(&[f64::INFINITY, 1.0], &[2]);
    let e = nn::utils::clip_grad_norm_(std::slice::from_ref(&i), 1.0, 2.0, true).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    assert!(e.to_string().contains("inf"), "{e}");
    assert_eq!(grad_f64(&i), vec![f64::INFINITY, 1.0]);
    // without it: the norm is inf and the grads are multiplied by 0
    let total = nn::utils::clip_grad_norm_(std::slice::from_ref(&i), 1.0, 2.0, false)?;
    assert_eq!(total, f64::INFINITY);
    let g = grad_f64(&i);
    assert!(g[0].is_nan() && g[1] == 0.0, "{g:?}");
    Ok(())
}

#[test]
fn clip_grad_errors_name_the_argument() -> tp::Result<()> {
    let a = param_with_grad(&[3.0, 4.0], &[2]);
    let params = [a.clone()];
    let arg_of = |r: tp::Result<f64>| match r {
        Err(Error::InvalidArgument { arg, .. }) => arg,
        other => panic!("{other:?}"),
    };
    for bad in [-1.0, f64::NAN, f64::NEG_INFINITY] {
        assert_eq!(
            arg_of(nn::utils::clip_grad_norm_(&params, bad, 2.0, false)),
            "max_norm"
        );
    }
    for bad in [0.0, -1.0, -0.0, f64::NAN, f64::NEG_INFINITY] {
        assert_eq!(
            arg_of(nn::utils::clip_grad_norm_(&params, 1.0, bad, false)),
            "norm_type"
        );
    }
    for bad in [-1e-3, f64::NAN, f64::NEG_INFINITY] {
        let e = nn::utils::clip_grad_value_(&params, bad).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    arg: "clip_value",
                    ..
                }
            ),
            "{e}"
        );
    }
    assert_eq!(grad_f64(&a), vec![3.0, 4.0], "nothing changed");
    // a non-float grad, after a float one: an error, and nothing changes
    let ints = tp::zeros(&[2])?;
    ints.set_grad(Some(Tensor::from_vec(vec![5i64, 6], &[2])?));
    let mixed = [a.clone(), ints.clone()];
    let e = nn::utils::clip_grad_norm_(&mixed, 1.0, 2.0, false).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                arg: "parameters",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("int64"), "{e}");
    let e = nn::utils::clip_grad_value_(&mixed, 1.0).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                arg: "parameters",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(grad_f64(&a), vec![3.0, 4.0]);
    assert_eq!(ints.grad().unwrap().to_vec::<i64>()?, vec![5, 6]);
    Ok(())
}

#[test]
fn clip_grad_value_clamps_f32_and_f64() -> tp::Result<()> {
    let a = param_with_grad(&[-3.0, -0.5, 0.0, 0.5, 3.0, f64::NAN], &[2, 3]);
    let b = tp::zeros(&[3])?.requires_grad_(true);
    b.set_grad(Some(Tensor::from_vec(vec![1.5f32, -0.25, -7.0], &[3])?));
    let c = tp::zeros(&[1])?.requires_grad_(true);
    nn::utils::clip_grad_value_(&[a.clone(), b.clone(), c.clone()], 1.0)?;
    let g = grad_f64(&a);
    assert_eq!(&g[..5], &[-1.0, -0.5, 0.0, 0.5, 1.0]);
    assert!(g[5].is_nan(), "NaN stays NaN");
    assert_eq!(a.grad().unwrap().shape(), &[2, 3]);
    assert_eq!(b.grad().unwrap().dtype(), DType::F32);
    assert_eq!(b.grad().unwrap().to_vec::<f32>()?, vec![1.0, -0.25, -1.0]);
    assert!(c.grad().is_none(), "skipped");
    // 0 zeroes, infinity changes nothing
    nn::utils::clip_grad_value_(std::slice::from_ref(&b), f64::INFINITY)?;
    assert_eq!(b.grad().unwrap().to_vec::<f32>()?, vec![1.0, -0.25, -1.0]);
    nn::utils::clip_grad_value_(std::slice::from_ref(&b), 0.0)?;
    assert_eq!(b.grad().unwrap().to_vec::<f32>()?, vec![0.0, 0.0, 0.0]);
    // no history is recorded, even for a grad that requires grad (create_graph)
    let p = tp::zeros(&[2])?.requires_grad_(true);
    p.set_grad(Some(tp::ones(&[2])?.mul_scalar(5.0)?.requires_grad_(true)));
    nn::utils::clip_grad_value_(std::slice::from_ref(&p), 2.0)?;
    let g = p.grad().unwrap();
    assert!(!g.requires_grad() && g.is_leaf());
    assert_eq!(g.to_vec::<f32>()?, vec![2.0, 2.0]);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Sigmoid and GELU

#[test]
fn sigmoid_and_gelu_values_and_gradients() -> tp::Result<()> {
    let xs = [-2.0, -0.5, 0.0, 0.5, 1.0, 3.0];
    let x = t64(&xs, &[2, 3]);
    let sig = nn::Sigmoid::new();
    let gelu = nn::GELU::new();
    let y = sig.call(&x)?;
    assert_eq!(y.shape(), &[2, 3]);
    let want: Vec<f64> = xs.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect();
    close(&y.to_vec::<f64>()?, &want, 1e-15);
    // x * Phi(x), values from Python's math.erf
    close(
        &gelu.call(&x)?.to_vec::<f64>()?,
        &[
            -0.04550026389635842,
            -0.15426876936299344,
            0.0,
            0.34573123063700656,
            0.8413447460685429,
            2.99595030590511,
        ],
        1e-14,
    );
    // float32 in, float32 out
    let x32 = Tensor::from_vec(vec![0.0f32, 1.0], &[2])?;
    assert_eq!(sig.call(&x32)?.dtype(), DType::F32);
    assert_eq!(gelu.call(&x32)?.to_vec::<f32>()?[0], 0.0);
    // integer input is an error, not a panic
    let ints = Tensor::from_vec(vec![1i64, 2], &[2])?;
    assert!(matches!(
        sig.call(&ints),
        Err(Error::UnsupportedDType { .. })
    ));
    assert!(matches!(
        gelu.call(&ints),
        Err(Error::UnsupportedDType { .. })
    ));
    // gradients: sigmoid'(0) = 1/4, gelu'(0) = 1/2, gelu'(1) = Phi(1) + phi(1)
    let z = t64(&[0.0, 1.0], &[2]).requires_grad_(true);
    sig.call(&z)?.sum()?.backward()?;
    let s1 = 1.0 / (1.0 + (-1.0f64).exp());
    close(&grad_f64(&z), &[0.25, s1 * (1.0 - s1)], 1e-15);
    z.set_grad(None);
    gelu.call(&z)?.sum()?.backward()?;
    let phi1 = (-0.5f64).exp() / (2.0 * std::f64::consts::PI).sqrt();
    close(&grad_f64(&z), &[0.5, 0.8413447460685429 + phi1], 1e-12);
    // against finite differences
    let x = t64(&xs, &[2, 3]).requires_grad_(true);
    gradcheck(
        |v| Ok(vec![sig.call(&v[0])?]),
        std::slice::from_ref(&x),
        GradcheckOptions::default(),
    )?;
    gradcheck(
        |v| Ok(vec![gelu.call(&v[0])?]),
        std::slice::from_ref(&x),
        GradcheckOptions::default(),
    )?;
    // inside a model
    let m = nn::Sequential::new()
        .add(nn::Linear::new(3, 2, true)?)
        .add(nn::GELU::new())
        .add(nn::Sigmoid::new());
    let out = m.call(&tp::randn(&[4, 3])?)?;
    assert_eq!(out.shape(), &[4, 2]);
    assert!(out.to_vec_f64()?.iter().all(|&v| v > 0.0 && v < 1.0));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Module::to with a device string

#[test]
fn module_to_accepts_strings_and_devices() -> tp::Result<()> {
    let mut lin = nn::Linear::new(2, 3, true)?;
    let before = lin.state_dict()?;
    lin.to("cpu")?;
    lin.to(Device::Cpu)?;
    lin.to(String::from("cpu"))?;
    let name = String::from(" cpu ");
    lin.to(&name)?;
    lin.to(name)?;
    assert!(lin.parameters().iter().all(|p| p.device() == Device::Cpu));
    for (k, v) in lin.state_dict()? {
        assert_eq!(v.to_vec::<f32>()?, before[&k].to_vec::<f32>()?);
    }
    // a bad string: InvalidDevice, and nothing moves
    let e = lin.to("bogus").unwrap_err();
    assert!(
        matches!(&e, Error::InvalidDevice { input } if input == "bogus"),
        "{e}"
    );
    assert!(matches!(lin.to("cuda:x"), Err(Error::InvalidDevice { .. })));
    // trait objects: a Box<dyn Module> and a &mut dyn Module
    let mut boxed: Box<dyn Module> = Box::new(nn::Linear::new(2, 2, false)?);
    boxed.to("cpu")?;
    boxed.to(Device::Cpu)?;
    assert!(matches!(boxed.to("tpu"), Err(Error::InvalidDevice { .. })));
    let mut seq = mlp()?;
    seq.to("cpu")?;
    // a bare `&mut dyn Module` takes a Device through to_device
    let first: &mut dyn Module = seq.get_mut(0).unwrap();
    first.to_device(Device::Cpu)?;
    first.to_device("cpu".parse()?)?;
    // a box of a module is a module: it can be added to a Sequential and moved
    let mut nested = nn::Sequential::new().add(boxed);
    nested.to("cpu")?;
    assert_eq!(nested.parameters().len(), 1);
    if !tp::cuda::is_available() {
        for mut m in [
            Box::new(nn::Linear::new(2, 2, true)?) as Box<dyn Module>,
            Box::new(mlp()?),
        ] {
            let e = m.to("cuda").unwrap_err();
            assert!(matches!(e, Error::CudaUnavailable { .. }), "{e}");
            assert!(m.parameters().iter().all(|p| p.device() == Device::Cpu));
        }
        let e = lin.to("cuda:0").unwrap_err();
        assert!(matches!(e, Error::CudaUnavailable { .. }), "{e}");
    } else {
        lin.to("cuda")?;
        assert!(
            lin.parameters()
                .iter()
                .all(|p| p.device() == Device::Cuda(0))
        );
        nested.to("cuda:0")?;
        assert!(
            nested
                .parameters()
                .iter()
                .all(|p| p.device() == Device::Cuda(0))
        );
        lin.to("cpu")?;
        for (k, v) in lin.state_dict()? {
            assert_eq!(v.to_vec::<f32>()?, before[&k].to_vec::<f32>()?);
        }
    }
    Ok(())
}

/// A module that records the devices it is asked to move to.
#[derive(Module)]
struct Recorder {
    core: nn::ModuleCore,
    #[module(skip)]
    seen: Arc<std::sync::Mutex<Vec<Device>>>,
}

impl Module for Recorder {
    fn forward(&self, input: &Tensor) -> tp::Result<Tensor> {
        Ok(input.clone())
    }
    fn to_device(&mut self, device: Device) -> tp::Result<()> {
        self.seen.lock().unwrap().push(device);
        if device == Device::Cuda(7) {
            return Err(Error::NotSupported {
                op: "to",
                detail: "here: not there".into(),
            });
        }
        Ok(())
    }
}

#[test]
fn module_to_cpu_and_cuda_go_through_to_device() -> tp::Result<()> {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut r = Recorder {
        core: nn::ModuleCore::new(),
        seen: seen.clone(),
    };
    r.to("cuda:2")?;
    r.to(Device::Cpu)?;
    r.cpu()?;
    r.cuda(1)?;
    assert!(matches!(r.to("nope"), Err(Error::InvalidDevice { .. })));
    assert_eq!(
        *seen.lock().unwrap(),
        [Device::Cuda(2), Device::Cpu, Device::Cpu, Device::Cuda(1)]
    );
    // through a Box<dyn Module> the override is still used
    let mut boxed: Box<dyn Module> = Box::new(r);
    boxed.to("cuda")?;
    boxed.cpu()?;
    assert!(matches!(
        boxed.to("cuda:7"),
        Err(Error::NotSupported { op: "to", .. })
    ));
    assert_eq!(
        seen.lock().unwrap()[4..],
        [Device::Cuda(0), Device::Cpu, Device::Cuda(7)]
    );
    Ok(())
}

/// One change a hook makes to the tensor it sees.
#[derive(Debug, Clone, Copy)]
enum Op {
    Scale(f64),
    Add(f64),
    Keep,
}

impl Op {
    fn run(self, t: &Tensor) -> tp::Result<Option<Tensor>> {
        Ok(match self {
            Op::Scale(s) => Some(t.mul_scalar(s)?),
            Op::Add(a) => Some(t.add_scalar(a)?),
            Op::Keep => None,
        })
    }
}

/// Hooks on `y = 2x` called with `x = 3`: pre-hooks and post-hooks in registration order (pre
/// first), the handles of `remove` (indices in registration order) removed before the call.
struct HookCase {
    name: &'static str,
    pre: &'static [Op],
    post: &'static [Op],
    remove: &'static [usize],
    want: f64,
}

fn check_hooks(case: &HookCase) -> tp::Result<()> {
    let mut lin = nn::Linear::from_weights(t64(&[2.0], &[1, 1]), None)?;
    let mut handles = Vec::new();
    for &op in case.pre {
        handles.push(lin.register_forward_pre_hook(Box::new(move |x| op.run(x)))?);
    }
    for &op in case.post {
        handles.push(lin.register_forward_hook(Box::new(move |_, y| op.run(y)))?);
    }
    for &i in case.remove {
        handles[i].remove();
    }
    let got = lin.call(&t64(&[3.0], &[1, 1]))?.to_vec::<f64>()?;
    assert_eq!(got, [case.want], "case {}", case.name);
    // forward alone runs no hook
    let plain = lin.forward(&t64(&[3.0], &[1, 1]))?.to_vec::<f64>()?;
    assert_eq!(plain, [6.0], "case {}: forward", case.name);
    Ok(())
}

#[test]
fn forward_pre_and_post_hooks_in_order_and_removed() -> tp::Result<()> {
    use Op::*;
    let cases = [
        HookCase {
            name: "no hooks",
            pre: &[],
            post: &[],
            remove: &[],
            want: 6.0,
        },
        HookCase {
            name: "a pre-hook scales the input",
            pre: &[Scale(10.0)],
            post: &[],
            remove: &[],
            want: 60.0,
        },
        HookCase {
            name: "pre-hooks chain in registration order (scale, then add)",
            pre: &[Scale(10.0), Add(1.0)],
            post: &[],
            remove: &[],
            want: 62.0,
        },
        HookCase {
            name: "pre-hooks chain in registration order (add, then scale)",
            pre: &[Add(1.0), Scale(10.0)],
            post: &[],
            remove: &[],
            want: 80.0,
        },
        HookCase {
            name: "a pre-hook returning None keeps the input",
            pre: &[Keep, Add(1.0), Keep],
            post: &[],
            remove: &[],
            want: 8.0,
        },
        HookCase {
            name: "post-hooks chain in registration order",
            pre: &[],
            post: &[Scale(10.0), Add(1.0)],
            remove: &[],
            want: 61.0,
        },
        HookCase {
            name: "pre then forward then post",
            pre: &[Add(1.0)],
            post: &[Scale(10.0)],
            remove: &[],
            want: 80.0,
        },
        HookCase {
            name: "removing the pre-hook restores the output",
            pre: &[Scale(10.0)],
            post: &[],
            remove: &[0],
            want: 6.0,
        },
        HookCase {
            name: "removing one of several keeps the others in order",
            pre: &[Add(1.0), Scale(10.0)],
            post: &[Add(1.0), Scale(10.0)],
            remove: &[1, 2],
            want: 80.0,
        },
        HookCase {
            name: "removing twice is harmless",
            pre: &[Add(1.0)],
            post: &[Add(1.0)],
            remove: &[1, 1],
            want: 8.0,
        },
    ];
    for case in &cases {
        check_hooks(case)?;
    }
    Ok(())
}

#[test]
fn forward_hooks_see_the_replaced_input_and_errors_stop_the_call() -> tp::Result<()> {
    let mut lin = nn::Linear::from_weights(t64(&[2.0], &[1, 1]), None)?;
    lin.register_forward_pre_hook(Box::new(|x| Ok(Some(x.mul_scalar(10.0)?))))?;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = seen.clone();
    lin.register_forward_hook(Box::new(move |x, y| {
        s.lock()
            .unwrap()
            .push((x.to_vec::<f64>()?, y.to_vec::<f64>()?));
        Ok(None)
    }))?;
    assert_eq!(lin.call(&t64(&[3.0], &[1, 1]))?.to_vec::<f64>()?, [60.0]);
    assert_eq!(*seen.lock().unwrap(), [(vec![30.0], vec![60.0])]);
    // a failing pre-hook: neither forward nor the post-hook runs
    let failing = lin.register_forward_pre_hook(Box::new(|_| {
        Err(Error::Custom {
            context: "pre-hook".into(),
            message: "no".into(),
        })
    }))?;
    assert!(matches!(
        lin.call(&t64(&[3.0], &[1, 1])),
        Err(Error::Custom { .. })
    ));
    assert_eq!(seen.lock().unwrap().len(), 1);
    failing.remove();
    assert_eq!(lin.core().hook_counts(), (1, 1));
    // a handle outliving its module does nothing
    let h = lin.register_forward_hook(Box::new(|_, _| Ok(None)))?;
    drop(lin);
    h.remove();
    Ok(())
}

/// A derived module with every kind of field.
#[derive(Module)]
struct Everything {
    scale: Tensor,
    shift: Option<Tensor>,
    absent: Option<Tensor>,
    #[module(buffer)]
    steps: Tensor,
    #[module(skip)]
    cache: Tensor,
    first: nn::Linear,
    extra: Option<nn::Linear>,
    missing: Option<nn::Linear>,
    blocks: nn::ModuleList<nn::Linear>,
    width: usize,
    shape: Vec<usize>,
    core: nn::ModuleCore,
}

impl Module for Everything {
    fn forward(&self, x: &Tensor) -> tp::Result<Tensor> {
        self.first.call(x)?.mul(&self.scale)
    }
}

fn everything() -> tp::Result<Everything> {
    let mut blocks = nn::ModuleList::new();
    blocks.push(nn::Linear::new(2, 2, false)?);
    blocks.push(nn::Linear::new(2, 2, true)?);
    Ok(Everything {
        scale: t64(&[1.0, 2.0], &[2]).requires_grad_(true),
        shift: Some(t64(&[0.5], &[1]).requires_grad_(true)),
        absent: None,
        steps: t64(&[0.0], &[1]),
        cache: t64(&[9.0], &[1]),
        first: nn::Linear::from_weights(t64(&[1.0, 0.0, 0.0, 1.0], &[2, 2]), None)?,
        extra: Some(nn::Linear::new(2, 2, true)?),
        missing: None,
        blocks,
        width: 2,
        shape: vec![2],
        core: nn::ModuleCore::new(),
    })
}

#[test]
fn derived_module_names_buffers_children_and_state() -> tp::Result<()> {
    let mut m = everything()?;
    let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "scale",
            "shift",
            "first.weight",
            "extra.weight",
            "extra.bias",
            "blocks.0.weight",
            "blocks.1.weight",
            "blocks.1.bias",
        ]
    );
    let buffers: Vec<String> = m.named_buffers().into_iter().map(|(n, _)| n).collect();
    assert_eq!(buffers, ["steps"]);
    let kids: Vec<String> = m.named_children().into_iter().map(|(n, _)| n).collect();
    assert_eq!(kids, ["first", "extra", "blocks"]);
    assert_eq!(m.state_dict()?.len(), 9);
    assert_eq!(m.width + m.shape[0], 4);
    assert_eq!(m.cache.to_vec::<f64>()?, [9.0]);
    let y = m.call(&t64(&[3.0, 4.0], &[1, 2]))?;
    assert_eq!(y.to_vec::<f64>()?, [3.0, 8.0]);
    // train/eval reach every child, the optional one and the list's items
    m.eval()?;
    let modes: Vec<bool> = m.modules().iter().map(|c| c.is_training()).collect();
    assert_eq!(modes, [false; 6]);
    // to() replaces every parameter and buffer slot, optional ones included
    m.to("cpu")?;
    assert_eq!(m.named_parameters().len(), 8);
    assert_eq!(m.state_dict()?["shift"].to_vec::<f64>()?, [0.5]);
    Ok(())
}

#[test]
fn module_visitors_walk_the_tree_in_order() -> tp::Result<()> {
    let mut m = everything()?;
    let names: Vec<String> = m.named_modules().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        ["", "first", "extra", "blocks", "blocks.0", "blocks.1"]
    );
    let counts: Vec<usize> = m.children().iter().map(|c| c.parameters().len()).collect();
    assert_eq!(counts, [1, 2, 3]);
    // apply: children first (post-order), as PyTorch's module.apply
    let mut seen = Vec::new();
    m.apply(&mut |c| {
        seen.push(c.named_parameters().len());
        Ok(())
    })?;
    assert_eq!(seen, [1, 2, 1, 2, 3, 8]);
    // the mutable visitor rewrites parameters in place: every weight becomes a tensor of 7s
    let mut visited = Vec::new();
    m.named_modules_mut(&mut |name, c| {
        visited.push(name.to_string());
        for (pname, slot) in c.local_parameters_mut() {
            if pname == "weight" {
                *slot = slot.ones_like()?.mul_scalar(7.0)?;
            }
        }
        Ok(())
    })?;
    assert_eq!(
        visited,
        ["", "first", "extra", "blocks", "blocks.0", "blocks.1"]
    );
    for (n, p) in m.named_parameters() {
        if n.ends_with("weight") {
            assert!(p.to_vec_f64()?.iter().all(|&v| v == 7.0), "{n}");
        }
    }
    // modules_mut visits the same modules; an error stops the walk
    let mut count = 0;
    let r = m.modules_mut(&mut |_| {
        count += 1;
        if count == 3 {
            return Err(Error::Custom {
                context: "visitor".into(),
                message: "stop".into(),
            });
        }
        Ok(())
    });
    assert!(matches!(r, Err(Error::Custom { .. })));
    assert_eq!(count, 3);
    Ok(())
}
