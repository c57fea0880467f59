//! The CUDA kernels compile with NVRTC and assemble with ptxas for every supported
//! architecture, on a machine without a GPU. Run by `cargo xtask check-kernels` (in CI), which
//! fetches NVIDIA's compiler wheels and names their files in `TENSORPLAY_NVRTC` and
//! `TENSORPLAY_PTXAS`; ignored otherwise, because it needs them.

use std::process::Command;

use tensorplay::cuda;

/// Every kernel tensorplay.cu defines (the host emulation's tests check the same list).
fn kernel_names() -> Vec<String> {
    let all = ["f32", "f64", "i64", "bool", "bf16", "f16"];
    let mut want = vec!["tp_dropout_mask".to_string()];
    for s in all {
        for k in ["unary", "cmp", "where", "index_select", "gather"] {
            want.push(format!("tp_{k}_{s}"));
        }
        for d in all {
            want.push(format!("tp_copy_{s}_{d}"));
        }
    }
    for s in ["f32", "f64", "i64", "bf16", "f16"] {
        for k in ["binary", "reduce", "scatter_add"] {
            want.push(format!("tp_{k}_{s}"));
        }
    }
    for s in ["f32", "f64", "bf16", "f16"] {
        want.push(format!("tp_cross_entropy_{s}"));
    }
    // 16-bit reductions' float32 partials; no 16-bit optimizer kernels (float32 masters)
    for s in ["bf16", "f16"] {
        want.push(format!("tp_reduce_{s}_part"));
        want.push(format!("tp_reduce_{s}_final"));
    }
    for s in ["f32", "f64"] {
        for k in ["sgd", "adam"] {
            want.push(format!("tp_{k}_{s}"));
        }
    }
    want
}

#[test]
#[ignore = "needs NVRTC and ptxas: run by `cargo xtask check-kernels`"]
fn kernels_compile_and_assemble_for_every_architecture() {
    let nvrtc = std::env::var("TENSORPLAY_NVRTC").expect(
        "TENSORPLAY_NVRTC must name the libnvrtc to check with (cargo xtask check-kernels sets it)",
    );
    let ptxas = std::env::var("TENSORPLAY_PTXAS").expect("TENSORPLAY_PTXAS must name ptxas");
    let archs = std::env::var("TENSORPLAY_KERNEL_ARCHS").unwrap_or_else(|_| "80,90".into());
    let (major, minor) = cuda::nvrtc_version().expect("NVRTC loads");
    let dir = std::env::temp_dir().join(format!("tensorplay-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary folder");
    let names = kernel_names();
    for arch in archs.split(',') {
        let a: u32 = arch
            .trim()
            .parse()
            .expect("TENSORPLAY_KERNEL_ARCHS: numbers such as 80,90");
        let case = format!("compute_{a} with NVRTC {major}.{minor} ({nvrtc})");
        let (ptx, file) =
            cuda::compile_kernels((a / 10, a % 10)).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!(file, nvrtc, "{case}: loaded another NVRTC");
        let entries = ptx.matches(".entry ").count();
        for n in &names {
            assert!(
                ptx.contains(&format!(".entry {n}(")),
                "{case}: the PTX lacks kernel {n}"
            );
        }
        assert_eq!(entries, names.len(), "{case}: kernels that no plan names");
        let src = dir.join(format!("tensorplay_{a}.ptx"));
        std::fs::write(&src, &ptx).expect("write PTX");
        let out = Command::new(&ptxas)
            .arg(format!("-arch=sm_{a}"))
            .arg(&src)
            .arg("-o")
            .arg(dir.join(format!("tensorplay_{a}.cubin")))
            .output()
            .unwrap_or_else(|e| panic!("running {ptxas}: {e}"));
        assert!(
            out.status.success(),
            "{case}: ptxas -arch=sm_{a} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // the machine code the device path loads when NVRTC knows the device
        let (cubin, _) = cuda::compile_kernels_binary((a / 10, a % 10))
            .unwrap_or_else(|e| panic!("{case}: the cubin for sm_{a}: {e}"));
        assert!(
            cubin.starts_with(b"\x7fELF"),
            "{case}: the cubin for sm_{a} is not an ELF file"
        );
        println!(
            "{case}: {entries} kernels, PTX {} KiB assembled for sm_{a}, cubin {} KiB",
            ptx.len() / 1024,
            cubin.len() / 1024
        );
    }
    std::fs::remove_dir_all(&dir).expect("remove the temporary folder");
}

#[test]
fn a_missing_nvrtc_is_reported_not_a_panic() {
    // without the variable pointing at a real library this is the message users see; with
    // it (check-kernels), compiling works
    if std::env::var_os("TENSORPLAY_NVRTC").is_some() {
        return;
    }
    match cuda::compile_kernels((8, 0)) {
        Ok(_) => {} // a machine with NVRTC installed
        Err(e) => {
            let m = e.to_string();
            assert!(m.contains("NVRTC") && m.contains("libnvrtc.so.13"), "{m}");
        }
    }
}
