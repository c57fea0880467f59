//! Stochastic gradient descent (`torch.optim.SGD`).

use super::group::{ParamGroup, check_groups, in_group, ranges, set_all_lr};
use super::opt_dispatch;
use super::state::{GroupState, OptimizerState, buf_tensor, check_layout, check_names, saved_buf};
use super::{
    Buf, OptElem, Optimizer, check_grads, check_lr, check_nonneg, check_params, device_state,
    device_step, state, update_param,
};
use crate::backend::{DeviceStorage as _, SgdStep};
use crate::{Error, Result, Tensor};
use std::collections::BTreeMap;

/// Hyperparameters of [`SGD`]; the defaults are PyTorch's except `lr`, which PyTorch requires
/// and which defaults to `1e-3` here.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdOptions {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables momentum).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient (`grad + weight_decay * param`).
    pub weight_decay: f64,
    /// Nesterov momentum; requires `momentum > 0` and `dampening == 0`.
    pub nesterov: bool,
}

impl Default for SgdOptions {
    fn default() -> Self {
        SgdOptions {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

/// SGD with optional momentum, dampening, weight decay and Nesterov momentum, with PyTorch's
/// update rule:
///
/// ```text
/// d = g + weight_decay * p
/// if momentum != 0:
///     buf = d                                   (first step)
///     buf = momentum * buf + (1 - dampening) * d (later steps)
///     d = d + momentum * buf if nesterov else buf
/// p = p - lr * d
/// ```
///
/// Each parameter group ([`SGD::with_groups`], [`Optimizer::param_groups`]) has its own
/// options; `lr`, `weight_decay` and `momentum` may change between steps.
#[derive(Debug)]
pub struct SGD {
    params: Vec<Tensor>,
    groups: Vec<ParamGroup>,
    /// Per group: the options given (dampening and Nesterov are read from here).
    fixed: Vec<SgdOptions>,
    /// Per parameter: its group.
    group_of: Vec<usize>,
    momentum_buffers: Vec<Option<Buf>>,
}

fn check_options(op: &'static str, options: &SgdOptions) -> Result<()> {
    check_lr(op, options.lr)?;
    check_nonneg(op, "momentum", options.momentum)?;
    check_nonneg(op, "dampening", options.dampening)?;
    check_nonneg(op, "weight_decay", options.weight_decay)?;
    if options.nesterov && (options.momentum <= 0.0 || options.dampening != 0.0) {
        return Err(Error::invalid(
            op,
            "nesterov",
            "momentum > 0 and dampening == 0 for Nesterov momentum",
            format!(
                "momentum={}, dampening={}",
                options.momentum, options.dampening
            ),
        ));
    }
    Ok(())
}

impl SGD {
    /// An optimizer over `params`. Errors ([`Error::InvalidArgument`]) on a negative or
    /// non-finite `lr`, `momentum`, `dampening` or `weight_decay`, on `nesterov` without
    /// `momentum > 0` and `dampening == 0`, and on non-float parameters.
    pub fn new(params: Vec<Tensor>, options: SgdOptions) -> Result<SGD> {
        SGD::with_groups(vec![(params, options)])
    }

    /// An optimizer over several parameter groups, each with its own options (PyTorch's
    /// `SGD([{"params": ..., "lr": ...}, ...])`). Errors as [`SGD::new`], and for no groups.
    pub fn with_groups(groups: Vec<(Vec<Tensor>, SgdOptions)>) -> Result<SGD> {
        const OP: &str = "SGD";
        if groups.is_empty() {
            return Err(Error::invalid(
                OP,
                "groups",
                "at least one parameter group",
                "none",
            ));
        }
        for (_, o) in &groups {
            check_options(OP, o)?;
        }
        let spans = ranges(groups.iter().map(|(p, _)| p.len()));
        let mut params = Vec::new();
        let mut fixed = Vec::new();
        let mut group_of = Vec::new();
        let mut pgs = Vec::new();
        for (i, ((ps, o), r)) in groups.into_iter().zip(spans).enumerate() {
            group_of.extend(std::iter::repeat_n(i, ps.len()));
            params.extend(ps);
            pgs.push(ParamGroup::new(
                o.lr,
                o.weight_decay,
                Some(o.momentum),
                None,
                r,
            ));
            fixed.push(o);
        }
        check_params(OP, &params)?;
        let n = params.len();
        Ok(SGD {
            params,
            groups: pgs,
            fixed,
            group_of,
            momentum_buffers: vec![None; n],
        })
    }

    /// The options of group `i` as they apply now (with the group's current `lr`,
    /// `weight_decay` and `momentum`); `None` past the last group.
    pub fn options(&self, i: usize) -> Option<SgdOptions> {
        let g = self.groups.get(i)?;
        Some(SgdOptions {
            lr: g.lr,
            weight_decay: g.weight_decay,
            momentum: g.momentum.unwrap_or(0.0),
            ..self.fixed[i]
        })
    }
}

fn sgd_update<T: OptElem>(
    p: &Tensor,
    g: &Tensor,
    o: &SgdOptions,
    buf_slot: &mut Option<Buf>,
) -> Result<()> {
    let (lr, wd, mom, damp) = (
        T::c(o.lr),
        T::c(o.weight_decay),
        T::c(o.momentum),
        T::c(o.dampening),
    );
    let use_wd = o.weight_decay != 0.0;
    if p.device().is_cuda() {
        let (buf, first) = if o.momentum == 0.0 {
            (None, false)
        } else {
            let (t, fresh) = device_state(buf_slot, p)?;
            (Some(t), fresh)
        };
        let h = SgdStep {
            lr: o.lr,
            momentum: o.momentum,
            dampening: o.dampening,
            weight_decay: o.weight_decay,
            nesterov: o.nesterov,
            first,
        };
        let states: Vec<&Tensor> = buf.iter().collect();
        return device_step("SGD.step", p, g, &states, |cp, n, cg, st| match st {
            [b] => cp.sgd_step(n, cg, Some(&mut **b), &h),
            _ => cp.sgd_step(n, cg, None, &h),
        })
        .unwrap_or(Ok(()));
    }
    if o.momentum == 0.0 {
        return update_param::<T>("SGD.step", p, g, |ps, gs| {
            for (x, &gr) in ps.iter_mut().zip(gs) {
                let d = if use_wd { gr + wd * *x } else { gr };
                *x = *x - lr * d;
            }
        });
    }
    let n = p.numel();
    let first = buf_slot
        .as_mut()
        .and_then(T::buf)
        .is_none_or(|v| v.len() != n);
    let buf = state::<T>(buf_slot, n, || vec![T::default(); n])?;
    let one_minus_damp = T::one() - damp;
    let nesterov = o.nesterov;
    update_param::<T>("SGD.step", p, g, |ps, gs| {
        for ((x, &gr), b) in ps.iter_mut().zip(gs).zip(buf.iter_mut()) {
            let d = if use_wd { gr + wd * *x } else { gr };
            *b = if first {
                d
            } else {
                mom * *b + one_minus_damp * d
            };
            let d = if nesterov { d + mom * *b } else { *b };
            *x = *x - lr * d;
        }
    })
}

impl Optimizer for SGD {
    fn kind(&self) -> &'static str {
        "SGD"
    }

    fn step_with_grads(&mut self, grads: &[Option<Tensor>]) -> Result<()> {
        const OP: &str = "SGD.step";
        check_grads(OP, &self.params, grads)?;
        check_groups(OP, &self.groups)?;
        let options: Vec<SgdOptions> = (0..self.groups.len())
            .filter_map(|i| self.options(i))
            .collect();
        for (i, o) in options.iter().enumerate() {
            check_options(OP, o).map_err(|e| in_group(e, i))?;
        }
        for (i, g) in grads.iter().enumerate() {
            let Some(g) = g else { continue };
            let p = &self.params[i];
            let o = &options[self.group_of[i]];
            let slot = &mut self.momentum_buffers[i];
            opt_dispatch!(p.dtype(), OP, T => sgd_update::<T>(p, g, o, slot)?);
        }
        Ok(())
    }
    fn params(&self) -> &[Tensor] {
        &self.params
    }
    fn param_groups(&self) -> &[ParamGroup] {
        &self.groups
    }
    fn param_groups_mut(&mut self) -> &mut [ParamGroup] {
        &mut self.groups
    }
    fn set_lr(&mut self, lr: f64) -> Result<()> {
        set_all_lr("SGD.set_lr", &mut self.groups, lr)
    }
    fn state_dict(&self) -> Result<OptimizerState> {
        let mut state = BTreeMap::new();
        for (i, b) in self.momentum_buffers.iter().enumerate() {
            if let Some(b) = b {
                let t = buf_tensor(b, &self.params[i])?;
                state.insert(i, BTreeMap::from([(MOMENTUM.to_string(), t)]));
            }
        }
        let param_groups = self
            .groups
            .iter()
            .zip(&self.fixed)
            .map(|(g, f)| GroupState {
                lr: g.lr,
                weight_decay: g.weight_decay,
                momentum: g.momentum,
                dampening: Some(f.dampening),
                nesterov: Some(f.nesterov),
                betas: None,
                eps: None,
                amsgrad: None,
                params: g.params().collect(),
            })
            .collect();
        Ok(OptimizerState {
            kind: "SGD".into(),
            state,
            param_groups,
        })
    }
    fn load_state_dict(&mut self, s: &OptimizerState) -> Result<()> {
        const OP: &str = "SGD.load_state_dict";
        let spans: Vec<_> = self.groups.iter().map(ParamGroup::params).collect();
        check_layout(OP, "SGD", s, &spans, self.params.len())?;
        check_names(OP, s, &[MOMENTUM])?;
        let (mut groups, mut fixed) = (self.groups.clone(), self.fixed.clone());
        for (i, gs) in s.param_groups.iter().enumerate() {
            let (g, f) = (&mut groups[i], &mut fixed[i]);
            g.lr = gs.lr;
            g.weight_decay = gs.weight_decay;
            g.momentum = Some(gs.momentum.unwrap_or(0.0));
            f.dampening = gs.dampening.unwrap_or(f.dampening);
            f.nesterov = gs.nesterov.unwrap_or(f.nesterov);
            let o = SgdOptions {
                lr: g.lr,
                weight_decay: g.weight_decay,
                momentum: gs.momentum.unwrap_or(0.0),
                ..*f
            };
            check_options(OP, &o).map_err(|e| in_group(e, i))?;
        }
        let bufs = (0..self.params.len())
            .map(|i| saved_buf(OP, s, i, MOMENTUM, &self.params[i]))
            .collect::<Result<Vec<_>>>()?;
        self.groups = groups;
        self.fixed = fixed;
        self.momentum_buffers = bufs;
        Ok(())
    }
}

/// The name of SGD's per-parameter state (PyTorch's).
const MOMENTUM: &str = "momentum_buffer";
