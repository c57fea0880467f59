//! One data-parallel training step of `DistributedDataParallel` on the "cpu" backend (shared
//! memory between the ranks of this host), measured as PyTorch's anchor
//! `../shared/anchors/torch_ddp_step.py` measures DDP over gloo, and printed in the same line
//! shape, so `cargo xtask bench-ddp` can put the two side by side.
//!
//! Usage: `cargo run --release -p tensorplay-distributed-nn --example bench_ddp [world] [hidden]
//! [steps] [view]` (defaults 2 1024 30; with `view`, DDP runs with `gradient_as_bucket_view`,
//! as the anchor's own `view` argument).
//!
//! Each rank trains the MLP 784 -> hidden -> hidden -> hidden -> 10 (float32, ReLU,
//! cross-entropy, SGD lr 0.01) on its own random batch of 32 (seeded by its rank), one thread
//! per rank. First the plain module (the local step: compute only), then the same model in
//! `DistributedDataParallel` with the default options (the DDP step); each is timed as the
//! median of `steps` steps after 5 warm-up steps, with a barrier before the timed steps. The
//! optimizer's `zero_grad` runs every step (it sets `.grad` to `None`, PyTorch 2's default; the
//! anchor zeroes in place, `set_to_none=False`). Before the DDP step is timed, one checked
//! step makes sure the reduced gradients are bit-identical on every rank and equal to the mean
//! of the ranks' local gradients; the benchmark fails otherwise. Prints, from rank 0:
//!
//! ```text
//! tensorplay-ddp params N grad_bytes B buckets K
//! tensorplay-ddp local step   X us
//! tensorplay-ddp ddp step     Y us
//! tensorplay-ddp overhead     Z us       (Y - X)
//! tensorplay-ddp hidden fraction F       (median share of all-reduce time before backward ended)
//! tensorplay-ddp exposed wait W us       (median wait for the all-reduces at the end of backward)
//! ```
//!
//! and a few more `tensorplay-ddp` lines (all-reduce time, backward time, the check) that the
//! xtask shows but does not compare.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use tensorplay as tp;
use tp::distributed as dist;
use tp::nn::parallel::{DdpOptions, DistributedDataParallel as Ddp, StepStats};
use tp::nn::{CrossEntropyLoss, Linear, Module, ReLU, Sequential};
use tp::optim::{Optimizer, SGD, SgdOptions};

type R<T = ()> = Result<T, dist::SpawnError>;

/// Warm-up steps before each timed phase (as the anchor).
const WARMUP: usize = 5;
/// Batch rows per rank and the model's input and output widths (as the anchor).
const BATCH: usize = 32;
const INPUT: usize = 784;
const CLASSES: usize = 10;

/// The command line: `[world] [hidden] [steps]`, each at least 1.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "bench_ddp",
    about = "One data-parallel training step of DistributedDataParallel on the \"cpu\" backend, \
             beside the local step, in the lines `cargo xtask bench-ddp` reads."
)]
struct Args {
    /// Ranks (processes) on this machine.
    #[arg(default_value_t = 2, value_parser = at_least_one)]
    world: usize,
    /// Width of the MLP's hidden layers.
    #[arg(default_value_t = 1024, value_parser = at_least_one)]
    hidden: usize,
    /// Timed steps (after 5 warm-up steps).
    #[arg(default_value_t = 30, value_parser = at_least_one)]
    steps: usize,
    /// `view`: run DDP with `gradient_as_bucket_view` (each `.grad` a view into its bucket).
    #[arg(value_parser = ["view"])]
    view: Option<String>,
    /// DDP's `bucket_cap_mb` (default: DDP's own default).
    #[arg(long, value_name = "MiB")]
    bucket_cap_mb: Option<f64>,
}

/// A whole number >= 1.
fn at_least_one(v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("expected a whole number >= 1".into()),
    }
}

/// The anchor's model, initialised from seed 0 on every rank.
fn mlp(hidden: usize) -> tp::Result<Sequential> {
    tp::manual_seed(0);
    Ok(Sequential::new()
        .add(Linear::new(INPUT, hidden, true)?)
        .add(ReLU::new())
        .add(Linear::new(hidden, hidden, true)?)
        .add(ReLU::new())
        .add(Linear::new(hidden, hidden, true)?)
        .add(ReLU::new())
        .add(Linear::new(hidden, CLASSES, true)?))
}

fn sgd(params: Vec<tp::Tensor>) -> tp::Result<SGD> {
    SGD::new(
        params,
        SgdOptions {
            lr: 0.01,
            ..Default::default()
        },
    )
}

/// One training step: zero_grad, forward, cross-entropy, backward, SGD.
fn step(m: &dyn Module, opt: &mut SGD, x: &tp::Tensor, y: &tp::Tensor) -> tp::Result<()> {
    opt.zero_grad()?;
    CrossEntropyLoss::new()
        .forward(&m.call(x)?, y)?
        .backward()?;
    opt.step()
}

/// Runs `WARMUP` steps, a barrier, then `steps` timed steps; `after` runs after each timed
/// step, outside the timing. Returns the step times in seconds.
fn timed(
    steps: usize,
    mut one: impl FnMut() -> tp::Result<()>,
    mut after: impl FnMut(),
) -> R<Vec<f64>> {
    for _ in 0..WARMUP {
        one()?;
    }
    dist::barrier(None)?;
    let mut ts = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t = Instant::now();
        one()?;
        ts.push(t.elapsed().as_secs_f64());
        after();
    }
    Ok(ts)
}

/// The median (the mean of the two middle values for an even count, as Python's
/// `statistics.median`); `None` for no values.
fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// The gradients of `m`'s parameters as float32 values, one vector per parameter; an error
/// names a parameter without one.
fn grads(m: &dyn Module) -> R<Vec<(String, Vec<f32>)>> {
    m.named_parameters()
        .into_iter()
        .map(|(name, p)| match p.grad() {
            Some(g) => Ok((name, g.to_vec::<f32>()?)),
            None => Err(format!("parameter {name:?} has no gradient after backward").into()),
        })
        .collect()
}

/// The check before timing: after one DDP step every rank holds bit-identical gradients (the
/// elementwise MIN and MAX over ranks equal this rank's), and they equal the mean of the
/// ranks' local gradients `expected`. Returns the largest absolute difference to the mean.
fn check_reduction(ddp: &dyn Module, expected: &[Vec<f32>], rank: usize) -> R<f64> {
    let got = grads(ddp)?;
    let mut worst = 0.0f64;
    for ((name, g), want) in got.iter().zip(expected) {
        for op in [dist::ReduceOp::Min, dist::ReduceOp::Max] {
            let t = tp::Tensor::from_vec(g.clone(), &[g.len()])?;
            dist::all_reduce(&t, op, None)?;
            let other = t.to_vec::<f32>()?;
            if let Some(i) = (0..g.len()).find(|&i| other[i].to_bits() != g[i].to_bits()) {
                return Err(format!(
                    "the reduced gradients differ between ranks: {name:?}[{i}] is {} on rank \
                     {rank}, the {op:?} over ranks is {}; the benchmark would measure a wrong \
                     reduction",
                    g[i], other[i]
                )
                .into());
            }
        }
        for (i, (&a, &b)) in g.iter().zip(want).enumerate() {
            let d = (f64::from(a) - f64::from(b)).abs();
            if d.is_nan() || d > 1e-6 + 1e-4 * f64::from(b).abs() {
                return Err(format!(
                    "the reduced gradient is not the mean of the ranks' gradients: {name:?}[{i}] \
                     is {a} on rank {rank}, the mean of the local gradients is {b}"
                )
                .into());
            }
            worst = worst.max(d);
        }
    }
    Ok(worst)
}

/// The mean over ranks of each parameter's local gradient on this rank's batch (a fresh model
/// from seed 0: the state the DDP replica starts from).
fn mean_local_grads(
    hidden: usize,
    x: &tp::Tensor,
    y: &tp::Tensor,
    world: usize,
) -> R<Vec<Vec<f32>>> {
    let m = mlp(hidden)?;
    CrossEntropyLoss::new()
        .forward(&m.call(x)?, y)?
        .backward()?;
    let w = world as f32;
    let mut out = Vec::new();
    for (_, g) in grads(&m)? {
        let n = g.len();
        let t = tp::Tensor::from_vec(g, &[n])?;
        dist::all_reduce(&t, dist::ReduceOp::Sum, None)?;
        out.push(t.to_vec::<f32>()?.into_iter().map(|s| s / w).collect());
    }
    Ok(out)
}

fn run(rank: usize, args: Args) -> R {
    tp::set_num_threads(1);
    dist::init_process_group(
        "cpu",
        dist::InitOptions {
            timeout: Duration::from_secs(120),
            ..Default::default()
        },
    )?;
    tp::manual_seed(rank as u64);
    let x = tp::randn(&[BATCH, INPUT])?;
    let y = tp::randint(0, CLASSES as i64, &[BATCH])?;

    // the local step: the plain module, compute only
    let local = mlp(args.hidden)?;
    let mut opt = sgd(local.parameters())?;
    let t_local = timed(args.steps, || step(&local, &mut opt, &x, &y), || {})?;
    let params: usize = local.parameters().iter().map(|p| p.numel()).sum();

    // the DDP step, after one checked step
    let expected = mean_local_grads(args.hidden, &x, &y, args.world)?;
    let ddp = Ddp::with_options(
        mlp(args.hidden)?,
        DdpOptions {
            gradient_as_bucket_view: args.view.is_some(),
            bucket_cap_mb: args
                .bucket_cap_mb
                .unwrap_or_else(|| DdpOptions::default().bucket_cap_mb),
            ..DdpOptions::default()
        },
    )?;
    let mut opt = sgd(ddp.parameters())?;
    opt.zero_grad()?;
    CrossEntropyLoss::new()
        .forward(&ddp.call(&x)?, &y)?
        .backward()?;
    let worst = check_reduction(&ddp, &expected, rank)?;
    opt.step()?;
    let mut stats: Vec<StepStats> = Vec::with_capacity(args.steps);
    let t_ddp = timed(
        args.steps,
        || step(&ddp, &mut opt, &x, &y),
        || stats.extend(ddp.last_step_stats()),
    )?;

    if rank == 0 {
        let us = |v: Option<f64>| v.unwrap_or(f64::NAN) * 1e6;
        let (local_us, ddp_us) = (us(median(t_local)), us(median(t_ddp)));
        let med =
            |f: &dyn Fn(&StepStats) -> Option<f64>| median(stats.iter().filter_map(f).collect());
        let hidden = med(&|s| s.hidden_fraction);
        let wait = med(&|s| Some(s.wait_time.as_secs_f64()));
        let comm = med(&|s| Some(s.comm_time.as_secs_f64()));
        let backward = med(&|s| s.backward_time.map(|d| d.as_secs_f64()));
        let last = stats.last();
        let mut out = String::new();
        out.push_str(&format!(
            "tensorplay-ddp params {params} grad_bytes {} buckets {}\n",
            params * 4,
            last.map_or(0, |s| s.buckets)
        ));
        out.push_str(&format!("tensorplay-ddp local step {local_us:10.1} us\n"));
        out.push_str(&format!("tensorplay-ddp ddp step   {ddp_us:10.1} us\n"));
        out.push_str(&format!(
            "tensorplay-ddp overhead   {:10.1} us\n",
            ddp_us - local_us
        ));
        out.push_str(&match hidden {
            Some(h) => format!("tensorplay-ddp hidden fraction {h:.3}\n"),
            None => "tensorplay-ddp hidden fraction -\n".to_string(),
        });
        out.push_str(&format!(
            "tensorplay-ddp exposed wait {:10.1} us\n",
            us(wait)
        ));
        out.push_str(&format!(
            "tensorplay-ddp all-reduce time {:10.1} us (sum over buckets, {} bytes)\n",
            us(comm),
            last.map_or(0, |s| s.bytes)
        ));
        out.push_str(&format!(
            "tensorplay-ddp backward time {:10.1} us (first gradient ready to end of backward)\n",
            us(backward)
        ));
        out.push_str(&format!(
            "tensorplay-ddp check gradients bit-identical across {} rank(s), max |ddp - mean of \
             local| {worst:.3e}\n",
            args.world
        ));
        // the children's output is captured by spawn: rank 0 reports through a file
        std::fs::write(report_path(), out)?;
    }
    dist::destroy_process_group()?;
    Ok(())
}

fn report_path() -> std::path::PathBuf {
    let parent =
        std::env::var("TENSORPLAY_BENCH_PARENT").unwrap_or_else(|_| std::process::id().to_string());
    std::env::temp_dir().join(format!("tensorplay-bench-ddp-{parent}.txt"))
}

fn main() -> ExitCode {
    let args = Args::parse();
    tp::set_num_threads(1);
    let parent = std::process::id().to_string();
    let report = std::env::temp_dir().join(format!("tensorplay-bench-ddp-{parent}.txt"));
    let _ = std::fs::remove_file(&report);
    let mut opts = dist::SpawnOptions::new(args.world);
    opts.timeout = Some(Duration::from_secs(1800));
    opts.env.push(("TENSORPLAY_BENCH_PARENT".into(), parent));
    let r = dist::spawn_with(opts, move |rank| run(rank, args.clone()));
    if let Ok(text) = std::fs::read_to_string(&report) {
        print!("{text}");
    }
    let _ = std::fs::remove_file(&report);
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench_ddp: {e}");
            ExitCode::FAILURE
        }
    }
}
