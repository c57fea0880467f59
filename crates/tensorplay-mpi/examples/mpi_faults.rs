//! Faults under `mpirun`, for `cargo xtask test-mpi`: `timeout` (rank 1 stays out of an
//! all_reduce past the group's timeout: rank 0's error, and the job ends), `recv-timeout`
//! (rank 0's receive waits past the timeout inside MPI: the watchdog prints its report and
//! ends the job with exit code 124) and `killed` (rank 1 dies in a loop of all_reduces:
//! `mpirun` ends the job, which must not hang).

use std::time::Duration;

use clap::{Parser, ValueEnum};
use tensorplay::distributed as dist;

#[derive(Clone, Copy, ValueEnum)]
enum Mode {
    /// Rank 1 stays out of an all_reduce past the timeout (the cross-rank check times out on
    /// rank 0, which returns the error and exits: the job ends).
    Timeout,
    /// Rank 0 waits in a receive from rank 1, which sends nothing (an MPI call past the
    /// timeout: the watchdog ends the job with 124).
    RecvTimeout,
    /// Rank 1 aborts in a loop of all_reduces.
    Killed,
}

#[derive(Parser)]
#[command(about = "faults of the mpi backend under mpirun (cargo xtask test-mpi)")]
struct Args {
    /// The fault.
    #[arg(value_enum)]
    mode: Mode,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mode = Args::parse().mode;
    tensorplay_mpi::register();
    dist::init_process_group(
        "mpi",
        dist::InitOptions {
            timeout: Duration::from_secs(3),
            ..Default::default()
        },
    )?;
    let rank = dist::get_rank(None)?;
    let x = tensorplay::Tensor::ones(&[1024], tensorplay::DType::F32)?;
    match mode {
        Mode::Timeout => {
            dist::all_reduce(&x, dist::ReduceOp::Sum, None)?;
            if rank == 1 {
                // stays away past the timeout (the job is ended before this returns)
                std::thread::sleep(Duration::from_secs(30));
            }
            dist::all_reduce(&x, dist::ReduceOp::Sum, None)?;
        }
        Mode::RecvTimeout => {
            if rank == 0 {
                dist::recv(&x, 1, None, 5)?;
            } else {
                std::thread::sleep(Duration::from_secs(30));
            }
        }
        Mode::Killed => {
            for i in 0..1000 {
                if rank == 1 && i == 10 {
                    std::process::abort();
                }
                dist::all_reduce(&x, dist::ReduceOp::Sum, None)?;
            }
        }
    }
    println!("rank {rank}: finished (unexpected)");
    Ok(())
}
