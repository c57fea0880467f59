//! The NCCL backend's CPU-side paths, which every machine can check: no CUDA driver, no NCCL
//! library, a GPU index the machine lacks, an unknown backend name; and that the crates below
//! never pull in cudarc. On a machine with a GPU the driver test checks that a world of one
//! initialises instead. The GPU paths themselves run in `cargo xtask gpu-check`.

use std::time::Duration;

use tensorplay as tp;
use tp::distributed::{self as dist, InitOptions};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

#[test]
fn without_a_driver_nccl_is_a_clear_error() -> TestResult {
    dist::spawn(1, |_rank| -> TestResult {
        let r = dist::init_process_group(
            "nccl",
            InitOptions {
                timeout: Duration::from_secs(20),
                ..Default::default()
            },
        );
        if tp::cuda::is_available() {
            // a GPU machine: a world of one on cuda:0 must come up
            r?;
            assert_eq!(dist::get_backend(None)?, "nccl");
            dist::destroy_process_group()?;
            return Ok(());
        }
        let e = r.unwrap_err().to_string();
        assert!(
            e.contains("libcuda") || e.contains("GPU"),
            "the error names the missing driver or GPU: {e}"
        );
        assert!(
            e.contains("\"cpu\""),
            "it names the backend to use instead: {e}"
        );
        Ok(())
    })?;
    Ok(())
}

#[test]
fn a_missing_library_names_where_it_looked() -> TestResult {
    let dir = std::env::temp_dir().join(format!("tensorplay-nccl-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let r = tensorplay_nccl::library_in(std::slice::from_ref(&dir));
    let _ = std::fs::remove_dir_all(&dir);
    match r {
        // NCCL is on this machine's loader path: it was found by name
        Ok(path) => assert!(path.contains("libnccl"), "{path}"),
        Err(e) => {
            assert!(e.contains("libnccl.so.2") && e.contains("not found"), "{e}");
            assert!(
                e.contains(&dir.display().to_string()),
                "names the folder searched: {e}"
            );
            assert!(e.contains("LD_LIBRARY_PATH"), "says what to do: {e}");
        }
    }
    // the default search includes the system folders
    let dirs = tensorplay_nccl::search_dirs();
    assert!(dirs.iter().any(|d| d.ends_with("lib64")), "{dirs:?}");
    Ok(())
}

#[test]
fn a_gpu_index_the_machine_lacks_is_refused() {
    assert_eq!(tensorplay_nccl::device_for(0, 0, 1).ok(), Some(0));
    assert_eq!(tensorplay_nccl::device_for(5, 1, 2).ok(), Some(1));
    let e = tensorplay_nccl::device_for(3, 2, 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank 3") && e.contains("cuda:2") && e.contains("1 GPU"),
        "{e}"
    );
    let e = tensorplay_nccl::device_for(0, 0, 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("0 GPU"), "{e}");
}

#[test]
fn an_unknown_backend_lists_the_registered_ones() -> TestResult {
    dist::spawn(1, |_rank| -> TestResult {
        let e = dist::init_process_group(
            "mpi",
            InitOptions {
                timeout: Duration::from_secs(20),
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("unknown backend")
                && e.contains("\"nccl\"")
                && e.contains("register_backend"),
            "{e}"
        );
        assert!(!dist::is_initialized());
        Ok(())
    })?;
    Ok(())
}

/// `tensorplay-collectives` and `tensorplay-rpc` build the core without CUDA: no cudarc in
/// their normal dependencies.
#[test]
fn the_host_only_crates_do_not_depend_on_cudarc() -> TestResult {
    let cargo = env!("CARGO");
    let tree = |krate: &str| -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
        let out = std::process::Command::new(cargo)
            .args(["tree", "--offline", "-e", "normal", "-p", krate])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()?;
        if !out.status.success() {
            return Err(format!(
                "cargo tree -p {krate}: {}",
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    for krate in [
        "tensorplay-collectives",
        "tensorplay-rpc",
        "tensorplay-core",
    ] {
        let t = tree(krate)?;
        assert!(t.contains(krate), "{t}");
        assert!(!t.contains("cudarc"), "{krate} pulls in cudarc:\n{t}");
    }
    // and this crate does (it enables the core's `cuda`)
    assert!(tree("tensorplay-nccl")?.contains("cudarc"));
    Ok(())
}
