//! Running the programs the commands drive: one child process, its output captured.

use std::process::Command;

/// Runs `cmd` to completion and returns its standard output; a failure to start or a non-zero
/// exit is an error quoting the command and both of its outputs.
pub(crate) fn run_capture(cmd: &mut Command) -> Result<String, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("could not start {cmd:?}: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed ({}):\n{}\n{}",
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(stdout)
}

/// A clap parser of whole numbers >= 1 (bad values exit with code 2 and clap's message).
pub(crate) fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
}

/// Cargo's target directory: `$CARGO_TARGET_DIR`, else the workspace's `target` (absolute).
pub(crate) fn target_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .unwrap_or_else(|| std::path::Path::new("."))
                .join("target")
        })
}
