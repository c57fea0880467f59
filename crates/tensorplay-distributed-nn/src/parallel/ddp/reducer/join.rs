//! `join`: a rank that ran out of data shadows the other ranks' synced steps with zeros.

use tensorplay_core::Result;

use super::super::protocol;
use super::{Phase, Reducer};

impl Reducer {
    /// One round of [`join`]: the handshake as a joined rank. Returns `Shadow(src)` when
    /// some rank still trains (this rank then shadows the step: buffers from `src`, then
    /// [`Reducer::join_backward`]), or `Done(authority)` when every rank has joined (every
    /// rank then takes the model of `authority`, the last to join).
    ///
    /// [`join`]: super::DistributedDataParallel::join
    pub(crate) fn join_round(&self) -> Result<JoinRound> {
        let mut st = self.lock();
        self.settle_pending(&mut st, "join()")?;
        let outcome = self.handshake(&st, protocol::JOINED)?;
        if outcome.active.is_empty() {
            st.phase = Phase::Idle;
            return Ok(JoinRound::Done(outcome.authority));
        }
        st.step += 1;
        st.plan.schedule.reset();
        st.used.iter_mut().for_each(|u| *u = false);
        st.error = None;
        st.phase = Phase::Running;
        Ok(JoinRound::Shadow(outcome.active[0]))
    }

    /// The backward half of a shadowed step: every bucket as zeros, then the flags.
    pub(crate) fn join_backward(&self) -> Result<()> {
        let mut st = self.lock();
        for t in &st.plan.tensors {
            t.zero_()?;
        }
        for p in st.plan.schedule.unmarked() {
            self.mark(&mut st, p);
        }
        let (results, _) = self.wait_all(&mut st);
        let failed_here = st.error.is_some() || results.is_err();
        let flags = self.exchange_flags(&st, failed_here);
        st.phase = Phase::Done;
        if let Some(e) = st.error.take() {
            return Err(e);
        }
        results?;
        flags?;
        Ok(())
    }
}

/// What a round of `join` found.
pub(crate) enum JoinRound {
    /// Some rank still trains; buffers come from this global rank.
    Shadow(usize),
    /// Every rank has joined; this global rank's model is the final one.
    Done(usize),
}
