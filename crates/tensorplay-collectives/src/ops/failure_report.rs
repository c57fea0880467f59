//! Failure reports: which members a failed collective lost.
//!
//! A rank of a ring or a tree only sees its neighbours. When one host is cut off, the ranks
//! next to it time out first and shut their connections down, so the ranks further away see
//! *those* ranks fail and would blame the wrong ones. So, on a timeout or a peer failure of a
//! group of three or more, every member posts a one-line report to the group's store and
//! waits a short grace (a quarter of the group's timeout, between 0.1 and 1 s: the
//! cascade from the first failure reaches every connected rank within milliseconds) for the
//! others' reports. The members that did not report in that time are the ones lost (dead,
//! cut off, or stuck outside the collective); the error names them, with the first report.
//! A member whose store (served by rank 0) does not answer says so: it is cut off from rank
//! 0, or rank 0 is stopped or lost. Rank 0 stays until every reporter has read the reports,
//! so that its exit does not take them away. Groups of two need none of this: the only peer is already named.
//!
//! Store keys (under the group's prefix): `fail/n` counts the reports, `fail/<k>` holds the
//! k-th as `<global rank>|<first line of its error>`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::Error;
use crate::group::ProcessGroup;
use crate::store::Store;

/// How long a failing member waits for the others' reports (`timeout` is the group's).
pub(crate) fn grace(timeout: Duration) -> Duration {
    (timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// `e` with the group's failure reports added to its detail (see the module's docs); other
/// errors, and errors of groups smaller than three, unchanged.
pub(crate) fn attribute(g: &ProcessGroup, e: Error) -> Error {
    let (Error::Timeout { .. } | Error::PeerFailed { .. }) = &e else {
        return e;
    };
    if g.size() < 3 {
        return e;
    }
    let me = g.my_global_rank();
    let line = e.to_string();
    let line = line.lines().next().unwrap_or("").to_string();
    let grace = grace(g.timeout());
    let reports = exchange(g.store().clone(), me, line, g.size(), grace);
    let note = conclude(
        g.ranks(),
        me,
        reports.as_deref().map_err(String::as_str),
        grace,
    );
    e.with_note(&note)
}

/// Posts this member's report and collects every report posted within `grace` (stopping
/// early once all `size` members reported), on a thread of its own: `Err` when the store
/// failed or did not answer in time (a cut-off host's store calls hang until the store's own
/// timeout).
fn exchange(
    store: Arc<dyn Store>,
    me: usize,
    line: String,
    size: usize,
    grace: Duration,
) -> Result<Vec<(usize, String)>, String> {
    let deadline = Instant::now() + grace;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("tensorplay-failure-report".into())
        .spawn(move || {
            let r = post_and_collect(&*store, me, &line, size, deadline).map_err(|e| e.to_string());
            let _ = tx.send(r);
        })
        .map_err(|e| format!("could not start the report thread: {e}"))?;
    // the store's answers may lag the deadline a little
    rx.recv_timeout(grace + Duration::from_millis(500))
        .map_err(|_| format!("did not answer within {grace:?}"))?
}

/// Posts this member's report, waits until `deadline` (or every member reported), reads the
/// reports. Global rank 0 serves the store: it then stays until every reporter has read them
/// (or a little past the deadline), so that its exit does not take the reports away.
fn post_and_collect(
    store: &dyn Store,
    me: usize,
    line: &str,
    size: usize,
    deadline: Instant,
) -> crate::Result<Vec<(usize, String)>> {
    let k = store.add("fail/n", 1)?;
    store.set(&format!("fail/{k}"), format!("{me}|{line}").as_bytes())?;
    let mut n = k;
    while n < size as i64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        n = store.add("fail/n", 0)?;
    }
    let mut reports = Vec::new();
    for i in 1..=n {
        let key = format!("fail/{i}");
        // a report counted but not written yet is left out
        if !store.check(&[&key])? {
            continue;
        }
        let v = String::from_utf8_lossy(&store.get(&key)?).into_owned();
        if let Some((r, l)) = v.split_once('|')
            && let Ok(r) = r.parse()
        {
            reports.push((r, l.to_string()));
        }
    }
    store.add("fail/read", 1)?;
    if me == 0 {
        let until = deadline + Duration::from_millis(300);
        while store.add("fail/read", 0)? < store.add("fail/n", 0)? && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    Ok(reports)
}

/// The sentence added to the error of member `me` of the group of global `ranks`, given the
/// reports in posting order, or why the store could not give them.
pub(crate) fn conclude(
    ranks: &[usize],
    me: usize,
    reports: Result<&[(usize, String)], &str>,
    grace: Duration,
) -> String {
    let reports = match reports {
        Ok(r) => r,
        Err(why) => {
            return format!(
                "; the group's store (served by rank 0) {why}, so failure reports could not be compared: this rank is cut off from rank 0, or rank 0 is stopped or lost"
            );
        }
    };
    let lost: Vec<usize> = ranks
        .iter()
        .copied()
        .filter(|&r| r != me && !reports.iter().any(|(q, _)| *q == r))
        .collect();
    let first = reports.iter().find(|(r, _)| *r != me);
    // errors that start with their rank ("rank 2: connection to ...") are not named twice
    let first = first.map_or(String::new(), |(r, l)| {
        let l = l.strip_prefix(&format!("rank {r}: ")).unwrap_or(l);
        format!("; the first report: rank {r}: {l}")
    });
    if lost.is_empty() {
        return format!("; every member of the group reported a failure{first}");
    }
    let names: Vec<String> = lost.iter().map(|r| format!("rank {r}")).collect();
    format!(
        "; lost: {} (no failure report within {grace:?}: dead, cut off, or not in this collective){first}",
        names.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    const G: Duration = Duration::from_millis(100);

    #[test]
    fn the_members_that_did_not_report_are_named_as_lost() {
        let reports = vec![
            (2, "all_reduce timed out waiting for rank 1".to_string()),
            (0, "connection to rank 2 failed".to_string()),
        ];
        let s = conclude(&[0, 1, 2], 0, Ok(&reports), G);
        assert!(s.contains("lost: rank 1 (no failure report"), "{s}");
        assert!(
            s.contains("the first report: rank 2: all_reduce timed out"),
            "{s}"
        );
        // a subgroup: only its members count, by global rank
        let reports = vec![(2, "rank 2: connection to rank 1 failed".to_string())];
        let s = conclude(&[0, 1, 2], 0, Ok(&reports), G);
        assert!(
            s.ends_with("; the first report: rank 2: connection to rank 1 failed"),
            "{s}"
        );
        let s = conclude(&[3, 5, 7], 5, Ok(&[(5, "x".into())]), G);
        assert!(s.contains("lost: rank 3, rank 7"), "{s}");
        assert!(!s.contains("first report"), "{s}");
    }

    #[test]
    fn every_member_reporting_names_nobody_and_an_unreachable_store_says_so() {
        let reports = vec![(1, "a".to_string()), (0, "b".into()), (2, "c".into())];
        let s = conclude(&[0, 1, 2], 0, Ok(&reports), G);
        assert_eq!(
            s,
            "; every member of the group reported a failure; the first report: rank 1: a"
        );
        let s = conclude(&[0, 1, 2], 1, Err("did not answer within 100ms"), G);
        assert!(
            s.contains("did not answer") && s.contains("cut off from rank 0"),
            "{s}"
        );
    }

    #[test]
    fn reports_are_exchanged_through_the_store() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        // rank 2 reported first; rank 1 never does
        post_and_collect(
            &*store,
            2,
            "timed out waiting for rank 1",
            3,
            Instant::now(),
        )
        .unwrap();
        let t0 = Instant::now();
        let got = exchange(store.clone(), 0, "peer 2 closed".into(), 3, G).unwrap();
        assert!(t0.elapsed() >= G, "waited the grace for rank 1");
        assert_eq!(
            got,
            vec![
                (2, "timed out waiting for rank 1".to_string()),
                (0, "peer 2 closed".to_string())
            ]
        );
        // once everyone reported, no waiting
        let t0 = Instant::now();
        let got = exchange(store, 1, "late".into(), 3, Duration::from_secs(2)).unwrap();
        assert_eq!(got.len(), 3);
        assert!(t0.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn grace_is_a_quarter_of_the_timeout_within_bounds() {
        assert_eq!(grace(Duration::from_secs(10)), Duration::from_secs(1));
        assert_eq!(grace(Duration::from_secs(2)), Duration::from_millis(500));
        assert_eq!(
            grace(Duration::from_millis(100)),
            Duration::from_millis(100)
        );
        assert_eq!(grace(Duration::from_secs(1800)), Duration::from_secs(1));
    }
}
