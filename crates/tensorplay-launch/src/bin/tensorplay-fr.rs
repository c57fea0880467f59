//! `tensorplay-fr [DIR]`: reads the flight-recorder dumps of a failed or hung job (one
//! `rank<R>.json` per process, written on a timeout, a peer failure, another rank's request,
//! or `dist::dump_flight_recorder()`) and prints the diagnosis: per process group, the earliest
//! operation that did not finish everywhere, which ranks wait in it, and which rank is behind
//! (never called it), in a different operation, failed, or left no dump, with call sites.
//!
//! DIR defaults to `TENSORPLAY_FR_DIR`, else the folder of the job named by `MASTER_ADDR` and
//! `MASTER_PORT`. Exits 1 when DIR holds no dump.

use std::path::PathBuf;
use std::process::ExitCode;

use tensorplay_collectives::recorder;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") || args.len() > 1 {
        eprintln!("usage: tensorplay-fr [DIR]   (the folder of a job's flight-recorder dumps)");
        return ExitCode::from(if args.len() > 1 { 2 } else { 0 });
    }
    let from_env = std::env::var_os(recorder::FR_DIR_ENV).is_some()
        || (std::env::var_os("MASTER_ADDR").is_some() && std::env::var_os("MASTER_PORT").is_some());
    if args.is_empty() && !from_env {
        eprintln!(
            "usage: tensorplay-fr DIR   (the folder of a job's flight-recorder dumps: the failed job's error names it; without DIR, TENSORPLAY_FR_DIR or MASTER_ADDR and MASTER_PORT say where it is)"
        );
        return ExitCode::from(2);
    }
    let dir = args.first().map_or_else(recorder::dump_dir, PathBuf::from);
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
