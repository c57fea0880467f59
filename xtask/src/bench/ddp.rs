//! `bench-ddp`: one `DistributedDataParallel` training step (our `bench_ddp` example, cpu
//! backend) and PyTorch's `torch_ddp_step.py` (DDP over gloo), alternately for `--rounds`
//! rounds. The summary gives each side's median over the rounds and the median of the rounds'
//! ratios (ours / PyTorch's) against the goals, and our hidden fraction and exposed wait. Each
//! round runs two pairs: DDP's default options, and `gradient_as_bucket_view` on both sides
//! (the anchor's `view` argument): the rows ending in `_view`.

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
    // each round runs both pairs: DDP's defaults, then gradient_as_bucket_view on both sides
    let modes: [(&str, Option<&str>); 2] = [("", None), ("_view", Some("view"))];
    let mut ours: [Vec<DdpRun>; 2] = Default::default();
    let mut theirs: [Vec<Option<DdpRun>>; 2] = Default::default();
    let mut last_failure = None;
    for r in 1..=*rounds {
        for (m, (suffix, flag)) in modes.iter().enumerate() {
            let args: Vec<String> = sizes
                .iter()
                .cloned()
                .chain(flag.map(str::to_string))
                .collect();
            eprintln!(
                "round {r}: running tensorplay (cpu backend) {}",
                flag.unwrap_or("")
            );
            let o = run_capture(
                Command::new("cargo")
                    .arg("run")
                    .args(example)
                    .arg("--")
                    .args(&args),
            )?;
            print!("{o}");
            let parsed = parse_ddp(&o);
            if parsed.ddp_us.is_none() || parsed.local_us.is_none() {
                return Err(format!(
                    "the bench_ddp example{suffix} printed no step times in round {r}:\n{o}"
                ));
            }
            ours[m].push(parsed);
            if let Ok((python, script)) = &torch {
                eprintln!(
                    "round {r}: running PyTorch DDP (gloo) {}",
                    flag.unwrap_or("")
                );
                match run_torch(python, script, &args, r, &[]) {
                    Ok(t) => {
                        print!("{t}");
                        theirs[m].push(Some(parse_ddp(&t)));
                    }
                    Err((_, why)) => {
                        last_failure = Some(why);
                        theirs[m].push(None);
                    }
                }
            }
        }
    }
    let any_torch = theirs.iter().flatten().any(Option::is_some);
    let pytorch = match (&torch, last_failure) {
        (Err(why), _) => Pytorch::Missing(why.clone()),
        (Ok(_), Some(why)) if !any_torch => Pytorch::Failed(why),
        _ => Pytorch::Ran,
    };
    let first = ours[0].first().cloned().unwrap_or_default();
    println!();
    println!(
        "world {world}, MLP 784-{hidden}-{hidden}-{hidden}-10, batch 32 per rank, float32, \
         {steps} timed steps; params {} grad_bytes {} buckets {} (PyTorch: {}); rows ending in \
         _view: gradient_as_bucket_view on both sides",
        or_dash(first.params),
        or_dash(first.grad_bytes),
        or_dash(first.buckets),
        or_dash(theirs[0].iter().flatten().next().and_then(|t| t.buckets))
    );
    let mut rows: Vec<Row> = Vec::new();
    let mut pairs_total = 0;
    for (m, (suffix, _)) in modes.iter().enumerate() {
        let pairs: Vec<(&DdpRun, &DdpRun)> = ours[m]
            .iter()
            .zip(&theirs[m])
            .filter_map(|(o, t)| t.as_ref().map(|t| (o, t)))
            .collect();
        pairs_total += pairs.len();
        let mine: Vec<&DdpRun> = ours[m].iter().collect();
        let torch_runs: Vec<&DdpRun> = theirs[m].iter().flatten().collect();
        let med = |runs: &[&DdpRun], f: DdpField| median(runs.iter().map(|r| f(r)));
        let med_ratio = |f: DdpField| median(pairs.iter().map(|(o, t)| ratio(f(o), f(t))));
        let mut compared: Vec<(&str, DdpField, Goal)> = vec![
            ("ddp_step", |r| r.ddp_us, Goal::AtMost(0.7)),
            ("ddp_overhead", |r| r.overhead_us, Goal::AtMost(0.25)),
        ];
        if m == 0 {
            compared.insert(0, ("ddp_local_step", |r| r.local_us, Goal::None));
        }
        for (metric, f, goal) in compared {
            rows.push(Row {
                ratio: med_ratio(f),
                ..Row::new(
                    &format!("{metric}{suffix}"),
                    "us",
                    med(&mine, f),
                    med(&torch_runs, f),
                    goal,
                )
            });
        }
        rows.push(Row::ours_only(
            &format!("ddp_exposed_wait{suffix}"),
            "us",
            med(&mine, |r| r.wait_us),
        ));
        rows.push(Row::ours_only(
            &format!("ddp_allreduce_time{suffix}"),
            "us",
            med(&mine, |r| r.allreduce_us),
        ));
        rows.push(Row::ours_only(
            &format!("ddp_hidden_fraction{suffix}"),
            "fraction",
            med(&mine, |r| r.hidden_fraction),
        ));
    }
    print_summary(
        &format!(
            "median of {} round(s); ratio = the median of the rounds' ratios ({} pair(s) \
             with both sides)",
            ours[0].len(),
            pairs_total
        ),
        &rows,
        &pytorch,
    );
    Ok(())
}
