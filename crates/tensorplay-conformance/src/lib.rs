//! `tensorplay-conformance`: runs files of conformance vectors against the differentiable
//! collectives of `tensorplay-distributed-nn` (`tensorplay::distributed::nn::functional`).
//!
//! The format (one JSON record per case and rank, the loss weights, the comparison rule, the
//! run order and the failure line) is described in `conformance/README.md` at the root of the
//! repository. [`run_file`] launches one world of real processes (through
//! [`spawn`](tensorplay_collectives::spawn())) for every world size in the file, rebuilds each
//! case on every rank, runs forward and backward, and compares outputs and gradients.
//!
//! `cargo xtask conformance --vectors FILE` is the command-line front end; this crate's tests
//! run the vector files of the repository.
//!
//! Because [`run_file`] uses `spawn`, which re-executes the current program, call it from
//! `main` (or a test) before anything that must not run once per rank; in a spawned child it
//! runs the child's share of the work and exits.

mod case;
mod compare;
mod execute;
mod record;
mod run;
mod summary;
mod world;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use compare::{RTOL, tolerance};
pub use execute::weight;
pub use record::{Record, TensorData, load};
pub use run::{RunOptions, run_file};
pub use summary::Summary;

/// Errors of the runner itself (not of the vectors under test, which are reported as failing
/// records).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The vectors file could not be read.
    #[error("cannot read {path}: {source}", path = .0.display(), source = .1)]
    Io(PathBuf, std::io::Error),
    /// The vectors file is not a JSON array of records.
    #[error("{path} is not a conformance vectors file (a JSON array of records): {source}", path = .0.display(), source = .1)]
    Parse(PathBuf, serde_json::Error),
    /// `RunOptions::dtype` is not a floating dtype (the cases differentiate their inputs).
    #[error(
        "RunOptions::dtype: expected a floating dtype (float64, float32, bfloat16 or float16), got {0}"
    )]
    Dtype(tensorplay_core::DType),
}
