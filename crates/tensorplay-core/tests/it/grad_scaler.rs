//! `GradScaler` against hand-computed values: the scaled loss and unscaled gradients (powers
//! of two, so exact), steps skipped on infinite and NaN gradients, growth after a run of clean
//! steps, the state round trip, misuse errors, and the disabled pass-through.

use tensorplay_core::amp::{GradScaler, GradScalerOptions};
use tensorplay_core::optim::{Optimizer, SGD, SgdOptions};
use tensorplay_core::{self as tp, Tensor};

const W0: [f32; 3] = [1.0, -2.0, 4.0];
/// loss = sum(C * w), so the gradient is C.
const C: [f32; 3] = [1.0, 0.5, 0.25];
const LR: f64 = 0.5;

/// What a case does and checks.
#[derive(Clone, Copy)]
enum Case {
    /// One clean iteration at scale `s`.
    Clean { s: f64 },
    /// A gradient element replaced by `bad` after backward: skipped, scale halved.
    Skip { bad: f32 },
    /// `interval` clean iterations: the scale doubles at the last, not before.
    Growth { interval: u64 },
    /// A state taken after 2 clean steps (interval 3) and loaded into a fresh scaler: both
    /// grow at the next clean step.
    RoundTrip,
    /// unscale_ twice, step twice, unscale_ after step, update with nothing recorded.
    Misuse,
    /// Disabled: the loss and gradients pass unscaled, the step is plain.
    Disabled,
    /// A skip at the smallest positive float32 scale: the scale stays there (not 0) and its
    /// state loads into another scaler.
    Floor,
}

const CASES: [(&str, Case); 9] = [
    ("clean step at 2^16", Case::Clean { s: 65536.0 }),
    ("clean step at 1024", Case::Clean { s: 1024.0 }),
    ("skip on inf", Case::Skip { bad: f32::INFINITY }),
    ("skip on NaN", Case::Skip { bad: f32::NAN }),
    ("growth after 3 clean steps", Case::Growth { interval: 3 }),
    ("state round trip", Case::RoundTrip),
    ("misuse errors", Case::Misuse),
    ("disabled pass-through", Case::Disabled),
    ("a skip at the smallest scale", Case::Floor),
];

fn setup() -> tp::Result<(Tensor, SGD)> {
    let w = Tensor::from_slice(&W0, &[3])?.requires_grad_(true);
    let opt = SGD::new(
        vec![w.clone()],
        SgdOptions {
            lr: LR,
            ..Default::default()
        },
    )?;
    Ok((w, opt))
}

fn loss(w: &Tensor) -> tp::Result<Tensor> {
    Tensor::from_slice(&C, &[3])?.mul(w)?.sum()
}

fn scaler(init_scale: f64, growth_interval: u64, enabled: bool) -> tp::Result<GradScaler> {
    GradScaler::new(GradScalerOptions {
        init_scale,
        growth_interval,
        enabled,
        ..Default::default()
    })
}

/// One iteration; returns whether it stepped.
fn iteration(sc: &mut GradScaler, w: &Tensor, opt: &mut SGD) -> tp::Result<bool> {
    opt.zero_grad()?;
    sc.scale(&loss(w)?)?.backward()?;
    let stepped = sc.step(opt)?;
    sc.update()?;
    Ok(stepped)
}

fn stepped_once() -> Vec<f32> {
    W0.iter().zip(C).map(|(w, c)| w - LR as f32 * c).collect()
}

fn ensure(what: &str, ok: bool) -> Result<(), String> {
    if ok { Ok(()) } else { Err(what.to_string()) }
}

fn run(c: Case) -> Result<(), Box<dyn std::error::Error>> {
    let (w, mut opt) = setup()?;
    match c {
        Case::Clean { s } => {
            let mut sc = scaler(s, 2000, true)?;
            let scaled = sc.scale(&loss(&w)?)?;
            let l = loss(&w)?.item::<f32>()?;
            ensure("scaled loss", scaled.item::<f32>()? == l * s as f32)?;
            scaled.backward()?;
            let g: Vec<f32> = C.iter().map(|c| c * s as f32).collect();
            ensure(
                "scaled grads",
                w.grad().ok_or("no grad")?.to_vec::<f32>()? == g,
            )?;
            sc.unscale_(&mut opt)?;
            ensure(
                "unscaled grads",
                w.grad().ok_or("no grad")?.to_vec::<f32>()? == C,
            )?;
            ensure("stepped", sc.step(&mut opt)?)?;
            sc.update()?;
            ensure("params", w.to_vec::<f32>()? == stepped_once())?;
            ensure("scale kept", sc.get_scale() == s)?;
            ensure("tracker", sc.state_dict().growth_tracker == 1)?;
        }
        Case::Skip { bad } => {
            let mut sc = scaler(1024.0, 2000, true)?;
            ensure("first step", iteration(&mut sc, &w, &mut opt)?)?;
            let before = w.to_vec::<f32>()?;
            opt.zero_grad()?;
            sc.scale(&loss(&w)?)?.backward()?;
            w.set_grad(Some(Tensor::from_slice(&[1.0, bad, 2.0f32], &[3])?));
            ensure("skipped", !sc.step(&mut opt)?)?;
            sc.update()?;
            ensure("params unchanged", w.to_vec::<f32>()? == before)?;
            ensure("scale halved", sc.get_scale() == 512.0)?;
            ensure("tracker reset", sc.state_dict().growth_tracker == 0)?;
        }
        Case::Floor => {
            let tiny = f64::from(f32::from_bits(1));
            let mut sc = scaler(1024.0, 2000, true)?;
            sc.update_to(tiny)?;
            opt.zero_grad()?;
            sc.scale(&loss(&w)?)?.backward()?;
            w.set_grad(Some(Tensor::from_slice(
                &[1.0, f32::INFINITY, 2.0f32],
                &[3],
            )?));
            ensure("skipped", !sc.step(&mut opt)?)?;
            sc.update()?;
            ensure("scale kept above 0", sc.get_scale() == tiny)?;
            let mut other = scaler(8.0, 2000, true)?;
            other.load_state_dict(&sc.state_dict())?;
            ensure("state loaded", other.get_scale() == tiny)?;
        }
        Case::Growth { interval } => {
            let mut sc = scaler(8.0, interval, true)?;
            for i in 1..=interval {
                ensure("stepped", iteration(&mut sc, &w, &mut opt)?)?;
                let want = if i == interval { 16.0 } else { 8.0 };
                ensure(&format!("scale after {i} steps"), sc.get_scale() == want)?;
            }
        }
        Case::RoundTrip => {
            let mut sc = scaler(8.0, 3, true)?;
            for _ in 0..2 {
                iteration(&mut sc, &w, &mut opt)?;
            }
            let st = sc.state_dict();
            ensure(
                "state",
                (st.scale, st.growth_tracker, st.growth_interval) == (8.0, 2, 3),
            )?;
            let mut other = scaler(65536.0, 2000, true)?;
            other.load_state_dict(&st)?;
            ensure("loaded state", other.state_dict() == st)?;
            let (w2, mut opt2) = setup()?;
            iteration(&mut sc, &w, &mut opt)?;
            iteration(&mut other, &w2, &mut opt2)?;
            ensure(
                "both grew",
                sc.get_scale() == 16.0 && other.get_scale() == 16.0,
            )?;
            ensure("states equal", sc.state_dict() == other.state_dict())?;
            let bad = tp::amp::GradScalerState {
                growth_tracker: 3,
                ..st
            };
            ensure(
                "tracker past interval refused",
                other.load_state_dict(&bad).is_err(),
            )?;
        }
        Case::Misuse => {
            let mut sc = scaler(4.0, 2000, true)?;
            ensure("update with nothing recorded", sc.update().is_err())?;
            sc.scale(&loss(&w)?)?.backward()?;
            sc.unscale_(&mut opt)?;
            ensure("unscale_ twice", sc.unscale_(&mut opt).is_err())?;
            ensure(
                "grads unscaled once",
                w.grad().ok_or("no grad")?.to_vec::<f32>()? == C,
            )?;
            sc.step(&mut opt)?;
            ensure("step twice", sc.step(&mut opt).is_err())?;
            ensure("unscale_ after step", sc.unscale_(&mut opt).is_err())?;
            ensure("params stepped once", w.to_vec::<f32>()? == stepped_once())?;
            sc.update()?;
            ensure("bad options", scaler(f64::INFINITY, 1, true).is_err())?;
            ensure("zero interval", scaler(1.0, 0, true).is_err())?;
        }
        Case::Disabled => {
            let mut sc = scaler(65536.0, 2000, false)?;
            ensure("disabled", !sc.is_enabled() && sc.get_scale() == 1.0)?;
            let scaled = sc.scale(&loss(&w)?)?;
            ensure(
                "loss as is",
                scaled.item::<f32>()? == loss(&w)?.item::<f32>()?,
            )?;
            scaled.backward()?;
            ensure("stepped", sc.step(&mut opt)?)?;
            sc.update()?;
            ensure("params", w.to_vec::<f32>()? == stepped_once())?;
        }
    }
    Ok(())
}

fn check(name: &str, c: Case) {
    if let Err(e) = run(c) {
        panic!("GradScaler case `{name}`: {e}");
    }
}

#[test]
fn grad_scaler_cases() {
    for (name, c) in CASES {
        check(name, c);
    }
}
