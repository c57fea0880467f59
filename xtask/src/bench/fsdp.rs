//! `bench-fsdp`: the GPT training step fully sharded (our `bench_fsdp` example, cpu backend)
//! and PyTorch's `torch_fsdp_step.py` (FSDP2 over gloo), alternately for `--rounds` rounds.
//! Both run the same model (`layers` blocks of width `width`, 4 heads, context 64, vocabulary
//! 65, tied head), batch 8 per rank, AdamW, one thread per rank, each mode (local, DDP, FSDP)
//! in fresh processes. The summary gives each side's median over the rounds and the median of
//! the rounds' ratios: our FSDP step against PyTorch's, our state bytes per rank against
//! PyTorch's, and our FSDP step against our own DDP step (in the PyTorch column).

use std::process::Command;

use super::anchor::Pytorch;
use super::summary::{Goal, Row, print_summary, ratio};
use super::{Common, median, run_torch};
use crate::process::{at_least_one, run_capture};

/// The flags of `bench-fsdp`.
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
    #[arg(long, default_value_t = 256, value_parser = at_least_one())]
    pub(crate) width: usize,
    /// Timed steps of each mode (after 5 warm-up steps); the median is reported.
    #[arg(long, default_value_t = 20, value_parser = at_least_one())]
    pub(crate) steps: usize,
}

/// What one run of either side printed.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct FsdpRun {
    pub(crate) params: Option<f64>,
    pub(crate) local_us: Option<f64>,
    pub(crate) ddp_us: Option<f64>,
    pub(crate) fsdp_us: Option<f64>,
    pub(crate) ddp_state: Option<f64>,
    pub(crate) fsdp_state: Option<f64>,
}

/// Reads the `tensorplay-fsdp ...` or `torch-fsdp ...` lines (other lines are skipped).
pub(crate) fn parse_fsdp(text: &str) -> FsdpRun {
    let mut r = FsdpRun::default();
    for line in text.lines() {
        let t: Vec<&str> = line.split_whitespace().collect();
        if !t.first().is_some_and(|p| p.ends_with("-fsdp")) {
            continue;
        }
        let num = |i: usize| t.get(i).and_then(|s| s.parse::<f64>().ok());
        let us = |i: usize| num(i).filter(|_| t.get(i + 1) == Some(&"us"));
        match t.get(1..3) {
            Some(["params", _]) => r.params = num(2),
            Some(["local", "step"]) => r.local_us = us(3),
            Some(["ddp", "step"]) => r.ddp_us = us(3),
            Some(["fsdp", "step"]) => r.fsdp_us = us(3),
            Some(["state", "bytes"]) if t.len() >= 9 => {
                r.ddp_state = num(6);
                r.fsdp_state = num(8);
            }
            _ => {}
        }
    }
    r
}

type Field = fn(&FsdpRun) -> Option<f64>;

pub(crate) fn run(args: &Args) -> Result<(), String> {
    super::cpu::print_cpu();
    let Args {
        common: Common { anchor, rounds },
        world,
        layers,
        width,
        steps,
    } = args;
    let example = [
        "--release",
        "-q",
        "-p",
        "tensorplay-examples",
        "--example",
        "bench_fsdp",
    ];
    let sizes = [world, layers, width, steps].map(|v| v.to_string());
    run_capture(Command::new("cargo").arg("build").args(example))?;
    let torch = anchor.script("torch_fsdp_step.py");
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
                .args(&sizes),
        )?;
        print!("{o}");
        let parsed = parse_fsdp(&o);
        if parsed.fsdp_us.is_none() || parsed.ddp_us.is_none() {
            return Err(format!(
                "the bench_fsdp example printed no step times in round {r}:\n{o}"
            ));
        }
        ours.push(parsed);
        if let Ok((python, script)) = &torch {
            eprintln!("round {r}: running PyTorch FSDP2 (gloo)");
            match run_torch(python, script, &sizes, r, &[]) {
                Ok(t) => {
                    print!("{t}");
                    theirs.push(Some(parse_fsdp(&t)));
                }
                Err((_, why)) => {
                    last_failure = Some(why);
                    theirs.push(None);
                }
            }
        }
    }
    let any_torch = theirs.iter().any(Option::is_some);
    let pytorch = match (&torch, last_failure) {
        (Err(why), _) => Pytorch::Missing(why.clone()),
        (Ok(_), Some(why)) if !any_torch => Pytorch::Failed(why),
        _ => Pytorch::Ran,
    };
    let torch_runs: Vec<&FsdpRun> = theirs.iter().flatten().collect();
    let pairs: Vec<(&FsdpRun, &FsdpRun)> = ours
        .iter()
        .zip(&theirs)
        .filter_map(|(o, t)| t.as_ref().map(|t| (o, t)))
        .collect();
    let med = |runs: &mut dyn Iterator<Item = &FsdpRun>, f: Field| median(runs.map(f));
    let med_ratio = |f: Field| median(pairs.iter().map(|(o, t)| ratio(f(o), f(t))));
    println!();
    println!(
        "world {world}, GPT {layers} blocks of width {width}, batch 8 per rank, float32, AdamW, \
         {steps} timed steps; params {} (PyTorch: {})",
        med(&mut ours.iter(), |r| r.params).map_or_else(|| "-".into(), |v| v.to_string()),
        med(&mut torch_runs.iter().copied(), |r| r.params)
            .map_or_else(|| "-".into(), |v| v.to_string()),
    );
    let mut rows = Vec::new();
    let compared: [(&str, &str, Field, Goal); 4] = [
        ("fsdp_local_step", "us", |r| r.local_us, Goal::None),
        ("fsdp_ddp_step", "us", |r| r.ddp_us, Goal::None),
        ("fsdp_step", "us", |r| r.fsdp_us, Goal::AtMost(0.8)),
        (
            "state_bytes_per_rank",
            "bytes",
            |r| r.fsdp_state,
            Goal::AtMost(1.0),
        ),
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
    // our FSDP step against our own DDP step: the "pytorch" column holds our DDP step
    let own: Vec<Option<f64>> = ours.iter().map(|r| ratio(r.fsdp_us, r.ddp_us)).collect();
    rows.push(Row {
        ratio: median(own),
        ..Row::new(
            "fsdp_over_own_ddp",
            "us",
            med(&mut ours.iter(), |r| r.fsdp_us),
            med(&mut ours.iter(), |r| r.ddp_us),
            Goal::AtMost(1.25),
        )
    });
    rows.push(Row::ours_only(
        "ddp_state_bytes_per_rank",
        "bytes",
        med(&mut ours.iter(), |r| r.ddp_state),
    ));
    print_summary(
        &format!(
            "median of {} round(s); ratio = the median of the rounds' ratios ({} pair(s) with \
             both sides); fsdp_over_own_ddp compares with our own DDP step",
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
                "ours, with spawn's prefixed lines around",
                "[rank 0] note\ntensorplay-fsdp params 6400000 world 2\ntensorplay-fsdp local step 100.5 us\n\
                 tensorplay-fsdp ddp step 200.0 us\ntensorplay-fsdp fsdp step 250.0 us\n\
                 tensorplay-fsdp state bytes per rank ddp 1000 fsdp 520\n",
                FsdpRun {
                    params: Some(6_400_000.0),
                    local_us: Some(100.5),
                    ddp_us: Some(200.0),
                    fsdp_us: Some(250.0),
                    ddp_state: Some(1000.0),
                    fsdp_state: Some(520.0),
                },
            ),
            (
                "PyTorch's, with the rss line and no fsdp-bf16",
                "torch-fsdp params 6 world 2\ntorch-fsdp local step 1.0 us\ntorch-fsdp ddp step 2.0 us\n\
                 torch-fsdp fsdp step 3.0 us\ntorch-fsdp state bytes per rank ddp 10 fsdp 5\n\
                 torch-fsdp peak rss MB ddp 1.0 fsdp 2.0\n",
                FsdpRun {
                    params: Some(6.0),
                    local_us: Some(1.0),
                    ddp_us: Some(2.0),
                    fsdp_us: Some(3.0),
                    ddp_state: Some(10.0),
                    fsdp_state: Some(5.0),
                },
            ),
            ("nothing", "hello\n", FsdpRun::default()),
        ];
        for (name, text, want) in cases {
            assert_eq!(parse_fsdp(text), want, "{name}");
        }
    }
}
