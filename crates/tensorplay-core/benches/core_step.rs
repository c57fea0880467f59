//! Core benchmark (the same workload as PyTorch's `torch_core_step.py` anchor), one thread:
//! 1. MLP training step (Linear 11->64, ReLU, Linear 64->64, ReLU, Linear 64->10,
//!    cross-entropy, SGD lr 0.01), batch 64, float32: microseconds per step (forward +
//!    backward + optimizer step), median of 5 x 500 steps after 200 warm-up steps.
//! 2. float32 matmul 512^3 and 1024^3, and bfloat16 1024^3 (beside `torch_bf16_step.py`):
//!    GFLOP/s.
//!
//! Run with `cargo bench -p tensorplay-core --bench core_step`, or side by side with PyTorch
//! through `cargo xtask bench-core`.

use std::time::Instant;

use clap::{Parser, ValueEnum};
use tensorplay_core::nn::{self, Module};
use tensorplay_core::optim::{Optimizer, SGD, SgdOptions};
use tensorplay_core::{self as tp};

fn mlp_step_us() -> tp::Result<f64> {
    tp::manual_seed(0);
    let model = nn::Sequential::new()
        .add(nn::Linear::new(11, 64, true)?)
        .add(nn::ReLU::new())
        .add(nn::Linear::new(64, 64, true)?)
        .add(nn::ReLU::new())
        .add(nn::Linear::new(64, 10, true)?);
    let mut opt = SGD::new(
        model.parameters(),
        SgdOptions {
            lr: 0.01,
            ..Default::default()
        },
    )?;
    let loss_fn = nn::CrossEntropyLoss::new();
    let x = tp::randn(&[64, 11])?;
    let y = tp::randint(0, 10, &[64])?;
    let mut step = || -> tp::Result<()> {
        opt.zero_grad()?;
        let loss = loss_fn.forward(&model.call(&x)?, &y)?;
        loss.backward()?;
        opt.step()
    };
    for _ in 0..200 {
        step()?;
    }
    let mut runs = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..500 {
            step()?;
        }
        runs.push(t.elapsed().as_secs_f64() / 500.0);
    }
    runs.sort_by(|a, b| a.total_cmp(b));
    Ok(runs[2] * 1e6)
}

/// `[n, n] @ [n, n]` in `dtype` (output of `dtype`): GFLOP/s of the mean of a few calls.
fn matmul_gflops(n: usize, dtype: tp::DType) -> tp::Result<f64> {
    let a = tp::randn(&[n, n])?.to_dtype(dtype)?;
    let b = tp::randn(&[n, n])?.to_dtype(dtype)?;
    for _ in 0..3 {
        a.matmul(&b)?;
    }
    let k = if n == 512 { 10 } else { 3 };
    let t = Instant::now();
    for _ in 0..k {
        a.matmul(&b)?;
    }
    let dt = t.elapsed().as_secs_f64() / k as f64;
    Ok(2.0 * (n as f64).powi(3) / dt / 1e9)
}

/// What to measure.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Only {
    /// Only the MLP training step (for profiling).
    Mlp,
}

/// The core benchmark's command line (`cargo bench -p tensorplay-core --bench core_step [-- mlp]`).
#[derive(Parser, Debug)]
#[command(
    name = "core_step",
    about = "An MLP training step and f32 matmuls on one thread, in the lines `cargo xtask \
             bench-core` reads."
)]
struct Args {
    /// Measure only this (`mlp`: the training step, for profiling).
    only: Option<Only>,
    /// Given by `cargo bench` to every benchmark; nothing changes.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> tp::Result<()> {
    let args = Args::parse();
    tp::set_num_threads(1);
    let only_mlp = args.only == Some(Only::Mlp);
    println!(
        "tensorplay-core mlp_step batch64  {:8.1} us/step",
        mlp_step_us()?
    );
    if only_mlp {
        return Ok(());
    }
    for n in [512, 1024] {
        println!(
            "tensorplay-core matmul {n}^3 f32  {:8.1} GFLOP/s",
            matmul_gflops(n, tp::DType::F32)?
        );
    }
    // beside torch_bf16_step.py's `matmul 1024 bf16` (PyTorch's oneDNN)
    println!(
        "tensorplay-core matmul 1024^3 bf16  {:8.1} GFLOP/s",
        matmul_gflops(1024, tp::DType::BF16)?
    );
    Ok(())
}
