//! Who failed first: the root cause of a failed job among the ranks that ended, for `spawn`
//! and `tensorplay-run`. Pure logic over what the parent saw (no processes, no clock), tested
//! in memory.
//!
//! When one rank dies, the others fail a moment later with errors about it (a closed
//! connection, an unreachable worker, a timeout); a parent that reports the first failure it
//! happens to look at blames a survivor. The rules, in order:
//!
//! 1. A rank that ended before the parent stopped the job beats one the parent stopped.
//! 2. A rank that ended on its own account (killed by a signal, a panic, an error of its own)
//!    beats one whose last message is a consequence of another rank's failure
//!    ([`is_consequence`]).
//! 3. Then the earliest exit, then the lowest rank.
//!
//! The other ranks that failed are sorted in two lists: **consequences**, whose last message
//! reports another rank's failure ([`is_consequence`]: a lost peer, a timeout waiting for
//! others, an unreachable worker) or which ended after the parent began stopping the job; and
//! **own failures**, which failed on their own account (killed by a signal the parent did not
//! send, a panic, an error of their own): two ranks that each return an error of their own are
//! the root and an own failure, never a cause and its consequence.
//!
//! When even the root's message is a consequence that names another rank ("rank 2 never
//! reached this call", "connection to rank 2 failed"), that rank is the likely culprit even
//! though it did not fail: it exited with code 0 while the others still expected it in a
//! collective, or it was still running (stuck, or it skipped a collective) when the others
//! timed out waiting for it. [`implicated`] says so.

use std::time::Duration;

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Exited with this code.
    Code(i32),
    /// Killed by this signal.
    Signal(i32),
}

impl Ended {
    /// Whether this is a successful exit (code 0).
    pub fn success(self) -> bool {
        self == Ended::Code(0)
    }
}

/// What the parent saw of one rank that ended.
#[derive(Debug, Clone)]
pub struct Exit {
    /// The rank.
    pub rank: usize,
    /// When the parent saw it end, since the job started.
    pub at: Duration,
    /// How it ended.
    pub how: Ended,
    /// Its failure message (the spawn marker line) or its last output lines.
    pub message: String,
    /// Whether it ended after the parent began stopping the job (it was told to stop).
    pub stopped: bool,
}

/// The verdict over a failed job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The rank that failed first in its own right.
    pub root: usize,
    /// The other ranks whose failure is a consequence of another's (their message reports a
    /// lost or awaited peer, or the parent stopped them), in the order they ended.
    pub consequences: Vec<usize>,
    /// The other ranks that failed on their own account (a signal the parent did not send, a
    /// panic, an error of their own), in the order they ended.
    pub own_failures: Vec<usize>,
}

/// A rank that did not fail but that the root's message blames.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Implicated {
    /// The rank named by the root's message.
    pub rank: usize,
    /// What happened to it.
    pub why: Why,
    /// The rank whose message names it (the verdict's root).
    pub named_by: usize,
}

/// How an [`Implicated`] rank went wrong without failing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// It exited with code 0 before the rank that names it failed.
    ExitedEarly,
    /// It was still running when the job was stopped.
    StillRunning,
}

/// The rank the root's consequence message names, when that rank did not fail itself: it
/// exited successfully before the root ended, or it is in `still_running` (the ranks the
/// parent had to stop).
pub fn implicated(
    exits: &[Exit],
    verdict: &Verdict,
    still_running: &[usize],
) -> Option<Implicated> {
    let root = exits.iter().find(|e| e.rank == verdict.root)?;
    if matches!(root.how, Ended::Signal(_)) || !is_consequence(&root.message) {
        return None;
    }
    let peer = named_peer(&root.message).filter(|&p| p != root.rank)?;
    if still_running.contains(&peer) {
        return Some(Implicated {
            rank: peer,
            why: Why::StillRunning,
            named_by: root.rank,
        });
    }
    let e = exits.iter().find(|e| e.rank == peer)?;
    (e.how.success() && e.at <= root.at).then_some(Implicated {
        rank: peer,
        why: Why::ExitedEarly,
        named_by: root.rank,
    })
}

/// The first rank a consequence message names as the one it waited for or lost.
fn named_peer(message: &str) -> Option<usize> {
    const BEFORE: &[&str] = &["connection to rank ", "(did rank ", "waiting for rank "];
    const AFTER: &[&str] = &[" never reached", " never called", " did not "];
    let number = |s: &str| -> Option<usize> {
        let d: String = s.chars().take_while(char::is_ascii_digit).collect();
        d.parse().ok()
    };
    for b in BEFORE {
        if let Some(r) = message
            .find(b)
            .and_then(|i| number(&message[i + b.len()..]))
        {
            return Some(r);
        }
    }
    for a in AFTER {
        if let Some(i) = message.find(a) {
            let head = &message[..i];
            let digits: String = head
                .chars()
                .rev()
                .take_while(char::is_ascii_digit)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            if !digits.is_empty() && head[..head.len() - digits.len()].ends_with("rank ") {
                return digits.parse().ok();
            }
        }
    }
    None
}

/// Whether `message` reports another rank's failure rather than one of this rank's own: a
/// connection to a peer that failed, an unreachable RPC worker, a timeout waiting for
/// others, a store whose host left, a pipeline stage stopped by another's failure.
pub fn is_consequence(message: &str) -> bool {
    const SIGNS: &[&str] = &[
        "connection to rank",
        "is unreachable during",
        "timed out after",
        "ran for more than its timeout",
        "the store host",
        "store: connection",
        "store: the store server",
        "(did rank",
        "rejected their own arguments",
        // a store whose host (the first rank) exited while this rank used it
        "the server closed the connection",
        // a pipeline stage that stopped because another stage failed
        ") stopped at action ",
    ];
    SIGNS.iter().any(|s| message.contains(s))
}

/// Whether `e`'s own exit reads as a failure of its own: killed by a signal, or a message that
/// is not a consequence of another rank's failure ([`is_consequence`]).
fn own_account(e: &Exit) -> bool {
    matches!(e.how, Ended::Signal(_)) || !is_consequence(&e.message)
}

/// Whether `e` failed on its own account ([`own_account`]); a rank the parent stopped never
/// is.
fn on_its_own(e: &Exit) -> bool {
    !e.stopped && own_account(e)
}

/// How `spawn` and `tensorplay-run` label the list of `n` [`Verdict::own_failures`]: "also
/// failed on its own" (one rank) or "also failed, each on its own".
pub fn own_failures_label(n: usize) -> &'static str {
    if n == 1 {
        "also failed on its own"
    } else {
        "also failed, each on its own"
    }
}

/// The root cause, the consequences and the other own failures among `exits` (the ranks that
/// ended so far); `None` when none failed.
pub fn root_cause(exits: &[Exit]) -> Option<Verdict> {
    let mut failed: Vec<&Exit> = exits.iter().filter(|e| !e.how.success()).collect();
    if failed.is_empty() {
        return None;
    }
    let key = |e: &Exit| (e.stopped, !own_account(e), e.at, e.rank);
    let root = failed.iter().min_by_key(|e| key(e)).map(|e| e.rank)?;
    failed.sort_by_key(|e| (e.at, e.rank));
    let (own, consequences): (Vec<&Exit>, Vec<&Exit>) = failed
        .into_iter()
        .filter(|e| e.rank != root)
        .partition(|e| on_its_own(e));
    Some(Verdict {
        root,
        consequences: consequences.iter().map(|e| e.rank).collect(),
        own_failures: own.iter().map(|e| e.rank).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exit(rank: usize, ms: u64, how: Ended, message: &str) -> Exit {
        Exit {
            rank,
            at: Duration::from_millis(ms),
            how,
            message: message.into(),
            stopped: false,
        }
    }

    const PEER: &str = "rank 0: connection to rank 2 failed during all_reduce: closed";

    #[test]
    fn a_killed_rank_beats_the_survivors_that_report_it() {
        // the survivors are seen first (same poll pass, lower ranks)
        let v = root_cause(&[
            exit(0, 10, Ended::Code(1), PEER),
            exit(1, 10, Ended::Code(1), PEER),
            exit(2, 10, Ended::Signal(9), ""),
        ])
        .unwrap();
        assert_eq!(
            v,
            Verdict {
                root: 2,
                consequences: vec![0, 1],
                own_failures: vec![],
            }
        );
    }

    #[test]
    fn an_own_error_beats_a_consequence_seen_earlier() {
        let v = root_cause(&[
            exit(0, 5, Ended::Code(1), PEER),
            exit(1, 7, Ended::Code(1), "invalid argument `src`"),
        ])
        .unwrap();
        assert_eq!(v.root, 1);
    }

    #[test]
    fn stopped_ranks_and_successes_are_never_the_root() {
        let mut stopped = exit(0, 1, Ended::Signal(15), "");
        stopped.stopped = true;
        let v = root_cause(&[
            stopped,
            exit(1, 3, Ended::Code(0), ""),
            exit(2, 9, Ended::Code(1), PEER),
        ])
        .unwrap();
        assert_eq!(
            v,
            Verdict {
                root: 2,
                consequences: vec![0],
                own_failures: vec![],
            }
        );
        assert_eq!(root_cause(&[exit(0, 1, Ended::Code(0), "")]), None);
    }

    #[test]
    fn among_equals_the_earliest_then_the_lowest_rank() {
        let v = root_cause(&[
            exit(3, 4, Ended::Code(2), "x"),
            exit(1, 4, Ended::Code(2), "y"),
            exit(0, 6, Ended::Code(2), "z"),
        ])
        .unwrap();
        assert_eq!(v.root, 1);
        assert_eq!(v.own_failures, vec![3, 0]);
        assert!(v.consequences.is_empty());
    }

    /// Each case: the exits, then the expected (root, consequences, own failures).
    #[test]
    fn own_failures_are_not_consequences() {
        let mut stopped_by_parent = exit(3, 20, Ended::Signal(15), "");
        stopped_by_parent.stopped = true;
        type Case = (&'static str, Vec<Exit>, (usize, Vec<usize>, Vec<usize>));
        let cases: Vec<Case> = vec![
            (
                "two ranks, each with an error of its own: the first is the root",
                vec![
                    exit(1, 5, Ended::Code(1), "rank one's own error"),
                    exit(0, 9, Ended::Code(1), "rank zero's own error"),
                ],
                (1, vec![], vec![0]),
            ),
            (
                "a panic, an own error, a lost peer and a rank the parent stopped",
                vec![
                    exit(2, 4, Ended::Code(101), "panicked at src/main.rs:3:5: boom"),
                    exit(0, 6, Ended::Code(1), PEER),
                    exit(1, 7, Ended::Code(1), "invalid argument `src`"),
                    stopped_by_parent.clone(),
                ],
                (2, vec![0, 3], vec![1]),
            ),
            (
                "a signal the parent did not send is an own failure",
                vec![
                    exit(0, 4, Ended::Code(1), "bad input"),
                    exit(1, 5, Ended::Signal(11), ""),
                ],
                (0, vec![], vec![1]),
            ),
        ];
        for (name, exits, (root, consequences, own)) in cases {
            let v = root_cause(&exits).unwrap_or_else(|| panic!("{name}: no verdict"));
            assert_eq!(
                (v.root, &v.consequences, &v.own_failures),
                (root, &consequences, &own),
                "{name}"
            );
        }
    }

    #[test]
    fn a_rank_that_others_wait_for_is_implicated() {
        let timeout = "all_reduce timed out after 3s on rank 1: rank 2 never reached this call";
        let exits = [
            exit(1, 3000, Ended::Code(1), timeout),
            exit(0, 3001, Ended::Code(1), timeout),
        ];
        let v = root_cause(&exits).unwrap();
        assert_eq!(
            implicated(&exits, &v, &[2]),
            Some(Implicated {
                rank: 2,
                why: Why::StillRunning,
                named_by: v.root
            })
        );
        // exited with code 0 first: the others lost their connection to it
        let exits = [
            exit(2, 5, Ended::Code(0), ""),
            exit(0, 9, Ended::Code(1), PEER),
        ];
        let v = root_cause(&exits).unwrap();
        assert_eq!(
            implicated(&exits, &v, &[]).map(|i| (i.rank, i.why)),
            Some((2, Why::ExitedEarly))
        );
        // a killed root, or an own error, implicates no one
        let exits = [
            exit(2, 5, Ended::Signal(9), ""),
            exit(0, 9, Ended::Code(1), PEER),
        ];
        let v = root_cause(&exits).unwrap();
        assert_eq!(implicated(&exits, &v, &[1]), None);
        assert_eq!(named_peer("rank 12 never reached it"), Some(12));
        assert_eq!(named_peer("connection to rank 3 failed"), Some(3));
        assert_eq!(named_peer("panicked"), None);
    }

    #[test]
    fn consequence_texts() {
        assert!(is_consequence(PEER));
        assert!(is_consequence(
            "worker worker1 is unreachable during rpc_sync: reset"
        ));
        assert!(is_consequence(
            "all_reduce timed out after 5s on rank 1: waiting for rank 2"
        ));
        assert!(is_consequence(
            "broadcast: ranks disagree: rank(s) [1] rejected their own arguments: rank 1: src"
        ));
        assert!(is_consequence(
            "store: set on the store server at 127.0.0.1:22955: the server closed the \
             connection (is it still running?)"
        ));
        assert!(is_consequence(
            "pipeline stage 0 (rank 0) stopped at action 0RECV_B0: stage 1 (rank 1) failed: \
             boom"
        ));
        assert!(!is_consequence("panicked: boom"));
        assert!(!is_consequence(
            "broadcast on rank 1: invalid argument `src`: expected a rank"
        ));
    }
}
