//! The GPT training step of `gpt_distributed` (4 layers, width 128, 4 heads, context 64,
//! vocabulary 65, float32), batch 16 x 64 tokens, one thread: forward, backward and an AdamW
//! step, in float32 and under autocast bfloat16. Prints two lines in the format `cargo xtask
//! bench-core` reads, beside `benchmarks/torch_gpt.py step` and the anchors'
//! `torch_bf16_step.py` (`gpt step autocast-bf16`).

use std::time::Instant;

use clap::Parser;
use tensorplay as tp;
use tp::models::{Gpt, GptConfig};
use tp::nn::Module;
use tp::optim::{AdamW, AdamWOptions, Optimizer};
use tp::{DType, Tensor};

/// The GPT step benchmark's command line
/// (`cargo bench -p tensorplay-examples --bench gpt_step [-- STEPS]`).
#[derive(Parser, Debug)]
#[command(
    name = "gpt_step",
    about = "The GPT training step of gpt_distributed (batch 16 x 64, one thread), in the line \
             `cargo xtask bench-core` reads."
)]
struct Args {
    /// Run this many steps and print nothing (for profiling).
    steps: Option<usize>,
    /// With STEPS: profile the step under autocast bfloat16.
    #[arg(long)]
    autocast_bf16: bool,
    /// Given by `cargo bench` to every benchmark; nothing changes.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The job's model (seed 0) and AdamW, and one fixed batch.
fn setup() -> tp::Result<(Gpt, AdamW, Tensor, Tensor)> {
    tp::manual_seed(0);
    let model = Gpt::new(GptConfig {
        vocab_size: 65,
        block_size: 64,
        n_layer: 4,
        n_head: 4,
        n_embd: 128,
        dropout: 0.0,
        dtype: DType::F32,
    })?;
    let opt = AdamW::new(
        model.parameters(),
        AdamWOptions {
            lr: 1e-3,
            betas: (0.9, 0.99),
            weight_decay: 0.01,
            ..Default::default()
        },
    )?;
    let ids: Vec<i64> = (0..16 * 65).map(|i| (i * 37 % 65) as i64).collect();
    let x = Tensor::from_vec(ids[..16 * 64].to_vec(), &[16, 64])?;
    let y = Tensor::from_vec(ids[16..16 * 65].to_vec(), &[16, 64])?;
    Ok((model, opt, x, y))
}

/// Microseconds per step (zero_grad, forward and loss, backward, AdamW): the median of 5 x 10
/// steps after 5 warm-up steps; `autocast`: forward and loss under autocast bfloat16 (float32
/// masters), backward outside it. `profile`: run that many steps and return `None`.
fn step_us(autocast: bool, profile: Option<usize>) -> tp::Result<Option<f64>> {
    let (model, mut opt, x, y) = setup()?;
    let mut step = || -> tp::Result<()> {
        opt.zero_grad()?;
        let loss = {
            let _ac = autocast
                .then(|| tp::autocast(tp::Device::Cpu, DType::BF16))
                .transpose()?;
            model.loss(&x, &y)?
        };
        loss.backward()?;
        opt.step()
    };
    if let Some(n) = profile {
        for _ in 0..n {
            step()?;
        }
        return Ok(None);
    }
    for _ in 0..5 {
        step()?;
    }
    let mut runs = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..10 {
            step()?;
        }
        runs.push(t.elapsed().as_secs_f64() / 10.0);
    }
    runs.sort_by(f64::total_cmp);
    Ok(Some(runs[2] * 1e6))
}

fn main() -> tp::Result<()> {
    let args = Args::parse();
    tp::set_num_threads(1);
    // `cargo bench ... -- N [--autocast-bf16]` runs N steps only (for profiling)
    if let Some(n) = args.steps {
        step_us(args.autocast_bf16, Some(n))?;
        return Ok(());
    }
    if let Some(us) = step_us(false, None)? {
        println!("tensorplay-core gpt_step batch16x64  {us:8.1} us/step");
    }
    // beside torch_bf16_step.py's `gpt step autocast-bf16`
    if let Some(us) = step_us(true, None)? {
        println!("tensorplay-core gpt_step_autocast_bf16 batch16x64  {us:8.1} us/step");
    }
    Ok(())
}
