//! A job for fault scenarios (`cargo xtask test-multihost`): joins the `env://` rendezvous
//! with a short collective timeout, prints `fault_loop: running` once every rank is in, then
//! all-reduces a 256 KiB tensor over and over, checking every result, until `--seconds` pass
//! or a collective fails. A failure is printed as `fault_loop: failed: <error>` and the process
//! exits 1, so the harness can check that every rank failed in time and named the lost ranks.
//!
//! Usage (one process per rank, under `tensorplay-run` or with `RANK` etc. set):
//! `fault_loop [--seconds N] [--timeout-secs N]`

use std::time::{Duration, Instant};

use tensorplay_collectives::{self as dist, InitOptions, ReduceOp};
use tensorplay_core::{DType, Tensor};

fn arg(name: &str, default: u64) -> Result<u64, String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{name} takes a whole number")),
        None => Ok(default),
    }
}

fn run() -> Result<(), String> {
    let seconds = arg("--seconds", 60)?;
    let timeout = arg("--timeout-secs", 10)?;
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
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            println!("fault_loop: failed: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
