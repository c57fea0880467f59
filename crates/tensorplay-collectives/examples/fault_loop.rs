//! A job for fault scenarios (`cargo xtask test-multihost`): joins the `env://` rendezvous
//! with a short collective timeout, prints `fault_loop: running` once every rank is in, then
//! all-reduces a 256 KiB tensor over and over, checking every result, until `--seconds` pass
//! or a collective fails. A failure is printed as `fault_loop: failed: <error>` and the process
//! exits 1, so the harness can check that every rank failed in time and named the lost ranks.
//!
//! Usage (one process per rank, under `tensorplay-run` or with `RANK` etc. set):
//! `fault_loop [--seconds N] [--timeout-secs N]`

use std::time::{Duration, Instant};

use clap::Parser;
use tensorplay_collectives::{self as dist, InitOptions, ReduceOp};
use tensorplay_core::{DType, Tensor};

/// The fault job's command line.
#[derive(Parser, Debug)]
#[command(
    name = "fault_loop",
    about = "A job for fault scenarios (`cargo xtask test-multihost`): all-reduces over and over, \
             one process per rank under tensorplay-run, until --seconds pass or one fails."
)]
struct Args {
    /// How long to go on without a fault, in seconds.
    #[arg(long, value_name = "N", default_value_t = 60)]
    seconds: u64,
    /// The timeout of each collective, in seconds.
    #[arg(long, value_name = "N", default_value_t = 10)]
    timeout_secs: u64,
}

fn run(args: &Args) -> Result<(), String> {
    let seconds = args.seconds;
    let timeout = args.timeout_secs;
    dist::init_process_group(
        "cpu",
        InitOptions {
            timeout: Duration::from_secs(timeout),
            ..InitOptions::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let world = dist::get_world_size(None).map_err(|e| e.to_string())?;
    dist::barrier(None).map_err(|e| e.to_string())?;
    println!("fault_loop: running");
    let start = Instant::now();
    let mut rounds = 0u64;
    while start.elapsed() < Duration::from_secs(seconds) {
        let x = Tensor::ones(&[64 << 10], DType::F32).map_err(|e| e.to_string())?;
        dist::all_reduce(&x, ReduceOp::Sum, None).map_err(|e| e.to_string())?;
        let v = x.to_vec::<f32>().map_err(|e| e.to_string())?;
        if v.iter().any(|&e| e != world as f32) {
            return Err(format!("round {rounds}: a wrong sum (expected {world})"));
        }
        rounds += 1;
    }
    println!("fault_loop: {rounds} rounds, no fault");
    dist::destroy_process_group().map_err(|e| e.to_string())?;
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            println!("fault_loop: failed: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
