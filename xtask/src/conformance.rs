//! `conformance --vectors FILE [--backend nccl] [--dtype bfloat16]`: builds and runs the `tensorplay-conformance`
//! program (`crates/tensorplay-conformance`) on a vectors file, one world of processes per
//! world size in the file; it ends with `N passed, M failed`.

use std::path::PathBuf;
use std::process::Command;

/// The flags of `conformance`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// The vectors file (format: conformance/README.md).
    #[arg(long)]
    pub(crate) vectors: PathBuf,
    /// Process-group backend: "cpu", or "nccl" on a GPU machine.
    #[arg(long, default_value = "cpu")]
    pub(crate) backend: String,
    /// Timeout of each collective, in seconds.
    #[arg(long, default_value_t = 30)]
    pub(crate) timeout: u64,
    /// The dtype the cases run in: float64 (the files'), float32, bfloat16 or float16.
    #[arg(long, default_value = "float64")]
    pub(crate) dtype: String,
}

pub(crate) fn run(args: &Args) -> Result<(), String> {
    // resolve the path before cargo changes directory
    let vectors = std::fs::canonicalize(&args.vectors)
        .map_err(|e| format!("cannot read {}: {e}", args.vectors.display()))?;
    // the first build takes minutes: let cargo show it
    let built = Command::new("cargo")
        .args(["build", "-p", "tensorplay-conformance"])
        .status()
        .map_err(|e| format!("could not run cargo: {e}"))?;
    if !built.success() {
        return Err(format!("building tensorplay-conformance failed ({built})"));
    }
    let status = Command::new("cargo")
        .args(["run", "-q", "-p", "tensorplay-conformance", "--"])
        .arg("--vectors")
        .arg(&vectors)
        .args(["--backend", &args.backend])
        .args(["--timeout", &args.timeout.to_string()])
        .args(["--dtype", &args.dtype])
        .status()
        .map_err(|e| format!("could not run cargo: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("conformance failed ({status})"))
    }
}
