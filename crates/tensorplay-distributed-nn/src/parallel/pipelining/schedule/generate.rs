//! The compute order of each schedule, per rank (pure functions of the pipeline's shape), and
//! the lowering that adds the sends and receives between ranks.

use super::action::{Action, ActionKind};
use super::{PipelineShape, ScheduleKind};
use ActionKind::{Backward, BackwardInput, BackwardWeight, Forward};

/// Every rank's compute actions (`F`, `B`, `I`, `W`) in order, for `kind` on `shape`
/// (checked by [`PipelineShape::check`] before).
pub(crate) fn compute_lists(kind: ScheduleKind, shape: &PipelineShape) -> Vec<Vec<Action>> {
    let lists: Vec<Vec<Action>> = (0..shape.ranks)
        .map(|r| match kind {
            ScheduleKind::GPipe => gpipe(shape, r),
            ScheduleKind::OneFOneB => one_f_one_b(shape, r),
            ScheduleKind::Interleaved1F1B => interleaved(shape, r, false),
            ScheduleKind::InterleavedZeroBubble => interleaved(shape, r, true),
        })
        .collect();
    match kind {
        ScheduleKind::InterleavedZeroBubble => fill_bubbles(shape, lists),
        _ => lists,
    }
}

/// All forwards, then all backwards in micro-batch order.
fn gpipe(shape: &PipelineShape, r: usize) -> Vec<Action> {
    let m = shape.microbatches;
    let f = (0..m).map(|i| Action::new(r, Forward, i));
    f.chain((0..m).map(|i| Action::new(r, Backward, i)))
        .collect()
}

/// PipeDream-flush: `p - r - 1` warm-up forwards, then one forward and one backward in
/// turn, then the remaining backwards; at most `p - r` micro-batches in flight on rank `r`.
fn one_f_one_b(shape: &PipelineShape, r: usize) -> Vec<Action> {
    let (p, m) = (shape.ranks, shape.microbatches);
    let warmup = (p - r - 1).min(m);
    let mut list: Vec<Action> = (0..warmup).map(|i| Action::new(r, Forward, i)).collect();
    for i in 0..m - warmup {
        list.push(Action::new(r, Forward, warmup + i));
        list.push(Action::new(r, Backward, i));
    }
    list.extend((m - warmup..m).map(|i| Action::new(r, Backward, i)));
    list
}

/// Megatron's interleaved 1F1B over `v` stages per rank (rank `r` holds stages `r`, `r + p`,
/// ...): forwards go through the stages chunk by chunk in groups of `p` micro-batches, with
/// `2 (p - r - 1) + (v - 1) p` warm-up forwards. With `split`, each backward is an `I`
/// followed by its `W` (moved into the bubbles by [`fill_bubbles`]).
fn interleaved(shape: &PipelineShape, r: usize, split: bool) -> Vec<Action> {
    let (p, v, m) = (shape.ranks, shape.stages_per_rank, shape.microbatches);
    let total = m * v;
    let fwd = |k: usize| Action::new((k / p) % v * p + r, Forward, (k / (p * v)) * p + k % p);
    let bwd = |k: usize| {
        let kind = if split { BackwardInput } else { Backward };
        Action::new(
            (v - 1 - (k / p) % v) * p + r,
            kind,
            (k / (p * v)) * p + k % p,
        )
    };
    let warmup = if v == 1 {
        (p - r - 1).min(total)
    } else {
        (2 * (p - r - 1) + (v - 1) * p).min(total)
    };
    let mut list: Vec<Action> = (0..warmup).map(fwd).collect();
    let push_b = |list: &mut Vec<Action>, k: usize| {
        let b = bwd(k);
        list.push(b);
        if split {
            list.push(Action::new(b.stage, BackwardWeight, b.microbatch));
        }
    };
    for i in 0..total - warmup {
        list.push(fwd(warmup + i));
        push_b(&mut list, i);
    }
    for k in total - warmup..total {
        push_b(&mut list, k);
    }
    list
}

/// Zero bubble: moves each rank's `W` actions into the times it would wait. Runs the lists
/// in unit time (`F`, `I`, `W` one unit each, sends and receives free): whenever a rank's
/// next `F` or `I` is not ready, it runs its oldest pending `W` instead; a rank keeps at most
/// `p` `W`s pending (running the oldest at once past that, so memory stays as 1F1B's), and
/// runs the rest at the end. The result is each rank's order as run.
fn fill_bubbles(shape: &PipelineShape, lists: Vec<Vec<Action>>) -> Vec<Vec<Action>> {
    let p = shape.ranks;
    let s = shape.stages();
    let m = shape.microbatches;
    // the F/I order of each rank, W removed
    let queues: Vec<Vec<Action>> = lists
        .into_iter()
        .map(|l| l.into_iter().filter(|a| a.kind != BackwardWeight).collect())
        .collect();
    let mut next = vec![0usize; p];
    let mut pending: Vec<std::collections::VecDeque<Action>> = vec![Default::default(); p];
    let mut out: Vec<Vec<Action>> = vec![Vec::new(); p];
    // completion time of F and I of (stage, micro-batch)
    let mut f_done = vec![vec![None::<usize>; m]; s];
    let mut i_done = vec![vec![None::<usize>; m]; s];
    let limit = 4 * queues.iter().map(Vec::len).sum::<usize>() + 4;
    let mut t = 0usize;
    // (the lists F/I order is the interleaved schedule's, which always progresses; the
    // limit only guards the loop)
    while t < limit {
        let finished = (0..p).all(|r| next[r] == queues[r].len() && pending[r].is_empty());
        if finished {
            break;
        }
        let mut ran: Vec<(Action, usize)> = Vec::new();
        for r in 0..p {
            let ready = |a: &Action| -> bool {
                let at = |x: Option<usize>| x.is_some_and(|d| d <= t);
                match a.kind {
                    Forward => a.stage == 0 || at(f_done[a.stage - 1][a.microbatch]),
                    _ => {
                        at(f_done[a.stage][a.microbatch])
                            && (a.stage + 1 == s || at(i_done[a.stage + 1][a.microbatch]))
                    }
                }
            };
            let head = queues[r].get(next[r]).copied();
            let pick = if pending[r].len() > p {
                pending[r].pop_front()
            } else if let Some(a) = head.filter(|a| ready(a)) {
                next[r] += 1;
                if a.kind == BackwardInput {
                    pending[r].push_back(Action::new(a.stage, BackwardWeight, a.microbatch));
                }
                Some(a)
            } else {
                pending[r].pop_front()
            };
            if let Some(a) = pick {
                out[r].push(a);
                ran.push((a, t + 1));
            }
        }
        for (a, done) in ran {
            match a.kind {
                Forward => f_done[a.stage][a.microbatch] = Some(done),
                BackwardInput => i_done[a.stage][a.microbatch] = Some(done),
                _ => {}
            }
        }
        t += 1;
    }
    out
}

/// Adds the communication to compute lists: after a compute action whose result another
/// rank needs, its send (`SEND_F` after `F` of a stage that is not the last, `SEND_B` after
/// `B`/`I` of a stage that is not the first); before one that needs another rank's result,
/// the receive (`RECV_F`, `RECV_B`). Stages on the same rank (one rank) hand over locally.
pub(crate) fn add_comms(shape: &PipelineShape, lists: Vec<Vec<Action>>) -> Vec<Vec<Action>> {
    let s = shape.stages();
    let rank_of = |stage: usize| shape.rank_of(stage);
    lists
        .into_iter()
        .enumerate()
        .map(|(r, list)| {
            let mut out = Vec::with_capacity(list.len() * 2);
            for a in list {
                let (st, mb) = (a.stage, a.microbatch);
                let backward = matches!(a.kind, Backward | BackwardInput);
                if a.kind == Forward && st > 0 && rank_of(st - 1) != r {
                    out.push(Action::new(st, ActionKind::RecvF, mb));
                }
                if backward && st + 1 < s && rank_of(st + 1) != r {
                    out.push(Action::new(st, ActionKind::RecvB, mb));
                }
                out.push(a);
                if a.kind == Forward && st + 1 < s && rank_of(st + 1) != r {
                    out.push(Action::new(st, ActionKind::SendF, mb));
                }
                if backward && st > 0 && rank_of(st - 1) != r {
                    out.push(Action::new(st, ActionKind::SendB, mb));
                }
            }
            out
        })
        .collect()
}
