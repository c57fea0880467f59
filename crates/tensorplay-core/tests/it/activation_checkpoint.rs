//! Activation checkpointing (`utils::checkpoint`): gradients with and without it bit-identical
//! for a table of regions (an MLP, a GPT block with dropout, nested checkpoints, ops that save
//! their output, inputs without gradient, several outputs, `retain_graph`, backward on another
//! thread), the random stream left where it was, the peak bytes of a GPT's forward and backward
//! measured against the run without, and every misuse an error, not a panic.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tensorplay::models::{Block, Gpt, GptConfig};
use tensorplay_core::nn::functional::dropout;
use tensorplay_core::nn::{self, Module, Sequential};
use tensorplay_core::utils::checkpoint::{CheckpointWrapper, checkpoint};
use tensorplay_core::{self as tp, DType, Error, Tensor};
use tensorplay_testkit::cpu_world;

/// `f(inputs)` under `checkpoint` when `ac`, directly otherwise.
fn region<F>(ac: bool, f: F, inputs: &[&Tensor]) -> tp::Result<Vec<Tensor>>
where
    F: Fn(&[Tensor]) -> tp::Result<Vec<Tensor>> + Send + Sync + 'static,
{
    if ac {
        checkpoint(f, inputs)
    } else {
        f(&inputs.iter().map(|t| (*t).clone()).collect::<Vec<_>>())
    }
}

fn leaf(shape: &[usize]) -> tp::Result<Tensor> {
    Ok(tp::randn(shape)?.to_dtype(DType::F64)?.requires_grad_(true))
}

/// The gradients of `ts` (an error when one is missing).
fn grads(ts: &[Tensor]) -> tp::Result<Vec<Tensor>> {
    ts.iter()
        .enumerate()
        .map(|(i, t)| {
            t.grad()
                .ok_or_else(|| Error::Autograd(format!("tensor {i} got no gradient")))
        })
        .collect()
}

/// The next draw of the default generator: equal in both runs only if recomputing put the
/// stream back.
fn next_draw() -> tp::Result<Tensor> {
    tp::rand(&[4])
}

fn mlp_block(ac: bool) -> tp::Result<Vec<Tensor>> {
    let mlp = Arc::new(
        Sequential::new()
            .add(nn::Linear::new(6, 24, true)?)
            .add(nn::GELU::new())
            .add(nn::Linear::new(24, 6, true)?),
    );
    let x = leaf(&[5, 6])?
        .to_dtype(DType::F32)?
        .detach()
        .requires_grad_(true);
    let m = mlp.clone();
    let y = region(ac, move |xs| Ok(vec![m.call(&xs[0])?]), &[&x])?.remove(0);
    y.tanh()?.sum()?.backward()?;
    let mut out = grads(&[x])?;
    out.extend(grads(&mlp.parameters())?);
    out.push(y);
    Ok(out)
}

fn gpt_config(dropout: f64) -> GptConfig {
    GptConfig {
        vocab_size: 13,
        block_size: 8,
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        dropout,
        dtype: DType::F64,
    }
}

/// A GPT block in training mode with dropout 0.2, in a [`CheckpointWrapper`] or bare.
fn gpt_block(ac: bool) -> tp::Result<Vec<Tensor>> {
    let mut block = Block::new(&gpt_config(0.2))?;
    block.train(true)?;
    let x = leaf(&[2, 8, 16])?;
    let (y, params) = if ac {
        let w = CheckpointWrapper::new(block);
        (w.call(&x)?, w.parameters())
    } else {
        (block.call(&x)?, block.parameters())
    };
    y.pow_scalar(2.0)?.mean()?.backward()?;
    let mut out = grads(&[x])?;
    out.extend(grads(&params)?);
    out.extend([y, next_draw()?]);
    Ok(out)
}

fn with_dropout(ac: bool) -> tp::Result<Vec<Tensor>> {
    let (x, w) = (leaf(&[4, 7])?, leaf(&[7])?);
    let w2 = w.clone();
    let f = move |xs: &[Tensor]| -> tp::Result<Vec<Tensor>> {
        let h = dropout(&xs[0].mul(&w2)?.tanh()?, 0.5, true)?;
        Ok(vec![dropout(&h.exp()?, 0.3, true)?])
    };
    let y = region(ac, f, &[&x])?.remove(0);
    y.sum()?.backward()?;
    let mut out = grads(&[x, w])?;
    out.extend([y, next_draw()?]);
    Ok(out)
}

fn nested(ac: bool) -> tp::Result<Vec<Tensor>> {
    let (x, w) = (leaf(&[3, 4])?, leaf(&[4])?);
    let w2 = w.clone();
    let outer = move |xs: &[Tensor]| -> tp::Result<Vec<Tensor>> {
        let a = xs[0].mul(&w2)?.erf()?;
        let w3 = w2.clone();
        let inner = move |ys: &[Tensor]| -> tp::Result<Vec<Tensor>> {
            Ok(vec![dropout(&ys[0].exp()?.mul(&w3)?, 0.25, true)?])
        };
        let b = region(true, inner, &[&a])?.remove(0);
        Ok(vec![b.mul(&a)?.tanh()?])
    };
    let y = region(ac, outer, &[&x])?.remove(0);
    y.sum()?.backward()?;
    let mut out = grads(&[x, w])?;
    out.extend([y, next_draw()?]);
    Ok(out)
}

/// exp, tanh and sigmoid save their outputs; the last is also the region's output.
fn saved_outputs(ac: bool) -> tp::Result<Vec<Tensor>> {
    let x = leaf(&[6])?;
    let f = |xs: &[Tensor]| -> tp::Result<Vec<Tensor>> {
        Ok(vec![xs[0].exp()?.tanh()?.mul_scalar(3.0)?.sigmoid()?])
    };
    let y = region(ac, f, &[&x])?.remove(0);
    y.mul(&y)?.sum()?.backward()?;
    Ok(vec![grads(&[x])?.remove(0), y])
}

/// One input without gradient, one with; a captured parameter.
fn inputs_without_grad(ac: bool) -> tp::Result<Vec<Tensor>> {
    let x = tp::randn(&[3, 5])?.to_dtype(DType::F64)?;
    let (z, w) = (leaf(&[3, 5])?, leaf(&[5])?);
    let w2 = w.clone();
    let f = move |xs: &[Tensor]| -> tp::Result<Vec<Tensor>> {
        Ok(vec![xs[0].mul(&w2)?.add(&xs[1].sigmoid()?)?.exp()?])
    };
    let y = region(ac, f, &[&x, &z])?.remove(0);
    y.sum()?.backward()?;
    if x.grad().is_some() {
        return Err(Error::Autograd("the input without grad got one".into()));
    }
    let mut out = grads(&[z, w])?;
    out.push(y);
    Ok(out)
}

fn several_outputs(ac: bool) -> tp::Result<Vec<Tensor>> {
    let (x, w) = (leaf(&[4, 3])?, leaf(&[3, 3])?);
    let w2 = w.clone();
    let f = move |xs: &[Tensor]| -> tp::Result<Vec<Tensor>> {
        let h = xs[0].matmul(&w2)?.tanh()?;
        Ok(vec![h.exp()?, h.mul(&xs[0])?, h.sum()?])
    };
    let ys = region(ac, f, &[&x])?;
    ys[0]
        .sum()?
        .add(&ys[1].pow_scalar(2.0)?.sum()?)?
        .add(&ys[2])?
        .backward()?;
    let mut out = grads(&[x, w])?;
    out.extend(ys);
    Ok(out)
}

/// Two backward passes through one graph: the second recomputes again.
fn retain_graph_twice(ac: bool) -> tp::Result<Vec<Tensor>> {
    let (x, w) = (leaf(&[5])?, leaf(&[5])?);
    let w2 = w.clone();
    let f = move |xs: &[Tensor]| -> tp::Result<Vec<Tensor>> {
        Ok(vec![
            dropout(&xs[0].mul(&w2)?.exp()?, 0.4, true)?
                .add_scalar(1.0)?
                .log()?,
        ])
    };
    let y = region(ac, f, &[&x])?.remove(0).sum()?;
    y.backward_with(None, true, false)?;
    let first = grads(&[x.clone(), w.clone()])?;
    y.backward_with(None, true, false)?;
    let mut out = first;
    out.extend(grads(&[x, w])?);
    out.push(next_draw()?);
    Ok(out)
}

fn backward_on_another_thread(ac: bool) -> tp::Result<Vec<Tensor>> {
    let (x, w) = (leaf(&[4, 4])?, leaf(&[4, 4])?);
    let w2 = w.clone();
    let f = move |xs: &[Tensor]| -> tp::Result<Vec<Tensor>> {
        Ok(vec![dropout(&xs[0].matmul(&w2)?.gelu_tanh()?, 0.5, true)?])
    };
    let y = region(ac, f, &[&x])?.remove(0).sum()?;
    std::thread::spawn(move || y.backward())
        .join()
        .map_err(|_| Error::Autograd("the backward thread panicked".into()))??;
    let mut out = grads(&[x, w])?;
    out.push(next_draw()?);
    Ok(out)
}

type Case = (&'static str, fn(bool) -> tp::Result<Vec<Tensor>>);

const CASES: [Case; 9] = [
    ("an MLP block", mlp_block),
    ("a GPT block with dropout, wrapped", gpt_block),
    ("dropout masks repeat", with_dropout),
    ("nested checkpoints", nested),
    ("ops that save their output", saved_outputs),
    ("inputs that do not require grad", inputs_without_grad),
    ("several outputs", several_outputs),
    ("retain_graph twice", retain_graph_twice),
    ("backward on another thread", backward_on_another_thread),
];

/// The bit patterns of a tensor's elements.
fn bits(t: &Tensor) -> tp::Result<Vec<u64>> {
    Ok(t.to_vec_f64()?.iter().map(|v| v.to_bits()).collect())
}

/// Runs the case without and with checkpointing from the same seed; every tensor returned
/// (gradients, outputs, the next random draw) must be bit-identical.
fn check((name, run): Case) -> Result<(), String> {
    let go = |ac: bool| {
        tp::manual_seed(17);
        run(ac).map_err(|e| format!("{name} (checkpoint {ac}): {e}"))
    };
    let (plain, ckpt) = (go(false)?, go(true)?);
    if plain.len() != ckpt.len() {
        return Err(format!("{name}: {} tensors vs {}", plain.len(), ckpt.len()));
    }
    for (i, (a, b)) in plain.iter().zip(&ckpt).enumerate() {
        let (a, b) = (
            bits(a).map_err(|e| e.to_string())?,
            bits(b).map_err(|e| e.to_string())?,
        );
        if a != b {
            return Err(format!("{name}: tensor {i} differs with checkpoint"));
        }
    }
    Ok(())
}

/// In a process of its own: the cases seed and draw from the process-wide generator, which
/// other tests running beside them would move.
#[test]
fn gradients_are_bit_identical_with_checkpoint() {
    cpu_world(1, Duration::from_secs(120), |_| -> Result<(), String> {
        let failures: Vec<String> = CASES.into_iter().filter_map(|c| check(c).err()).collect();
        if failures.is_empty() {
            Ok(())
        } else {
            Err(format!("{failures:#?}"))
        }
    });
}

#[test]
fn without_recording_the_function_just_runs() -> tp::Result<()> {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let x = leaf(&[3])?;
    let y = {
        let _g = tp::no_grad();
        checkpoint(
            move |xs| {
                c.fetch_add(1, Ordering::Relaxed);
                Ok(vec![xs[0].exp()?])
            },
            &[&x],
        )?
        .remove(0)
    };
    assert!(!y.requires_grad());
    assert_eq!(calls.load(Ordering::Relaxed), 1);
    Ok(())
}

/// The GPT test model with every block checkpointed: the peak bytes of one forward and
/// backward (above what was allocated before) fall by at least 40%, gradients identical.
///
/// The size is one where activations dominate, as in training: 4 blocks of width 32 over a
/// batch of 8 sequences of 64 tokens, so the per-block attention scores (`[8, 4, 64, 64]`,
/// kept several times: scores, softmax, dropout) and MLP activations outweigh the ~60k
/// parameters and their gradients. Runs in a process of its own, so that other tests'
/// allocations do not move the peak.
#[test]
fn checkpointing_every_block_lowers_the_peak_by_40_percent() {
    cpu_world(1, Duration::from_secs(120), |_| -> Result<(), String> {
        let config = GptConfig {
            vocab_size: 32,
            block_size: 64,
            n_layer: 4,
            n_head: 4,
            n_embd: 32,
            dropout: 0.1,
            dtype: DType::F32,
        };
        let tok: Vec<i64> = (0..8 * 65).map(|i| ((i * 7 + i / 5) % 32) as i64).collect();
        let all = Tensor::from_vec(tok, &[8, 65]).map_err(|e| e.to_string())?;
        let run = |ac: bool| -> tp::Result<(usize, Vec<Vec<u64>>)> {
            tp::manual_seed(3);
            let mut gpt = Gpt::new(config)?;
            gpt.train(true)?;
            gpt.set_activation_checkpointing(ac);
            let (x, y) = (
                all.narrow(1, 0, 64)?.contiguous()?,
                all.narrow(1, 1, 64)?.contiguous()?,
            );
            let base = tp::memory::allocated_bytes();
            tp::memory::reset_peak();
            gpt.loss(&x, &y)?.backward()?;
            let peak = tp::memory::peak_allocated_bytes().saturating_sub(base);
            let g = gpt
                .parameters()
                .iter()
                .map(|p| p.grad().map_or(Ok(vec![]), |g| bits(&g)))
                .collect::<tp::Result<_>>()?;
            Ok((peak, g))
        };
        let (plain, plain_g) = run(false).map_err(|e| e.to_string())?;
        let (ckpt, ckpt_g) = run(true).map_err(|e| e.to_string())?;
        let ratio = ckpt as f64 / plain as f64;
        if plain_g != ckpt_g {
            return Err("gradients differ with per-block checkpointing".into());
        }
        if ratio > 0.6 {
            return Err(format!(
                "peak with checkpointing {ckpt} B is {:.1}% of the {plain} B without; want at \
                 most 60%",
                100.0 * ratio
            ));
        }
        eprintln!(
            "activation checkpointing: peak {ckpt} B vs {plain} B ({:.1}%)",
            100.0 * ratio
        );
        Ok(())
    });
}

/// A function that saves one more tensor each time it runs.
fn growing() -> impl Fn(&[Tensor]) -> tp::Result<Vec<Tensor>> + Send + Sync + 'static {
    let calls = AtomicUsize::new(0);
    move |xs| {
        let mut h = xs[0].exp()?;
        for _ in 0..calls.fetch_add(1, Ordering::Relaxed) {
            h = h.exp()?;
        }
        Ok(vec![h])
    }
}

/// A function whose saved tensor changes shape when recomputed.
fn reshaping() -> impl Fn(&[Tensor]) -> tp::Result<Vec<Tensor>> + Send + Sync + 'static {
    let calls = AtomicUsize::new(0);
    move |xs| {
        let n = if calls.fetch_add(1, Ordering::Relaxed) == 0 {
            4
        } else {
            2
        };
        Ok(vec![xs[0].narrow(0, 0, n)?.exp()?.sum()?])
    }
}

fn count_changes() -> tp::Result<()> {
    let x = leaf(&[3])?;
    checkpoint(growing(), &[&x])?[0].sum()?.backward()
}

fn shape_changes() -> tp::Result<()> {
    let x = leaf(&[4])?;
    checkpoint(reshaping(), &[&x])?[0].backward()
}

fn input_modified_in_place() -> tp::Result<()> {
    let x = leaf(&[3])?;
    let a = x.mul_scalar(2.0)?;
    let y = checkpoint(|xs| Ok(vec![xs[0].mul(&xs[0])?]), &[&a])?.remove(0);
    {
        let _g = tp::no_grad();
        a.add_scalar_(1.0)?;
    }
    y.sum()?.backward()
}

fn parameter_modified_in_place() -> tp::Result<()> {
    let (x, w) = (leaf(&[3])?, leaf(&[3])?);
    let w2 = w.clone();
    let y = checkpoint(move |xs| Ok(vec![xs[0].mul(&w2)?.tanh()?]), &[&x])?.remove(0);
    {
        let _g = tp::no_grad();
        w.mul_scalar_(0.5)?;
    }
    y.sum()?.backward()
}

fn second_backward_without_retain() -> tp::Result<()> {
    let x = leaf(&[3])?;
    let y = checkpoint(|xs| Ok(vec![xs[0].exp()?.erf()?]), &[&x])?
        .remove(0)
        .sum()?;
    y.backward()?;
    y.backward()
}

fn create_graph() -> tp::Result<()> {
    let x = leaf(&[3])?;
    let y = checkpoint(|xs| Ok(vec![xs[0].exp()?]), &[&x])?
        .remove(0)
        .sum()?;
    y.backward_with(None, false, true)
}

fn module_changed_before_backward() -> tp::Result<()> {
    let mut w = CheckpointWrapper::new(nn::Linear::new(3, 3, true)?);
    let y = w
        .call(&leaf(&[2, 3])?.to_dtype(DType::F32)?)?
        .tanh()?
        .sum()?;
    w.train(false)?;
    y.backward()
}

fn error_in_forward() -> tp::Result<()> {
    let x = leaf(&[3])?;
    checkpoint(
        |xs| Ok(vec![xs[0].matmul(&xs[0].reshape(&[3, 1])?.t()?)?]),
        &[&x],
    )?;
    Ok(())
}

/// (case, run, expected variant, parts of the message)
type Bad = (
    &'static str,
    fn() -> tp::Result<()>,
    &'static str,
    &'static [&'static str],
);

const BAD: [Bad; 8] = [
    (
        "count changes",
        count_changes,
        "Autograd",
        &["saved 1 tensors", "but 2", "same operations"],
    ),
    (
        "shape changes",
        shape_changes,
        "Autograd",
        &["saved tensor 0", "[4]", "[2]"],
    ),
    (
        "input modified in place",
        input_modified_in_place,
        "Autograd",
        &["in-place", "version"],
    ),
    (
        "parameter modified in place",
        parameter_modified_in_place,
        "Autograd",
        &["in-place"],
    ),
    (
        "second backward",
        second_backward_without_retain,
        "Autograd",
        &["second time", "retain_graph"],
    ),
    (
        "create_graph",
        create_graph,
        "Autograd",
        &["create_graph", "not supported"],
    ),
    (
        "module changed",
        module_changed_before_backward,
        "Autograd",
        &["changed", "run backward before"],
    ),
    ("error in the forward", error_in_forward, "any", &[]),
];

fn check_bad((name, run, variant, parts): Bad) -> Result<(), String> {
    let e = match std::panic::catch_unwind(run) {
        Err(_) => return Err(format!("{name}: panicked")),
        Ok(Ok(())) => return Err(format!("{name}: no error")),
        Ok(Err(e)) => e,
    };
    let kind = match &e {
        Error::Autograd(_) => "Autograd",
        _ => "other",
    };
    if variant != "any" && kind != variant {
        return Err(format!("{name}: {kind} error {e}, want {variant}"));
    }
    let msg = e.to_string();
    match parts.iter().find(|p| !msg.contains(*p)) {
        Some(p) => Err(format!("{name}: {msg:?} does not say {p:?}")),
        None => Ok(()),
    }
}

#[test]
fn misuse_is_an_error_not_a_panic() {
    let failures: Vec<String> = BAD.into_iter().filter_map(|c| check_bad(c).err()).collect();
    assert!(failures.is_empty(), "{failures:#?}");
}
