//! `bench-pp`: the GPT training step pipelined over 2 ranks (our `bench_pp` example, cpu
//! backend) and PyTorch's `torch_pipeline_step.py` (`torch.distributed.pipelining` over
//! gloo), alternately for `--rounds` rounds: the same model (8 blocks of width 256, 4 heads,
//! context 64, vocabulary 65, head untied), split in 2 stages, batch 16 in 4 micro-batches,
//! AdamW, one thread per rank, the slowest rank's median step. The summary gives each side's
//! median over the rounds and the median of the rounds' ratios; our measured bubble against
//! the schedule's theory, and our interleaved and zero-bubble steps against our 1F1B step
//! (their "pytorch" columns hold the theory and our 1F1B step).

use std::process::Command;

use super::anchor::Pytorch;
use super::summary::{Goal, Row, print_summary, ratio};
use super::{Common, median, run_torch};
use crate::process::{at_least_one, run_capture};

/// The flags of `bench-pp`.
#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Micro-batches per batch of 16.
    #[arg(long, default_value_t = 4, value_parser = at_least_one())]
    pub(crate) microbatches: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 8, value_parser = at_least_one())]
    pub(crate) layers: usize,
    /// Width of the model (a multiple of its 4 heads).
    #[arg(long, default_value_t = 256, value_parser = at_least_one())]
    pub(crate) width: usize,
    /// Timed steps (after 5 warm-up steps); the median is reported.
    #[arg(long, default_value_t = 10, value_parser = at_least_one())]
    pub(crate) steps: usize,
}

/// One schedule's line: step, bubble, theory, imbalance.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Sched {
    pub(crate) step_us: Option<f64>,
    pub(crate) bubble: Option<f64>,
    pub(crate) theory: Option<f64>,
    pub(crate) imbalance: Option<f64>,
}

/// What one run of either side printed.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct PpRun {
    pub(crate) single_us: Option<f64>,
    pub(crate) gpipe: Sched,
    pub(crate) one_f_one_b: Sched,
    pub(crate) interleaved: Sched,
    pub(crate) zero_bubble: Sched,
}

/// Reads the `tensorplay-pp ...` or `torch-pp ...` lines (other lines are skipped).
pub(crate) fn parse_pp(text: &str) -> PpRun {
    let mut r = PpRun::default();
    for line in text.lines() {
        let t: Vec<&str> = line.split_whitespace().collect();
        if !t.first().is_some_and(|p| p.ends_with("-pp")) || t.get(2) != Some(&"step") {
            continue;
        }
        let num = |i: usize| t.get(i).and_then(|s| s.parse::<f64>().ok());
        let after = |word: &str| t.iter().position(|w| *w == word).and_then(|i| num(i + 1));
        let s = Sched {
            step_us: num(3).filter(|_| t.get(4) == Some(&"us")),
            bubble: after("bubble"),
            theory: after("theory"),
            imbalance: after("imbalance"),
        };
        match t[1] {
            "single" => r.single_us = s.step_us,
            "gpipe" => r.gpipe = s,
            "1f1b" => r.one_f_one_b = s,
            "interleaved" => r.interleaved = s,
            "zero-bubble" => r.zero_bubble = s,
            _ => {}
        }
    }
    r
}

type Field = fn(&PpRun) -> Option<f64>;

pub(crate) fn run(args: &Args) -> Result<(), String> {
    super::cpu::print_cpu();
    let Args {
        common: Common { anchor, rounds },
        microbatches,
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
        "bench_pp",
    ];
    let ours_args = [microbatches, layers, width, steps].map(|v| v.to_string());
    let torch_args = [2, *microbatches, *layers, *width, *steps].map(|v| v.to_string());
    run_capture(Command::new("cargo").arg("build").args(example))?;
    let torch = anchor.script("torch_pipeline_step.py");
    let (mut ours, mut theirs, mut last_failure) = (Vec::new(), Vec::new(), None);
    for r in 1..=*rounds {
        eprintln!("round {r}: running tensorplay (cpu backend)");
        let o = run_capture(
            Command::new("cargo")
                .arg("run")
                .args(example)
                .arg("--")
                .args(&ours_args),
        )?;
        print!("{o}");
        let parsed = parse_pp(&o);
        if parsed.one_f_one_b.step_us.is_none() {
            return Err(format!(
                "the bench_pp example printed no 1F1B step in round {r}:\n{o}"
            ));
        }
        ours.push(parsed);
        if let Ok((python, script)) = &torch {
            eprintln!("round {r}: running PyTorch pipelining (gloo)");
            match run_torch(python, script, &torch_args, r, &[]) {
                Ok(t) => {
                    print!("{t}");
                    theirs.push(Some(parse_pp(&t)));
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
    let torch_runs: Vec<&PpRun> = theirs.iter().flatten().collect();
    let pairs: Vec<(&PpRun, &PpRun)> = ours
        .iter()
        .zip(&theirs)
        .filter_map(|(o, t)| t.as_ref().map(|t| (o, t)))
        .collect();
    let med_ours = |f: Field| median(ours.iter().map(f));
    let med_theirs = |f: Field| median(torch_runs.iter().map(|r| f(r)));
    let med_ratio = |f: Field| median(pairs.iter().map(|(o, t)| ratio(f(o), f(t))));
    println!();
    println!(
        "2 stages (interleaved: 4, 2 per rank), GPT {layers} blocks of width {width}, batch 16 in \
         {microbatches} micro-batches, float32, AdamW, {steps} timed steps"
    );
    let mut rows = Vec::new();
    let compared: [(&str, Field, Goal); 3] = [
        ("pp_single_step", |r| r.single_us, Goal::None),
        ("pp_gpipe_step", |r| r.gpipe.step_us, Goal::None),
        ("pp_1f1b_step", |r| r.one_f_one_b.step_us, Goal::AtMost(0.9)),
    ];
    for (metric, f, goal) in compared {
        rows.push(Row {
            ratio: med_ratio(f),
            ..Row::new(metric, "us", med_ours(f), med_theirs(f), goal)
        });
    }
    // against a reference of our own: the "pytorch" column holds it
    let own = |metric: &str, unit: &str, a: Field, b: Field, goal: Goal| Row {
        ratio: median(ours.iter().map(|r| ratio(a(r), b(r)))),
        ..Row::new(metric, unit, med_ours(a), med_ours(b), goal)
    };
    rows.push(own(
        "bubble_vs_theory",
        "fraction",
        |r| r.one_f_one_b.bubble,
        |r| r.one_f_one_b.theory,
        Goal::Within(0.8, 1.2),
    ));
    rows.push(own(
        "interleaved_bubble_vs_theory",
        "fraction",
        |r| r.interleaved.bubble,
        |r| r.interleaved.theory,
        Goal::None,
    ));
    rows.push(own(
        "interleaved_over_1f1b",
        "us",
        |r| r.interleaved.step_us,
        |r| r.one_f_one_b.step_us,
        Goal::None,
    ));
    rows.push(own(
        "zero_bubble_over_1f1b",
        "us",
        |r| r.zero_bubble.step_us,
        |r| r.one_f_one_b.step_us,
        Goal::None,
    ));
    rows.push(Row::ours_only(
        "zero_bubble_bubble",
        "fraction",
        med_ours(|r| r.zero_bubble.bubble),
    ));
    rows.push(Row::ours_only(
        "stage_imbalance_1f1b",
        "x",
        med_ours(|r| r.one_f_one_b.imbalance),
    ));
    print_summary(
        &format!(
            "median of {} round(s); ratio = the median of the rounds' ratios ({} pair(s) with \
             both sides); the *_vs_theory and *_over_1f1b rows compare with the schedule's \
             theory and our own 1F1B step (in the pytorch column)",
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
    fn both_sides_lines_are_read() {
        let ours = "tensorplay-pp single step 445273.1 us\n\
                    tensorplay-pp 1f1b step 315541.3 us bubble 0.2105 theory 0.2000 imbalance 1.012\n\
                    noise\n";
        let r = parse_pp(ours);
        assert_eq!(r.single_us, Some(445273.1));
        assert_eq!(
            r.one_f_one_b,
            Sched {
                step_us: Some(315541.3),
                bubble: Some(0.2105),
                theory: Some(0.2),
                imbalance: Some(1.012)
            }
        );
        let torch =
            "torch-pp gpipe step 409827.0 us\ntorch-pp loss single 2.878309 pipelined 2.878310\n";
        let t = parse_pp(torch);
        assert_eq!(t.gpipe.step_us, Some(409827.0));
        assert_eq!(t.gpipe.bubble, None);
    }
}
