//! Pipelines given bad input or hit by faults, across real processes: ranks that disagree on
//! the schedule or the micro-batches, a stage that raises, a stage that dies mid-step — every
//! rank gets an error naming the stage (and micro-batch) at fault within seconds, never a hang.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tensorplay_collectives as dist;
use tensorplay_core::nn::{Linear, Module};
use tensorplay_core::{self as tp, DType, Tensor};
use tensorplay_distributed_nn::parallel::pipelining::{
    MultiIo, PipelineError, PipelineSchedule, PipelineStage, ScheduleKind, loss_fn,
};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn init(timeout_s: u64) -> dist::Result<()> {
    dist::init_process_group(
        "cpu",
        dist::InitOptions {
            timeout: Duration::from_secs(timeout_s),
            ..Default::default()
        },
    )
}

/// Rank 0 serves the store: it waits (at most 20 s) until rank 1 has its verdict for `case`
/// too, so that leaving does not take the store from under rank 1.
fn both_checked(rank: usize, case: &str) -> TestResult {
    all_checked(rank, 2, case)
}

/// [`both_checked`] for `n` ranks: rank 0 waits until the other `n - 1` have their verdicts.
fn all_checked(rank: usize, n: i64, case: &str) -> TestResult {
    let store = dist::default_group("test")?.store().clone();
    store.add("test/checked", 1)?;
    let start = Instant::now();
    while rank == 0 && store.add("test/checked", 0)? < n {
        if start.elapsed() > Duration::from_secs(20) {
            return Err(format!("{case}: not every rank finished").into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Stage `s` of `n`: a 4 -> 4 linear layer whose forward runs `hook(call number)` first.
fn stage(
    s: usize,
    n: usize,
    hook: impl Fn(usize) -> tp::Result<()> + 'static,
) -> tp::Result<PipelineStage> {
    tp::manual_seed(s as u64);
    let calls = Arc::new(AtomicUsize::new(0));
    let m = MultiIo::new(
        Linear::new(4, 4, true)?,
        move |m: &Linear, xs: &[Tensor]| {
            hook(calls.fetch_add(1, Ordering::Relaxed))?;
            Ok(vec![m.call(&xs[0])?])
        },
    );
    PipelineStage::new(m, s, n, &dist::default_group("test")?)
}

fn mse() -> tensorplay_distributed_nn::parallel::pipelining::LossFn {
    loss_fn(|y, t| y.sub(t)?.pow_scalar(2.0)?.mean())
}

/// One training step of rank `rank` (stage `rank` of `n`) on a batch of 8.
fn step(sched: &mut PipelineSchedule, rank: usize, n: usize) -> tp::Result<()> {
    let x = Tensor::ones(&[8, 4], DType::F32)?;
    let mut losses = vec![];
    match rank {
        0 => sched.step(&x),
        r if r + 1 == n => sched.step_with_target(&x, &mut losses),
        _ => sched.step_middle(),
    }
}

/// `res` is an error whose text contains every one of `needles`.
fn fails_with(case: &str, res: tp::Result<()>, needles: &[String]) -> Result<(), String> {
    match res {
        Ok(()) => Err(format!("{case}: accepted")),
        Err(e) => match needles.iter().find(|n| !e.to_string().contains(n.as_str())) {
            Some(n) => Err(format!("{case}: the error lacks {n:?}: {e}")),
            None => Ok(()),
        },
    }
}

#[test]
fn ranks_that_disagree_on_the_schedule_fail_on_every_rank_at_the_first_step() {
    // (case, rank 1's schedule, rank 1's micro-batches, what every rank's error says)
    let cases: [(&str, ScheduleKind, usize, &str); 2] = [
        (
            "micro-batch counts",
            ScheduleKind::OneFOneB,
            2,
            "with 2 micro-batches",
        ),
        ("schedules", ScheduleKind::GPipe, 4, "runs ScheduleGPipe"),
    ];
    for (case, kind1, m1, want) in cases {
        let res = dist::spawn(2, move |rank| -> TestResult {
            init(10)?;
            let (kind, m) = if rank == 1 {
                (kind1, m1)
            } else {
                (ScheduleKind::OneFOneB, 4)
            };
            let mut sched =
                PipelineSchedule::new(kind, vec![stage(rank, 2, |_| Ok(()))?], m, Some(mse()))?;
            let start = Instant::now();
            let res = step(&mut sched, rank, 2);
            fails_with(
                case,
                res,
                &[format!("mismatch on rank {rank}"), want.to_string()],
            )?;
            if start.elapsed() > Duration::from_secs(5) {
                return Err(format!("{case}: took {:?}", start.elapsed()).into());
            }
            Ok(())
        });
        if let Err(e) = res {
            panic!("{case}: {e}");
        }
    }
}

/// What rank 1 does differently from rank 0 (which trains, tying nothing).
#[derive(Clone, Copy)]
enum Divergence {
    /// Rank 0 evaluates while rank 1 trains.
    EvalBesideStep,
    /// Rank 1 evaluates while rank 0 trains (rank 0 waits for gradients that never come).
    StepBesideEval,
    /// Rank 0 ties its weight over both ranks; rank 1 ties nothing.
    TieOnOneRank,
}

/// A step that one rank takes differently fails on both ranks (never `Ok` on one and an
/// error on the other), within seconds, saying what differs.
#[test]
fn ranks_that_take_a_step_differently_fail_together() {
    // (case, what differs, what both errors say)
    let cases: [(&str, Divergence, &str); 3] = [
        (
            "eval beside step",
            Divergence::EvalBesideStep,
            "1 rank(s) of the pipeline group called step and 1 called eval",
        ),
        (
            "step beside eval",
            Divergence::StepBesideEval,
            "1 rank(s) of the pipeline group called step and 1 called eval",
        ),
        (
            "tie on one rank",
            Divergence::TieOnOneRank,
            "rank 0 ties a parameter of shape [4, 4] over ranks [0, 1] (its tie 1 over them); \
             rank 1 does not match: it ties 0 parameter(s) over them",
        ),
    ];
    for (case, how, want) in cases {
        let res = dist::spawn(2, move |rank| -> TestResult {
            init(20)?;
            let mut s = stage(rank, 2, |_| Ok(()))?;
            if rank == 0 && matches!(how, Divergence::TieOnOneRank) {
                let w = s.parameters()[0].clone();
                s.tie_parameter(&w, &dist::default_group("test")?)?;
            }
            let mut sched = PipelineSchedule::new(ScheduleKind::OneFOneB, vec![s], 4, Some(mse()))?;
            let evaluates = match how {
                Divergence::EvalBesideStep => rank == 0,
                Divergence::StepBesideEval => rank == 1,
                Divergence::TieOnOneRank => false,
            };
            let start = Instant::now();
            let res = if evaluates {
                let x = Tensor::ones(&[8, 4], DType::F32)?;
                let ins = (rank == 0).then_some(std::slice::from_ref(&x));
                sched.eval(ins).map(|_| ())
            } else {
                step(&mut sched, rank, 2)
            };
            let checked = fails_with(case, res, &[want.to_string()]);
            if start.elapsed() > Duration::from_secs(5) {
                return Err(format!("{case}: took {:?}", start.elapsed()).into());
            }
            both_checked(rank, case)?;
            Ok(checked?)
        });
        if let Err(e) = res {
            panic!("{case}: {e}");
        }
    }
}

/// What goes wrong in a step, and whether the next steps run.
#[derive(Clone, Copy)]
enum Failed {
    /// Rank 0 passes a batch that does not split (found before any message: the next step
    /// runs).
    BadBatchOnRank0,
    /// Rank 1 raises in its second forward (messages are in flight: later steps are refused).
    RaiseMidStep,
    /// A first schedule steps once; a second one, on the same group, fails its step 0 on
    /// rank 0's last backward (its keys are its own: rank 1 must not read the first's).
    SecondScheduleRaises,
}

/// After a failed step: every rank returns the same outcome for it and for the next two.
#[test]
fn after_a_failed_step_every_rank_agrees_on_what_runs_next() {
    // (case, the fault, what the failed step's errors say, whether the next steps run)
    let cases: [(&str, Failed, &str, bool); 3] = [
        (
            "bad batch",
            Failed::BadBatchOnRank0,
            "a batch whose dim 0 splits into 4 equal micro-batches",
            true,
        ),
        ("raise mid-step", Failed::RaiseMidStep, "boom", false),
        (
            "second schedule",
            Failed::SecondScheduleRaises,
            "boom",
            false,
        ),
    ];
    for (case, how, want, recovers) in cases {
        let res = dist::spawn(2, move |rank| -> TestResult {
            init(20)?;
            let raise = move |on: usize, call: usize| {
                move |c: usize| {
                    if rank == on && c == call {
                        Err(tp::Error::Custom {
                            context: format!("stage {on}"),
                            message: "boom".into(),
                        })
                    } else {
                        Ok(())
                    }
                }
            };
            let mut sched = match how {
                Failed::RaiseMidStep => {
                    let s = stage(rank, 2, raise(1, 1))?;
                    PipelineSchedule::new(ScheduleKind::OneFOneB, vec![s], 4, Some(mse()))?
                }
                Failed::BadBatchOnRank0 => {
                    let s = stage(rank, 2, |_| Ok(()))?;
                    PipelineSchedule::new(ScheduleKind::OneFOneB, vec![s], 4, Some(mse()))?
                }
                Failed::SecondScheduleRaises => {
                    let s = stage(rank, 2, |_| Ok(()))?;
                    let mut first =
                        PipelineSchedule::new(ScheduleKind::OneFOneB, vec![s], 4, Some(mse()))?;
                    step(&mut first, rank, 2)?;
                    // rank 0's stage forwards 4 times a step: its 4th call is the last one
                    let s = stage(rank, 2, raise(0, 3))?;
                    PipelineSchedule::new(ScheduleKind::OneFOneB, vec![s], 4, Some(mse()))?
                }
            };
            let first = if matches!(how, Failed::BadBatchOnRank0) && rank == 0 {
                let x = Tensor::ones(&[7, 4], DType::F32)?;
                sched.step(&x)
            } else {
                step(&mut sched, rank, 2)
            };
            let checked = fails_with(case, first, &[want.to_string()]).and_then(|()| {
                for next in 1..3 {
                    let res = step(&mut sched, rank, 2);
                    match (recovers, res) {
                        (true, Err(e)) => return Err(format!("{case}: step {next}: {e}")),
                        (false, Ok(())) => return Err(format!("{case}: step {next} ran")),
                        (false, Err(e)) if !e.to_string().contains("build a new process group") => {
                            return Err(format!("{case}: step {next}: {e}"));
                        }
                        _ => {}
                    }
                }
                Ok(())
            });
            both_checked(rank, case)?;
            Ok(checked?)
        });
        if let Err(e) = res {
            panic!("{case}: {e}");
        }
    }
}

/// Identity whose backward sleeps `delay` first.
struct SlowBackward {
    delay: Duration,
}

impl tp::autograd::Function for SlowBackward {
    fn forward(
        &self,
        _ctx: &mut tp::autograd::Context,
        inputs: &[&Tensor],
    ) -> tp::Result<Vec<Tensor>> {
        Ok(vec![inputs[0].clone()])
    }
    fn backward(
        &self,
        _ctx: &tp::autograd::Context,
        grads: &[Tensor],
    ) -> tp::Result<Vec<Option<Tensor>>> {
        std::thread::sleep(self.delay);
        Ok(vec![Some(grads[0].clone())])
    }
}

/// Rank 0's last action (the backward of micro-batch 3, after every message of the step)
/// outlasts the group's timeout: the step fails on both ranks, never `Ok` on the slow one
/// and an error on the other.
#[test]
fn a_rank_slower_than_the_timeout_after_its_last_message_fails_the_step_on_every_rank() {
    let res = dist::spawn(2, |rank| -> TestResult {
        init(3)?;
        tp::manual_seed(rank as u64);
        let calls = Arc::new(AtomicUsize::new(0));
        let m = MultiIo::new(
            Linear::new(4, 4, true)?,
            move |m: &Linear, xs: &[Tensor]| {
                let y = m.call(&xs[0])?;
                let slow = rank == 0 && calls.fetch_add(1, Ordering::Relaxed) == 3;
                let delay = Duration::from_millis(if slow { 4500 } else { 0 });
                tp::autograd::apply(SlowBackward { delay }, &[&y])
            },
        );
        let s = PipelineStage::new(m, rank, 2, &dist::default_group("test")?)?;
        let mut sched = PipelineSchedule::new(ScheduleKind::OneFOneB, vec![s], 4, Some(mse()))?;
        let res = step(&mut sched, rank, 2);
        let checked = fails_with(
            "slow last action",
            res,
            &[
                "did not reach the end of step 0".to_string(),
                "[0]".to_string(),
            ],
        );
        both_checked(rank, "slow last action")?;
        Ok(checked?)
    });
    if let Err(e) = res {
        panic!("{e}");
    }
}

#[test]
fn a_stage_that_raises_is_named_on_every_rank() {
    let res = dist::spawn(3, |rank| -> TestResult {
        init(20)?;
        // stage 1 fails in the forward of micro-batch 2
        let s = stage(rank, 3, move |call| {
            if rank == 1 && call == 2 {
                Err(tp::Error::Custom {
                    context: "stage 1".into(),
                    message: "boom".into(),
                })
            } else {
                Ok(())
            }
        })?;
        let mut sched = PipelineSchedule::new(ScheduleKind::OneFOneB, vec![s], 4, Some(mse()))?;
        let start = Instant::now();
        let err = step(&mut sched, rank, 3)
            .err()
            .ok_or("the step succeeded")?;
        if start.elapsed() > Duration::from_secs(5) {
            return Err(format!("rank {rank}: took {:?}: {err}", start.elapsed()).into());
        }
        let pe = err
            .downcast_ref::<PipelineError>()
            .ok_or_else(|| format!("not a PipelineError: {err}"))?;
        let ok = match pe {
            PipelineError::Action {
                stage: 1,
                microbatch: 2,
                action,
                message,
                ..
            } => rank == 1 && action == "1F2" && message.contains("boom"),
            PipelineError::PeerFailed {
                failed_stage: 1,
                failed_rank: 1,
                message,
                ..
            } => rank != 1 && message.contains("micro-batch 2") && message.contains("boom"),
            _ => false,
        };
        // rank 0 serves the store: it stays until the others have their verdicts too
        all_checked(rank, 3, "a stage that raises")?;
        if !ok {
            return Err(format!("rank {rank}: {pe}").into());
        }
        Ok(())
    });
    if let Err(e) = res {
        panic!("{e}");
    }
}

#[test]
fn a_stage_that_dies_mid_step_is_named_by_the_others() {
    let res = dist::spawn(3, |rank| -> TestResult {
        init(5)?;
        let s = stage(rank, 3, move |call| {
            if rank == 1 && call == 1 {
                std::process::exit(0); // gone without a word, in its second forward
            }
            Ok(())
        })?;
        let mut sched = PipelineSchedule::new(ScheduleKind::OneFOneB, vec![s], 4, Some(mse()))?;
        let start = Instant::now();
        let err = step(&mut sched, rank, 3)
            .err()
            .ok_or("the step succeeded")?;
        if start.elapsed() > Duration::from_secs(20) {
            return Err(format!("rank {rank}: took {:?}: {err}", start.elapsed()).into());
        }
        let msg = err.to_string();
        if !msg.contains("stage 1 (rank 1) failed: lost") {
            return Err(format!("rank {rank}: does not name stage 1 on rank 1: {msg}").into());
        }
        Ok(())
    });
    // rank 1 exited with status 0 before reporting: spawn counts that as its failure only
    if let Err(e) = res {
        let msg = e.to_string();
        if msg.contains("rank 0") || msg.contains("rank 2") || !msg.contains("rank 1") {
            panic!("{msg}");
        }
    }
}

/// A rank stuck in its forward (longer than the group's timeout): the stage waiting for its
/// activation fails at the timeout naming the stage, the micro-batch and the rank it waits
/// for, and the flight recorder's diagnosis says which receive waits and where the peer is.
#[test]
fn a_hang_is_reported_with_the_message_waited_for_and_where_the_peer_is() {
    let res = dist::spawn(2, |rank| -> TestResult {
        init(3)?;
        // rank 0's stage: two forwards a step; the first of step 1 stalls
        let s = stage(rank, 2, move |call| {
            if rank == 0 && call == 2 {
                std::thread::sleep(Duration::from_millis(4500));
            }
            Ok(())
        })?;
        let mut sched = PipelineSchedule::new(ScheduleKind::OneFOneB, vec![s], 2, Some(mse()))?;
        step(&mut sched, rank, 2)?;
        let err = step(&mut sched, rank, 2)
            .err()
            .ok_or("step 1 succeeded with a stalled stage 0")?;
        if rank == 0 {
            return Err(err.into());
        }
        let msg = err.to_string();
        for want in [
            "stage 0 (rank 0) failed: lost",
            "waiting for stage 0's micro-batch 0 activation (step 1) from rank 0",
        ] {
            if !msg.contains(want) {
                return Err(format!("the error lacks {want:?}: {msg}").into());
            }
        }
        Err(msg.into())
    });
    let msg = res.expect_err("both ranks time out").to_string();
    // (waits, or failed once the timeout closed the connection)
    let want = "in recv from rank 0 (stage 0's micro-batch 0 activation (step 1), header)";
    assert!(msg.contains(want), "the report lacks {want:?}:\n{msg}");
}
