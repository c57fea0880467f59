//! The flagship job: the red-wine-quality MLP of `wine_quality` (same data, split, standardisation
//! and recipe: Adam lr 1e-3, minibatches of 64 in file order, 200 epochs, float32), trained
//! three times across two workers on 127.0.0.1, each run checked against the same model
//! trained in one process from the same initial weights:
//!
//! 1. **tensor-parallel** (2 ranks, a process group): the first Linear (11 -> 64) is
//!    column-parallel (each rank holds 32 output features), the second (64 -> 64) row-parallel
//!    (each rank holds 32 input features; the partial outputs are summed by the differentiable
//!    `all_reduce` of `distributed::nn::functional`), the head is replicated. Backward flows
//!    through the collectives.
//! 2. **parameter-server** (2 RPC workers, "trainer" and "ps"): the hidden layers live in a
//!    `RemoteModule` on "ps"; the trainer holds the head; distributed autograd carries the
//!    backward pass to "ps" and a `DistributedOptimizer` updates the parameters on both.
//! 3. **data-parallel** (2 ranks, a process group): each rank holds the whole MLP in a
//!    `DistributedDataParallel` and takes its share of every minibatch (rank 0 the first
//!    ceil(b/2) rows, rank 1 the rest); each backpropagates its mean loss scaled by its share
//!    of the rows, so the gradients DDP averages during backward are the whole minibatch's.
//!    The loss reported is the whole minibatch's, summed from the ranks' by an `all_reduce`.
//!
//! Each run prints one line `<run>: test accuracy 0.xxxx, max loss difference <e-notation>`
//! (the largest absolute difference of the losses of the first 200 steps against the
//! single-process reference); a summary table follows. The program exits non-zero when an
//! accuracy is below 0.58 or a loss difference reaches 1e-4.
//!
//! ```text
//! cargo run --release --example wine_distributed                    # starts its 2 workers
//! cargo run --release --example wine_distributed -- --plot loss.svg  # and draws the losses
//! tensorplay-run --nproc-per-node 2 target/release/examples/wine_distributed
//! ```
//!
//! Without `RANK`/`WORLD_SIZE` in the environment the program is rank 0 and starts rank 1 as a
//! second process of itself; under `tensorplay-run` (or any launcher setting `RANK`,
//! `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) each process takes its rank from there, so the
//! same binary runs across machines.

// built as a test harness too (its plot test): `main` and the training code then go unused
#![cfg_attr(test, allow(dead_code, unused_imports))]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use tensorplay as tp;
use tensorplay_examples::resume::{Checkpoints, Progress};
use tensorplay_examples::{launch, plot, resume, wine};
use tp::distributed::checkpoint;
use tp::distributed::nn::{self as dnn, LayerSpec, LinearArgs, RemoteModule, functional};
use tp::distributed::optim::{DistributedOptimizer, OptimizerKind};
use tp::distributed::{self as dist, ReduceOp, autograd as dist_autograd, rpc};
use tp::nn::{self, Module};
use tp::optim::{Adam, AdamOptions, Optimizer};
use tp::{Tensor, no_grad};
use wine::CLASSES;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const BATCH: usize = 64;
const HIDDEN: usize = 64;
/// Steps compared with the single-process reference.
const COMPARE_STEPS: usize = 200;
const MAX_LOSS_DIFF: f64 = 1e-4;
const MIN_ACCURACY: f64 = 0.58;
const WORLD: usize = 2;
/// The most epochs `--epochs` accepts (the run keeps one loss per epoch).
const MAX_EPOCHS: usize = 1_000_000;

struct Opts {
    seed: u64,
    epochs: usize,
    plot: Option<PathBuf>,
    checkpoint: Option<Checkpoints>,
}

/// Steps between checkpoints when `--checkpoint-dir` is given without `--checkpoint-every`.
const DEFAULT_CHECKPOINT_EVERY: usize = 100;

fn parse_args() -> Result<Opts, String> {
    let usage = "usage: wine_distributed [--seed N] [--epochs N] [--plot PATH.svg] \
                 [--checkpoint-dir DIR [--checkpoint-every STEPS]]";
    let mut o = Opts {
        seed: 0,
        epochs: 200,
        plot: None,
        checkpoint: None,
    };
    let mut every: Option<usize> = None;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let (key, inline) = match args[i].split_once('=') {
            Some((k, v)) => (k.to_string(), Some(v.to_string())),
            None => (args[i].clone(), None),
        };
        let value = |i: &mut usize| -> Result<String, String> {
            if let Some(v) = &inline {
                return Ok(v.clone());
            }
            *i += 1;
            args.get(*i)
                .cloned()
                .ok_or_else(|| format!("{key} needs a value ({usage})"))
        };
        match key.as_str() {
            // the end of a launcher's own options (`tensorplay-run ... wine_distributed -- ...`)
            "--" => {}
            "--seed" => {
                let v = value(&mut i)?;
                o.seed = v.parse().map_err(|e| format!("bad --seed {v:?}: {e}"))?;
            }
            "--epochs" => {
                let v = value(&mut i)?;
                o.epochs = v.parse().map_err(|e| format!("bad --epochs {v:?}: {e}"))?;
                if o.epochs == 0 || o.epochs > MAX_EPOCHS {
                    return Err(format!("--epochs must be from 1 to {MAX_EPOCHS}, got {v}"));
                }
            }
            "--plot" => {
                let p = PathBuf::from(value(&mut i)?);
                plot::check_path(&p)?;
                o.plot = Some(p);
            }
            "--checkpoint-dir" => {
                let d = PathBuf::from(value(&mut i)?);
                if d.as_os_str().is_empty() {
                    return Err("--checkpoint-dir needs a folder".into());
                }
                o.checkpoint = Some(Checkpoints {
                    dir: d,
                    every: DEFAULT_CHECKPOINT_EVERY,
                });
            }
            "--checkpoint-every" => {
                let v = value(&mut i)?;
                let k: usize = v
                    .parse()
                    .map_err(|e| format!("bad --checkpoint-every {v:?}: {e}"))?;
                if k == 0 {
                    return Err("--checkpoint-every must be at least 1 (steps)".into());
                }
                every = Some(k);
            }
            "-h" | "--help" => {
                println!("{usage}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} ({usage})")),
        }
        i += 1;
    }
    match (&mut o.checkpoint, every) {
        (Some(c), Some(k)) => c.every = k,
        (None, Some(_)) => {
            return Err(format!(
                "--checkpoint-every needs --checkpoint-dir DIR ({usage})"
            ));
        }
        _ => {}
    }
    if let Some(c) = &o.checkpoint {
        std::fs::create_dir_all(&c.dir).map_err(|e| {
            format!(
                "--checkpoint-dir {}: cannot create it: {e}",
                c.dir.display()
            )
        })?;
        // a folder holds the checkpoints of one configuration
        let config = format!("--seed {} --epochs {}", o.seed, o.epochs);
        let f = c.dir.join("config.txt");
        match std::fs::read_to_string(&f) {
            Ok(saved) if saved.trim() != config => {
                return Err(format!(
                    "--checkpoint-dir {} holds the checkpoints of `{}`, not `{config}`: use another folder",
                    c.dir.display(),
                    saved.trim()
                ));
            }
            Ok(_) => {}
            Err(_) => {
                tp::serialize::write_atomically(&f, config.as_bytes()).map_err(|e| e.to_string())?
            }
        }
    }
    Ok(o)
}

fn progress(epochs: usize, what: &str, rank: usize) -> ProgressBar {
    if rank != 0 {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(epochs as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{prefix:>16} {bar:30} {pos}/{len} epochs [{elapsed}] {msg}")
    {
        bar.set_style(style);
    }
    bar.set_prefix(what.to_string());
    bar
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// The single-process reference: `model` trained for `steps` steps of the same recipe;
/// returns the losses.
fn reference(model: &nn::Sequential, batches: &[(Tensor, Tensor)], steps: usize) -> Res<Vec<f64>> {
    let loss_fn = nn::CrossEntropyLoss::new();
    let mut opt = Adam::new(model.parameters(), adam())?;
    let mut losses = Vec::with_capacity(steps);
    for (x, y) in batches.iter().cycle().take(steps) {
        opt.zero_grad()?;
        let loss = loss_fn.forward(&model.call(x)?, y)?;
        losses.push(loss.item_f64()?);
        loss.backward()?;
        opt.step()?;
    }
    Ok(losses)
}

fn adam() -> AdamOptions {
    AdamOptions {
        lr: 1e-3,
        ..Default::default()
    }
}

/// A new leaf with a copy of `t`'s values (its own storage, no history).
fn fresh(t: &Tensor) -> tp::Result<Tensor> {
    Ok(t.detach().deep_clone()?.requires_grad_(true))
}

/// A deep copy of a Linear (its own storage).
fn copy_linear(l: &nn::Linear) -> Res<nn::Linear> {
    let w = fresh(&l.weight)?;
    let b = match &l.bias {
        Some(b) => Some(fresh(b)?),
        None => None,
    };
    Ok(nn::Linear::from_weights(w, b)?)
}

/// What one run reports.
struct Report {
    accuracy: f64,
    /// The first [`COMPARE_STEPS`] steps' losses, checked against `reference`.
    losses: Vec<f64>,
    reference: Vec<f64>,
    /// The mean training loss of every epoch (the whole run, for the plot).
    epoch_losses: Vec<f64>,
    wall: Duration,
    collective_bytes: u64,
    rpc_bytes: u64,
}

impl Report {
    /// The report of a rank that only served (or whose run rank 0 reports).
    fn empty() -> Report {
        Report {
            accuracy: 0.0,
            losses: vec![],
            reference: vec![],
            epoch_losses: vec![],
            wall: Duration::ZERO,
            collective_bytes: 0,
            rpc_bytes: 0,
        }
    }
}

/// The report of `run` when a checkpoint says it finished (rank 0 reads it; the other ranks
/// only skip the run).
fn finished(o: &Opts, run: &str, rank: usize) -> Res<Option<Report>> {
    let Some(c) = &o.checkpoint else {
        return Ok(None);
    };
    if !resume::done_path(&c.dir, run).is_file() {
        return Ok(None);
    }
    if rank != 0 {
        return Ok(Some(Report::empty()));
    }
    let d = resume::load_done(&c.dir, run)?;
    eprintln!(
        "{run}: finished earlier; its results are read from {}",
        resume::done_path(&c.dir, run).display()
    );
    Ok(Some(Report {
        accuracy: d.accuracy,
        losses: d.losses,
        reference: d.reference,
        epoch_losses: d.epoch_losses,
        wall: Duration::from_secs_f64(d.wall),
        collective_bytes: d.collective_bytes,
        rpc_bytes: d.rpc_bytes,
    }))
}

/// Records that `run` finished with `r` (rank 0, with checkpoints on).
fn record_done(o: &Opts, run: &str, rank: usize, r: &Report) -> Res<()> {
    let (Some(c), 0) = (&o.checkpoint, rank) else {
        return Ok(());
    };
    resume::save_done(
        &c.dir,
        run,
        &resume::Done {
            accuracy: r.accuracy,
            losses: r.losses.clone(),
            reference: r.reference.clone(),
            epoch_losses: r.epoch_losses.clone(),
            wall: r.wall.as_secs_f64(),
            collective_bytes: r.collective_bytes,
            rpc_bytes: r.rpc_bytes,
        },
    )
}

/// The training loop every run shares, from `p` (a fresh start or a checkpoint) to the last
/// epoch: `step(x, y)` takes one optimizer step on a minibatch and returns its mean loss;
/// `save(p)` writes a checkpoint, every `--checkpoint-every` steps.
fn train(
    o: &Opts,
    run: &str,
    rank: usize,
    batches: &[(Tensor, Tensor)],
    mut p: Progress,
    mut step: impl FnMut(&Tensor, &Tensor) -> Res<f64>,
    mut save: impl FnMut(&Progress) -> Res<()>,
) -> Res<Progress> {
    let rows: usize = batches.iter().map(|(_, y)| y.numel()).sum();
    let bar = progress(o.epochs, run, rank);
    bar.set_position(p.epoch_losses.len() as u64);
    let start = Instant::now();
    let wall_before = p.wall;
    let steps = o.epochs * batches.len();
    while p.step < steps {
        let (x, y) = &batches[p.step % batches.len()];
        let loss = step(x, y)?;
        if p.losses.len() < COMPARE_STEPS {
            p.losses.push(loss);
        }
        p.total += loss * y.numel() as f64;
        p.step += 1;
        if p.step.is_multiple_of(batches.len()) {
            let mean = p.total / rows as f64;
            p.epoch_losses.push(mean);
            p.total = 0.0;
            bar.set_message(format!("loss {mean:.4}"));
            bar.inc(1);
        }
        if let Some(c) = &o.checkpoint
            && p.step.is_multiple_of(c.every)
            && p.step < steps
        {
            p.wall = wall_before + start.elapsed().as_secs_f64();
            save(&p)?;
        }
        resume::maybe_kill(run, p.step, rank);
    }
    bar.finish_and_clear();
    p.wall = wall_before + start.elapsed().as_secs_f64();
    Ok(p)
}

// ---------------------------------------------------------------------------------------------
// 1. tensor parallel

/// One rank's shards: `w1` rows `[32, 11]` + `b1`, `w2` columns `[64, 32]`, the bias `b2` on
/// rank 0 only (added before the all_reduce, so it is counted once), and the replicated head.
struct TpModel {
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Option<Tensor>,
    head: nn::Linear,
}

impl TpModel {
    fn params(&self) -> Vec<Tensor> {
        let mut p = vec![self.w1.clone(), self.b1.clone(), self.w2.clone()];
        p.extend(self.b2.clone());
        p.extend(self.head.parameters());
        p
    }

    /// This rank's parameters by name (a shard of the checkpoint).
    fn named(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![
            ("w1".to_string(), self.w1.clone()),
            ("b1".to_string(), self.b1.clone()),
            ("w2".to_string(), self.w2.clone()),
        ];
        v.extend(self.b2.clone().map(|b| ("b2".to_string(), b)));
        v.extend(
            self.head
                .named_parameters()
                .into_iter()
                .map(|(k, p)| (format!("head.{k}"), p)),
        );
        v
    }

    fn forward(&self, x: &Tensor) -> tp::Result<Tensor> {
        // column-parallel: this rank's 32 hidden features
        let h = x.matmul(&self.w1.t()?)?.add(&self.b1)?.relu()?;
        // row-parallel: a partial sum of the second layer, summed across ranks
        let mut partial = h.matmul(&self.w2.t()?)?;
        if let Some(b2) = &self.b2 {
            partial = partial.add(b2)?;
        }
        let h2 = functional::all_reduce(&partial, ReduceOp::Sum, None)?.relu()?;
        self.head.call(&h2)
    }
}

/// The full model from the seed (identical on every rank), its shards for `rank`, and a deep
/// copy of the full model for the reference.
fn tp_models(seed: u64, f: usize, rank: usize) -> Res<(TpModel, nn::Sequential)> {
    tp::manual_seed(seed);
    let l1 = nn::Linear::new(f, HIDDEN, true)?;
    let l2 = nn::Linear::new(HIDDEN, HIDDEN, true)?;
    let l3 = nn::Linear::new(HIDDEN, CLASSES, true)?;
    let half = HIDDEN / WORLD;
    let shard = |t: &Tensor, dim: isize| -> tp::Result<Tensor> {
        fresh(&t.narrow(dim, rank * half, half)?)
    };
    let b1 = l1.bias.as_ref().ok_or("Linear without bias")?;
    let b2 = l2.bias.as_ref().ok_or("Linear without bias")?;
    let model = TpModel {
        w1: shard(&l1.weight, 0)?,
        b1: shard(b1, 0)?,
        w2: shard(&l2.weight, 1)?,
        b2: if rank == 0 { Some(fresh(b2)?) } else { None },
        head: copy_linear(&l3)?,
    };
    let full = nn::Sequential::new()
        .add(copy_linear(&l1)?)
        .add(nn::ReLU::new())
        .add(copy_linear(&l2)?)
        .add(nn::ReLU::new())
        .add(copy_linear(&l3)?);
    Ok((model, full))
}

/// Joins the 2-rank process group of the tensor-parallel and data-parallel runs.
fn init_group(rank: usize, init: &str) -> Res<()> {
    dist::init_process_group(
        "cpu",
        dist::InitOptions {
            init_method: init.to_string(),
            rank: Some(rank),
            world_size: Some(WORLD),
            timeout: Duration::from_secs(120),
        },
    )?;
    Ok(())
}

/// The bytes every rank's collectives sent on the default group, summed over the ranks.
fn collective_bytes() -> Res<u64> {
    let sent = Tensor::from_vec(
        vec![dist::default_group("bytes")?.bytes_sent() as f64],
        &[1],
    )?;
    dist::all_reduce(&sent, ReduceOp::Sum, None)?;
    Ok(sent.item::<f64>()? as u64)
}

fn tensor_parallel(rank: usize, init: &str, o: &Opts) -> Res<Report> {
    const RUN: &str = "tensor-parallel";
    if let Some(r) = finished(o, RUN, rank)? {
        return Ok(r);
    }
    let (train_set, test, f) = wine::load()?;
    let batches = wine::batches(&train_set, f, BATCH)?;
    init_group(rank, init)?;
    let (model, full) = tp_models(o.seed, f, rank)?;
    let loss_fn = nn::CrossEntropyLoss::new();
    let opt = RefCell::new(Adam::new(model.params(), adam())?);
    let head_params = model.head.parameters();
    let mut start = Progress::default();
    if let Some(c) = &o.checkpoint
        && checkpoint::sharded_exists(&c.dir, RUN)
    {
        // every rank restores its own shard (and optimizer state) of the same step
        let shard = checkpoint::load_sharded(&c.dir, RUN, None)?;
        let file = format!(
            "{}/{RUN}.step{}.rank{rank}.safetensors",
            c.dir.display(),
            shard.step
        );
        let u = resume::unpack(shard.tensors, &shard.metadata, &file)?;
        let named = model.named();
        let values = named
            .iter()
            .map(|(k, _)| u.model.get(k).ok_or_else(|| format!("shard lacks {k}")))
            .collect::<Result<Vec<_>, _>>()?;
        let params: Vec<Tensor> = named.into_iter().map(|(_, p)| p).collect();
        resume::restore(&params, &values)?;
        opt.borrow_mut()
            .load_state_dict(&u.opt.ok_or("shard lacks the optimizer state")?)?;
        start = u.progress;
    }
    let p = train(
        o,
        RUN,
        rank,
        &batches,
        start,
        |x, y| {
            let mut opt = opt.borrow_mut();
            opt.zero_grad()?;
            let loss = loss_fn.forward(&model.forward(x)?, y)?;
            let value = loss.item_f64()?;
            // every rank computes the same loss; the all_reduce's backward sums the ranks'
            // gradients, so each rank backpropagates its 1/WORLD share
            loss.mul_scalar(1.0 / WORLD as f64)?.backward()?;
            // the replicated head: sum its shares
            for p in &head_params {
                if let Some(g) = p.grad() {
                    dist::all_reduce(&g, ReduceOp::Sum, None)?;
                }
            }
            opt.step()?;
            Ok(value)
        },
        |p| {
            let Some(c) = &o.checkpoint else {
                return Ok(());
            };
            let state: BTreeMap<String, Tensor> = model.named().into_iter().collect();
            let (t, m) = resume::pack(&state, Some(&opt.borrow().state_dict()?), p);
            checkpoint::save_sharded(&c.dir, RUN, p.step as u64, &t, &m, None)?;
            Ok(())
        },
    )?;
    let accuracy = {
        let _g = no_grad();
        let logits = model.forward(&Tensor::from_slice(&test.x, &[test.rows(), f])?)?;
        wine::accuracy(&logits, &test.y)?
    };
    let collective_bytes = collective_bytes()?;
    dist::destroy_process_group()?;
    let reference = if rank == 0 {
        reference(&full, &batches, p.losses.len())?
    } else {
        Vec::new()
    };
    let r = Report {
        accuracy,
        losses: p.losses,
        reference,
        epoch_losses: p.epoch_losses,
        wall: Duration::from_secs_f64(p.wall),
        collective_bytes,
        rpc_bytes: 0,
    };
    record_done(o, RUN, rank, &r)?;
    Ok(r)
}

// ---------------------------------------------------------------------------------------------
// 2. parameter server

fn hidden_spec(f: usize) -> Vec<LayerSpec> {
    let lin = |i, o| {
        LayerSpec::Linear(LinearArgs {
            in_features: i,
            out_features: o,
            bias: true,
        })
    };
    vec![
        lin(f, HIDDEN),
        LayerSpec::ReLU,
        lin(HIDDEN, HIDDEN),
        LayerSpec::ReLU,
    ]
}

/// The commit file of the parameter-server run's checkpoint: `{"step": S}` names the files of
/// step S (the ps's layers and optimizer state, saved by the ps itself; the trainer's head,
/// optimizer state and progress).
fn ps_index(dir: &Path) -> PathBuf {
    dir.join("parameter-server.json")
}

fn ps_tag(step: usize) -> String {
    format!("parameter-server.step{step}")
}

fn parameter_server(rank: usize, init: &str, o: &Opts) -> Res<Report> {
    const RUN: &str = "parameter-server";
    if let Some(r) = finished(o, RUN, rank)? {
        return Ok(r);
    }
    dnn::register_module::<nn::Sequential>();
    rpc::register("bytes_sent", |(): ()| Ok(rpc::bytes_sent()?));
    // the ps builds the hidden layers from its own generator
    tp::manual_seed(o.seed + 1);
    let name = if rank == 0 { "trainer" } else { "ps" };
    rpc::init_rpc(
        name,
        rank,
        WORLD,
        rpc::RpcBackendOptions {
            init_method: init.to_string(),
            rpc_timeout: Duration::from_secs(120),
            ..Default::default()
        },
    )?;
    if rank != 0 {
        // the ps serves until the trainer is done
        rpc::shutdown(true)?;
        return Ok(Report::empty());
    }
    let (train_set, test, f) = wine::load()?;
    let batches = wine::batches(&train_set, f, BATCH)?;
    let hidden = RemoteModule::<nn::Sequential>::new("ps/cpu", hidden_spec(f))?;
    tp::manual_seed(o.seed);
    let mut head = nn::Linear::new(HIDDEN, CLASSES, true)?;
    // the reference: a copy of the remote layers' state and of the head
    let full = {
        let copy = hidden.get_module_rref().to_here(None)?;
        let state = copy.read().state_dict()?;
        let mut layers = <nn::Sequential as dnn::RemoteConstructible>::construct(&hidden_spec(f))?;
        {
            let _g = no_grad();
            let state = state
                .into_iter()
                .map(|(k, v)| Ok((k, v.detach().deep_clone()?)))
                .collect::<tp::Result<_>>()?;
            layers.load_state_dict(&state, true)?;
        }
        layers.push(Box::new(copy_linear(&head)?));
        layers
    };
    let mut params = hidden.remote_parameters(true)?;
    for p in head.parameters() {
        params.push(rpc::RRef::new(p)?);
    }
    let opt = DistributedOptimizer::new(OptimizerKind::Adam(adam()), &params)?;
    let mut start = Progress::default();
    if let Some(c) = &o.checkpoint
        && ps_index(&c.dir).is_file()
    {
        let index_path = ps_index(&c.dir);
        let step = std::fs::read(&index_path)
            .map_err(|e| e.to_string())
            .and_then(|b| {
                serde_json::from_slice::<serde_json::Value>(&b).map_err(|e| e.to_string())
            })
            .and_then(|v| v["step"].as_u64().ok_or_else(|| "no \"step\"".to_string()))
            .map_err(|e| format!("checkpoint {}: {e}", index_path.display()))?
            as usize;
        let tag = ps_tag(step);
        let dir = c.dir.display().to_string();
        // each owner loads its own part
        hidden.load_on_owner(&format!("{dir}/{tag}.ps-layers.safetensors"))?;
        opt.load_on_owners(&dir, &format!("{tag}.optim"))?;
        let file = c.dir.join(format!("{tag}.trainer.safetensors"));
        let (t, m) = tp::serialize::load_with_metadata(&file)?;
        let u = resume::unpack(t, &m, &file.display().to_string())?;
        head.load_state_dict(&u.model, true)?;
        start = u.progress;
    }
    let loss_fn = nn::CrossEntropyLoss::new();
    let p = train(
        o,
        RUN,
        rank,
        &batches,
        start,
        |x, y| {
            let ctx = dist_autograd::context()?;
            let h = hidden.forward(x)?;
            let loss = loss_fn.forward(&head.call(&h)?, y)?;
            let value = loss.item_f64()?;
            dist_autograd::backward(ctx.id(), &[loss], false)?;
            opt.step(ctx.id())?;
            Ok(value)
        },
        |p| {
            let Some(c) = &o.checkpoint else {
                return Ok(());
            };
            let tag = ps_tag(p.step);
            let dir = c.dir.display().to_string();
            // the owners save their own parameters and optimizer states, asked by RPC
            hidden.save_on_owner(&format!("{dir}/{tag}.ps-layers.safetensors"))?;
            opt.save_on_owners(&dir, &format!("{tag}.optim"))?;
            let (t, m) = resume::pack(&head.state_dict()?, None, p);
            tp::serialize::save_with_metadata(
                &t,
                &m,
                c.dir.join(format!("{tag}.trainer.safetensors")),
            )?;
            // the commit point, then the files of earlier steps go
            let index = serde_json::json!({ "step": p.step }).to_string();
            tp::serialize::write_atomically(ps_index(&c.dir), index.as_bytes())?;
            for e in std::fs::read_dir(&c.dir)?.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.starts_with("parameter-server.step") && !n.starts_with(&format!("{tag}.")) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
            Ok(())
        },
    )?;
    let accuracy = {
        let _g = no_grad();
        let h = hidden.forward(&Tensor::from_slice(&test.x, &[test.rows(), f])?)?;
        wine::accuracy(&head.call(&h)?, &test.y)?
    };
    let ps_bytes: u64 = rpc::rpc_sync("ps", "bytes_sent", (), None)?;
    let rpc_bytes = rpc::bytes_sent()? + ps_bytes;
    drop(opt);
    drop(hidden);
    rpc::shutdown(true)?;
    let reference = reference(&full, &batches, p.losses.len())?;
    let r = Report {
        accuracy,
        losses: p.losses,
        reference,
        epoch_losses: p.epoch_losses,
        wall: Duration::from_secs_f64(p.wall),
        collective_bytes: 0,
        rpc_bytes,
    };
    record_done(o, RUN, rank, &r)?;
    Ok(r)
}

// ---------------------------------------------------------------------------------------------
// 3. data parallel

/// The MLP from the seed (the same initial weights as the other runs' references) and a deep
/// copy of it for the reference.
fn mlp(seed: u64, f: usize) -> Res<(nn::Sequential, nn::Sequential)> {
    tp::manual_seed(seed);
    let l1 = nn::Linear::new(f, HIDDEN, true)?;
    let l2 = nn::Linear::new(HIDDEN, HIDDEN, true)?;
    let l3 = nn::Linear::new(HIDDEN, CLASSES, true)?;
    let full = nn::Sequential::new()
        .add(copy_linear(&l1)?)
        .add(nn::ReLU::new())
        .add(copy_linear(&l2)?)
        .add(nn::ReLU::new())
        .add(copy_linear(&l3)?);
    let model = nn::Sequential::new()
        .add(l1)
        .add(nn::ReLU::new())
        .add(l2)
        .add(nn::ReLU::new())
        .add(l3);
    Ok((model, full))
}

/// This rank's rows of a minibatch of `b` rows: `(start, len)`; rank 0 takes the first
/// ceil(b/2), rank 1 the rest.
fn dp_shard(b: usize, rank: usize) -> (usize, usize) {
    let first = b.div_ceil(WORLD);
    let start = (rank * first).min(b);
    (start, first.min(b - start))
}

fn data_parallel(rank: usize, init: &str, o: &Opts) -> Res<Report> {
    use tp::nn::parallel::DistributedDataParallel as Ddp;
    const RUN: &str = "data-parallel";
    if let Some(r) = finished(o, RUN, rank)? {
        return Ok(r);
    }
    let (train_set, test, f) = wine::load()?;
    let batches = wine::batches(&train_set, f, BATCH)?;
    let path = o
        .checkpoint
        .as_ref()
        .map(|c| c.dir.join(format!("{RUN}.safetensors")));
    // rank 0 wrote it; every rank reads it (before any rank can write a newer one: the next
    // save needs every rank's steps)
    let resumed = match &path {
        Some(p) if p.is_file() => {
            let (t, m) = tp::serialize::load_with_metadata(p)?;
            Some(resume::unpack(t, &m, &p.display().to_string())?)
        }
        _ => None,
    };
    init_group(rank, init)?;
    let (mut model, full) = mlp(o.seed, f)?;
    if let Some(u) = &resumed {
        model.load_state_dict(&u.model, true)?;
    }
    // broadcasts rank 0's parameters (the same ones: every rank built or loaded them)
    let ddp = Ddp::new(model)?;
    let loss_fn = nn::CrossEntropyLoss::new();
    let opt = RefCell::new(Adam::new(ddp.parameters(), adam())?);
    let mut start = Progress::default();
    if let Some(u) = resumed {
        opt.borrow_mut()
            .load_state_dict(&u.opt.ok_or("checkpoint lacks the optimizer state")?)?;
        start = u.progress;
    }
    let p = train(
        o,
        RUN,
        rank,
        &batches,
        start,
        |x, y| {
            let mut opt = opt.borrow_mut();
            let b = y.numel();
            let (first, len) = dp_shard(b, rank);
            let share = len as f64 / b as f64;
            opt.zero_grad()?;
            let local = loss_fn.forward(
                &ddp.call(&x.narrow(0, first, len)?)?,
                &y.narrow(0, first, len)?,
            )?;
            // DDP divides the summed gradients by WORLD: scaled by WORLD * b_r / b, they add up
            // to the gradient of the whole minibatch's mean loss
            local.mul_scalar(WORLD as f64 * share)?.backward()?;
            opt.step()?;
            // the whole minibatch's mean loss: the ranks' shares of it, summed
            let _g = no_grad();
            let t = Tensor::from_vec(vec![local.item_f64()? * share], &[1])?;
            dist::all_reduce(&t, ReduceOp::Sum, None)?;
            Ok(t.item::<f64>()?)
        },
        |p| {
            let Some(path) = &path else {
                return Ok(());
            };
            // replicated: rank 0 writes, the others wait for it
            let state = ddp.module().state_dict()?;
            let (t, m) = resume::pack(&state, Some(&opt.borrow().state_dict()?), p);
            checkpoint::save_replicated(&t, &m, path, None)?;
            Ok(())
        },
    )?;
    let accuracy = if rank == 0 {
        let _g = no_grad();
        let logits = ddp
            .module()
            .call(&Tensor::from_slice(&test.x, &[test.rows(), f])?)?;
        wine::accuracy(&logits, &test.y)?
    } else {
        0.0
    };
    let collective_bytes = collective_bytes()?;
    drop(opt);
    drop(ddp);
    dist::destroy_process_group()?;
    let reference = if rank == 0 {
        reference(&full, &batches, p.losses.len())?
    } else {
        Vec::new()
    };
    let r = Report {
        accuracy,
        losses: p.losses,
        reference,
        epoch_losses: p.epoch_losses,
        wall: Duration::from_secs_f64(p.wall),
        collective_bytes,
        rpc_bytes: 0,
    };
    record_done(o, RUN, rank, &r)?;
    Ok(r)
}

// ---------------------------------------------------------------------------------------------

/// Two panels (`common/plot.rs`): the first steps of each run over its single-process
/// reference (what the check compares), and the mean training loss of every epoch of the
/// whole run.
fn plot(path: &Path, runs: &[(&str, &Report)]) -> Res<()> {
    let steps = runs.iter().map(|(_, r)| r.losses.len()).max().unwrap_or(1);
    let epochs = runs
        .iter()
        .map(|(_, r)| r.epoch_losses.len())
        .max()
        .unwrap_or(1);
    let left = format!("first {steps} steps: distributed vs one process");
    let right = format!("all {epochs} epochs: mean training loss");
    let compared: Vec<plot::Compared<'_>> = runs
        .iter()
        .map(|(n, r)| (*n, r.reference.clone(), r.losses.clone()))
        .collect();
    let curves: Vec<plot::Curve<'_>> = runs
        .iter()
        .map(|(n, r)| {
            let points = r.epoch_losses.iter().enumerate();
            (*n, points.map(|(e, l)| (e + 1, *l)).collect())
        })
        .collect();
    plot::two_panels(
        path,
        plot::Panel {
            caption: &left,
            x_desc: "step",
            y_desc: "cross-entropy loss",
        },
        &compared,
        plot::Panel {
            caption: &right,
            x_desc: "epoch",
            y_desc: "mean cross-entropy loss",
        },
        &curves,
    )
}

fn run(o: &Opts) -> Res<bool> {
    let (rank, init, children) = launch::launch(WORLD)?;
    let result = (|| -> Res<(Report, Report, Report)> {
        let tp = tensor_parallel(rank, &init, o)?;
        let ps = parameter_server(rank, &init, o)?;
        let dp = data_parallel(rank, &init, o)?;
        Ok((tp, ps, dp))
    })();
    let (tp, ps, dp) = launch::join(children, result)?;
    if rank != 0 {
        return Ok(true);
    }
    let runs = [
        ("tensor-parallel", &tp),
        ("parameter-server", &ps),
        ("data-parallel", &dp),
    ];
    let mut ok = true;
    for (name, r) in runs {
        let diff = max_diff(&r.losses, &r.reference);
        println!(
            "{name}: test accuracy {:.4}, max loss difference {diff:.2e}",
            r.accuracy
        );
        if r.accuracy < MIN_ACCURACY {
            eprintln!(
                "check failed: {name} test accuracy {:.4} < {MIN_ACCURACY}",
                r.accuracy
            );
            ok = false;
        }
        if diff.is_nan() || diff >= MAX_LOSS_DIFF || r.losses.len() != r.reference.len() {
            eprintln!("check failed: {name} loss difference {diff:e} >= {MAX_LOSS_DIFF:e}");
            ok = false;
        }
    }
    println!();
    println!(
        "{:<18} {:>10} {:>18} {:>12}",
        "run", "wall time", "collective bytes", "RPC bytes"
    );
    for (name, r) in runs {
        println!(
            "{name:<18} {:>9.1}s {:>15.1} MB {:>9.1} MB",
            r.wall.as_secs_f64(),
            r.collective_bytes as f64 / 1e6,
            r.rpc_bytes as f64 / 1e6
        );
    }
    if let Some(p) = &o.plot {
        plot(p, &runs).map_err(|e| format!("writing the plot to {}: {e}", p.display()))?;
        println!("\nloss curves written to {}", p.display());
    }
    Ok(ok)
}

fn main() -> ExitCode {
    let o = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match run(&o) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            launch::report(&e);
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plot paths that cannot be written are refused when the arguments are read.
    #[test]
    fn bad_plot_paths_are_refused_up_front() {
        let dir = std::env::temp_dir();
        assert!(plot::check_path(Path::new("")).is_err());
        assert!(plot::check_path(&dir).unwrap_err().contains("directory"));
        let svg_dir = dir.join(format!("tp-dir-{}.svg", std::process::id()));
        std::fs::create_dir_all(&svg_dir).unwrap();
        let refused = plot::check_path(&svg_dir);
        std::fs::remove_dir(&svg_dir).unwrap();
        assert!(refused.unwrap_err().contains("directory"));
        assert!(
            plot::check_path(Path::new("loss.png"))
                .unwrap_err()
                .contains(".svg")
        );
        let missing = dir
            .join(format!("tp-no-such-dir-{}", std::process::id()))
            .join("l.svg");
        assert!(
            plot::check_path(&missing)
                .unwrap_err()
                .contains("does not exist")
        );
        // a folder where no file can be made (procfs) is found before the training
        assert!(
            plot::check_path(Path::new("/proc/tp-loss.svg"))
                .unwrap_err()
                .contains("cannot write")
        );
        let probe = dir.join(format!("tp-probe-{}.svg", std::process::id()));
        assert!(plot::check_path(&probe).is_ok());
        assert!(!probe.exists(), "the try left {}", probe.display());
        assert!(plot::check_path(Path::new("loss.svg")).is_ok());
    }

    /// The plot shows every epoch of the run (not only the compared steps) and gives each of
    /// its nine curves a legend entry with a coloured swatch.
    #[test]
    fn plot_has_a_swatch_per_curve_and_every_epoch() {
        let dir = std::env::temp_dir().join(format!("tp-wine-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("loss.svg");
        let report = |shift: f64| Report {
            accuracy: 0.6,
            losses: (0..COMPARE_STEPS)
                .map(|i| 1.8 - i as f64 * 1e-3 + shift)
                .collect(),
            reference: (0..COMPARE_STEPS)
                .map(|i| 1.8 - i as f64 * 1e-3 + shift)
                .collect(),
            epoch_losses: (0..437).map(|e| 1.5 / (1.0 + e as f64) + shift).collect(),
            wall: Duration::ZERO,
            collective_bytes: 0,
            rpc_bytes: 0,
        };
        let (a, b, c) = (report(0.0), report(0.1), report(0.2));
        plot(
            &path,
            &[
                ("tensor-parallel", &a),
                ("parameter-server", &b),
                ("data-parallel", &c),
            ],
        )
        .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        for label in [
            "tensor-parallel, 2 workers",
            "tensor-parallel, one process",
            "parameter-server, 2 workers",
            "parameter-server, one process",
            "data-parallel, 2 workers",
            "data-parallel, one process",
            "all 437 epochs",
            "first 200 steps",
        ] {
            assert!(svg.contains(label), "{label} missing");
        }
        // nine curves and nine legend swatches, in the runs' three colours
        assert!(svg.matches("<polyline").count() >= 18, "{svg}");
        assert!(
            svg.contains("#FF0000") && svg.contains("#0000FF") && svg.contains("#008C00"),
            "colours"
        );
        // the right panel's axis reaches the last epochs (the left one stops at step 200)
        let texts: Vec<&str> = svg.split(['<', '>']).map(str::trim).collect();
        assert!(texts.contains(&"400"), "epoch axis: {texts:?}");
    }

    /// Curves that coincide all stay visible: over a single-process twin equal to it (and to
    /// each other), each distributed run is a dashed line of its own pattern, drawn after the
    /// wide pale references; on the right the first curve is solid and the others dashed; every
    /// legend entry is there.
    #[test]
    fn coinciding_curves_stay_visible() {
        let dir = std::env::temp_dir().join(format!("tp-plot-twins-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("loss.svg");
        let losses: Vec<f64> = (0..100).map(|i| 4.2 - (i as f64 / 30.0).sin()).collect();
        let smooth: Vec<(usize, f64)> = (1..=30).map(|i| (i * 20, 4.0 / i as f64)).collect();
        let panel = |caption| plot::Panel {
            caption,
            x_desc: "step",
            y_desc: "loss",
        };
        plot::two_panels(
            &path,
            panel("compared"),
            &[
                ("tensor-parallel", losses.clone(), losses.clone()),
                ("data-parallel", losses.clone(), losses.clone()),
            ],
            panel("whole run"),
            &[
                ("single-process", smooth.clone()),
                ("tensor-parallel", smooth.clone()),
                ("data-parallel", smooth),
            ],
        )
        .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        // (stroke colour, stroke width, number of points) of every polyline
        let lines: Vec<(&str, &str, usize)> = svg
            .split("<polyline")
            .skip(1)
            .map(|l| {
                let l = &l[..l.find("/>").unwrap_or(l.len())];
                let attr = |name: &str| {
                    let key = format!(" {name}=\"");
                    let from = l.find(&key).map(|i| i + key.len()).unwrap_or(l.len());
                    &l[from..from + l[from..].find('"').unwrap_or(0)]
                };
                (
                    attr("stroke"),
                    attr("stroke-width"),
                    attr("points").split_whitespace().count(),
                )
            })
            .collect();
        let count = |colour: &str, width: &str, min_points: usize| {
            lines
                .iter()
                .filter(|(c, w, n)| *c == colour && *w == width && *n >= min_points)
                .count()
        };
        type Check = (&'static str, bool, String);
        let mut checks: Vec<Check> = [
            "tensor-parallel, 2 workers",
            "tensor-parallel, one process",
            "data-parallel, 2 workers",
            "data-parallel, one process",
            "single-process",
        ]
        .iter()
        .map(|l| (*l, svg.contains(l), format!("legend entry {l:?} missing")))
        .collect();
        // a solid curve is one polyline (and one legend swatch); a dashed one is a polyline per
        // dash: 100 steps across ~500 px give dozens
        let (red, blue, green) = ("#FF0000", "#0000FF", "#008C00");
        let dashed = [
            ("tensor-parallel run dashed (red, left)", count(red, "2", 2)),
            (
                "data-parallel run dashed (blue, left) and tensor-parallel curve (blue, right)",
                count(blue, "2", 2),
            ),
            (
                "data-parallel curve dashed (green, right)",
                count(green, "2", 2),
            ),
        ];
        for (name, n) in dashed {
            checks.push((name, n >= 20, format!("{n} thin segments")));
        }
        // the references stay wide solid lines; the first right curve is solid (one polyline of
        // all 30 points)
        for (name, colour) in [("tensor-parallel", red), ("data-parallel", blue)] {
            let n = count(colour, "6", 100);
            checks.push((
                name,
                n == 1,
                format!("{n} wide reference lines of 100 points"),
            ));
        }
        let n = count(red, "2", 30);
        checks.push((
            "single-process solid",
            n == 1,
            format!("{n} solid red lines"),
        ));
        // every reference (not its legend swatch) is drawn before the first run, so no pale line
        // covers a run
        let last_wide = lines.iter().rposition(|(_, w, n)| *w == "6" && *n >= 100);
        let first_run = lines.iter().position(|(c, w, _)| *c == red && *w == "2");
        checks.push((
            "references under the runs",
            matches!((last_wide, first_run), (Some(w), Some(r)) if w < r),
            format!("last reference at {last_wide:?}, first run segment at {first_run:?}"),
        ));
        // the two runs' dash patterns differ, so one does not hide the other
        checks.push((
            "distinct patterns",
            plot::DASHES[0] != plot::DASHES[1],
            format!("{:?}", plot::DASHES),
        ));
        let failed: Vec<String> = checks
            .into_iter()
            .filter(|(_, ok, _)| !ok)
            .map(|(name, _, why)| format!("{name}: {why}"))
            .collect();
        assert!(failed.is_empty(), "{failed:#?}");
    }
}
