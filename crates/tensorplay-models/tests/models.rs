//! `tensorplay::models::gpt`: the GPT against a hand-written float64 reference (logits, loss,
//! gradients by finite differences), its tensor-parallel form against the unsplit model in real
//! processes (world sizes 2 and 4, float64, 1e-10), and a short training run that lowers the
//! validation loss on the shipped Shakespeare text.

use std::collections::BTreeMap;
use std::time::Duration;
use tensorplay_testkit::cpu_world;

use tensorplay as tp;
use tp::distributed as dist;
use tp::models::gpt::{self, Block, Gpt, GptConfig};
use tp::nn::Module;
use tp::optim::lr_scheduler::{LrScheduler, WarmupCosineLR};
use tp::optim::{AdamW, AdamWOptions, Optimizer};
use tp::{DType, Tensor};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const TOL: f64 = 1e-10;

fn tiny(n_layer: usize, n_head: usize) -> GptConfig {
    GptConfig {
        vocab_size: 7,
        block_size: 6,
        n_layer,
        n_head,
        n_embd: 8,
        dropout: 0.0,
        dtype: DType::F64,
    }
}

fn close(what: &str, got: &[f64], want: &[f64], tol: f64) -> R<()> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, want {}", got.len(), want.len()).into());
    }
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        if (a - b).abs() > tol * (1.0 + b.abs()) || a.is_nan() {
            return Err(format!("{what}: element {i}: got {a}, want {b}").into());
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// the hand-written reference

struct Params(BTreeMap<String, Vec<f64>>);

impl Params {
    fn of(model: &Gpt) -> R<Params> {
        let mut m = BTreeMap::new();
        for (n, t) in model.state_dict()? {
            m.insert(n, t.to_vec::<f64>()?);
        }
        Ok(Params(m))
    }
    fn get(&self, name: &str) -> &[f64] {
        &self.0[name]
    }
}

/// `w [rows, cols] @ x [cols] (+ b)`.
fn affine(w: &[f64], b: Option<&[f64]>, x: &[f64]) -> Vec<f64> {
    let cols = x.len();
    (0..w.len() / cols)
        .map(|r| {
            let s: f64 = (0..cols).map(|c| w[r * cols + c] * x[c]).sum();
            s + b.map_or(0.0, |b| b[r])
        })
        .collect()
}

fn layer_norm(x: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    x.iter()
        .enumerate()
        .map(|(i, v)| (v - mean) / (var + 1e-5).sqrt() * w[i] + b[i])
        .collect()
}

fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}

/// Logits `[T][V]` of one sequence, written out with loops.
fn reference_logits(p: &Params, c: &GptConfig, tokens: &[i64]) -> Vec<Vec<f64>> {
    let (e, v, heads) = (c.n_embd, c.vocab_size, c.n_head);
    let d = e / heads;
    let t_len = tokens.len();
    let wte = p.get("wte.weight");
    let wpe = p.get("wpe.weight");
    let mut x: Vec<Vec<f64>> = (0..t_len)
        .map(|t| {
            let tok = tokens[t] as usize;
            (0..e).map(|i| wte[tok * e + i] + wpe[t * e + i]).collect()
        })
        .collect();
    for l in 0..c.n_layer {
        let g = |s: &str| p.get(&format!("h.{l}.{s}"));
        // attention
        let qkv: Vec<Vec<f64>> = x
            .iter()
            .map(|xt| {
                let a = layer_norm(xt, g("ln_1.weight"), g("ln_1.bias"));
                affine(g("attn.c_attn.weight"), Some(g("attn.c_attn.bias")), &a)
            })
            .collect();
        let mut att = vec![vec![0.0; e]; t_len];
        for h in 0..heads {
            for i in 0..t_len {
                let q = &qkv[i][h * d..(h + 1) * d];
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let k = &qkv[j][e + h * d..e + (h + 1) * d];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for (j, wj) in w.iter().enumerate() {
                    for k in 0..d {
                        att[i][h * d + k] += wj / z * qkv[j][2 * e + h * d + k];
                    }
                }
            }
        }
        for (xt, at) in x.iter_mut().zip(&att) {
            let y = affine(g("attn.c_proj.weight"), Some(g("attn.c_proj.bias")), at);
            xt.iter_mut().zip(y).for_each(|(a, b)| *a += b);
        }
        // MLP
        for xt in x.iter_mut() {
            let a = layer_norm(xt, g("ln_2.weight"), g("ln_2.bias"));
            let h: Vec<f64> = affine(g("mlp.c_fc.weight"), Some(g("mlp.c_fc.bias")), &a)
                .into_iter()
                .map(gelu_tanh)
                .collect();
            let y = affine(g("mlp.c_proj.weight"), Some(g("mlp.c_proj.bias")), &h);
            xt.iter_mut().zip(y).for_each(|(a, b)| *a += b);
        }
    }
    x.iter()
        .map(|xt| {
            let a = layer_norm(xt, p.get("ln_f.weight"), p.get("ln_f.bias"));
            affine(wte, None, &a)
        })
        .inspect(|l| assert_eq!(l.len(), v))
        .collect()
}

fn reference_loss(logits: &[Vec<f64>], targets: &[i64]) -> f64 {
    let n = logits.len() as f64;
    logits
        .iter()
        .zip(targets)
        .map(|(l, &t)| {
            let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + l.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            lse - l[t as usize]
        })
        .sum::<f64>()
        / n
}

fn tokens(b: usize, t: usize, k: i64, v: usize) -> Vec<i64> {
    (0..b * t).map(|i| (i as i64 * 5 + k) % v as i64).collect()
}

#[test]
fn gpt_logits_loss_and_gradients_equal_a_hand_written_reference() -> R<()> {
    let c = tiny(2, 2);
    tp::manual_seed(11);
    let model = Gpt::new(c)?;
    // LayerNorms and biases away from their initial ones and zeros, so they are exercised
    {
        let _g = tp::no_grad();
        for (i, (name, p)) in model.named_parameters().into_iter().enumerate() {
            if name.contains("ln_") || name.ends_with("bias") {
                p.copy_(
                    &tp::randn(p.shape())?
                        .mul_scalar(0.3)?
                        .add_scalar(0.1 * i as f64)?,
                )?;
            }
        }
    }
    let names: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names.len(), 2 + 12 * 2 + 2, "{names:?}");
    assert_eq!(
        &names[..4],
        [
            "wte.weight",
            "wpe.weight",
            "h.0.ln_1.weight",
            "h.0.ln_1.bias"
        ]
    );
    let (b, t) = (2, 5);
    let idx_v = tokens(b, t, 1, c.vocab_size);
    let tgt_v = tokens(b, t, 3, c.vocab_size);
    let idx = Tensor::from_vec(idx_v.clone(), &[b, t])?;
    let tgt = Tensor::from_vec(tgt_v.clone(), &[b, t])?;
    let logits = model.call(&idx)?;
    assert_eq!(logits.shape(), [b, t, c.vocab_size]);
    let got = logits.to_vec::<f64>()?;
    let p = Params::of(&model)?;
    let mut all_ref = Vec::new();
    for s in 0..b {
        let r = reference_logits(&p, &c, &idx_v[s * t..(s + 1) * t]);
        all_ref.extend(r);
    }
    let flat: Vec<f64> = all_ref.iter().flatten().copied().collect();
    close("logits", &got, &flat, TOL)?;
    let loss = model.loss(&idx, &tgt)?;
    close(
        "loss",
        &[loss.item::<f64>()?],
        &[reference_loss(&all_ref, &tgt_v)],
        TOL,
    )?;

    // gradients against central differences of the reference loss, for elements of every kind
    // of parameter (the tied embedding gets both of its uses)
    loss.backward()?;
    let eps = 1e-6;
    for (name, elems) in [
        ("wte.weight", vec![0, 9, 50]),
        ("wpe.weight", vec![3, 40]),
        ("h.0.attn.c_attn.weight", vec![0, 100, 190]),
        ("h.1.attn.c_proj.bias", vec![5]),
        ("h.0.mlp.c_fc.weight", vec![7, 200]),
        ("h.1.ln_2.weight", vec![2]),
        ("ln_f.bias", vec![6]),
    ] {
        let param = model
            .named_parameters()
            .into_iter()
            .find(|(n, _)| n == name)
            .ok_or(name)?
            .1;
        let grad = param.grad().ok_or("no gradient")?.to_vec::<f64>()?;
        for i in elems {
            let at = |delta: f64| -> f64 {
                let mut q = Params(p.0.clone());
                q.0.get_mut(name).unwrap()[i] += delta;
                let logits: Vec<Vec<f64>> = (0..b)
                    .flat_map(|s| reference_logits(&q, &c, &idx_v[s * t..(s + 1) * t]))
                    .collect();
                reference_loss(&logits, &tgt_v)
            };
            let numeric = (at(eps) - at(-eps)) / (2.0 * eps);
            close(
                &format!("d loss / d {name}[{i}]"),
                &[grad[i]],
                &[numeric],
                1e-6,
            )?;
        }
    }

    // bad input
    assert!(
        model
            .call(&Tensor::from_vec(vec![1.0f64; 4], &[2, 2])?)
            .is_err()
    );
    assert!(
        model
            .call(&Tensor::from_vec(vec![0i64; 14], &[2, 7])?)
            .is_err()
    ); // T > block_size
    assert!(model.call(&Tensor::from_vec(vec![7i64], &[1, 1])?).is_err()); // id >= V
    assert!(model.loss(&idx, &idx.narrow(1, 0, 2)?).is_err());
    assert!(Gpt::new(GptConfig { n_head: 3, ..c }).is_err());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// tensor parallelism in real processes

/// Runs `f` on every rank of a world of `n` processes ([`cpu_world`]).
fn world(n: usize, f: impl Fn(usize) -> R<()>) {
    cpu_world(n, Duration::from_secs(60), f);
}

/// `(output, input gradient, parameter gradients by name)` of `Σ y ⊙ c` for a module.
type Run = (Vec<f64>, Option<Vec<f64>>, BTreeMap<String, Tensor>);

fn run(m: &dyn Module, x: &Tensor, c: &Tensor) -> R<Run> {
    let y = m.call(x)?;
    let out = y.to_vec_f64()?;
    y.mul(c)?.sum()?.backward()?;
    let dx = x.grad().map(|g| g.to_vec::<f64>()).transpose()?;
    let mut grads = BTreeMap::new();
    for (n, p) in m.named_parameters() {
        // a frozen parameter (the zeros of a row-parallel bias off rank 0) gets none
        let g = match p.grad() {
            None if !p.requires_grad() => p.zeros_like()?,
            g => g.ok_or("a parameter got no gradient")?,
        };
        grads.insert(n, g);
    }
    Ok((out, dx, grads))
}

/// The tensor-parallel block and model equal the unsplit ones: outputs, input gradients, and
/// every parameter's gradient equals its shard of the single-process gradient.
fn tensor_parallel_equals_unsplit(rank: usize) -> R<()> {
    let w = dist::get_world_size(None)?;
    let group = dist::default_group("test")?;
    let who = |s: &str| format!("{s} (rank {rank} of {w})");
    let c = tiny(2, 4);
    let (b, t, e) = (2, 5, c.n_embd);

    // one block, a float input
    tp::manual_seed(5);
    let full = Block::new(&c)?;
    let xv: Vec<f64> = (0..b * t * e).map(|i| (i as f64 * 0.37).sin()).collect();
    let cv: Vec<f64> = (0..b * t * e).map(|i| (i as f64 * 0.11).cos()).collect();
    let weights = Tensor::from_vec(cv, &[b, t, e])?;
    let x = Tensor::from_vec(xv.clone(), &[b, t, e])?.requires_grad_(true);
    let (y_full, dx_full, g_full) = run(&full, &x, &weights)?;
    let shard = full.tensor_parallel(&group)?;
    let x = Tensor::from_vec(xv, &[b, t, e])?.requires_grad_(true);
    let (y, dx, g) = run(&shard, &x, &weights)?;
    close(&who("block output"), &y, &y_full, TOL)?;
    close(
        &who("block input gradient"),
        &dx.ok_or("dx")?,
        &dx_full.ok_or("dx")?,
        TOL,
    )?;
    for (name, grad) in &g {
        let want = gpt::shard_parameter(name, &g_full[name], rank, w)?;
        if grad.shape() != want.shape() {
            return Err(format!(
                "{}: shape {:?} vs {:?}",
                who(name),
                grad.shape(),
                want.shape()
            )
            .into());
        }
        close(
            &who(&format!("block gradient {name}")),
            &grad.to_vec()?,
            &want.to_vec()?,
            TOL,
        )?;
    }
    let local_heads = shard.attn.c_attn.weight.shape()[0] / 3 / (e / c.n_head);
    assert_eq!(local_heads, c.n_head / w);

    // the whole model: logits, loss, every gradient
    tp::manual_seed(6);
    let model = Gpt::new(c)?;
    let idx = Tensor::from_vec(tokens(b, t, 2, c.vocab_size), &[b, t])?;
    let tgt = Tensor::from_vec(tokens(b, t, 4, c.vocab_size), &[b, t])?;
    let loss_full = model.loss(&idx, &tgt)?;
    loss_full.backward()?;
    let tp_model = model.tensor_parallel(&group)?;
    let loss = tp_model.loss(&idx, &tgt)?;
    close(
        &who("model loss"),
        &[loss.item::<f64>()?],
        &[loss_full.item::<f64>()?],
        TOL,
    )?;
    loss.backward()?;
    let full_params: BTreeMap<String, Tensor> = model.named_parameters().into_iter().collect();
    for (name, p) in tp_model.named_parameters() {
        let want = gpt::shard_parameter(&name, &full_params[&name].grad().ok_or("grad")?, rank, w)?;
        let got = match p.grad() {
            None if !p.requires_grad() => p.zeros_like()?,
            g => g.ok_or("grad")?,
        };
        close(
            &who(&format!("model gradient {name}")),
            &got.to_vec()?,
            &want.to_vec()?,
            TOL,
        )?;
    }
    Ok(())
}

#[test]
fn tensor_parallel_gpt_equals_unsplit_world_2() {
    world(2, tensor_parallel_equals_unsplit);
}

#[test]
fn tensor_parallel_gpt_equals_unsplit_world_4() {
    world(4, tensor_parallel_equals_unsplit);
}

#[test]
fn sharding_layout_and_errors() -> R<()> {
    // the plan: which layers split how (the rest replicated)
    let plan: Vec<&str> = gpt::tensor_parallel_plan()
        .iter()
        .map(|(p, _)| *p)
        .collect();
    assert_eq!(
        plan,
        [
            "h.*.attn.c_attn",
            "h.*.attn.c_proj",
            "h.*.mlp.c_fc",
            "h.*.mlp.c_proj"
        ]
    );
    let v = Tensor::arange(1.0, 5.0, 1.0, DType::F64)?;
    // (name, rank of 2, expected values): replicated, the row-parallel bias (Partial: whole on
    // rank 0, zeros elsewhere), a column-parallel bias
    let cases: [(&str, usize, [f64; 4]); 4] = [
        ("wte.weight", 1, [1.0, 2.0, 3.0, 4.0]),
        ("h.0.mlp.c_proj.bias", 0, [1.0, 2.0, 3.0, 4.0]),
        ("h.0.mlp.c_proj.bias", 1, [0.0; 4]),
        ("h.3.attn.c_proj.bias", 1, [0.0; 4]),
    ];
    for (name, rank, want) in cases {
        let s = gpt::shard_parameter(name, &v, rank, 2)?;
        assert_eq!(s.to_vec::<f64>()?, want, "{name} on rank {rank}");
    }
    let fc = gpt::shard_parameter("h.0.mlp.c_fc.bias", &v, 1, 2)?;
    assert_eq!(fc.to_vec::<f64>()?, [3.0, 4.0]);
    // c_attn: rank 1 of 2 takes the second half of each of the q, k, v blocks
    let full = Tensor::arange(0.0, 12.0, 1.0, DType::F64)?.reshape(&[12, 1])?;
    let s = gpt::shard_parameter("attn.c_attn.weight", &full, 1, 2)?;
    assert_eq!(s.to_vec::<f64>()?, [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]);
    let cols = gpt::shard_parameter("mlp.c_proj.weight", &full.reshape(&[2, 6])?, 2, 3)?;
    assert_eq!(cols.to_vec::<f64>()?, [4.0, 5.0, 10.0, 11.0]);
    assert!(gpt::shard_parameter("mlp.c_fc.weight", &full, 2, 2).is_err());
    assert!(gpt::shard_parameter("mlp.c_fc.weight", &full, 0, 5).is_err());
    // a tensor without the split dimension, and stacked q/k/v rows that do not split evenly,
    // are refused naming `full` (the first indexed out of bounds, the second dropped rows)
    let arg_of = |r: tp::Result<Tensor>| match r {
        Err(tp::Error::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected an invalid-argument error, got {other:?}"),
    };
    let vector = Tensor::arange(0.0, 8.0, 1.0, DType::F64)?;
    assert_eq!(
        arg_of(gpt::shard_parameter("h.0.mlp.c_proj.weight", &vector, 0, 2)),
        "full"
    );
    let square = Tensor::zeros(&[8, 8], DType::F64)?;
    assert_eq!(
        arg_of(gpt::shard_parameter(
            "h.0.attn.c_attn.weight",
            &square,
            0,
            2
        )),
        "full"
    );
    let scalar = Tensor::scalar(1.0f64);
    assert_eq!(
        arg_of(gpt::shard_parameter("h.0.mlp.c_fc.bias", &scalar, 0, 2)),
        "full"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// training

#[test]
fn short_training_lowers_the_validation_loss() -> R<()> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/data/tinyshakespeare.txt"
    ))?;
    let text: Vec<u8> = text.bytes().take(60_000).collect();
    let mut vocab: Vec<u8> = text.clone();
    vocab.sort_unstable();
    vocab.dedup();
    let ids: Vec<i64> = text
        .iter()
        .map(|c| vocab.binary_search(c).map(|i| i as i64))
        .collect::<Result<_, _>>()
        .map_err(|_| "vocabulary")?;
    let split = ids.len() * 9 / 10;
    let (train, val) = ids.split_at(split);
    let c = GptConfig {
        vocab_size: vocab.len(),
        block_size: 32,
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        dropout: 0.0,
        dtype: DType::F32,
    };
    tp::manual_seed(0);
    let model = Gpt::new(c)?;
    let batch = |data: &[i64], step: usize, b: usize| -> R<(Tensor, Tensor)> {
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for r in 0..b {
            let at = (step * 7919 + r * 104_729) % (data.len() - c.block_size - 1);
            x.extend_from_slice(&data[at..at + c.block_size]);
            y.extend_from_slice(&data[at + 1..at + c.block_size + 1]);
        }
        Ok((
            Tensor::from_vec(x, &[b, c.block_size])?,
            Tensor::from_vec(y, &[b, c.block_size])?,
        ))
    };
    let val_loss = |m: &Gpt| -> R<f64> {
        let _g = tp::no_grad();
        let (x, y) = batch(val, 1, 32)?;
        Ok(m.loss(&x, &y)?.item::<f32>()? as f64)
    };
    let before = val_loss(&model)?;
    let mut opt = AdamW::new(
        model.parameters(),
        AdamWOptions {
            lr: 3e-3,
            ..Default::default()
        },
    )?;
    let steps = 80;
    let mut sched = WarmupCosineLR::new(&mut opt, 10, steps, 0.1)?;
    for step in 0..steps {
        let (x, y) = batch(train, step, 8)?;
        opt.zero_grad()?;
        model.loss(&x, &y)?.backward()?;
        tp::nn::utils::clip_grad_norm_(&model.parameters(), 1.0, 2.0, false)?;
        opt.step()?;
        sched.step(&mut opt)?;
    }
    let after = val_loss(&model)?;
    // from about ln(vocab) = 4 to well below
    assert!(before > 3.5, "initial validation loss {before}");
    assert!(after < before - 0.8, "validation loss {before} -> {after}");
    Ok(())
}
