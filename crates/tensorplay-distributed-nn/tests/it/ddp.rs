//! `DistributedDataParallel` across real processes (`spawn`, the "cpu" backend): gradients and
//! parameters against the single-process run of the concatenated batch, launch order and
//! overlap, unused parameters, `no_sync`, `join` with uneven inputs, communication hooks, and
//! bad inputs that must fail on every rank.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tensorplay_collectives::{self as dist, InitOptions};
use tensorplay_core::nn::{self, Linear, Module, ModuleCore, Sequential};
use tensorplay_core::optim::{Optimizer, SGD, SgdOptions};
use tensorplay_core::{self as tp, DType, Tensor};
use tensorplay_distributed_nn::parallel::{
    CommFuture, DdpError, DdpOptions, DistributedDataParallel as Ddp, default_hooks,
};

pub(crate) type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

const DIMS: [usize; 4] = [5, 7, 6, 3];
pub(crate) const SEED: u64 = 11;

fn init() -> dist::Result<()> {
    dist::init_process_group(
        "cpu",
        InitOptions {
            timeout: Duration::from_secs(30),
            ..Default::default()
        },
    )
}

/// A leaf copy of `t` in `dtype`.
pub(crate) fn leaf(t: &Tensor, dtype: DType) -> tp::Result<Tensor> {
    Ok(t.detach()
        .to_dtype(dtype)?
        .deep_clone()?
        .requires_grad_(true))
}

pub(crate) fn linear(i: usize, o: usize, dtype: DType) -> tp::Result<Linear> {
    let l = Linear::new(i, o, true)?;
    let b = l.bias.as_ref().map(|b| leaf(b, dtype)).transpose()?;
    Linear::from_weights(leaf(&l.weight, dtype)?, b)
}

/// Linear and Tanh layers of `dims`, initialised from `seed`.
pub(crate) fn mlp(dims: &[usize], dtype: DType, seed: u64) -> tp::Result<Sequential> {
    tp::manual_seed(seed);
    let mut m = Sequential::new();
    for (k, w) in dims.windows(2).enumerate() {
        m = m.add(linear(w[0], w[1], dtype)?);
        if k + 2 < dims.len() {
            m = m.add(nn::Tanh::new());
        }
    }
    Ok(m)
}

/// Deterministic rows `from..from + n` of a regression dataset (the same on every rank).
pub(crate) fn rows(
    from: usize,
    n: usize,
    dims: &[usize],
    dtype: DType,
) -> tp::Result<(Tensor, Tensor)> {
    let (fi, fo) = (dims[0], dims[dims.len() - 1]);
    let x: Vec<f64> = (from..from + n)
        .flat_map(|i| (0..fi).map(move |j| ((i * 13 + j * 7) as f64 * 0.37).sin()))
        .collect();
    let y: Vec<f64> = (from..from + n)
        .flat_map(|i| (0..fo).map(move |j| ((i * 5 + j * 11) as f64 * 0.23).cos()))
        .collect();
    Ok((
        Tensor::from_vec(x, &[n, fi])?.to_dtype(dtype)?,
        Tensor::from_vec(y, &[n, fo])?.to_dtype(dtype)?,
    ))
}

pub(crate) fn mse(out: &Tensor, y: &Tensor) -> tp::Result<Tensor> {
    nn::MSELoss::new().forward(out, y)
}

fn tol(dtype: DType) -> f64 {
    if dtype == DType::F64 { 1e-12 } else { 1e-6 }
}

/// `max |a - b| <= tol * (1 + max |b|)`, else a message naming `what`.
fn close(a: &Tensor, b: &Tensor, tol: f64, what: &str) -> Result<(), String> {
    let (av, bv) = (
        a.to_vec_f64().map_err(|e| e.to_string())?,
        b.to_vec_f64().map_err(|e| e.to_string())?,
    );
    if av.len() != bv.len() {
        return Err(format!("{what}: {} values vs {}", av.len(), bv.len()));
    }
    let scale = 1.0 + bv.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let diff = av
        .iter()
        .zip(&bv)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
    if diff.is_nan() || diff > tol * scale {
        return Err(format!(
            "{what}: max difference {diff:e} > {tol:e} x {scale}"
        ));
    }
    Ok(())
}

fn grads_close(model: &dyn Module, reference: &dyn Module, tol: f64, what: &str) -> TestResult {
    for ((n, p), (_, q)) in model
        .named_parameters()
        .iter()
        .zip(reference.named_parameters())
    {
        match (p.grad(), q.grad()) {
            (Some(g), Some(h)) => close(&g, &h, tol, &format!("{what}: grad of {n}"))?,
            (None, None) => {}
            (g, h) => {
                return Err(format!(
                    "{what}: grad of {n} is {:?} here, {:?} in the reference",
                    g.map(|_| "set"),
                    h.map(|_| "set")
                )
                .into());
            }
        }
    }
    Ok(())
}

fn params_close(model: &dyn Module, reference: &dyn Module, tol: f64, what: &str) -> TestResult {
    for ((n, p), (_, q)) in model
        .named_parameters()
        .iter()
        .zip(reference.named_parameters())
    {
        close(p, &q, tol, &format!("{what}: {n}"))?;
    }
    Ok(())
}

/// Every rank's parameters, bit for bit the same.
fn identical_across_ranks(model: &dyn Module, what: &str) -> TestResult {
    let mine: Vec<Vec<u64>> = model
        .parameters()
        .iter()
        .map(|p| Ok(p.to_vec_f64()?.iter().map(|v| v.to_bits()).collect()))
        .collect::<tp::Result<_>>()?;
    let all = dist::all_gather_object(&mine, None)?;
    for (r, theirs) in all.iter().enumerate() {
        if *theirs != all[0] {
            return Err(format!("{what}: rank {r}'s parameters differ from rank 0's").into());
        }
    }
    Ok(())
}

fn sgd(params: Vec<Tensor>) -> tp::Result<SGD> {
    SGD::new(
        params,
        SgdOptions {
            lr: 0.1,
            ..Default::default()
        },
    )
}

pub(crate) fn options(cap_mb: f64) -> DdpOptions {
    DdpOptions {
        bucket_cap_mb: cap_mb,
        ..Default::default()
    }
}

/// A cap of 100 bytes: about one bucket per parameter.
pub(crate) const SMALL_CAP: f64 = 100.0 / (1024.0 * 1024.0);

// ---------------------------------------------------------------------------------------------
// gradients and parameters against one process

/// One DDP step's gradients equal the single-process gradient of the concatenated batch, and
/// after `STEPS` SGD steps every rank's parameters are bit-identical and equal the
/// single-process run's — in float64 and float32, with several buckets and with one.
fn grads_match(world: usize) {
    const PER_RANK: usize = 4;
    const STEPS: usize = 3;
    dist::spawn::spawn(world, |rank| -> TestResult {
        init()?;
        for dtype in [DType::F64, DType::F32] {
            for cap in [SMALL_CAP, 25.0] {
                let what = format!("world {world}, {dtype}, bucket_cap_mb {cap:.6}");
                // ranks start from different weights: construction broadcasts rank 0's
                let ddp = Ddp::with_options(mlp(&DIMS, dtype, SEED + rank as u64)?, options(cap))?;
                let reference = mlp(&DIMS, dtype, SEED)?;
                params_close(
                    ddp.module(),
                    &reference,
                    0.0,
                    &format!("{what}: after construction"),
                )?;
                let buckets = ddp.bucket_parameter_names();
                if cap == 25.0 && buckets.len() != 1 || cap < 1.0 && buckets.len() < 3 {
                    return Err(format!("{what}: {} buckets: {buckets:?}", buckets.len()).into());
                }
                let mut opt = sgd(ddp.parameters())?;
                let mut ref_opt = sgd(reference.parameters())?;
                for step in 0..STEPS {
                    let first = step * world * PER_RANK;
                    let (x, y) = rows(first + rank * PER_RANK, PER_RANK, &DIMS, dtype)?;
                    let (xa, ya) = rows(first, world * PER_RANK, &DIMS, dtype)?;
                    opt.zero_grad()?;
                    mse(&ddp.call(&x)?, &y)?.backward()?;
                    ref_opt.zero_grad()?;
                    mse(&reference.call(&xa)?, &ya)?.backward()?;
                    grads_close(
                        ddp.module(),
                        &reference,
                        tol(dtype),
                        &format!("{what}, step {step}"),
                    )?;
                    opt.step()?;
                    ref_opt.step()?;
                }
                identical_across_ranks(ddp.module(), &what)?;
                params_close(
                    ddp.module(),
                    &reference,
                    tol(dtype),
                    &format!("{what}: after {STEPS} steps"),
                )?;
                // the buckets were rebuilt once, the same way on every rank
                let names = dist::all_gather_object(&ddp.bucket_parameter_names(), None)?;
                if names.iter().any(|n| *n != names[0]) {
                    return Err(format!("{what}: ranks disagree on the buckets: {names:?}").into());
                }
                let stats = ddp.last_step_stats().ok_or("no step stats")?;
                if stats.buckets != names[0].len() || stats.step != STEPS as u64 - 1 {
                    return Err(format!("{what}: stats {stats:?}").into());
                }
            }
        }
        if world == 1 {
            // a bad option is refused with the argument's name
            let err = Ddp::with_options(mlp(&DIMS, DType::F32, 1)?, options(0.0))
                .err()
                .ok_or("cap 0 accepted")?;
            if !err.to_string().contains("bucket_cap_mb") {
                return Err(format!("bad cap: {err}").into());
            }
        }
        dist::destroy_process_group()?;
        Ok(())
    })
    .unwrap();
}

#[test]
fn gradients_match_one_process_world_1() {
    grads_match(1);
}

#[test]
fn gradients_match_one_process_world_2() {
    grads_match(2);
}

#[test]
fn gradients_match_one_process_world_3() {
    grads_match(3);
}

#[test]
fn gradients_match_one_process_world_4() {
    grads_match(4);
}

// ---------------------------------------------------------------------------------------------
// launch order, overlap, communication hooks

/// A counting communication hook: every rank launches the same buckets in the same order, one
/// all-reduce per bucket per step, and bucket 0 goes out while backward is still running (the
/// first layer's weight has no gradient yet). Hooks get the undivided gradient and what their
/// future yields is written back as is.
#[test]
fn launch_order_overlap_and_comm_hooks() {
    dist::spawn::spawn(3, |rank| -> TestResult {
        init()?;
        let dims = [5, 64, 64, 64, 3];
        let ddp = Ddp::with_options(mlp(&dims, DType::F64, SEED)?, options(SMALL_CAP))?;
        // (step, bucket, whether the first layer's weight had a gradient at launch)
        let log: Arc<Mutex<Vec<(usize, usize, bool)>>> = Arc::default();
        let step_now = Arc::new(Mutex::new(0usize));
        let first_weight = ddp.module().named_parameters()[0].1.clone();
        {
            let (log, step_now, w) = (log.clone(), step_now.clone(), first_weight.clone());
            ddp.register_comm_hook(move |group, bucket| {
                log.lock().unwrap().push((
                    *step_now.lock().unwrap(),
                    bucket.index(),
                    w.grad().is_some(),
                ));
                default_hooks::allreduce_hook(group, bucket)
            })?;
        }
        if ddp
            .register_comm_hook(|_, b| Ok(CommFuture::ready(b.buffer().clone())))
            .is_ok()
        {
            return Err("a second comm hook was accepted".into());
        }
        let reference = mlp(&dims, DType::F64, SEED)?;
        for step in 0..3 {
            *step_now.lock().unwrap() = step;
            let (x, y) = rows(step * 12 + rank * 4, 4, &dims, DType::F64)?;
            let (xa, ya) = rows(step * 12, 12, &dims, DType::F64)?;
            ddp.zero_grad()?;
            mse(&ddp.call(&x)?, &y)?.backward()?;
            reference.zero_grad()?;
            mse(&reference.call(&xa)?, &ya)?.backward()?;
            grads_close(
                ddp.module(),
                &reference,
                1e-12,
                &format!("allreduce_hook, step {step}"),
            )?;
        }
        let log = log.lock().unwrap().clone();
        let n = ddp.bucket_parameter_names().len();
        if n < 4 {
            return Err(format!("only {n} buckets").into());
        }
        for step in 0..3 {
            let launched: Vec<usize> = log.iter().filter(|e| e.0 == step).map(|e| e.1).collect();
            if launched != (0..n).collect::<Vec<_>>() {
                return Err(format!(
                    "rank {rank} step {step}: launched {launched:?}, expected 0..{n}"
                )
                .into());
            }
            let first = log.iter().find(|e| e.0 == step).unwrap();
            if first.2 {
                return Err(format!(
                    "step {step}: bucket 0 launched only after the first layer's gradient existed \
                     (no overlap)"
                )
                .into());
            }
        }
        let all = dist::all_gather_object(&log, None)?;
        if all.iter().any(|l| *l != all[0]) {
            return Err(format!("ranks launched differently: {all:?}").into());
        }

        // the hook contract: undivided gradients in, the future's tensor written back as is
        let local = Ddp::with_options(mlp(&dims, DType::F64, SEED)?, options(SMALL_CAP))?;
        local.register_comm_hook(|_, b| Ok(CommFuture::ready(b.buffer().mul_scalar(2.0)?)))?;
        let (x, y) = rows(100 + rank * 4, 4, &dims, DType::F64)?;
        mse(&local.call(&x)?, &y)?.backward()?;
        let alone = mlp(&dims, DType::F64, SEED)?;
        mse(&alone.call(&x)?, &y)?.mul_scalar(2.0)?.backward()?;
        grads_close(
            local.module(),
            &alone,
            1e-12,
            "a hook that doubles its rank's gradient",
        )?;

        // a hook whose future has the wrong length fails backward with the bucket named
        let bad = Ddp::with_options(mlp(&dims, DType::F64, SEED)?, options(SMALL_CAP))?;
        bad.register_comm_hook(|_, b| {
            Ok(CommFuture::ready(b.buffer().narrow(0, 0, 1)?.contiguous()?))
        })?;
        let err = mse(&bad.call(&x)?, &y)?
            .backward()
            .err()
            .ok_or("a short future was accepted")?;
        if !err.to_string().contains("bucket 0") || err.downcast_ref::<DdpError>().is_none() {
            return Err(format!("short future: {err}").into());
        }

        // without a hook: the statistics see the overlap
        let plain = Ddp::with_options(mlp(&dims, DType::F64, SEED)?, options(SMALL_CAP))?;
        for _ in 0..2 {
            plain.zero_grad()?;
            mse(&plain.call(&x)?, &y)?.backward()?;
        }
        let s = plain.last_step_stats().ok_or("no stats")?;
        let hidden = s.hidden_fraction.ok_or("no hidden fraction")?;
        if !(0.0..=1.0).contains(&hidden)
            || s.bytes
                != plain
                    .parameters()
                    .iter()
                    .map(|p| p.numel() * 8)
                    .sum::<usize>()
        {
            return Err(format!("stats {s:?}").into());
        }
        dist::destroy_process_group()?;
        Ok(())
    })
    .unwrap();
}

// ---------------------------------------------------------------------------------------------
// unused parameters and no_sync

/// A trunk, a branch used only on some steps and some ranks, and a head nobody uses.
#[derive(Module)]
struct Branchy {
    trunk: Linear,
    branch: Linear,
    never: Linear,
    #[module(skip)]
    use_branch: Mutex<bool>,
    core: ModuleCore,
}

impl Branchy {
    fn new(dtype: DType) -> tp::Result<Branchy> {
        tp::manual_seed(SEED);
        Ok(Branchy {
            trunk: linear(5, 3, dtype)?,
            branch: linear(5, 3, dtype)?,
            never: linear(5, 3, dtype)?,
            use_branch: Mutex::new(true),
            core: ModuleCore::new(),
        })
    }
}

impl Module for Branchy {
    fn forward(&self, x: &Tensor) -> tp::Result<Tensor> {
        let h = self.trunk.call(x)?.tanh()?;
        if *self.use_branch.lock().unwrap() {
            h.add(&self.branch.call(x)?)
        } else {
            Ok(h)
        }
    }
}

/// Parameters unused on some ranks and steps: no hang, gradients equal to the single-process
/// sum of the ranks' losses divided by the world; a parameter no rank used keeps `None`. With
/// and without `find_unused_parameters`. Then `no_sync` for k micro-batches and a synced step
/// equals the big batch.
#[test]
fn unused_parameters_and_no_sync() {
    dist::spawn::spawn(3, |rank| -> TestResult {
        init()?;
        let world = 3usize;
        let dims = [5, 3];
        for find in [false, true] {
            let ddp = Ddp::with_options(
                Branchy::new(DType::F64)?,
                DdpOptions {
                    find_unused_parameters: find,
                    bucket_cap_mb: SMALL_CAP,
                    ..Default::default()
                },
            )?;
            let reference = Branchy::new(DType::F64)?;
            // step 2: nobody uses the branch; otherwise ranks where (step + rank) is even do
            let uses = |step: usize, r: usize| step != 2 && (step + r).is_multiple_of(2);
            for step in 0..4 {
                let what = format!("find_unused_parameters {find}, step {step}");
                *ddp.module().use_branch.lock().unwrap() = uses(step, rank);
                let (x, y) = rows(step * 9 + rank * 3, 3, &dims, DType::F64)?;
                ddp.zero_grad()?;
                mse(&ddp.call(&x)?, &y)?.backward()?;
                reference.zero_grad()?;
                let mut total: Option<Tensor> = None;
                for r in 0..world {
                    *reference.use_branch.lock().unwrap() = uses(step, r);
                    let (xr, yr) = rows(step * 9 + r * 3, 3, &dims, DType::F64)?;
                    let l = mse(&reference.call(&xr)?, &yr)?.mul_scalar(1.0 / world as f64)?;
                    total = Some(match total {
                        None => l,
                        Some(t) => t.add(&l)?,
                    });
                }
                total.ok_or("no loss")?.backward()?;
                grads_close(ddp.module(), &reference, 1e-12, &what)?;
                if ddp.module().never.weight.grad().is_some() {
                    return Err(format!("{what}: a parameter no rank used got a gradient").into());
                }
                if step == 2 && ddp.module().branch.weight.grad().is_some() {
                    return Err(format!("{what}: the branch nobody used got a gradient").into());
                }
            }
        }

        // no_sync: three accumulated micro-batches, then a synced one
        let ddp = Ddp::new(mlp(&DIMS, DType::F64, SEED)?)?;
        let reference = mlp(&DIMS, DType::F64, SEED)?;
        ddp.zero_grad()?;
        for m in 0..3 {
            let _guard = ddp.no_sync();
            let (x, y) = rows(m * 6 + rank * 2, 2, &DIMS, DType::F64)?;
            mse(&ddp.call(&x)?, &y)?.backward()?;
        }
        let (x, y) = rows(3 * 6 + rank * 2, 2, &DIMS, DType::F64)?;
        mse(&ddp.call(&x)?, &y)?.backward()?;
        for m in 0..4 {
            let (xa, ya) = rows(m * 6, 6, &DIMS, DType::F64)?;
            mse(&reference.call(&xa)?, &ya)?.backward()?;
        }
        grads_close(
            ddp.module(),
            &reference,
            1e-12,
            "no_sync x3 then a synced step",
        )?;
        dist::destroy_process_group()?;
        Ok(())
    })
    .unwrap();
}

// ---------------------------------------------------------------------------------------------
// join

/// Rank 0 has 3 batches, rank 1 has 5: with `join` both finish, rank 1's last two steps are
/// divided by the initial world size (or by the ranks still training), and afterwards both
/// ranks hold the model of rank 1, equal to the hand-computed run.
#[test]
fn join_with_uneven_inputs() {
    dist::spawn::spawn(2, |rank| -> TestResult {
        init()?;
        let batches = [3usize, 5];
        for divide_by_initial in [true, false] {
            let what = format!("divide_by_initial_world_size {divide_by_initial}");
            let ddp = Ddp::with_options(
                mlp(&DIMS, DType::F64, SEED)?,
                DdpOptions {
                    divide_by_initial_world_size: divide_by_initial,
                    bucket_cap_mb: SMALL_CAP,
                    ..Default::default()
                },
            )?;
            let mut opt = sgd(ddp.parameters())?;
            for step in 0..batches[rank] {
                let (x, y) = rows(step * 8 + rank * 4, 4, &DIMS, DType::F64)?;
                opt.zero_grad()?;
                mse(&ddp.call(&x)?, &y)?.backward()?;
                opt.step()?;
            }
            ddp.join()?;
            // the hand computation: steps 0..3 average both ranks; steps 3, 4 only rank 1's
            let reference = mlp(&DIMS, DType::F64, SEED)?;
            let mut ref_opt = sgd(reference.parameters())?;
            for step in 0..5 {
                ref_opt.zero_grad()?;
                let active: Vec<usize> = (0..2).filter(|&r| step < batches[r]).collect();
                let div = if divide_by_initial {
                    2.0
                } else {
                    active.len() as f64
                };
                for &r in &active {
                    let (x, y) = rows(step * 8 + r * 4, 4, &DIMS, DType::F64)?;
                    mse(&reference.call(&x)?, &y)?
                        .mul_scalar(1.0 / div)?
                        .backward()?;
                }
                ref_opt.step()?;
            }
            params_close(ddp.module(), &reference, 1e-12, &what)?;
            identical_across_ranks(ddp.module(), &what)?;
        }
        dist::destroy_process_group()?;
        Ok(())
    })
    .unwrap();
}

// ---------------------------------------------------------------------------------------------
// bad inputs

fn expect_err<T>(r: tp::Result<T>, what: &str) -> Result<tp::Error, String> {
    match r {
        Ok(_) => Err(format!("{what}: succeeded, expected an error")),
        Err(e) => Ok(e),
    }
}

fn contains_all(e: &tp::Error, parts: &[&str], what: &str) -> TestResult {
    let s = e.to_string();
    for p in parts {
        if !s.contains(p) {
            return Err(format!("{what}: {s:?} does not mention {p:?}").into());
        }
    }
    Ok(())
}

/// A rank with a different model, a rank that runs two training forwards before one backward,
/// and a rank that skips a backward: every rank gets an error naming the rank and what it did,
/// quickly (no timeout), and training can go on afterwards.
#[test]
fn bad_inputs_fail_on_every_rank() {
    dist::spawn::spawn(3, |rank| -> TestResult {
        init()?;
        // rank 2's second layer is wider
        let dims: &[usize] = if rank == 2 { &[5, 7, 8, 3] } else { &DIMS };
        let e = expect_err(Ddp::new(mlp(dims, DType::F32, SEED)?), "different models")?;
        contains_all(
            &e,
            &["rank 2", "\"2.weight\"", "[8, 7]", "[6, 7]"],
            "different models",
        )?;
        if !matches!(
            e.downcast_ref::<DdpError>(),
            Some(DdpError::ModelMismatch { .. })
        ) {
            return Err(format!("different models: {e:?}").into());
        }

        let ddp = Ddp::new(mlp(&DIMS, DType::F32, SEED)?)?;
        let started = std::time::Instant::now();
        let (x, y) = rows(rank * 2, 2, &DIMS, DType::F32)?;
        // step 0: rank 1 runs a second forward instead of its backward; the others' backward
        // fails naming it (no rank writes that step's gradients)
        let out = ddp.call(&x)?;
        if rank == 1 {
            let e = expect_err(ddp.call(&x), "two forwards")?;
            contains_all(
                &e,
                &[
                    "rank 1",
                    "before the backward of the previous training forward",
                ],
                "two forwards",
            )?;
        } else {
            let e = expect_err(mse(&out, &y)?.backward(), "peer's two forwards")?;
            contains_all(
                &e,
                &["rank(s) [1] could not finish this step"],
                "peer's two forwards",
            )?;
            if !matches!(
                e.downcast_ref::<DdpError>(),
                Some(DdpError::PeerMisuse { .. })
            ) {
                return Err(format!("peer's two forwards: {e:?}").into());
            }
            if ddp.module().parameters().iter().any(|p| p.grad().is_some()) {
                return Err("a failed step wrote gradients".into());
            }
        }
        // training goes on: one good step, then rank 0 skips a backward
        let reference = mlp(&DIMS, DType::F32, SEED)?;
        ddp.zero_grad()?;
        mse(&ddp.call(&x)?, &y)?.backward()?;
        let (xa, ya) = rows(0, 6, &DIMS, DType::F32)?;
        mse(&reference.call(&xa)?, &ya)?.backward()?;
        grads_close(ddp.module(), &reference, 1e-6, "the step after an error")?;
        let skipped = ddp.call(&x)?;
        if rank == 0 {
            contains_all(
                &expect_err(ddp.call(&x), "skipped backward")?,
                &["rank 0"],
                "skipped",
            )?;
        } else {
            let e = expect_err(mse(&skipped, &y)?.backward(), "peer's skipped backward")?;
            contains_all(
                &e,
                &["rank(s) [0] could not finish"],
                "peer's skipped backward",
            )?;
        }
        // a second backward through one forward is refused on the rank that does it
        let out = ddp.call(&x)?;
        let loss = mse(&out, &y)?;
        loss.backward_with(None, true, false)?;
        let e = expect_err(loss.backward(), "second backward")?;
        contains_all(&e, &["second backward"], "second backward")?;
        if started.elapsed() > Duration::from_secs(20) {
            return Err(format!(
                "errors took {:?}: a timeout, not a report",
                started.elapsed()
            )
            .into());
        }
        dist::destroy_process_group()?;
        Ok(())
    })
    .unwrap();
}

/// The ways one rank's step can fail — its backward errors in a tensor hook, its comm hook
/// errors or panics, its module's forward errors — fail that step on every rank (nobody writes
/// partial gradients), keep the collectives paired, and the next step is right again with the
/// replicas still identical.
#[test]
fn a_failed_step_fails_everywhere_and_training_goes_on() {
    dist::spawn::spawn(2, |rank| -> TestResult {
        init()?;
        let dims = [5, 16, 16, 3];
        let make = || Ddp::with_options(mlp(&dims, DType::F64, SEED).unwrap(), options(SMALL_CAP));
        let fail_hook = Arc::new(Mutex::new(0u8)); // 0 none, 1 error, 2 panic
        let ddp = make()?;
        {
            let f = fail_hook.clone();
            ddp.register_comm_hook(move |g, b| {
                let mode = *f.lock().unwrap_or_else(|e| e.into_inner());
                match mode {
                    1 if rank == 1 && b.index() == 1 => {
                        return Err(tp::Error::Autograd("the hook failed on purpose".into()));
                    }
                    2 if rank == 1 && b.index() == 0 => panic!("the hook panicked on purpose"),
                    _ => {}
                }
                default_hooks::allreduce_hook(g, b)
            })?;
        }
        let mut opt = sgd(ddp.parameters())?;
        let reference = mlp(&dims, DType::F64, SEED)?;
        let mut ref_opt = sgd(reference.parameters())?;
        let mut good = 0usize;
        for step in 0..6 {
            let (x, y) = rows(step * 6 + rank * 3, 3, &dims, DType::F64)?;
            *fail_hook.lock().unwrap() = match step {
                1 => 1,
                2 => 2,
                _ => 0,
            };
            let r = (|| -> tp::Result<()> {
                opt.zero_grad()?;
                let x_in = if step == 3 && rank == 1 {
                    // a bad batch: the module's forward fails on rank 1 only
                    x.narrow(1, 0, 2)?
                } else {
                    x.clone()
                };
                let out = ddp.call(&x_in)?;
                if step == 4 && rank == 1 {
                    out.register_hook(|_| Err(tp::Error::Autograd("a tensor hook failed".into())))?;
                }
                mse(&out, &y)?.backward()
            })();
            let should_fail = (1..=4).contains(&step);
            match (&r, should_fail) {
                (Ok(()), false) => {
                    opt.step()?;
                    let (xa, ya) = rows(step * 6, 6, &dims, DType::F64)?;
                    ref_opt.zero_grad()?;
                    mse(&reference.call(&xa)?, &ya)?.backward()?;
                    ref_opt.step()?;
                    good += 1;
                }
                (Err(_), true) => {
                    if ddp.module().parameters().iter().any(|p| p.grad().is_some()) {
                        return Err(format!("step {step}: a failed step wrote gradients").into());
                    }
                }
                (r, _) => return Err(format!("step {step}: {r:?}").into()),
            }
            identical_across_ranks(ddp.module(), &format!("after step {step}"))?;
        }
        if good != 2 {
            return Err(format!("{good} good steps").into());
        }
        params_close(ddp.module(), &reference, 1e-12, "after the failed steps")?;
        dist::destroy_process_group()?;
        Ok(())
    })
    .unwrap();
}

/// Protocol checks at the handshake: `no_sync` on one rank only, two models stepped in a
/// different order, a comm hook on one rank only — every rank fails at once, naming the
/// difference. Evaluation forwards with grad enabled need no collectives, and a backward
/// through one is refused. A gradient penalty (`autograd::grad` before `backward`) works, a
/// `.grad` the user kept is not overwritten, and with bucket views an unused parameter keeps
/// its `.grad`.
#[test]
fn protocol_checks_and_pytorch_patterns() {
    dist::spawn::spawn(2, |rank| -> TestResult {
        init()?;
        let (x, y) = rows(rank * 3, 3, &DIMS, DType::F64)?;
        let a = Ddp::new(mlp(&DIMS, DType::F64, SEED)?)?;
        let b = Ddp::new(mlp(&DIMS, DType::F64, SEED)?)?;
        // no_sync on rank 0 only
        if rank == 0 {
            let _g = a.no_sync();
            mse(&a.call(&x)?, &y)?.backward()?;
        }
        let e = expect_err(a.call(&x), "no_sync on one rank")?;
        contains_all(
            &e,
            &["no_sync", "rank 0 ran 1", "rank 1 ran 0"],
            "no_sync on one rank",
        )?;
        // a and b in a different order
        let first = if rank == 0 { &a } else { &b };
        let e = expect_err(first.call(&x), "models in a different order")?;
        contains_all(
            &e,
            &["different DistributedDataParallel"],
            "models in a different order",
        )?;
        // after the failed handshakes both models train again, on every rank alike
        for m in [&a, &b] {
            m.zero_grad()?;
            mse(&m.call(&x)?, &y)?.backward()?;
        }
        let reference = mlp(&DIMS, DType::F64, SEED)?;
        let (xa, ya) = rows(0, 6, &DIMS, DType::F64)?;
        mse(&reference.call(&xa)?, &ya)?.backward()?;
        grads_close(a.module(), &reference, 1e-12, "after the failed handshakes")?;
        // eval forwards: no collectives (rank 1 runs two, rank 0 none), no reduced backward
        if rank == 1 {
            let mut m = mlp(&DIMS, DType::F64, SEED)?;
            m.eval()?;
            let ev = Ddp::new(m)?;
            let _ = ev.call(&x)?;
            let out = ev.call(&x)?;
            let e = expect_err(mse(&out, &y)?.backward(), "backward through eval")?;
            contains_all(&e, &["eval() mode"], "backward through eval")?;
        } else {
            let mut m = mlp(&DIMS, DType::F64, SEED)?;
            m.eval()?;
            let _ev = Ddp::new(m)?;
        }
        // a gradient penalty: autograd::grad of the output, then backward
        let g = Ddp::new(mlp(&DIMS, DType::F64, SEED)?)?;
        let reference = mlp(&DIMS, DType::F64, SEED)?;
        let penalty = |m: &dyn Module, x: &Tensor, y: &Tensor| -> tp::Result<Tensor> {
            let x = x.detach().requires_grad_(true);
            let out = m.call(&x)?;
            let gx = tp::autograd::grad(
                &[out.sum()?],
                std::slice::from_ref(&x),
                &[],
                tp::autograd::GradOptions {
                    create_graph: true,
                    ..Default::default()
                },
            )?;
            let gx = gx[0]
                .clone()
                .ok_or_else(|| tp::Error::Autograd("no grad".into()))?;
            mse(&out, y)?.add(&gx.mul(&gx)?.mean()?)
        };
        penalty(&g, &x, &y)?.backward()?;
        let mut total: Option<Tensor> = None;
        for r in 0..2 {
            let (xr, yr) = rows(r * 3, 3, &DIMS, DType::F64)?;
            let l = penalty(&reference, &xr, &yr)?.mul_scalar(0.5)?;
            total = Some(match total {
                None => l,
                Some(t) => t.add(&l)?,
            });
        }
        total.ok_or("no loss")?.backward()?;
        grads_close(g.module(), &reference, 1e-12, "gradient penalty")?;
        // a kept `.grad` is not overwritten after zero_grad
        let kept = g.module().parameters()[0].grad().ok_or("no grad")?;
        let snapshot = kept.deep_clone()?;
        g.zero_grad()?;
        mse(&g.call(&x.mul_scalar(2.0)?)?, &y)?.backward()?;
        close(&kept, &snapshot, 0.0, "a .grad kept across zero_grad")?;
        // bucket views: a parameter nobody uses this step keeps its .grad
        let v = Ddp::with_options(
            Branchy::new(DType::F64)?,
            DdpOptions {
                gradient_as_bucket_view: true,
                ..Default::default()
            },
        )?;
        let (x5, y5) = rows(rank * 3, 3, &[5, 3], DType::F64)?;
        for step in 0..3 {
            *v.module().use_branch.lock().unwrap() = step < 2;
            let before = v
                .module()
                .branch
                .weight
                .grad()
                .map(|g| g.deep_clone())
                .transpose()?;
            mse(&v.call(&x5)?, &y5)?.backward()?;
            if step == 2 {
                let now = v
                    .module()
                    .branch
                    .weight
                    .grad()
                    .ok_or("branch lost its grad")?;
                close(
                    &now,
                    &before.ok_or("no grad before")?,
                    0.0,
                    "unused with bucket views",
                )?;
            }
        }
        dist::destroy_process_group()?;
        Ok(())
    })
    .unwrap();
}

/// The scratch folder of a checkpoint test: the parent's, passed to the ranks in
/// `TP_CKPT_TEST_DIR`.
fn ckpt_dir() -> std::path::PathBuf {
    match std::env::var("TP_CKPT_TEST_DIR") {
        Ok(d) => d.into(),
        Err(_) => {
            let d = std::env::temp_dir().join(format!("tp-dnn-ckpt-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).expect("scratch dir");
            d
        }
    }
}

/// Replicated and sharded checkpoints at world size 2: rank 0 writes the replicated file and
/// both read it back; each rank's shard comes back bit-exact at the same world size; a later
/// save removes the earlier shards; a corrupt shard fails every rank, naming the rank; a
/// checkpoint of another world size is refused (no resharding).
#[test]
fn replicated_and_sharded_checkpoints_world_2() {
    use std::collections::BTreeMap;
    use tensorplay_distributed_nn::checkpoint;
    let dir = ckpt_dir();
    let mut o = dist::SpawnOptions::new(2);
    o.timeout = Some(Duration::from_secs(60));
    o.env = vec![("TP_CKPT_TEST_DIR".into(), dir.display().to_string())];
    let result = dist::spawn::spawn_with(o, |rank| -> TestResult {
        let dir = ckpt_dir();
        init()?;
        let meta = BTreeMap::from([("rank".to_string(), rank.to_string())]);
        // replicated: rank 0's values are the file's
        let mine = BTreeMap::from([(
            "w".to_string(),
            Tensor::from_vec(vec![rank as f64; 3], &[3])?,
        )]);
        let path = dir.join("model.safetensors");
        checkpoint::save_replicated(&mine, &meta, &path, None)?;
        let (back, m) = tp::serialize::load_with_metadata(&path)?;
        assert_eq!(
            back["w"].to_vec::<f64>()?,
            vec![0.0; 3],
            "rank {rank}: rank 0's values"
        );
        assert_eq!(m["rank"], "0");
        // sharded: each rank's own, twice (the second save replaces the first)
        for step in [10u64, 20] {
            let shard = BTreeMap::from([(
                "part".to_string(),
                Tensor::from_vec(vec![(rank * 100) as i64 + step as i64; 2], &[2])?,
            )]);
            checkpoint::save_sharded(&dir, "tp", step, &shard, &meta, None)?;
        }
        let s = checkpoint::load_sharded(&dir, "tp", None)?;
        assert_eq!(s.step, 20);
        assert_eq!(
            s.tensors["part"].to_vec::<i64>()?,
            vec![(rank * 100) as i64 + 20; 2]
        );
        assert_eq!(s.metadata["rank"], rank.to_string());
        dist::barrier(None)?;
        let old = dir.join(format!("tp.step10.rank{rank}.safetensors"));
        assert!(!old.exists(), "rank {rank}: the earlier shard was removed");
        // rank 1's shard corrupted: both ranks fail, rank 1 naming its file
        if rank == 1 {
            let f = dir.join("tp.step20.rank1.safetensors");
            let mut b = std::fs::read(&f)?;
            let n = b.len();
            b[n - 1] ^= 0xff;
            std::fs::write(&f, b)?;
        }
        dist::barrier(None)?;
        let e = checkpoint::load_sharded(&dir, "tp", None)
            .unwrap_err()
            .to_string();
        if rank == 1 {
            assert!(
                e.contains("tp.step20.rank1.safetensors") && e.contains("corrupt"),
                "{e}"
            );
        } else {
            assert!(e.contains("rank(s) [1] could not load"), "{e}");
        }
        dist::barrier(None)?;
        // another world size: refused on every rank
        if rank == 0 {
            let json = std::fs::read_to_string(dir.join("tp.json"))?;
            std::fs::write(
                dir.join("tp.json"),
                json.replace("\"world_size\":2", "\"world_size\":4"),
            )?;
        }
        dist::barrier(None)?;
        let e = checkpoint::load_sharded(&dir, "tp", None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("written by 4 ranks, loaded by 2"),
            "rank {rank}: {e}"
        );
        dist::destroy_process_group()?;
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&dir);
    result.unwrap();
}
