//! The summary table every bench command ends with: one place, so that later benchmarks add
//! rows of the same form.
//!
//! ```text
//! metric      tensorplay unit     pytorch unit     ratio goal
//! mlp_step         129.0 us/step    613.6 us/step  0.210 <=0.5
//! matmul_512        84.2 GFLOP/s     80.9 GFLOP/s  1.041 >=0.8
//! ```
//!
//! `metric` is one token (letters, digits, `_`) and appears as the first token of a line only
//! in this table, so `grep '^matmul_512 '` finds the row. `ratio` is tensorplay / pytorch in
//! every row: below 1 is better for a time, above 1 for a rate (a throughput: GFLOP/s, GB/s,
//! calls/s); `goal` is the ratio the project wants (`<=0.5`, `>=0.8`; `-` when none). The
//! pytorch columns say `no-pytorch` when PyTorch could not run, `failed` when it failed in
//! every round, and `-` for a metric PyTorch does not measure. After the table one line gives
//! the goals met and missed.

use super::anchor::Pytorch;

/// The ratio the project wants for a row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Goal {
    /// No goal.
    None,
    /// tensorplay / pytorch at most this (times).
    AtMost(f64),
    /// tensorplay / pytorch at least this (rates).
    AtLeast(f64),
    /// tensorplay / the reference between these two (a measured value against its theory).
    Within(f64, f64),
}

impl Goal {
    fn token(self) -> String {
        match self {
            Goal::None => "-".into(),
            Goal::AtMost(g) => format!("<={g}"),
            Goal::AtLeast(g) => format!(">={g}"),
            Goal::Within(lo, hi) => format!("{lo}..{hi}"),
        }
    }

    fn met(self, ratio: f64) -> Option<bool> {
        match self {
            Goal::None => None,
            Goal::AtMost(g) => Some(ratio <= g),
            Goal::AtLeast(g) => Some(ratio >= g),
            Goal::Within(lo, hi) => Some((lo..=hi).contains(&ratio)),
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Row {
    /// One token, unique among the first tokens of the command's output.
    pub(crate) metric: String,
    /// The unit of both values (`us/step`, `GFLOP/s`, ...).
    pub(crate) unit: String,
    /// Our value, when measured.
    pub(crate) ours: Option<f64>,
    /// PyTorch's value, when measured (`None` for a metric only we report).
    pub(crate) theirs: Option<f64>,
    /// Whether PyTorch has this metric at all.
    pub(crate) ours_only: bool,
    /// tensorplay / pytorch (usually `ours / theirs`; a median of rounds' ratios where the
    /// bench says so).
    pub(crate) ratio: Option<f64>,
    /// The goal for `ratio`.
    pub(crate) goal: Goal,
}

impl Row {
    /// A row compared with PyTorch: the ratio is `ours / theirs`.
    pub(crate) fn new(
        metric: &str,
        unit: &str,
        ours: Option<f64>,
        theirs: Option<f64>,
        goal: Goal,
    ) -> Row {
        assert!(
            is_token(metric),
            "a metric is one token of letters, digits and `_`: {metric:?}"
        );
        Row {
            metric: metric.into(),
            unit: unit.into(),
            ours,
            theirs,
            ours_only: false,
            ratio: ratio(ours, theirs),
            goal,
        }
    }

    /// A row PyTorch has no counterpart for.
    pub(crate) fn ours_only(metric: &str, unit: &str, ours: Option<f64>) -> Row {
        Row {
            ours_only: true,
            ..Row::new(metric, unit, ours, None, Goal::None)
        }
    }
}

/// Whether `s` is one token of ASCII letters, digits and `_`.
pub(crate) fn is_token(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `a / b` when both are known and `b > 0` (a ratio to a non-positive value means nothing).
pub(crate) fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// Decimals for a value in `unit`.
fn decimals(unit: &str) -> usize {
    match unit {
        "GB/s" | "fraction" => 3,
        "calls/s" => 0,
        _ => 1,
    }
}

/// The table's lines (header, rows, then the goals line), without printing them.
pub(crate) fn render(rows: &[Row], pytorch: &Pytorch) -> Vec<String> {
    let cells: Vec<[String; 7]> = rows
        .iter()
        .map(|r| {
            let p = decimals(&r.unit);
            let num = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.p$}"));
            let (theirs, theirs_unit) = match pytorch {
                _ if r.ours_only => ("-".into(), "-".into()),
                Pytorch::Missing(_) => ("no-pytorch".into(), "-".into()),
                Pytorch::Failed(_) => ("failed".into(), "-".into()),
                Pytorch::Ran if r.theirs.is_none() => ("-".into(), "-".into()),
                Pytorch::Ran => (num(r.theirs), r.unit.clone()),
            };
            [
                r.metric.clone(),
                num(r.ours),
                r.unit.clone(),
                theirs,
                theirs_unit,
                r.ratio.map_or_else(|| "-".into(), |v| format!("{v:.3}")),
                r.goal.token(),
            ]
        })
        .collect();
    let header = [
        "metric",
        "tensorplay",
        "unit",
        "pytorch",
        "unit",
        "ratio",
        "goal",
    ]
    .map(String::from);
    let mut width = [0usize; 7];
    for row in std::iter::once(&header).chain(&cells) {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.len());
        }
    }
    // text columns to the left, numbers to the right
    let line = |row: &[String; 7]| {
        let w = width;
        format!(
            "{:<a$} {:>b$} {:<c$} {:>d$} {:<e$} {:>f$} {}",
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            row[5],
            row[6],
            a = w[0],
            b = w[1],
            c = w[2],
            d = w[3],
            e = w[4],
            f = w[5],
        )
        .trim_end()
        .to_string()
    };
    let mut out = vec![line(&header)];
    out.extend(cells.iter().map(line));
    let (mut met, mut missed, mut unmeasured) = (vec![], vec![], vec![]);
    for r in rows {
        match r.ratio.map(|x| r.goal.met(x)) {
            Some(Some(true)) => met.push(r.metric.as_str()),
            Some(Some(false)) => missed.push(r.metric.as_str()),
            None if r.goal != Goal::None => unmeasured.push(r.metric.as_str()),
            _ => {}
        }
    }
    let list = |v: &[&str]| {
        if v.is_empty() {
            "-".into()
        } else {
            v.join(" ")
        }
    };
    out.push(format!(
        "goals: met {}; MISSED {}; not measured {}",
        list(&met),
        list(&missed),
        list(&unmeasured)
    ));
    out
}

/// Prints the summary: what the ratio means, why PyTorch did not run (when it did not), the
/// table and the goals line.
pub(crate) fn print_summary(title: &str, rows: &[Row], pytorch: &Pytorch) {
    println!();
    println!(
        "summary: {title}; ratio = tensorplay / pytorch in every row (times: lower is better, rates: higher is better); goal = the ratio wanted"
    );
    match pytorch {
        Pytorch::Ran => {}
        Pytorch::Missing(why) => println!("pytorch: not run: {why}"),
        Pytorch::Failed(why) => println!("pytorch: failed in every round: {why}"),
    }
    for l in render(rows, pytorch) {
        println!("{l}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Case {
        name: &'static str,
        rows: Vec<Row>,
        pytorch: Pytorch,
        want: &'static [&'static str],
    }

    fn check(c: Case) {
        let got = render(&c.rows, &c.pytorch);
        assert_eq!(got, c.want, "case {}", c.name);
    }

    fn core_rows(torch: bool) -> Vec<Row> {
        let t = |v: f64| torch.then_some(v);
        vec![
            Row::new(
                "mlp_step",
                "us/step",
                Some(129.0),
                t(613.6),
                Goal::AtMost(0.5),
            ),
            Row::new(
                "matmul_512",
                "GFLOP/s",
                Some(84.2),
                t(80.9),
                Goal::AtLeast(0.8),
            ),
            Row::new(
                "gpt_step",
                "us/step",
                Some(140.0),
                t(100.0),
                Goal::AtMost(0.7),
            ),
            Row::ours_only("hidden_fraction", "fraction", Some(0.4)),
        ]
    }

    #[test]
    fn renders_rows_ratios_and_goals() {
        let cases = [
            Case {
                name: "pytorch ran",
                rows: core_rows(true),
                pytorch: Pytorch::Ran,
                want: &[
                    "metric          tensorplay unit     pytorch unit    ratio goal",
                    "mlp_step             129.0 us/step    613.6 us/step 0.210 <=0.5",
                    "matmul_512            84.2 GFLOP/s     80.9 GFLOP/s 1.041 >=0.8",
                    "gpt_step             140.0 us/step    100.0 us/step 1.400 <=0.7",
                    "hidden_fraction      0.400 fraction       - -           - -",
                    "goals: met mlp_step matmul_512; MISSED gpt_step; not measured -",
                ],
            },
            Case {
                name: "no pytorch",
                rows: core_rows(false),
                pytorch: Pytorch::Missing("no interpreter".into()),
                want: &[
                    "metric          tensorplay unit        pytorch unit ratio goal",
                    "mlp_step             129.0 us/step  no-pytorch -        - <=0.5",
                    "matmul_512            84.2 GFLOP/s  no-pytorch -        - >=0.8",
                    "gpt_step             140.0 us/step  no-pytorch -        - <=0.7",
                    "hidden_fraction      0.400 fraction          - -        - -",
                    "goals: met -; MISSED -; not measured mlp_step matmul_512 gpt_step",
                ],
            },
        ];
        for c in cases {
            check(c);
        }
    }

    #[test]
    fn a_metric_is_one_token() {
        for (s, want) in [
            ("matmul_512", true),
            ("echo_16MiB", true),
            ("matmul 512", false),
            ("", false),
            ("rpc-sync", false),
        ] {
            assert_eq!(is_token(s), want, "{s:?}");
        }
    }
}
