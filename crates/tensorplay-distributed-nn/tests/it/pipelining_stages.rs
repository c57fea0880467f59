//! Pipeline stages beyond one tensor in and out, and the memory each schedule holds, across
//! real processes: a stage with two outputs (the next stage takes both) against the
//! single-process composition; the first stage's peak activation bytes under 1F1B within the
//! schedule's bound (`p` micro-batches in flight) and under GPipe growing with the number of
//! micro-batches.

use std::time::Duration;

use tensorplay_collectives as dist;
use tensorplay_core::nn::{Linear, Module};
use tensorplay_core::{self as tp, DType, Tensor};
use tensorplay_distributed_nn::parallel::pipelining::{
    MultiIo, PipelineSchedule, PipelineStage, ScheduleKind, loss_fn,
};
use tensorplay_testkit::{Tol, check_close, cpu_world};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn as_f64(t: &Tensor) -> Vec<f64> {
    t.to_vec::<f64>().unwrap()
}

/// Stage 0: `h = W0 x + b0`, outputs `(tanh h, 2 h)`; stage 1: `W1 (a + b * b)`.
fn layers() -> tp::Result<(Linear, Linear)> {
    tp::manual_seed(11);
    let f64_linear = |i: usize, o: usize| -> tp::Result<Linear> {
        let w = Tensor::randn(&[o, i], DType::F64)?.requires_grad_(true);
        let b = Tensor::randn(&[o], DType::F64)?.requires_grad_(true);
        Linear::from_weights(w, Some(b))
    };
    Ok((f64_linear(4, 6)?, f64_linear(6, 3)?))
}

fn first(m: &Linear, xs: &[Tensor]) -> tp::Result<Vec<Tensor>> {
    let h = m.call(&xs[0])?;
    Ok(vec![h.tanh()?, h.mul_scalar(2.0)?])
}

fn second(m: &Linear, xs: &[Tensor]) -> tp::Result<Vec<Tensor>> {
    Ok(vec![m.call(&xs[0].add(&xs[1].mul(&xs[1])?)?)?])
}

fn data() -> tp::Result<(Tensor, Tensor)> {
    tp::manual_seed(5);
    Ok((
        Tensor::randn(&[8, 4], DType::F64)?,
        Tensor::randn(&[8, 3], DType::F64)?,
    ))
}

fn mse(y: &Tensor, t: &Tensor) -> tp::Result<Tensor> {
    y.sub(t)?.pow_scalar(2.0)?.mean()
}

#[test]
fn a_stage_with_two_outputs_feeds_both_to_the_next() {
    cpu_world(2, Duration::from_secs(60), |rank| -> TestResult {
        let (x, t) = data()?;
        // the single-process reference
        let (l0, l1) = layers()?;
        let y = second(&l1, &first(&l0, std::slice::from_ref(&x))?)?.remove(0);
        let loss = mse(&y, &t)?;
        loss.backward()?;
        let want: Vec<Vec<f64>> = [&l0, &l1][rank]
            .parameters()
            .iter()
            .map(|p| as_f64(&p.grad().unwrap()))
            .collect();
        // the pipeline, GPipe and 1F1B
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let (l0, l1) = layers()?;
            let group = dist::default_group("test")?;
            let stage = if rank == 0 {
                PipelineStage::new(MultiIo::new(l0, first), 0, 2, &group)?
            } else {
                PipelineStage::new(MultiIo::new(l1, second), 1, 2, &group)?
            };
            let mut sched = PipelineSchedule::new(kind, vec![stage], 4, Some(loss_fn(mse)))?;
            let mut losses = vec![];
            if rank == 0 {
                sched.step(&x)?;
            } else {
                sched.step_with_target(&t, &mut losses)?;
                let mean = losses.iter().map(|l| as_f64(l)[0]).sum::<f64>() / 4.0;
                // the mean of the micro-batches' mean losses is the batch's mean loss
                check_close(
                    &format!("{kind}: loss"),
                    &[mean],
                    &as_f64(&loss),
                    Tol::scaled(1e-12),
                )?;
            }
            for (i, p) in sched.stages()[0].parameters().iter().enumerate() {
                check_close(
                    &format!("{kind}: stage {rank} parameter {i}"),
                    &as_f64(&p.grad().unwrap()),
                    &want[i],
                    Tol::scaled(1e-12),
                )?;
            }
        }
        Ok(())
    });
}

/// A first stage wide enough that its activations dominate: `x -> gelu(W x)` of width 512.
fn wide_stage(rank: usize) -> tp::Result<PipelineStage> {
    tp::manual_seed(3);
    let m = if rank == 0 {
        Linear::new(64, 512, true)?
    } else {
        Linear::new(512, 64, true)?
    };
    let f = |m: &Linear, xs: &[Tensor]| Ok(vec![m.call(&xs[0])?.tanh()?]);
    PipelineStage::new(MultiIo::new(m, f), rank, 2, &dist::default_group("test")?)
}

/// Stage 0's peak tensor bytes above what it held before the step, for `kind` over `m`
/// micro-batches of 16 rows (rank 1 returns 0).
fn peak_bytes(rank: usize, kind: ScheduleKind, m: usize) -> tp::Result<usize> {
    let mut sched = PipelineSchedule::new(kind, vec![wide_stage(rank)?], m, Some(loss_fn(mse)))?;
    let x = Tensor::ones(&[16 * m, 64], DType::F32)?;
    let mut losses = vec![];
    dist::barrier(None)?;
    let base = tp::memory::allocated_bytes();
    tp::memory::reset_peak();
    if rank == 0 {
        sched.step(&x)?;
    } else {
        sched.step_with_target(&x, &mut losses)?;
    }
    let peak = tp::memory::peak_allocated_bytes().saturating_sub(base);
    dist::barrier(None)?;
    Ok(if rank == 0 { peak } else { 0 })
}

#[test]
fn stage_zero_holds_p_micro_batches_under_1f1b_and_all_of_them_under_gpipe() {
    cpu_world(2, Duration::from_secs(60), |rank| -> TestResult {
        // one micro-batch's activation on stage 0: the tanh's output, 16 x 512 float32 (kept
        // for its backward, sent to stage 1); each received gradient is as large
        let one = 16 * 512 * 4;
        let mut got = vec![];
        for (kind, m) in [
            (ScheduleKind::OneFOneB, 4),
            (ScheduleKind::OneFOneB, 8),
            (ScheduleKind::GPipe, 4),
            (ScheduleKind::GPipe, 8),
        ] {
            got.push(peak_bytes(rank, kind, m)?);
        }
        if rank != 0 {
            return Ok(());
        }
        let [f4, f8, g4, g8] = [got[0], got[1], got[2], got[3]];
        let say = format!(
            "1F1B m=4 {f4}, m=8 {f8}; GPipe m=4 {g4}, m=8 {g8} (one micro-batch {one} bytes)"
        );
        // GPipe holds every micro-batch: 4 more micro-batches, 4 more activations
        if (g8 as f64) < g4 as f64 + 3.5 * one as f64 {
            return Err(format!("GPipe does not grow with the micro-batches: {say}").into());
        }
        // 1F1B holds at most p = 2 in flight whatever m (and the gradient it receives): flat
        // in m, and at m = 8 at least 8 - 2 - 1 activations below GPipe
        if f8.abs_diff(f4) > one / 2 {
            return Err(format!("1F1B grows with the micro-batches: {say}").into());
        }
        if (f8 as f64) > g8 as f64 - 4.5 * one as f64 {
            return Err(format!("1F1B holds more than p micro-batches: {say}").into());
        }
        Ok(())
    });
}
