//! The GPU check's behaviour on a machine without GPUs (the CI machine).

use std::process::Command;

/// The GPU check never reports checks that did not run: without a driver or GPU it says why
/// and exits 2; with one it ends with `N passed, M failed, K skipped`.
#[test]
fn gpu_check_without_a_gpu_says_why_and_fails() {
    let out = Command::new(env!("CARGO_BIN_EXE_tensorplay-gpu-check"))
        .env("TENSORPLAY_SPAWN_VERBOSE", "0")
        .output()
        .expect("run tensorplay-gpu-check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if tensorplay::cuda::is_available() {
        assert!(
            stdout
                .lines()
                .any(|l| l.contains(" passed, ") && l.contains(" failed, ")),
            "{stdout}{stderr}"
        );
        return;
    }
    assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
    assert!(stderr.contains("nothing was checked"), "{stderr}");
    assert!(!stdout.contains("passed"), "{stdout}");
}
