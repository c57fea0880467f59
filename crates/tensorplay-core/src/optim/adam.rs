//! Adam and AdamW (`torch.optim.Adam`, `torch.optim.AdamW`).

use super::group::{ParamGroup, check_groups, ranges, set_all_lr};
use super::opt_dispatch;
use super::state::{
    GroupState, OptimizerState, buf_tensor, check_layout, check_names, read_step, saved_buf,
    step_tensor,
};
use super::{
    Buf, OptElem, Optimizer, check_grads, check_lr, check_nonneg, check_params, device_state,
    device_step, state, update_param,
};
use crate::backend::{AdamStep, DeviceStorage as _};
use crate::{Error, Result, Tensor};
use std::collections::BTreeMap;

/// Hyperparameters of [`Adam`], defaulting to PyTorch's: `lr = 1e-3`, `betas = (0.9, 0.999)`,
/// `eps = 1e-8`, `weight_decay = 0`, `amsgrad = false`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamOptions {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moment estimates, each in `[0, 1)`.
    pub betas: (f64, f64),
    /// Added to the denominator for numerical stability.
    pub eps: f64,
    /// L2 penalty added to the gradient (`grad + weight_decay * param`).
    pub weight_decay: f64,
    /// Use the maximum of past second moments (AMSGrad).
    pub amsgrad: bool,
}

impl Default for AdamOptions {
    fn default() -> Self {
        AdamOptions {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
        }
    }
}

/// Hyperparameters of [`AdamW`], defaulting to PyTorch's: as [`AdamOptions`] but
/// `weight_decay = 0.01`, applied decoupled from the gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWOptions {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moment estimates, each in `[0, 1)`.
    pub betas: (f64, f64),
    /// Added to the denominator for numerical stability.
    pub eps: f64,
    /// Decoupled weight decay: `param *= 1 - lr * weight_decay` before the Adam step.
    pub weight_decay: f64,
    /// Use the maximum of past second moments (AMSGrad).
    pub amsgrad: bool,
}

impl Default for AdamWOptions {
    fn default() -> Self {
        AdamWOptions {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-2,
            amsgrad: false,
        }
    }
}

#[derive(Debug, Default, Clone)]
struct AdamState {
    step: u64,
    exp_avg: Option<Buf>,
    exp_avg_sq: Option<Buf>,
    max_exp_avg_sq: Option<Buf>,
}

/// The options of one group of the shared implementation.
#[derive(Debug, Clone, Copy)]
struct Hyper {
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    amsgrad: bool,
}

macro_rules! hyper_from {
    ($o:ty) => {
        impl From<$o> for Hyper {
            fn from(o: $o) -> Hyper {
                Hyper {
                    lr: o.lr,
                    betas: o.betas,
                    eps: o.eps,
                    weight_decay: o.weight_decay,
                    amsgrad: o.amsgrad,
                }
            }
        }
    };
}
hyper_from!(AdamOptions);
hyper_from!(AdamWOptions);

fn check_hyper(op: &'static str, h: &Hyper) -> Result<()> {
    check_lr(op, h.lr)?;
    check_nonneg(op, "eps", h.eps)?;
    check_nonneg(op, "weight_decay", h.weight_decay)?;
    for (i, b) in [h.betas.0, h.betas.1].into_iter().enumerate() {
        if !(0.0..1.0).contains(&b) {
            return Err(Error::invalid(
                op,
                "betas",
                "betas in [0, 1)",
                format!("beta{} = {b}", i + 1),
            ));
        }
    }
    Ok(())
}

/// The shared implementation: `decoupled` selects AdamW's weight decay.
#[derive(Debug)]
struct AdamCore {
    params: Vec<Tensor>,
    groups: Vec<ParamGroup>,
    /// Per group: `eps` and `amsgrad`, fixed at construction.
    fixed: Vec<(f64, bool)>,
    /// Per parameter: its group.
    group_of: Vec<usize>,
    decoupled: bool,
    states: Vec<AdamState>,
}

impl AdamCore {
    fn new(
        op: &'static str,
        groups: Vec<(Vec<Tensor>, Hyper)>,
        decoupled: bool,
    ) -> Result<AdamCore> {
        if groups.is_empty() {
            return Err(Error::invalid(
                op,
                "groups",
                "at least one parameter group",
                "none",
            ));
        }
        for (_, h) in &groups {
            check_hyper(op, h)?;
        }
        let spans = ranges(groups.iter().map(|(p, _)| p.len()));
        let (mut params, mut pgs, mut fixed, mut group_of) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, ((ps, h), r)) in groups.into_iter().zip(spans).enumerate() {
            group_of.extend(std::iter::repeat_n(i, ps.len()));
            params.extend(ps);
            pgs.push(ParamGroup::new(
                h.lr,
                h.weight_decay,
                None,
                Some(h.betas),
                r,
            ));
            fixed.push((h.eps, h.amsgrad));
        }
        check_params(op, &params)?;
        let n = params.len();
        Ok(AdamCore {
            params,
            groups: pgs,
            fixed,
            group_of,
            decoupled,
            states: vec![AdamState::default(); n],
        })
    }

    /// Group `i`'s options as they apply now.
    fn hyper(&self, i: usize) -> Hyper {
        let g = &self.groups[i];
        let (eps, amsgrad) = self.fixed[i];
        Hyper {
            lr: g.lr,
            betas: g.betas.unwrap_or((0.9, 0.999)),
            eps,
            weight_decay: g.weight_decay,
            amsgrad,
        }
    }

    fn step_with_grads(&mut self, op: &'static str, grads: &[Option<Tensor>]) -> Result<()> {
        check_grads(op, &self.params, grads)?;
        check_groups(op, &self.groups)?;
        let hypers: Vec<Hyper> = (0..self.groups.len()).map(|i| self.hyper(i)).collect();
        for (i, g) in grads.iter().enumerate() {
            let Some(g) = g else { continue };
            let p = self.params[i].clone();
            let h = hypers[self.group_of[i]];
            opt_dispatch!(p.dtype(), op, T => self.update::<T>(op, i, &p, g, &h)?);
        }
        Ok(())
    }

    fn update<T: OptElem>(
        &mut self,
        op: &'static str,
        i: usize,
        p: &Tensor,
        g: &Tensor,
        h: &Hyper,
    ) -> Result<()> {
        let n = p.numel();
        let st = &mut self.states[i];
        st.step += 1;
        let (b1, b2) = h.betas;
        let bias_c1 = 1.0 - b1.powi(st.step.min(i32::MAX as u64) as i32);
        let bias_c2 = 1.0 - b2.powi(st.step.min(i32::MAX as u64) as i32);
        let step_size = T::c(h.lr / bias_c1);
        let bias_c2_sqrt = T::c(bias_c2.sqrt());
        let (tb1, tb2) = (T::c(b1), T::c(b2));
        let (one_b1, one_b2) = (T::c(1.0 - b1), T::c(1.0 - b2));
        let eps = T::c(h.eps);
        let wd = T::c(h.weight_decay);
        let use_wd = h.weight_decay != 0.0;
        let decay = T::c(1.0 - h.lr * h.weight_decay);
        let decoupled = self.decoupled;
        if p.device().is_cuda() {
            let (m, _) = device_state(&mut st.exp_avg, p)?;
            let (v, _) = device_state(&mut st.exp_avg_sq, p)?;
            let vmax = if h.amsgrad {
                Some(device_state(&mut st.max_exp_avg_sq, p)?.0)
            } else {
                None
            };
            let hs = AdamStep {
                beta1: b1,
                beta2: b2,
                eps: h.eps,
                weight_decay: h.weight_decay,
                decoupled,
                decay: 1.0 - h.lr * h.weight_decay,
                step_size: h.lr / bias_c1,
                bias_c2_sqrt: bias_c2.sqrt(),
            };
            let mut states = vec![&m, &v];
            states.extend(vmax.as_ref());
            return device_step(op, p, g, &states, |cp, n, cg, st| match st {
                [m, v] => cp.adam_step(n, cg, m, v, None, &hs),
                [m, v, vmax] => cp.adam_step(n, cg, m, v, Some(&mut **vmax), &hs),
                _ => Ok(()),
            })
            .unwrap_or(Ok(()));
        }
        let m = std::mem::take(&mut st.exp_avg);
        let v = std::mem::take(&mut st.exp_avg_sq);
        let vmax = std::mem::take(&mut st.max_exp_avg_sq);
        let (mut m, mut v, mut vmax) = (m, v, vmax);
        {
            let mv = state::<T>(&mut m, n, || vec![T::default(); n])?;
            let vv = state::<T>(&mut v, n, || vec![T::default(); n])?;
            let mut vmax_v = if h.amsgrad {
                Some(state::<T>(&mut vmax, n, || vec![T::default(); n])?)
            } else {
                None
            };
            let k = AdamConsts {
                b1: tb1,
                b2: tb2,
                one_b1,
                one_b2,
                eps,
                wd,
                decay,
                step_size,
                bias_c2_sqrt,
            };
            let mode = match (use_wd, decoupled) {
                (false, _) => Decay::None,
                (true, true) => Decay::Decoupled,
                (true, false) => Decay::L2,
            };
            update_param::<T>(op, p, g, |ps, gs| {
                adam_parallel(
                    ps,
                    gs,
                    mv,
                    vv,
                    vmax_v.as_mut().map(|v| &mut v[..]),
                    mode,
                    &k,
                )
            })?;
        }
        let st = &mut self.states[i];
        st.exp_avg = m;
        st.exp_avg_sq = v;
        st.max_exp_avg_sq = vmax;
        Ok(())
    }
}

impl AdamCore {
    fn state_dict(&self, kind: &str) -> Result<OptimizerState> {
        let mut state = BTreeMap::new();
        for (i, st) in self.states.iter().enumerate() {
            if st.step == 0 {
                continue;
            }
            let p = &self.params[i];
            let mut m = BTreeMap::from([("step".to_string(), step_tensor(st.step))]);
            for (name, b) in [
                ("exp_avg", &st.exp_avg),
                ("exp_avg_sq", &st.exp_avg_sq),
                ("max_exp_avg_sq", &st.max_exp_avg_sq),
            ] {
                if let Some(b) = b {
                    m.insert(name.to_string(), buf_tensor(b, p)?);
                }
            }
            state.insert(i, m);
        }
        let param_groups = (0..self.groups.len())
            .map(|i| {
                let h = self.hyper(i);
                GroupState {
                    lr: h.lr,
                    weight_decay: h.weight_decay,
                    momentum: None,
                    dampening: None,
                    nesterov: None,
                    betas: Some(h.betas),
                    eps: Some(h.eps),
                    amsgrad: Some(h.amsgrad),
                    params: self.groups[i].params().collect(),
                }
            })
            .collect();
        Ok(OptimizerState {
            kind: kind.into(),
            state,
            param_groups,
        })
    }

    fn load_state_dict(&mut self, op: &'static str, kind: &str, s: &OptimizerState) -> Result<()> {
        let spans: Vec<_> = self.groups.iter().map(ParamGroup::params).collect();
        check_layout(op, kind, s, &spans, self.params.len())?;
        check_names(op, s, &["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"])?;
        let (mut groups, mut fixed) = (self.groups.clone(), self.fixed.clone());
        for (i, gs) in s.param_groups.iter().enumerate() {
            let (g, f) = (&mut groups[i], &mut fixed[i]);
            g.lr = gs.lr;
            g.weight_decay = gs.weight_decay;
            g.betas = Some(gs.betas.unwrap_or((0.9, 0.999)));
            *f = (gs.eps.unwrap_or(f.0), gs.amsgrad.unwrap_or(f.1));
            let h = Hyper {
                lr: g.lr,
                betas: gs.betas.unwrap_or((0.9, 0.999)),
                eps: f.0,
                weight_decay: g.weight_decay,
                amsgrad: f.1,
            };
            check_hyper(op, &h).map_err(|e| super::group::in_group(e, i))?;
        }
        let mut states = vec![AdamState::default(); self.params.len()];
        for (i, st) in states.iter_mut().enumerate() {
            let Some(saved) = s.state.get(&i) else {
                continue;
            };
            let p = &self.params[i];
            let step = saved.get("step").ok_or_else(|| {
                Error::invalid(op, "state", format!("state.{i}.step"), "no step count")
            })?;
            st.step = read_step(step).ok_or_else(|| {
                Error::invalid(
                    op,
                    "state",
                    format!(
                        "state.{i}.step: a 0-d float32, float64 or int64 holding a whole number \
                         >= 0"
                    ),
                    format!(
                        "a tensor of dtype {:?} and shape {:?}",
                        step.dtype(),
                        step.shape()
                    ),
                )
            })?;
            let amsgrad = fixed[self.group_of[i]].1;
            // a stepped parameter has both moments (and, with AMSGrad, their maximum), as
            // PyTorch requires; second moments are never negative
            let need = |name: &str| -> Result<Buf> {
                let b = saved_buf(op, s, i, name, p)?.ok_or_else(|| {
                    Error::invalid(op, "state", format!("state.{i}.{name}"), "none (missing)")
                })?;
                if name != "exp_avg" {
                    let negative = match &b {
                        Buf::F32(v) => v.iter().any(|x| x.is_nan() || *x < 0.0),
                        Buf::F64(v) => v.iter().any(|x| x.is_nan() || *x < 0.0),
                        Buf::Device(_) => false,
                    };
                    if negative {
                        return Err(Error::invalid(
                            op,
                            "state",
                            format!("state.{i}.{name} >= 0 everywhere"),
                            "a negative or NaN element",
                        ));
                    }
                }
                Ok(b)
            };
            st.exp_avg = Some(need("exp_avg")?);
            st.exp_avg_sq = Some(need("exp_avg_sq")?);
            st.max_exp_avg_sq = if amsgrad {
                Some(need("max_exp_avg_sq")?)
            } else {
                saved_buf(op, s, i, "max_exp_avg_sq", p)?
            };
        }
        self.groups = groups;
        self.fixed = fixed;
        self.states = states;
        Ok(())
    }
}

/// Adam (`torch.optim.Adam`) with PyTorch's update, per parameter at step `t`:
///
/// ```text
/// g = g + weight_decay * p
/// m = beta1 * m + (1 - beta1) * g
/// v = beta2 * v + (1 - beta2) * g^2
/// vmax = max(vmax, v)                                  (amsgrad; then v = vmax below)
/// step_size = lr / (1 - beta1^t)
/// denom = sqrt(v) / sqrt(1 - beta2^t) + eps
/// p = p - step_size * m / denom
/// ```
#[derive(Debug)]
pub struct Adam(AdamCore);

impl Adam {
    /// An optimizer over `params`. Errors ([`Error::InvalidArgument`]) on a negative or
    /// non-finite `lr`, `eps` or `weight_decay`, betas outside `[0, 1)`, and non-float
    /// parameters.
    pub fn new(params: Vec<Tensor>, o: AdamOptions) -> Result<Adam> {
        Adam::with_groups(vec![(params, o)])
    }

    /// An optimizer over several parameter groups, each with its own options; errors as
    /// [`Adam::new`], and for no groups.
    pub fn with_groups(groups: Vec<(Vec<Tensor>, AdamOptions)>) -> Result<Adam> {
        let groups = groups.into_iter().map(|(p, o)| (p, o.into())).collect();
        Ok(Adam(AdamCore::new("Adam", groups, false)?))
    }
}

impl Optimizer for Adam {
    fn step_with_grads(&mut self, grads: &[Option<Tensor>]) -> Result<()> {
        self.0.step_with_grads("Adam.step", grads)
    }
    fn params(&self) -> &[Tensor] {
        &self.0.params
    }
    fn param_groups(&self) -> &[ParamGroup] {
        &self.0.groups
    }
    fn param_groups_mut(&mut self) -> &mut [ParamGroup] {
        &mut self.0.groups
    }
    fn set_lr(&mut self, lr: f64) -> Result<()> {
        set_all_lr("Adam.set_lr", &mut self.0.groups, lr)
    }
    fn kind(&self) -> &'static str {
        "Adam"
    }

    fn state_dict(&self) -> Result<OptimizerState> {
        self.0.state_dict("Adam")
    }
    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        self.0
            .load_state_dict("Adam.load_state_dict", "Adam", state)
    }
}

/// AdamW (`torch.optim.AdamW`): Adam with decoupled weight decay, `p = p * (1 - lr *
/// weight_decay)` before the Adam update (which then runs without the L2 term).
#[derive(Debug)]
pub struct AdamW(AdamCore);

impl AdamW {
    /// An optimizer over `params`; errors as [`Adam::new`].
    pub fn new(params: Vec<Tensor>, o: AdamWOptions) -> Result<AdamW> {
        AdamW::with_groups(vec![(params, o)])
    }

    /// An optimizer over several parameter groups, each with its own options; errors as
    /// [`Adam::new`], and for no groups.
    pub fn with_groups(groups: Vec<(Vec<Tensor>, AdamWOptions)>) -> Result<AdamW> {
        let groups = groups.into_iter().map(|(p, o)| (p, o.into())).collect();
        Ok(AdamW(AdamCore::new("AdamW", groups, true)?))
    }
}

impl Optimizer for AdamW {
    fn step_with_grads(&mut self, grads: &[Option<Tensor>]) -> Result<()> {
        self.0.step_with_grads("AdamW.step", grads)
    }
    fn params(&self) -> &[Tensor] {
        &self.0.params
    }
    fn param_groups(&self) -> &[ParamGroup] {
        &self.0.groups
    }
    fn param_groups_mut(&mut self) -> &mut [ParamGroup] {
        &mut self.0.groups
    }
    fn set_lr(&mut self, lr: f64) -> Result<()> {
        set_all_lr("AdamW.set_lr", &mut self.0.groups, lr)
    }
    fn kind(&self) -> &'static str {
        "AdamW"
    }

    fn state_dict(&self) -> Result<OptimizerState> {
        self.0.state_dict("AdamW")
    }
    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        self.0
            .load_state_dict("AdamW.load_state_dict", "AdamW", state)
    }
}

/// Elements per piece of the parallel Adam step.
const ADAM_CHUNK: usize = 1 << 14;

/// The Adam step over a parameter's elements in pieces on the intra-op threads (above the size
/// threshold), each piece compiled for the processor's vector width; elementwise, so neither
/// the thread count nor the level changes a bit (sqrt and division are exact).
fn adam_parallel<T: OptElem>(
    ps: &mut [T],
    gs: &[T],
    m: &mut [T],
    v: &mut [T],
    vmax: Option<&mut [T]>,
    mode: Decay,
    k: &AdamConsts<T>,
) {
    use rayon::prelude::*;
    let one = |ps: &mut [T], gs: &[T], m: &mut [T], v: &mut [T], vm: Option<&mut [T]>| {
        crate::kernels::dispatch(
            #[inline(always)]
            || match (mode, vm) {
                (Decay::None, None) => adam_slices::<T, 0>(ps, gs, m, v, k),
                (Decay::Decoupled, None) => adam_slices::<T, 1>(ps, gs, m, v, k),
                (Decay::L2, None) => adam_slices::<T, 2>(ps, gs, m, v, k),
                (mode, Some(vm)) => amsgrad_slices(ps, gs, m, v, vm, mode, k),
            },
        )
    };
    crate::kernels::with_pool(ps.len(), |par| {
        if !par {
            return one(ps, gs, m, v, vmax);
        }
        let c = ADAM_CHUNK;
        let pieces = ps
            .par_chunks_mut(c)
            .zip(gs.par_chunks(c))
            .zip(m.par_chunks_mut(c))
            .zip(v.par_chunks_mut(c));
        match vmax {
            None => pieces.for_each(|(((p, g), m), v)| one(p, g, m, v, None)),
            Some(vm) => pieces
                .zip(vm.par_chunks_mut(c))
                .for_each(|((((p, g), m), v), vm)| one(p, g, m, v, Some(vm))),
        }
    })
}

/// How weight decay enters an Adam step.
#[derive(Clone, Copy, Debug)]
enum Decay {
    None,
    /// AdamW: the parameter shrinks by `1 - lr * weight_decay` first.
    Decoupled,
    /// Adam: `weight_decay * p` is added to the gradient.
    L2,
}

/// One step's constants, in the parameter's element type.
struct AdamConsts<T> {
    b1: T,
    b2: T,
    one_b1: T,
    one_b2: T,
    eps: T,
    wd: T,
    decay: T,
    step_size: T,
    bias_c2_sqrt: T,
}

/// The step of one element; `vmax` holds AMSGrad's running maximum when there is one.
#[inline(always)]
fn adam_elem<T: OptElem, const MODE: u8>(
    x: &mut T,
    g: T,
    m: &mut T,
    v: &mut T,
    vmax: Option<&mut T>,
    k: &AdamConsts<T>,
) {
    let mut g = g;
    match MODE {
        1 => *x = *x * k.decay,
        2 => g = g + k.wd * *x,
        _ => {}
    }
    let mj = k.b1 * *m + k.one_b1 * g;
    let vj = k.b2 * *v + k.one_b2 * g * g;
    *m = mj;
    *v = vj;
    let vd = match vmax {
        Some(vm) => {
            let mx = if *vm > vj { *vm } else { vj };
            *vm = mx;
            mx
        }
        None => vj,
    };
    let denom = vd.sqrt() / k.bias_c2_sqrt + k.eps;
    *x = *x - k.step_size * (mj / denom);
}

/// The Adam step over whole slices (no per-element branches, so it vectorises); `MODE` is the
/// weight decay (0 none, 1 decoupled, 2 L2).
#[inline(always)]
fn adam_slices<T: OptElem, const MODE: u8>(
    ps: &mut [T],
    gs: &[T],
    m: &mut [T],
    v: &mut [T],
    k: &AdamConsts<T>,
) {
    for (((x, &g), mj), vj) in ps.iter_mut().zip(gs).zip(m.iter_mut()).zip(v.iter_mut()) {
        adam_elem::<T, MODE>(x, g, mj, vj, None, k);
    }
}

/// The AMSGrad step over whole slices.
#[inline(always)]
fn amsgrad_slices<T: OptElem>(
    ps: &mut [T],
    gs: &[T],
    m: &mut [T],
    v: &mut [T],
    vmax: &mut [T],
    mode: Decay,
    k: &AdamConsts<T>,
) {
    let all = ps
        .iter_mut()
        .zip(gs)
        .zip(m.iter_mut())
        .zip(v.iter_mut())
        .zip(vmax.iter_mut());
    for ((((x, &g), mj), vj), vm) in all {
        match mode {
            Decay::None => adam_elem::<T, 0>(x, g, mj, vj, Some(vm), k),
            Decay::Decoupled => adam_elem::<T, 1>(x, g, mj, vj, Some(vm), k),
            Decay::L2 => adam_elem::<T, 2>(x, g, mj, vj, Some(vm), k),
        }
    }
}
