//! What the ranks of a pipeline group must agree on before their first step (the schedule,
//! its micro-batches and stages, who holds which stage, the tied parameters, the order the
//! schedules were built in), compared in one `all_gather_object`.

use serde::{Deserialize, Serialize};
use tensorplay_collectives::{self as dist, ProcessGroup};
use tensorplay_core::Result;

use super::error::PipelineError;
use super::schedule::PipelineShape;

/// What every rank must agree on, compared at the first step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Signature {
    pub(super) schedule: String,
    pub(super) n_microbatches: usize,
    pub(super) num_stages: usize,
    pub(super) stages: Vec<usize>,
    /// Per tied parameter, in order: the global ranks of its group and its shape.
    pub(super) tied: Vec<(Vec<usize>, Vec<usize>)>,
    /// The order this process built the schedule in (its store keys).
    pub(super) id: u64,
}

/// At the first step: every rank of the pipeline `group` runs the same schedule (`mine` is
/// this rank's signature) with the same micro-batches and stages, holds the stages `shape`
/// gives it, ties the same parameters, and built the schedule in the same order (an error on
/// every rank otherwise). A collective over `group`.
pub(super) fn agree(group: &ProcessGroup, shape: &PipelineShape, mine: &Signature) -> Result<()> {
    let all = dist::all_gather_object(mine, Some(group))?;
    let me = group.my_global_rank();
    if let Some(detail) = tie_mismatch(group.ranks(), &all) {
        return Err(PipelineError::Mismatch { rank: me, detail }.into());
    }
    if let Some((r, sig)) = all.iter().enumerate().find(|(_, s)| s.id != mine.id) {
        return Err(PipelineError::Mismatch {
            rank: me,
            detail: format!(
                "this schedule is the {}-th rank {me} built on this group, and the {}-th \
                 rank {} built: build the schedules of a group in the same order on every \
                 rank",
                mine.id + 1,
                sig.id + 1,
                group.ranks()[r]
            ),
        }
        .into());
    }
    for (r, sig) in all.iter().enumerate() {
        let expect_stages = shape.stages_of(r);
        let ours = (&mine.schedule, mine.n_microbatches, mine.num_stages);
        if (&sig.schedule, sig.n_microbatches, sig.num_stages) != ours
            || sig.stages != expect_stages
        {
            return Err(PipelineError::Mismatch {
                rank: me,
                detail: format!(
                    "rank {} runs {} with {} micro-batches over {} stages holding stages {:?}; \
                     rank {r} runs {} with {} micro-batches over {} stages holding stages {:?}",
                    me,
                    mine.schedule,
                    mine.n_microbatches,
                    mine.num_stages,
                    mine.stages,
                    sig.schedule,
                    sig.n_microbatches,
                    sig.num_stages,
                    sig.stages
                ),
            }
            .into());
        }
    }
    Ok(())
}

/// Where the ranks' tied parameters disagree: a rank ties a parameter over a group whose
/// other members (those in the pipeline group `ranks`, whose signatures are `all`) do not tie
/// one over the same group, in the same order, of the same shape.
fn tie_mismatch(ranks: &[usize], all: &[Signature]) -> Option<String> {
    for (r, sig) in all.iter().enumerate() {
        let mut seen: std::collections::HashMap<&[usize], usize> = Default::default();
        for (group, shape) in &sig.tied {
            // the i-th tie over this group on rank r pairs with the i-th on each member
            let i = seen.entry(group.as_slice()).or_insert(0);
            for q in group {
                let Some(qi) = ranks.iter().position(|x| x == q) else {
                    continue;
                };
                let theirs: Vec<&Vec<usize>> = all[qi]
                    .tied
                    .iter()
                    .filter(|(g, _)| g == group)
                    .map(|(_, s)| s)
                    .collect();
                let ok = theirs.get(*i).is_some_and(|s| *s == shape);
                if !ok {
                    let got = match theirs.get(*i) {
                        Some(s) => format!("its copy has shape {s:?}"),
                        None => format!("it ties {} parameter(s) over them", theirs.len()),
                    };
                    return Some(format!(
                        "rank {} ties a parameter of shape {shape:?} over ranks {group:?} \
                         (its tie {} over them); rank {q} does not match: {got}",
                        ranks[r],
                        *i + 1
                    ));
                }
            }
            *i += 1;
        }
    }
    None
}
