//! The flagship job: the red-wine-quality MLP of `wine_quality` (same data, split, standardisation
//! and recipe: Adam lr 1e-3, minibatches of 64 in file order, 200 epochs, float32), trained
//! three times across two workers on 127.0.0.1, each run checked against the same model
//! trained in one process from the same initial weights:
//!
//! 1. **tensor-parallel** (2 ranks, a process group): the MLP split by a plan
//!    (`parallelize_module`): the first Linear (11 -> 64) column-parallel (each rank holds 32
//!    output features), the second (64 -> 64) row-parallel (each rank holds 32 input features;
//!    the partial outputs are summed across the ranks), the head replicated. Backward flows
//!    through the collectives.
//! 2. **parameter-server** (2 RPC workers, "trainer" and "ps"): the hidden layers live in a
//!    `RemoteModule` on "ps"; the trainer holds the head; distributed autograd carries the
//!    backward pass to "ps" and a `DistributedOptimizer` updates the parameters on both.
//! 3. **data-parallel** (2 ranks, a process group): each rank holds the whole MLP in a
//!    `DistributedDataParallel` and takes its share of every minibatch (rank 0 the first
//!    ceil(b/2) rows, rank 1 the rest); each backpropagates its mean loss scaled by its share
//!    of the rows, so the gradients DDP averages during backward are the whole minibatch's.
//!    The loss reported is the whole minibatch's, summed from the ranks' by an `all_reduce`.
//!
//! Each run prints one line `<run>: test accuracy 0.xxxx, max loss difference <e-notation>`
//! (the largest absolute difference of the losses of the first 200 steps against the
//! single-process reference); a summary table follows. The program exits non-zero when an
//! accuracy is below 0.58 or a loss difference reaches 1e-4.
//!
//! ```text
//! cargo run --release --example wine_distributed                    # starts its 2 workers
//! cargo run --release --example wine_distributed -- --plot loss.svg  # and draws the losses
//! tensorplay-run --nproc-per-node 2 target/release/examples/wine_distributed
//! ```
//!
//! Without `RANK`/`WORLD_SIZE` in the environment the program is rank 0 and starts rank 1 as a
//! second process of itself; under `tensorplay-run` (or any launcher setting `RANK`,
//! `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) each process takes its rank from there, so the
//! same binary runs across machines.
//!
//! One module per run: [`tensor_parallel`], [`parameter_server`], [`data_parallel`]; what they
//! share (the training loop, the single-process reference) is in [`train`], their reports and
//! the plot in [`report`], the command line in [`args`].

// built as a test harness too (its plot test): `main` and the training code then go unused
#![cfg_attr(test, allow(dead_code, unused_imports))]

mod args;
mod data_parallel;
mod parameter_server;
mod report;
mod tensor_parallel;
#[cfg(test)]
mod tests;
mod train;

use std::process::ExitCode;

use tensorplay_examples::launch;

use args::Opts;
use data_parallel::data_parallel;
use parameter_server::parameter_server;
use report::{Report, plot};
use tensor_parallel::tensor_parallel;
use train::max_diff;

pub(crate) type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

pub(crate) const BATCH: usize = 64;
pub(crate) const HIDDEN: usize = 64;
/// Steps compared with the single-process reference.
pub(crate) const COMPARE_STEPS: usize = 200;
pub(crate) const MAX_LOSS_DIFF: f64 = 1e-4;
pub(crate) const MIN_ACCURACY: f64 = 0.58;
pub(crate) const WORLD: usize = 2;
/// The most epochs `--epochs` accepts (the run keeps one loss per epoch).
pub(crate) const MAX_EPOCHS: usize = 1_000_000;

fn run(o: &Opts) -> Res<bool> {
    let (rank, init, children) = launch::launch(WORLD)?;
    let result = (|| -> Res<(Report, Report, Report)> {
        let tp = tensor_parallel(rank, &init, o)?;
        let ps = parameter_server(rank, &init, o)?;
        let dp = data_parallel(rank, &init, o)?;
        Ok((tp, ps, dp))
    })();
    let (tp, ps, dp) = launch::join(children, result)?;
    if rank != 0 {
        return Ok(true);
    }
    let runs = [
        ("tensor-parallel", &tp),
        ("parameter-server", &ps),
        ("data-parallel", &dp),
    ];
    let mut ok = true;
    for (name, r) in runs {
        let diff = max_diff(&r.losses, &r.reference);
        println!(
            "{name}: test accuracy {:.4}, max loss difference {diff:.2e}",
            r.accuracy
        );
        if r.accuracy < MIN_ACCURACY {
            eprintln!(
                "check failed: {name} test accuracy {:.4} < {MIN_ACCURACY}",
                r.accuracy
            );
            ok = false;
        }
        if diff.is_nan() || diff >= MAX_LOSS_DIFF || r.losses.len() != r.reference.len() {
            eprintln!("check failed: {name} loss difference {diff:e} >= {MAX_LOSS_DIFF:e}");
            ok = false;
        }
    }
    println!();
    println!(
        "{:<18} {:>10} {:>18} {:>12}",
        "run", "wall time", "collective bytes", "RPC bytes"
    );
    for (name, r) in runs {
        println!(
            "{name:<18} {:>9.1}s {:>15.1} MB {:>9.1} MB",
            r.wall.as_secs_f64(),
            r.collective_bytes as f64 / 1e6,
            r.rpc_bytes as f64 / 1e6
        );
    }
    if let Some(p) = &o.plot {
        plot(p, &runs).map_err(|e| format!("writing the plot to {}: {e}", p.display()))?;
        println!("\nloss curves written to {}", p.display());
    }
    Ok(ok)
}

fn main() -> ExitCode {
    let o = match args::parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match run(&o) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            launch::report(&e);
            ExitCode::FAILURE
        }
    }
}
