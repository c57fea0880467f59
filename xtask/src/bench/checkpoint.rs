//! `bench-checkpoint`: distributed checkpoints of the fully sharded GPT with its AdamW state
//! (our `bench_checkpoint` example, cpu backend) beside PyTorch's DCP over gloo
//! (`benchmarks/torch_dcp.py`), alternately for `--rounds` rounds, both writing under `--dir`
//! (a folder on disk, not tmpfs). Both save the same model (`layers` blocks of width `width`:
//! 8 x 768 is about 57 M parameters, 680 MB with AdamW's moments) at world `world`, one thread
//! per rank: a synchronous save (fsynced before the commit), a load, and an async save. The
//! summary gives each side's median over the rounds and the median of the rounds' ratios:
//! save and load throughput (bytes of the state over the seconds; ours over PyTorch's), and
//! our async save's blocked time over our synchronous save's time.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::anchor::{Pytorch, torch_with};
use super::summary::{Goal, Row, print_summary, ratio};
use super::{Common, median, run_torch};
use crate::process::{at_least_one, run_capture};

/// The flags of `bench-checkpoint`.
#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Number of ranks.
    #[arg(long, default_value_t = 2, value_parser = at_least_one())]
    pub(crate) world: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 8, value_parser = at_least_one())]
    pub(crate) layers: usize,
    /// Width of the model (a multiple of its 4 heads).
    #[arg(long, default_value_t = 768, value_parser = at_least_one())]
    pub(crate) width: usize,
    /// The folder the checkpoints are written under (on a disk, not tmpfs; default
    /// `target/bench-checkpoint`); emptied of them at the end.
    #[arg(long)]
    pub(crate) dir: Option<PathBuf>,
}

/// What one run of either side printed.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct DcpRun {
    pub(crate) bytes: Option<f64>,
    pub(crate) save_s: Option<f64>,
    pub(crate) load_s: Option<f64>,
    pub(crate) async_blocking_s: Option<f64>,
    pub(crate) async_total_s: Option<f64>,
}

/// Reads the `tensorplay-dcp ...` or `torch-dcp ...` lines (spawn's `[rank 0] ` prefix taken
/// off; other lines skipped). With several rounds in one run, the last round's times.
pub(crate) fn parse_dcp(text: &str) -> DcpRun {
    let mut r = DcpRun::default();
    for line in text.lines() {
        let line = line.trim_start_matches("[rank 0] ");
        let t: Vec<&str> = line.split_whitespace().collect();
        if !t.first().is_some_and(|p| p.ends_with("-dcp")) {
            continue;
        }
        let after = |key: &str| {
            t.iter()
                .position(|w| *w == key)
                .and_then(|i| t.get(i + 1))
                .and_then(|v| v.parse::<f64>().ok())
        };
        match t.get(1) {
            Some(&"bytes") => r.bytes = after("bytes"),
            Some(&"round") => {
                r.save_s = after("save_s");
                r.load_s = after("load_s");
                r.async_blocking_s = after("async_blocking_s");
                r.async_total_s = after("async_total_s");
            }
            _ => {}
        }
    }
    r
}

type Field = fn(&DcpRun) -> Option<f64>;

/// MB/s of the state's bytes over `seconds`.
fn rate(bytes: Option<f64>, seconds: Option<f64>) -> Option<f64> {
    Some(bytes? / 1e6 / seconds.filter(|s| *s > 0.0)?)
}

pub(crate) fn run(args: &Args) -> Result<(), String> {
    super::cpu::print_cpu();
    let Args {
        common: Common { anchor, rounds },
        world,
        layers,
        width,
        dir,
    } = args;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = dir
        .clone()
        .unwrap_or_else(|| root.join("target/bench-checkpoint"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let example = [
        "--release",
        "-q",
        "-p",
        "tensorplay-examples",
        "--example",
        "bench_checkpoint",
    ];
    run_capture(Command::new("cargo").arg("build").args(example))?;
    let torch = torch_with(anchor.python(), &root.join("benchmarks/torch_dcp.py"));
    let sizes = |side: &str| {
        [
            dir.join(side).display().to_string(),
            world.to_string(),
            layers.to_string(),
            width.to_string(),
            "1".to_string(),
        ]
    };
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    let mut last_failure = None;
    for r in 1..=*rounds {
        eprintln!("round {r}: running tensorplay (cpu backend)");
        let o = run_capture(
            Command::new("cargo")
                .arg("run")
                .args(example)
                .arg("--")
                .args(sizes("tensorplay")),
        )?;
        print!("{o}");
        let parsed = parse_dcp(&o);
        if parsed.save_s.is_none() || parsed.bytes.is_none() {
            return Err(format!(
                "the bench_checkpoint example printed no times in round {r}:\n{o}"
            ));
        }
        ours.push(parsed);
        if let Ok((python, script)) = &torch {
            eprintln!("round {r}: running PyTorch DCP (gloo)");
            match run_torch(python, script, &sizes("torch"), r, &[]) {
                Ok(t) => {
                    print!("{t}");
                    theirs.push(Some(parse_dcp(&t)));
                }
                Err((_, why)) => {
                    last_failure = Some(why);
                    theirs.push(None);
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let any_torch = theirs.iter().any(Option::is_some);
    let pytorch = match (&torch, last_failure) {
        (Err(why), _) => Pytorch::Missing(why.clone()),
        (Ok(_), Some(why)) if !any_torch => Pytorch::Failed(why),
        _ => Pytorch::Ran,
    };
    let torch_runs: Vec<&DcpRun> = theirs.iter().flatten().collect();
    let pairs: Vec<(&DcpRun, &DcpRun)> = ours
        .iter()
        .zip(&theirs)
        .filter_map(|(o, t)| t.as_ref().map(|t| (o, t)))
        .collect();
    let med = |runs: &mut dyn Iterator<Item = &DcpRun>, f: Field| median(runs.map(f));
    let med_ratio = |f: Field| median(pairs.iter().map(|(o, t)| ratio(f(o), f(t))));
    println!();
    println!(
        "world {world}, GPT {layers} blocks of width {width} fully sharded with AdamW state: \
         {} bytes (PyTorch: {}), written under {}",
        med(&mut ours.iter(), |r| r.bytes).map_or_else(|| "-".into(), |v| v.to_string()),
        med(&mut torch_runs.iter().copied(), |r| r.bytes)
            .map_or_else(|| "-".into(), |v| v.to_string()),
        dir.display()
    );
    let mut rows = Vec::new();
    let compared: [(&str, &str, Field, Goal); 5] = [
        (
            "save_throughput",
            "MB/s",
            |r| rate(r.bytes, r.save_s),
            Goal::AtLeast(1.0),
        ),
        (
            "load_throughput",
            "MB/s",
            |r| rate(r.bytes, r.load_s),
            Goal::AtLeast(1.0),
        ),
        ("save", "s", |r| r.save_s, Goal::None),
        (
            "async_save_blocked",
            "s",
            |r| r.async_blocking_s,
            Goal::None,
        ),
        ("async_save_total", "s", |r| r.async_total_s, Goal::None),
    ];
    for (metric, unit, f, goal) in compared {
        rows.push(Row {
            ratio: med_ratio(f),
            ..Row::new(
                metric,
                unit,
                med(&mut ours.iter(), f),
                med(&mut torch_runs.iter().copied(), f),
                goal,
            )
        });
    }
    // our blocked time against our own synchronous save: the "pytorch" column holds our save
    let own: Vec<Option<f64>> = ours
        .iter()
        .map(|r| ratio(r.async_blocking_s, r.save_s))
        .collect();
    rows.push(Row {
        ratio: median(own),
        ..Row::new(
            "async_save_blocking",
            "s",
            med(&mut ours.iter(), |r| r.async_blocking_s),
            med(&mut ours.iter(), |r| r.save_s),
            Goal::AtMost(0.1),
        )
    });
    print_summary(
        &format!(
            "median of {} round(s); ratio = the median of the rounds' ratios ({} pair(s) with \
             both sides); async_save_blocking compares with our own synchronous save",
            ours.len(),
            pairs.len()
        ),
        &rows,
        &pytorch,
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_sides_lines_parse() {
        let cases = [
            (
                "ours, behind spawn's prefix",
                "[rank 0] tensorplay-dcp bytes 100\n[rank 1] noise\n[rank 0] tensorplay-dcp round 0 \
                 save_s 0.5 load_s 0.25 async_blocking_s 0.01 async_total_s 0.6\n",
                DcpRun {
                    bytes: Some(100.0),
                    save_s: Some(0.5),
                    load_s: Some(0.25),
                    async_blocking_s: Some(0.01),
                    async_total_s: Some(0.6),
                },
            ),
            (
                "PyTorch's",
                "torch-dcp bytes 7\ntorch-dcp round 0 save_s 1 load_s 2 async_blocking_s 3 \
                 async_total_s 4\n",
                DcpRun {
                    bytes: Some(7.0),
                    save_s: Some(1.0),
                    load_s: Some(2.0),
                    async_blocking_s: Some(3.0),
                    async_total_s: Some(4.0),
                },
            ),
            ("nothing", "hello\n", DcpRun::default()),
        ];
        for (name, text, want) in cases {
            assert_eq!(parse_dcp(text), want, "{name}");
        }
    }
}
