//! Red-wine quality classification with an MLP: the first end-to-end training job.
//!
//! The recipe matches PyTorch's `torch_wine_mlp.py` anchor: row `i` of the file is a test row
//! when `i % 5 == 0`; features are standardised with the training rows' mean and unbiased std;
//! classes are `quality - 3` (0..=5); an MLP 11-64-64-6 with ReLU is trained with
//! cross-entropy and Adam (lr 1e-3) on minibatches of 64 in file order for 200 epochs, in
//! float32. The last line printed is `test accuracy 0.xxxx`.
//!
//! `--device cuda` (or `cuda:N`) trains on a GPU: the model, the minibatches and the
//! optimizer state live there (needs the NVIDIA driver and NVRTC; see the README).
//!
//! ```text
//! cargo run --release --example wine_quality -- --seed 0 [--device cuda]
//! ```

use std::process::ExitCode;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use tensorplay as tp;
use tp::nn::{self, Module};
use tp::optim::{Adam, AdamOptions, Optimizer};
use tp::{Tensor, no_grad};

use tensorplay_examples::wine::{self, CLASSES, load};

const EPOCHS: usize = 200;
const BATCH: usize = 64;

/// Trains the wine-quality MLP and prints its test accuracy.
#[derive(Parser, Debug)]
#[command(
    name = "wine_quality",
    about = "Red-wine quality classification with an MLP (11-64-64-6, Adam, 200 epochs); the \
             last line printed is `test accuracy 0.xxxx`."
)]
struct Args {
    /// Seed of the initial weights.
    #[arg(long, value_name = "N", default_value_t = 0)]
    seed: u64,
    /// Where to train: cpu, cuda or cuda:N.
    #[arg(long, value_name = "cpu|cuda|cuda:N", default_value = "cpu", value_parser = parse_device)]
    device: tp::Device,
}

/// `--device`: a device name as `Tensor::to` takes it.
fn parse_device(v: &str) -> Result<tp::Device, String> {
    tp::IntoDevice::into_device(v).map_err(|e| e.to_string())
}

fn run(args: Args) -> Result<f64, Box<dyn std::error::Error>> {
    let Args { seed, device } = args;
    tp::manual_seed(seed);
    let (train, test, f) = load()?;

    let mut model = nn::Sequential::new()
        .add(nn::Linear::new(f, 64, true)?)
        .add(nn::ReLU::new())
        .add(nn::Linear::new(64, 64, true)?)
        .add(nn::ReLU::new())
        .add(nn::Linear::new(64, CLASSES, true)?);
    model.to_device(device)?;
    let loss_fn = nn::CrossEntropyLoss::new();
    let mut opt = Adam::new(
        model.parameters(),
        AdamOptions {
            lr: 1e-3,
            ..Default::default()
        },
    )?;

    // minibatches in file order, built once
    let batches: Vec<(Tensor, Tensor)> = wine::batches(&train, f, BATCH)?
        .into_iter()
        .map(|(x, y)| Ok((x.to_device(device)?, y.to_device(device)?)))
        .collect::<tp::Result<_>>()?;

    let bar = ProgressBar::new(EPOCHS as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} epochs [{elapsed_precise}] {msg}",
    )?);
    model.train(true)?;
    for _epoch in 0..EPOCHS {
        let mut total = 0.0;
        for (x, y) in &batches {
            opt.zero_grad()?;
            let loss = loss_fn.forward(&model.call(x)?, y)?;
            loss.backward()?;
            opt.step()?;
            total += loss.item_f64()? * y.numel() as f64;
        }
        bar.set_message(format!("loss {:.4}", total / train.rows() as f64));
        bar.inc(1);
    }
    bar.finish_and_clear();

    model.eval()?;
    let _g = no_grad();
    let logits = model.call(&Tensor::from_slice(&test.x, &[test.rows(), f])?.to_device(device)?)?;
    Ok(wine::accuracy(&logits, &test.y)?)
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(acc) => {
            println!("test accuracy {acc:.4}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
