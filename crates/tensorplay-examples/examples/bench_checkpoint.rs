//! Distributed checkpoints of the GPT fully sharded with its AdamW state, measured as PyTorch's
//! anchor `benchmarks/torch_dcp.py` measures DCP over gloo, and printed in the same line shape,
//! so `cargo xtask bench-checkpoint` can put the two side by side.
//!
//! Usage: `cargo run --release -p tensorplay-examples --example bench_checkpoint DIR [world]
//! [layers] [width] [rounds]` (defaults 2 8 768 1). `DIR` must be on a disk (not tmpfs): the
//! checkpoints are written under it and removed at the end.
//!
//! Every rank builds `tensorplay::models::Gpt` (the anchor's layout: `layers` blocks of width
//! `width`, 4 heads, context 64, vocabulary 65, tied head, float32: 8 x 768 is about 57 M
//! parameters), fully shards each block and then the root, and takes one AdamW step on a
//! random batch of 4 sequences so that the optimizer's state exists. Then, per round:
//! `checkpoint::save_state` of an `AppState` (model and optimizer; files and metadata fsynced
//! before the commit), `checkpoint::load_state` back into the same model and optimizer, and
//! `checkpoint::async_save` of the same state, timing how long the call blocks the training
//! thread (including making the state dict) and how long until the handle's `wait` returns. One
//! thread per rank. Rank 0 prints:
//!
//! ```text
//! tensorplay-dcp bytes B
//! tensorplay-dcp round R save_s S load_s L async_blocking_s A async_total_s T
//! ```
//!
//! `B` counts the state dict's tensors across all ranks (each shard once), as the anchor does.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use tensorplay as tp;
use tp::distributed::checkpoint::{self as dcp, AppState, StateValue, Stateful};
use tp::distributed::{self as dist, ReduceOp, fsdp};
use tp::models::{Gpt, GptConfig};
use tp::nn::Module;
use tp::optim::{AdamW, AdamWOptions, Optimizer};

type R<T = ()> = Result<T, dist::SpawnError>;

const CONTEXT: usize = 64;
const VOCAB: usize = 65;

/// The command line: `DIR [world] [layers] [width] [rounds]`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "bench_checkpoint",
    about = "Distributed checkpoints (save, load, async save) of the fully sharded GPT with its \
             AdamW state, in the lines `cargo xtask bench-checkpoint` reads."
)]
struct Args {
    /// The folder the checkpoints are written under (on a disk, not tmpfs).
    dir: PathBuf,
    /// Ranks (processes) on this machine.
    #[arg(default_value_t = 2, value_parser = at_least_one)]
    world: usize,
    /// Transformer blocks.
    #[arg(default_value_t = 8, value_parser = at_least_one)]
    layers: usize,
    /// Width (a multiple of the 4 heads).
    #[arg(default_value_t = 768, value_parser = at_least_one)]
    width: usize,
    /// Rounds of save, load and async save.
    #[arg(default_value_t = 1, value_parser = at_least_one)]
    rounds: usize,
}

/// A whole number >= 1.
fn at_least_one(v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("expected a whole number >= 1".into()),
    }
}

fn run(rank: usize, a: &Args) -> R {
    tp::set_num_threads(1);
    dist::init_process_group(
        "cpu",
        dist::InitOptions {
            timeout: Duration::from_secs(600),
            ..Default::default()
        },
    )?;
    tp::manual_seed(0);
    let mut gpt = Gpt::new(GptConfig {
        vocab_size: VOCAB,
        block_size: CONTEXT,
        n_layer: a.layers,
        n_head: 4,
        n_embd: a.width,
        dropout: 0.0,
        dtype: tp::DType::F32,
    })?;
    for block in gpt.h.iter_mut() {
        fsdp::fully_shard(block, fsdp::FsdpOptions::default())?;
    }
    fsdp::fully_shard(&mut gpt, fsdp::FsdpOptions::default())?;
    let mut opt = AdamW::new(gpt.parameters(), AdamWOptions::default())?;
    tp::manual_seed(rank as u64);
    let xy = tp::randint(0, VOCAB as i64, &[4, CONTEXT + 1])?;
    let (x, y) = (
        xy.narrow(1, 0, CONTEXT)?.contiguous()?,
        xy.narrow(1, 1, CONTEXT)?.contiguous()?,
    );
    let n = 4 * CONTEXT;
    let logits = gpt.call(&x)?;
    tp::nn::functional::cross_entropy(&logits.reshape(&[n, VOCAB])?, &y.reshape(&[n])?)?
        .backward()?;
    opt.step()?;
    let mut app = AppState {
        model: &mut gpt,
        optimizer: Some(&mut opt),
    };
    let mine: usize = app
        .state_dict()?
        .values()
        .filter_map(|v| match v {
            StateValue::Tensor { local, .. } => Some(local.numel() * local.dtype().size_in_bytes()),
            _ => None,
        })
        .sum();
    let bytes = tp::Tensor::from_vec(vec![mine as i64], &[1])?;
    dist::all_reduce(&bytes, ReduceOp::Sum, None)?;
    if rank == 0 {
        println!("tensorplay-dcp bytes {}", bytes.item::<i64>()?);
    }
    for r in 0..a.rounds {
        let path = a.dir.join(format!("round{r}"));
        dist::barrier(None)?;
        let t0 = Instant::now();
        dcp::save_state(&[("app", &app)], &path, None)?;
        dist::barrier(None)?;
        let save_s = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        dcp::load_state(&mut [("app", &mut app)], &path, None)?;
        dist::barrier(None)?;
        let load_s = t0.elapsed().as_secs_f64();
        let apath = a.dir.join(format!("round{r}-async"));
        dist::barrier(None)?;
        let t0 = Instant::now();
        let handle = dcp::async_save(&app.state_dict()?, &apath, None)?;
        let blocking = t0.elapsed().as_secs_f64();
        handle.wait()?;
        dist::barrier(None)?;
        let total = t0.elapsed().as_secs_f64();
        if rank == 0 {
            println!(
                "tensorplay-dcp round {r} save_s {save_s:.3} load_s {load_s:.3} \
                 async_blocking_s {blocking:.3} async_total_s {total:.3}"
            );
            let _ = std::fs::remove_dir_all(&path);
            let _ = std::fs::remove_dir_all(&apath);
        }
        dist::barrier(None)?;
    }
    dist::destroy_process_group()?;
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = std::fs::create_dir_all(&args.dir) {
        eprintln!("bench_checkpoint: {}: {e}", args.dir.display());
        return ExitCode::FAILURE;
    }
    let mut opts = dist::SpawnOptions::new(args.world);
    opts.timeout = Some(Duration::from_secs(1800));
    let a = args.clone();
    if let Err(e) = dist::spawn_with(opts, move |rank| run(rank, &a)) {
        eprintln!("bench_checkpoint: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
