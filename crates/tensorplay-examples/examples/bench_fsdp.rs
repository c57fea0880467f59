//! One training step of the GPT fully sharded (`fully_shard` on each block, then the root),
//! beside the same model with `DistributedDataParallel` and alone, measured as PyTorch's anchor
//! `../shared/anchors/torch_fsdp_step.py` measures FSDP2 over gloo, and printed in the same line
//! shape, so `cargo xtask bench-fsdp` can put the two side by side.
//!
//! Usage: `cargo run --release -p tensorplay-examples --example bench_fsdp [world] [layers]
//! [width] [steps]` (defaults 2 8 256 20).
//!
//! Every rank trains `tensorplay::models::Gpt` (the anchor's layout: `layers` blocks of width
//! `width`, 4 heads, context 64, vocabulary 65, tanh GELU, tied head, dropout 0, float32) on
//! its own random batch of 8 sequences (seeded by its rank), AdamW (lr 1e-3, betas 0.9/0.99,
//! weight decay 0.01), one thread per rank. Three modes, each in fresh processes: `local` (the
//! model alone, all ranks at once), `ddp` (`DistributedDataParallel`, default options) and
//! `fsdp`. Step = zero_grad + forward + loss + backward + optimizer step, the median of `steps`
//! timed steps after 5 warm-up steps. Prints, from rank 0:
//!
//! ```text
//! tensorplay-fsdp params N world W
//! tensorplay-fsdp local step X us
//! tensorplay-fsdp ddp step Y us
//! tensorplay-fsdp fsdp step Z us
//! tensorplay-fsdp state bytes per rank ddp A fsdp B
//! ```
//!
//! State bytes: parameters, gradients and AdamW state on rank 0 after a step
//! (`gpt_checks::state_bytes`, the anchor's definition).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use tensorplay as tp;
use tp::distributed::{self as dist, fsdp};
use tp::models::{Gpt, GptConfig};
use tp::nn::Module;
use tp::nn::parallel::DistributedDataParallel as Ddp;
use tp::optim::{AdamW, AdamWOptions, Optimizer};

use tensorplay_examples::gpt_checks::state_bytes;

type R<T = ()> = Result<T, dist::SpawnError>;

const WARMUP: usize = 5;
const BATCH: usize = 8;
const CONTEXT: usize = 64;
const VOCAB: usize = 65;

/// The command line: `[world] [layers] [width] [steps]`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "bench_fsdp",
    about = "One training step of the GPT fully sharded, with DDP and alone, in the lines \
             `cargo xtask bench-fsdp` reads."
)]
struct Args {
    /// Ranks (processes) on this machine.
    #[arg(default_value_t = 2, value_parser = at_least_one)]
    world: usize,
    /// Transformer blocks.
    #[arg(default_value_t = 8, value_parser = at_least_one)]
    layers: usize,
    /// Width (a multiple of the 4 heads).
    #[arg(default_value_t = 256, value_parser = at_least_one)]
    width: usize,
    /// Timed steps (after 5 warm-up steps).
    #[arg(default_value_t = 20, value_parser = at_least_one)]
    steps: usize,
}

/// A whole number >= 1.
fn at_least_one(v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("expected a whole number >= 1".into()),
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Local,
    Ddp,
    Fsdp,
}

fn model(a: &Args) -> tp::Result<Gpt> {
    tp::manual_seed(0);
    Gpt::new(GptConfig {
        vocab_size: VOCAB,
        block_size: CONTEXT,
        n_layer: a.layers,
        n_head: 4,
        n_embd: a.width,
        dropout: 0.0,
        dtype: tp::DType::F32,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn run(rank: usize, mode: Mode, a: &Args) -> R {
    tp::set_num_threads(1);
    dist::init_process_group(
        "cpu",
        dist::InitOptions {
            timeout: Duration::from_secs(300),
            ..Default::default()
        },
    )?;
    tp::manual_seed(rank as u64);
    let xy = tp::randint(0, VOCAB as i64, &[BATCH, CONTEXT + 1])?;
    let (x, y) = (
        xy.narrow(1, 0, CONTEXT)?.contiguous()?,
        xy.narrow(1, 1, CONTEXT)?.contiguous()?,
    );
    let mut gpt = model(a)?;
    let params: usize = gpt.parameters().iter().map(|p| p.numel()).sum();
    let wrapped: Box<dyn Module> = match mode {
        Mode::Local => Box::new(gpt),
        Mode::Ddp => Box::new(Ddp::new(gpt)?),
        Mode::Fsdp => {
            for block in gpt.h.iter_mut() {
                fsdp::fully_shard(block, fsdp::FsdpOptions::default())?;
            }
            fsdp::fully_shard(&mut gpt, fsdp::FsdpOptions::default())?;
            Box::new(gpt)
        }
    };
    let opts = AdamWOptions {
        lr: 1e-3,
        betas: (0.9, 0.99),
        weight_decay: 0.01,
        ..Default::default()
    };
    let mut opt = AdamW::new(wrapped.parameters(), opts)?;
    let mut step = || -> tp::Result<()> {
        opt.zero_grad()?;
        let logits = wrapped.call(&x)?;
        let n = BATCH * CONTEXT;
        tp::nn::functional::cross_entropy(&logits.reshape(&[n, VOCAB])?, &y.reshape(&[n])?)?
            .backward()?;
        opt.step()
    };
    for _ in 0..WARMUP {
        step()?;
    }
    dist::barrier(None)?;
    let mut ts = Vec::with_capacity(a.steps);
    for _ in 0..a.steps {
        let t = Instant::now();
        step()?;
        ts.push(t.elapsed().as_secs_f64());
    }
    let bytes = state_bytes(&wrapped.parameters(), &opt)?;
    if rank == 0 {
        let name = match mode {
            Mode::Local => "local",
            Mode::Ddp => "ddp",
            Mode::Fsdp => "fsdp",
        };
        let mut out = String::new();
        if mode == Mode::Local {
            out.push_str(&format!(
                "tensorplay-fsdp params {params} world {}\n",
                a.world
            ));
        }
        out.push_str(&format!(
            "tensorplay-fsdp {name} step {:.1} us\n",
            median(ts) * 1e6
        ));
        out.push_str(&format!("state {name} {bytes}\n"));
        let path = report_path();
        let before = std::fs::read_to_string(&path).unwrap_or_default();
        std::fs::write(&path, before + &out)?;
    }
    dist::barrier(None)?;
    dist::destroy_process_group()?;
    Ok(())
}

fn report_path() -> std::path::PathBuf {
    let parent =
        std::env::var("TENSORPLAY_BENCH_PARENT").unwrap_or_else(|_| std::process::id().to_string());
    std::env::temp_dir().join(format!("tensorplay-bench-fsdp-{parent}.txt"))
}

fn main() -> ExitCode {
    let args = Args::parse();
    let parent = std::process::id().to_string();
    let report = std::env::temp_dir().join(format!("tensorplay-bench-fsdp-{parent}.txt"));
    let _ = std::fs::remove_file(&report);
    for mode in [Mode::Local, Mode::Ddp, Mode::Fsdp] {
        let mut opts = dist::SpawnOptions::new(args.world);
        opts.timeout = Some(Duration::from_secs(1800));
        opts.env
            .push(("TENSORPLAY_BENCH_PARENT".into(), parent.clone()));
        let a = args.clone();
        if let Err(e) = dist::spawn_with(opts, move |rank| run(rank, mode, &a)) {
            eprintln!("bench_fsdp ({mode:?}): {e}");
            return ExitCode::FAILURE;
        }
    }
    let text = std::fs::read_to_string(&report).unwrap_or_default();
    let _ = std::fs::remove_file(&report);
    let mut state = [None, None];
    for line in text.lines() {
        match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["state", "ddp", b] => state[0] = Some(b.to_string()),
            ["state", "fsdp", b] => state[1] = Some(b.to_string()),
            ["state", ..] => {}
            _ => println!("{line}"),
        }
    }
    match state {
        [Some(d), Some(f)] => println!("tensorplay-fsdp state bytes per rank ddp {d} fsdp {f}"),
        _ => {
            eprintln!("bench_fsdp: a mode reported no state bytes:\n{text}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
