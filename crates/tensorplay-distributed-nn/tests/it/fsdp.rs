//! `fully_shard` across real processes (`spawn`, the "cpu" backend): gradients and parameters
//! (after AdamW steps) against the single-process run of the whole batch, for an MLP and a small GPT, nested and
//! root-only wrapping, with and without resharding after forward, frozen and tied parameters,
//! dimensions 0 that do not divide by the world; the bytes each rank keeps; and bad inputs
//! that must fail on every rank.

use std::time::Duration;

use tensorplay::models::{Gpt, GptConfig};
use tensorplay_collectives::{self as dist, device_mesh::DeviceMesh};
use tensorplay_core::nn::utils::clip_grad_norm_;
use tensorplay_core::nn::{self, Linear, Module, Sequential};
use tensorplay_core::optim::{AdamW, AdamWOptions, Optimizer, SGD, SgdOptions};
use tensorplay_core::utils::checkpoint::CheckpointWrapper;
use tensorplay_core::{self as tp, DType, Tensor};
use tensorplay_distributed_nn::parallel::fsdp::{
    FsdpEvent, FsdpModule, FsdpOptions, MixedPrecisionPolicy, clip_grad_norm_ as sharded_clip,
    full_tensor, fully_shard, to_local,
};
use tensorplay_testkit::{Tol, check_close, cpu_world};

pub(crate) type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

pub(crate) const TIMEOUT: Duration = Duration::from_secs(60);
const STEPS: usize = 3;
/// Rows of the whole batch (every world used here divides it).
pub(crate) const BATCH: usize = 12;

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Model {
    /// Linear 5 -> 7 -> 6 -> 3 with Tanh: dimensions 0 of 7, 6 and 3 rows.
    Mlp,
    /// The GPT of `tensorplay::models` with 2 blocks of width 16 and a tied head.
    Gpt,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Wrap {
    /// Every child with parameters (every block), then the root.
    Nested,
    /// The root alone.
    RootOnly,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Case {
    pub(crate) name: &'static str,
    pub(crate) model: Model,
    pub(crate) wrap: Wrap,
    pub(crate) reshard_after_forward: bool,
    /// The dtype the model is built in (the shards' dtype).
    pub(crate) dtype: DType,
    /// The first layer's bias (the MLP) or the first block's first LayerNorm (the GPT) frozen.
    pub(crate) frozen: bool,
    /// The mixed-precision policy of every `fully_shard` call.
    pub(crate) mp: MixedPrecisionPolicy,
    /// Every layer (the MLP) or block (the GPT) of the sharded model in a
    /// `CheckpointWrapper` before `fully_shard` (the reference is never checkpointed).
    pub(crate) checkpointed: bool,
}

pub(crate) const fn case(
    name: &'static str,
    model: Model,
    wrap: Wrap,
    raf: bool,
    dtype: DType,
) -> Case {
    Case {
        name,
        model,
        wrap,
        reshard_after_forward: raf,
        dtype,
        frozen: false,
        mp: MixedPrecisionPolicy {
            param_dtype: None,
            reduce_dtype: None,
            output_dtype: None,
            cast_forward_inputs: true,
        },
        checkpointed: false,
    }
}

pub(crate) fn gpt_config(dtype: DType) -> GptConfig {
    GptConfig {
        vocab_size: 11,
        block_size: 8,
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        dropout: 0.0,
        dtype,
    }
}

fn mlp(dtype: DType, checkpointed: bool) -> tp::Result<Sequential> {
    let dims = [5, 7, 6, 3];
    let mut m = Sequential::new();
    for (k, w) in dims.windows(2).enumerate() {
        let l = Linear::new(w[0], w[1], true)?;
        let leaf = |t: &Tensor| -> tp::Result<Tensor> {
            Ok(t.detach()
                .to_dtype(dtype)?
                .deep_clone()?
                .requires_grad_(true))
        };
        let b = l.bias.as_ref().map(leaf).transpose()?;
        let l = Linear::from_weights(leaf(&l.weight)?, b)?;
        m = if checkpointed {
            m.add(CheckpointWrapper::new(l))
        } else {
            m.add(l)
        };
        if k + 2 < dims.len() {
            m = m.add(nn::Tanh::new());
        }
    }
    Ok(m)
}

/// The case's model, built from the seed (the same on every rank and in the reference),
/// with activation checkpointing per layer or block when `checkpointed`.
pub(crate) fn build(c: &Case, checkpointed: bool) -> tp::Result<Box<dyn Module>> {
    tp::manual_seed(7);
    let mut m: Box<dyn Module> = match c.model {
        Model::Mlp => Box::new(mlp(c.dtype, checkpointed)?),
        Model::Gpt => {
            let mut g = Gpt::new(gpt_config(c.dtype))?;
            g.set_activation_checkpointing(checkpointed);
            Box::new(g)
        }
    };
    if c.frozen {
        let name = match c.model {
            Model::Mlp => "0.bias",
            Model::Gpt => "h.0.ln_1.weight",
        };
        let (_, p) = m
            .named_parameters()
            .into_iter()
            .find(|(n, _)| n == name)
            .ok_or_else(|| tp::Error::Autograd(format!("no parameter {name}")))?;
        p.set_requires_grad(false)?;
    }
    m.train(true)?;
    Ok(m)
}

/// Rows `from..from + n` of the case's data: `(input, target)`.
pub(crate) fn rows(c: &Case, from: usize, n: usize) -> tp::Result<(Tensor, Tensor)> {
    match c.model {
        Model::Mlp => {
            let x: Vec<f64> = (from..from + n)
                .flat_map(|i| (0..5).map(move |j| ((i * 13 + j * 7) as f64 * 0.37).sin()))
                .collect();
            let y: Vec<f64> = (from..from + n)
                .flat_map(|i| (0..3).map(move |j| ((i * 5 + j * 11) as f64 * 0.23).cos()))
                .collect();
            Ok((
                Tensor::from_vec(x, &[n, 5])?.to_dtype(c.dtype)?,
                Tensor::from_vec(y, &[n, 3])?.to_dtype(c.dtype)?,
            ))
        }
        Model::Gpt => {
            let t = 8;
            let tok = |i: usize, j: usize| ((i * 7 + j * 3 + i * j) % 11) as i64;
            let x: Vec<i64> = (from..from + n)
                .flat_map(|i| (0..t).map(move |j| tok(i, j)))
                .collect();
            let y: Vec<i64> = (from..from + n)
                .flat_map(|i| (0..t).map(move |j| tok(i, j + 1)))
                .collect();
            Ok((Tensor::from_vec(x, &[n, t])?, Tensor::from_vec(y, &[n, t])?))
        }
    }
}

pub(crate) fn loss(c: &Case, m: &dyn Module, x: &Tensor, y: &Tensor) -> tp::Result<Tensor> {
    loss_of(c, &m.call(x)?, y)
}

/// The case's loss of the model's output `out` against `y`.
pub(crate) fn loss_of(c: &Case, out: &Tensor, y: &Tensor) -> tp::Result<Tensor> {
    match c.model {
        Model::Mlp => nn::MSELoss::new().forward(out, y),
        Model::Gpt => {
            let n = y.numel();
            nn::functional::cross_entropy(&out.reshape(&[n, 11])?, &y.reshape(&[n])?)
        }
    }
}

/// Wraps `m` as the case says; the handles, the root's last.
pub(crate) fn wrap(c: &Case, m: &mut dyn Module) -> tp::Result<Vec<FsdpModule>> {
    wrap_on(c, m, None)
}

/// [`wrap`] over `mesh` (`None`: the default group).
pub(crate) fn wrap_on(
    c: &Case,
    m: &mut dyn Module,
    mesh: Option<&DeviceMesh>,
) -> tp::Result<Vec<FsdpModule>> {
    let opts = FsdpOptions {
        mesh: mesh.cloned(),
        reshard_after_forward: c.reshard_after_forward,
        mp_policy: c.mp,
        ..Default::default()
    };
    // the blocks' outputs stay in the compute dtype (the next block and the root's own layers
    // take them as they are); the root's output is cast as the policy says
    let inner = FsdpOptions {
        mp_policy: MixedPrecisionPolicy {
            output_dtype: None,
            ..c.mp
        },
        ..opts.clone()
    };
    let mut out = Vec::new();
    if c.wrap == Wrap::Nested {
        for (_, child) in m.named_children_mut() {
            // the GPT's blocks are in `h`; the MLP's layers are its children
            if child.named_children().iter().any(|(n, _)| n == "0") {
                for (_, block) in child.named_children_mut() {
                    out.push(fully_shard(block, inner.clone())?);
                }
            } else if !child.local_parameters().is_empty() && c.model == Model::Mlp {
                out.push(fully_shard(child, inner.clone())?);
            }
        }
    }
    out.push(fully_shard(m, opts)?);
    Ok(out)
}

/// The whole tensor of which every rank holds `shard` (rows in rank order), as `f64`s.
pub(crate) fn gathered(shard: &Tensor) -> tp::Result<Vec<f64>> {
    gathered_in(shard, None)
}

/// [`gathered`] over `group` (`None`: the default group).
pub(crate) fn gathered_in(
    shard: &Tensor,
    group: Option<&dist::ProcessGroup>,
) -> tp::Result<Vec<f64>> {
    let all: Vec<Vec<f64>> = dist::all_gather_object(&shard.to_vec_f64()?, group)?;
    Ok(all.concat())
}

/// AdamW in float64; SGD in float32, where AdamW's division by the root of the second moment
/// turns gradients that are zero up to rounding (the key projection's bias: softmax ignores
/// it) into steps of size `lr` whose signs are the rounding's, in either run.
pub(crate) fn optimizer(params: Vec<Tensor>, dtype: DType) -> tp::Result<Box<dyn Optimizer>> {
    Ok(if dtype == DType::F64 {
        Box::new(AdamW::new(
            params,
            AdamWOptions {
                lr: 1e-2,
                weight_decay: 0.01,
                ..Default::default()
            },
        )?)
    } else {
        Box::new(SGD::new(
            params,
            SgdOptions {
                lr: 0.1,
                ..Default::default()
            },
        )?)
    })
}

pub(crate) fn tol(dtype: DType) -> Tol {
    if dtype == DType::F64 {
        Tol::scaled(1e-12)
    } else {
        Tol::scaled(1e-5)
    }
}

/// One case on this rank: `STEPS` AdamW steps of the fully sharded model on the rank's rows
/// beside the single-process model on the whole batch; after every backward the gathered
/// gradient of every parameter equals the reference's, after the last step the parameters.
fn run_case(c: &Case, rank: usize, world: usize) -> TestResult {
    run_case_on(c, rank, world, None)
}

/// [`run_case`] with the model sharded over `mesh` (1-D, or 2-D for HSDP; `None`: the default
/// group); `rank` and `world` place the rank's rows in the whole batch.
pub(crate) fn run_case_on(
    c: &Case,
    rank: usize,
    world: usize,
    mesh: Option<&DeviceMesh>,
) -> TestResult {
    let what = format!("{} (world {world})", c.name);
    // the shards' group: the mesh's last dimension
    let group = match mesh {
        Some(m) => Some(m.get_group(m.ndim() - 1)?.clone()),
        None => None,
    };
    let gathered = |t: &Tensor| gathered_in(t, group.as_ref());
    let mut model = build(c, c.checkpointed)?;
    let reference = build(c, false)?;
    let names: Vec<String> = reference
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let handles = wrap_on(c, model.as_mut(), mesh)?;
    let listed: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    if listed != names {
        return Err(format!("{what}: parameters listed as {listed:?}, want {names:?}").into());
    }
    let mut opt = optimizer(model.parameters(), c.dtype)?;
    let mut ref_opt = optimizer(reference.parameters(), c.dtype)?;
    let per = BATCH / world;
    for step in 0..STEPS {
        let (x, y) = rows(c, step * BATCH + rank * per, per)?;
        let (xa, ya) = rows(c, step * BATCH, BATCH)?;
        opt.zero_grad()?;
        loss(c, model.as_ref(), &x, &y)?.backward()?;
        ref_opt.zero_grad()?;
        loss(c, reference.as_ref(), &xa, &ya)?.backward()?;
        for ((n, s), (_, r)) in model
            .named_parameters()
            .iter()
            .zip(reference.named_parameters())
        {
            match (s.grad(), r.grad()) {
                (Some(g), Some(h)) => check_close(
                    &format!("{what}, step {step}: grad of {n}"),
                    &gathered(&g)?,
                    &h.to_vec_f64()?,
                    tol(c.dtype),
                )?,
                (None, None) => {}
                (g, h) => {
                    return Err(format!(
                        "{what}, step {step}: grad of {n} is {} here, {} in the reference",
                        if g.is_some() { "set" } else { "None" },
                        if h.is_some() { "set" } else { "None" },
                    )
                    .into());
                }
            }
        }
        // between steps every group is resharded: nothing gathered stays
        if let Some(h) = handles.iter().find(|h| h.is_unsharded()) {
            return Err(format!("{what}, step {step}: {h:?} still gathered after backward").into());
        }
        opt.step()?;
        ref_opt.step()?;
    }
    for ((n, s), (_, r)) in model
        .named_parameters()
        .iter()
        .zip(reference.named_parameters())
    {
        check_close(
            &format!("{what}: {n} after {STEPS} steps"),
            &gathered(s)?,
            &r.to_vec_f64()?,
            tol(c.dtype),
        )?;
        // full_tensor puts the same rows back together, in the full shape
        let full = full_tensor(s)?;
        if full.shape() != r.shape() {
            return Err(format!("{what}: full_tensor of {n} has shape {:?}", full.shape()).into());
        }
        check_close(
            &format!("{what}: full_tensor of {n}"),
            &full.to_vec_f64()?,
            &r.to_vec_f64()?,
            tol(c.dtype),
        )?;
        // to_local is the shard itself
        if to_local(s)?.id() != s.id() {
            return Err(format!("{what}: to_local of {n} is another tensor").into());
        }
    }
    if full_tensor(&reference.parameters()[0]).is_ok()
        || to_local(&reference.parameters()[0]).is_ok()
    {
        return Err(format!(
            "{what}: full_tensor or to_local accepted a tensor that is not a shard"
        )
        .into());
    }
    Ok(())
}

pub(crate) const CASES: [Case; 6] = [
    case(
        "mlp nested, reshard after forward",
        Model::Mlp,
        Wrap::Nested,
        true,
        DType::F64,
    ),
    case(
        "mlp root only",
        Model::Mlp,
        Wrap::RootOnly,
        true,
        DType::F64,
    ),
    case(
        "mlp nested, kept until backward",
        Model::Mlp,
        Wrap::Nested,
        false,
        DType::F64,
    ),
    case(
        "gpt nested, reshard after forward",
        Model::Gpt,
        Wrap::Nested,
        true,
        DType::F64,
    ),
    case(
        "gpt nested, float32",
        Model::Gpt,
        Wrap::Nested,
        true,
        DType::F32,
    ),
    case(
        "gpt root only, kept",
        Model::Gpt,
        Wrap::RootOnly,
        false,
        DType::F64,
    ),
];

const FROZEN: [Case; 2] = [
    Case {
        frozen: true,
        ..case(
            "mlp with a frozen bias",
            Model::Mlp,
            Wrap::Nested,
            true,
            DType::F64,
        )
    },
    Case {
        frozen: true,
        ..case(
            "gpt with a frozen LayerNorm",
            Model::Gpt,
            Wrap::Nested,
            true,
            DType::F64,
        )
    },
];

pub(crate) fn check_world(world: usize, cases: &[Case]) {
    cpu_world(world, TIMEOUT, |rank| -> TestResult {
        for c in cases {
            run_case(c, rank, world)?;
        }
        Ok(())
    });
}

#[test]
fn matches_one_process_world_2() {
    check_world(2, &CASES);
    check_world(2, &FROZEN);
}

#[test]
fn matches_one_process_worlds_1_3_4() {
    check_world(1, &CASES[..1]);
    check_world(3, &[CASES[0], CASES[3]]);
    check_world(4, &[CASES[0], CASES[3], FROZEN[1]]);
}

/// Where `e` falls in `events`: the sequence numbers of its occurrences.
fn seqs(events: &[(u64, FsdpEvent)], e: FsdpEvent) -> Vec<u64> {
    events
        .iter()
        .filter(|(_, x)| *x == e)
        .map(|(n, _)| *n)
        .collect()
}

/// Overlap, from the recorded order of a second step (the first forward learns the order):
/// in forward, the next group's all-gather is issued before this group's forward ends; in
/// backward, the group before is gathered before this group's reduce-scatter is issued; the
/// first reduce-scatter is issued before backward ends; every group is resharded after.
#[test]
fn prefetching_and_reduce_scatter_overlap_compute() {
    let c = CASES[3];
    cpu_world(2, TIMEOUT, |rank| -> TestResult {
        use FsdpEvent::*;
        let mut model = build(&c, false)?;
        let handles = wrap(&c, model.as_mut())?;
        for step in 0..2 {
            let (x, y) = rows(&c, step * 12 + rank * 6, 6)?;
            loss(&c, model.as_ref(), &x, &y)?.backward()?;
            if step == 0 {
                for h in &handles {
                    h.take_events();
                }
            }
        }
        // forward order: the root, then the blocks
        let mut order: Vec<&FsdpModule> = vec![&handles[handles.len() - 1]];
        order.extend(&handles[..handles.len() - 1]);
        let ev: Vec<Vec<(u64, FsdpEvent)>> = order.iter().map(|h| h.take_events()).collect();
        let first = |k: usize, e| {
            seqs(&ev[k], e)
                .first()
                .copied()
                .ok_or_else(|| format!("group {k}: no {e:?} in {:?}", ev[k]))
        };
        let last = |k: usize, e| {
            seqs(&ev[k], e)
                .last()
                .copied()
                .ok_or_else(|| format!("group {k}: no {e:?} in {:?}", ev[k]))
        };
        for k in 0..order.len() - 1 {
            if first(k + 1, AllGather)? > first(k, ForwardEnd)? {
                return Err(format!(
                    "forward: group {}'s all-gather after group {k}'s forward ended: {ev:?}",
                    k + 1
                )
                .into());
            }
        }
        for k in 2..order.len() {
            // the block before this one was gathered again for backward before this one's
            // gradients went out
            if last(k - 1, AllGather)? > first(k, ReduceScatter)? {
                return Err(format!("backward: group {}'s all-gather late: {ev:?}", k - 1).into());
            }
        }
        let first_rs = (0..order.len())
            .map(|k| first(k, ReduceScatter))
            .collect::<Result<Vec<_>, _>>()?;
        let ends = (0..order.len())
            .map(|k| first(k, BackwardEnd))
            .collect::<Result<Vec<_>, _>>()?;
        if first_rs.iter().min() > ends.iter().min() {
            return Err(format!("no reduce-scatter before backward ended: {ev:?}").into());
        }
        for (k, h) in order.iter().enumerate() {
            if h.is_unsharded() {
                return Err(format!("group {k} still gathered: {ev:?}").into());
            }
            if h.is_root() != (k == 0) {
                return Err(format!("group {k}: is_root {:?}", h.is_root()).into());
            }
        }
        Ok(())
    });
}

/// `fsdp::clip_grad_norm_` over shards (and replicated parameters, counted once) gives the
/// single-process total norm and clipped gradients, for the 2-norm and the largest value.
/// Every rank trains on the whole batch, so the replicated layers' gradients agree.
#[test]
fn clip_grad_norm_matches_one_process() {
    let c = CASES[0];
    cpu_world(2, TIMEOUT, |_rank| -> TestResult {
        for (norm_type, max_norm) in [(2.0, 0.05), (f64::INFINITY, 0.01), (1.0, 1e6)] {
            let what = format!("norm_type {norm_type}, max_norm {max_norm}");
            let mut model = build(&c, false)?;
            // only the first layer is sharded: the others stay whole on every rank
            let first = model
                .named_children_mut()
                .into_iter()
                .next()
                .ok_or("no layer")?
                .1;
            fully_shard(first, FsdpOptions::default())?;
            let reference = build(&c, false)?;
            let (x, y) = rows(&c, 0, BATCH)?;
            loss(&c, model.as_ref(), &x, &y)?.backward()?;
            loss(&c, reference.as_ref(), &x, &y)?.backward()?;
            let total = sharded_clip(&model.parameters(), max_norm, norm_type, false)?;
            let want = clip_grad_norm_(&reference.parameters(), max_norm, norm_type, false)?;
            check_close(
                &format!("{what}: total norm"),
                &[total],
                &[want],
                tol(c.dtype),
            )?;
            for ((n, s), (_, r)) in model
                .named_parameters()
                .iter()
                .zip(reference.named_parameters())
            {
                let g = s.grad().ok_or_else(|| format!("{what}: no grad for {n}"))?;
                let sharded = n.starts_with("0.");
                let got = if sharded {
                    gathered(&g)?
                } else {
                    g.to_vec_f64()?
                };
                let want = r.grad().ok_or("no reference grad")?.to_vec_f64()?;
                check_close(
                    &format!("{what}: clipped grad of {n}"),
                    &got,
                    &want,
                    tol(c.dtype),
                )?;
            }
        }
        Ok(())
    });
}
