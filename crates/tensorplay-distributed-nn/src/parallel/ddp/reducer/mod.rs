//! The reducer: gradient hooks copy each parameter's gradient into its bucket, full buckets
//! start their all-reduce in bucket order while backward goes on, and an end-of-backward
//! callback waits for them and writes the averaged gradients into `.grad`.

use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use tensorplay_collectives::{self as dist, ProcessGroup, ReduceOp, Work};
use tensorplay_core::autograd::{self, HookHandle};
use tensorplay_core::{Result, Tensor};

use super::StepStats;
use super::buckets::ParamSpec;
use super::comm_hook::{CommFuture, CommHook};
use super::copy;
use super::error::DdpError;
use super::protocol::{self, Hello, Outcome};
use super::schedule::{MarkError, Schedule};

/// The phase marking DDP's collectives in the cross-rank check.
pub(crate) const PHASE: &str = "ddp";

/// Options the reducer needs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReducerOptions {
    pub(crate) broadcast_buffers: bool,
    pub(crate) find_unused_parameters: bool,
    pub(crate) gradient_as_bucket_view: bool,
    pub(crate) divide_by_initial_world_size: bool,
    pub(crate) bucket_limits: [usize; 2],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No training forward since the last reduction (or ever).
    Idle,
    /// A training forward under `no_sync`: backward accumulates locally.
    NoSync,
    /// A synced training forward ran; its backward has not started.
    Expect,
    /// Its backward is running and reducing.
    Running,
    /// The reduction of the last forward finished; a second backward would not be reduced.
    Done,
}

struct Plan {
    buckets: Vec<Vec<usize>>,
    schedule: Schedule,
    tensors: Vec<Tensor>,
    fingerprint: i64,
}

enum Launched {
    Work(Arc<Work>, Tensor),
    Hook(CommFuture),
}

/// When one all-reduce ran, and its bytes.
type Timing = (Instant, Instant, usize);

enum Rebuild {
    /// No synced step finished yet.
    NotYet,
    /// The order of the first synced step, to rebuild from at the next forward.
    Pending(Vec<usize>),
    Done,
}

struct State {
    plan: Plan,
    phase: Phase,
    /// Synced steps begun (handshakes taken), trained or shadowed.
    step: u64,
    /// Synced steps this rank trained (not shadowed after `join`).
    trained: u64,
    /// `no_sync` training forwards since the last synced one.
    no_sync: u64,
    launched: Vec<(usize, Launched)>,
    used: Vec<bool>,
    unused_after_forward: Vec<usize>,
    rebuild: Rebuild,
    active: usize,
    comm_hook: Option<Arc<CommHook>>,
    grads: Vec<Option<Tensor>>,
    first_ready: Option<Instant>,
    error: Option<tensorplay_core::Error>,
    stats: Option<StepStats>,
}

/// The reducer of one [`DistributedDataParallel`](super::DistributedDataParallel).
pub(crate) struct Reducer {
    pub(crate) group: ProcessGroup,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    /// The parameters that require grad, in registration order, and their names.
    pub(crate) params: Vec<Tensor>,
    pub(crate) names: Vec<String>,
    specs: Vec<ParamSpec>,
    opts: ReducerOptions,
    /// The number every rank agreed on for this `DistributedDataParallel`.
    instance: i64,
    state: Mutex<State>,
}

fn dtype_key(t: &Tensor) -> u64 {
    let d = 1 + u64::from(t.dtype().code());
    let dev = match t.device() {
        tensorplay_core::Device::Cpu => 0,
        tensorplay_core::Device::Meta => 1,
        tensorplay_core::Device::Cuda(i) => 2 + i as u64,
    };
    d | (dev << 8)
}

impl Reducer {
    pub(crate) fn new(
        group: ProcessGroup,
        named: Vec<(String, Tensor)>,
        opts: ReducerOptions,
        instance: i64,
    ) -> Result<Arc<Reducer>> {
        let rank = group.my_global_rank();
        let world = group.size();
        let (names, params): (Vec<String>, Vec<Tensor>) = named.into_iter().unzip();
        let specs: Vec<ParamSpec> = params
            .iter()
            .map(|p| ParamSpec {
                numel: p.numel(),
                elem_bytes: p.dtype().size_in_bytes(),
                key: dtype_key(p),
            })
            .collect();
        let order: Vec<usize> = (0..params.len()).rev().collect();
        let plan = make_plan(&params, &specs, &order, &opts.bucket_limits)?;
        let n = params.len();
        Ok(Arc::new(Reducer {
            group,
            rank,
            world,
            specs,
            opts,
            instance,
            state: Mutex::new(State {
                plan,
                phase: Phase::Idle,
                step: 0,
                trained: 0,
                no_sync: 0,
                launched: Vec::new(),
                used: vec![false; n],
                unused_after_forward: Vec::new(),
                rebuild: Rebuild::NotYet,
                active: world,
                comm_hook: None,
                grads: vec![None; n],
                first_ready: None,
                error: None,
                stats: None,
            }),
            params,
            names,
        }))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers the per-parameter gradient hooks.
    pub(crate) fn install_hooks(self: &Arc<Self>) -> Result<Vec<HookHandle>> {
        let mut handles = Vec::with_capacity(self.params.len());
        for (i, p) in self.params.iter().enumerate() {
            let weak: Weak<Reducer> = Arc::downgrade(self);
            handles.push(p.register_post_accumulate_grad_hook(
                move |leaf| match weak.upgrade() {
                    Some(r) => r.on_grad(i, leaf),
                    None => Ok(()),
                },
            )?);
        }
        Ok(handles)
    }

    /// The bucket assignment: parameter names per bucket, in launch order.
    pub(crate) fn bucket_names(&self) -> Vec<Vec<String>> {
        self.lock()
            .plan
            .buckets
            .iter()
            .map(|b| b.iter().map(|&p| self.names[p].clone()).collect())
            .collect()
    }

    pub(crate) fn stats(&self) -> Option<StepStats> {
        self.lock().stats.clone()
    }

    pub(crate) fn set_comm_hook(&self, hook: Arc<CommHook>) -> Result<()> {
        let mut st = self.lock();
        if st.comm_hook.is_some() {
            return Err(self.misuse(&st, "register_comm_hook may be called only once".into()));
        }
        if st.step > 0 {
            return Err(self.misuse(
                &st,
                "register_comm_hook must be called before the first training forward".into(),
            ));
        }
        st.comm_hook = Some(hook);
        Ok(())
    }

    /// The step an error is about: the one being reduced (or abandoned) while a step is under
    /// way, else the one about to begin.
    fn step_of(st: &State) -> u64 {
        match st.phase {
            Phase::Expect | Phase::Running | Phase::Done => st.step.saturating_sub(1),
            Phase::Idle | Phase::NoSync => st.step,
        }
    }

    fn misuse(&self, st: &State, detail: String) -> tensorplay_core::Error {
        DdpError::Misuse {
            rank: self.rank,
            step: Self::step_of(st),
            detail,
        }
        .into()
    }

    fn peer(&self, st: &State, detail: String) -> tensorplay_core::Error {
        DdpError::PeerMisuse {
            rank: self.rank,
            step: Self::step_of(st),
            detail,
        }
        .into()
    }

    /// This rank's configuration bits (see [`protocol::config`]).
    fn config(&self, st: &State) -> i64 {
        let mut c = 0;
        if st.comm_hook.is_some() {
            c |= protocol::config::COMM_HOOK;
        }
        if self.opts.broadcast_buffers {
            c |= protocol::config::BROADCAST_BUFFERS;
        }
        if self.opts.divide_by_initial_world_size {
            c |= protocol::config::DIVIDE_BY_INITIAL;
        }
        c
    }

    /// One handshake (see [`protocol`]); `status` is this rank's.
    fn handshake(&self, st: &State, status: i64) -> Result<Outcome> {
        let hello = Hello {
            step: st.step,
            status,
            fingerprint: st.plan.fingerprint,
            trained: st.trained,
            rebuild: matches!(st.rebuild, Rebuild::Pending(_)),
            instance: self.instance,
            config: self.config(st),
            no_sync: st.no_sync,
        };
        let all = dist::all_gather_metadata(
            "DistributedDataParallel",
            &hello.desc(),
            Ok(()),
            Some(&self.group),
        )?;
        protocol::read(&all, self.group.ranks()).map_err(|m| {
            DdpError::PeerMisuse {
                rank: self.rank,
                step: st.step,
                detail: m,
            }
            .into()
        })
    }

    /// Before a synced training forward: checks the protocol with every rank, rebuilds the
    /// buckets once, and expects a backward. Returns the lowest active global rank (the
    /// source of buffer broadcasts).
    pub(crate) fn prepare_forward(&self) -> Result<usize> {
        let mut st = self.lock();
        self.settle_pending(&mut st, "a training forward")?;
        // a `.grad` the user replaced or cleared since the last step is not ours to overwrite
        for (p, param) in self.params.iter().enumerate() {
            if let Some(g) = &st.grads[p]
                && param.grad().is_none_or(|now| now.id() != g.id())
            {
                st.grads[p] = None;
            }
        }
        let outcome = self.handshake(&st, protocol::ACTIVE);
        // every rank counts its no_sync forwards afresh, also after a failed handshake (so a
        // rank that ran one more than the others does not fail every later step)
        st.no_sync = 0;
        let outcome = outcome?;
        if let Rebuild::Pending(order) = &st.rebuild
            && outcome.rebuild
        {
            let order = order.clone();
            self.rebuild(&mut st, order)?;
        }
        st.step += 1;
        st.trained += 1;
        st.active = outcome.active.len();
        st.phase = Phase::Expect;
        st.plan.schedule.reset();
        st.used.iter_mut().for_each(|u| *u = false);
        st.unused_after_forward.clear();
        st.first_ready = None;
        st.error = None;
        Ok(outcome.active.first().copied().unwrap_or(self.rank))
    }

    /// Before a new step: when the last synced forward's reduction did not run (no backward)
    /// or did not finish (its backward failed), finishes it with zero gradients and marks it
    /// failed, so that the other ranks' backward of that step completes — with an error, not
    /// with partial gradients. A skipped backward is then this rank's error too; a failed
    /// backward was reported already, and training goes on.
    fn settle_pending(&self, st: &mut State, what: &str) -> Result<()> {
        match st.phase {
            Phase::Expect => {
                // the step being abandoned, as the other ranks' backward names it
                let e = self.misuse(
                    st,
                    format!(
                        "{what} started before the backward of the previous training forward \
                         ran{}; this rank sent zero gradients for that step and marked it \
                         failed, so no rank used it",
                        if what == "join()" {
                            ": run backward on the output of the last training forward before \
                             join()"
                        } else {
                            ": run backward on the output of every training forward before the \
                             next one (or run extra forwards under no_grad() or in eval() mode)"
                        }
                    ),
                );
                self.abandon(st);
                Err(e)
            }
            Phase::Running => {
                self.abandon(st);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Finishes the current step with zeros for every parameter not sent yet, and tells every
    /// rank, through the flags, that it failed here.
    fn abandon(&self, st: &mut State) {
        st.phase = Phase::Running;
        for p in st.plan.schedule.unmarked() {
            self.mark_unused(st, p);
        }
        let _ = self.wait_all(st);
        let _ = self.exchange_flags(st, true);
        st.error = None;
        st.phase = Phase::Idle;
        self.clear_grads();
    }

    /// After a failed step: no `.grad` holds a local, unreduced gradient that an optimizer
    /// step would apply on this rank only.
    fn clear_grads(&self) {
        for p in &self.params {
            p.set_grad(None);
        }
    }

    /// After a synced training forward whose module failed: abandons the step (see
    /// [`Reducer::abandon`]) so that the other ranks' backward fails instead of waiting.
    pub(crate) fn abandon_after_forward_error(&self) {
        let mut st = self.lock();
        if st.phase == Phase::Expect {
            self.abandon(&mut st);
        }
    }

    /// The SUM all-reduce, after the last bucket, of `[used here (one per parameter), failed
    /// here (one per group rank)]` as 0/1 values; returns the sums.
    fn exchange_flags(&self, st: &State, failed: bool) -> Result<Vec<f32>> {
        let n = st.used.len();
        let mut v: Vec<f32> = st.used.iter().map(|&u| if u { 1.0 } else { 0.0 }).collect();
        v.resize(n + self.world, 0.0);
        if failed {
            let me = self.group.group_rank(self.rank)?;
            v[n + me] = 1.0;
        }
        let flags = Tensor::from_vec(v, &[n + self.world])?;
        let r = dist::with_phase(PHASE, || {
            dist::all_reduce_async(&flags, ReduceOp::Sum, Some(&self.group))?.wait(None)
        });
        r.map_err(|e| self.comm_error(st, "exchanging the used-parameter flags", e.into()))?;
        flags.to_vec::<f32>()
    }

    /// Rebuilds the buckets from the gradient order of the first synced step, as rank 0 saw
    /// it (broadcast, so that every rank builds the same buckets).
    fn rebuild(&self, st: &mut State, order: Vec<usize>) -> Result<()> {
        let t = Tensor::from_vec(
            order.iter().map(|&p| p as i64).collect::<Vec<_>>(),
            &[order.len()],
        )?;
        if self.world > 1 {
            let src = self.group.global_rank(0)?;
            dist::with_phase(PHASE, || dist::broadcast(&t, src, Some(&self.group)))?;
        }
        let order: Vec<usize> = t.to_vec::<i64>()?.into_iter().map(|p| p as usize).collect();
        let mut seen = vec![false; self.params.len()];
        let valid = order.len() == self.params.len()
            && order
                .iter()
                .all(|&p| p < seen.len() && !std::mem::replace(&mut seen[p], true));
        if valid {
            st.plan = make_plan(&self.params, &self.specs, &order, &self.opts.bucket_limits)?;
        }
        st.rebuild = Rebuild::Done;
        Ok(())
    }

    /// A training forward under `no_sync`, or one without a backward to reduce.
    pub(crate) fn forward_without_sync(&self) -> Result<()> {
        let mut st = self.lock();
        self.settle_pending(&mut st, "a no_sync() training forward")?;
        st.phase = Phase::NoSync;
        st.no_sync += 1;
        Ok(())
    }

    /// After a synced training forward: finds the parameters the output does not depend on
    /// (with `find_unused_parameters`) and hooks the output so that the reduction starts with
    /// the backward pass even if no parameter gets a gradient.
    pub(crate) fn after_forward(self: &Arc<Self>, out: &Tensor) -> Result<()> {
        if self.opts.find_unused_parameters {
            let reached = reachable_leaves(out);
            let unused: Vec<usize> = (0..self.params.len())
                .filter(|&i| !reached.contains(&self.params[i].id()))
                .collect();
            self.lock().unused_after_forward = unused;
        }
        if out.requires_grad() {
            let weak = Arc::downgrade(self);
            out.register_hook(move |_| {
                if let Some(r) = weak.upgrade() {
                    let mut st = r.lock();
                    r.start_backward(&mut st)?;
                }
                Ok(None)
            })?;
        }
        Ok(())
    }

    /// The first event of a backward pass that reduces: queue the end-of-backward callback
    /// and send the parameters found unused after forward.
    fn start_backward(self: &Arc<Self>, st: &mut State) -> Result<()> {
        if st.phase != Phase::Expect || !autograd::accumulating_pass() {
            return Ok(());
        }
        st.phase = Phase::Running;
        st.first_ready = Some(Instant::now());
        // if the pass fails, its callbacks are dropped unrun: the guard then abandons the step
        // at once, so the other ranks' backward fails instead of waiting for this rank
        let guard = SettleOnDrop(Arc::downgrade(self));
        autograd::queue_callback(move || match guard.0.upgrade() {
            Some(r) => r.finalize(),
            None => Ok(()),
        })?;
        for p in std::mem::take(&mut st.unused_after_forward) {
            self.mark_unused(st, p);
        }
        Ok(())
    }

    /// A parameter's gradient was accumulated into its `.grad`.
    fn on_grad(self: &Arc<Self>, p: usize, leaf: &Tensor) -> Result<()> {
        let mut st = self.lock();
        match st.phase {
            Phase::Idle | Phase::NoSync => return Ok(()),
            Phase::Done => {
                return Err(self.misuse(
                    &st,
                    format!(
                        "parameter {:?} got a gradient from a second backward after one \
                         forward; its gradients were reduced already (run a forward before each \
                         backward, or accumulate under no_sync())",
                        self.names[p]
                    ),
                ));
            }
            Phase::Expect => self.start_backward(&mut st)?,
            Phase::Running => {}
        }
        if st.plan.schedule.is_marked(p) {
            // a second gradient for it in this pass: reported when the pass ends
            let e = self.misuse(
                &st,
                format!(
                    "parameter {:?} got its gradient twice in one backward pass",
                    self.names[p]
                ),
            );
            st.error.get_or_insert(e);
            return Ok(());
        }
        let Some(g) = leaf.grad() else { return Ok(()) };
        let slot = st.plan.schedule.slot(p);
        let scale = if st.comm_hook.is_some() {
            1.0
        } else {
            1.0 / self.world as f64
        };
        if let Err(e) = copy::copy_in(&st.plan.tensors[slot.bucket], slot.offset, &g, scale) {
            st.error.get_or_insert(e);
            let _ = copy::zero(&st.plan.tensors[slot.bucket], slot.offset, slot.numel);
        }
        st.used[p] = true;
        self.mark(&mut st, p);
        Ok(())
    }

    fn mark_unused(&self, st: &mut State, p: usize) {
        if st.plan.schedule.is_marked(p) {
            return;
        }
        let slot = st.plan.schedule.slot(p);
        // with bucket views, a `.grad` that views this slot must survive its zeroing (a
        // parameter no rank uses keeps its `.grad`)
        if self.opts.gradient_as_bucket_view
            && let Some(g) = self.params[p].grad()
            && g.shares_storage_with(&st.plan.tensors[slot.bucket])
        {
            match g.deep_clone() {
                Ok(c) => self.params[p].set_grad(Some(c)),
                Err(e) => {
                    st.error.get_or_insert(e);
                }
            }
        }
        if let Err(e) = copy::zero(&st.plan.tensors[slot.bucket], slot.offset, slot.numel) {
            st.error.get_or_insert(e);
        }
        self.mark(st, p);
    }

    fn mark(&self, st: &mut State, p: usize) {
        match st.plan.schedule.mark(p) {
            Ok(ready) => {
                for b in ready {
                    self.launch(st, b);
                }
            }
            Err(MarkError::Twice(_) | MarkError::Unknown(_)) => {}
        }
    }
}

mod finish;
mod join;
mod launch;
mod plan;

use plan::{make_plan, reachable_leaves};

pub(crate) use join::JoinRound;

/// Held by the end-of-backward callback: when a backward pass fails, the engine drops its
/// callbacks without running them, and this abandons the step that was being reduced.
struct SettleOnDrop(Weak<Reducer>);

impl Drop for SettleOnDrop {
    fn drop(&mut self) {
        if let Some(r) = self.0.upgrade() {
            let mut st = r.lock();
            if st.phase == Phase::Running {
                r.abandon(&mut st);
            }
        }
    }
}
