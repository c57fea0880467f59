//! The per-step handshake of data parallelism, as pure functions: what each rank says at the
//! start of a synced training step, and what every rank concludes from all of them.
//!
//! Every synced training forward (and every round of a rank that has [`join`]ed) begins with
//! one small all-gather of `[step, status, bucket fingerprint, steps trained, rebuild ready]`. It costs one round trip and
//! buys: ranks that joined are seen (so the others know whom to expect, and the joined rank
//! knows whether to shadow a step), a rank that broke the protocol tells the others instead of
//! leaving them to time out, and ranks at different steps or with different bucket layouts stop
//! before they pair unrelated all-reduces.
//!
//! [`join`]: super::DistributedDataParallel::join

/// A rank that trains this step.
pub(crate) const ACTIVE: i64 = 0;
/// A rank that ran out of data and shadows the others' all-reduces with zeros.
pub(crate) const JOINED: i64 = 1;
/// A rank whose previous training forward had no backward (a skipped backward, or two
/// forwards before one backward).
pub(crate) const NO_BACKWARD: i64 = 2;
/// A rank whose previous backward started but did not finish its reduction (it failed).
pub(crate) const UNFINISHED: i64 = 3;

/// What one rank says: its step, status, bucket fingerprint, how many steps it trained (not
/// shadowed), and whether it is ready to rebuild its buckets.
pub(crate) fn desc(
    step: u64,
    status: i64,
    fingerprint: i64,
    trained: u64,
    rebuild: bool,
) -> Vec<i64> {
    vec![
        step as i64,
        status,
        fingerprint,
        trained as i64,
        i64::from(rebuild),
    ]
}

/// What every rank learns from the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Outcome {
    /// Global ranks that train this step.
    pub(crate) active: Vec<usize>,
    /// Global ranks that have joined.
    pub(crate) joined: Vec<usize>,
    /// The rank that trained the most steps (the lowest such): the last to join, whose model
    /// every rank takes when all have joined.
    pub(crate) authority: usize,
    /// Every rank trains and is ready to rebuild its buckets: they all do it now.
    pub(crate) rebuild: bool,
}

/// A handshake that must stop the step on every rank: the text names the ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stop {
    /// These ranks broke the protocol (`(rank, status)`); this rank may be one of them.
    Misuse(Vec<(usize, i64)>),
    /// The ranks disagree on the step or the bucket layout.
    Disagree(String),
}

/// What `status` means, for messages.
pub(crate) fn describe(status: i64) -> &'static str {
    match status {
        NO_BACKWARD => {
            "started a training forward before running backward on its previous one (a skipped \
             backward, or two forwards before one backward)"
        }
        UNFINISHED => "started a training forward after a backward that failed",
        JOINED => "has joined (ran out of data)",
        _ => "is training",
    }
}

/// Reads everyone's descriptors (`all[i]` from the group's rank `i`, `ranks[i]` its global
/// rank).
pub(crate) fn read(all: &[Vec<i64>], ranks: &[usize]) -> Result<Outcome, Stop> {
    let bad: Vec<(usize, i64)> = all
        .iter()
        .zip(ranks)
        .filter(|(d, _)| d[1] >= NO_BACKWARD)
        .map(|(d, &r)| (r, d[1]))
        .collect();
    if !bad.is_empty() {
        return Err(Stop::Misuse(bad));
    }
    if all.iter().any(|d| d[0] != all[0][0]) {
        let steps: Vec<String> = all
            .iter()
            .zip(ranks)
            .map(|(d, r)| format!("rank {r} at step {}", d[0]))
            .collect();
        return Err(Stop::Disagree(format!(
            "the ranks are at different training steps ({}): did a rank run an extra training \
             forward, or wrap its model later than the others?",
            steps.join(", ")
        )));
    }
    if all.iter().any(|d| d[2] != all[0][2]) {
        let differ: Vec<usize> = all
            .iter()
            .zip(ranks)
            .filter(|(d, _)| d[2] != all[0][2])
            .map(|(_, &r)| r)
            .collect();
        return Err(Stop::Disagree(format!(
            "the gradient buckets of rank(s) {differ:?} differ from rank {}'s",
            ranks[0]
        )));
    }
    let (mut active, mut joined) = (Vec::new(), Vec::new());
    let (mut authority, mut most) = (ranks[0], i64::MIN);
    for (d, &r) in all.iter().zip(ranks) {
        if d[1] == JOINED {
            joined.push(r);
        } else {
            active.push(r);
        }
        if d[3] > most {
            (authority, most) = (r, d[3]);
        }
    }
    let rebuild = joined.is_empty() && all.iter().all(|d| d[4] == 1);
    Ok(Outcome {
        active,
        joined,
        authority,
        rebuild,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agreement_misuse_and_disagreement() {
        let ranks = [0, 1, 2];
        let ok = read(
            &[
                desc(4, ACTIVE, 9, 4, true),
                desc(4, JOINED, 9, 2, true),
                desc(4, ACTIVE, 9, 4, true),
            ],
            &ranks,
        );
        assert_eq!(
            ok,
            Ok(Outcome {
                active: vec![0, 2],
                joined: vec![1],
                authority: 0,
                rebuild: false,
            })
        );
        let last = read(
            &[desc(6, JOINED, 9, 3, true), desc(6, JOINED, 9, 5, true)],
            &[0, 1],
        );
        assert_eq!(
            last.map(|o| o.authority),
            Ok(1),
            "the last joiner is the authority"
        );
        let all_ready = read(
            &[desc(2, ACTIVE, 9, 2, true), desc(2, ACTIVE, 9, 2, true)],
            &[0, 1],
        );
        assert_eq!(all_ready.map(|o| o.rebuild), Ok(true));
        let one_not = read(
            &[desc(2, ACTIVE, 9, 2, true), desc(2, ACTIVE, 9, 1, false)],
            &[0, 1],
        );
        assert_eq!(
            one_not.map(|o| o.rebuild),
            Ok(false),
            "rebuild only when every rank is ready"
        );
        let misuse = read(
            &[
                desc(4, ACTIVE, 9, 0, true),
                desc(4, NO_BACKWARD, 9, 0, true),
                desc(3, ACTIVE, 9, 0, true),
            ],
            &ranks,
        );
        assert_eq!(
            misuse,
            Err(Stop::Misuse(vec![(1, NO_BACKWARD)])),
            "misuse wins"
        );
        match read(
            &[
                desc(4, ACTIVE, 9, 0, true),
                desc(4, ACTIVE, 9, 0, true),
                desc(3, ACTIVE, 9, 0, true),
            ],
            &ranks,
        ) {
            Err(Stop::Disagree(m)) => assert!(m.contains("rank 2 at step 3"), "{m}"),
            other => panic!("{other:?}"),
        }
        match read(
            &[desc(4, ACTIVE, 9, 0, true), desc(4, ACTIVE, 8, 0, true)],
            &[3, 5],
        ) {
            Err(Stop::Disagree(m)) => assert!(m.contains("[5]") && m.contains("rank 3"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
