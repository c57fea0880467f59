//! `cargo xtask gpu-check [--bundle DIR]`: the GPU check as a self-contained bundle. Builds
//! `tensorplay-gpu-check` and the `wine_quality` example (release, stripped) and writes them
//! with PyTorch's `torch_cuda_step.py` anchor and a `run.sh` into `DIR`, which a GPU machine
//! runs without a Rust toolchain; without `--bundle` it builds the bundle in a temporary folder
//! and runs it here.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::bench::anchor::DEFAULT_ANCHORS;
use crate::packages::{GPU_CHECK_PACKAGE, WINE_QUALITY_PACKAGE};

/// The flags of `gpu-check`.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Only build the bundle into this folder.
    #[arg(long)]
    pub(crate) bundle: Option<PathBuf>,
    /// Folder holding the PyTorch anchor scripts (the bundle takes `torch_cuda_step.py`).
    #[arg(long, env = "TENSORPLAY_ANCHORS", default_value = DEFAULT_ANCHORS)]
    pub(crate) anchors: PathBuf,
}

/// The most a bundle may weigh (what the device tool carries).
const MAX_BYTES: u64 = 64 << 20;

const RUN_SH: &str = r#"#!/bin/sh
# The tensorplay GPU check: every core operation and its gradient on cuda:0 against the CPU,
# the fused optimizers, an MLP, wine_quality --device cuda, the first example on nccl, a
# RemoteModule on worker1/cuda:0, NCCL at world size 1, the NCCL timeout path, CUDA copies and
# RPC of CUDA tensors. Prints `N passed, M failed, K skipped`, then the core benchmark's GPU
# rows beside PyTorch's (`--python PATH` names an interpreter with torch; `--no-bench` skips
# them). Exits non-zero when a check failed or when there is no GPU (then nothing was checked).
# Needs the NVIDIA driver and NVRTC (libnvrtc.so.13 or .12; TENSORPLAY_NVRTC=FILE names
# another), cuBLAS for matrix products and NCCL for the collectives.
case "$1" in -h|--help) sed -n '2,10p' "$0"; exit 0;; esac
here="$(cd "$(dirname "$0")" && pwd)"
export TENSORPLAY_SPAWN_VERBOSE="${TENSORPLAY_SPAWN_VERBOSE:-0}"
exec "$here/tensorplay-gpu-check" "$@"
"#;

/// Builds the bundle into `dir`; returns the path of `run.sh`.
pub(crate) fn bundle(dir: &Path, anchors: &Path) -> Result<PathBuf, String> {
    let status = Command::new("cargo")
        .args([
            "build",
            "--release",
            "-p",
            GPU_CHECK_PACKAGE,
            "--bin",
            "tensorplay-gpu-check",
            "-p",
            WINE_QUALITY_PACKAGE,
            "--example",
            "wine_quality",
        ])
        .env("CARGO_PROFILE_RELEASE_STRIP", "true")
        .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .status()
        .map_err(|e| format!("could not run cargo build: {e}"))?;
    if !status.success() {
        return Err(format!(
            "cargo build of tensorplay-gpu-check failed ({status})"
        ));
    }
    let target = crate::process::target_dir();
    let bin = target.join("release/tensorplay-gpu-check");
    std::fs::create_dir_all(dir).map_err(|e| format!("could not create {}: {e}", dir.display()))?;
    let dest = dir.join("tensorplay-gpu-check");
    std::fs::copy(&bin, &dest).map_err(|e| format!("could not copy {}: {e}", bin.display()))?;
    let wine_bin = target.join("release/examples/wine_quality");
    let wine = dir.join("wine_quality");
    std::fs::copy(&wine_bin, &wine)
        .map_err(|e| format!("could not copy {}: {e}", wine_bin.display()))?;
    let anchor = anchors.join("torch_cuda_step.py");
    let torch = dir.join("torch_cuda_step.py");
    match std::fs::copy(&anchor, &torch) {
        Ok(_) => {}
        Err(e) => eprintln!(
            "note: {} not copied ({e}): the bundle's benchmark will print ours only",
            anchor.display()
        ),
    }
    let run = dir.join("run.sh");
    std::fs::write(&run, RUN_SH).map_err(|e| format!("could not write {}: {e}", run.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("could not make run.sh executable: {e}"))?;
    }
    let size: u64 = [&dest, &wine, &torch, &run]
        .iter()
        .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
        .sum();
    if size > MAX_BYTES {
        return Err(format!(
            "the bundle is {} MiB, over the 64 MiB limit",
            size >> 20
        ));
    }
    println!(
        "gpu-check bundle: {} ({:.1} MiB); run {}",
        dir.display(),
        size as f64 / 1048576.0,
        run.display()
    );
    Ok(run)
}

/// `cargo xtask gpu-check [--bundle DIR] [--anchors DIR]`.
pub(crate) fn run(args: &Args) -> Result<(), String> {
    if let Some(dir) = &args.bundle {
        return bundle(dir, &args.anchors).map(|_| ());
    }
    let dir = std::env::temp_dir().join(format!("tensorplay-gpu-check-{}", std::process::id()));
    let run = bundle(&dir, &args.anchors)?;
    let status = Command::new("sh").arg(&run).status();
    let _ = std::fs::remove_dir_all(&dir);
    let status = status.map_err(|e| format!("could not run {}: {e}", run.display()))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("the GPU check did not pass ({status})"))
    }
}
