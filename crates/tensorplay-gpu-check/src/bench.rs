//! The core benchmark's GPU rows beside PyTorch's `torch_cuda_step.py` (TF32 off on both
//! sides): a 4096^3 float32 matrix product in TFLOP/s, and the MLP 11-64-64-10 training step
//! (batch 64, cross-entropy, SGD) in µs. Figures, never pass/fail: the machines are shared.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use tensorplay as tp;
use tp::nn::{self, Module};
use tp::optim::{Optimizer, SGD, SgdOptions};
use tp::{DType, Device, Tensor};

use super::e;

const GPU: Device = Device::Cuda(0);

fn sync() -> Result<(), String> {
    tp::cuda::synchronize(0).map_err(e)
}

/// Ours: (matmul TFLOP/s, MLP step µs).
fn ours() -> Result<(f64, f64), String> {
    let n = 4096;
    let a = Tensor::randn(&[n, n], (DType::F32, GPU)).map_err(e)?;
    let b = Tensor::randn(&[n, n], (DType::F32, GPU)).map_err(e)?;
    for _ in 0..3 {
        a.matmul(&b).map_err(e)?;
    }
    sync()?;
    let t = Instant::now();
    for _ in 0..20 {
        a.matmul(&b).map_err(e)?;
    }
    sync()?;
    let s = t.elapsed().as_secs_f64() / 20.0;
    let tflops = 2.0 * (n as f64).powi(3) / s / 1e12;

    tp::manual_seed(0);
    let mut model = nn::Sequential::new()
        .add(nn::Linear::new(11, 64, true).map_err(e)?)
        .add(nn::ReLU::new())
        .add(nn::Linear::new(64, 64, true).map_err(e)?)
        .add(nn::ReLU::new())
        .add(nn::Linear::new(64, 10, true).map_err(e)?);
    model.to_device(GPU).map_err(e)?;
    let mut opt = SGD::new(
        model.parameters(),
        SgdOptions {
            lr: 0.01,
            ..Default::default()
        },
    )
    .map_err(e)?;
    let x = Tensor::randn(&[64, 11], (DType::F32, GPU)).map_err(e)?;
    let y = Tensor::randint(0, 10, &[64], GPU).map_err(e)?;
    let mut step = || -> Result<(), String> {
        opt.zero_grad().map_err(e)?;
        nn::functional::cross_entropy(&model.call(&x).map_err(e)?, &y)
            .and_then(|l| l.backward())
            .map_err(e)?;
        opt.step().map_err(e)
    };
    for _ in 0..20 {
        step()?;
    }
    sync()?;
    let mut ts = Vec::with_capacity(200);
    for _ in 0..200 {
        let t = Instant::now();
        step()?;
        sync()?;
        ts.push(t.elapsed().as_secs_f64() * 1e6);
    }
    ts.sort_by(f64::total_cmp);
    Ok((tflops, ts[ts.len() / 2]))
}

/// PyTorch's figures from `script`, or why there are none.
fn torch(python: &str, script: &Path) -> Result<(f64, f64), String> {
    let out = Command::new(python)
        .arg(script)
        .output()
        .map_err(|x| format!("{python}: {x}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let num = |key: &str| {
        text.lines()
            .find(|l| l.contains(key))
            .and_then(|l| l.split_whitespace().rev().nth(1)?.parse::<f64>().ok())
    };
    match (num("matmul"), num("mlp_step")) {
        (Some(a), Some(b)) if out.status.success() => Ok((a, b)),
        _ => Err(format!(
            "{python} {} gave no figures: {}{}",
            script.display(),
            text.trim(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )),
    }
}

/// Prints both sides and the ratios; PyTorch is `python` running the bundled anchor script.
pub(crate) fn run(python: &str, script: &Path) -> Result<(), String> {
    let (tflops, step_us) = ours()?;
    println!("bench   tensorplay cuda matmul 4096^3 f32 {tflops:8.2} TFLOP/s");
    println!("bench   tensorplay cuda mlp_step batch64  {step_us:8.1} us/step");
    match torch(python, script) {
        Ok((t_tflops, t_us)) => {
            println!("bench   torch      cuda matmul 4096^3 f32 {t_tflops:8.2} TFLOP/s");
            println!("bench   torch      cuda mlp_step batch64  {t_us:8.1} us/step");
            println!(
                "bench   ratios: matmul {:.2}x PyTorch's TFLOP/s (goal >= 0.9), MLP step {:.2}x PyTorch's time (goal <= 1.0)",
                tflops / t_tflops,
                step_us / t_us
            );
        }
        Err(why) => println!("bench   no PyTorch figures (no ratios): {why}"),
    }
    Ok(())
}
