//! `tensorplay-fr [DIR]`: reads the flight-recorder dumps of a failed or hung job (one
//! `rank<R>.json` per process, written on a timeout, a peer failure, another rank's request,
//! or `dist::dump_flight_recorder()`) and prints the diagnosis: per process group, the earliest
//! operation that did not finish everywhere, which ranks wait in it, and which rank is behind
//! (never called it), in a different operation, failed, or left no dump, with call sites.
//!
//! DIR defaults to `TENSORPLAY_FR_DIR`, else the folder of the job named by `MASTER_ADDR` and
//! `MASTER_PORT`. Exits 1 when DIR holds no dump, 2 on bad arguments.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use tensorplay_collectives::recorder;

/// Reads a failed or hung job's flight-recorder dumps and prints the diagnosis.
#[derive(Parser, Debug)]
#[command(
    name = "tensorplay-fr",
    version,
    about = "Read the flight-recorder dumps of a failed or hung tensorplay job (one rank<R>.json \
             per process) and print the diagnosis: per process group, the earliest operation that \
             did not finish everywhere, and which rank is behind, elsewhere, failed or silent."
)]
struct Args {
    /// The folder of a job's flight-recorder dumps (the failed job's error names it). Default:
    /// `TENSORPLAY_FR_DIR`, else the folder of the job named by `MASTER_ADDR` and `MASTER_PORT`.
    dir: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let from_env = std::env::var_os(recorder::FR_DIR_ENV).is_some()
        || (std::env::var_os("MASTER_ADDR").is_some() && std::env::var_os("MASTER_PORT").is_some());
    if args.dir.is_none() && !from_env {
        Args::command()
            .error(
                clap::error::ErrorKind::MissingRequiredArgument,
                "DIR is required here: the folder of a job's flight-recorder dumps (the failed \
                 job's error names it; without DIR, TENSORPLAY_FR_DIR or MASTER_ADDR and \
                 MASTER_PORT say where it is)",
            )
            .exit();
    }
    let dir = args.dir.unwrap_or_else(recorder::dump_dir);
    match recorder::read_dumps(&dir) {
        Ok((dumps, notes)) => {
            println!(
                "flight recorder: {} dump(s) in {}",
                dumps.len(),
                dir.display()
            );
            for d in &dumps {
                println!("  rank {} (pid {}): {}", d.rank, d.pid, d.reason);
            }
            for n in notes {
                println!("  {n}");
            }
            print!("{}", recorder::diagnose(&dumps));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tensorplay-fr: {e}");
            ExitCode::FAILURE
        }
    }
}
