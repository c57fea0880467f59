//! Pipeline parallelism across real processes: the GPT split into 2 and 4 stages under every
//! schedule, its loss and every parameter's gradient after a step against the unsplit model on
//! the whole batch (float64 1e-12, float32 1e-6), AdamW steps (with a sequence length that
//! changes between steps) against the single-process run, the tied embedding and head
//! bit-identical after every update, and each rank's recorded trace equal to its list.

use std::collections::BTreeMap;
use std::time::Duration;

use tensorplay::models::gpt::{shard_parameter, tensor_parallel_plan};
use tensorplay::models::{Gpt, GptConfig, GptStage};
use tensorplay_collectives::{self as dist, ProcessGroup};
use tensorplay_core::nn::Module;
use tensorplay_core::nn::functional::cross_entropy;
use tensorplay_core::optim::{AdamW, AdamWOptions, Optimizer};
use tensorplay_core::{self as tp, DType, Tensor};
use tensorplay_distributed_nn::parallel::fsdp::{FsdpOptions, fully_shard};
use tensorplay_distributed_nn::parallel::pipelining::{
    LossFn, PipelineSchedule, PipelineShape, PipelineStage, ScheduleKind, loss_fn,
};
use tensorplay_distributed_nn::parallel::tensor::parallelize_module;
use tensorplay_testkit::{Tol, check_close, cpu_world, element_bits};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

const TIMEOUT: Duration = Duration::from_secs(60);
const VOCAB: usize = 11;
/// Sequences in the whole batch.
const BATCH: usize = 8;

fn config(dtype: DType) -> GptConfig {
    GptConfig {
        vocab_size: VOCAB,
        block_size: 8,
        n_layer: 4,
        n_head: 2,
        n_embd: 16,
        dropout: 0.0,
        dtype,
    }
}

/// The batch of step `step`: token ids and next-token targets `[BATCH, t]`.
fn batch(step: usize, t: usize) -> tp::Result<(Tensor, Tensor)> {
    let ids = |shift: usize| -> Vec<i64> {
        (0..BATCH * t)
            .map(|i| ((i * 7 + (i / t) * 3 + step * 5 + shift) % VOCAB) as i64)
            .collect()
    };
    Ok((
        Tensor::from_vec(ids(0), &[BATCH, t])?,
        Tensor::from_vec(ids(1), &[BATCH, t])?,
    ))
}

fn gpt_loss() -> LossFn {
    loss_fn(|logits, target| {
        let n = target.numel();
        cross_entropy(&logits.reshape(&[n, VOCAB])?, &target.reshape(&[n])?)
    })
}

/// The full model's name of a stage's parameter (`h.i` counts from the stage's first block;
/// the head is the tied token embedding).
fn full_name(name: &str, first_block: usize) -> String {
    if name == "lm_head.weight" {
        return "wte.weight".into();
    }
    match name.strip_prefix("h.").and_then(|r| r.split_once('.')) {
        Some((i, rest)) => format!("h.{}.{rest}", first_block + i.parse::<usize>().unwrap()),
        None => name.to_string(),
    }
}

struct Case {
    name: &'static str,
    kind: ScheduleKind,
    ranks: usize,
    stages_per_rank: usize,
    microbatches: usize,
    dtype: DType,
    /// AdamW steps after the first (checked against the single-process run).
    steps: usize,
}

const CASES: &[Case] = &[
    Case {
        name: "GPipe, 2 stages, 4 micro-batches, f64",
        kind: ScheduleKind::GPipe,
        ranks: 2,
        stages_per_rank: 1,
        microbatches: 4,
        dtype: DType::F64,
        steps: 2,
    },
    Case {
        name: "1F1B, 2 stages, 4 micro-batches, f64",
        kind: ScheduleKind::OneFOneB,
        ranks: 2,
        stages_per_rank: 1,
        microbatches: 4,
        dtype: DType::F64,
        steps: 2,
    },
    Case {
        name: "1F1B, 4 stages, 8 micro-batches, f32",
        kind: ScheduleKind::OneFOneB,
        ranks: 4,
        stages_per_rank: 1,
        microbatches: 8,
        dtype: DType::F32,
        steps: 0,
    },
    Case {
        name: "GPipe, 4 stages, 4 micro-batches, f64",
        kind: ScheduleKind::GPipe,
        ranks: 4,
        stages_per_rank: 1,
        microbatches: 4,
        dtype: DType::F64,
        steps: 1,
    },
    Case {
        name: "interleaved 1F1B, 2 ranks x 2 stages, 4 micro-batches, f64",
        kind: ScheduleKind::Interleaved1F1B,
        ranks: 2,
        stages_per_rank: 2,
        microbatches: 4,
        dtype: DType::F64,
        steps: 2,
    },
    Case {
        name: "interleaved zero bubble, 2 ranks x 2 stages, 4 micro-batches, f64",
        kind: ScheduleKind::InterleavedZeroBubble,
        ranks: 2,
        stages_per_rank: 2,
        microbatches: 4,
        dtype: DType::F64,
        steps: 2,
    },
];

/// The single-process run: the loss and every gradient of each step, and the parameters after
/// each AdamW step, by name.
struct Reference {
    losses: Vec<f64>,
    grads: Vec<BTreeMap<String, Vec<f64>>>,
    params: Vec<BTreeMap<String, Vec<f64>>>,
}

fn adamw(params: Vec<Tensor>) -> tp::Result<AdamW> {
    AdamW::new(
        params,
        AdamWOptions {
            lr: 1e-2,
            weight_decay: 0.01,
            ..Default::default()
        },
    )
}

fn as_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

/// Sequence length of step `i` (it changes: shapes travel with the activations).
fn seq_len(i: usize) -> usize {
    [6, 4, 7][i % 3]
}

fn reference(case: &Case) -> tp::Result<Reference> {
    tp::manual_seed(0);
    let gpt = Gpt::new(config(case.dtype))?;
    let mut opt = adamw(gpt.parameters())?;
    let mut r = Reference {
        losses: vec![],
        grads: vec![],
        params: vec![],
    };
    for i in 0..=case.steps {
        let (x, y) = batch(i, seq_len(i))?;
        opt.zero_grad()?;
        let loss = gpt.loss(&x, &y)?;
        loss.backward()?;
        r.losses.push(as_f64(&loss)[0]);
        r.grads.push(
            gpt.named_parameters()
                .iter()
                .map(|(n, p)| (n.clone(), as_f64(&p.grad().unwrap())))
                .collect(),
        );
        opt.step()?;
        r.params.push(
            gpt.named_parameters()
                .iter()
                .map(|(n, p)| (n.clone(), as_f64(p)))
                .collect(),
        );
    }
    Ok(r)
}

/// This rank's stages of the GPT built from seed 0, the embedding and head tied over the
/// group of the first and last stages' ranks.
pub(crate) fn gpt_stages(
    cfg: GptConfig,
    shape: &PipelineShape,
    group: &ProcessGroup,
    tie: &ProcessGroup,
) -> tp::Result<Vec<PipelineStage>> {
    tp::manual_seed(0);
    let gpt = Gpt::new(cfg)?;
    let r = group.rank().unwrap();
    let s_total = shape.stages();
    let mut out = vec![];
    for s in shape.stages_of(r) {
        let part: GptStage = gpt.pipeline_stage(s, s_total)?;
        let tied = part.tied_weight();
        let mut stage = PipelineStage::new(part, s, s_total, group)?;
        if let (Some(w), true) = (tied, s == 0 || s + 1 == s_total) {
            stage.tie_parameter(&w, tie)?;
        }
        out.push(stage);
    }
    Ok(out)
}

fn run_case(case: &Case, rank: usize) -> TestResult {
    let shape = PipelineShape {
        ranks: case.ranks,
        stages_per_rank: case.stages_per_rank,
        microbatches: case.microbatches,
    };
    let tol = if case.dtype == DType::F64 {
        Tol::scaled(1e-12)
    } else {
        Tol::scaled(1e-6)
    };
    let want = reference(case)?;
    let world = dist::new_group(&(0..case.ranks).collect::<Vec<_>>(), None, None)?;
    let tie = dist::new_group(&[0, shape.rank_of(shape.stages() - 1)], None, None)?;
    let stages = gpt_stages(config(case.dtype), &shape, &world, &tie)?;
    let cuts: Vec<usize> = stages
        .iter()
        .map(|s| 4 * s.stage_index() / shape.stages())
        .collect();
    let params: Vec<Tensor> = stages.iter().flat_map(PipelineStage::parameters).collect();
    let mut sched = PipelineSchedule::new(case.kind, stages, case.microbatches, Some(gpt_loss()))?;
    let mut opt = adamw(params)?;
    let c = case.name;
    for i in 0..=case.steps {
        let (x, y) = batch(i, seq_len(i))?;
        opt.zero_grad()?;
        let mut losses = vec![];
        let first = rank == 0;
        let last = rank == shape.rank_of(shape.stages() - 1);
        sched.step_full(
            first.then_some(std::slice::from_ref(&x)),
            last.then_some(&y),
            Some(&mut losses),
        )?;
        if sched.last_trace() != sched.actions()[rank].as_slice() {
            return Err(format!(
                "{c}: rank {rank} ran {:?}, its list is {:?}",
                sched.last_trace(),
                sched.actions()[rank]
            )
            .into());
        }
        if last {
            let mean = losses.iter().map(|l| as_f64(l)[0]).sum::<f64>() / losses.len() as f64;
            check_close(
                &format!("{c}: step {i} loss"),
                &[mean],
                &[want.losses[i]],
                tol,
            )?;
        }
        for (st, &lo) in sched.stages().iter().zip(&cuts) {
            for (n, p) in st.submod().named_parameters() {
                let full = full_name(&n, lo);
                let g = p.grad().ok_or_else(|| {
                    format!("{c}: stage {} {n} has no gradient", st.stage_index())
                })?;
                check_close(
                    &format!("{c}: step {i} stage {} grad {n}", st.stage_index()),
                    &as_f64(&g),
                    &want.grads[i][&full],
                    tol,
                )?;
            }
        }
        opt.step()?;
        // (float32: AdamW turns gradients that are zero up to rounding — the key bias's —
        // into full steps of either sign, in either run; the gradients above are the check)
        for (st, &lo) in sched
            .stages()
            .iter()
            .zip(&cuts)
            .filter(|_| case.dtype == DType::F64)
        {
            for (n, p) in st.submod().named_parameters() {
                let full = full_name(&n, lo);
                check_close(
                    &format!("{c}: step {i} stage {} param {n}", st.stage_index()),
                    &as_f64(&p),
                    &want.params[i][&full],
                    tol,
                )?;
            }
        }
        // the two copies of the tied weight stay bit-identical
        let mine = sched.stages().iter().find_map(|s| {
            s.submod()
                .named_parameters()
                .into_iter()
                .find(|(n, _)| n == "wte.weight" || n == "lm_head.weight")
                .map(|(_, p)| p)
        });
        let bits = mine.map(|p| element_bits(&p).unwrap()).unwrap_or_default();
        let all = dist::all_gather_object(&bits, Some(&world))?;
        let copies: Vec<&Vec<u64>> = all.iter().filter(|b| !b.is_empty()).collect();
        if copies.len() != 2 || copies[0] != copies[1] {
            return Err(format!(
                "{c}: step {i}: the tied embedding and head differ ({} copies)",
                copies.len()
            )
            .into());
        }
    }
    Ok(())
}

#[test]
fn the_gpt_split_into_stages_trains_as_the_unsplit_model_under_every_schedule() {
    for case in CASES {
        cpu_world(case.ranks, TIMEOUT, |rank| {
            run_case(case, rank).map_err(|e| format!("{}: {e}", case.name))
        });
    }
}

/// How each stage's replicas share their work in [`pp_by_dp`].
#[derive(Debug, Clone, Copy, PartialEq)]
enum Replicas {
    /// `PipelineStage::data_parallel`: gradients averaged over the replicas.
    DataParallel,
    /// Every block of the stage, then the stage, `fully_shard`ed over the `dp` sub-mesh.
    FullySharded,
}

/// Pipeline x data parallel on a `DeviceMesh` `[pp 2, dp 2]` at world 4: each pipeline
/// replica takes half the batch in 2 micro-batches; gradients and AdamW steps equal the
/// single-process run on the whole batch.
fn pp_by_dp(replicas: Replicas) {
    let case = Case {
        name: "1F1B pp 2 x dp 2",
        kind: ScheduleKind::OneFOneB,
        ranks: 2,
        stages_per_rank: 1,
        microbatches: 2,
        dtype: DType::F64,
        steps: 2,
    };
    cpu_world(4, TIMEOUT, |rank| -> TestResult {
        let want = reference(&case)?;
        let mesh = dist::device_mesh::init_device_mesh(&[2, 2], &["pp", "dp"])?;
        let (pp, dp) = (mesh.get_group("pp")?.clone(), mesh.get_group("dp")?.clone());
        let (pp_rank, dp_rank) = (mesh.get_local_rank("pp")?, mesh.get_local_rank("dp")?);
        let s = pp_rank;
        tp::manual_seed(0);
        let mut part = Gpt::new(config(DType::F64))?.pipeline_stage(s, 2)?;
        if replicas == Replicas::FullySharded {
            let opts = || FsdpOptions {
                mesh: Some(mesh.sub_mesh("dp").unwrap().clone()),
                ..Default::default()
            };
            for block in part.h.iter_mut() {
                fully_shard(block, opts())?;
            }
            fully_shard(&mut part, opts())?;
        }
        // (after sharding: the tied copies are the shards, the same rows on both stages)
        let tied = part.tied_weight().ok_or("no tied weight")?;
        let mut stage = PipelineStage::new(part, s, 2, &pp)?;
        // with 2 stages the embedding group is the pipeline group
        stage.tie_parameter(&tied, &pp)?;
        if replicas == Replicas::DataParallel {
            stage = stage.data_parallel(&dp)?;
        }
        let lo = 4 * s / 2;
        let mut opt = adamw(stage.parameters())?;
        let mut sched = PipelineSchedule::new(case.kind, vec![stage], 2, Some(gpt_loss()))?;
        let tol = Tol::scaled(1e-12);
        // the whole tensor (its shards' rows in dp rank order)
        let whole = |t: &Tensor| -> tp::Result<Vec<f64>> {
            match replicas {
                Replicas::FullySharded => crate::fsdp::gathered_in(t, Some(&dp)),
                Replicas::DataParallel => Ok(as_f64(t)),
            }
        };
        for i in 0..=case.steps {
            let (x, y) = batch(i, seq_len(i))?;
            let rows = BATCH / 2;
            let (x, y) = (
                x.narrow(0, dp_rank * rows, rows)?,
                y.narrow(0, dp_rank * rows, rows)?,
            );
            opt.zero_grad()?;
            let mut losses = vec![];
            if pp_rank == 0 {
                sched.step(&x)?;
            } else {
                sched.step_with_target(&y, &mut losses)?;
            }
            let c = format!("{replicas:?} rank {rank} step {i}");
            for (n, p) in sched.stages()[0].submod().named_parameters() {
                let g = whole(&p.grad().ok_or("no gradient")?)?;
                check_close(
                    &format!("{c} grad {n}"),
                    &g,
                    &want.grads[i][&full_name(&n, lo)],
                    tol,
                )?;
            }
            opt.step()?;
            for (n, p) in sched.stages()[0].submod().named_parameters() {
                check_close(
                    &format!("{c} param {n}"),
                    &whole(&p)?,
                    &want.params[i][&full_name(&n, lo)],
                    tol,
                )?;
            }
        }
        Ok(())
    });
}

#[test]
fn pipeline_by_data_parallel_on_a_mesh_equals_one_process() {
    pp_by_dp(Replicas::DataParallel);
}

#[test]
fn pipeline_by_fully_sharded_on_a_mesh_equals_one_process() {
    pp_by_dp(Replicas::FullySharded);
}

/// Pipeline x tensor parallel on a `DeviceMesh` `[pp 2, tp 2]` at world 4: each stage's blocks
/// split Megatron-style over its tp group by the GPT's plan (`parallelize_module`), the
/// activations between stages replicated over tp; every shard's gradient and value after
/// AdamW steps equal its slice of the single-process run's (`shard_parameter`).
#[test]
fn pipeline_by_tensor_parallel_on_a_mesh_equals_one_process() {
    let case = Case {
        name: "1F1B pp 2 x tp 2",
        kind: ScheduleKind::OneFOneB,
        ranks: 2,
        stages_per_rank: 1,
        microbatches: 4,
        dtype: DType::F64,
        steps: 2,
    };
    cpu_world(4, TIMEOUT, |rank| -> TestResult {
        let want = reference(&case)?;
        tp::manual_seed(0);
        let full = Gpt::new(config(DType::F64))?;
        let shapes: BTreeMap<String, Vec<usize>> = full
            .named_parameters()
            .into_iter()
            .map(|(n, p)| (n, p.shape().to_vec()))
            .collect();
        let mesh = dist::device_mesh::init_device_mesh(&[2, 2], &["pp", "tp"])?;
        let pp = mesh.get_group("pp")?.clone();
        let (s, tp_rank) = (mesh.get_local_rank("pp")?, mesh.get_local_rank("tp")?);
        let mut part = full.pipeline_stage(s, 2)?;
        parallelize_module(&mut part, mesh.sub_mesh("tp")?, &tensor_parallel_plan())?;
        let tied = part.tied_weight().ok_or("no tied weight")?;
        let mut stage = PipelineStage::new(part, s, 2, &pp)?;
        stage.tie_parameter(&tied, &pp)?;
        let lo = 4 * s / 2;
        let mut opt = adamw(stage.parameters())?;
        let mut sched = PipelineSchedule::new(case.kind, vec![stage], 4, Some(gpt_loss()))?;
        let tol = Tol::scaled(1e-12);
        // this rank's slice of a full value of parameter `n`
        let slice = |n: &str, v: &[f64]| -> tp::Result<Vec<f64>> {
            let t = Tensor::from_vec(v.to_vec(), &shapes[n])?;
            Ok(as_f64(&shard_parameter(n, &t, tp_rank, 2)?))
        };
        for i in 0..=case.steps {
            let (x, y) = batch(i, seq_len(i))?;
            opt.zero_grad()?;
            let mut losses = vec![];
            if s == 0 {
                sched.step(&x)?;
            } else {
                sched.step_with_target(&y, &mut losses)?;
            }
            let c = format!("rank {rank} step {i}");
            for (n, p) in sched.stages()[0].submod().named_parameters() {
                let f = full_name(&n, lo);
                // (a row-parallel bias is trained by tp rank 0: no gradient on the others)
                let g = match p.grad() {
                    Some(g) => as_f64(&g),
                    None => vec![0.0; p.numel()],
                };
                check_close(
                    &format!("{c} grad {n}"),
                    &g,
                    &slice(&f, &want.grads[i][&f])?,
                    tol,
                )?;
            }
            opt.step()?;
            for (n, p) in sched.stages()[0].submod().named_parameters() {
                let f = full_name(&n, lo);
                check_close(
                    &format!("{c} param {n}"),
                    &as_f64(&p),
                    &slice(&f, &want.params[i][&f])?,
                    tol,
                )?;
            }
        }
        Ok(())
    });
}
