//! The gradient scaler (`torch.amp.GradScaler`): multiplies the loss by a large factor so that
//! small float16 gradients do not flush to zero, divides the gradients by it before the
//! optimizer's step, skips the step when a gradient came out infinite or NaN, and adapts the
//! factor (halved after a skip, doubled after a run of clean steps).

use std::collections::BTreeMap;

use crate::{DType, Error, Result, Tensor, TensorId};

/// Agrees on the found-inf flag across ranks: given this rank's flag (`true`: some gradient
/// of this rank is infinite or NaN), returns whether any rank found one. A collective: every
/// rank calls it in the same order. Installed by
/// [`GradScaler::set_found_inf_sync`]; `tensorplay::distributed::fsdp::ShardedGradScaler`
/// installs an all-reduce (MAX) over a process group.
pub type FoundInfSync = Box<dyn Fn(bool) -> Result<bool> + Send>;

/// The options of a [`GradScaler`], with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerOptions {
    /// The first scale factor (default `2^16 = 65536.0`).
    pub init_scale: f64,
    /// The factor the scale is multiplied by after `growth_interval` clean steps in a row
    /// (default `2.0`; must be > 1).
    pub growth_factor: f64,
    /// The factor the scale is multiplied by after a skipped step (default `0.5`; must be in
    /// (0, 1)).
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows (default `2000`; must be >= 1).
    pub growth_interval: u64,
    /// `false` makes every method a pass-through (scale 1, steps always taken).
    pub enabled: bool,
}

impl Default for GradScalerOptions {
    fn default() -> Self {
        GradScalerOptions {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

/// A [`GradScaler`]'s state (`scaler.state_dict()`), restored by
/// [`GradScaler::load_state_dict`]: the scale, the factors and the count of clean steps since
/// the scale last changed (PyTorch's `_growth_tracker`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerState {
    /// The current scale factor.
    pub scale: f64,
    /// See [`GradScalerOptions::growth_factor`].
    pub growth_factor: f64,
    /// See [`GradScalerOptions::backoff_factor`].
    pub backoff_factor: f64,
    /// See [`GradScalerOptions::growth_interval`].
    pub growth_interval: u64,
    /// Clean steps since the scale last changed.
    pub growth_tracker: u64,
}

/// Where one optimizer is in the current iteration.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Stage {
    /// Gradients unscaled; whether any (on any rank) was infinite or NaN.
    Unscaled { found_inf: bool },
    /// Stepped (or skipped) after unscaling.
    Stepped { found_inf: bool },
}

/// Loss scaling for float16 training (`torch.amp.GradScaler`).
///
/// Per iteration: `scaler.scale(&loss)?.backward()?`, optionally
/// [`unscale_`](GradScaler::unscale_) (before clipping the gradients), then
/// [`step`](GradScaler::step) (unscales if not done yet; skips the optimizer's step when a
/// gradient is infinite or NaN) and [`update`](GradScaler::update) (halves the scale after a
/// skip; multiplies it by `growth_factor` after `growth_interval` clean steps in a row). The
/// scale is kept as a float32 value, as PyTorch keeps it.
///
/// The gradients are those of the optimizer's parameters (float32 or float64 master
/// weights; the optimizers refuse 16-bit parameters). bfloat16 has float32's exponent range
/// and needs no scaling: a bfloat16 loss or gradient is accepted, with a warning printed once
/// per process.
///
/// ```
/// use tensorplay::{self as tp, amp::{GradScaler, GradScalerOptions}};
/// use tp::optim::{Optimizer, SGD, SgdOptions};
/// let w = tp::Tensor::from_vec(vec![1.0f32, -2.0], &[2])?.requires_grad_(true);
/// let mut opt = SGD::new(vec![w.clone()], SgdOptions { lr: 0.5, ..Default::default() })?;
/// let mut scaler = GradScaler::new(GradScalerOptions::default())?;
/// scaler.scale(&w.sum()?)?.backward()?; // gradient 65536 per element
/// assert!(scaler.step(&mut opt)?); // unscaled to 1, stepped
/// scaler.update()?;
/// assert_eq!(w.to_vec::<f32>()?, vec![0.5, -2.5]);
/// # Ok::<(), tp::Error>(())
/// ```
pub struct GradScaler {
    options: GradScalerOptions,
    scale: f64,
    growth_tracker: u64,
    /// Per optimizer (by its first parameter's id), this iteration's stage.
    stages: BTreeMap<Option<TensorId>, Stage>,
    sync: Option<FoundInfSync>,
}

impl std::fmt::Debug for GradScaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradScaler")
            .field("options", &self.options)
            .field("scale", &self.scale)
            .field("growth_tracker", &self.growth_tracker)
            .field("synced", &self.sync.is_some())
            .finish()
    }
}

/// `v` rounded to float32, as PyTorch stores the scale.
fn as_f32(v: f64) -> f64 {
    f64::from(v as f32)
}

fn check_factors(op: &'static str, growth: f64, backoff: f64, interval: u64) -> Result<()> {
    if !(growth > 1.0 && growth.is_finite()) {
        return Err(Error::invalid(
            op,
            "growth_factor",
            "a finite value > 1",
            growth,
        ));
    }
    if !(backoff > 0.0 && backoff < 1.0) {
        return Err(Error::invalid(
            op,
            "backoff_factor",
            "a value in (0, 1)",
            backoff,
        ));
    }
    if interval == 0 {
        return Err(Error::invalid(
            op,
            "growth_interval",
            "at least 1",
            interval,
        ));
    }
    Ok(())
}

fn check_scale(op: &'static str, arg: &'static str, scale: f64) -> Result<()> {
    let s = as_f32(scale);
    if !(s > 0.0 && s.is_finite()) {
        return Err(Error::invalid(
            op,
            arg,
            "a finite scale > 0 (as a float32)",
            scale,
        ));
    }
    Ok(())
}

fn warn_bf16(what: &str) {
    crate::kernels::warn_once(
        "GradScaler/bfloat16",
        &format!(
            "GradScaler used with a bfloat16 {what}: bfloat16 has float32's exponent range and \
             needs no loss scaling (allowed; the scaler only costs time)"
        ),
    );
}

impl GradScaler {
    /// A scaler with the given options.
    ///
    /// Errors: [`Error::InvalidArgument`] for an `init_scale` that is not finite and > 0 (as a
    /// float32), a `growth_factor` <= 1, a `backoff_factor` outside (0, 1), or a
    /// `growth_interval` of 0.
    pub fn new(options: GradScalerOptions) -> Result<GradScaler> {
        const OP: &str = "GradScaler::new";
        check_scale(OP, "init_scale", options.init_scale)?;
        check_factors(
            OP,
            options.growth_factor,
            options.backoff_factor,
            options.growth_interval,
        )?;
        Ok(GradScaler {
            options,
            scale: as_f32(options.init_scale),
            growth_tracker: 0,
            stages: BTreeMap::new(),
            sync: None,
        })
    }

    /// Installs the function that agrees on the found-inf flag across ranks, called once per
    /// [`unscale_`](GradScaler::unscale_) (so every rank must unscale the same optimizers in
    /// the same order); without one the flag is this process's own.
    pub fn set_found_inf_sync(&mut self, sync: FoundInfSync) {
        self.sync = Some(sync);
    }

    /// Whether the scaler is enabled (`is_enabled()`).
    pub fn is_enabled(&self) -> bool {
        self.options.enabled
    }

    /// The current scale factor (`get_scale()`); 1.0 when disabled.
    pub fn get_scale(&self) -> f64 {
        if self.options.enabled {
            self.scale
        } else {
            1.0
        }
    }

    /// `loss * scale` (`scale(outputs)`), recorded by autograd, of `loss`'s shape and dtype;
    /// `loss` itself when disabled. A bfloat16 `loss` warns once that no scaler is needed.
    ///
    /// Errors: those of [`Tensor::mul_scalar`] (an integer or boolean `loss`).
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        if !self.options.enabled {
            return Ok(loss.clone());
        }
        if loss.dtype() == DType::BF16 {
            warn_bf16("loss");
        }
        loss.mul_scalar(self.scale)
    }

    /// Divides the gradients of `optimizer`'s parameters by the scale in place
    /// (`unscale_(optimizer)`), checking in the same pass whether any is infinite or NaN (the
    /// flag then goes through the found-inf sync, if one is installed). Call it before clipping
    /// the gradients; [`step`](GradScaler::step) calls it when it was not called. Nothing when
    /// disabled.
    ///
    /// Errors ([`Error::InvalidArgument`]): a second call for the same optimizer before
    /// [`update`](GradScaler::update), or a call after its `step`; a gradient that is not
    /// floating-point; and the sync's error.
    pub fn unscale_(&mut self, optimizer: &mut dyn crate::optim::Optimizer) -> Result<()> {
        if !self.options.enabled {
            return Ok(());
        }
        let key = key_of(optimizer);
        match self.stages.get(&key) {
            Some(Stage::Unscaled { .. }) => {
                return Err(Error::invalid(
                    "GradScaler::unscale_",
                    "optimizer",
                    "one unscale_ per optimizer between update() calls",
                    "a second unscale_ since the last update()",
                ));
            }
            Some(Stage::Stepped { .. }) => {
                return Err(Error::invalid(
                    "GradScaler::unscale_",
                    "optimizer",
                    "unscale_ before step()",
                    "unscale_ after step() (call update() first)",
                ));
            }
            None => {}
        }
        let inv = as_f32(1.0 / self.scale);
        let mut found = false;
        for (i, p) in optimizer.params().iter().enumerate() {
            let Some(mut g) = p.grad() else { continue };
            if g.layout().contiguous_range().is_none() {
                // a gradient that is a view (a sum's backward gives an expanded one, whose
                // elements share memory) is replaced by a contiguous copy: scaled in place,
                // a shared element would be scaled once per view of it
                g = g.contiguous()?;
                p.set_grad(Some(g.clone()));
            }
            found |= unscale_grad(&g, inv, i)?;
        }
        if let Some(sync) = &self.sync {
            found = sync(found)?;
        }
        self.stages
            .insert(key, Stage::Unscaled { found_inf: found });
        Ok(())
    }

    /// Steps `optimizer` unless a gradient was infinite or NaN (`step(optimizer)`), unscaling
    /// first when [`unscale_`](GradScaler::unscale_) was not called. Returns whether it
    /// stepped. When disabled, a plain `optimizer.step()`.
    ///
    /// Errors: a second `step` for the same optimizer before [`update`](GradScaler::update)
    /// ([`Error::InvalidArgument`]); those of `unscale_` and of the optimizer's step.
    pub fn step(&mut self, optimizer: &mut dyn crate::optim::Optimizer) -> Result<bool> {
        if !self.options.enabled {
            optimizer.step()?;
            return Ok(true);
        }
        let key = key_of(optimizer);
        if let Some(Stage::Stepped { .. }) = self.stages.get(&key) {
            return Err(Error::invalid(
                "GradScaler::step",
                "optimizer",
                "one step per optimizer between update() calls",
                "a second step since the last update()",
            ));
        }
        if !self.stages.contains_key(&key) {
            self.unscale_(optimizer)?;
        }
        let found_inf = matches!(
            self.stages.get(&key),
            Some(Stage::Unscaled { found_inf: true })
        );
        if !found_inf {
            optimizer.step()?;
        }
        self.stages.insert(key, Stage::Stepped { found_inf });
        Ok(!found_inf)
    }

    /// Adapts the scale after the iteration's steps (`update()`): multiplied by
    /// `backoff_factor` when any optimizer found an infinite or NaN gradient (the count of
    /// clean steps restarts; the scale stops at the smallest positive float32, never 0), else the count grows and at `growth_interval` the scale is
    /// multiplied by `growth_factor` (unless that overflows float32) and the count restarts.
    /// Nothing when disabled.
    ///
    /// Errors: [`Error::InvalidArgument`] when no optimizer was unscaled or stepped since the
    /// last update.
    pub fn update(&mut self) -> Result<()> {
        if !self.options.enabled {
            return Ok(());
        }
        if self.stages.is_empty() {
            return Err(Error::invalid(
                "GradScaler::update",
                "self",
                "an unscale_ or step since the last update()",
                "none (no inf checks were recorded)",
            ));
        }
        let found_inf = self.stages.values().any(|s| {
            matches!(
                s,
                Stage::Unscaled { found_inf: true } | Stage::Stepped { found_inf: true }
            )
        });
        self.stages.clear();
        let o = &self.options;
        if found_inf {
            // never down to zero (a float32 underflow): a zero scale would skip every later
            // step and make the scaler's own state unloadable; it stops at the smallest
            // positive float32
            let backed = as_f32(self.scale * o.backoff_factor);
            self.scale = if backed > 0.0 {
                backed
            } else {
                f64::from(f32::from_bits(1))
            };
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker >= o.growth_interval {
                let grown = as_f32(self.scale * o.growth_factor);
                if grown.is_finite() {
                    self.scale = grown;
                }
                self.growth_tracker = 0;
            }
        }
        Ok(())
    }

    /// Sets the scale by hand (`update(new_scale)`), restarting nothing else but this
    /// iteration's records.
    ///
    /// Errors: [`Error::InvalidArgument`] for a scale that is not finite and > 0 as a float32.
    pub fn update_to(&mut self, new_scale: f64) -> Result<()> {
        check_scale("GradScaler::update_to", "new_scale", new_scale)?;
        self.stages.clear();
        self.scale = as_f32(new_scale);
        Ok(())
    }

    /// The scaler's state (`state_dict()`).
    pub fn state_dict(&self) -> GradScalerState {
        GradScalerState {
            scale: self.scale,
            growth_factor: self.options.growth_factor,
            backoff_factor: self.options.backoff_factor,
            growth_interval: self.options.growth_interval,
            growth_tracker: self.growth_tracker,
        }
    }

    /// Restores a state from [`state_dict`](GradScaler::state_dict) (`load_state_dict`): the
    /// scale, factors and count of clean steps are replaced; the next updates are those of the
    /// scaler it came from.
    ///
    /// Errors ([`Error::InvalidArgument`], nothing changed): a disabled scaler (as PyTorch);
    /// a scale or factors [`new`](GradScaler::new) would refuse; a count of clean steps at or
    /// past `growth_interval`.
    pub fn load_state_dict(&mut self, state: &GradScalerState) -> Result<()> {
        const OP: &str = "GradScaler::load_state_dict";
        if !self.options.enabled {
            return Err(Error::invalid(
                OP,
                "self",
                "an enabled scaler",
                "a disabled one (it keeps no state)",
            ));
        }
        check_scale(OP, "state.scale", state.scale)?;
        check_factors(
            OP,
            state.growth_factor,
            state.backoff_factor,
            state.growth_interval,
        )?;
        if state.growth_tracker >= state.growth_interval {
            return Err(Error::invalid(
                OP,
                "state.growth_tracker",
                format!("fewer than growth_interval = {}", state.growth_interval),
                state.growth_tracker,
            ));
        }
        self.scale = as_f32(state.scale);
        self.options.growth_factor = state.growth_factor;
        self.options.backoff_factor = state.backoff_factor;
        self.options.growth_interval = state.growth_interval;
        self.growth_tracker = state.growth_tracker;
        self.stages.clear();
        Ok(())
    }
}

/// Identifies an optimizer by its first parameter (optimizers own disjoint parameters).
fn key_of(optimizer: &dyn crate::optim::Optimizer) -> Option<TensorId> {
    optimizer.params().first().map(Tensor::id)
}

/// Multiplies gradient `g` (of parameter `i`) by `inv` in place; returns whether an element
/// was infinite or NaN. One pass over float32/float64 host gradients.
fn unscale_grad(g: &Tensor, inv: f64, i: usize) -> Result<bool> {
    const OP: &str = "GradScaler::unscale_";
    fn pass<T: Copy>(
        s: &mut [T],
        l: &crate::Layout,
        mul: impl Fn(T) -> T,
        finite: impl Fn(T) -> bool,
    ) -> bool {
        let mut bad = false;
        match l.contiguous_range() {
            Some(r) => {
                for x in &mut s[r] {
                    bad |= !finite(*x);
                    *x = mul(*x);
                }
            }
            None => l.for_each_offset(|o| {
                bad |= !finite(s[o]);
                s[o] = mul(s[o]);
            }),
        }
        bad
    }
    let _ng = crate::no_grad();
    match g.dtype() {
        DType::F32 if !g.device().is_cuda() => {
            let inv = inv as f32;
            g.with_slice_mut(OP, |s: &mut [f32], l| {
                pass(s, l, |x| x * inv, f32::is_finite)
            })
        }
        DType::F64 if !g.device().is_cuda() => g.with_slice_mut(OP, |s: &mut [f64], l| {
            pass(s, l, |x| x * inv, f64::is_finite)
        }),
        d if d.is_float() => {
            if d == DType::BF16 {
                warn_bf16("gradient");
            }
            // other dtypes and devices: the scaling op, then one check on the host
            g.mul_scalar_(inv)?;
            Ok(g.to_vec_f64()?.iter().any(|v| !v.is_finite()))
        }
        d => Err(Error::invalid(
            OP,
            "optimizer",
            "floating-point gradients",
            format!("parameter {i}'s gradient of dtype {d}"),
        )),
    }
}
