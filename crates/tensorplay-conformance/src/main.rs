//! `tensorplay-conformance --vectors FILE [--backend cpu|nccl] [--timeout SECONDS]
//! [--dtype float64|float32|bfloat16|float16]`: runs a
//! conformance vectors file against the differentiable collectives, one world of processes per
//! world size in the file. Prints one `FAIL ...` line per failing record and ends with
//! `N passed, M failed`; exits with status 1 when a record failed, 2 when the file cannot be
//! read. `cargo xtask conformance` runs this program.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tensorplay_conformance::{RunOptions, run_file};
use tensorplay_core::DType;

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
    /// The dtype the cases run in: float64 (the files'), float32, bfloat16 or float16;
    /// expected values are rounded to it and compared within its tolerance.
    #[arg(long, default_value = "float64", value_parser = parse_dtype)]
    dtype: DType,
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    match s {
        "float64" | "f64" => Ok(DType::F64),
        "float32" | "f32" => Ok(DType::F32),
        "bfloat16" | "bf16" => Ok(DType::BF16),
        "float16" | "f16" => Ok(DType::F16),
        _ => Err(format!(
            "{s:?}: expected float64, float32, bfloat16 or float16"
        )),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let opts = RunOptions {
        backend: args.backend,
        timeout: Duration::from_secs(args.timeout),
        dtype: args.dtype,
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
