//! `nn`: layers, module machinery (names, state_dict, train/eval, hooks, devices) and losses,
//! checked against hand-computed values and finite differences.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tensorplay_core::autograd::{GradcheckOptions, gradcheck, gradgradcheck};
use tensorplay_core::nn::{self, Module, functional as F};
use tensorplay_core::{self as tp, DType, Device, Error, Tensor};

fn t64(v: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape).unwrap()
}

fn close(a: &[f64], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= tol, "{a:?} vs {b:?}");
    }
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
