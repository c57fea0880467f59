//! The end of a reducing backward pass: unused parameters go out as zeros, every all-reduce
//! is waited for, and the averaged gradients land in `.grad`.

use std::time::{Duration, Instant};

use tensorplay_core::{Result, Tensor};

use super::super::StepStats;
use super::super::copy;
use super::{Launched, Phase, Rebuild, Reducer, State, Timing};

impl Reducer {
    /// The end of backward: unused parameters go out as zeros, every all-reduce is waited
    /// for, and the averaged gradients of the parameters some rank used land in `.grad`.
    pub(super) fn finalize(&self) -> Result<()> {
        let mut st = self.lock();
        if st.phase != Phase::Running {
            return Ok(());
        }
        let backward_end = Instant::now();
        for p in st.plan.schedule.unmarked() {
            self.mark_unused(&mut st, p);
        }
        let (results, timings) = self.wait_all(&mut st);
        let failed_here = st.error.is_some() || results.is_err();
        // which parameters some rank used, and which ranks failed this step: one small SUM
        // after the last bucket
        let flags = self.exchange_flags(&st, failed_here);
        let wait_end = Instant::now();
        st.phase = Phase::Done;
        let checked = (|| {
            if let Some(e) = st.error.take() {
                return Err(e);
            }
            Ok((results?, flags?))
        })();
        let (results, flags) = match checked {
            Ok(v) => v,
            Err(e) => {
                self.clear_grads();
                return Err(e);
            }
        };
        let n = self.params.len();
        let failed: Vec<usize> = (0..self.world)
            .filter(|&r| flags[n + r] > 0.0)
            .filter_map(|r| self.group.global_rank(r).ok())
            .collect();
        if !failed.is_empty() {
            self.clear_grads();
            return Err(self.peer(
                &st,
                format!(
                    "rank(s) {failed:?} could not finish this step (a forward or backward that \
                     failed, a skipped backward, or a failed comm hook); no rank wrote this \
                     step's gradients (their .grad is cleared), so the replicas stay identical"
                ),
            ));
        }
        let used_anywhere = &flags[..n];
        let rescale = if st.comm_hook.is_none()
            && !self.opts.divide_by_initial_world_size
            && st.active > 0
            && st.active < self.world
        {
            self.world as f64 / st.active as f64
        } else {
            1.0
        };
        for (p, &used) in used_anywhere.iter().enumerate() {
            if used <= 0.0 {
                continue;
            }
            let slot = st.plan.schedule.slot(p);
            let src = &results[slot.bucket];
            let param = &self.params[p];
            if self.opts.gradient_as_bucket_view {
                if rescale != 1.0 {
                    copy::scale(src, slot.offset, slot.numel, rescale)?;
                }
                param.set_grad(Some(
                    src.narrow(0, slot.offset, slot.numel)?
                        .reshape(param.shape())?,
                ));
            } else {
                let dst = match &st.grads[p] {
                    Some(g) => g.clone(),
                    None => {
                        let g = Tensor::zeros(param.shape(), (param.dtype(), param.device()))?;
                        st.grads[p] = Some(g.clone());
                        g
                    }
                };
                copy::copy_out(&dst, src, slot.offset, rescale)?;
                param.set_grad(Some(dst));
            }
        }
        if let Rebuild::NotYet = st.rebuild {
            st.rebuild = Rebuild::Pending(st.plan.schedule.ready_order().to_vec());
        }
        st.stats = Some(stats(&st, &timings, backward_end, wait_end));
        Ok(())
    }

    /// Waits for every launched bucket, in launch order; returns each bucket's result tensor
    /// (or the first error) and the start and end of each all-reduce that reported them.
    pub(super) fn wait_all(&self, st: &mut State) -> (Result<Vec<Tensor>>, Vec<Timing>) {
        let launched = std::mem::take(&mut st.launched);
        let mut out: Vec<Option<Tensor>> = vec![None; st.plan.buckets.len()];
        let mut timings = Vec::new();
        let mut first: Option<tensorplay_core::Error> = None;
        for (b, l) in launched {
            let (res, work) = match l {
                Launched::Work(w, t) => (w.wait(None).map(|()| t).map_err(Into::into), Some(w)),
                Launched::Hook(f) => {
                    let w = f.work().cloned();
                    (f.wait(), w)
                }
            };
            if let Some((s, e)) = work.and_then(|w| w.timing()) {
                timings.push((
                    s,
                    e,
                    st.plan.tensors[b].numel() * st.plan.tensors[b].dtype().size_in_bytes(),
                ));
            }
            match res {
                Ok(t) => {
                    let want = &st.plan.tensors[b];
                    if t.numel() != want.numel() || t.dtype() != want.dtype() || !t.is_contiguous()
                    {
                        let e = self.misuse(
                            st,
                            format!(
                                "the communication hook's future for bucket {b} resolved to a \
                                 tensor of shape {:?} and dtype {} (contiguous: {}); expected a \
                                 contiguous tensor of {} elements of dtype {}",
                                t.shape(),
                                t.dtype(),
                                t.is_contiguous(),
                                want.numel(),
                                want.dtype()
                            ),
                        );
                        first.get_or_insert(e);
                    } else {
                        out[b] = Some(t.reshape(&[t.numel()]).unwrap_or(t));
                    }
                }
                Err(e) => {
                    let what = format!("reducing gradient bucket {b} of {}", st.plan.buckets.len());
                    let e = self.comm_error(st, &what, e);
                    first.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first {
            return (Err(e), timings);
        }
        let all: Option<Vec<Tensor>> = out.into_iter().collect();
        match all {
            Some(v) => (Ok(v), timings),
            None => (
                Err(self.misuse(st, "a gradient bucket was never launched".into())),
                timings,
            ),
        }
    }
}

fn stats(st: &State, timings: &[Timing], backward_end: Instant, wait_end: Instant) -> StepStats {
    let comm: Duration = timings.iter().map(|(s, e, _)| *e - *s).sum();
    let hidden: Duration = timings
        .iter()
        .map(|(s, e, _)| (*e).min(backward_end).saturating_duration_since(*s))
        .sum();
    StepStats {
        step: st.step.saturating_sub(1),
        buckets: st.plan.buckets.len(),
        bytes: st
            .plan
            .tensors
            .iter()
            .map(|t| t.numel() * t.dtype().size_in_bytes())
            .sum(),
        comm_time: comm,
        hidden_fraction: (comm > Duration::ZERO).then(|| hidden.as_secs_f64() / comm.as_secs_f64()),
        backward_time: st
            .first_ready
            .map(|f| backward_end.saturating_duration_since(f)),
        wait_time: wait_end.saturating_duration_since(backward_end),
    }
}
