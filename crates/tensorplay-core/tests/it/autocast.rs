//! Autocast: the dtype of every op's output under the policy, regions that nest and disable,
//! backward without autocast, and a small MLP trained under bfloat16 autocast reaching the
//! float32 run's loss.

use tensorplay_core::nn::functional as F;
use tensorplay_core::{self as tp, DType, Tensor};

type Op = fn(&[Tensor]) -> tp::Result<Tensor>;

/// One op under `autocast("cpu", low)`: the dtypes of its float inputs and the dtype its
/// output must have (`None`: the low dtype of the case's region).
struct Case {
    name: &'static str,
    inputs: &'static [DType],
    f: Op,
    want: Option<DType>,
}

fn input(dtype: DType, i: usize) -> Tensor {
    let v: Vec<f32> = (0..12)
        .map(|j| ((j * 7 + i * 3) % 11) as f32 / 4.0 - 1.0)
        .collect();
    Tensor::from_vec(v, &[3, 4])
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn cases() -> Vec<Case> {
    use DType::*;
    let c = |name, inputs, f: Op, want| Case {
        name,
        inputs,
        f,
        want,
    };
    vec![
        c("matmul", &[F32, F32], |x| x[0].matmul(&x[1].t()?), None),
        c("mm", &[F32, F32], |x| x[0].mm(&x[1].t()?), None),
        c(
            "linear",
            &[F32, F32, F32],
            |x| F::linear(&x[0], &x[1], Some(&x[2].sum_dims(&[1], false)?)),
            None,
        ),
        c(
            "matmul of float64 stays",
            &[F64, F64],
            |x| x[0].matmul(&x[1].t()?),
            Some(F64),
        ),
        c(
            "scaled_dot_product_attention",
            &[F32, F32, F32],
            |x| F::scaled_dot_product_attention(&x[0], &x[1], &x[2], None, 0.0, true, None),
            None,
        ),
        c("softmax", &[BF16], |x| x[0].softmax(-1), Some(F32)),
        c("log_softmax", &[BF16], |x| x[0].log_softmax(-1), Some(F32)),
        c(
            "layer_norm",
            &[BF16],
            |x| F::layer_norm(&x[0], &[4], None, None, 1e-5),
            Some(F32),
        ),
        c("exp", &[BF16], |x| x[0].exp(), Some(F32)),
        c(
            "log",
            &[BF16],
            |x| x[0].abs()?.add_scalar(1.0)?.log(),
            Some(F32),
        ),
        c("pow", &[BF16, BF16], |x| x[0].abs()?.pow(&x[1]), Some(F32)),
        c("sum", &[BF16], |x| x[0].sum(), Some(F32)),
        c("mean", &[BF16], |x| x[0].mean_dims(&[0], false), Some(F32)),
        c(
            "mse_loss",
            &[BF16, F32],
            |x| F::mse_loss(&x[0], &x[1]),
            Some(F32),
        ),
        c(
            "cross_entropy",
            &[BF16],
            |x| F::cross_entropy(&x[0], &Tensor::from_vec(vec![0i64, 3, 1], &[3])?),
            Some(F32),
        ),
        c(
            "add promotes to the widest",
            &[BF16, F32],
            |x| x[0].add(&x[1]),
            Some(F32),
        ),
        c(
            "relu keeps its input's dtype",
            &[BF16],
            |x| x[0].relu(),
            None,
        ),
        c("relu of float32 stays", &[F32], |x| x[0].relu(), Some(F32)),
    ]
}

fn check(c: &Case) -> Result<(), String> {
    for low in [DType::BF16, DType::F16] {
        let xs: Vec<Tensor> = c
            .inputs
            .iter()
            .enumerate()
            .map(|(i, &d)| input(if d == DType::BF16 { low } else { d }, i))
            .collect();
        let _ac = tp::autocast("cpu", low).map_err(|e| e.to_string())?;
        let y = (c.f)(&xs).map_err(|e| format!("{} under {low}: {e}", c.name))?;
        let want = c.want.unwrap_or(low);
        if y.dtype() != want {
            return Err(format!(
                "{} under {low}: output {}, want {want}",
                c.name,
                y.dtype()
            ));
        }
    }
    Ok(())
}

#[test]
fn every_op_follows_the_autocast_policy() {
    let failures: Vec<String> = cases().iter().filter_map(|c| check(c).err()).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn regions_nest_disable_and_restore() -> tp::Result<()> {
    let (x, w) = (input(DType::F32, 0), input(DType::F32, 1).t()?);
    assert!(!tp::is_autocast_enabled("cpu"));
    assert_eq!(
        tp::get_autocast_dtype("cpu")?,
        DType::BF16,
        "the CPU's default"
    );
    assert_eq!(
        tp::get_autocast_dtype("cuda")?,
        DType::F16,
        "CUDA's default"
    );
    {
        let _outer = tp::autocast("cpu", DType::BF16)?;
        assert!(tp::is_autocast_enabled("cpu") && !tp::is_autocast_enabled("cuda"));
        {
            let _inner = tp::amp::autocast_with(
                "cpu",
                tp::amp::AutocastOptions {
                    enabled: false,
                    ..Default::default()
                },
            )?;
            assert_eq!(x.matmul(&w)?.dtype(), DType::F32, "disabled inside");
            {
                let _f16 = tp::autocast("cpu", DType::F16)?;
                assert_eq!(x.matmul(&w)?.dtype(), DType::F16, "nested float16");
            }
            assert_eq!(x.matmul(&w)?.dtype(), DType::F32, "disabled again");
        }
        assert_eq!(x.matmul(&w)?.dtype(), DType::BF16, "the outer region back");
    }
    assert_eq!(x.matmul(&w)?.dtype(), DType::F32, "off after the region");
    assert!(
        tp::autocast("cpu", DType::F32).is_err(),
        "float32 is not a low dtype"
    );
    assert!(
        tp::autocast("meta", DType::BF16).is_err(),
        "no autocast on meta"
    );
    {
        // as PyTorch: without CUDA a CUDA region is disabled (with a warning), not an error
        let _cuda = tp::autocast("cuda", DType::F16)?;
        assert_eq!(
            tp::is_autocast_enabled("cuda"),
            tp::cuda::is_available(),
            "a CUDA region is on exactly where CUDA is available"
        );
        assert!(!tp::is_autocast_enabled("cpu"), "the CPU stays off");
    }
    Ok(())
}

#[test]
fn backward_runs_without_autocast_and_gradients_take_the_forward_dtypes() -> tp::Result<()> {
    let x = input(DType::F32, 0);
    let w = input(DType::F32, 1).t()?.contiguous()?.requires_grad_(true);
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let _ac = tp::autocast("cpu", DType::BF16)?;
    let h = x.matmul(&w)?; // bfloat16
    let s = seen.clone();
    h.register_hook(move |g| {
        s.lock()
            .unwrap()
            .push((tp::is_autocast_enabled("cpu"), g.dtype()));
        Ok(None)
    })?;
    // twice the weight in one region: one cached cast, both uses' gradients reach it
    let y = h.add(&x.matmul(&w)?)?.softmax(-1)?; // float32
    assert_eq!(y.dtype(), DType::F32);
    y.mul(&y)?.sum()?.backward()?;
    assert_eq!(
        *seen.lock().unwrap(),
        vec![(false, DType::BF16)],
        "the hook inside backward"
    );
    assert!(
        tp::is_autocast_enabled("cpu"),
        "the region is back after backward"
    );
    let g = w.grad().expect("the weight's gradient");
    assert_eq!(g.dtype(), DType::F32, "a float32 weight's gradient");
    // against the same computation written out in bfloat16 without autocast
    drop(_ac);
    let wb = w.detach().requires_grad_(true);
    let (xb, wc) = (x.bfloat16()?, wb.bfloat16()?);
    let y2 = xb
        .matmul(&wc)?
        .add(&xb.matmul(&wc)?)?
        .float()?
        .softmax(-1)?;
    y2.mul(&y2)?.sum()?.backward()?;
    assert_eq!(
        tensorplay_testkit::element_bits(&g)?,
        tensorplay_testkit::element_bits(&wb.grad().expect("gradient"))?,
        "autocast's gradient is the hand-cast one, bit for bit"
    );
    Ok(())
}

/// A two-layer MLP regressing a smooth function, trained 60 steps of AdamW from the same
/// start in float32 and under bfloat16 autocast: the final losses within 5% of each other
/// (bfloat16 keeps 8 bits; measured: the runs differ by well under 1%).
#[test]
fn an_mlp_trained_under_bf16_autocast_reaches_the_float32_loss() -> tp::Result<()> {
    let n = 64;
    let xv: Vec<f32> = (0..n * 4)
        .map(|i| ((i * 13) % 29) as f32 / 14.5 - 1.0)
        .collect();
    let x = Tensor::from_vec(xv, &[n, 4])?;
    let y = x.sum_dims(&[1], true)?.tanh()?.mul_scalar(0.8)?;
    let train = |autocast: bool| -> tp::Result<f64> {
        let w1: Vec<f32> = (0..32 * 4)
            .map(|i| ((i * 7) % 17) as f32 / 17.0 - 0.5)
            .collect();
        let w2: Vec<f32> = (0..32)
            .map(|i| ((i * 5) % 13) as f32 / 13.0 - 0.5)
            .collect();
        let w1 = Tensor::from_vec(w1, &[32, 4])?.requires_grad_(true);
        let w2 = Tensor::from_vec(w2, &[1, 32])?.requires_grad_(true);
        let mut opt = tp::optim::AdamW::new(vec![w1.clone(), w2.clone()], Default::default())?;
        let mut last = f64::NAN;
        for _ in 0..60 {
            use tp::optim::Optimizer as _;
            opt.zero_grad()?;
            let loss = {
                let _ac = autocast
                    .then(|| tp::autocast("cpu", DType::BF16))
                    .transpose()?;
                let h = F::linear(&x, &w1, None)?.tanh()?;
                F::mse_loss(&F::linear(&h, &w2, None)?, &y)?
            };
            assert_eq!(loss.dtype(), DType::F32);
            loss.backward()?;
            opt.step()?;
            last = loss.item_f64()?;
        }
        Ok(last)
    };
    let (l32, l16) = (train(false)?, train(true)?);
    assert!(l32 < 0.05, "the float32 run learns: {l32}");
    assert!(
        (l16 - l32).abs() <= 0.05 * l32 + 1e-3,
        "bfloat16 {l16} vs float32 {l32}"
    );
    Ok(())
}

/// An activation-checkpointed block under autocast: the recompute in backward runs under the
/// forward's autocast state, so the gradients equal the plain autocast run's bit for bit.
#[test]
fn checkpointed_blocks_recompute_under_the_forwards_autocast() -> tp::Result<()> {
    let w = Tensor::from_vec((0..12).map(|i| i as f32 * 0.25 - 1.0).collect(), &[3, 4])?
        .requires_grad_(true);
    let x = Tensor::from_vec((0..6).map(|i| i as f32 * 0.5 - 1.5).collect(), &[2, 3])?
        .requires_grad_(true);
    let run = |checkpointed: bool| -> tp::Result<(Vec<f64>, Vec<f64>)> {
        w.set_grad(None);
        x.set_grad(None);
        let y = {
            let _ac = tp::autocast("cpu", DType::BF16)?;
            let wc = w.clone();
            let body = move |xs: &[Tensor]| -> tp::Result<Vec<Tensor>> {
                Ok(vec![xs[0].matmul(&wc)?.tanh()?])
            };
            if checkpointed {
                tp::utils::checkpoint::checkpoint(body, &[&x])?.remove(0)
            } else {
                body(std::slice::from_ref(&x))?.remove(0)
            }
        };
        if y.dtype() != DType::BF16 {
            return Err(tp::Error::Autograd(format!("output of {}", y.dtype())));
        }
        y.float()?.sum()?.backward()?;
        let grad = |t: &Tensor| -> tp::Result<Vec<f64>> {
            t.grad()
                .ok_or_else(|| tp::Error::Autograd("no gradient".into()))?
                .to_vec_f64()
        };
        Ok((grad(&w)?, grad(&x)?))
    };
    assert_eq!(run(true)?, run(false)?);
    Ok(())
}

/// Two forwards in one region share the weight's cached cast, each with its own backward (a
/// pipeline's micro-batches): the cast saved nothing, so the second backward runs through it
/// too (PyTorch's rule), and the weight's gradient is the sum of both.
#[test]
fn a_cached_cast_serves_two_backwards() -> tp::Result<()> {
    let (x1, x2) = (input(DType::F32, 0), input(DType::F32, 2));
    let w = input(DType::F32, 1).t()?.contiguous()?.requires_grad_(true);
    let ac = tp::autocast("cpu", DType::BF16)?;
    let y1 = x1.matmul(&w)?.sum()?;
    let y2 = x2.matmul(&w)?.sum()?;
    y1.backward()?;
    y2.backward()?;
    drop(ac);
    let got = w.grad().expect("the weight's gradient").to_vec::<f32>()?;
    // the same sums in one backward
    let w2 = w.detach().deep_clone()?.requires_grad_(true);
    let _ac = tp::autocast("cpu", DType::BF16)?;
    x1.matmul(&w2)?
        .sum()?
        .add(&x2.matmul(&w2)?.sum()?)?
        .backward()?;
    let want = w2.grad().unwrap().to_vec::<f32>()?;
    for (g, e) in got.iter().zip(&want) {
        assert!(
            (g - e).abs() <= 1e-2 * (1.0 + e.abs()),
            "{got:?} vs {want:?}"
        );
    }
    Ok(())
}
