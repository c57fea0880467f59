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
