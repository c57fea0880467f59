//! Red-wine quality classification with an MLP: the first end-to-end training job.
//!
//! The recipe matches PyTorch's `torch_wine_mlp.py` anchor: row `i` of the file is a test row
//! when `i % 5 == 0`; features are standardised with the training rows' mean and unbiased std;
//! classes are `quality - 3` (0..=5); an MLP 11-64-64-6 with ReLU is trained with
//! cross-entropy and Adam (lr 1e-3) on minibatches of 64 in file order for 200 epochs, in
//! float32. The last line printed is `test accuracy 0.xxxx`.
//!
//! ```text
//! cargo run --release --example wine_quality -- --seed 0
//! ```

use std::process::ExitCode;

use indicatif::{ProgressBar, ProgressStyle};
use tensorplay as tp;
use tp::nn::{self, Module};
use tp::optim::{Adam, AdamOptions, Optimizer};
use tp::{Tensor, no_grad};

const EPOCHS: usize = 200;
const BATCH: usize = 64;
const CLASSES: usize = 6;

fn parse_seed() -> Result<u64, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut seed = 0u64;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--seed" => {
                let v = args.get(i + 1).ok_or("--seed needs a value")?;
                seed = v.parse().map_err(|e| format!("bad --seed {v:?}: {e}"))?;
                i += 2;
            }
            a => {
                if let Some(v) = a.strip_prefix("--seed=") {
                    seed = v.parse().map_err(|e| format!("bad --seed {v:?}: {e}"))?;
                    i += 1;
                } else {
                    return Err(format!(
                        "unknown argument {a:?} (usage: wine_quality [--seed N])"
                    ));
                }
            }
        }
    }
    Ok(seed)
}

/// Row-major f32 features and int64 labels of some rows.
struct Split {
    x: Vec<f32>,
    y: Vec<i64>,
}

impl Split {
    fn rows(&self) -> usize {
        self.y.len()
    }
}

fn load() -> Result<(Split, Split, usize), String> {
    let ds = linfa_datasets::winequality();
    let (records, targets) = (&ds.records, &ds.targets);
    let (n, f) = (records.nrows(), records.ncols());
    let mut train_rows = Vec::new();
    let mut test_rows = Vec::new();
    for i in 0..n {
        if i % 5 == 0 {
            test_rows.push(i)
        } else {
            train_rows.push(i)
        }
    }
    // mean and unbiased std of the training rows, in f64
    let mut mean = vec![0.0f64; f];
    for &r in &train_rows {
        for j in 0..f {
            mean[j] += records[[r, j]];
        }
    }
    for m in &mut mean {
        *m /= train_rows.len() as f64;
    }
    let mut var = vec![0.0f64; f];
    for &r in &train_rows {
        for j in 0..f {
            let d = records[[r, j]] - mean[j];
            var[j] += d * d;
        }
    }
    let std: Vec<f64> = var
        .iter()
        .map(|v| (v / (train_rows.len() as f64 - 1.0)).sqrt())
        .collect();
    let split = |rows: &[usize]| -> Result<Split, String> {
        let mut x = Vec::with_capacity(rows.len() * f);
        let mut y = Vec::with_capacity(rows.len());
        for &r in rows {
            for j in 0..f {
                x.push(((records[[r, j]] - mean[j]) / std[j]) as f32);
            }
            let q = targets[r] as i64 - 3;
            if !(0..CLASSES as i64).contains(&q) {
                return Err(format!("row {r}: quality {} outside 3..=8", targets[r]));
            }
            y.push(q);
        }
        Ok(Split { x, y })
    };
    Ok((split(&train_rows)?, split(&test_rows)?, f))
}

fn run() -> Result<f64, Box<dyn std::error::Error>> {
    let seed = parse_seed()?;
    tp::manual_seed(seed);
    let (train, test, f) = load()?;

    let mut model = nn::Sequential::new()
        .add(nn::Linear::new(f, 64, true)?)
        .add(nn::ReLU::new())
        .add(nn::Linear::new(64, 64, true)?)
        .add(nn::ReLU::new())
        .add(nn::Linear::new(64, CLASSES, true)?);
    let loss_fn = nn::CrossEntropyLoss::new();
    let mut opt = Adam::new(
        model.parameters(),
        AdamOptions {
            lr: 1e-3,
            ..Default::default()
        },
    )?;

    // minibatches in file order, built once
    let batches: Vec<(Tensor, Tensor)> = (0..train.rows())
        .step_by(BATCH)
        .map(|s| {
            let e = (s + BATCH).min(train.rows());
            Ok((
                Tensor::from_slice(&train.x[s * f..e * f], &[e - s, f])?,
                Tensor::from_slice(&train.y[s..e], &[e - s])?,
            ))
        })
        .collect::<tp::Result<_, tp::Error>>()?;

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
    let logits = model.call(&Tensor::from_slice(&test.x, &[test.rows(), f])?)?;
    let v = logits.to_vec::<f32>()?;
    let correct = v
        .chunks_exact(CLASSES)
        .zip(&test.y)
        .filter(|&(row, &y)| {
            let mut best = 0;
            for (k, &s) in row.iter().enumerate() {
                if s > row[best] {
                    best = k;
                }
            }
            best as i64 == y
        })
        .count();
    Ok(correct as f64 / test.rows() as f64)
}

fn main() -> ExitCode {
    match run() {
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
