//! Learning-rate schedulers (`torch.optim.lr_scheduler`): [`StepLR`], [`MultiStepLR`],
//! [`ExponentialLR`], [`CosineAnnealingLR`], [`LinearLR`], [`LambdaLR`] and [`WarmupCosineLR`].
//!
//! A scheduler drives anything with per-group learning rates ([`LrGroups`]: every
//! [`Optimizer`], and the distributed optimizer of `tensorplay::distributed::optim`). As in
//! PyTorch, creating one records each group's current rate as its base rate and sets the rates
//! of epoch 0; each [`LrScheduler::step`] (once per epoch, after the optimizer's step) moves to
//! the next epoch. The rates follow PyTorch's *chained* formulas, which build each epoch's rate
//! from the previous one (so a rate changed by hand between steps carries on); without such
//! changes they equal the closed forms given on each scheduler
//! ([`closed_form_lr`](StepLR::closed_form_lr)).
//!
//! ```
//! use tensorplay::{self as tp, optim::{Optimizer, SGD, SgdOptions}};
//! use tp::optim::lr_scheduler::{LrScheduler, StepLR};
//! let w = tp::Tensor::from_vec(vec![1.0f64], &[1])?.requires_grad_(true);
//! let mut opt = SGD::new(vec![w], SgdOptions { lr: 0.1, ..Default::default() })?;
//! let mut sched = StepLR::new(&mut opt, 2, 0.5)?; // halve the rate every 2 epochs
//! for _ in 0..4 {
//!     // ... the epoch's optimizer steps ...
//!     sched.step(&mut opt)?;
//! }
//! assert!((opt.lr() - 0.025).abs() < 1e-15); // epoch 4: 0.1 * 0.5^2
//! # Ok::<(), tp::Error>(())
//! ```

use std::f64::consts::PI;

use super::Optimizer;
use crate::{Error, Result};

/// Something whose parameter groups have learning rates a scheduler sets.
pub trait LrGroups {
    /// The learning rate of each parameter group, in order.
    fn group_lrs(&self) -> Vec<f64>;

    /// Sets the learning rate of each group (`lrs` has one per group).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a count that is not the number of groups, or a rate
    /// that is negative or not finite (nothing is changed then).
    fn set_group_lrs(&mut self, lrs: &[f64]) -> Result<()>;
}

impl<O: Optimizer + ?Sized> LrGroups for O {
    fn group_lrs(&self) -> Vec<f64> {
        self.param_groups().iter().map(|g| g.lr).collect()
    }

    fn set_group_lrs(&mut self, lrs: &[f64]) -> Result<()> {
        let n = self.param_groups().len();
        if lrs.len() != n {
            return Err(Error::invalid(
                "set_group_lrs",
                "lrs",
                format!("{n} rates (one per parameter group)"),
                lrs.len(),
            ));
        }
        for &lr in lrs {
            super::check_lr("set_group_lrs", lr)?;
        }
        for (g, &lr) in self.param_groups_mut().iter_mut().zip(lrs) {
            g.lr = lr;
        }
        Ok(())
    }
}

/// A learning-rate scheduler.
pub trait LrScheduler {
    /// Moves to the next epoch and sets `opt`'s rates (`scheduler.step()`).
    ///
    /// # Errors
    /// As [`LrGroups::set_group_lrs`]: `opt` has another number of groups than the one the
    /// scheduler was created with, or a rate came out negative or not finite (a
    /// [`LambdaLR`] factor).
    fn step(&mut self, opt: &mut dyn LrGroups) -> Result<()>;

    /// The rates set by the last step (or at creation), one per group (`get_last_lr()`).
    fn get_last_lr(&self) -> &[f64];

    /// The current epoch: 0 after creation, +1 per step (`last_epoch`).
    fn last_epoch(&self) -> usize;
}

/// What every scheduler keeps.
#[derive(Debug, Clone)]
struct Schedule {
    base_lrs: Vec<f64>,
    last_epoch: usize,
    last_lr: Vec<f64>,
}

impl Schedule {
    /// The state before [`Schedule::start`] (a constructor needs the rule, a method of the
    /// scheduler being built, to start).
    fn pending() -> Schedule {
        Schedule {
            base_lrs: Vec::new(),
            last_epoch: 0,
            last_lr: Vec::new(),
        }
    }

    /// Records `opt`'s rates as the base rates and sets epoch 0's.
    fn start(opt: &mut dyn LrGroups, rule: impl Fn(usize, f64, f64) -> f64) -> Result<Schedule> {
        let base_lrs = opt.group_lrs();
        let lrs: Vec<f64> = base_lrs.iter().map(|&b| rule(0, b, b)).collect();
        opt.set_group_lrs(&lrs)?;
        Ok(Schedule {
            base_lrs,
            last_epoch: 0,
            last_lr: lrs,
        })
    }

    /// Epoch `last_epoch + 1`'s rates from `opt`'s current ones by `rule(epoch, lr, base)`.
    fn advance(
        &mut self,
        opt: &mut dyn LrGroups,
        rule: impl Fn(usize, f64, f64) -> f64,
    ) -> Result<()> {
        let now = opt.group_lrs();
        if now.len() != self.base_lrs.len() {
            return Err(Error::invalid(
                "LrScheduler::step",
                "opt",
                format!(
                    "the optimizer the scheduler was created with ({} parameter groups)",
                    self.base_lrs.len()
                ),
                format!("{} parameter groups", now.len()),
            ));
        }
        let epoch = self.last_epoch + 1;
        let lrs: Vec<f64> = now
            .iter()
            .zip(&self.base_lrs)
            .map(|(&lr, &b)| rule(epoch, lr, b))
            .collect();
        opt.set_group_lrs(&lrs)?;
        self.last_epoch = epoch;
        self.last_lr = lrs;
        Ok(())
    }

    fn closed(&self, f: impl Fn(f64) -> f64) -> Vec<f64> {
        self.base_lrs.iter().map(|&b| f(b)).collect()
    }
}

macro_rules! scheduler {
    ($t:ty) => {
        impl LrScheduler for $t {
            fn step(&mut self, opt: &mut dyn LrGroups) -> Result<()> {
                let rule = self.rule();
                self.s.advance(opt, rule)
            }
            fn get_last_lr(&self) -> &[f64] {
                &self.s.last_lr
            }
            fn last_epoch(&self) -> usize {
                self.s.last_epoch
            }
        }
    };
}

fn positive(op: &'static str, arg: &'static str, v: f64) -> Result<()> {
    if !(v > 0.0 && v.is_finite()) {
        return Err(Error::invalid(op, arg, "a finite value > 0", v));
    }
    Ok(())
}

fn at_least_one(op: &'static str, arg: &'static str, v: usize) -> Result<()> {
    if v == 0 {
        return Err(Error::invalid(op, arg, "at least 1", v));
    }
    Ok(())
}

/// Multiplies the rate by `gamma` every `step_size` epochs: `base * gamma^(epoch / step_size)`
/// (`StepLR`).
#[derive(Debug, Clone)]
pub struct StepLR {
    step_size: usize,
    gamma: f64,
    s: Schedule,
}

impl StepLR {
    /// A scheduler for `opt`. Errors ([`Error::InvalidArgument`]) for `step_size` 0 or
    /// `gamma` not finite and `> 0`.
    pub fn new(opt: &mut dyn LrGroups, step_size: usize, gamma: f64) -> Result<StepLR> {
        at_least_one("StepLR", "step_size", step_size)?;
        positive("StepLR", "gamma", gamma)?;
        let mut me = StepLR {
            step_size,
            gamma,
            s: Schedule::pending(),
        };
        me.s = Schedule::start(opt, me.rule())?;
        Ok(me)
    }

    fn rule(&self) -> impl Fn(usize, f64, f64) -> f64 + use<> {
        let (k, g) = (self.step_size, self.gamma);
        move |e, lr, _| if e == 0 || e % k != 0 { lr } else { lr * g }
    }

    /// The rates of `epoch` by the closed form.
    pub fn closed_form_lr(&self, epoch: usize) -> Vec<f64> {
        let p = (epoch / self.step_size) as i32;
        self.s.closed(|b| b * self.gamma.powi(p))
    }
}
scheduler!(StepLR);

/// Multiplies the rate by `gamma` at each of `milestones` (epochs; a milestone given twice
/// multiplies twice): `base * gamma^(milestones <= epoch)` (`MultiStepLR`).
#[derive(Debug, Clone)]
pub struct MultiStepLR {
    milestones: Vec<usize>,
    gamma: f64,
    s: Schedule,
}

impl MultiStepLR {
    /// A scheduler for `opt`; `milestones` in any order. Errors for `gamma` not finite and
    /// `> 0`.
    pub fn new(
        opt: &mut dyn LrGroups,
        mut milestones: Vec<usize>,
        gamma: f64,
    ) -> Result<MultiStepLR> {
        positive("MultiStepLR", "gamma", gamma)?;
        milestones.sort_unstable();
        let mut me = MultiStepLR {
            milestones,
            gamma,
            s: Schedule::pending(),
        };
        me.s = Schedule::start(opt, me.rule())?;
        Ok(me)
    }

    fn rule(&self) -> impl Fn(usize, f64, f64) -> f64 + use<> {
        let (ms, g) = (self.milestones.clone(), self.gamma);
        move |e, lr, _| {
            let hits = ms.iter().filter(|&&m| m == e).count() as i32;
            lr * g.powi(hits)
        }
    }

    /// The rates of `epoch` by the closed form.
    pub fn closed_form_lr(&self, epoch: usize) -> Vec<f64> {
        let passed = self.milestones.iter().filter(|&&m| m <= epoch).count() as i32;
        self.s.closed(|b| b * self.gamma.powi(passed))
    }
}
scheduler!(MultiStepLR);

/// Multiplies the rate by `gamma` every epoch: `base * gamma^epoch` (`ExponentialLR`).
#[derive(Debug, Clone)]
pub struct ExponentialLR {
    gamma: f64,
    s: Schedule,
}

impl ExponentialLR {
    /// A scheduler for `opt`. Errors for `gamma` not finite and `> 0`.
    pub fn new(opt: &mut dyn LrGroups, gamma: f64) -> Result<ExponentialLR> {
        positive("ExponentialLR", "gamma", gamma)?;
        let mut me = ExponentialLR {
            gamma,
            s: Schedule::pending(),
        };
        me.s = Schedule::start(opt, me.rule())?;
        Ok(me)
    }

    fn rule(&self) -> impl Fn(usize, f64, f64) -> f64 + use<> {
        let g = self.gamma;
        move |e, lr, _| if e == 0 { lr } else { lr * g }
    }

    /// The rates of `epoch` by the closed form.
    pub fn closed_form_lr(&self, epoch: usize) -> Vec<f64> {
        self.s
            .closed(|b| b * self.gamma.powi(epoch.min(i32::MAX as usize) as i32))
    }
}
scheduler!(ExponentialLR);

/// Cosine annealing from the base rate down to `eta_min` over `t_max` epochs, then back up
/// (period `2 * t_max`): `eta_min + (base - eta_min) * (1 + cos(pi * epoch / t_max)) / 2`
/// (`CosineAnnealingLR`, without restarts).
#[derive(Debug, Clone)]
pub struct CosineAnnealingLR {
    t_max: usize,
    eta_min: f64,
    s: Schedule,
}

impl CosineAnnealingLR {
    /// A scheduler for `opt`. Errors for `t_max` 0 or `eta_min` negative or not finite.
    pub fn new(opt: &mut dyn LrGroups, t_max: usize, eta_min: f64) -> Result<CosineAnnealingLR> {
        at_least_one("CosineAnnealingLR", "t_max", t_max)?;
        super::check_nonneg("CosineAnnealingLR", "eta_min", eta_min)?;
        let mut me = CosineAnnealingLR {
            t_max,
            eta_min,
            s: Schedule::pending(),
        };
        me.s = Schedule::start(opt, me.rule())?;
        Ok(me)
    }

    fn rule(&self) -> impl Fn(usize, f64, f64) -> f64 + use<> {
        let (t, m) = (self.t_max as f64, self.eta_min);
        let period = 2 * self.t_max;
        move |e, lr, base| {
            if e == 0 {
                lr
            } else if (e + period - 1 - (period / 2)).is_multiple_of(period) {
                // the bottom of a cycle: PyTorch's step back up (the ratio below would
                // divide by zero)
                lr + (base - m) * (1.0 - (PI / t).cos()) / 2.0
            } else {
                let e = e as f64;
                (1.0 + (PI * e / t).cos()) / (1.0 + (PI * (e - 1.0) / t).cos()) * (lr - m) + m
            }
        }
    }

    /// The rates of `epoch` by the closed form.
    pub fn closed_form_lr(&self, epoch: usize) -> Vec<f64> {
        let c = (PI * epoch as f64 / self.t_max as f64).cos();
        self.s
            .closed(|b| self.eta_min + (b - self.eta_min) * (1.0 + c) / 2.0)
    }
}
scheduler!(CosineAnnealingLR);

/// Scales the rate linearly from `start_factor * base` to `end_factor * base` over
/// `total_iters` epochs, then keeps it: `base * (start + (end - start) * min(epoch,
/// total_iters) / total_iters)` (`LinearLR`; PyTorch's defaults are 1/3, 1 and 5).
#[derive(Debug, Clone)]
pub struct LinearLR {
    start_factor: f64,
    end_factor: f64,
    total_iters: usize,
    s: Schedule,
}

impl LinearLR {
    /// A scheduler for `opt`; sets the rates to `start_factor * base` at once. Errors for
    /// `start_factor` outside `(0, 1]`, `end_factor` outside `[0, 1]` or `total_iters` 0.
    pub fn new(
        opt: &mut dyn LrGroups,
        start_factor: f64,
        end_factor: f64,
        total_iters: usize,
    ) -> Result<LinearLR> {
        if !(start_factor > 0.0 && start_factor <= 1.0) {
            return Err(Error::invalid(
                "LinearLR",
                "start_factor",
                "a factor in (0, 1]",
                start_factor,
            ));
        }
        if !(0.0..=1.0).contains(&end_factor) {
            return Err(Error::invalid(
                "LinearLR",
                "end_factor",
                "a factor in [0, 1]",
                end_factor,
            ));
        }
        at_least_one("LinearLR", "total_iters", total_iters)?;
        let mut me = LinearLR {
            start_factor,
            end_factor,
            total_iters,
            s: Schedule::pending(),
        };
        me.s = Schedule::start(opt, me.rule())?;
        Ok(me)
    }

    fn rule(&self) -> impl Fn(usize, f64, f64) -> f64 + use<> {
        let (s0, s1, n) = (self.start_factor, self.end_factor, self.total_iters);
        move |e, lr, _| {
            if e == 0 {
                lr * s0
            } else if e > n {
                lr
            } else {
                lr * (1.0 + (s1 - s0) / (n as f64 * s0 + (e - 1) as f64 * (s1 - s0)))
            }
        }
    }

    /// The rates of `epoch` by the closed form.
    pub fn closed_form_lr(&self, epoch: usize) -> Vec<f64> {
        let f = self.start_factor
            + (self.end_factor - self.start_factor) * epoch.min(self.total_iters) as f64
                / self.total_iters as f64;
        self.s.closed(|b| b * f)
    }
}
scheduler!(LinearLR);

/// A factor of the epoch.
type Lambda = std::sync::Arc<dyn Fn(usize) -> f64 + Send + Sync>;

/// The base rate times a function of the epoch: `base * lambda(epoch)` (`LambdaLR`).
#[derive(Clone)]
pub struct LambdaLR {
    lambda: Lambda,
    s: Schedule,
}

impl std::fmt::Debug for LambdaLR {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LambdaLR")
            .field("last_epoch", &self.s.last_epoch)
            .field("last_lr", &self.s.last_lr)
            .finish()
    }
}

impl LambdaLR {
    /// A scheduler for `opt` with one `lambda` for every group; sets the rates to
    /// `base * lambda(0)` at once. Errors when a rate comes out negative or not finite.
    pub fn new(
        opt: &mut dyn LrGroups,
        lambda: impl Fn(usize) -> f64 + Send + Sync + 'static,
    ) -> Result<LambdaLR> {
        let mut me = LambdaLR {
            lambda: std::sync::Arc::new(lambda),
            s: Schedule::pending(),
        };
        me.s = Schedule::start(opt, me.rule())?;
        Ok(me)
    }

    fn rule(&self) -> impl Fn(usize, f64, f64) -> f64 + use<> {
        let l = self.lambda.clone();
        move |e, _, base| base * l(e)
    }

    /// The rates of `epoch` by the closed form.
    pub fn closed_form_lr(&self, epoch: usize) -> Vec<f64> {
        self.s.closed(|b| b * (self.lambda)(epoch))
    }
}
scheduler!(LambdaLR);

/// Linear warm-up, then cosine decay: the schedule GPT-style training uses (as in nanoGPT, or
/// PyTorch's `SequentialLR(LinearLR, CosineAnnealingLR)`), one step per optimizer step.
///
/// With `w = warmup`, `T = total` and `m = min_factor`, the rate of step `e` is `base` times
/// - `(e + 1) / w` while `e < w` (so the first step already trains, and step `w - 1` reaches
///   the base rate);
/// - `m + (1 - m) * (1 + cos(pi * (e - w) / (T - w))) / 2` for `w <= e <= T`;
/// - `m` after `T`.
///
/// ```
/// use tensorplay::{self as tp, optim::{AdamW, AdamWOptions, Optimizer}};
/// use tp::optim::lr_scheduler::{LrScheduler, WarmupCosineLR};
/// let w = tp::Tensor::from_vec(vec![1.0f32], &[1])?.requires_grad_(true);
/// let mut opt = AdamW::new(vec![w], AdamWOptions { lr: 1e-3, ..Default::default() })?;
/// let mut sched = WarmupCosineLR::new(&mut opt, 10, 100, 0.1)?;
/// assert!((opt.lr() - 1e-4).abs() < 1e-15); // step 0: 1/10 of the rate
/// for _ in 0..9 {
///     sched.step(&mut opt)?;
/// }
/// assert!((opt.lr() - 1e-3).abs() < 1e-15); // warmed up
/// # Ok::<(), tp::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct WarmupCosineLR {
    warmup: usize,
    total: usize,
    min_factor: f64,
    s: Schedule,
}

impl WarmupCosineLR {
    /// A scheduler for `opt`: `warmup` steps of linear warm-up (0 for none), cosine decay until
    /// step `total`, down to `min_factor` times the base rate.
    ///
    /// Errors ([`Error::InvalidArgument`]): `total` is not greater than `warmup`, or
    /// `min_factor` is outside `[0, 1]`.
    pub fn new(
        opt: &mut dyn LrGroups,
        warmup: usize,
        total: usize,
        min_factor: f64,
    ) -> Result<WarmupCosineLR> {
        if total <= warmup {
            return Err(Error::invalid(
                "WarmupCosineLR",
                "total",
                format!("more steps than the warm-up's {warmup}"),
                total,
            ));
        }
        if !(0.0..=1.0).contains(&min_factor) {
            return Err(Error::invalid(
                "WarmupCosineLR",
                "min_factor",
                "a factor in [0, 1]",
                min_factor,
            ));
        }
        let mut me = WarmupCosineLR {
            warmup,
            total,
            min_factor,
            s: Schedule::pending(),
        };
        me.s = Schedule::start(opt, me.rule())?;
        Ok(me)
    }

    /// The factor on the base rate at step `e`.
    pub fn factor(&self, e: usize) -> f64 {
        warmup_cosine(self.warmup, self.total, self.min_factor, e)
    }

    fn rule(&self) -> impl Fn(usize, f64, f64) -> f64 + use<> {
        let (w, t, m) = (self.warmup, self.total, self.min_factor);
        move |e, _, base| base * warmup_cosine(w, t, m, e)
    }

    /// The rates of `epoch` by the closed form.
    pub fn closed_form_lr(&self, epoch: usize) -> Vec<f64> {
        self.s.closed(|b| b * self.factor(epoch))
    }
}
scheduler!(WarmupCosineLR);

fn warmup_cosine(warmup: usize, total: usize, min_factor: f64, e: usize) -> f64 {
    if e < warmup {
        return (e + 1) as f64 / warmup as f64;
    }
    let p = ((e - warmup) as f64 / (total - warmup) as f64).min(1.0);
    min_factor + (1.0 - min_factor) * (1.0 + (PI * p).cos()) / 2.0
}
