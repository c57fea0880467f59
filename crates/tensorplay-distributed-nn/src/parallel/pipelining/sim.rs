//! The schedule simulator: runs every rank's action list in simulated time before anything
//! runs for real. It checks that each list is complete (every stage's forward and backward
//! of every micro-batch, with the sends and receives between ranks), that every action comes
//! after what it needs, that the messages between two ranks are received in the order they
//! are sent, and that no rank waits forever; and it measures the step's bubble and the
//! micro-batches in flight.
//!
//! Semantics (those of the executor): a rank runs its list in order; compute actions take
//! their [`Costs`] and never wait (what they need must already be on the rank); sends are
//! non-blocking; a receive waits for its message.

use std::collections::{HashMap, HashSet};

use super::schedule::{Action, ActionKind, PipelineShape, ScheduleError};
use ActionKind::{Backward, BackwardInput, BackwardWeight, Forward, RecvB, RecvF, SendB, SendF};

/// The simulated time of each compute action (any unit). A full backward (`B`) costs
/// `backward_input + backward_weight`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Costs {
    /// A forward (`F`).
    pub forward: f64,
    /// An input-gradient backward (`I`).
    pub backward_input: f64,
    /// A weight-gradient backward (`W`).
    pub backward_weight: f64,
}

impl Default for Costs {
    /// One unit each: a forward 1, a full backward 2 (the usual ratio).
    fn default() -> Costs {
        Costs {
            forward: 1.0,
            backward_input: 1.0,
            backward_weight: 1.0,
        }
    }
}

/// What a simulated step did.
#[derive(Debug, Clone, PartialEq)]
pub struct SimReport {
    /// The step's length: when the last rank finishes.
    pub makespan: f64,
    /// Per rank: time spent computing.
    pub busy: Vec<f64>,
    /// The bubble: per rank `1 - busy / makespan`, averaged over ranks.
    pub bubble: f64,
    /// Per rank: the most micro-batches (of any of its stages) whose forward had run and whose
    /// backward (`B` or `I`) had not, at once: the activations it holds at its peak.
    pub peak_in_flight: Vec<usize>,
    /// Per rank: each compute action with its start time, in order.
    pub timeline: Vec<Vec<(f64, Action)>>,
}

impl SimReport {
    /// The timeline drawn in text, one line per rank and one cell per unit of time (costs of
    /// whole units): `F3` a forward of micro-batch 3 (`F3 B3` style cells; a backward of two
    /// units fills two cells), `.` idle; with several stages per rank, a cell is prefixed
    /// with the stage (`2F3`).
    pub fn draw(&self, costs: &Costs) -> String {
        // several stages per rank: some stage index is not a rank's
        let ranks = self.timeline.len();
        let multi = self
            .timeline
            .iter()
            .flatten()
            .any(|(_, a)| a.stage >= ranks);
        let cell = |a: &Action| {
            let code = match a.kind {
                Forward => "F",
                Backward => "B",
                BackwardInput => "I",
                _ => "W",
            };
            if multi {
                format!("{}{code}{}", a.stage, a.microbatch)
            } else {
                format!("{code}{}", a.microbatch)
            }
        };
        // one cell per unit of time: a timeline too long to read is not drawn
        const MAX_CELLS: f64 = 10_000.0;
        if self.makespan.is_nan() || self.makespan > MAX_CELLS {
            return format!(
                "(a step of {} units: too long to draw in cells)\n",
                self.makespan
            );
        }
        let units = self.makespan.round() as usize;
        let width = self
            .timeline
            .iter()
            .flatten()
            .map(|(_, a)| cell(a).len())
            .max()
            .unwrap_or(2);
        let mut out = String::new();
        for (r, line) in self.timeline.iter().enumerate() {
            let mut cells = vec![".".to_string(); units];
            for (t, a) in line {
                let len = match a.kind {
                    Forward => costs.forward,
                    Backward => costs.backward_input + costs.backward_weight,
                    BackwardInput => costs.backward_input,
                    _ => costs.backward_weight,
                }
                .round() as usize;
                for u in 0..len {
                    if let Some(c) = cells.get_mut(t.round() as usize + u) {
                        *c = cell(a);
                    }
                }
            }
            let row: Vec<String> = cells.iter().map(|c| format!("{c:<width$}")).collect();
            out.push_str(&format!("rank {r}: {}\n", row.join(" ").trim_end()));
        }
        out
    }
}

type Key = (usize, ActionKind, usize);

fn key(a: &Action) -> Key {
    (a.stage, a.kind, a.microbatch)
}

/// Checks and runs `lists` (`lists[r]` is rank `r`'s) on `shape` with `costs`.
///
/// # Errors
/// [`ScheduleError`]: a list for another number of ranks or an action outside the shape
/// (`Misplaced`), a missing or repeated action (`Incomplete`), an action before what it
/// needs (`Dependency`), messages received out of their sending order (`Order`), a deadlock.
pub fn simulate(
    shape: &PipelineShape,
    lists: &[Vec<Action>],
    costs: &Costs,
) -> Result<SimReport, ScheduleError> {
    let pairs = shape
        .ranks
        .checked_mul(shape.stages_per_rank)
        .and_then(|s| s.checked_mul(shape.microbatches));
    if shape.ranks == 0 || pairs.is_none_or(|n| n > super::schedule::MAX_ACTIONS) {
        return Err(ScheduleError::Incomplete {
            detail: format!(
                "a shape of {} ranks x {} stages per rank x {} micro-batches: at least one rank \
                 and at most {} (stage, micro-batch) pairs",
                shape.ranks,
                shape.stages_per_rank,
                shape.microbatches,
                super::schedule::MAX_ACTIONS
            ),
        });
    }
    for (name, c) in [
        ("forward", costs.forward),
        ("backward_input", costs.backward_input),
        ("backward_weight", costs.backward_weight),
    ] {
        if !c.is_finite() || c < 0.0 {
            return Err(ScheduleError::Incomplete {
                detail: format!("costs.{name} must be a finite time >= 0, got {c}"),
            });
        }
    }
    check_complete(shape, lists)?;
    let p = shape.ranks;
    let s = shape.stages();
    let mut pos = vec![0usize; p];
    let mut clock = vec![0.0f64; p];
    let mut busy = vec![0.0f64; p];
    let mut in_flight = vec![0usize; p];
    let mut peak = vec![0usize; p];
    let mut timeline: Vec<Vec<(f64, Action)>> = vec![Vec::new(); p];
    let mut done: HashSet<Key> = HashSet::new();
    let mut sends: HashMap<(usize, usize), Vec<(Action, f64)>> = HashMap::new();
    let mut received: HashMap<(usize, usize), usize> = HashMap::new();
    let backward_done = |done: &HashSet<Key>, st: usize, mb: usize| {
        done.contains(&(st, Backward, mb)) || done.contains(&(st, BackwardInput, mb))
    };
    loop {
        let mut progress = false;
        for r in 0..p {
            while let Some(a) = lists[r].get(pos[r]).copied() {
                let dep = |needs: String| ScheduleError::Dependency {
                    rank: r,
                    index: pos[r],
                    action: a.to_string(),
                    needs,
                };
                let (st, mb) = (a.stage, a.microbatch);
                let mut cost = 0.0;
                match a.kind {
                    Forward => {
                        if st > 0 {
                            let (k, what) = if shape.rank_of(st - 1) == r {
                                ((st - 1, Forward, mb), "on this rank")
                            } else {
                                ((st, RecvF, mb), "(its input)")
                            };
                            if !done.contains(&k) {
                                let n = Action::new(k.0, k.1, k.2);
                                return Err(dep(format!("{n} {what}")));
                            }
                        }
                        cost = costs.forward;
                        in_flight[r] += 1;
                        peak[r] = peak[r].max(in_flight[r]);
                    }
                    Backward | BackwardInput => {
                        if !done.contains(&(st, Forward, mb)) {
                            return Err(dep(format!(
                                "its forward {}",
                                Action::new(st, Forward, mb)
                            )));
                        }
                        if st + 1 < s {
                            if shape.rank_of(st + 1) == r {
                                if !backward_done(&done, st + 1, mb) {
                                    return Err(dep(format!(
                                        "the backward of stage {} micro-batch {mb} on this rank",
                                        st + 1
                                    )));
                                }
                            } else if !done.contains(&(st, RecvB, mb)) {
                                return Err(dep(format!(
                                    "{} (its output's gradient)",
                                    Action::new(st, RecvB, mb)
                                )));
                            }
                        }
                        cost = costs.backward_input;
                        if a.kind == Backward {
                            cost += costs.backward_weight;
                        }
                        in_flight[r] -= 1;
                    }
                    BackwardWeight => {
                        if !done.contains(&(st, BackwardInput, mb)) {
                            return Err(dep(format!("its {}", Action::new(st, BackwardInput, mb))));
                        }
                        cost = costs.backward_weight;
                    }
                    SendF | SendB => {
                        let (src_done, peer) = if a.kind == SendF {
                            (done.contains(&(st, Forward, mb)), shape.rank_of(st + 1))
                        } else {
                            (backward_done(&done, st, mb), shape.rank_of(st - 1))
                        };
                        if !src_done {
                            let what = if a.kind == SendF {
                                "its forward"
                            } else {
                                "its backward"
                            };
                            return Err(dep(format!("{what} of stage {st} micro-batch {mb}")));
                        }
                        sends.entry((r, peer)).or_default().push((a, clock[r]));
                    }
                    RecvF | RecvB => {
                        let (peer, expect) = if a.kind == RecvF {
                            (shape.rank_of(st - 1), Action::new(st - 1, SendF, mb))
                        } else {
                            (shape.rank_of(st + 1), Action::new(st + 1, SendB, mb))
                        };
                        let n = received.get(&(peer, r)).copied().unwrap_or(0);
                        let Some(&(sent, at)) = sends.get(&(peer, r)).and_then(|v| v.get(n)) else {
                            break; // blocked: the message is not sent yet
                        };
                        if sent != expect {
                            return Err(ScheduleError::Order {
                                src: peer,
                                dst: r,
                                nth: n,
                                recv: a.to_string(),
                                sent: sent.to_string(),
                            });
                        }
                        received.insert((peer, r), n + 1);
                        clock[r] = clock[r].max(at);
                    }
                }
                if a.kind.is_compute() {
                    timeline[r].push((clock[r], a));
                }
                clock[r] += cost;
                busy[r] += cost;
                done.insert(key(&a));
                pos[r] += 1;
                progress = true;
            }
        }
        if !progress {
            break;
        }
    }
    let blocked: Vec<String> = (0..p)
        .filter(|&r| pos[r] < lists[r].len())
        .map(|r| {
            let a = lists[r][pos[r]];
            let (peer, send) = match a.kind {
                RecvF => (
                    shape.rank_of(a.stage - 1),
                    Action::new(a.stage - 1, SendF, a.microbatch),
                ),
                _ => (
                    shape.rank_of(a.stage + 1),
                    Action::new(a.stage + 1, SendB, a.microbatch),
                ),
            };
            let at = match lists[peer].get(pos[peer]) {
                Some(b) => format!("at action {} ({b})", pos[peer]),
                None => "finished".to_string(),
            };
            format!(
                "rank {r} waits at action {} ({a}) for rank {peer}'s {send}, and rank {peer} is \
                 {at}",
                pos[r]
            )
        })
        .collect();
    if !blocked.is_empty() {
        return Err(ScheduleError::Deadlock {
            waits: blocked.join("; "),
        });
    }
    let makespan = clock.iter().copied().fold(0.0, f64::max);
    let bubble = if makespan > 0.0 {
        busy.iter().map(|b| 1.0 - b / makespan).sum::<f64>() / p as f64
    } else {
        0.0
    };
    Ok(SimReport {
        makespan,
        busy,
        bubble,
        peak_in_flight: peak,
        timeline,
    })
}

/// Every action within the shape and on its stage's rank; every needed action present once.
fn check_complete(shape: &PipelineShape, lists: &[Vec<Action>]) -> Result<(), ScheduleError> {
    let (p, s, m) = (shape.ranks, shape.stages(), shape.microbatches);
    if lists.len() != p {
        return Err(ScheduleError::Incomplete {
            detail: format!("{} action lists for a pipeline of {p} ranks", lists.len()),
        });
    }
    let mut seen: HashMap<Key, usize> = HashMap::new();
    for (r, list) in lists.iter().enumerate() {
        for (i, a) in list.iter().enumerate() {
            let bad = |detail: String| ScheduleError::Misplaced {
                rank: r,
                index: i,
                action: a.to_string(),
                detail,
            };
            if a.stage >= s {
                return Err(bad(format!("the pipeline has {s} stages")));
            }
            if shape.rank_of(a.stage) != r {
                return Err(bad(format!(
                    "stage {} runs on rank {}",
                    a.stage,
                    shape.rank_of(a.stage)
                )));
            }
            if a.microbatch >= m {
                return Err(bad(format!("the step has {m} micro-batches")));
            }
            if !a.kind.is_compute() && !needs_comm(shape, a.stage, a.kind) {
                return Err(bad("no message crosses ranks there".into()));
            }
            if seen.insert(key(a), r).is_some() {
                return Err(ScheduleError::Incomplete {
                    detail: format!("rank {r}: {a} appears twice"),
                });
            }
        }
    }
    let missing = |a: Action| ScheduleError::Incomplete {
        detail: format!("rank {} lacks {a}", shape.rank_of(a.stage)),
    };
    for st in 0..s {
        for mb in 0..m {
            let has = |k: ActionKind| seen.contains_key(&(st, k, mb));
            if !has(Forward) {
                return Err(missing(Action::new(st, Forward, mb)));
            }
            match (has(Backward), has(BackwardInput), has(BackwardWeight)) {
                (true, false, false) | (false, true, true) => {}
                (false, false, false) => return Err(missing(Action::new(st, Backward, mb))),
                (false, true, false) => return Err(missing(Action::new(st, BackwardWeight, mb))),
                (false, false, true) => return Err(missing(Action::new(st, BackwardInput, mb))),
                _ => {
                    return Err(ScheduleError::Incomplete {
                        detail: format!(
                            "rank {}: stage {st} micro-batch {mb} has both a full backward (B) \
                             and a split one (I/W)",
                            shape.rank_of(st)
                        ),
                    });
                }
            }
            for k in [SendF, RecvF, SendB, RecvB] {
                if needs_comm(shape, st, k) && !has(k) {
                    return Err(missing(Action::new(st, k, mb)));
                }
            }
        }
    }
    Ok(())
}

/// Whether stage `stage` sends or receives a message of kind `k` (its neighbour on another
/// rank).
fn needs_comm(shape: &PipelineShape, stage: usize, k: ActionKind) -> bool {
    let s = shape.stages();
    let r = shape.rank_of(stage);
    match k {
        SendF | RecvB => stage + 1 < s && shape.rank_of(stage + 1) != r,
        RecvF | SendB => stage > 0 && shape.rank_of(stage - 1) != r,
        _ => false,
    }
}
