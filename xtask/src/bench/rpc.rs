//! `bench-rpc`: the RPC benchmark (`tensorplay-rpc`'s `bench_rpc` example, then
//! `tensorplay-distributed-nn`'s `bench_remote_module`) and PyTorch's `torch_rpc_latency.py`
//! (TensorPipe) alternately for `--rounds` rounds; the summary keeps the best round of each
//! (ratio = ours / PyTorch's for every metric: the goal says which way is better).

use crate::packages::REMOTE_MODULE_BENCH_PACKAGE;
use std::process::Command;

use super::anchor::Pytorch;
use super::parse::{Metric, parse_rpc};
use super::summary::{Goal, Row, print_summary};
use super::{Common, best, higher_is_better, run_torch};
use crate::process::run_capture;

/// The flags of `bench-rpc`.
#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    pub(crate) common: Common,
}

/// The goal of a metric: p50 latencies of `rpc_sync` and the RemoteModule forward at most half
/// of PyTorch's, `rpc_async` at least twice its rate, the echoes at least its GB/s.
fn goal(key: &str, unit: &str) -> Goal {
    match unit {
        "us" if key == "rpc_sync_p50" || key == "remote_module_fwd_p50" => Goal::AtMost(0.5),
        "us" => Goal::None,
        "calls/s" => Goal::AtLeast(2.0),
        _ => Goal::AtLeast(1.0),
    }
}

pub(crate) fn run(args: &Args) -> Result<(), String> {
    super::cpu::print_cpu();
    let Common { anchor, rounds } = &args.common;
    let torch = anchor.script("torch_rpc_latency.py");
    let args = [
        "-q",
        "--release",
        "-p",
        "tensorplay-rpc",
        "--example",
        "bench_rpc",
    ];
    let rm_args = [
        "-q",
        "--release",
        "-p",
        REMOTE_MODULE_BENCH_PACKAGE,
        "--example",
        "bench_remote_module",
    ];
    // build once, outside the timed runs
    run_capture(Command::new("cargo").arg("build").args(args))?;
    run_capture(Command::new("cargo").arg("build").args(rm_args))?;
    let mut ours: Vec<Metric> = Vec::new();
    let mut theirs: Vec<Metric> = Vec::new();
    let (mut torch_ran, mut last_failure) = (false, None);
    for r in 1..=*rounds {
        eprintln!("round {r}: tensorplay");
        let mut o = run_capture(Command::new("cargo").arg("run").args(args))?;
        o.push_str(&run_capture(
            Command::new("cargo").arg("run").args(rm_args),
        )?);
        print!("{o}");
        ours.extend(parse_rpc(&o));
        if let Ok((python, script)) = &torch {
            eprintln!("round {r}: pytorch");
            // keep what it printed before a failure (its RemoteModule part sometimes fails)
            let t = match run_torch(python, script, &[], r, &["torch-rpc "]) {
                Ok(t) => {
                    torch_ran = true;
                    t
                }
                Err((kept, why)) => {
                    last_failure = Some(why);
                    kept
                }
            };
            print!("{t}");
            theirs.extend(parse_rpc(&t));
        }
    }
    let pytorch = match (&torch, torch_ran, last_failure) {
        (Err(why), _, _) => Pytorch::Missing(why.clone()),
        (Ok(_), false, Some(why)) if theirs.is_empty() => Pytorch::Failed(why),
        _ => Pytorch::Ran,
    };
    let best_of = |runs: &[Metric], key: &str, unit: &str| {
        best(
            runs.iter()
                .filter(|m| m.key == key && m.unit == unit)
                .map(|m| m.value),
            higher_is_better(unit),
        )
    };
    // the metrics in the order our programs printed them
    let mut keys: Vec<(&str, &str)> = Vec::new();
    for m in &ours {
        if !keys.contains(&(m.key.as_str(), m.unit.as_str())) {
            keys.push((&m.key, &m.unit));
        }
    }
    let rows: Vec<Row> = keys
        .into_iter()
        .map(|(key, unit)| {
            Row::new(
                key,
                unit,
                best_of(&ours, key, unit),
                best_of(&theirs, key, unit),
                goal(key, unit),
            )
        })
        .collect();
    print_summary(&format!("best of {rounds} round(s)"), &rows, &pytorch);
    Ok(())
}
