//! A job for RPC fault scenarios (`cargo xtask test-multihost`): every worker (`worker<rank>`)
//! calls every other worker in turn with `rpc_sync`, echoing a 64 KiB tensor and checking it,
//! prints `rpc_fault_loop: running` after its first full round, and goes on until `--seconds`
//! pass or a call fails. A failure is printed as `rpc_fault_loop: failed: <error>` and the
//! process exits 1, so the harness can check that every worker failed in time and named the
//! workers it lost.
//!
//! Usage (one process per worker, under `tensorplay-run` or with `RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT` set): `rpc_fault_loop [--seconds N] [--timeout-secs N]`

use std::time::{Duration, Instant};

use clap::Parser;
use tensorplay_core::{DType, Tensor};
use tensorplay_rpc as rpc;

/// The fault job's command line.
#[derive(Parser, Debug)]
#[command(
    name = "rpc_fault_loop",
    about = "A job for fault scenarios (`cargo xtask test-multihost`): rpc_sync calls over and over, \
             one process per rank under tensorplay-run, until --seconds pass or one fails."
)]
struct Args {
    /// How long to go on without a fault, in seconds.
    #[arg(long, value_name = "N", default_value_t = 60)]
    seconds: u64,
    /// The timeout of each call, in seconds.
    #[arg(long, value_name = "N", default_value_t = 10)]
    timeout_secs: u64,
}

fn env(name: &str) -> Result<usize, String> {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("{name} must be set to a whole number (start under tensorplay-run)"))
}

fn run(args: &Args) -> Result<(), String> {
    let seconds = args.seconds;
    let timeout = Duration::from_secs(args.timeout_secs);
    let (rank, world) = (env("RANK")?, env("WORLD_SIZE")?);
    rpc::register("echo", |t: Tensor| Ok(t));
    rpc::init_rpc(
        &format!("worker{rank}"),
        rank,
        world,
        rpc::RpcBackendOptions {
            rpc_timeout: timeout,
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let x = Tensor::full(&[16 << 10], rank as f64 + 0.5, DType::F32).map_err(|e| e.to_string())?;
    let start = Instant::now();
    let mut rounds = 0u64;
    while start.elapsed() < Duration::from_secs(seconds) {
        for peer in (0..world).filter(|&p| p != rank) {
            let y: Tensor =
                rpc::rpc_sync(peer, "echo", x.clone(), None).map_err(|e| e.to_string())?;
            let v = y.to_vec::<f32>().map_err(|e| e.to_string())?;
            if v.len() != 16 << 10 || v.iter().any(|&e| e != rank as f32 + 0.5) {
                return Err(format!(
                    "round {rounds}: worker{peer} echoed a wrong tensor"
                ));
            }
        }
        if rounds == 0 {
            println!("rpc_fault_loop: running");
        }
        rounds += 1;
    }
    println!("rpc_fault_loop: {rounds} rounds, no fault");
    rpc::shutdown(true).map_err(|e| e.to_string())
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            println!("rpc_fault_loop: failed: {e}");
            // the others are failing too: do not wait for them
            let _ = rpc::shutdown(false);
            std::process::ExitCode::FAILURE
        }
    }
}
