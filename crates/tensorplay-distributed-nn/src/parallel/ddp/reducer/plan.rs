//! The bucket plan (which parameters share a bucket, where each sits in it, the buckets'
//! flat tensors) and the walk that finds the leaves a forward output reaches.

use std::sync::Arc;

use tensorplay_core::{Result, Tensor, TensorId};

use super::super::buckets::{self, ParamSpec};
use super::super::schedule::Schedule;
use super::Plan;

pub(super) fn make_plan(
    params: &[Tensor],
    specs: &[ParamSpec],
    order: &[usize],
    limits: &[usize],
) -> Result<Plan> {
    let assignment = buckets::assign(specs, order, limits);
    let numels: Vec<usize> = specs.iter().map(|s| s.numel).collect();
    let schedule = Schedule::new(&assignment, &numels);
    let mut tensors = Vec::with_capacity(assignment.len());
    for (b, members) in assignment.iter().enumerate() {
        let p = &params[members[0]];
        tensors.push(Tensor::zeros(
            &[schedule.bucket_numel(b)],
            (p.dtype(), p.device()),
        )?);
    }
    Ok(Plan {
        fingerprint: buckets::fingerprint(&assignment, specs),
        buckets: assignment,
        schedule,
        tensors,
    })
}

/// The leaves the backward graph of `out` reaches.
pub(super) fn reachable_leaves(out: &Tensor) -> std::collections::HashSet<TensorId> {
    let mut leaves = std::collections::HashSet::new();
    let mut seen = std::collections::HashSet::new();
    let mut stack = Vec::new();
    if let Some(e) = out.gradient_edge() {
        stack.push(e.node().clone());
    }
    while let Some(n) = stack.pop() {
        if !seen.insert(Arc::as_ptr(&n) as usize) {
            continue;
        }
        if let Some(l) = n.leaf() {
            leaves.insert(l.id());
        }
        for e in n.next_functions().into_iter().flatten() {
            stack.push(e.node().clone());
        }
    }
    leaves
}
