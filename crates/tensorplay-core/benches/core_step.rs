//! Core benchmark (the same workload as PyTorch's `torch_core_step.py` anchor), one thread:
//! 1. MLP training step (Linear 11->64, ReLU, Linear 64->64, ReLU, Linear 64->10,
//!    cross-entropy, SGD lr 0.01), batch 64, float32: microseconds per step (forward +
//!    backward + optimizer step), median of 5 x 500 steps after 200 warm-up steps.
//! 2. float32 matmul 512^3 and 1024^3: GFLOP/s.
//!
//! Run with `cargo bench -p tensorplay-core --bench core_step`, or side by side with PyTorch
//! through `cargo xtask bench-core`.

use std::time::Instant;

use tensorplay_core::{self as tp, Tensor};

fn mlp_step_us() -> tp::Result<f64> {
    tp::manual_seed(0);
    let init = |o: usize, i: usize| -> tp::Result<(Tensor, Tensor)> {
        let b = 1.0 / (i as f64).sqrt();
        let w = tp::rand(&[o, i])?
            .mul_scalar(2.0 * b)?
            .sub_scalar(b)?
            .requires_grad_(true);
        let bias = tp::rand(&[o])?
            .mul_scalar(2.0 * b)?
            .sub_scalar(b)?
            .requires_grad_(true);
        Ok((w, bias))
    };
    let layers = [init(64, 11)?, init(64, 64)?, init(10, 64)?];
    let x = tp::randn(&[64, 11])?;
    let y = tp::randn(&[64, 10])?;
    let step = || -> tp::Result<()> {
        for (w, b) in &layers {
            w.set_grad(None);
            b.set_grad(None);
        }
        let mut h = x.clone();
        for (i, (w, b)) in layers.iter().enumerate() {
            h = h.matmul(&w.t()?)?.add(b)?;
            if i < 2 {
                h = h.relu()?;
            }
        }
        let loss = h.sub(&y)?.pow_scalar(2.0)?.mean()?;
        loss.backward()?;
        let _g = tp::no_grad();
        for (w, b) in &layers {
            w.sub_(&w.grad().unwrap().mul_scalar(0.01)?)?;
            b.sub_(&b.grad().unwrap().mul_scalar(0.01)?)?;
        }
        Ok(())
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

fn matmul_gflops(n: usize) -> tp::Result<f64> {
    let a = tp::randn(&[n, n])?;
    let b = tp::randn(&[n, n])?;
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

fn main() -> tp::Result<()> {
    tp::set_num_threads(1);
    // `cargo bench ... -- mlp` runs only the training step (for profiling)
    let only_mlp = std::env::args().any(|a| a == "mlp");
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
            matmul_gflops(n)?
        );
    }
    Ok(())
}
