//! The NCCL backend's CPU-side paths, which every machine can check: no CUDA driver, no NCCL
//! library, a GPU index the machine lacks, an unknown backend name; and that the crates below
//! never pull in cudarc. On a machine with a GPU the driver test checks that a world of one
//! initialises instead. The GPU paths themselves run in `cargo xtask gpu-check`, and the NCCL
//! world test (`nccl_world`, ignored without GPUs) in `cargo xtask test-multigpu`.

use std::time::Duration;

use tensorplay as tp;
use tp::distributed::{self as dist, InitOptions, ReduceOp};
use tp::{DType, Tensor};

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
            "ucc",
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

// ---- the NCCL world: collectives between GPUs, against single-process results ----

/// Rank `r`'s input: deterministic small integers (exact in every dtype and op).
fn values(r: usize, n: usize, salt: usize) -> Vec<f64> {
    (0..n)
        .map(|i| (((r + 1) * 7 + i * 3 + salt) % 5) as f64 - 1.0)
        .collect()
}

fn tensor(v: &[f64], shape: &[usize], dt: DType) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape)
        .and_then(|t| t.to_dtype(dt))
        .expect("tensor")
}

fn as_f64(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().expect("values")
}

/// `op` over the ranks' inputs `xs`, element by element, in one process.
fn reduce_ref(op: ReduceOp, xs: &[Vec<f64>]) -> Vec<f64> {
    let n = xs.len();
    (0..xs[0].len())
        .map(|i| {
            let col = xs.iter().map(|x| x[i]);
            match op {
                ReduceOp::Sum => col.sum(),
                ReduceOp::Avg => col.sum::<f64>() / n as f64,
                ReduceOp::Product => col.product(),
                ReduceOp::Max => col.fold(f64::NEG_INFINITY, f64::max),
                ReduceOp::Min => col.fold(f64::INFINITY, f64::min),
                ReduceOp::BAnd => col.map(|v| v as i64).reduce(|a, b| a & b).unwrap_or(0) as f64,
                ReduceOp::BOr => col.map(|v| v as i64).reduce(|a, b| a | b).unwrap_or(0) as f64,
                ReduceOp::BXor => col.map(|v| v as i64).reduce(|a, b| a ^ b).unwrap_or(0) as f64,
            }
        })
        .collect()
}

fn check(what: &str, got: Vec<f64>, want: Vec<f64>) -> TestResult {
    if got.len() != want.len()
        || got
            .iter()
            .zip(&want)
            .any(|(a, b)| (a - b).abs() > 1e-5 * (1.0 + b.abs()))
    {
        return Err(format!("{what}: got {got:?}, want {want:?}").into());
    }
    Ok(())
}

/// NCCL on GPUs, ignored without them: `cargo xtask test-multigpu` runs it with `--ignored`
/// on machines with GPUs, once per world size up to the GPU count
/// (`TENSORPLAY_TEST_NCCL_WORLD=N`; without it, every GPU this machine has, and an error
/// when it has none). Moved here from `tensorplay-collectives`' multi-process tests.
#[test]
#[ignore = "needs GPUs: cargo xtask test-multigpu"]
fn nccl_world() -> TestResult {
    let n = match std::env::var("TENSORPLAY_TEST_NCCL_WORLD") {
        Ok(v) => v.parse::<usize>()?,
        Err(_) => tp::cuda::device_count(),
    };
    if n == 0 {
        return Err("nccl_world needs GPUs: this machine has none".into());
    }
    dist::spawn(n, move |rank| -> TestResult {
        tensorplay_nccl::register();
        dist::init_process_group(
            "nccl",
            InitOptions {
                timeout: Duration::from_secs(60),
                ..Default::default()
            },
        )?;
        let dev = format!("cuda:{rank}");
        let xs: Vec<Vec<f64>> = (0..n).map(|r| values(r, 1000, 1)).collect();
        for op in [
            ReduceOp::Sum,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Product,
            ReduceOp::Avg,
        ] {
            let t = tensor(&xs[rank], &[1000], DType::F32).to(dev.as_str())?;
            dist::all_reduce(&t, op, None)?;
            check(
                &format!("nccl all_reduce {op:?}"),
                as_f64(&t.cpu()?),
                reduce_ref(op, &xs),
            )?;
        }
        let t = tensor(&values(rank, 10, 2), &[10], DType::F64).to(dev.as_str())?;
        dist::broadcast(&t, 0, None)?;
        check("nccl broadcast", as_f64(&t.cpu()?), values(0, 10, 2))?;
        let out = Tensor::zeros(&[n * 4], DType::F32)?.to(dev.as_str())?;
        dist::all_gather_into_tensor(
            &out,
            &tensor(&values(rank, 4, 3), &[4], DType::F32).to(dev.as_str())?,
            None,
        )?;
        check(
            "nccl all_gather_into_tensor",
            as_f64(&out.cpu()?),
            (0..n).flat_map(|r| values(r, 4, 3)).collect(),
        )?;
        let host = Tensor::zeros(&[2], DType::F32)?;
        assert!(
            dist::all_reduce(&host, ReduceOp::Sum, None).is_err(),
            "a CPU tensor to nccl is refused"
        );
        dist::barrier(None)?;
        dist::destroy_process_group()?;
        Ok(())
    })?;
    Ok(())
}
