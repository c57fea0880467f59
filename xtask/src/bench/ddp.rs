//! `bench-ddp`: one `DistributedDataParallel` training step (our `bench_ddp` example, cpu
//! backend) and PyTorch's `torch_ddp_step.py` (DDP over gloo), alternately for `--rounds`
//! rounds. The summary gives each side's median over the rounds and the median of the rounds'
//! ratios (ours / PyTorch's) against the goals, and our hidden fraction and exposed wait.

use std::process::Command;

use super::anchor::Pytorch;
use super::parse::{DdpRun, parse_ddp};
use super::summary::{Goal, Row, print_summary, ratio};
use super::{Common, median, run_torch};
use crate::process::{at_least_one, run_capture};

/// The flags of `bench-ddp`.
#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Number of ranks.
    #[arg(long, default_value_t = 2, value_parser = at_least_one())]
    pub(crate) world: usize,
    /// Width of the three hidden layers.
    #[arg(long, default_value_t = 1024, value_parser = at_least_one())]
    pub(crate) hidden: usize,
    /// Timed steps of each phase (after 5 warm-up steps); the median is reported.
    #[arg(long, default_value_t = 30, value_parser = at_least_one())]
    pub(crate) steps: usize,
}

/// One number of a [`DdpRun`], for the summary's rows.
type DdpField = fn(&DdpRun) -> Option<f64>;

/// The value, or `-` when it was not printed.
fn or_dash<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

pub(crate) fn run(args: &Args) -> Result<(), String> {
    super::cpu::print_cpu();
    let Args {
        common: Common { anchor, rounds },
        world,
        hidden,
        steps,
    } = args;
    let example = [
        "--release",
        "-q",
        "-p",
        "tensorplay-distributed-nn",
        "--example",
        "bench_ddp",
    ];
    let sizes = [world.to_string(), hidden.to_string(), steps.to_string()];
    run_capture(Command::new("cargo").arg("build").args(example))?;
    let torch = anchor.script("torch_ddp_step.py");
    let mut ours: Vec<DdpRun> = Vec::new();
    let mut theirs: Vec<Option<DdpRun>> = Vec::new();
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
        let parsed = parse_ddp(&o);
        if parsed.ddp_us.is_none() || parsed.local_us.is_none() {
            return Err(format!(
                "the bench_ddp example printed no step times in round {r}:\n{o}"
            ));
        }
        ours.push(parsed);
        if let Ok((python, script)) = &torch {
            eprintln!("round {r}: running PyTorch DDP (gloo)");
            match run_torch(python, script, &sizes, r, &[]) {
                Ok(t) => {
                    print!("{t}");
                    theirs.push(Some(parse_ddp(&t)));
                }
                Err((_, why)) => {
                    last_failure = Some(why);
                    theirs.push(None);
                }
            }
        }
    }
    let pairs: Vec<(&DdpRun, &DdpRun)> = ours
        .iter()
        .zip(&theirs)
        .filter_map(|(o, t)| t.as_ref().map(|t| (o, t)))
        .collect();
    let theirs: Vec<&DdpRun> = theirs.iter().flatten().collect();
    let pytorch = match (&torch, last_failure) {
        (Err(why), _) => Pytorch::Missing(why.clone()),
        (Ok(_), Some(why)) if theirs.is_empty() => Pytorch::Failed(why),
        _ => Pytorch::Ran,
    };
    let ours: Vec<&DdpRun> = ours.iter().collect();
    let med = |runs: &[&DdpRun], f: DdpField| median(runs.iter().map(|r| f(r)));
    let med_ratio = |f: DdpField| median(pairs.iter().map(|(o, t)| ratio(f(o), f(t))));
    let first = ours.first().copied().cloned().unwrap_or_default();
    println!();
    println!(
        "world {world}, MLP 784-{hidden}-{hidden}-{hidden}-10, batch 32 per rank, float32, \
         {steps} timed steps; params {} grad_bytes {} buckets {} (PyTorch: {})",
        or_dash(first.params),
        or_dash(first.grad_bytes),
        or_dash(first.buckets),
        or_dash(theirs.first().and_then(|t| t.buckets))
    );
    let compared: [(&str, DdpField, Goal); 3] = [
        ("ddp_local_step", |r| r.local_us, Goal::None),
        ("ddp_step", |r| r.ddp_us, Goal::AtMost(0.7)),
        ("ddp_overhead", |r| r.overhead_us, Goal::AtMost(0.25)),
    ];
    let mut rows: Vec<Row> = compared
        .into_iter()
        .map(|(metric, f, goal)| Row {
            ratio: med_ratio(f),
            ..Row::new(metric, "us", med(&ours, f), med(&theirs, f), goal)
        })
        .collect();
    rows.push(Row::ours_only(
        "ddp_exposed_wait",
        "us",
        med(&ours, |r| r.wait_us),
    ));
    rows.push(Row::ours_only(
        "ddp_allreduce_time",
        "us",
        med(&ours, |r| r.allreduce_us),
    ));
    rows.push(Row::ours_only(
        "ddp_hidden_fraction",
        "fraction",
        med(&ours, |r| r.hidden_fraction),
    ));
    print_summary(
        &format!(
            "median of {} round(s); ratio = the median of the rounds' ratios ({} round(s) \
             with both)",
            ours.len(),
            pairs.len()
        ),
        &rows,
        &pytorch,
    );
    Ok(())
}
