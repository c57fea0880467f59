//! `tensorplay-conformance --vectors FILE [--backend cpu|nccl] [--timeout SECONDS]`: runs a
//! conformance vectors file against the differentiable collectives, one world of processes per
//! world size in the file. Prints one `FAIL ...` line per failing record and ends with
//! `N passed, M failed`; exits with status 1 when a record failed, 2 when the file cannot be
//! read. `cargo xtask conformance` runs this program.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tensorplay_conformance::{RunOptions, run_file};

#[derive(Parser)]
#[command(
    name = "tensorplay-conformance",
    about = "Checks tensorplay's differentiable collectives against a conformance vectors file"
)]
struct Args {
    /// The vectors file (a JSON array of records; format in conformance/README.md).
    #[arg(long)]
    vectors: PathBuf,
    /// Process-group backend: "cpu", or "nccl" on a machine with GPUs.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Timeout of each collective, in seconds.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let opts = RunOptions {
        backend: args.backend,
        timeout: Duration::from_secs(args.timeout),
        ..RunOptions::default()
    };
    // the children's own lines would repeat the parent's summary: keep them quiet
    if std::env::var_os("TENSORPLAY_SPAWN_VERBOSE").is_none() {
        // SAFETY: single-threaded at this point (nothing spawned yet)
        unsafe { std::env::set_var("TENSORPLAY_SPAWN_VERBOSE", "0") };
    }
    match run_file(&args.vectors, &opts) {
        Ok(summary) => {
            println!("{summary}");
            if summary.failed == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("tensorplay-conformance: {e}");
            ExitCode::from(2)
        }
    }
}
