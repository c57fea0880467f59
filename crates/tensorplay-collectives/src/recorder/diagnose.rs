//! Reading the dumps of a job and saying what went wrong: per group, the earliest operation
//! that did not finish everywhere, which ranks wait in it, and which rank is behind (it never
//! called it), in a different operation, or failed, with call sites. Pure: tested in memory.

use std::collections::BTreeMap;
use std::path::Path;

use super::dump::{Dump, GroupDump};
use super::{Entry, State};

/// The diagnosis of a job's dumps: one paragraph per group that has an unfinished or failed
/// operation.
#[derive(Debug, Clone, Default)]
pub struct Diagnosis {
    /// The lines to print.
    pub lines: Vec<String>,
}

impl std::fmt::Display for Diagnosis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for l in &self.lines {
            writeln!(f, "{l}")?;
        }
        Ok(())
    }
}

/// Reads every `rank*.json` dump in `dir`.
///
/// # Errors
/// The folder cannot be read, or holds no dump (each unreadable file is skipped with a note
/// in the diagnosis instead).
pub fn read_dumps(dir: &Path) -> Result<(Vec<Dump>, Vec<String>), String> {
    let rd = std::fs::read_dir(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    let (mut dumps, mut notes) = (Vec::new(), Vec::new());
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let is_dump = name
            .strip_prefix("rank")
            .and_then(|n| n.strip_suffix(".json"))
            .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()));
        if !is_dump {
            continue;
        }
        match std::fs::read(e.path())
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<Dump>(&b).map_err(|e| e.to_string()))
        {
            Ok(d) => dumps.push(d),
            Err(err) => notes.push(format!("skipped {name}: {err}")),
        }
    }
    if dumps.is_empty() {
        let why = if notes.is_empty() {
            String::new()
        } else {
            format!(" ({})", notes.join("; "))
        };
        return Err(format!(
            "no flight-recorder dumps (rank<R>.json) in {}{why}",
            dir.display()
        ));
    }
    // a kept folder may hold dumps of earlier jobs: only the newest dump's job counts
    let newest = dumps
        .iter()
        .max_by(|a, b| a.time_ms.total_cmp(&b.time_ms))
        .map(|d| d.job.clone())
        .unwrap_or_default();
    let (mut dumps, old): (Vec<Dump>, Vec<Dump>) = dumps.into_iter().partition(|d| d.job == newest);
    for d in &old {
        notes.push(format!(
            "ignored rank{}.json: written by an earlier job (pid {}), not the newest dump's",
            d.rank, d.pid
        ));
    }
    dumps.sort_by_key(|d| d.rank);
    dumps.dedup_by(|b, a| {
        let same = a.rank == b.rank;
        if same {
            notes.push(format!(
                "two dumps claim rank {} (pids {} and {}): the first is read",
                a.rank, a.pid, b.pid
            ));
        }
        same
    });
    Ok((dumps, notes))
}

fn describe(e: &Entry) -> String {
    let mut s = format!("#{} {}", e.seq, e.op);
    if let Some(dt) = &e.dtype {
        s.push_str(&format!(" ({dt} {:?})", e.shape));
    }
    s
}

fn state_word(e: &Entry) -> &'static str {
    match e.state {
        State::Issued => "waits for its turn in",
        State::Started => "waits in",
        State::Done => "finished",
        State::Failed => "failed in",
    }
}

/// What the dumps say, group by group: the collectives (numbered alike on every rank), then
/// each point-to-point operation that did not finish, with where its peer is.
pub fn diagnose(dumps: &[Dump]) -> Diagnosis {
    let collectives: Vec<Dump> = dumps
        .iter()
        .map(|d| Dump {
            groups: d
                .groups
                .iter()
                .map(|g| GroupDump {
                    entries: g
                        .entries
                        .iter()
                        .filter(|e| e.peer.is_none())
                        .cloned()
                        .collect(),
                    ..g.clone()
                })
                .collect(),
            ..d.clone()
        })
        .collect();
    let mut out = diagnose_collectives(&collectives);
    out.lines.extend(diagnose_p2p(dumps));
    out
}

fn describe_p2p(e: &Entry) -> String {
    let dir = if e.op == "send" { "to" } else { "from" };
    let mut s = format!("{} {dir} rank {}", e.op, e.peer.unwrap_or(usize::MAX));
    if let Some(l) = &e.label {
        s.push_str(&format!(" ({l})"));
    }
    s.push_str(&format!(
        " [tag {}, {:?} bytes {}]",
        e.tag.unwrap_or(0),
        e.shape,
        e.bytes
    ));
    s
}

/// Each point-to-point operation not finished on a rank, and where its peer is.
fn diagnose_p2p(dumps: &[Dump]) -> Vec<String> {
    let mut lines = Vec::new();
    for d in dumps {
        for g in &d.groups {
            for e in g
                .entries
                .iter()
                .filter(|e| e.peer.is_some() && e.state != State::Done)
            {
                let peer = e.peer.unwrap_or(usize::MAX);
                lines.push(format!(
                    "group {}: rank {} {} {} at {}{}",
                    g.name,
                    d.rank,
                    state_word(e),
                    describe_p2p(e),
                    e.site,
                    e.error.as_ref().map_or(String::new(), |m| format!(": {m}"))
                ));
                lines.push(peer_now(dumps, &g.name, peer, d.rank));
            }
        }
    }
    lines
}

/// Where rank `peer` is: its first unfinished operation in any group, else its last message
/// with rank `me` in group `group`.
fn peer_now(dumps: &[Dump], group: &str, peer: usize, me: usize) -> String {
    let Some(pd) = dumps.iter().find(|x| x.rank == peer) else {
        return format!("  rank {peer}: no dump (it exited, was killed, or could not be asked)");
    };
    let open = pd.groups.iter().find_map(|g| {
        g.entries
            .iter()
            .find(|e| e.state != State::Done)
            .map(|e| (g, e))
    });
    if let Some((g, e)) = open {
        let what = if e.peer.is_some() {
            describe_p2p(e)
        } else {
            describe(e)
        };
        return format!(
            "  rank {peer} {} {what} (group {}) at {}",
            state_word(e),
            g.name,
            e.site
        );
    }
    let last = pd
        .groups
        .iter()
        .filter(|g| g.name == group)
        .flat_map(|g| g.entries.iter())
        .rfind(|e| e.peer == Some(me));
    match last {
        Some(e) => format!(
            "  rank {peer} is not in any operation; its last message with rank {me}: {} (finished)",
            describe_p2p(e)
        ),
        None => {
            format!("  rank {peer} is not in any operation and exchanged nothing with rank {me}")
        }
    }
}

/// The collectives' diagnosis, group by group.
fn diagnose_collectives(dumps: &[Dump]) -> Diagnosis {
    let mut out = Diagnosis::default();
    // group name -> (its description, rank -> its ring)
    let mut groups: BTreeMap<String, (&GroupDump, BTreeMap<usize, &GroupDump>)> = BTreeMap::new();
    for d in dumps {
        for g in &d.groups {
            groups
                .entry(g.name.clone())
                .or_insert_with(|| (g, BTreeMap::new()))
                .1
                .insert(d.rank, g);
        }
    }
    for (name, (first, by_rank)) in &groups {
        let head = format!(
            "group {name} (ranks {:?}, backend {})",
            first.ranks, first.backend
        );
        // the earliest operation not finished on some rank, leaving out one that failed on
        // every member (an error every rank got, and went on from)
        let settled = |k: u64| {
            first.ranks.iter().all(|r| {
                by_rank
                    .get(r)
                    .and_then(|g| g.entries.iter().find(|e| e.seq == k))
                    .is_some_and(|e| e.state == State::Failed)
            })
        };
        let open: Option<u64> = by_rank
            .values()
            .flat_map(|g| {
                g.entries
                    .iter()
                    .filter(|e| e.state != State::Done)
                    .map(|e| e.seq)
            })
            .filter(|&k| !settled(k))
            .min();
        let Some(k) = open else {
            out.lines.push(format!(
                "{head}: every recorded operation finished on every rank that dumped"
            ));
            continue;
        };
        // the operation most ranks have at #k
        // (ties: the operation of the lowest rank)
        let mut votes: Vec<(&str, usize)> = Vec::new();
        for g in by_rank.values() {
            if let Some(e) = g.entries.iter().find(|e| e.seq == k) {
                match votes.iter_mut().find(|(op, _)| *op == e.op) {
                    Some(v) => v.1 += 1,
                    None => votes.push((e.op.as_str(), 1)),
                }
            }
        }
        let most = votes.iter().map(|v| v.1).max().unwrap_or(0);
        let reference = votes.iter().find(|v| v.1 == most).map_or("?", |v| v.0);
        let ref_entry = by_rank
            .values()
            .filter_map(|g| g.entries.iter().find(|e| e.seq == k && e.op == reference))
            .next();
        let ref_site = ref_entry.map_or(String::new(), |e| format!(" (called at {})", e.site));
        out.lines.push(format!(
            "{head}: operation #{k} {reference}{ref_site} did not finish everywhere"
        ));
        let (mut waiting, mut lines) = (Vec::new(), Vec::new());
        for &r in &first.ranks {
            let Some(g) = by_rank.get(&r) else {
                lines.push(format!(
                    "  rank {r}: no dump (it exited, was killed, or could not be asked)"
                ));
                continue;
            };
            match g.entries.iter().find(|e| e.seq == k) {
                Some(e) if e.op == reference && matches!(e.state, State::Started | State::Issued) => {
                    waiting.push(r);
                    lines.push(format!("  rank {r} {} {} at {}", state_word(e), describe(e), e.site));
                }
                Some(e) if e.op == reference && e.state == State::Failed => {
                    lines.push(format!(
                        "  rank {r} failed in {} at {}: {}",
                        describe(e),
                        e.site,
                        e.error.as_deref().unwrap_or("")
                    ));
                }
                Some(e) if e.op == reference => {
                    let now = g.entries.iter().find(|x| x.state != State::Done);
                    lines.push(match now {
                        Some(n) => format!("  rank {r} finished #{k} and {} {} at {}", state_word(n), describe(n), n.site),
                        None => format!("  rank {r} finished #{k} and every later operation"),
                    });
                }
                Some(e) => lines.push(format!(
                    "  rank {r} is in a different operation: it called {} at {} where the others called {reference}",
                    describe(e),
                    e.site
                )),
                None => {
                    let last = g.entries.iter().rev().find(|e| e.seq < k);
                    lines.push(match last {
                        Some(l) => format!(
                            "  rank {r} never called #{k} {reference}: it is behind, its last operation is {} ({}) at {}",
                            describe(l),
                            match l.state {
                                State::Done => "finished",
                                State::Failed => "failed",
                                _ => "not finished",
                            },
                            l.site
                        ),
                        None => format!("  rank {r} never called #{k} {reference} (it recorded nothing before it)"),
                    });
                }
            }
        }
        if !waiting.is_empty() {
            out.lines
                .push(format!("  ranks {waiting:?} wait in #{k} {reference}"));
        }
        out.lines.extend(lines);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64, op: &str, state: State, site: &str) -> Entry {
        Entry {
            seq,
            op: op.into(),
            dtype: Some("float32".into()),
            shape: vec![4],
            bytes: 16,
            state,
            issued_ms: 0.0,
            started_ms: None,
            finished_ms: None,
            error: None,
            site: site.into(),
            peer: None,
            tag: None,
            label: None,
        }
    }

    fn dump(rank: usize, entries: Vec<Entry>) -> Dump {
        Dump {
            rank,
            pid: 1,
            reason: String::new(),
            time_ms: 0.0,
            job: String::new(),
            groups: vec![GroupDump {
                name: "world".into(),
                backend: "cpu".into(),
                ranks: vec![0, 1, 2],
                entries,
            }],
        }
    }

    fn p2p(seq: u64, op: &str, state: State, peer: usize, label: &str) -> Entry {
        Entry {
            peer: Some(peer),
            tag: Some(0),
            label: Some(label.into()),
            ..entry(seq, op, state, "executor.rs:1:1")
        }
    }

    #[test]
    fn a_point_to_point_wait_names_the_peer_and_where_it_is() {
        // stage 1 (rank 1) waits for micro-batch 3's activation; stage 0 (rank 0) sent
        // micro-batch 2 and then entered a collective; rank 2 waits on rank 3, which left
        // no dump; the collectives (numbered apart) all finished
        let act = |m: usize| format!("stage 0 micro-batch {m} activation");
        let dumps = vec![
            dump(
                0,
                vec![
                    p2p(0, "send", State::Done, 1, &act(2)),
                    entry(0, "all_reduce", State::Started, "train.rs:9:1"),
                ],
            ),
            dump(
                1,
                vec![
                    p2p(0, "recv", State::Done, 0, &act(2)),
                    p2p(1, "recv", State::Started, 0, &act(3)),
                    entry(0, "all_reduce", State::Done, "train.rs:9:1"),
                ],
            ),
            dump(
                2,
                vec![p2p(0, "recv", State::Started, 3, "stage 3 gradient")],
            ),
        ];
        let d = diagnose(&dumps).to_string();
        for want in [
            "group world: rank 1 waits in recv from rank 0 (stage 0 micro-batch 3 activation) [tag 0, [4] bytes 16] at executor.rs:1:1",
            "  rank 0 waits in #0 all_reduce (float32 [4]) (group world) at train.rs:9:1",
            "group world: rank 2 waits in recv from rank 3 (stage 3 gradient)",
            "  rank 3: no dump",
        ] {
            assert!(d.contains(want), "missing {want:?} in\n{d}");
        }
        // rank 0's finished send is not reported as a wait
        assert!(!d.contains("rank 0 waits in send"), "{d}");
    }

    #[test]
    fn the_rank_that_skipped_an_operation_is_named_with_its_call_site() {
        let done = |s| entry(s, "all_reduce", State::Done, "train.rs:10:5");
        let dumps = vec![
            dump(
                0,
                vec![
                    done(0),
                    entry(1, "all_reduce", State::Started, "train.rs:20:5"),
                ],
            ),
            dump(
                1,
                vec![
                    done(0),
                    entry(1, "all_reduce", State::Started, "train.rs:20:5"),
                ],
            ),
            dump(2, vec![done(0)]),
        ];
        let text = diagnose(&dumps).to_string();
        assert!(
            text.contains("operation #1 all_reduce (called at train.rs:20:5)"),
            "{text}"
        );
        assert!(
            text.contains("ranks [0, 1] wait in #1 all_reduce"),
            "{text}"
        );
        assert!(
            text.contains("rank 2 never called #1 all_reduce: it is behind"),
            "{text}"
        );
        assert!(
            text.contains("#0 all_reduce (float32 [4]) (finished) at train.rs:10:5"),
            "{text}"
        );
    }

    #[test]
    fn an_operation_that_failed_everywhere_does_not_hide_a_later_hang() {
        let failed = |s| entry(s, "broadcast", State::Failed, "t.rs:1:1");
        let done = |s| entry(s, "all_reduce", State::Done, "t.rs:2:2");
        let waits = || entry(2, "all_reduce", State::Started, "t.rs:3:3");
        let dumps = vec![
            dump(0, vec![failed(0), done(1), waits()]),
            dump(1, vec![failed(0), done(1), waits()]),
            dump(2, vec![failed(0), done(1)]),
        ];
        let text = diagnose(&dumps).to_string();
        assert!(
            text.contains("operation #2 all_reduce (called at t.rs:3:3)"),
            "{text}"
        );
        assert!(text.contains("rank 2 never called #2"), "{text}");
        // failed on one rank only: that is the news
        let dumps = vec![
            dump(0, vec![failed(0)]),
            dump(1, vec![entry(0, "broadcast", State::Done, "t.rs:1:1")]),
            dump(2, vec![failed(0)]),
        ];
        assert!(
            diagnose(&dumps)
                .to_string()
                .contains("operation #0 broadcast")
        );
    }

    #[test]
    fn a_different_operation_and_a_missing_dump_are_said() {
        let dumps = vec![
            dump(0, vec![entry(0, "all_reduce", State::Started, "a.rs:1:1")]),
            dump(1, vec![entry(0, "barrier", State::Started, "b.rs:2:2")]),
        ];
        let text = diagnose(&dumps).to_string();
        assert!(
            text.contains("rank 1 is in a different operation: it called #0 barrier"),
            "{text}"
        );
        assert!(text.contains("rank 2: no dump"), "{text}");
        let all_done = vec![dump(
            0,
            vec![entry(0, "all_reduce", State::Done, "a.rs:1:1")],
        )];
        assert!(
            diagnose(&all_done)
                .to_string()
                .contains("every recorded operation finished")
        );
    }
}
