//! `ShardedGradScaler` across real processes: an infinite or NaN gradient on one rank only
//! makes every rank skip the step (parameters bit-identical to before on every rank, scales
//! halved alike), and the next clean step is taken everywhere. A plain `GradScaler` in the
//! same world (no agreement) is shown to let the ranks diverge, so the agreement is what the
//! test sees.

use tensorplay_core::amp::{GradScaler, GradScalerOptions};
use tensorplay_core::optim::{Optimizer, SGD, SgdOptions};
use tensorplay_core::{self as tp, Tensor};
use tensorplay_distributed_nn::parallel::fsdp::ShardedGradScaler;
use tensorplay_testkit::{cpu_world, element_bits};

use super::fsdp::{TIMEOUT, TestResult};

const W0: [f32; 3] = [1.0, -2.0, 4.0];
const C: [f32; 3] = [1.0, 0.5, 0.25];
const LR: f64 = 0.5;

/// One case: the value injected into one element of `bad_rank`'s gradient at the second
/// iteration, and whether the scaler agrees across ranks.
struct Case {
    name: &'static str,
    bad: f32,
    bad_rank: usize,
    sharded: bool,
}

const CASES: [Case; 3] = [
    Case {
        name: "inf on rank 1, sharded scaler",
        bad: f32::INFINITY,
        bad_rank: 1,
        sharded: true,
    },
    Case {
        name: "NaN on rank 0, sharded scaler",
        bad: f32::NAN,
        bad_rank: 0,
        sharded: true,
    },
    Case {
        name: "inf on rank 1, plain scaler",
        bad: f32::INFINITY,
        bad_rank: 1,
        sharded: false,
    },
];

fn loss(w: &Tensor) -> tp::Result<Tensor> {
    Tensor::from_slice(&C, &[3])?.mul(w)?.sum()
}

/// `w` after `n` clean steps of SGD with gradient C.
fn after(n: usize) -> Vec<f32> {
    let mut w = W0.to_vec();
    for _ in 0..n {
        for (x, c) in w.iter_mut().zip(C) {
            *x -= LR as f32 * c;
        }
    }
    w
}

fn bits(v: &[f32]) -> Vec<u64> {
    v.iter().map(|x| u64::from(x.to_bits())).collect()
}

fn run_case(c: &Case, rank: usize) -> TestResult {
    let w = Tensor::from_slice(&W0, &[3])?.requires_grad_(true);
    let mut opt = SGD::new(
        vec![w.clone()],
        SgdOptions {
            lr: LR,
            ..Default::default()
        },
    )?;
    let options = GradScalerOptions {
        init_scale: 1024.0,
        ..Default::default()
    };
    let mut sharded;
    let mut plain;
    let sc: &mut GradScaler = if c.sharded {
        sharded = ShardedGradScaler::new(options, None)?;
        &mut sharded
    } else {
        plain = GradScaler::new(options)?;
        &mut plain
    };
    let what = |s: &str| format!("{} (rank {rank}): {s}", c.name);
    for it in 0..3 {
        opt.zero_grad()?;
        sc.scale(&loss(&w)?)?.backward()?;
        if it == 1 && rank == c.bad_rank {
            w.set_grad(Some(Tensor::from_slice(&[1.0, c.bad, 2.0f32], &[3])?));
        }
        let stepped = sc.step(&mut opt)?;
        sc.update()?;
        // every rank skips iteration 1 with the agreement; without it only the bad rank does
        let skipper = c.sharded || rank == c.bad_rank;
        if stepped == (it == 1 && skipper) {
            return Err(what(&format!("iteration {it}: stepped = {stepped}")).into());
        }
        let taken = it + 1 - usize::from(skipper && it >= 1);
        let got = element_bits(&w)?;
        if got != bits(&after(taken)) {
            return Err(what(&format!(
                "iteration {it}: parameters {:?}, want {:?}",
                w.to_vec::<f32>()?,
                after(taken)
            ))
            .into());
        }
        let want_scale = if skipper && it >= 1 { 512.0 } else { 1024.0 };
        if sc.get_scale() != want_scale {
            return Err(what(&format!(
                "iteration {it}: scale {}, want {want_scale}",
                sc.get_scale()
            ))
            .into());
        }
    }
    Ok(())
}

#[test]
fn sharded_grad_scaler_skips_on_every_rank() {
    cpu_world(2, TIMEOUT, |rank| -> TestResult {
        for c in &CASES {
            run_case(c, rank)?;
        }
        Ok(())
    });
}
