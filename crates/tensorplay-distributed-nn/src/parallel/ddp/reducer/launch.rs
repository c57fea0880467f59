//! Launching a full bucket: its asynchronous all-reduce, or the communication hook on it
//! (zeros go out when the hook or the launch fails, so that the ranks' collectives stay
//! paired).

use std::sync::Arc;

use tensorplay_collectives::{self as dist, ReduceOp};
use tensorplay_core::Result;

use super::super::comm_hook::GradBucket;
use super::super::error::DdpError;
use super::{Launched, PHASE, Reducer, State};

impl Reducer {
    /// Starts bucket `b`'s all-reduce (or the communication hook on it). When the hook fails
    /// (an error or a panic) or the launch fails here, the bucket still goes out, as zeros, so
    /// that the ranks' collectives stay paired; the error fails this step on every rank
    /// through the flags.
    pub(super) fn launch(&self, st: &mut State, b: usize) {
        let t = st.plan.tensors[b].clone();
        let r = dist::with_phase(PHASE, || -> Result<Launched> {
            match &st.comm_hook {
                Some(h) => {
                    let bucket = self.grad_bucket(st, b);
                    let called = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        h(&self.group, &bucket)
                    }));
                    match called {
                        Ok(r) => Ok(Launched::Hook(r?)),
                        Err(_) => Err(tensorplay_core::Error::Custom {
                            context: format!("the communication hook on bucket {b}"),
                            message: "panicked".into(),
                        }),
                    }
                }
                None => {
                    let w = dist::all_reduce_async(&t, ReduceOp::Sum, Some(&self.group))?;
                    Ok(Launched::Work(Arc::new(w), t.clone()))
                }
            }
        });
        match r {
            Ok(l) => st.launched.push((b, l)),
            Err(e) => {
                let what = format!("reducing gradient bucket {b} of {}", st.plan.buckets.len());
                let e = self.comm_error(st, &what, e);
                st.error.get_or_insert(e);
                // keep the collectives paired: this rank's share of the bucket is zeros
                let zeros = t.zero_().and_then(|()| {
                    dist::with_phase(PHASE, || {
                        dist::all_reduce_async(&t, ReduceOp::Sum, Some(&self.group))
                    })
                    .map_err(Into::into)
                });
                if let Ok(w) = zeros {
                    st.launched
                        .push((b, Launched::Work(Arc::new(w), t.clone())));
                }
            }
        }
    }

    fn grad_bucket(&self, st: &State, b: usize) -> GradBucket {
        let members = &st.plan.buckets[b];
        GradBucket {
            index: b,
            count: st.plan.buckets.len(),
            buffer: st.plan.tensors[b].clone(),
            parameters: members.iter().map(|&p| self.params[p].clone()).collect(),
            offsets: members
                .iter()
                .map(|&p| st.plan.schedule.slot(p).offset)
                .collect(),
        }
    }

    pub(super) fn comm_error(
        &self,
        st: &State,
        what: &str,
        e: tensorplay_core::Error,
    ) -> tensorplay_core::Error {
        DdpError::Communication {
            rank: self.rank,
            step: Self::step_of(st),
            what: what.to_string(),
            error: e,
        }
        .into()
    }
}
