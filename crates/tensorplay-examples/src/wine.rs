//! The red-wine-quality data of the examples: PyTorch's `torch_wine_mlp.py` recipe (row `i` is
//! a test row when `i % 5 == 0`; features standardised with the training rows' mean and
//! unbiased std; classes `quality - 3`), and minibatches in file order.

use tensorplay as tp;
use tp::Tensor;

/// Number of classes (`quality - 3` in 0..=5).
pub const CLASSES: usize = 6;

/// Row-major f32 features and int64 labels of some rows.
pub struct Split {
    /// Features, row-major `[rows, features]`.
    pub x: Vec<f32>,
    /// Labels.
    pub y: Vec<i64>,
}

impl Split {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.y.len()
    }
}

/// The training split, the test split and the number of features.
pub fn load() -> Result<(Split, Split, usize), String> {
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

/// Minibatches of `batch` rows in file order: `(features [b, f], labels [b])`.
pub fn batches(s: &Split, f: usize, batch: usize) -> tp::Result<Vec<(Tensor, Tensor)>> {
    (0..s.rows())
        .step_by(batch)
        .map(|start| {
            let end = (start + batch).min(s.rows());
            Ok((
                Tensor::from_slice(&s.x[start * f..end * f], &[end - start, f])?,
                Tensor::from_slice(&s.y[start..end], &[end - start])?,
            ))
        })
        .collect()
}

/// The fraction of rows whose largest logit is the label (`logits [rows, CLASSES]`, f32).
pub fn accuracy(logits: &Tensor, y: &[i64]) -> tp::Result<f64> {
    let v = logits.to_vec::<f32>()?;
    let correct = v
        .chunks_exact(CLASSES)
        .zip(y)
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
    Ok(correct as f64 / y.len() as f64)
}
