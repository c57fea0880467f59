//! One training step of the GPT pipelined over 2 ranks, measured as PyTorch's anchor
//! `../shared/anchors/torch_pipeline_step.py` measures `torch.distributed.pipelining` over
//! gloo, and printed in the same line shape, so `cargo xtask bench-pp` can put the two side by
//! side.
//!
//! Usage: `cargo run --release -p tensorplay-examples --example bench_pp [microbatches]
//! [layers] [width] [steps]` (defaults 4 8 256 10).
//!
//! The model is `tensorplay::models::Gpt` in the anchor's layout (`layers` blocks of width
//! `width`, 4 heads, context 64, vocabulary 65, float32, dropout 0) built from seed 0 on every
//! rank and split by `Gpt::pipeline_stage`: 2 stages (the first half of the blocks with the
//! embeddings; the rest with the final LayerNorm and the head, untied: nothing sums the head's
//! gradient with the embedding's), or 4 stages, 2 per rank, for the interleaved schedules. The
//! batch is one fixed random batch of 16 sequences (seed 0) split into `microbatches`; loss
//! averaged over micro-batches; AdamW (lr 1e-3, betas 0.9/0.99, weight decay 0.01); one
//! thread per rank. Step = zero_grad + the schedule's step + optimizer step; 5 warm-up steps,
//! then the median of `steps` timed steps, the slowest rank's. Prints:
//!
//! ```text
//! tensorplay-pp single step X us
//! tensorplay-pp gpipe step Y us bubble B theory T imbalance I
//! tensorplay-pp 1f1b step Z us bubble B theory T imbalance I
//! tensorplay-pp interleaved step Z us bubble B theory T imbalance I
//! tensorplay-pp zero-bubble step Z us bubble B theory T imbalance I
//! ```
//!
//! Bubble: per rank `1 - (time in compute actions) / (time in the schedule's step)`, medians
//! over the timed steps, averaged over the ranks; theory: the schedule's `(p - 1) / (v m + p -
//! 1)`; imbalance: the ranks' largest compute time over their smallest.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use tensorplay as tp;
use tp::Tensor;
use tp::distributed::pipelining::{LossFn, PipelineSchedule, PipelineStage, ScheduleKind, loss_fn};
use tp::distributed::{self as dist};
use tp::models::{Gpt, GptConfig};
use tp::nn::Module;
use tp::optim::{AdamW, AdamWOptions, Optimizer};

type R<T = ()> = Result<T, dist::SpawnError>;

const WARMUP: usize = 5;
const BATCH: usize = 16;
const CONTEXT: usize = 64;
const VOCAB: usize = 65;
const RANKS: usize = 2;

/// The command line: `[microbatches] [layers] [width] [steps]`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "bench_pp",
    about = "One pipelined GPT training step per schedule, in the lines `cargo xtask bench-pp` reads."
)]
struct Args {
    /// Micro-batches per batch of 16 (a multiple of 2 that divides 16).
    #[arg(default_value_t = 4)]
    microbatches: usize,
    /// Transformer blocks (at least 4).
    #[arg(default_value_t = 8)]
    layers: usize,
    /// Width (a multiple of the 4 heads).
    #[arg(default_value_t = 256)]
    width: usize,
    /// Timed steps (after 5 warm-up steps).
    #[arg(default_value_t = 10)]
    steps: usize,
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

fn batch() -> tp::Result<(Tensor, Tensor)> {
    tp::manual_seed(0);
    let xy = tp::randint(0, VOCAB as i64, &[BATCH, CONTEXT + 1])?;
    Ok((
        xy.narrow(1, 0, CONTEXT)?.contiguous()?,
        xy.narrow(1, 1, CONTEXT)?.contiguous()?,
    ))
}

fn gpt_loss() -> LossFn {
    loss_fn(|logits, y| {
        let n = y.numel();
        tp::nn::functional::cross_entropy(&logits.reshape(&[n, VOCAB])?, &y.reshape(&[n])?)
    })
}

fn adamw(params: Vec<Tensor>) -> tp::Result<AdamW> {
    AdamW::new(
        params,
        AdamWOptions {
            lr: 1e-3,
            betas: (0.9, 0.99),
            weight_decay: 0.01,
            ..Default::default()
        },
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The single-process step on the whole batch (the unsplit model, one thread).
fn single(a: &Args) -> tp::Result<f64> {
    tp::set_num_threads(1);
    let gpt = model(a)?;
    let (x, y) = batch()?;
    let mut opt = adamw(gpt.parameters())?;
    let f = gpt_loss();
    let mut ts = vec![];
    for i in 0..WARMUP + a.steps {
        let t = Instant::now();
        opt.zero_grad()?;
        f(&gpt.call(&x)?, &y)?.backward()?;
        opt.step()?;
        if i >= WARMUP {
            ts.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(median(ts))
}

/// One schedule's timed steps on this rank: (its slowest rank's median step, mean bubble,
/// imbalance).
fn pipelined(rank: usize, kind: ScheduleKind, a: &Args) -> tp::Result<(f64, f64, f64, f64)> {
    let group = dist::default_group("bench_pp")?;
    let v = if kind.is_multi_stage() { 2 } else { 1 };
    let stages_total = RANKS * v;
    let full = model(a)?;
    let mut stages = vec![];
    for s in (0..v).map(|i| rank + i * RANKS) {
        stages.push(PipelineStage::new(
            full.pipeline_stage(s, stages_total)?,
            s,
            stages_total,
            &group,
        )?);
    }
    drop(full);
    let params: Vec<Tensor> = stages.iter().flat_map(PipelineStage::parameters).collect();
    let mut opt = adamw(params)?;
    let mut sched = PipelineSchedule::new(kind, stages, a.microbatches, Some(gpt_loss()))?;
    let theory = kind.theoretical_bubble(&sched.shape());
    let (x, y) = batch()?;
    let (mut step_us, mut sched_us, mut compute_us) = (vec![], vec![], vec![]);
    for i in 0..WARMUP + a.steps {
        if i == WARMUP {
            dist::barrier(None)?;
        }
        let t = Instant::now();
        opt.zero_grad()?;
        let mut losses = vec![];
        let ts = Instant::now();
        if rank == 0 {
            sched.step(&x)?;
        } else {
            sched.step_with_target(&y, &mut losses)?;
        }
        let in_sched = ts.elapsed().as_secs_f64() * 1e6;
        opt.step()?;
        if i >= WARMUP {
            step_us.push(t.elapsed().as_secs_f64() * 1e6);
            sched_us.push(in_sched);
            compute_us.push(sched.last_compute_time().as_secs_f64() * 1e6);
        }
    }
    let mine = (
        median(step_us),
        1.0 - median(compute_us.clone()) / median(sched_us),
        median(compute_us),
    );
    let all = dist::all_gather_object(&mine, None)?;
    let slowest = all.iter().map(|m| m.0).fold(0.0, f64::max);
    let bubble = all.iter().map(|m| m.1).sum::<f64>() / all.len() as f64;
    let (hi, lo) = all
        .iter()
        .fold((0.0f64, f64::MAX), |(h, l), m| (h.max(m.2), l.min(m.2)));
    Ok((slowest, bubble, theory, hi / lo))
}

fn run(rank: usize, a: &Args) -> R {
    tp::set_num_threads(1);
    dist::init_process_group(
        "cpu",
        dist::InitOptions {
            timeout: Duration::from_secs(300),
            ..Default::default()
        },
    )?;
    let mut out = String::new();
    for (name, kind) in [
        ("gpipe", ScheduleKind::GPipe),
        ("1f1b", ScheduleKind::OneFOneB),
        ("interleaved", ScheduleKind::Interleaved1F1B),
        ("zero-bubble", ScheduleKind::InterleavedZeroBubble),
    ] {
        let (step, bubble, theory, imbalance) = pipelined(rank, kind, a)?;
        out.push_str(&format!("tensorplay-pp {name} step {step:.1} us bubble {bubble:.4} theory {theory:.4} imbalance {imbalance:.3}\n"));
    }
    if rank == 0 {
        std::fs::write(report_path(), out)?;
    }
    dist::barrier(None)?;
    dist::destroy_process_group()?;
    Ok(())
}

fn report_path() -> std::path::PathBuf {
    let parent =
        std::env::var("TENSORPLAY_BENCH_PARENT").unwrap_or_else(|_| std::process::id().to_string());
    std::env::temp_dir().join(format!("tensorplay-bench-pp-{parent}.txt"))
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.layers < 4
        || !args.microbatches.is_multiple_of(RANKS)
        || args.microbatches == 0
        || !BATCH.is_multiple_of(args.microbatches)
    {
        eprintln!("bench_pp: need layers >= 4 and micro-batches a multiple of 2 that divides 16");
        return ExitCode::FAILURE;
    }
    if dist::spawn::is_spawned_child() {
        // a rank: spawn runs it below
    } else {
        match single(&args) {
            Ok(us) => println!("tensorplay-pp single step {us:.1} us"),
            Err(e) => {
                eprintln!("bench_pp (single): {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let parent = std::process::id().to_string();
    let mut opts = dist::SpawnOptions::new(RANKS);
    opts.timeout = Some(Duration::from_secs(1800));
    opts.env.push(("TENSORPLAY_BENCH_PARENT".into(), parent));
    let a = args.clone();
    if let Err(e) = dist::spawn_with(opts, move |rank| run(rank, &a)) {
        eprintln!("bench_pp: {e}");
        return ExitCode::FAILURE;
    }
    let report = report_path();
    let text = std::fs::read_to_string(&report).unwrap_or_default();
    let _ = std::fs::remove_file(&report);
    print!("{text}");
    ExitCode::SUCCESS
}
