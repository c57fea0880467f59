//! Times one training step of an MLP 11-64-64-10 at batch 64 (forward, cross-entropy,
//! backward, Adam).
use std::time::Instant;
use tensorplay as tp;
use tp::nn::{self, Module};
use tp::optim::{Adam, AdamOptions, Optimizer};

fn main() -> Result<(), tp::Error> {
    tp::manual_seed(0);
    let model = nn::Sequential::new()
        .add(nn::Linear::new(11, 64, true)?)
        .add(nn::ReLU::new())
        .add(nn::Linear::new(64, 64, true)?)
        .add(nn::ReLU::new())
        .add(nn::Linear::new(64, 10, true)?);
    let mut opt = Adam::new(model.parameters(), AdamOptions::default())?;
    let x = tp::randn(&[64, 11])?;
    let y = tp::randint(0, 10, &[64])?;
    let loss_fn = nn::CrossEntropyLoss::new();
    let step = |opt: &mut Adam| -> Result<(), tp::Error> {
        opt.zero_grad()?;
        let loss = loss_fn.forward(&model.call(&x)?, &y)?;
        loss.backward()?;
        opt.step()?;
        Ok(())
    };
    for _ in 0..200 {
        step(&mut opt)?;
    }
    let n = 5000;
    let t = Instant::now();
    for _ in 0..n {
        step(&mut opt)?;
    }
    println!("{:.1} us/step", t.elapsed().as_secs_f64() * 1e6 / n as f64);
    Ok(())
}
