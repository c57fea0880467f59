//! The public collectives on tensors (`torch.distributed.*`), written once for every backend:
//! call resolution (the group, this rank in it, its backend), argument validation, the
//! cross-rank metadata check (`check`), staging of strided views and aliased inputs (`stage`),
//! issue order (the group's sequencer), rank translation of errors (`translate`), then one
//! call into the group's [`Backend`]. One family of collectives per file.
//!
//! Conventions (PyTorch's): `src`/`dst` are global ranks; `group: None` is the default group;
//! operations are in place on the tensors PyTorch writes to. Tensors may be strided views:
//! results are computed in logical (row-major) order and only the view's elements are
//! written. Every rank checks, before moving data, that all ranks passed agreeing dtypes,
//! shapes, roots and ops (set `TENSORPLAY_COLLECTIVE_CHECK=0` to skip the pure checks for
//! speed); a disagreement is an [`Error::Mismatch`] on every rank naming the ranks and values.

mod all_to_all;
mod check;
mod failure_report;
mod gather;
mod lanes;
mod p2p;
mod reduce;
mod scatter;
mod stage;
mod translate;

use std::time::Duration;

use tensorplay_core::{DType, Tensor};

pub use self::all_to_all::{all_to_all, all_to_all_single, all_to_all_single_async};
pub use self::check::{all_gather_metadata, with_phase};
pub use self::gather::{all_gather, all_gather_into_tensor, all_gather_into_tensor_async, gather};
pub(crate) use self::lanes::Lanes;
pub use self::p2p::{P2POp, barrier, batch_isend_irecv, irecv, isend, recv, send};
pub use self::reduce::{
    all_reduce, all_reduce_async, reduce, reduce_scatter, reduce_scatter_tensor,
    reduce_scatter_tensor_async,
};
pub use self::scatter::{broadcast, broadcast_async, scatter};
pub(crate) use self::translate::to_global;

use crate::backend::{Backend, HostBackend};
use crate::group::{ProcessGroup, default_group};
use crate::{Error, ReduceOp, Result};

/// The resolved group of one call: the group, this rank in it, and its backend.
pub(crate) struct Call<'a> {
    op: &'static str,
    g: &'a ProcessGroup,
    rank: usize,
    size: usize,
    grank: i64,
}

impl Call<'_> {
    fn err(&self, arg: &str, expected: impl Into<String>, got: impl std::fmt::Display) -> Error {
        Error::invalid(self.op, self.grank, arg, expected, got)
    }

    fn not_member(&self) -> Error {
        Error::invalid(
            self.op,
            self.grank,
            "group",
            format!(
                "a group this rank belongs to (members: {:?})",
                self.g.ranks()
            ),
            format!("group {:?} without rank {}", self.g.ranks(), self.grank),
        )
    }

    fn timeout(&self) -> Duration {
        self.g.timeout()
    }

    /// The group's backend on this rank.
    fn backend(&self) -> Result<&dyn Backend> {
        self.g
            .inner
            .member
            .as_ref()
            .map(|m| m.backend.as_ref())
            .ok_or_else(|| self.not_member())
    }

    /// The group's cpu control channel (checks, barriers).
    fn ctl(&self) -> Result<&dyn HostBackend> {
        self.g
            .inner
            .member
            .as_ref()
            .map(|m| m.control.as_ref())
            .ok_or_else(|| self.not_member())
    }

    /// Runs `f` on the backend; its errors name global ranks.
    fn run<R>(&self, f: impl FnOnce(&dyn Backend) -> Result<R>) -> Result<R> {
        f(self.backend()?).map_err(|e| to_global(self.g.ranks(), e))
    }

    /// Translates a global root rank into a group rank.
    fn root(&self, arg: &str, global: usize) -> Result<usize> {
        self.g
            .inner
            .ranks
            .iter()
            .position(|&r| r == global)
            .ok_or_else(|| {
                self.err(
                    arg,
                    format!("a global rank in the group {:?}", self.g.ranks()),
                    global,
                )
            })
    }

    /// Checks that `t` is a tensor this group's backend moves: on its device, of one of its
    /// dtypes, and (for collectives) not requiring grad.
    fn accept(&self, arg: &str, t: &Tensor) -> Result<()> {
        let b = self.backend()?;
        let dev = b.device();
        if t.device() != dev {
            let expected = if t.device().is_meta() {
                format!(
                    "a tensor with elements on {dev} for the {} backend (a meta tensor has none: \
                     allocate the module with Module::to_empty and initialise it first)",
                    b.name()
                )
            } else if dev.is_cuda() {
                format!(
                    "a tensor on {dev}, this rank's GPU, for the {} backend (use the \"cpu\" backend for host tensors)",
                    b.name()
                )
            } else {
                format!(
                    "a CPU tensor for the {} backend (use the \"nccl\" backend for CUDA tensors)",
                    b.name()
                )
            };
            return Err(self.err(arg, expected, format!("a tensor on {}", t.device())));
        }
        if !b.dtypes().contains(&t.dtype()) {
            return Err(self.err(
                arg,
                format!("a {} tensor", dtype_list(b.dtypes())),
                t.dtype(),
            ));
        }
        self.not_differentiable(arg, t)
    }

    /// Checks that reduction `op` applies to `dt` on this backend.
    fn check_op(&self, op: ReduceOp, dt: DType) -> Result<()> {
        self.backend()?
            .check_op(op, dt)
            .map_err(|expected| self.err("op", expected, format!("{op:?} on {dt}")))
    }

    /// The blocking collectives are not differentiable: a tensor that requires grad while
    /// gradients are recorded is refused (PyTorch silently acts as the identity in backward,
    /// losing the other ranks' contributions, pytorch/pytorch#121587). Point-to-point calls
    /// (`send`, `recv`) are exempt.
    fn not_differentiable(&self, arg: &str, t: &Tensor) -> Result<()> {
        if matches!(self.op, "send" | "recv" | "isend" | "irecv")
            || !t.requires_grad()
            || !tensorplay_core::autograd::is_grad_enabled()
        {
            return Ok(());
        }
        Err(self.err(
            arg,
            format!(
                "a tensor that does not require grad: the blocking collectives are not differentiable; \
                 use tensorplay::distributed::nn::functional::{} for a collective with a backward, \
                 or call this one on `tensor.detach()` or under `no_grad()`",
                functional_name(self.op)
            ),
            "a tensor that requires grad",
        ))
    }
}

/// "float32, float64 or int64".
fn dtype_list(d: &[DType]) -> String {
    let names: Vec<String> = d.iter().map(ToString::to_string).collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        Some((last, _)) => last.clone(),
        None => "no".into(),
    }
}

/// Refuses outputs whose elements overlap in memory (expanded views).
fn check_writable(c: &Call<'_>, arg: &str, t: &Tensor) -> Result<()> {
    let l = t.layout();
    if l.shape()
        .iter()
        .zip(l.strides())
        .any(|(&n, &s)| n > 1 && s == 0)
    {
        return Err(c.err(
            arg,
            "a tensor whose elements do not overlap in memory (not an expanded view); call contiguous() first",
            format!("shape {:?} with strides {:?}", l.shape(), l.strides()),
        ));
    }
    Ok(())
}

/// The name of the differentiable counterpart of a blocking collective.
fn functional_name(op: &str) -> &str {
    match op {
        "all_gather_into_tensor" => "all_gather",
        "reduce_scatter_tensor" => "reduce_scatter",
        o => o,
    }
}

fn resolve(group: Option<&ProcessGroup>, op: &'static str) -> Result<ProcessGroup> {
    match group {
        Some(g) => Ok(g.clone()),
        None => default_group(op),
    }
}

fn call<'a>(g: &'a ProcessGroup, op: &'static str) -> Result<Call<'a>> {
    let grank = g.my_global_rank() as i64;
    let rank = g.inner.group_rank.ok_or_else(|| {
        Error::invalid(
            op,
            grank,
            "group",
            format!("a group this rank belongs to (members: {:?})", g.ranks()),
            format!("group {:?} without rank {grank}", g.ranks()),
        )
    })?;
    Ok(Call {
        op,
        g,
        rank,
        size: g.size(),
        grank,
    })
}

/// Runs the blocking operation `f` of group `g` in the group's issue order: recorded in the
/// flight recorder (called at `site` on `t`) inside a tracing span; a timeout or a peer
/// failure names the members lost (`failure_report`) and dumps the recorder
/// (`recorder::on_failure`).
fn blocking<R>(
    g: &ProcessGroup,
    op: &'static str,
    site: &'static std::panic::Location<'static>,
    t: Option<&Tensor>,
    f: impl FnOnce() -> Result<R>,
) -> Result<R> {
    let rec = &g.inner.recorder;
    let id = rec.issued(op, site, t);
    let span = span(g, op, t);
    let _in = span.enter();
    let start = std::time::Instant::now();
    let r = g.inner.seq.clone().run_blocking(g.timeout(), op, || {
        rec.started(id);
        f()
    });
    rec.finished(id, &r);
    tracing::debug!(
        latency_us = start.elapsed().as_micros() as u64,
        ok = r.is_ok(),
        "collective finished"
    );
    r.map_err(|e| crate::recorder::on_failure(failure_report::attribute(g, e)))
}

/// [`blocking`] for an `_async` operation: queued on the group's worker thread under the
/// caller's grad mode and phase; returns its [`Work`](crate::Work).
fn queued(
    g: &ProcessGroup,
    op: &'static str,
    site: &'static std::panic::Location<'static>,
    t: Option<&Tensor>,
    f: impl FnOnce() -> Result<()> + Send + 'static,
) -> Result<crate::Work> {
    let rec = g.inner.recorder.clone();
    let id = rec.issued(op, site, t);
    let span = span(g, op, t);
    let group = g.clone();
    g.inner.seq.submit(
        g.timeout(),
        op,
        callers_grad_mode(move || {
            let _in = span.enter();
            let start = std::time::Instant::now();
            rec.started(id);
            let r = f();
            rec.finished(id, &r);
            tracing::debug!(
                latency_us = start.elapsed().as_micros() as u64,
                ok = r.is_ok(),
                "collective finished"
            );
            r.map_err(|e| crate::recorder::on_failure(failure_report::attribute(&group, e)))
        }),
    )
}

/// The tracing span of one collective (op, group, bytes).
fn span(g: &ProcessGroup, op: &'static str, t: Option<&Tensor>) -> tracing::Span {
    tracing::debug_span!(
        "collective",
        op,
        group = %g.inner.name,
        bytes = t.map_or(0, |t| (t.numel() * t.dtype().size_in_bytes()) as u64)
    )
}

/// The job of an `_async` collective, run on the group's worker thread under the grad mode and
/// the phase of the thread that called it (both are per thread): the refusal of tensors that
/// require grad must see the caller's `no_grad()`, and the cross-rank check the caller's
/// [`with_phase`].
fn callers_grad_mode(
    f: impl FnOnce() -> Result<()> + Send + 'static,
) -> Box<dyn FnOnce() -> Result<()> + Send> {
    let enabled = tensorplay_core::autograd::is_grad_enabled();
    let phase = check::current_phase();
    Box::new(move || {
        let _mode = tensorplay_core::autograd::set_grad_enabled(enabled);
        match phase {
            Some(p) => with_phase(p, f),
            None => f(),
        }
    })
}
