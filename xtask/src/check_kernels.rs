//! `cargo xtask check-kernels`: the CUDA kernels on a machine without a GPU.
//!
//! 1. Their logic: the host emulation's tests (`cuda::` in the core's unit tests, built with
//!    the feature `cuda-emulator`, which the test kit turns on), every kernel family against
//!    the CPU's operations.
//! 2. Their build: NVIDIA's compiler wheels from PyPI (NVRTC and ptxas of CUDA 12.9 and 13.5,
//!    pinned, cached under `target/nvidia-wheels`) compile every kernel through the same code
//!    the GPU path runs and assemble it for each supported architecture.

use std::path::{Path, PathBuf};
use std::process::Command;

/// (package, version, files wanted from it): what each CUDA major needs.
struct Toolchain {
    name: &'static str,
    wheels: [(&'static str, &'static str); 2],
    nvrtc: &'static str,
    ptxas: &'static str,
    archs: &'static str,
}

const TOOLCHAINS: [Toolchain; 2] = [
    Toolchain {
        name: "CUDA 12.9",
        wheels: [
            ("nvidia-cuda-nvrtc-cu12", "12.9.86"),
            ("nvidia-cuda-nvcc-cu12", "12.9.86"),
        ],
        nvrtc: "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
        ptxas: "nvidia/cuda_nvcc/bin/ptxas",
        archs: "80,90",
    },
    Toolchain {
        name: "CUDA 13.5",
        wheels: [
            ("nvidia-cuda-nvrtc", "13.5.37"),
            ("nvidia-cuda-nvcc", "13.5.37"),
        ],
        nvrtc: "nvidia/cu13/lib/libnvrtc.so.13",
        ptxas: "nvidia/cu13/bin/ptxas",
        archs: "90,100",
    },
];

/// Downloads (once) and unpacks the libnvrtc and ptxas files of `t` under `cache`.
fn fetch(t: &Toolchain, cache: &Path) -> Result<(PathBuf, PathBuf), String> {
    // a toolchain folder appears whole or not at all: it is unpacked beside its place and
    // renamed into it, so an interrupted run never leaves a folder the next one trusts
    let root = cache.join(t.wheels[0].1);
    let (nvrtc, ptxas) = (root.join(t.nvrtc), root.join(t.ptxas));
    if root.is_dir() {
        return Ok((nvrtc, ptxas));
    }
    let partial = cache.join(format!("{}.partial", t.wheels[0].1));
    let _ = std::fs::remove_dir_all(&partial);
    let dl = cache.join("downloads");
    for (pkg, ver) in t.wheels {
        let status = Command::new("python3")
            .args([
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
            ])
            .arg("--dest")
            .arg(&dl)
            .arg(format!("{pkg}=={ver}"))
            .status()
            .map_err(|e| format!("running python3 -m pip: {e}"))?;
        if !status.success() {
            return Err(format!("pip could not download {pkg}=={ver} ({status})"));
        }
    }
    // unpack only the libraries and ptxas (the wheels are zip files)
    let script = r#"
import glob, os, sys, zipfile
dl, root, ver = sys.argv[1], sys.argv[2], sys.argv[3]
for w in glob.glob(os.path.join(dl, "*-" + ver + "-*.whl")):
    with zipfile.ZipFile(w) as z:
        for n in z.namelist():
            if "/lib/libnvrtc" in n or n.endswith("/bin/ptxas"):
                z.extract(n, root)
"#;
    let status = Command::new("python3")
        .args(["-c", script])
        .arg(&dl)
        .arg(&partial)
        .arg(t.wheels[0].1)
        .status()
        .map_err(|e| format!("running python3: {e}"))?;
    let (p_nvrtc, p_ptxas) = (partial.join(t.nvrtc), partial.join(t.ptxas));
    if !status.success() || !p_nvrtc.exists() || !p_ptxas.exists() {
        return Err(format!(
            "unpacking {} gave no {} and {}",
            t.name,
            p_nvrtc.display(),
            p_ptxas.display()
        ));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p_ptxas, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("chmod {}: {e}", p_ptxas.display()))?;
    }
    std::fs::rename(&partial, &root)
        .map_err(|e| format!("renaming {} into place: {e}", partial.display()))?;
    let _ = std::fs::remove_dir_all(&dl);
    Ok((nvrtc, ptxas))
}

fn cargo_test(args: &[&str], env: &[(&str, &Path)], archs: Option<&str>) -> Result<(), String> {
    let mut c = Command::new("cargo");
    c.arg("test").args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    if let Some(a) = archs {
        c.env("TENSORPLAY_KERNEL_ARCHS", a);
    }
    let status = c.status().map_err(|e| format!("running cargo test: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("cargo test {} failed ({status})", args.join(" ")))
    }
}

/// Runs both checks; `Err` names the first that failed.
pub(crate) fn run() -> Result<(), String> {
    println!("== the kernels' logic: the host emulation against the CPU");
    // `--workspace` and no features: the build `cargo test --workspace` made (the test kit
    // turns the emulator on), reused; `-p` or `--features` would resolve other features for
    // the dependencies and compile everything again
    cargo_test(&["--workspace", "--lib", "--", "cuda::"], &[], None)?;
    let target = crate::process::target_dir();
    // absolute: the tests run in their crate's folder and dlopen the path as given
    let cache = std::env::current_dir()
        .map_err(|e| format!("the current folder: {e}"))?
        .join(target)
        .join("nvidia-wheels");
    for t in &TOOLCHAINS {
        println!(
            "== the kernels' build with {} (NVRTC, then ptxas for sm_{})",
            t.name, t.archs
        );
        let (nvrtc, ptxas) = fetch(t, &cache)?;
        cargo_test(
            &[
                "--workspace",
                "--test",
                "it",
                "--",
                "cuda_kernels::",
                "--ignored",
                "--nocapture",
            ],
            &[("TENSORPLAY_NVRTC", &nvrtc), ("TENSORPLAY_PTXAS", &ptxas)],
            Some(t.archs),
        )?;
    }
    println!(
        "check-kernels: the emulated kernels match the CPU; every kernel compiles and assembles with CUDA 12.9 and 13.5"
    );
    Ok(())
}
