//! Optimizers against independent f64 reference implementations of PyTorch's recurrences on a
//! small quadratic, and their error cases.

use tensorplay_core::optim::{Adam, AdamOptions, AdamW, AdamWOptions, Optimizer, SGD, SgdOptions};
use tensorplay_core::{self as tp, DType, Error, Tensor};

const W0: [f64; 3] = [1.0, -2.0, 0.5];
const C: [f64; 3] = [0.5, 1.5, 3.0];
const STEPS: usize = 6;

/// loss = sum(c * w^2), so grad = 2 c w.
fn loss(w: &Tensor) -> tp::Result<Tensor> {
    let c = Tensor::from_slice(&C, &[3])?;
    c.mul(&w.mul(w)?)?.sum()
}

fn grad_ref(w: &[f64]) -> Vec<f64> {
    w.iter().zip(&C).map(|(w, c)| 2.0 * c * w).collect()
}

fn run(opt: &mut dyn Optimizer, w: &Tensor) -> tp::Result<Vec<f64>> {
    for _ in 0..STEPS {
        opt.zero_grad()?;
        loss(w)?.backward()?;
        opt.step()?;
    }
    w.to_vec::<f64>()
}

fn assert_close(a: &[f64], b: &[f64]) {
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-12, "{a:?} vs {b:?}");
    }
}

fn sgd_ref(lr: f64, momentum: f64, dampening: f64, wd: f64, nesterov: bool) -> Vec<f64> {
    let mut w = W0.to_vec();
    let mut buf: Option<Vec<f64>> = None;
    for _ in 0..STEPS {
        let g = grad_ref(&w);
        let mut d: Vec<f64> = g.iter().zip(&w).map(|(g, w)| g + wd * w).collect();
        if momentum != 0.0 {
            let b = match buf.take() {
                None => d.clone(),
                Some(b) => b
                    .iter()
                    .zip(&d)
                    .map(|(b, d)| momentum * b + (1.0 - dampening) * d)
                    .collect(),
            };
            d = if nesterov {
                d.iter().zip(&b).map(|(d, b)| d + momentum * b).collect()
            } else {
                b.clone()
            };
            buf = Some(b);
        }
        for (w, d) in w.iter_mut().zip(&d) {
            *w -= lr * d;
        }
    }
    w
}

#[allow(clippy::too_many_arguments)]
fn adam_ref(
    lr: f64,
    b1: f64,
    b2: f64,
    eps: f64,
    wd: f64,
    amsgrad: bool,
    decoupled: bool,
) -> Vec<f64> {
    let mut w = W0.to_vec();
    let (mut m, mut v, mut vmax) = (vec![0.0; 3], vec![0.0; 3], vec![0.0f64; 3]);
    for t in 1..=STEPS {
        let mut g = grad_ref(&w);
        for j in 0..3 {
            if decoupled {
                w[j] *= 1.0 - lr * wd;
            } else {
                g[j] += wd * w[j];
            }
            m[j] = b1 * m[j] + (1.0 - b1) * g[j];
            v[j] = b2 * v[j] + (1.0 - b2) * g[j] * g[j];
            vmax[j] = vmax[j].max(v[j]);
            let bc1 = 1.0 - b1.powi(t as i32);
            let bc2 = 1.0 - b2.powi(t as i32);
            let vv = if amsgrad { vmax[j] } else { v[j] };
            let denom = vv.sqrt() / bc2.sqrt() + eps;
            w[j] -= lr / bc1 * m[j] / denom;
        }
    }
    w
}

fn param() -> Tensor {
    Tensor::from_slice(&W0, &[3]).unwrap().requires_grad_(true)
}

#[test]
fn sgd_variants_match_reference() -> tp::Result<()> {
    let cases = [
        (0.1, 0.0, 0.0, 0.0, false),
        (0.05, 0.9, 0.0, 0.0, false),
        (0.05, 0.9, 0.3, 0.0, false),
        (0.05, 0.9, 0.0, 0.0, true),
        (0.1, 0.0, 0.0, 0.1, false),
        (0.05, 0.8, 0.1, 0.05, false),
        (0.05, 0.8, 0.0, 0.05, true),
    ];
    for (lr, momentum, dampening, weight_decay, nesterov) in cases {
        let w = param();
        let mut opt = SGD::new(
            vec![w.clone()],
            SgdOptions {
                lr,
                momentum,
                dampening,
                weight_decay,
                nesterov,
            },
        )?;
        let got = run(&mut opt, &w)?;
        assert_close(
            &got,
            &sgd_ref(lr, momentum, dampening, weight_decay, nesterov),
        );
        assert!(w.is_leaf() && w.requires_grad());
    }
    Ok(())
}

#[test]
fn adam_and_adamw_match_reference() -> tp::Result<()> {
    for (wd, amsgrad) in [(0.0, false), (0.1, false), (0.0, true), (0.2, true)] {
        let w = param();
        let o = AdamOptions {
            lr: 0.05,
            betas: (0.8, 0.9),
            eps: 1e-6,
            weight_decay: wd,
            amsgrad,
        };
        let got = run(&mut Adam::new(vec![w.clone()], o)?, &w)?;
        assert_close(&got, &adam_ref(0.05, 0.8, 0.9, 1e-6, wd, amsgrad, false));

        let w = param();
        let o = AdamWOptions {
            lr: 0.05,
            betas: (0.8, 0.9),
            eps: 1e-6,
            weight_decay: wd,
            amsgrad,
        };
        let got = run(&mut AdamW::new(vec![w.clone()], o)?, &w)?;
        assert_close(&got, &adam_ref(0.05, 0.8, 0.9, 1e-6, wd, amsgrad, true));
    }
    // defaults are PyTorch's
    let d = AdamOptions::default();
    assert_eq!(
        (d.lr, d.betas, d.eps, d.weight_decay, d.amsgrad),
        (1e-3, (0.9, 0.999), 1e-8, 0.0, false)
    );
    assert_eq!(AdamWOptions::default().weight_decay, 0.01);
    let w = param();
    let got = run(&mut Adam::new(vec![w.clone()], d)?, &w)?;
    assert_close(&got, &adam_ref(1e-3, 0.9, 0.999, 1e-8, 0.0, false, false));
    Ok(())
}

#[test]
fn float32_params_and_skipped_params() -> tp::Result<()> {
    let w = Tensor::from_vec(vec![1.0f32, 2.0], &[2])?.requires_grad_(true);
    let unused = Tensor::from_vec(vec![5.0f32], &[1])?.requires_grad_(true);
    let mut opt = SGD::new(
        vec![w.clone(), unused.clone()],
        SgdOptions {
            lr: 0.5,
            momentum: 0.9,
            ..Default::default()
        },
    )?;
    let v0 = w.version();
    w.sum()?.backward()?;
    opt.step()?;
    assert_eq!(w.to_vec::<f32>()?, vec![0.5, 1.5]);
    assert_eq!(unused.to_vec::<f32>()?, vec![5.0]); // no grad: skipped
    assert!(w.version() > v0);
    opt.zero_grad()?;
    assert!(w.grad().is_none());
    // explicit gradients, ignoring .grad
    let g = Tensor::from_vec(vec![1.0f32, 1.0], &[2])?;
    opt.step_with_grads(&[Some(g), None])?;
    // buf = 0.9 * 1 + 1 = 1.9
    let got = w.to_vec::<f32>()?;
    assert!((got[0] - (0.5 - 0.5 * 1.9)).abs() < 1e-6, "{got:?}");
    Ok(())
}

#[test]
fn lr_get_set() -> tp::Result<()> {
    let w = param();
    let mut opt = Adam::new(vec![w], AdamOptions::default())?;
    assert_eq!(opt.lr(), 1e-3);
    opt.set_lr(0.5)?;
    assert_eq!(opt.lr(), 0.5);
    assert!(matches!(
        opt.set_lr(-1.0),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(opt.params().len(), 1);
    Ok(())
}

#[test]
fn invalid_hyperparameters_and_grads() -> tp::Result<()> {
    let p = || vec![param()];
    let inv = |r: tp::Result<()>| assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    inv(SGD::new(
        p(),
        SgdOptions {
            lr: -0.1,
            ..Default::default()
        },
    )
    .map(|_| ()));
    inv(SGD::new(
        p(),
        SgdOptions {
            momentum: -0.5,
            ..Default::default()
        },
    )
    .map(|_| ()));
    inv(SGD::new(
        p(),
        SgdOptions {
            weight_decay: -1.0,
            ..Default::default()
        },
    )
    .map(|_| ()));
    inv(SGD::new(
        p(),
        SgdOptions {
            nesterov: true,
            ..Default::default()
        },
    )
    .map(|_| ()));
    inv(SGD::new(
        p(),
        SgdOptions {
            nesterov: true,
            momentum: 0.9,
            dampening: 0.1,
            ..Default::default()
        },
    )
    .map(|_| ()));
    inv(Adam::new(
        p(),
        AdamOptions {
            lr: f64::NAN,
            ..Default::default()
        },
    )
    .map(|_| ()));
    inv(Adam::new(
        p(),
        AdamOptions {
            betas: (1.0, 0.9),
            ..Default::default()
        },
    )
    .map(|_| ()));
    inv(Adam::new(
        p(),
        AdamOptions {
            betas: (0.9, -0.1),
            ..Default::default()
        },
    )
    .map(|_| ()));
    inv(Adam::new(
        p(),
        AdamOptions {
            eps: -1e-8,
            ..Default::default()
        },
    )
    .map(|_| ()));
    inv(AdamW::new(
        p(),
        AdamWOptions {
            weight_decay: -0.01,
            ..Default::default()
        },
    )
    .map(|_| ()));
    inv(SGD::new(
        vec![Tensor::from_vec(vec![1i64], &[1])?],
        SgdOptions::default(),
    )
    .map(|_| ()));

    let w = param();
    let mut opt = Adam::new(vec![w.clone()], AdamOptions::default())?;
    // wrong count, shape, dtype: the error names the parameter index
    inv(opt.step_with_grads(&[]));
    let e = opt
        .step_with_grads(&[Some(Tensor::zeros(&[2], DType::F64)?)])
        .unwrap_err();
    assert!(e.to_string().contains("gradient 0"), "{e}");
    let e = opt
        .step_with_grads(&[Some(Tensor::zeros(&[3], DType::F32)?)])
        .unwrap_err();
    assert!(e.to_string().contains("parameter 0"), "{e}");
    assert_eq!(w.to_vec::<f64>()?, W0.to_vec()); // untouched
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// parameter groups and learning-rate schedulers

fn w(v: &[f64]) -> Tensor {
    Tensor::from_slice(v, &[v.len()])
        .expect("tensor")
        .requires_grad_(true)
}

/// Two groups with their own options step exactly like two optimizers, one per group; a
/// group's rate changed through `param_groups_mut` applies from the next step.
#[test]
fn param_groups_step_like_separate_optimizers() -> tp::Result<()> {
    let (a, b) = (w(&W0), w(&W0));
    let (a2, b2) = (w(&W0), w(&W0));
    let oa = SgdOptions {
        lr: 0.05,
        momentum: 0.9,
        ..Default::default()
    };
    let ob = SgdOptions {
        lr: 0.01,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut both = SGD::with_groups(vec![(vec![a.clone()], oa), (vec![b.clone()], ob)])?;
    let mut sa = SGD::new(vec![a2.clone()], oa)?;
    let mut sb = SGD::new(vec![b2.clone()], ob)?;
    assert_eq!(both.param_groups().len(), 2);
    assert_eq!(both.param_groups()[1].params(), 1..2);
    for step in 0..STEPS {
        if step == 3 {
            both.param_groups_mut()[1].lr = 0.2;
            sb.set_lr(0.2)?;
        }
        for (opt, ts) in [
            (&mut both as &mut dyn Optimizer, vec![&a, &b]),
            (&mut sa, vec![&a2]),
            (&mut sb, vec![&b2]),
        ] {
            opt.zero_grad()?;
            for t in ts {
                loss(t)?.backward()?;
            }
            opt.step()?;
        }
    }
    assert_close(&a.to_vec::<f64>()?, &a2.to_vec::<f64>()?);
    assert_close(&b.to_vec::<f64>()?, &b2.to_vec::<f64>()?);
    // Adam: betas per group
    let (c, d, c2, d2) = (w(&W0), w(&W0), w(&W0), w(&W0));
    let oc = AdamOptions {
        lr: 0.1,
        betas: (0.5, 0.9),
        ..Default::default()
    };
    let od = AdamOptions {
        lr: 0.01,
        ..Default::default()
    };
    let mut both = Adam::with_groups(vec![(vec![c.clone()], oc), (vec![d.clone()], od)])?;
    assert_eq!(both.param_groups()[0].betas, Some((0.5, 0.9)));
    let mut sc = Adam::new(vec![c2.clone()], oc)?;
    let mut sd = Adam::new(vec![d2.clone()], od)?;
    for _ in 0..STEPS {
        for (opt, ts) in [
            (&mut both as &mut dyn Optimizer, vec![&c, &d]),
            (&mut sc, vec![&c2]),
            (&mut sd, vec![&d2]),
        ] {
            opt.zero_grad()?;
            for t in ts {
                loss(t)?.backward()?;
            }
            opt.step()?;
        }
    }
    assert_close(&c.to_vec::<f64>()?, &c2.to_vec::<f64>()?);
    assert_close(&d.to_vec::<f64>()?, &d2.to_vec::<f64>()?);
    Ok(())
}

/// A bad value put into a group fails the next step, naming the group, before any parameter
/// changes.
#[test]
fn bad_group_values_fail_the_step_naming_the_group() -> tp::Result<()> {
    let (a, b) = (w(&W0), w(&W0));
    let mut opt = AdamW::with_groups(vec![
        (vec![a.clone()], AdamWOptions::default()),
        (vec![b.clone()], AdamWOptions::default()),
    ])?;
    loss(&a)?.backward()?;
    loss(&b)?.backward()?;
    for (i, bad) in [(1, "lr"), (1, "betas"), (0, "weight_decay")] {
        let keep = opt.param_groups()[i].clone();
        match bad {
            "lr" => opt.param_groups_mut()[i].lr = f64::NAN,
            "betas" => opt.param_groups_mut()[i].betas = Some((1.0, 0.9)),
            _ => opt.param_groups_mut()[i].weight_decay = -1.0,
        }
        let e = opt.step().unwrap_err().to_string();
        assert!(
            e.contains(bad) && e.contains(&format!("param_groups[{i}]")),
            "{e}"
        );
        assert_eq!(a.to_vec::<f64>()?, W0.to_vec(), "{bad}");
        assert_eq!(b.to_vec::<f64>()?, W0.to_vec(), "{bad}");
        opt.param_groups_mut()[i] = keep;
    }
    assert!(SGD::with_groups(vec![]).is_err());
    Ok(())
}

/// Every scheduler's chained rates equal its closed form for 60 epochs on two groups with
/// different base rates, and the optimizer's groups carry them.
#[test]
fn schedulers_follow_their_closed_forms() -> tp::Result<()> {
    use tensorplay_core::optim::lr_scheduler::{
        CosineAnnealingLR, ExponentialLR, LambdaLR, LinearLR, LrScheduler, MultiStepLR, StepLR,
    };
    fn opt() -> SGD {
        SGD::with_groups(vec![
            (
                vec![w(&[1.0])],
                SgdOptions {
                    lr: 0.1,
                    ..Default::default()
                },
            ),
            (
                vec![w(&[1.0])],
                SgdOptions {
                    lr: 0.03,
                    ..Default::default()
                },
            ),
        ])
        .expect("sgd")
    }
    fn check<S: LrScheduler>(
        name: &str,
        opt: &mut SGD,
        s: &mut S,
        closed: impl Fn(&S, usize) -> Vec<f64>,
    ) {
        for epoch in 0..60 {
            let want = closed(s, epoch);
            let got: Vec<f64> = opt.param_groups().iter().map(|g| g.lr).collect();
            assert_eq!(s.last_epoch(), epoch);
            assert_eq!(s.get_last_lr(), &got[..], "{name} epoch {epoch}");
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-12 * w.abs().max(1e-3),
                    "{name} epoch {epoch}: {got:?} vs closed form {want:?}"
                );
            }
            s.step(opt).expect("step");
        }
    }
    let mut o = opt();
    let mut s = StepLR::new(&mut o, 7, 0.5)?;
    check("StepLR", &mut o, &mut s, |s, e| s.closed_form_lr(e));
    let mut o = opt();
    let mut s = MultiStepLR::new(&mut o, vec![30, 5, 12, 12], 0.3)?;
    check("MultiStepLR", &mut o, &mut s, |s, e| s.closed_form_lr(e));
    let mut o = opt();
    let mut s = ExponentialLR::new(&mut o, 0.95)?;
    check("ExponentialLR", &mut o, &mut s, |s, e| s.closed_form_lr(e));
    let mut o = opt();
    let mut s = CosineAnnealingLR::new(&mut o, 10, 0.001)?;
    check("CosineAnnealingLR", &mut o, &mut s, |s, e| {
        s.closed_form_lr(e)
    });
    let mut o = opt();
    let mut s = LinearLR::new(&mut o, 1.0 / 3.0, 1.0, 5)?;
    check("LinearLR", &mut o, &mut s, |s, e| s.closed_form_lr(e));
    let mut o = opt();
    let mut s = LambdaLR::new(&mut o, |e| 1.0 / (1.0 + e as f64))?;
    check("LambdaLR", &mut o, &mut s, |s, e| s.closed_form_lr(e));
    // the closed forms themselves, at a few points
    let mut o = opt();
    let s = CosineAnnealingLR::new(&mut o, 10, 0.0)?;
    assert!((s.closed_form_lr(5)[0] - 0.05).abs() < 1e-15 && s.closed_form_lr(10)[0].abs() < 1e-15);
    let mut o = opt();
    let s = MultiStepLR::new(&mut o, vec![2, 2], 0.5)?;
    assert!((s.closed_form_lr(2)[0] - 0.025).abs() < 1e-15);
    // bad arguments, and a factor that makes a rate negative
    let mut o = opt();
    assert!(StepLR::new(&mut o, 0, 0.5).is_err());
    assert!(ExponentialLR::new(&mut o, f64::NAN).is_err());
    assert!(LinearLR::new(&mut o, 0.0, 1.0, 5).is_err());
    assert!(CosineAnnealingLR::new(&mut o, 0, 0.0).is_err());
    let mut s = LambdaLR::new(&mut o, |e| 1.0 - e as f64)?;
    let e = s
        .step(&mut o)
        .map(|_| ())
        .and_then(|_| s.step(&mut o))
        .unwrap_err();
    assert!(e.to_string().contains("lr"), "{e}");
    Ok(())
}
