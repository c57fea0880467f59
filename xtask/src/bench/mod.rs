//! The benchmark commands, one file each: `bench-core` ([`core`]), `bench-ddp` ([`ddp`]),
//! `bench-rpc` ([`rpc`]), `bench-collectives` ([`collectives`]), `bench-fsdp` ([`fsdp`]),
//! `bench-checkpoint` ([`checkpoint`]) and `bench-pp` ([`pp`]).
//!
//! Every one of them does the same three things (`docs/benchmarks.md`):
//! 1. prints the CPU first (`cpu: <model>, N logical CPUs`, `simd: <flags>; absent: <flags>`,
//!    from `/proc/cpuinfo`: [`cpu`]);
//! 2. runs our program and PyTorch's twin alternately, `--rounds` rounds (3 by default: ours,
//!    pytorch, ours, pytorch, ...), printing what each printed;
//! 3. ends with the summary table `metric tensorplay unit pytorch unit ratio goal` of
//!    [`summary`], one row per metric, PyTorch's columns saying `no-pytorch` when it could not
//!    run.
//!
//! PyTorch's anchor scripts are found in `--anchors DIR`, else `TENSORPLAY_ANCHORS`, else
//! `../shared/anchors` ([`anchor`]); its interpreter with `--python`, `ANCHOR_PYTHON`,
//! `$ANCHOR_VENV/bin/python`, then what `<anchors>/setup.sh` prints.

pub(crate) mod anchor;
pub(crate) mod checkpoint;
pub(crate) mod collectives;
pub(crate) mod core;
pub(crate) mod cpu;
pub(crate) mod ddp;
pub(crate) mod fsdp;
pub(crate) mod parse;
pub(crate) mod pp;
pub(crate) mod rpc;
pub(crate) mod summary;

use std::path::Path;
use std::process::Command;

use crate::process::{at_least_one, run_capture};
use anchor::Anchor;

/// The flags every bench takes: where PyTorch is, and how many rounds.
#[derive(clap::Args)]
pub(crate) struct Common {
    #[command(flatten)]
    pub(crate) anchor: Anchor,
    /// How many times to alternate the two programs (ours, pytorch, ours, pytorch, ...): the
    /// machines are shared and noisy.
    #[arg(long, default_value_t = 3, value_parser = at_least_one())]
    pub(crate) rounds: usize,
}

/// The best of the rounds: the least for a time, the most for a rate (`higher`). On a shared,
/// noisy machine interference only ever slows a run down, so the best round is the least
/// disturbed one; both programs are treated alike. `None` for no values.
pub(crate) fn best(v: impl IntoIterator<Item = f64>, higher: bool) -> Option<f64> {
    v.into_iter()
        .filter(|x| x.is_finite())
        .reduce(|a, b| if higher { a.max(b) } else { a.min(b) })
}

/// Whether a larger value is better in `unit` (a rate, not a time).
pub(crate) fn higher_is_better(unit: &str) -> bool {
    unit.ends_with("/s") && !unit.starts_with("us") && !unit.starts_with("ms")
}

/// The median of the values present (the mean of the two middle ones for an even count).
pub(crate) fn median(v: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
    let mut v: Vec<f64> = v.into_iter().flatten().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Runs PyTorch's `script` with `args` on one thread (`OMP_NUM_THREADS=1`). A failure is not
/// fatal (PyTorch's RemoteModule sometimes fails on the worker: "No module named
/// '_remote_module_non_scriptable'"): the note names the round and the last error line, and
/// the lines it printed before failing that start with one of `keep` are kept.
pub(crate) fn run_torch(
    python: &Path,
    script: &Path,
    args: &[String],
    round: usize,
    keep: &[&str],
) -> Result<String, (String, String)> {
    run_torch_threads(python, script, args, round, keep, 1)
}

/// [`run_torch`] with `OMP_NUM_THREADS=threads`.
pub(crate) fn run_torch_threads(
    python: &Path,
    script: &Path,
    args: &[String],
    round: usize,
    keep: &[&str],
    threads: usize,
) -> Result<String, (String, String)> {
    match run_capture(
        Command::new(python)
            .arg(script)
            .args(args)
            .env("OMP_NUM_THREADS", threads.to_string()),
    ) {
        Ok(t) => Ok(t),
        Err(e) => {
            let last = e
                .lines()
                .rev()
                .find(|l| l.contains("Error"))
                .unwrap_or("")
                .to_string();
            eprintln!("note: the PyTorch anchor failed in round {round}: {last}");
            let kept = e
                .lines()
                .filter(|l| keep.iter().any(|k| l.starts_with(k)))
                .map(|l| format!("{l}\n"))
                .collect();
            Err((kept, last))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_and_median_of_rounds() {
        struct Case {
            name: &'static str,
            got: Option<f64>,
            want: Option<f64>,
        }
        let cases = [
            Case {
                name: "least time",
                got: best([3.0, 1.0, 2.0], false),
                want: Some(1.0),
            },
            Case {
                name: "most GFLOP/s",
                got: best([3.0, 1.0, 2.0], true),
                want: Some(3.0),
            },
            Case {
                name: "no rounds",
                got: best([], true),
                want: None,
            },
            Case {
                name: "median, odd",
                got: median([Some(3.0), None, Some(1.0), Some(2.0)]),
                want: Some(2.0),
            },
            Case {
                name: "median, even",
                got: median([Some(1.0), Some(2.0)]),
                want: Some(1.5),
            },
        ];
        for c in cases {
            assert_eq!(c.got, c.want, "case {}", c.name);
        }
        for (unit, want) in [
            ("us/step", false),
            ("us", false),
            ("GFLOP/s", true),
            ("GB/s", true),
            ("calls/s", true),
        ] {
            assert_eq!(higher_is_better(unit), want, "{unit}");
        }
    }
}
