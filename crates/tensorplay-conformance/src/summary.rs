//! The outcome of each rank's records, the result lines a rank writes for the parent, and the
//! summary that combines them (one `FAIL` line per failing record).

use std::collections::BTreeMap;

use crate::case::Case;

/// The outcome of a run.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Records that passed.
    pub passed: usize,
    /// Records that failed.
    pub failed: usize,
    /// One `FAIL <case> rank <r> ...` line per failing record, in the file's case order.
    pub lines: Vec<String>,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for l in &self.lines {
            writeln!(f, "{l}")?;
        }
        write!(f, "{} passed, {} failed", self.passed, self.failed)
    }
}

/// What a rank reports for one record.
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    /// Passed.
    Pass,
    /// The first differing value.
    Differs(String),
    /// The case raised an error on this rank.
    Error(String),
}

/// Combines the ranks' outcomes into the summary: one line per failing record.
pub(crate) fn summarize(
    cases: &[Case],
    outcomes: &BTreeMap<(String, usize), Outcome>,
    world_errors: &BTreeMap<usize, String>,
) -> Summary {
    let mut s = Summary::default();
    for c in cases {
        let mut fail = |line: String| {
            s.failed += 1;
            s.lines.push(line);
        };
        if let Some(why) = &c.invalid {
            for r in &c.records {
                fail(format!(
                    "FAIL {} rank {}: invalid case: {why}",
                    c.label, r.rank
                ));
            }
            continue;
        }
        // an error (or a missing result) on any rank fails the whole case
        let failing_rank =
            c.records
                .iter()
                .find_map(|r| match outcomes.get(&(c.label.clone(), r.rank)) {
                    Some(Outcome::Error(e)) => Some((r.rank, e.clone())),
                    None => Some((
                        r.rank,
                        format!(
                            "no result: the rank crashed or the run was stopped ({})",
                            world_errors
                                .get(&c.world)
                                .map_or("no error reported", String::as_str)
                        ),
                    )),
                    _ => None,
                });
        for r in &c.records {
            let mine = outcomes.get(&(c.label.clone(), r.rank));
            match (mine, &failing_rank) {
                (Some(Outcome::Error(e)), _) => {
                    fail(format!("FAIL {} rank {}: error: {e}", c.label, r.rank))
                }
                (_, Some((k, e))) if *k != r.rank || mine.is_none() => fail(format!(
                    "FAIL {} rank {}: rank {k} failed: {e}",
                    c.label, r.rank
                )),
                (Some(Outcome::Differs(d)), _) => {
                    fail(format!("FAIL {} rank {} {d}", c.label, r.rank))
                }
                (Some(Outcome::Pass), None) => s.passed += 1,
                (_, _) => fail(format!("FAIL {} rank {}: no result", c.label, r.rank)),
            }
        }
    }
    s
}

/// One rank's outcome of one record as a JSON line (the results file format).
pub(crate) fn result_line(case: &str, rank: usize, o: &Outcome) -> String {
    let (kind, text) = match o {
        Outcome::Pass => ("pass", String::new()),
        Outcome::Differs(d) => ("differs", d.clone()),
        Outcome::Error(e) => ("error", e.clone()),
    };
    serde_json::json!({"case": case, "rank": rank, "kind": kind, "text": text}).to_string()
}

/// Reads a line [`result_line`] wrote.
pub(crate) fn parse_result(line: &str) -> Result<(String, usize, Outcome), ()> {
    let v: serde_json::Value = serde_json::from_str(line).map_err(|_| ())?;
    let case = v["case"].as_str().ok_or(())?.to_string();
    let rank = v["rank"].as_u64().ok_or(())? as usize;
    let text = v["text"].as_str().unwrap_or("").to_string();
    let o = match v["kind"].as_str() {
        Some("pass") => Outcome::Pass,
        Some("differs") => Outcome::Differs(text),
        _ => Outcome::Error(text),
    };
    Ok((case, rank, o))
}
