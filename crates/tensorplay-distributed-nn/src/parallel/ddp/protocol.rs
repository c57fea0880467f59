//! The per-step handshake of data parallelism, as pure functions: what each rank says at the
//! start of a synced training step, and what every rank concludes from all of them.
//!
//! Every synced training forward (and every round of a rank that has [`join`]ed) begins with
//! one small all-gather of eight integers ([`Hello`]). It costs one round trip and buys: ranks
//! that joined are seen (so the others know whom to expect, and the joined rank knows whether
//! to shadow a step), and ranks stepping different models, configured differently, at
//! different steps, with different buckets or different `no_sync` counts stop before they pair
//! unrelated all-reduces. (A rank whose step failed says so in the flags all-reduce at the end
//! of that step's backward instead: see the reducer.)
//!
//! [`join`]: super::DistributedDataParallel::join

/// A rank that trains this step.
pub(crate) const ACTIVE: i64 = 0;
/// A rank that ran out of data and shadows the others' all-reduces with zeros.
pub(crate) const JOINED: i64 = 1;

/// Bits of a rank's configuration that every rank must share.
pub(crate) mod config {
    /// A communication hook is installed.
    pub(crate) const COMM_HOOK: i64 = 1;
    /// Buffers are broadcast before each synced forward.
    pub(crate) const BROADCAST_BUFFERS: i64 = 2;
    /// `divide_by_initial_world_size`.
    pub(crate) const DIVIDE_BY_INITIAL: i64 = 4;
}

/// What one rank says at a handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    /// Synced steps begun so far.
    pub(crate) step: u64,
    /// [`ACTIVE`] or [`JOINED`].
    pub(crate) status: i64,
    /// The bucket assignment's fingerprint.
    pub(crate) fingerprint: i64,
    /// Steps this rank trained (not shadowed).
    pub(crate) trained: u64,
    /// Ready to rebuild the buckets.
    pub(crate) rebuild: bool,
    /// Which `DistributedDataParallel` (a number all ranks agreed on at construction).
    pub(crate) instance: i64,
    /// The [`config`] bits.
    pub(crate) config: i64,
    /// `no_sync` forwards since the last synced one.
    pub(crate) no_sync: u64,
}

impl Hello {
    /// The descriptor all-gathered.
    pub(crate) fn desc(&self) -> Vec<i64> {
        vec![
            self.step as i64,
            self.status,
            self.fingerprint,
            self.trained as i64,
            i64::from(self.rebuild),
            self.instance,
            self.config,
            self.no_sync as i64,
        ]
    }
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

fn config_text(bits: i64) -> String {
    let mut v = Vec::new();
    if bits & config::COMM_HOOK != 0 {
        v.push("a comm hook");
    }
    if bits & config::BROADCAST_BUFFERS != 0 {
        v.push("broadcast_buffers");
    }
    if bits & config::DIVIDE_BY_INITIAL != 0 {
        v.push("divide_by_initial_world_size");
    }
    if v.is_empty() {
        "none of: a comm hook, broadcast_buffers, divide_by_initial_world_size".into()
    } else {
        v.join(", ")
    }
}

/// The ranks (global) whose element `i` differs from the first rank's.
fn differ(all: &[Vec<i64>], ranks: &[usize], i: usize) -> Vec<usize> {
    all.iter()
        .zip(ranks)
        .filter(|(d, _)| d[i] != all[0][i])
        .map(|(_, &r)| r)
        .collect()
}

/// Reads everyone's descriptors (`all[i]` from the group's rank `i`, `ranks[i]` its global
/// rank). `Err` carries the text of a disagreement that stops the step on every rank.
pub(crate) fn read(all: &[Vec<i64>], ranks: &[usize]) -> Result<Outcome, String> {
    let first = ranks[0];
    let bad = differ(all, ranks, 5);
    if !bad.is_empty() {
        return Err(format!(
            "rank(s) {bad:?} are stepping a different DistributedDataParallel than rank {first}              (are several models on this group stepped in a different order on different              ranks?)"
        ));
    }
    let bad = differ(all, ranks, 6);
    if !bad.is_empty() {
        return Err(format!(
            "rank(s) {bad:?} are configured with {}, rank {first} with {}: every rank must              use the same options and comm hook",
            config_text(all[ranks.iter().position(|r| *r == bad[0]).unwrap_or(0)][6]),
            config_text(all[0][6])
        ));
    }
    if all.iter().any(|d| d[0] != all[0][0]) {
        let steps: Vec<String> = all
            .iter()
            .zip(ranks)
            .map(|(d, r)| format!("rank {r} at step {}", d[0]))
            .collect();
        return Err(format!(
            "the ranks are at different training steps ({}): did a rank run an extra training \
             forward, or wrap its model later than the others?",
            steps.join(", ")
        ));
    }
    let bad = differ(all, ranks, 2);
    if !bad.is_empty() {
        return Err(format!(
            "the gradient buckets of rank(s) {bad:?} differ from rank {first}'s"
        ));
    }
    let active_no_sync: Vec<(usize, i64)> = all
        .iter()
        .zip(ranks)
        .filter(|(d, _)| d[1] == ACTIVE)
        .map(|(d, &r)| (r, d[7]))
        .collect();
    if active_no_sync
        .iter()
        .any(|(_, n)| *n != active_no_sync[0].1)
    {
        let v: Vec<String> = active_no_sync
            .iter()
            .map(|(r, n)| format!("rank {r} ran {n}"))
            .collect();
        return Err(format!(
            "the ranks ran different numbers of no_sync() forwards since the last synced step \
             ({}): every rank must accumulate the same micro-batches",
            v.join(", ")
        ));
    }
    let (mut active, mut joined) = (Vec::new(), Vec::new());
    let (mut authority, mut most) = (first, i64::MIN);
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

    fn hello(step: u64, status: i64, trained: u64, rebuild: bool) -> Vec<i64> {
        Hello {
            step,
            status,
            fingerprint: 9,
            trained,
            rebuild,
            instance: 77,
            config: config::BROADCAST_BUFFERS,
            no_sync: 0,
        }
        .desc()
    }

    #[test]
    fn agreement_and_disagreement() {
        let ranks = [0, 1, 2];
        let ok = read(
            &[
                hello(4, ACTIVE, 4, true),
                hello(4, JOINED, 2, true),
                hello(4, ACTIVE, 4, true),
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
            &[hello(6, JOINED, 3, true), hello(6, JOINED, 5, true)],
            &[0, 1],
        );
        assert_eq!(
            last.map(|o| o.authority),
            Ok(1),
            "the last joiner is the authority"
        );
        let ready = read(
            &[hello(2, ACTIVE, 2, true), hello(2, ACTIVE, 2, true)],
            &[0, 1],
        );
        assert_eq!(ready.map(|o| o.rebuild), Ok(true));
        let one_not = read(
            &[hello(2, ACTIVE, 2, true), hello(2, ACTIVE, 1, false)],
            &[0, 1],
        );
        assert_eq!(
            one_not.map(|o| o.rebuild),
            Ok(false),
            "rebuild only when every rank is ready"
        );
        let steps = read(
            &[
                hello(4, ACTIVE, 0, true),
                hello(4, ACTIVE, 0, true),
                hello(3, ACTIVE, 0, true),
            ],
            &ranks,
        );
        assert!(steps.unwrap_err().contains("rank 2 at step 3"));
        let mut other = hello(4, ACTIVE, 0, true);
        other[2] = 8;
        let m = read(&[hello(4, ACTIVE, 0, true), other], &[3, 5]).unwrap_err();
        assert!(m.contains("[5]") && m.contains("rank 3"), "{m}");
        other = hello(4, ACTIVE, 0, true);
        other[5] = 78;
        let m = read(&[hello(4, ACTIVE, 0, true), other], &[0, 1]).unwrap_err();
        assert!(m.contains("different DistributedDataParallel"), "{m}");
        other = hello(4, ACTIVE, 0, true);
        other[6] |= config::COMM_HOOK;
        let m = read(&[hello(4, ACTIVE, 0, true), other], &[0, 1]).unwrap_err();
        assert!(
            m.contains("rank(s) [1] are configured with a comm hook"),
            "{m}"
        );
        other = hello(4, ACTIVE, 0, true);
        other[7] = 2;
        let m = read(&[hello(4, ACTIVE, 0, true), other.clone()], &[0, 1]).unwrap_err();
        assert!(m.contains("rank 1 ran 2") && m.contains("no_sync"), "{m}");
        // a joined rank runs no forwards: its count does not matter
        other[1] = JOINED;
        assert!(read(&[hello(4, ACTIVE, 0, true), other], &[0, 1]).is_ok());
    }
}
